// The pskv wire protocol (docs/protocol.md): a fixed 48-byte frame header, then a table of
// 16-byte key entries, then the float payload in key order. Little-endian, as every supported
// host is. Used by the TCP backend for everything and by the RDMA backend for control messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "layout/crc.h"
#include "layout/key_entry.h"
#include "pskv/error.h"
#include "pskv/table.h"

namespace pskv::wire {

inline constexpr std::uint32_t kMagic = 0x564b5350;  // "PSKV"
inline constexpr std::uint16_t kVersion = 5;

enum class Op : std::uint16_t {
  hello =
      1,  // arg0 = worker id (or kNoWorker, or kServerPeer), arg1 = client's protocol version, payload: none or the
          // client's auth nonce; reply arg0 = server id, arg1 = num_workers, or kAuthChallenge (server nonce | proof)
  init = 2,     // keys + values: create keys (first initialiser wins)
  push = 3,     // keys + gradients; arg0 = the worker's clock (the step these gradients belong to)
  pull = 4,     // keys; arg0 = the worker's clock (bound check), reply carries values; reply arg0 = min clock seen
  clock = 5,    // arg0 = the clock the worker now enters; reply arg0 = min clock
  barrier = 6,  // arg0 = barrier generation
  stats = 7,    // reply payload: a JSON document (bytes)
  auth = 8,     // payload: the client's proof; reply as hello's (tcp) or the rdma::Grant (rdma)
  lookup = 9,   // rdma: keys; reply payload: one rdma::LookupEntry (slot offset, length) per key
  wait = 10,    // rdma: arg0 = the worker's clock; answered once a read at that clock may go; reply arg0 = the bound
  // Replication between servers (tcp; docs/protocol.md, "Replication"). arg0 = the origin: the
  // server whose keys these are. A key's record is [update count (2 floats) | value | state].
  replicate = 11,        // keys + records: the origin's state of those keys; arg1 = kReplicaSyncing/kReplicaSynced
                         // with no keys: a full transfer begins / is complete (syncing: arg0's high half is the
                         // origin's incarnation, its start in seconds)
  replica_pull = 12,     // keys (record lengths); reply: their records from this server's replica of the origin
  replica_index = 13,    // reply: text payload, a ReplicaIndex header, one ReplicaIndexEntry per key, then
                         // each worker's clock at the origin, its barrier generation, and 1 if evicted (u64 each)
  replica_clock = 14,    // arg0 = the origin | worker << 32, arg1 = the clock that worker entered at the origin
  replica_barrier = 15,  // arg0 as replica_clock, arg1 = the barrier generation that worker entered there
  replica_evict = 16,    // arg0 as replica_clock, arg1 = 1: the origin evicted that worker (0: it did not)
  // Embedding tables (docs/protocol.md, "Ops"): arg1 = the table id.
  table_create = 17,  // one key (the table id) whose kTableSpecFloats values are the spec's words
  table_pull = 18,    // keys: row ids, each of the table's dimension; arg0 = the worker's clock; reply carries the rows
  table_push = 19,    // keys + gradients, each of the table's dimension; arg0 = the worker's clock; a retrying
                      // client's first key is its identity {session << 32 | seq, length 0} (table_push_identity)
  // Replication of tables (tcp rings; docs/protocol.md, "Replication"). arg0 = the origin | the
  // frame's position in the origin's table stream << 32 (replica_table_rows: the origin alone);
  // arg1 = the table id. A row's record is [value (dim) | optimizer state].
  replica_table = 20,        // one key (the table id) whose kTableSpecFloats values are the origin's spec:
                             // (re)start this replica's copy of it, empty
  replica_rows = 21,         // keys: row ids, each with its record; the origin's rows as they are now
  replica_unrows = 22,       // keys: row ids (length 1, no payload) the origin no longer holds
  replica_table_rows = 23,   // one key {cursor: the row to go on from, length: at most that many rows}; reply:
                             // a text payload, ReplicaRowsHeader, the push marks (u64 each), each row's id
                             // (u64), then their records
  replica_rows_marked = 24,  // as replica_rows, the rows of an identified push; the first key is {worker, 2},
                             // whose value is that worker's push mark (u64) the rows now hold
  // Failover (docs/ARCHITECTURE.md, "Failover"): one key {0, floats} whose values are a DownVote
  // and the holder's URI (encode_down_vote).
  down_vote = 25,       // a server asks for this server's vote on the certificate; ok: granted; an error:
                        // refused, its text says why (stale_resource: the requester itself is down)
  down_certified = 26,  // a server that won a certificate tells this one: record it
  certificates = 27,    // anyone: reply: a text payload, one line "server incarnation holder uri" per
                        // certificate this server knows to have won (encode_certificates)
  hand_back = 28,       // a restarted server (the requester, with its claim as the certificate) asks the
                        // server that holds its keys to give them back; ok: that server is on it
};

inline constexpr std::uint32_t kReplicaSyncing = 1, kReplicaSynced = 2;
// down(server, incarnation, holder): "incarnation `incarnation` (its start, in seconds) of
// `server` may no longer acknowledge anything; its keys are served by `holder`, at `uri`". With
// holder == server, a restarted server's claim to its own keys (it wins only if no other
// holder took them). The requester names itself, so that a voter refuses a server it knows
// to be down.
struct DownVote {
  std::uint32_t server;
  std::uint32_t incarnation;
  std::uint32_t holder;
  std::uint32_t requester;
  std::uint32_t uri_bytes;  // the URI follows, padded to whole floats
  std::uint32_t reserved;
};
struct Certificate {
  std::uint32_t server = 0, incarnation = 0, holder = 0;
  std::string uri;  // where the holder serves the keys (empty in a restarted server's own claim)
  bool operator==(const Certificate&) const = default;
};
inline constexpr std::size_t kMaxCertificateUri = 512;
// The payload of down_vote, down_certified and hand_back (whole floats: one key of that many).
std::vector<float> encode_down_vote(const Certificate& c, std::uint32_t requester);
Errc decode_down_vote(std::span<const KeyEntry> keys, const float* payload, std::uint64_t payload_bytes, Certificate* c,
                      std::uint32_t* requester, std::string* why);
std::string encode_certificates(std::span<const Certificate> certificates);
// certificates' arg0: 0 asks for every certificate (what servers before it took every request
// for), server + 1 for those about that server only (so the answer stays small in a large ring:
// it must fit an rdma control message).
inline std::uint64_t certificates_about(std::uint32_t server) noexcept {
  return std::uint64_t{server} + 1;
}
inline std::uint32_t certificates_of(std::uint64_t arg0) noexcept {
  return arg0 == 0 || arg0 > UINT32_MAX ? UINT32_MAX : static_cast<std::uint32_t>(arg0 - 1);
}
// Strict: a line that is not four fields, a number out of range or a URI that is not tcp:// or rdma:// is
// a protocol error, since a client follows what it reads here.
Errc decode_certificates(std::string_view text, std::vector<Certificate>* out, std::string* why);
// hello's reply: arg0 = the server id | its incarnation (start, seconds) << 32.
inline std::uint64_t hello_reply_arg0(std::uint32_t server_id, std::uint32_t incarnation) noexcept {
  return (std::uint64_t{incarnation} << 32) | server_id;
}
// hello's arg0 from another server of the ring (replication): only such a connection may send
// the replication ops, and on a server with a peer token it must prove that token.
inline constexpr std::uint32_t kServerPeer = 0xFFFFFFFEu;
// replica_index reply: whether this replica holds a complete copy of the origin, then its keys.
struct ReplicaIndexHeader {
  std::uint32_t synced;
  std::uint32_t workers;  // clocks after the entries
  std::uint64_t keys;
};
struct ReplicaIndexEntry {
  std::uint64_t key;
  std::uint64_t length;  // value floats
};
// The reply: header, entries, then `words`: every worker's clock, then every one's barrier
// generation, then whether each was evicted (one word per worker and op of kWorkerWordOps).
std::string encode_replica_index(bool synced, std::span<const std::pair<std::uint64_t, std::uint32_t>> keys,
                                 std::span<const std::uint64_t> words);

enum Flags : std::uint16_t {
  kResponse = 1u << 0,
  kChecksum = 1u << 1,       // `checksum` covers the key table and payload (CRC-32)
  kText = 1u << 2,           // response payload is UTF-8 text: an error message, or the stats JSON
  kAuthChallenge = 1u << 3,  // hello response: authenticate first; payload = server nonce | server proof
  // Pull request: the client takes values sent straight from the store. Pull reply: they were,
  // and a u32 follows the payload: 0 if the values were consistent, else ask again.
  kFromStore = 1u << 4,
};

struct FrameHeader {
  std::uint32_t magic;
  std::uint16_t version;
  std::uint16_t op;
  std::uint64_t request_id;
  std::uint32_t num_keys;
  std::uint16_t flags;
  std::uint16_t status;  // Errc on responses
  std::uint64_t payload_bytes;
  std::uint64_t arg0;
  std::uint32_t arg1;
  std::uint32_t checksum;
};
static_assert(sizeof(FrameHeader) == 48);

using pskv::KeyEntry;  // the key table's entries (layout/key_entry.h)

// Limits every receiver enforces before it allocates anything a frame declares.
struct Limits {
  std::uint32_t max_keys = 1u << 20;
  std::uint64_t max_payload_bytes = 1ull << 30;
};

// Fixed payload sizes of the authentication handshake (transport/auth.h).
inline constexpr std::size_t kAuthNonceBytes = 32, kAuthProofBytes = 32;

// Checks the header alone (magic, version, op, declared sizes against the limits). A request
// must not carry kResponse; a response must. Returns ok or the Errc and a message in *why.
Errc validate_header(const FrameHeader& h, const Limits& limits, bool expect_response, std::string* why);

// Checks the key table against the header: each length > 0, and for ops that carry values the
// payload equals the sum of lengths * 4 (pull requests carry none).
Errc validate_keys(const FrameHeader& h, std::span<const KeyEntry> keys, std::string* why);

// Parses one request frame from the front of `data` (what a receiver has buffered so far).
// need_more: not all of it is here yet (`frame_bytes` says how much it needs once the header
// is known); complete: header, keys (copied to `keys`) and payload (pointed into `data`) are
// valid; bad: the stream cannot be trusted, *status and *why say why. The TCP server and the
// fuzzer share this code.
enum class ParseResult { need_more, complete, bad };
struct ParsedFrame {
  FrameHeader header{};
  std::uint64_t frame_bytes = 0;  // header + key table + payload, once the header was read
  const std::byte* payload = nullptr;
};
ParseResult parse_request(const std::byte* data, std::size_t avail, const Limits& limits, ParsedFrame* out,
                          std::vector<KeyEntry>* keys, Errc* status, std::string* why);

bool op_carries_values(Op op) noexcept;
// Ops whose reply carries one value per key of the request (into the request's slices).
inline bool op_returns_values(Op op) noexcept {
  return op == Op::pull || op == Op::replica_pull || op == Op::table_pull;
}
inline bool op_is_table(Op op) noexcept {
  return op == Op::table_create || op == Op::table_pull || op == Op::table_push;
}
std::string_view op_name(std::uint16_t op) noexcept;
// Ops only another server of the ring may send (it says hello as kServerPeer).
inline bool op_is_replication(Op op) noexcept {
  return op == Op::replicate || op == Op::replica_pull || op == Op::replica_index || op == Op::replica_clock ||
         op == Op::replica_barrier || op == Op::replica_evict || op == Op::replica_table || op == Op::replica_rows ||
         op == Op::replica_unrows || op == Op::replica_table_rows || op == Op::replica_rows_marked ||
         op == Op::down_vote || op == Op::down_certified || op == Op::hand_back;
}
// replica_clock and replica_barrier carry a 64-bit clock or generation in 32 bits: the highest
// (kClockDone, a finished worker) travels as UINT32_MAX, and so would any past it.
inline std::uint32_t worker_word_arg1(std::uint64_t value) noexcept {
  return value >= UINT32_MAX ? UINT32_MAX : static_cast<std::uint32_t>(value);
}
inline std::uint64_t worker_word_value(const FrameHeader& h) noexcept {
  return h.arg1 == UINT32_MAX ? ~std::uint64_t{0} : h.arg1;
}
// The three per-worker words a replica keeps (ShardEngine's WorkerWord, in that order), each
// carried by its op; the ops are consecutive, so a word's index is op - replica_clock.
inline constexpr Op kWorkerWordOps[] = {Op::replica_clock, Op::replica_barrier, Op::replica_evict};
static_assert(static_cast<int>(Op::replica_evict) - static_cast<int>(Op::replica_clock) == 2);
// replica_clock, replica_barrier and replica_evict: the origin in arg0's low half, the worker in
// its high half.
inline std::uint64_t replica_clock_arg0(std::uint32_t origin, std::uint32_t worker) noexcept {
  return (std::uint64_t{worker} << 32) | origin;
}
inline std::uint32_t replica_clock_origin(const FrameHeader& h) noexcept {
  return static_cast<std::uint32_t>(h.arg0);
}
inline std::uint32_t replica_clock_worker(const FrameHeader& h) noexcept {
  return static_cast<std::uint32_t>(h.arg0 >> 32);
}

// An identified push (a retrying client's, docs/protocol.md "push") carries its sequence number in
// arg1 and its client's session in arg0's high half, the clock in the low one; others carry 0 in arg1.
inline std::uint64_t identified_push_arg0(std::uint64_t clock, std::uint32_t session) noexcept {
  return (std::uint64_t{session} << 32) | clock;
}
inline bool push_is_identified(const FrameHeader& h) noexcept {
  return h.arg1 != 0;
}
// A clock, an identified push or a table push is applied before its reply waits for the replicas. Should that
// wait fail, a server closes the request's connection rather than refuse it: a retrying client
// then sends it again (a push's marks say it is applied; a clock only moves forward), where a
// refusal would be an error its worker sees.
inline bool applied_before_replicated(const FrameHeader& h) noexcept {
  const auto op = static_cast<Op>(h.op);
  return op == Op::clock || op == Op::table_push || (op == Op::push && push_is_identified(h));
}
// A retrying client's table_push leads its key table with its identity: {session << 32 | seq,
// length 0}, not a row (the header's args hold the table and the clock). Takes it off `keys`
// and returns it; 0 for a push that carries none.
inline std::uint64_t take_table_push_identity(std::span<const KeyEntry>* keys) noexcept {
  if (keys->empty() || (*keys)[0].length != 0) return 0;
  const std::uint64_t identity = (*keys)[0].key;
  *keys = keys->subspan(1);
  return identity;
}
inline std::uint32_t push_session(const FrameHeader& h) noexcept {
  return push_is_identified(h) ? static_cast<std::uint32_t>(h.arg0 >> 32) : 0;
}
inline std::uint64_t push_clock(const FrameHeader& h) noexcept {
  return push_is_identified(h) ? h.arg0 & 0xFFFFFFFFu : h.arg0;
}

// table_create's value: a TableSpec as 16 32-bit words (floats as their bits, 64-bit fields as
// two words, low first). Decoding checks every enum; check_table_spec the rest.
inline constexpr std::uint32_t kTableSpecFloats = 16;
void encode_table_spec(const TableSpec& spec, float out[kTableSpecFloats]) noexcept;
Errc decode_table_spec(const float in[kTableSpecFloats], TableSpec* spec, std::string* why);
// A table_create request as every backend takes it: its one key (the table id, below
// kMaxTables) and the spec its value encodes. protocol for the wrong shape, invalid_argument
// for an id or spec out of range, with *why.
Errc decode_table_create(std::span<const KeyEntry> keys, const float* payload, std::uint32_t* table, TableSpec* spec,
                         std::string* why);

// Where a table frame sits in its origin's table stream (arg0 >> 32): replicas apply that stream
// in order, and a rejoining origin takes its tables from the replica furthest along it.
inline std::uint64_t replica_table_arg0(std::uint32_t origin, std::uint32_t position) noexcept {
  return (std::uint64_t{position} << 32) | origin;
}
struct ReplicaRowsHeader {
  std::uint32_t exists;    // 0: this replica holds no such table of the origin (nothing follows)
  std::uint32_t position;  // how far along the origin's table stream the replica is
  std::uint32_t next;      // the cursor to go on from, 0 once every row was sent
  std::uint32_t rows;
  std::uint32_t record_floats;
  std::uint32_t synced;          // 1 if the replica holds every key and row of the origin
  std::uint64_t max_rows;        // the table's cap at the origin
  float spec[kTableSpecFloats];  // the spec it was created with
  std::uint32_t marks;           // push marks (u64 each, one per worker or none) after this header
  std::uint32_t epoch;           // the origin's incarnation (start, seconds) that transferred to the copy
};
static_assert(sizeof(ReplicaRowsHeader) == 104);

// The optional checksum (flag kChecksum) is layout/crc.h's CRC-32.
using pskv::crc32_update;

inline FrameHeader make_header(Op op, std::uint64_t id, std::uint32_t num_keys, std::uint64_t payload_bytes,
                               std::uint64_t arg0 = 0, std::uint32_t arg1 = 0) {
  return FrameHeader{kMagic, kVersion, static_cast<std::uint16_t>(op), id, num_keys, 0, 0, payload_bytes, arg0,
                     arg1,   0};
}

}  // namespace pskv::wire
