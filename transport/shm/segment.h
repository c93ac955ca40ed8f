// The shared-memory segment of one shm:// server: header, clock table, one request ring per
// client, and the store region, all in one Boost.Interprocess shared_memory_object.
//
//   SegmentHeader | ClockTable | ClientArea x clients (ring + data area each) | Store region
//
// Clients pull straight from the store region under the seqlock. Pushes are applied by the
// client itself under the stripe lock, with an undo record in its area that the server's
// watchdog rolls back if the client is killed mid-way (or, with worker_push off, they go through
// the ring like everything else). Everything else that changes state (init, clock, barrier)
// goes through the client's own ring and is applied by the server in ring order; a client
// applies a push itself only once its earlier ring requests are answered, so a worker's clock
// never becomes visible before its pushes are applied.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/memory.h"
#include "common/sync.h"
#include "pskv/error.h"
#include "pskv/types.h"
#include "store/store.h"
#include "transport/wire.h"

namespace boost::interprocess {
class mapped_region;
}

namespace pskv::shm {

inline constexpr std::uint32_t kRingEntries = 256;
inline constexpr std::uint32_t kMaxServerThreads = 16;
inline constexpr std::size_t kEntryText = 160;

// One request in a client's ring. The client fills it and publishes it by advancing `head`;
// the server answers in place and publishes by advancing `done`.
struct alignas(64) RingEntry {
  std::uint64_t seq;
  std::uint16_t op;
  std::uint16_t table;  // table ops: the table id (below 64)
  std::uint32_t num_keys;
  std::uint64_t arg0;
  std::uint64_t data_offset;  // into the area's data part: key table, then payload (table_pull: the rows)
  std::uint64_t payload_bytes;
  // Response.
  std::uint32_t status;    // Errc
  std::uint32_t text_len;  // error text (or stats JSON) at data_offset, up to data_bytes
  std::uint64_t reply_arg0;
  std::uint64_t data_bytes;  // bytes reserved at data_offset
};

inline constexpr std::int32_t kClaimingArea = -1;  // owner_pid while a client fills in its identity
// owner_pid of an area whose client left while the server still owed it answers: the server
// serves what it published, then its watchdog frees the area.
inline constexpr std::int32_t kLeavingArea = -2;

struct alignas(64) ClientArea {
  std::atomic<std::int32_t> owner_pid;  // 0: free; kClaimingArea: being claimed; kLeavingArea
  std::uint32_t worker_id;
  std::uint64_t owner_start;                    // owner's start time, so a reused pid is not mistaken
  alignas(64) std::atomic<std::uint64_t> head;  // last published seq (client)
  alignas(64) std::atomic<std::uint64_t> done;  // last answered seq (server)
  std::atomic<std::uint32_t> done_word;         // futex: bumped on every answer and clock change
  std::atomic<std::uint32_t> client_sleeping;
  std::atomic<std::uint32_t> client_polling;  // waiters reading `done` themselves: no wake needed
  std::atomic<std::uint32_t> waits_on_clock;  // the client has pulls parked on the bound
  // Client threads asleep on waiter_word, waiting for an answer themselves rather than through
  // the helper: the server then wakes them directly, one hand-off instead of two.
  std::atomic<std::uint32_t> waiters_sleeping;
  std::atomic<std::uint32_t> waiter_word;  // futex: bumped on an answer while waiters sleep
  // A push the client applies itself (SegmentHeader::worker_push): how far it got, for the
  // watchdog to roll back if the client dies holding a stripe lock. Its undo buffer is the
  // front of the area's data part, which the ring does not use meanwhile.
  alignas(64) UndoRecord undo;
  std::atomic<std::uint64_t> worker_pushes;  // keys this area's clients applied themselves
  alignas(64) RingEntry ring[kRingEntries];
};

struct alignas(64) SegmentHeader {
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::int32_t server_pid;
  std::uint64_t server_start;  // /proc start time of the server process
  std::uint64_t job_nonce;     // random per server start
  std::uint32_t num_workers;
  std::uint32_t clients;
  std::uint32_t server_threads;
  std::uint8_t mode;         // ConsistencyMode
  std::uint8_t worker_push;  // 1: clients apply their own pushes under the stripe locks
  std::uint8_t reserved8[2];
  std::uint32_t staleness;
  std::uint32_t sync_required;
  std::uint32_t wait_timeout_ms;
  std::uint64_t area_bytes;
  std::uint64_t clock_offset, areas_offset, area_stride, store_offset, store_bytes, total_bytes;
  std::uint64_t server_undo_offset, server_undo_bytes;
  alignas(64) std::atomic<std::uint32_t> ready;  // 1 once the server finished laying out
  // The server's stop: 0 once it no longer accepts clients (new ones are refused an area); `closing`
  // 1 once it drains, after which no client may apply a push itself (the server's final
  // checkpoint must hold every push acknowledged before it). Both only ever change this way.
  std::atomic<std::uint32_t> accepting;
  std::atomic<std::uint32_t> closing;
  alignas(64) std::atomic<std::uint32_t> doorbell[kMaxServerThreads];
  std::atomic<std::uint32_t> server_sleeping[kMaxServerThreads];
  // Client threads spinning on their areas, over all client processes: spinning is only worth
  // it while a core is left for the server (ShmConnection::begin_polling).
  alignas(64) std::atomic<std::uint32_t> spinners;
  alignas(64) std::atomic<std::uint64_t> recovered_pushes;  // rolled back after their client died
  // A push a server thread applies (the ring path) is logged like a client's own, so that a
  // successor can roll it back if the server dies inside it (shm://NAME?adopt=1); the buffers
  // follow the store (SegmentGeometry::server_undo_offset).
  alignas(64) UndoRecord server_undo[kMaxServerThreads];
};

// Wakes the area's client threads asleep on waiter_word, if any; true if there were. Callers
// fence (seq_cst) between what they published and this, pairing with the sleeper's fence in
// ShmConnection::sleep_for_answers.
inline bool wake_waiter_word(ClientArea& s) noexcept {
  if (s.waiters_sleeping.load(std::memory_order_seq_cst) == 0) return false;
  s.waiter_word.fetch_add(1, std::memory_order_release);
  futex_wake_all(&s.waiter_word);
  return true;
}

// The stripe-lock owner tag of the clients of area i (SharedMutex::kAnonymousOwner is the server),
// and back.
inline std::uint32_t area_owner_tag(std::uint32_t area) noexcept {
  return area + 2;
}
inline std::uint32_t owner_tag_area(std::uint32_t tag) noexcept {
  return tag - 2;
}
// The tag of server thread t: its locks are released by the successor that adopts the segment.
inline std::uint32_t server_thread_owner_tag(std::uint32_t t) noexcept {
  return 8192 + t;
}

struct SegmentConfig {
  std::uint32_t num_workers = 0;
  std::uint32_t clients = 64;
  std::uint32_t server_threads = 1;
  std::uint64_t area_bytes = 32ull << 20;
  std::uint64_t store_bytes = 0;
  // The server logs the pushes it applies (ring path), so that a successor can roll back the one
  // its death cuts short (adopt=1); state_per_value (optimizer-state floats per value float)
  // sizes the undo buffers.
  bool server_undo = false;
  std::uint32_t state_per_value = 0;
  ConsistencyMode mode = ConsistencyMode::asp;
  bool worker_push = true;
  std::uint32_t staleness = 0, sync_required = 0, wait_timeout_ms = 10000;
};

// Decodes a ring entry the client wrote (the client may be hostile or half-dead, so every
// field is checked against the area's data part before use). On success fills `keys` and
// `payload` (pointing into `area`) and `op`, the op that was validated: callers must use it, not
// re-read e.op, which the client could change in between. Shared by the server and the fuzzer.
Errc decode_entry(const RingEntry& e, const std::byte* area, std::uint64_t area_bytes,
                  std::vector<wire::KeyEntry>* keys, const float** payload, wire::Op* op, std::string* why,
                  std::uint64_t* data_bytes_out = nullptr);

// Process identity that survives pid reuse: pid plus its start time.
std::uint64_t process_start_time(pid_t pid);
bool process_alive(pid_t pid, std::uint64_t start_time);

// The segment's layout and the job's settings as the server laid them out. The server fills it
// from its own configuration and a client from the header once, checked against the mapping, at
// open; neither reads the header's copy again, since any process of the job's user can rewrite
// it (a raised client count or data size must not move the server's or another client's accesses).
struct SegmentGeometry {
  std::uint32_t num_workers = 0, clients = 0, server_threads = 1;
  std::uint64_t area_bytes = 0;
  std::uint64_t clock_offset = 0, areas_offset = 0, area_stride = 0, store_offset = 0, store_bytes = 0, total_bytes = 0;
  // One undo buffer per server thread, after the store: a ring push's value and its state
  // (server_undo_bytes 0: the server does not log its pushes).
  std::uint64_t server_undo_offset = 0, server_undo_bytes = 0;
  ConsistencyMode mode = ConsistencyMode::asp;
  bool worker_push = false;
  std::uint32_t staleness = 0, sync_required = 0, wait_timeout_ms = 0;
  std::int32_t server_pid = 0;
  std::uint64_t server_start = 0;
};

// A mapped segment. Thread-safety: the mapping and its geometry are immutable; the contents are
// shared state whose own types (atomics, seqlocks) make them safe.
class Segment {
 public:
  // Server: creates "/pskv-<name>" with mode 0600. A leftover from a dead server is reclaimed;
  // one owned by a live server is an error naming its pid.
  static std::unique_ptr<Segment> create(const std::string& name, const SegmentConfig& config);
  // Client: opens an existing segment and checks that its server is alive.
  static std::unique_ptr<Segment> open(const std::string& name);
  // A successor (shm://NAME?adopt=1): the segment a dead server left under `name`, checked as
  // open() checks it; nullptr when there is none. One whose server still runs is an error.
  static std::unique_ptr<Segment> open_left_by_dead_server(const std::string& name);
  ~Segment();

  // The shared header: for its atomics (doorbells, counters). Its layout fields are for
  // display only; addresses, sizes and counts come from geometry().
  SegmentHeader& header() noexcept { return *reinterpret_cast<SegmentHeader*>(base_); }
  const SegmentGeometry& geometry() const noexcept { return geo_; }
  void* clock_memory() noexcept { return base_ + geo_.clock_offset; }
  // i < geometry().clients.
  ClientArea& area(std::uint32_t i) noexcept {
    return *reinterpret_cast<ClientArea*>(base_ + geo_.areas_offset + std::uint64_t{i} * geo_.area_stride);
  }
  std::byte* area_data(std::uint32_t i) noexcept { return reinterpret_cast<std::byte*>(&area(i)) + sizeof(ClientArea); }
  // t < geometry().server_threads: server thread t's undo buffer, server_undo_bytes long.
  float* server_undo_buffer(std::uint32_t t) noexcept {
    return reinterpret_cast<float*>(base_ + geo_.server_undo_offset + std::uint64_t{t} * geo_.server_undo_bytes);
  }
  // A non-owning view of the store region, valid while this Segment lives.
  std::unique_ptr<MemoryResource> store_memory();
  const std::string& name() const noexcept { return name_; }
  // The server that laid the segment out still runs and has not stopped serving it. Decided
  // from the pid and start time read at open, not the header's words (a forged pid must not
  // make a client give up on a live server): a stopped server zeroes its pid in the header and
  // removes the name, and only both together count.
  bool server_alive();
  // Removes the name (server, at exit); existing mappings stay valid until unmapped.
  void remove();
  // The inode of the object this segment mapped: a name in /dev/shm holds it only while nobody
  // renamed another object there.
  ino_t inode() const noexcept { return inode_; }

 private:
  Segment() = default;
  static std::unique_ptr<Segment> open_checked(const std::string& name, bool server_must_live);
  std::string name_;
  SegmentGeometry geo_;
  std::unique_ptr<boost::interprocess::mapped_region> region_;  // unmapped with the Segment
  std::byte* base_ = nullptr;                                   // region_'s address
  bool owner_ = false;
  ino_t inode_ = 0;  // of /dev/shm/<object> when mapped: the name may be reused by a later server
};

std::string segment_object_name(const std::string& name);

}  // namespace pskv::shm
