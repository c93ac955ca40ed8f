// Client side of the RDMA backend: one RC queue pair to one server, set up through librdmacm.
//
//   pull     one-sided RDMA READs of the server's slots straight into the caller's buffer, each
//            validated by the slot's seqlock word (see rdma_datapath.cc); a LOOKUP control
//            message first learns where a key's slot is (cached: slots never move), and a WAIT
//            control message, parked on the server, holds a read back until the SSP bound allows it.
//   push     RDMA WRITEs from the caller's buffers into this client's receive region on the
//            server, with the descriptor (frame header + key table) in the same chain and an
//            immediate on the last WRITE saying where it is; the server answers with a SEND.
//   tables   table_create and table_push travel as pushes do; a table_pull too, with room for its
//            rows after its key table: the server reads the rows into that room and RDMA WRITEs
//            them into a ring of this client's (rows_ring_) just before its reply. A server peer's
//            replicate, replica_pull and replica_index (rdma_protocol.h) travel the same ways.
//   control  clock, barrier, stats, lookup, wait: SENDs of wire frames, answered by SENDs.
//
// Control path (connect, register, teardown) is in rdma_connection.cc, the hot path (posting
// work requests, completions) in rdma_datapath.cc.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/rdma/mr_cache.h"
#include "transport/rdma/rdma_protocol.h"
#include "transport/rdma/verbs.h"
#include "transport/transport.h"

namespace pskv::rdma {

// Thread-safety: submit() and register_buffer() may be called from any number of threads. One
// internal completion thread owns the completion queue; every piece of request state is
// guarded by mu_, and work requests are posted under it, so the send queue accounting, the
// credit count and the receive-region ring stay consistent.
class RdmaConnection final : public transport::Connection {
 public:
  RdmaConnection(const Uri& uri, const transport::ConnectOptions& options);
  ~RdmaConnection() override;

  void submit(transport::Request& request) override;
  void register_buffer(void* data, std::size_t bytes) override;
  const transport::ServerInfo& info() const noexcept override { return info_; }
  const std::string& endpoint() const noexcept override { return endpoint_; }
  bool broken() noexcept override {
    std::lock_guard lock(mu_);
    return broken_;
  }

 private:
  using Clock = std::chrono::steady_clock;

  // One connection attempt's verbs objects; the destructor releases them in reverse order.
  struct Verbs {
    rdma_event_channel* events = nullptr;
    rdma_cm_id* id = nullptr;
    ibv_context* ctx = nullptr;  // our own (see open_own_context)
    ibv_pd* pd = nullptr;
    ibv_comp_channel* channel = nullptr;
    ibv_cq* cq = nullptr;
    ibv_qp* qp = nullptr;
    unsigned unacked_events = 0;
    ~Verbs();
    void destroy_qp();
  };

  enum class Phase : std::uint8_t {
    idle,
    preparing,     // the submitting thread fills it in, unlocked; nobody else touches it
    send_queued,   // a SEND or WRITE chain waits for a credit, send queue room or region space
    sent,          // posted; waiting for the server's reply
    own_pushes,    // a pull waits until this client's earlier pushes are applied
    clock_queued,  // a pull waits for send queue room to read the clock table
    clock_read,    // a pull reads the clock table to learn the bound
    read_queued,   // a pull round waits for send queue room
    reading,       // a pull round of READs is in flight
    backoff,       // a pull waits to re-read slots that writers kept changing
    done,
  };

  struct RemoteSlot {
    std::uint64_t offset = 0;  // 0: unknown yet
    std::uint32_t length = 0;
  };

  struct InFlight {
    transport::Request* request = nullptr;
    std::uint64_t id = 0;
    Phase phase = Phase::idle;
    std::uint32_t chains = 0;     // posted chains not yet completed: the NIC may touch its buffers
    bool awaiting_reply = false;  // holds a credit until the server answers
    Errc status = Errc::ok;
    std::string why;
    wire::Op sent_op = wire::Op::hello;  // what the message in flight asks
    std::uint32_t message_bytes = 0;     // control SEND: bytes at the start of staging
    std::uint64_t text_total = 0;        // stats: the whole text's length, once its first page came
    // push/init: the message's size in the receive region, where it ends there, its gather list
    // and how many of those entries each WRITE of the chain takes.
    std::uint64_t message_total = 0;
    std::uint64_t region_end = 0;
    std::uint64_t region_offset = 0;  // where in the ring the message went
    std::vector<ibv_sge> gather;
    std::vector<std::uint32_t> wr_groups;
    // pull
    std::vector<RemoteSlot> remote;        // per key
    std::vector<std::uint32_t> lkeys;      // per key: the destination's lkey; 0 = bounce via staging
    std::vector<std::uint32_t> lookup;     // key indices the LOOKUP in flight asks about
    std::vector<std::uint32_t> round;      // key indices of the READ round in flight
    std::vector<std::uint32_t> bounce_at;  // per round position: offset of its bounce area
    std::uint32_t round_end = 0;           // keys before this are done once `round` is
    std::uint32_t torn_rounds = 0;
    std::uint64_t after_push = 0;
    std::uint64_t bound = 0;
    bool have_bound = false;
    bool snapshot = false;  // the next round also reads the clock table
    bool tried_clock_read = false;
    Clock::time_point started{}, retry_at{};
    RegisteredBuffer staging;             // descriptors, control frames, READ scratch, bounce copies
    std::vector<MemoryRegion> temporary;  // per-request registrations of unannounced buffers
  };

  struct Delivery {
    transport::Request* request;
    Errc status;
    std::string why;
    std::uint64_t bound;
    bool note_bound;
    std::vector<MemoryRegion> temporary;  // deregistered before the caller hears of completion
  };

  // Unannounced buffers up to this size are copied through staging rather than registered.
  static constexpr std::size_t kBounceBytes = 64u << 10;
  // A pull reads at most this many keys, and bounces at most this many bytes, per round.
  static constexpr std::uint32_t kMaxRoundKeys = 64;
  static constexpr std::size_t kRoundBounce = 256u << 10;

  // --- control path (rdma_connection.cc) ---
  // False when nothing listened (worth retrying until the deadline); throws on other failures.
  bool connect_once(const Uri& uri, Deadline deadline, std::string* refusal);
  // The server asked for the token and proved it: send our proof and receive the Grant.
  void authenticate(const auth::Proof& proof, Deadline deadline);
  void ensure_staging(InFlight& op, std::size_t bytes);
  // Finds the lkey of a caller buffer: cached registration, bounce (0), or a registration for
  // this request only.
  std::uint32_t local_key(InFlight& op, const void* data, std::size_t bytes);
  void prepare(InFlight& op);

  // --- hot path (rdma_datapath.cc) ---
  std::uint32_t acquire_slot(transport::Request* request);
  void start(std::uint32_t index);
  void pump();
  bool post_message(std::uint32_t index);
  void continue_pull(std::uint32_t index);
  void begin_reads(std::uint32_t index);
  bool post_clock_read(std::uint32_t index);
  bool post_round(std::uint32_t index);
  void next_round(InFlight& op);
  void assign_bounce(InFlight& op);
  std::size_t clock_area() const noexcept;
  std::size_t max_piece() const noexcept;
  std::uint32_t reads_for(std::uint32_t length) const noexcept;
  std::size_t bounce_base() const noexcept;
  void round_done(std::uint32_t index);
  void on_reply(std::uint32_t buffer, std::uint32_t bytes);
  void on_completion(const ibv_wc& wc);
  void on_clock_read(std::uint32_t index);
  void wake_own_push_waiters();
  void post_recv(std::uint32_t buffer);
  void finish(std::uint32_t index, Errc status, std::string why);
  void maybe_release(std::uint32_t index);
  void fail_all(Errc status, const std::string& why);
  void flush_deliveries();
  std::uint32_t sq_free() const noexcept { return send_depth_ - sq_used_; }
  bool bound_needed(const InFlight& op, std::uint64_t* need) const;
  std::string key_text(const InFlight& op, std::uint32_t k) const;

  void completion_loop();
  int drain_cq();
  void handle_cm_events();
  void on_tick(Clock::time_point now);
  int tick_ms(Clock::time_point now);

  transport::ConnectOptions options_;
  std::string endpoint_;
  transport::ServerInfo info_;
  EndpointParams params_;
  AcceptInfo server_{};
  auth::Nonce client_nonce_{};
  std::uint64_t staleness_ = 0;
  bool bounded_ = false;
  std::uint32_t send_depth_ = 0, recv_depth_ = 0, max_sge_ = 0;
  std::uint64_t max_message_ = 0;  // the port's largest message

  std::unique_ptr<Verbs> verbs_;
  RegisteredBuffer recv_;  // recv_depth_ buffers of kControlBytes
  std::unique_ptr<MrCache> cache_;
  // Where servers WRITE the rows of table pulls: the receive region's size, made at the first.
  std::once_flag rows_ring_once_;
  RegisteredBuffer rows_ring_;
  int wake_fd_ = -1;

  std::mutex mu_;  // guards everything below
  std::condition_variable slot_free_;
  std::vector<InFlight> in_flight_;
  std::vector<std::uint32_t> free_;
  std::uint64_t next_generation_ = 1;
  std::uint32_t credits_ = 0;
  std::uint32_t sq_used_ = 0;
  Clock::time_point last_progress_{};  // of the last completion or post
  std::vector<ibv_send_wr> wrs_;       // scratch for building chains
  std::vector<ibv_sge> sges_;
  std::deque<std::uint32_t> send_queue_;  // in submission order: a clock never passes its pushes
  std::deque<std::uint32_t> read_queue_;
  std::vector<std::uint32_t> own_push_waiters_;
  std::vector<std::uint32_t> backoff_;
  std::uint64_t pushes_started_ = 0, pushes_done_ = 0;
  std::uint64_t region_head_ = 0, region_tail_ = 0;  // monotonic byte positions in the ring
  std::uint64_t known_bound_ = 0;
  std::unordered_map<Key, RemoteSlot> slot_cache_;
  std::vector<Delivery> deliveries_;
  bool broken_ = false;
  Errc broken_status_ = Errc::ok;
  std::string broken_why_;
  Clock::time_point broken_at_{};
  std::atomic<bool> stopping_{false};
  std::thread completer_;
};

}  // namespace pskv::rdma
