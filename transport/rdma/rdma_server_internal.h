// Internals shared by the RDMA server's control path (rdma_server.cc: listening, accepting,
// teardown) and its hot path (rdma_server_io.cc: completions, message handling, replies).
#pragma once

#include <deque>

#include "transport/rdma/rdma_protocol.h"
#include "transport/rdma/rdma_server.h"

namespace pskv::rdma {

// Rows a reply RDMA WRITEs into the client's memory before its SEND.
struct RowsOut {
  const std::byte* data;
  std::uint64_t bytes;
  std::uint32_t lkey;
  RowsTarget target;
};

// A reply that found no free reply buffer: its frame, copied, and the rows it carries.
struct UnsentReply {
  std::string frame;
  bool has_rows = false;
  RowsOut rows{};
};

// One client connection. Created by the rdma_cm thread before it accepts; from then on its
// verbs objects and buffers belong to its owning completion thread, which alone posts to the
// queue pair and releases everything (release()) when the connection ends. Parked replies and
// the rdma_cm thread keep it alive through shared_ptr, but only look at `closed`.
class ServerConn : public std::enable_shared_from_this<ServerConn> {
 public:
  ~ServerConn() { release(); }
  // Queue pair, completion queues, then the memory they used. Idempotent; owner thread.
  void release();

  rdma_cm_id* id = nullptr;
  IoThread* owner = nullptr;
  std::uint32_t depth = 0;           // receive buffers = the client's credits; twice as many reply buffers
  std::uint64_t max_write = 0;       // bytes per RDMA WRITE of a table_pull's rows
  std::uint32_t wrs_per_reply = 1;   // send queue entries a reply may take: its SEND and those WRITEs
  std::uint32_t worker = kNoWorker;  // set once admitted (at accept, or after the challenge)
  std::uint32_t hello_worker = kNoWorker;
  // Connected as another server of the ring (wire::kServerPeer): may send the replication ops.
  bool server_peer = false;
  // Which connection a replica's frames came on (ShardEngine::mark_replica): the accept count
  // in the high half, as a tcp connection's tag has its generation there.
  std::uint64_t tag = 0;
  const auth::Token* token = nullptr;  // what it must prove (the server's; null: nothing)
  // With a token: nothing but AUTH is served until the client's proof matched.
  std::atomic<bool> authenticated{false};
  auth::Nonce client_nonce{}, server_nonce{};
  Grant grant{};        // the remote keys, withheld until authenticated
  std::string address;  // the peer's host:port, for the log
  std::string host;     // the peer's IP address: --max-connections-per-address
  // Bytes charged to the server's pinned budget for this connection's buffers, given back (to
  // `pinned_total`) by release().
  std::uint64_t pinned = 0;
  std::shared_ptr<std::atomic<std::uint64_t>> pinned_total;
  // With a token: closed if not authenticated by then (--handshake-timeout-ms).
  std::chrono::steady_clock::time_point handshake_deadline{};
  bool finished = false;  // the worker announced clock = done, so leaving is clean
  std::atomic<bool> closed{false};
  // Its requests waiting in the engine (a wait, barrier or replicated clock), up to `depth`: a
  // client never has more requests out than its credits, and the server re-posts a receive
  // before it serves the one it took, so nothing else bounds what a peer parks.
  std::atomic<std::uint32_t> parked{0};
  ibv_cq* send_cq = nullptr;
  ibv_cq* recv_cq = nullptr;
  ibv_qp* qp = nullptr;
  RegisteredBuffer recv;    // depth x kControlBytes
  RegisteredBuffer send;    // 2 x depth x kControlBytes
  RegisteredBuffer region;  // the client WRITEs its pushes here
  std::vector<std::uint32_t> free_send;
  // Replies waiting for a reply buffer, oldest first. A client that takes no replies (posts no
  // receives) leaves every SEND unacknowledged; its replies wait here rather than in the thread,
  // nothing more of its requests is read meanwhile, and it is closed once none has left for
  // RdmaServerOptions::reply_timeout. Since `unsent_since`: when the queue last moved.
  std::deque<UnsentReply> unsent;
  std::chrono::steady_clock::time_point unsent_since{};
  // Closed, its queue pair kept until its last replies left (an error reply says why it was
  // closed) or `linger_until` passed.
  std::chrono::steady_clock::time_point linger_until{};
  std::vector<wire::KeyEntry> keys;  // scratch: a request's key table, copied out of client memory
  std::vector<LookupEntry> lookups;
  // Stats texts the client is reading in pages (a reply is one SEND of kControlBytes), by the
  // request id they are read under: each cut from the text as it was when its first page was
  // asked for, dropped once its last page is sent; the oldest goes past kStatsReadings.
  struct StatsReading {
    std::uint64_t request_id;
    std::string text;
  };
  static constexpr std::size_t kStatsReadings = 4;
  std::deque<StatsReading> stats_readings;
};

// A completion thread and the connections it owns.
// Thread-safety: adopt/request_close/defer/wake from any thread; the rest on the thread itself
// (or, after stop_and_join(), on the stopping thread).
class IoThread {
 public:
  IoThread(RdmaServer& server, ibv_context* ctx);
  ~IoThread();
  ibv_comp_channel* channel() const noexcept { return channel_; }
  void start();
  void adopt(const std::shared_ptr<ServerConn>& conn);
  void request_close(const std::shared_ptr<ServerConn>& conn);
  // A reply for a parked request; sent by this thread unless the connection closed meanwhile.
  void defer(const std::shared_ptr<ServerConn>& conn, const wire::FrameHeader& request, Errc status, std::string why);
  void stop_and_join();
  // After stop_and_join(): closes every connection, then (call until true) lets their last
  // replies leave, for all threads against one deadline; `now_or_never` finishes them at once.
  void close_all();
  bool linger_out(bool now_or_never);

 private:
  struct Deferred {
    std::shared_ptr<ServerConn> conn;
    wire::FrameHeader request;
    Errc status;
    std::string why;
  };
  void wake();
  void loop();
  // Drains a connection's CQs up to a budget; true if completions may remain.
  bool process(ServerConn& c);
  bool process_or_close(ServerConn& c);  // process(), with a throw closing c
  void close_after_failure(ServerConn& c, const std::exception& e) noexcept;
  // False (and why) when c already has as many requests parked as its credits.
  bool may_park(const ServerConn& c, const wire::FrameHeader& h, std::string* why) const;
  int drain(ServerConn& c);
  void on_recv(ServerConn& c, const ibv_wc& wc);
  bool handle_control(ServerConn& c, std::uint32_t buffer, std::uint32_t bytes);
  // A message the client wrote into its receive region: push, init, or a table op.
  bool handle_region_message(ServerConn& c, std::uint32_t imm);
  bool apply_push(ServerConn& c, const wire::FrameHeader& h, const float* values);
  // table_pull, replica_pull, replica_index: the answer goes into the room the request left
  // (`left`: what the region has after its key table) and from there to the client's RowsTarget.
  bool answer_into_room(ServerConn& c, const wire::FrameHeader& h, std::byte* room, std::uint64_t left);
  // Permission refused, the connection closed: a replication op from a client.
  bool refuse_replication(ServerConn& c, const wire::FrameHeader& h);
  bool dispatch(ServerConn& c, const wire::FrameHeader& h);
  // Checks the client's proof; on success admits the worker and replies with the Grant.
  bool authenticate(ServerConn& c, const wire::FrameHeader& h, const auth::Proof& proof);
  bool refuse_unauthenticated(ServerConn& c, const wire::FrameHeader* h, const std::string& what);
  bool post_recv(ServerConn& c, std::uint32_t buffer);
  // `rows`, when given, are RDMA WRITTEN to the client before the reply SEND (RC order makes
  // them land first); they must stay untouched until the SEND completes.
  bool reply(ServerConn& c, const wire::FrameHeader& req, Errc status, const void* payload, std::size_t bytes,
             std::uint16_t flags = 0, std::uint64_t arg0 = 0, std::uint32_t arg1 = 0, const RowsOut* rows = nullptr);
  bool send_error(ServerConn& c, const wire::FrameHeader& req, Errc status, const std::string& why);
  // Posts the frame already in reply buffer `buffer`, after the rows' WRITEs.
  bool post_reply(ServerConn& c, std::uint32_t buffer, std::size_t length, const RowsOut* rows);
  // Sends queued replies while reply buffers are free; false if a post failed.
  bool flush_unsent(ServerConn& c);
  // Closes the connections whose queued replies have not moved for reply_timeout.
  void expire_unsent();
  // Takes every send completion: how many, or -1 when the queue pair broke.
  int reap_sends(ServerConn& c);
  // Visits each connection of `list` once; drops (order not kept) those `done` returns true for.
  template <class Done>
  static void sweep(std::vector<std::shared_ptr<ServerConn>>& list, Done done) {
    for (std::size_t i = 0; i < list.size();) {
      if (done(*list[i])) {
        list[i] = std::move(list.back());
        list.pop_back();
      } else {
        ++i;
      }
    }
  }
  // Ends the connection for good: the engine forgets its worker at once; its queue pair lingers
  // (without holding this thread) until its last replies left, then finish_close releases it.
  void close(ServerConn& c);
  void finish_close(ServerConn& c);
  // Takes the send completions; true once every reply posted has left, or none can any more.
  bool replies_left(ServerConn& c);
  // Finishes the lingering connections whose replies left or whose time is up (all: `all`).
  void end_lingering(bool all);
  // Closes the connections still unauthenticated past their handshake deadline.
  void expire_handshakes();

  RdmaServer& server_;
  ShardEngine& engine_;
  ibv_comp_channel* channel_ = nullptr;
  int wake_fd_ = -1;
  std::thread thread_;
  std::mutex mu_;  // guards the six below
  std::vector<std::shared_ptr<ServerConn>> conns_;
  std::uint64_t conns_version_ = 0;  // bumped when conns_ changes (busy polling re-reads it then)
  std::vector<std::shared_ptr<ServerConn>> closing_;
  std::vector<Deferred> deferred_;
  std::vector<std::shared_ptr<ServerConn>> adopted_unproven_;  // adopted, token not proven yet
  bool stop_ = false;
  // The thread's own: connections with completions to drain, and those closed during this
  // round, kept alive until no raw pointer to them is left in active_.
  std::vector<ServerConn*> active_;
  std::vector<std::shared_ptr<ServerConn>> graveyard_;
  // Connections with replies queued (ServerConn::unsent), and closed ones lingering.
  std::vector<std::shared_ptr<ServerConn>> stalled_, lingering_;
  std::vector<std::shared_ptr<ServerConn>> handshakes_;  // unauthenticated, with a deadline
};

}  // namespace pskv::rdma
