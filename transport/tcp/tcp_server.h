// Server side of the TCP backend: an event loop where no peer can hold a thread.
//
// Every socket is non-blocking and every connection is a state machine (tcp_server.cc, Peer)
// with bounded buffers in both directions. epoll with EPOLLONESHOT hands each ready connection
// to one of a few I/O threads at a time, so a connection's requests are handled in order (a
// worker's pushes are applied before its clock moves) while different connections run in
// parallel. A thread serves what has arrived and hands the connection back to epoll the moment
// the peer has nothing more for it (after a short spin in the middle of a large frame), so a slow
// sender costs its own buffer and nothing else. A reply the peer does not take stays queued on
// its connection, which is not read again until it is gone: a peer that never reads holds one
// reply, not a thread. Pulls that must wait for the consistency bound are parked in the engine
// and answered later by whichever thread moves the bound.
//
// What bounds each peer, all in TcpServerOptions (docs/ARCHITECTURE.md, "Hostile peers"):
// - time: a deadline per frame in each direction, a deadline for the handshake, and TCP
//   keepalive for a worker that is merely silent (idleness alone never closes a connection);
// - memory: one fixed receive buffer per connection; larger frames and copied replies draw on a
//   server-wide budget, sized from what a request declares and implies before anything is
//   allocated; before the handshake nothing larger than a hello is accepted;
// - count: connections in all and per peer address, and pulls parked per connection.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/shard_engine.h"
#include "transport/auth.h"
#include "transport/tcp/socket.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv::tcp {

struct TcpServerOptions {
  std::uint32_t io_threads = 2;
  std::uint32_t max_connections = 1024;
  // Connections from one IP address; more are refused. When the table is full, the oldest
  // connection that has not finished its handshake makes room for a new one.
  std::uint32_t max_connections_per_address = 256;
  // A frame must be transferred whole within this plus 1 s per kFrameBytesPerSecond of its
  // size, counted from its first byte (requests) or from when it was queued (replies).
  std::chrono::milliseconds frame_timeout{5000};
  // From accept until hello (and the token challenge) is done.
  std::chrono::milliseconds handshake_timeout{5000};
  // Frame buffers and copied replies of all connections together; a request that would need
  // more is answered `capacity` once its payload has been read and dropped.
  std::uint64_t memory_budget_bytes = 1ull << 30;
  wire::Limits limits{};
  // A push frame larger than a connection's receive buffer is applied as it arrives: each key of
  // up to kPushPieceFloats once all of it is in, a longer one in pieces of whatever has come in
  // (at most kPushPieceFloats, and while more keeps coming, at least kPushLeastFloats or the
  // key's rest). The value is never staged whole and is applied while still in cache, but
  // such a key is atomic per piece only, and a frame cut short leaves the pieces before the cut
  // applied. false: staged whole, then applied atomically per key (as checksummed and sync-mode
  // pushes always are).
  bool push_in_pieces = true;
  // When set, every connection must pass the HMAC challenge before anything else is served.
  std::shared_ptr<const auth::Token> token;
  // The token a connection that says it is a server (wire::kServerPeer) must prove instead;
  // null: `token`. Only such connections may send the replication ops.
  std::shared_ptr<const auth::Token> peer_token;
};

class Peer;
struct Reply;

// Bytes that frame buffers, copied replies and parked requests of all connections may hold
// together. Thread-safety: any thread.
class MemoryBudget {
 public:
  explicit MemoryBudget(std::uint64_t limit) : limit_(limit) {}
  // Takes `bytes` if they fit.
  bool take(std::uint64_t bytes) noexcept;
  void give(std::uint64_t bytes) noexcept {
    if (bytes) used_.fetch_sub(bytes, std::memory_order_relaxed);
  }
  std::uint64_t used() const noexcept { return used_.load(std::memory_order_relaxed); }
  std::uint64_t limit() const noexcept { return limit_; }

 private:
  const std::uint64_t limit_;
  std::atomic<std::uint64_t> used_{0};
};

// Bytes taken from a MemoryBudget, given back when the hold is destroyed or reset, on every path
// (an exception included). Thread-safety: one owner at a time.
class BudgetHold {
 public:
  BudgetHold() = default;
  BudgetHold(BudgetHold&& o) noexcept : budget_(o.budget_), bytes_(std::exchange(o.bytes_, 0)) {}
  BudgetHold& operator=(BudgetHold&& o) noexcept {
    if (this != &o) {
      reset();
      budget_ = o.budget_;
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~BudgetHold() { reset(); }
  // Adds `bytes` to the hold if the budget has them.
  bool take(MemoryBudget& budget, std::uint64_t bytes) noexcept {
    if (budget_ && budget_ != &budget) return false;
    if (!budget.take(bytes)) return false;
    budget_ = &budget;
    bytes_ += bytes;
    return true;
  }
  void reset() noexcept {
    if (budget_) budget_->give(std::exchange(bytes_, 0));
  }
  std::uint64_t bytes() const noexcept { return bytes_; }

 private:
  MemoryBudget* budget_ = nullptr;
  std::uint64_t bytes_ = 0;
};

// Thread-safety: construct, stop and destroy from one thread; stats_fields() from any thread;
// everything else is internal.
class TcpServer {
 public:
  TcpServer(ShardEngine& engine, const Uri& uri, const TcpServerOptions& options);
  ~TcpServer();
  TcpServer(const TcpServer&) = delete;
  TcpServer& operator=(const TcpServer&) = delete;

  std::uint16_t port() const noexcept { return port_; }
  // The stop, in the order transport::Listener runs it: no new connection is accepted; then no
  // request is read or applied any more (the I/O threads are joined; parked requests stay parked
  // for the engine's shutdown to answer, on the calling thread); then every connection is closed.
  void stop_accepting() noexcept;
  void drain() noexcept;
  void close() noexcept;
  std::uint64_t connections_refused() const noexcept { return refused_.load(); }
  // ,"name":value pairs for the stats document: connections, refusals, deadline closes, budget.
  JsonObject stats_fields() const;
  // The largest piece a push is applied in (a whole receive buffer, 256 KiB): smaller pieces
  // cost more receive calls, larger ones fall out of L2 before they are applied.
  static constexpr std::size_t kPushPieceFloats = 64u << 10;
  // The smallest piece (16 KiB) applied while more of the key is waiting to be read. A piece is
  // applied as soon as this much is in, not once a whole kPushPieceFloats is: the server keeps up
  // with the sender, so waiting for full pieces left a 256 KiB apply (8 us) between a push's last
  // byte and its reply, a tenth of a 1 MiB push's time with one in flight.
  static constexpr std::size_t kPushLeastFloats = 4u << 10;
  // The slowest transfer rate a frame's deadline allows for beyond frame_timeout: slow enough
  // that a server busy with other connections does not time out a peer it is itself not
  // reading fast enough, far too fast for a trickle to hold a frame open.
  static constexpr std::uint64_t kFrameBytesPerSecond = 16ull << 20;
  // Pulls (and barriers) one connection may have parked; past it the connection is not read
  // until one is answered. A client keeps at most max_in_flight requests anyway.
  static constexpr std::uint32_t kMaxParkedPerConnection = 256;
  // What one thread reads from one connection before it serves the others: 4 MiB, about 1 ms
  // at loopback rates, against a few microseconds to hand the connection back to epoll.
  static constexpr std::uint64_t kTurnBytes = 4u << 20;

 private:
  friend class ParkedRequest;
  enum class Progress { done, need_more, close };

  void io_loop();
  void accept_ready();
  // Sends a `capacity` error frame on a connection refused at accept.
  void refuse_at_accept(int fd, const std::string& text);
  // Out of descriptors: accepts one pending connection through the spare descriptor, tells it
  // why and closes it. False if there was none to take.
  bool shed_one_connection();
  void raise_fd_limit();
  void reap_expired();
  // Whether the server has stopped reading this connection (its replies are queued, or too many
  // of its pulls are parked); if so, the frame it holds half-read gets a fresh deadline.
  bool reading_paused(Peer& peer);
  // Serves what has arrived on a connection this thread owns; false: close it.
  bool serve(Peer& peer);
  bool serve_buffered(Peer& peer, bool* progressed);
  // Each returns false when the connection must be closed.
  bool handle(Peer& peer, const wire::FrameHeader& h, const float* payload);
  bool before_handshake(Peer& peer, const wire::FrameHeader& h);
  bool admit(Peer& peer, const wire::FrameHeader& h);
  // `owner`: called by the connection's owner, which may answer small pulls from peer.reply.
  // table_create, table_pull and table_push (docs/protocol.md, "Ops").
  bool handle_table(Peer& peer, const wire::FrameHeader& h, const float* payload);
  // replica_table_rows: a page of this server's copy of an origin's table (a rejoin reads them).
  bool answer_table_rows(Peer& peer, const wire::FrameHeader& h);
  bool answer_table_pull(Peer& peer, const wire::FrameHeader& h);
  // The bytes of a reply holding `keys`' values: capacity (logged, with *why naming `what` to
  // pull fewer of) past the request limit.
  Errc reply_size(const Peer& peer, std::span<const wire::KeyEntry> keys, const char* what, std::uint64_t* bytes,
                  std::string* why);
  // Sends `r` with `bytes` of values at `payload` (and their checksum when the request had one).
  bool send_values(Peer& peer, const wire::FrameHeader& h, Reply&& r, const float* payload, std::uint64_t bytes);
  // Where a reply of `bytes` values is built: the connection's own buffer for its owner when it
  // fits, else memory of the reply's own, charged to the budget (capacity, with *why, if over).
  Errc reply_buffer(Peer& peer, Reply& r, std::uint64_t bytes, bool owner, const char* what, float** out,
                    std::string* why);
  bool answer_pull(Peer& peer, const wire::FrameHeader& h, std::span<const wire::KeyEntry> keys, bool owner);
  // Finds a pull's keys and sizes its reply from the store's records (*bytes), refusing one over
  // the request limit; counts nothing.
  Errc check_pull(const Peer& peer, std::span<const wire::KeyEntry> keys, std::vector<SlotRef>& slots,
                  std::uint64_t* bytes, std::string* why);
  // A pull or barrier to answer later (counted against kMaxParkedPerConnection until it is, and
  // its parked_bytes against the memory budget); null if the budget cannot hold it.
  std::unique_ptr<Parked> park(Peer& peer, const wire::FrameHeader& h, std::vector<wire::KeyEntry> keys,
                               bool charge = true);
  static std::uint64_t parked_bytes(std::size_t keys) noexcept;
  // The reply to an init or push that was applied: at once, or once every live replica holds its
  // keys (--replicas).
  bool answer_applied(Peer& peer, const wire::FrameHeader& h);
  // Room for an init or push's records on their way to the replicas, taken before it is applied
  // (always true without --replicas); false: refuse it, nothing applied.
  // Replicator::reserve for the peer's keys (true without replicas); logs a refusal.
  bool reserve_for_replicas(Peer& peer, bool creating, std::string* why);
  // replica_pull: the records of peer.keys from the replica of the origin (h.arg0).
  bool answer_records(Peer& peer, const wire::FrameHeader& h);
  // Below this a pull reply is copied: the copy is cheap and the extra trailer write is not.
  static constexpr std::uint64_t kFromStoreBytes = 64u << 10;
  bool send_from_store(Peer& peer, const wire::FrameHeader& h, std::span<const wire::KeyEntry> keys,
                       std::span<const SlotRef> slots, std::uint64_t floats);
  // A frame larger than the receive buffer, in its stages.
  bool begin_large_frame(Peer& peer, const wire::FrameHeader& h);
  Progress continue_large_frame(Peer& peer);
  Progress stream_push(Peer& peer);
  bool streams(const Peer& peer, const wire::FrameHeader& h) const noexcept;
  // Reads more of a large frame from the socket: the bytes, 0 if nothing came (after the spin
  // and a fast sender's wait, unless !wait) or this thread's turn is used up, -1 if the
  // connection closed or failed.
  ssize_t read_frame_bytes(Peer& peer, char* dst, std::size_t bytes, bool wait = true);
  // Whether `in` holds a whole request (or a header that decides the connection's fate).
  static bool whole_frame_buffered(const Peer& peer);
  // Whether more of a large frame arrived after this thread waited for it (only for a peer that
  // sent the frame so far at kFastSenderBytesPerSecond or more, for kFastSenderPatienceMs).
  bool await_fast_sender(Peer& peer);
  static constexpr double kFastSenderBytesPerSecond = 256.0 * (1 << 20);
  static constexpr int kFastSenderPatienceMs = 1;
  // Logs and refuses a peer that did not authenticate; always false (close the connection).
  bool refuse(Peer& peer, const wire::FrameHeader& h, const std::string& what);
  // The token this peer must prove: the peer token for a server, when there is one.
  const auth::Token* token_for(const Peer& peer) const noexcept;
  // Logs a malformed frame and answers it if its magic says it is ours; always false (close).
  bool bad_frame(Peer& peer, const wire::FrameHeader& h, Errc status, const std::string& why);
  // Counts and logs a request the memory budget cannot hold; returns the answer to give it.
  std::string over_budget(const Peer& peer, std::uint64_t bytes, const std::string& what);

  // Replies. send() writes at once what the socket takes and queues the rest.
  bool send(Peer& peer, Reply&& reply);
  bool send_error(Peer& peer, const wire::FrameHeader& req, Errc status, const std::string& why);
  bool send_empty(Peer& peer, const wire::FrameHeader& req, std::uint64_t arg0 = 0, std::uint32_t arg1 = 0);
  // Writes queued replies; false when the peer is gone. Caller holds peer.mu.
  bool flush_locked(Peer& peer);
  // Hands the connection back to epoll with the interest its state calls for. From the owner
  // (release) or from another thread when the connection is idle in epoll (poke).
  void release(Peer& peer);
  void poke(Peer& peer);
  // What the connection's state asks epoll for (caller holds peer.mu): EPOLLOUT while replies
  // are queued, EPOLLIN unless reading is paused. armed_locked() adds what re-arming needs.
  std::uint32_t interest_locked(const Peer& peer) const;
  std::uint32_t armed_locked(const Peer& peer) const;

  void close_peer(Peer& peer, const std::string& reason);
  // Closes a connection another thread may own: shuts the socket so its owner sees the end.
  void expire(Peer& peer, const std::string& reason);
  void expire_locked(Peer& peer, const std::string& reason);  // caller holds peer.mu
  std::chrono::nanoseconds frame_deadline(std::uint64_t bytes) const noexcept;

  ShardEngine& engine_;
  TcpServerOptions options_;
  Fd listen_fd_;
  Fd epoll_fd_;
  Fd wake_fd_;
  std::mutex spare_mu_;
  Fd spare_fd_;  // kept open to be given up when the process runs out of descriptors
  std::uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> accepting_{true};
  std::atomic<std::uint64_t> refused_{0}, expired_{0}, over_budget_{0}, turns_yielded_{0};
  MemoryBudget budget_;
  std::atomic<std::int64_t> next_reap_ns_{0};
  std::mutex reap_mu_;
  mutable std::mutex peers_mu_;
  std::unordered_map<int, std::shared_ptr<Peer>> peers_;
  std::unordered_map<std::string, std::uint32_t> per_address_;
  std::vector<std::thread> threads_;
};

}  // namespace pskv::tcp
