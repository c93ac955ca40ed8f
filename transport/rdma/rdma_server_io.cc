// Hot path of the RDMA server: each completion thread drains its connections' completion
// queues, applies pushes (and table pushes, and a server peer's records) straight from the
// client's receive region, answers table and replica reads by RDMA WRITE into the client's rows
// ring, answers control messages, and sends the replies of parked requests. Every length a client declares is checked
// against the memory it claims to be in before anything is read or allocated.
#include <arpa/inet.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "common/sync.h"
#include "replication/failover_frames.h"
#include "replication/table_frames.h"
#include "transport/rdma/rdma_server_internal.h"

namespace pskv::rdma {

namespace {

constexpr std::size_t kHeader = sizeof(wire::FrameHeader);
// Completions handled for one connection before the thread looks at the others.
constexpr int kBudget = 256;

// A request parked in the engine (WAIT until the bound allows a read, or a barrier); its reply
// goes through the owning thread.
class ParkedReply final : public Parked {
 public:
  ParkedReply(std::shared_ptr<ServerConn> conn, const wire::FrameHeader& request)
      : conn_(std::move(conn)), request_(request) {
    conn_->parked.fetch_add(1, std::memory_order_relaxed);
  }
  ~ParkedReply() override { unpark(); }
  ParkedReply(const ParkedReply&) = delete;
  ParkedReply& operator=(const ParkedReply&) = delete;
  // Uncounted before the reply is queued, not when this object goes (the engine and the acker
  // destroy theirs after resuming a whole batch): the client may use the credit its reply frees
  // for another wait, and that one must find the count already down.
  void resume(Errc status, const std::string& why) override {
    unpark();
    conn_->owner->defer(conn_, request_, status, why);
  }

 private:
  void unpark() noexcept {
    if (!counted_) return;
    counted_ = false;
    conn_->parked.fetch_sub(1, std::memory_order_relaxed);
  }
  std::shared_ptr<ServerConn> conn_;
  wire::FrameHeader request_;
  bool counted_ = true;
};

}  // namespace

IoThread::IoThread(RdmaServer& server, ibv_context* ctx) : server_(server), engine_(*server.engine_) {
  if (!(channel_ = ibv_create_comp_channel(ctx)))
    throw Error(Errc::io, "ibv_create_comp_channel: " + errno_text(errno));
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) {
    ibv_destroy_comp_channel(channel_);
    throw Error(Errc::io, "eventfd: " + errno_text(errno));
  }
  set_nonblocking(channel_->fd);
}

IoThread::~IoThread() {
  stop_and_join();
  ibv_destroy_comp_channel(channel_);
  ::close(wake_fd_);
}

void IoThread::start() {
  thread_ = std::thread([this] { loop(); });
}

void IoThread::wake() {
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
}

void IoThread::adopt(const std::shared_ptr<ServerConn>& conn) {
  bool unproven;
  {
    std::lock_guard lock(mu_);
    conns_.push_back(conn);
    ++conns_version_;
    unproven = !conn->authenticated.load();
    if (unproven) adopted_unproven_.push_back(conn);
  }
  if (unproven) wake();  // its handshake deadline starts now
}

void IoThread::request_close(const std::shared_ptr<ServerConn>& conn) {
  {
    std::lock_guard lock(mu_);
    closing_.push_back(conn);
  }
  wake();
}

void IoThread::defer(const std::shared_ptr<ServerConn>& conn, const wire::FrameHeader& request, Errc status,
                     std::string why) {
  if (conn->closed.load()) return;
  {
    std::lock_guard lock(mu_);
    if (stop_) return;
    deferred_.push_back({conn, request, status, std::move(why)});
  }
  wake();
}

void IoThread::stop_and_join() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake();
  if (thread_.joinable()) thread_.join();
}

void IoThread::close_all() {
  std::vector<std::shared_ptr<ServerConn>> conns;
  {
    std::lock_guard lock(mu_);
    conns = conns_;
    deferred_.clear();
    closing_.clear();
    adopted_unproven_.clear();
  }
  for (auto& c : conns) close(*c);
  stalled_.clear();
  handshakes_.clear();
}

bool IoThread::linger_out(bool now_or_never) {
  end_lingering(now_or_never);
  return lingering_.empty();
}

void IoThread::loop() {
  const bool busy = server_.options_.busy_poll;
  std::vector<std::shared_ptr<ServerConn>> closing, polled;
  std::vector<Deferred> deferred;
  std::uint64_t polled_version = ~0ull;
  unsigned spins = 0;
  for (;;) {
    bool channel_ready = false;
    if (!busy || ++spins % 1024 == 0) {
      pollfd fds[2] = {{channel_->fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
      // Queued replies, lingering closes and handshakes have deadlines: look every 10 ms.
      const int idle = stalled_.empty() && lingering_.empty() && handshakes_.empty() ? -1 : 10;
      ::poll(fds, 2, busy || !active_.empty() ? 0 : idle);
      channel_ready = fds[0].revents & POLLIN;
      if (fds[1].revents & POLLIN) {
        std::uint64_t value;
        [[maybe_unused]] auto n = ::read(wake_fd_, &value, sizeof value);
      }
    }
    {
      // Taking the lock also orders this thread after the rdma_cm thread's setup of any
      // connection adopted meanwhile.
      std::lock_guard lock(mu_);
      if (stop_) return;
      closing.swap(closing_);
      deferred.swap(deferred_);
      handshakes_.insert(handshakes_.end(), adopted_unproven_.begin(), adopted_unproven_.end());
      adopted_unproven_.clear();
      if (busy && polled_version != conns_version_) {
        polled = conns_;
        polled_version = conns_version_;
      }
    }
    if (channel_ready) {
      ibv_cq* cq = nullptr;
      void* context = nullptr;
      while (ibv_get_cq_event(channel_, &cq, &context) == 0) {
        ibv_ack_cq_events(cq, 1);
        auto* c = static_cast<ServerConn*>(context);
        if (std::find(active_.begin(), active_.end(), c) == active_.end()) active_.push_back(c);
      }
    }
    if (busy)
      for (auto& c : polled)
        if (!c->closed.load() && std::find(active_.begin(), active_.end(), c.get()) == active_.end())
          active_.push_back(c.get());
    // Round-robin over connections with work, a budget each, so one busy client cannot starve others.
    for (std::size_t i = 0; i < active_.size();) {
      ServerConn* c = active_[i];
      if (!c->closed.load() && process_or_close(*c)) {
        ++i;
      } else {
        active_[i] = active_.back();
        active_.pop_back();
      }
    }
    for (Deferred& d : deferred) {
      ServerConn& c = *d.conn;
      if (c.closed.load()) continue;
      try {
        bool ok;
        if (d.status != Errc::ok && wire::applied_before_replicated(d.request))
          ok = false;  // closed: see wire::applied_before_replicated
        else if (d.status != Errc::ok)
          ok = send_error(c, d.request, d.status, d.why);
        else if (d.request.op == static_cast<std::uint16_t>(wire::Op::wait) ||
                 d.request.op == static_cast<std::uint16_t>(wire::Op::clock))
          ok = reply(c, d.request, Errc::ok, nullptr, 0, 0, engine_.observed_bound());
        else
          ok = reply(c, d.request, Errc::ok, nullptr, 0);
        if (!ok) close(c);
      } catch (const std::exception& e) {
        close_after_failure(c, e);
      }
    }
    deferred.clear();
    for (auto& c : closing) close(*c);
    closing.clear();
    if (!stalled_.empty()) expire_unsent();
    if (!handshakes_.empty()) expire_handshakes();
    active_.erase(std::remove_if(active_.begin(), active_.end(), [](ServerConn* c) { return c->closed.load(); }),
                  active_.end());
    if (!lingering_.empty()) end_lingering(false);  // none of them is in active_ now
    graveyard_.clear();
    if (busy && active_.empty()) cpu_relax();
  }
}

bool IoThread::may_park(const ServerConn& c, const wire::FrameHeader& h, std::string* why) const {
  if (c.parked.load(std::memory_order_relaxed) < c.depth) return true;
  *why = "its " + std::string(wire::op_name(h.op)) + " would be request " + std::to_string(c.depth + 1) +
         " of this connection waiting in the server, past its " + std::to_string(c.depth) +
         " credits; send no more requests than the credits the server granted";
  return false;
}

bool IoThread::process_or_close(ServerConn& c) {
  // Nothing a peer sends may end the process: a failure to get memory while serving it (the
  // system can refuse past every budget) closes that connection, as on tcp.
  try {
    return process(c);
  } catch (const std::exception& e) {
    close_after_failure(c, e);
    return false;
  }
}

void IoThread::close_after_failure(ServerConn& c, const std::exception& e) noexcept {
  try {
    log::error("rdma.failed", "server " + std::to_string(engine_.options().server_id) +
                                  ": serving a connection failed: " + e.what() + "; closed");
    close(c);
  } catch (const std::exception&) {
    c.closed.store(true);  // nothing more is read from it or sent to it by this thread
    c.release();           // and its pinned memory goes back to the budget
  }
}

bool IoThread::process(ServerConn& c) {
  const bool busy = server_.options_.busy_poll;
  for (int handled = 0; handled < kBudget;) {
    const int n = drain(c);
    if (c.closed.load()) return false;
    handled += n;
    if (n > 0) continue;
    if (busy) return false;
    // Re-arm, then poll again: a completion that arrived before the arm raised no event. While
    // replies wait, its requests are not read, so only sends are armed: some providers raise an
    // event at once for a queue armed with entries left in it.
    if ((c.unsent.empty() && ibv_req_notify_cq(c.recv_cq, 0) != 0) || ibv_req_notify_cq(c.send_cq, 0) != 0) {
      close(c);
      return false;
    }
    const int m = drain(c);
    if (c.closed.load() || m == 0) return false;
    handled += m;
  }
  return true;
}

int IoThread::drain(ServerConn& c) {
  const int m = reap_sends(c);
  if (m < 0 || !flush_unsent(c)) {
    close(c);
    return 0;
  }
  // Replies still waiting: read no more of its requests until they leave.
  if (!c.unsent.empty()) return m;
  ibv_wc wc[16];
  const int n = ibv_poll_cq(c.recv_cq, 16, wc);
  for (int i = 0; i < n && !c.closed.load(); ++i) on_recv(c, wc[i]);
  if (n < 0) close(c);
  return m + std::max(n, 0);
}

int IoThread::reap_sends(ServerConn& c) {
  ibv_wc wc[16];
  int reaped = 0, m;
  while ((m = ibv_poll_cq(c.send_cq, 16, wc)) > 0) {
    for (int i = 0; i < m; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return -1;  // the queue pair broke
      c.free_send.push_back(static_cast<std::uint32_t>(wc[i].wr_id));
    }
    reaped += m;
  }
  return m < 0 ? -1 : reaped;
}

bool IoThread::post_recv(ServerConn& c, std::uint32_t buffer) {
  ibv_sge sge{reinterpret_cast<std::uint64_t>(c.recv.data() + std::size_t{buffer} * kControlBytes),
              static_cast<std::uint32_t>(kControlBytes), c.recv.mr.lkey()};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = buffer;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  return ibv_post_recv(c.qp, &wr, &bad) == 0;
}

void IoThread::on_recv(ServerConn& c, const ibv_wc& wc) {
  const auto buffer = static_cast<std::uint32_t>(wc.wr_id);
  bool keep = false;
  if (wc.status != IBV_WC_SUCCESS || buffer >= c.depth) {
    keep = false;  // the client died or broke its queue pair
  } else if (wc.opcode == IBV_WC_RECV) {
    keep = handle_control(c, buffer, wc.byte_len);
  } else if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    // The push itself is in the receive region; the buffer can take the next message at once.
    if (!c.authenticated)
      keep = refuse_unauthenticated(c, nullptr, "wrote to its receive region before authenticating");
    else
      keep = post_recv(c, buffer) && handle_region_message(c, ntohl(wc.imm_data));
  }
  if (!keep) close(c);
}

bool IoThread::handle_control(ServerConn& c, std::uint32_t buffer, std::uint32_t bytes) {
  const std::byte* p = c.recv.data() + std::size_t{buffer} * kControlBytes;
  wire::FrameHeader h{};
  std::string why;
  if (bytes < kHeader) return false;
  std::memcpy(&h, p, kHeader);
  if (Errc e = wire::validate_header(h, server_.options_.limits, false, &why); e != Errc::ok) {
    if (h.magic == wire::kMagic) send_error(c, h, e, why);
    return false;
  }
  const std::uint64_t key_bytes = std::uint64_t{h.num_keys} * sizeof(wire::KeyEntry);
  if (kHeader + key_bytes + h.payload_bytes != bytes) {
    send_error(c, h, Errc::protocol,
               "the frame declares " + std::to_string(key_bytes + h.payload_bytes) +
                   " bytes after its header, the message has " + std::to_string(bytes - kHeader));
    return false;
  }
  c.keys.resize(h.num_keys);
  std::memcpy(c.keys.data(), p + kHeader, key_bytes);
  auth::Proof proof{};
  const bool is_auth = h.op == static_cast<std::uint16_t>(wire::Op::auth);
  if (is_auth) std::memcpy(proof.data(), p + kHeader + key_bytes, auth::kProofBytes);  // size checked above
  // Everything needed is copied out: the buffer can take the next message before we answer.
  if (!post_recv(c, buffer)) return false;
  if (!c.authenticated)
    return is_auth
               ? authenticate(c, h, proof)
               : refuse_unauthenticated(c, &h, "sent " + std::string(wire::op_name(h.op)) + " before authenticating");
  if (is_auth) return refuse_unauthenticated(c, &h, "authenticated twice");
  if (Errc e = wire::validate_keys(h, c.keys, &why); e != Errc::ok) {
    send_error(c, h, e, why);
    return false;
  }
  if (wire::op_is_replication(static_cast<wire::Op>(h.op)) && !c.server_peer) return refuse_replication(c, h);
  return dispatch(c, h);
}

bool IoThread::dispatch(ServerConn& c, const wire::FrameHeader& h) {
  std::string why;
  switch (static_cast<wire::Op>(h.op)) {
    case wire::Op::lookup: {
      if (h.num_keys > kLookupBatch)
        return send_error(c, h, Errc::capacity,
                          "a lookup of " + std::to_string(h.num_keys) + " keys; at most " +
                              std::to_string(kLookupBatch) + " fit one reply");
      Store& store = engine_.store();
      c.lookups.resize(h.num_keys);
      for (std::size_t i = 0; i < c.keys.size(); ++i) {
        const SlotHeader* slot = store.find(c.keys[i].key);
        c.lookups[i] = slot ? LookupEntry{store.slot_offset(*slot), slot->length, 0} : LookupEntry{0, 0, 0};
      }
      return reply(c, h, Errc::ok, c.lookups.data(), c.lookups.size() * sizeof(LookupEntry));
    }
    case wire::Op::wait:
      // Checked before it waits, as on tcp: a clock the worker never announced could only time out.
      if (Errc e = engine_.check_pull_clock(c.worker, h.arg0, &why); e != Errc::ok) return send_error(c, h, e, why);
      if (engine_.pull_allowed(c.worker, h.arg0)) return reply(c, h, Errc::ok, nullptr, 0, 0, engine_.observed_bound());
      if (!may_park(c, h, &why)) return send_error(c, h, Errc::capacity, why);
      engine_.park_pull(c.worker, h.arg0, std::make_unique<ParkedReply>(c.shared_from_this(), h));
      return true;
    case wire::Op::clock: {
      if (Errc e = engine_.check_worker(c.worker, &why); e != Errc::ok) return send_error(c, h, e, why);
      if (Errc e = engine_.check_replicable(h.arg0, "clock", &why); e != Errc::ok) return send_error(c, h, e, why);
      // With replicas, answered once they know it too (docs/ARCHITECTURE.md, "Replication"): a
      // clock that cannot wait for them is refused before it moves anything.
      Replicator* replicator = engine_.replicator();
      if (replicator && !may_park(c, h, &why)) return send_error(c, h, Errc::capacity, why);
      if (h.arg0 == kClockDone) c.finished = true;
      // This message was taken in queue-pair order: every push WRITE the worker posted before
      // it has already been applied by this thread, so the new clock covers them.
      const std::uint64_t bound = engine_.advance_clock(c.worker, h.arg0);
      if (replicator) {
        replicator->ship_clock(c.worker, h.arg0, std::make_unique<ParkedReply>(c.shared_from_this(), h));
        return true;
      }
      return reply(c, h, Errc::ok, nullptr, 0, 0, bound);
    }
    case wire::Op::barrier:
      if (Errc e = engine_.check_worker(c.worker, &why); e != Errc::ok) return send_error(c, h, e, why);
      if (!may_park(c, h, &why)) return send_error(c, h, Errc::capacity, why);
      engine_.barrier(c.worker, h.arg0, std::make_unique<ParkedReply>(c.shared_from_this(), h));
      return true;
    case wire::Op::stats: {
      // A text longer than a reply goes in pages: arg0 asks for the one at that offset, and
      // each answer's arg0 is the text's whole length.
      auto& readings = c.stats_readings;
      auto reading = std::find_if(readings.begin(), readings.end(),
                                  [&](const ServerConn::StatsReading& r) { return r.request_id == h.request_id; });
      if (h.arg0 == 0) {
        if (reading != readings.end()) readings.erase(reading);
        if (readings.size() == ServerConn::kStatsReadings) readings.pop_front();
        readings.push_back({h.request_id, engine_.stats_json(0, server_.stats_fields())});
        reading = std::prev(readings.end());
      } else if (reading == readings.end()) {
        return send_error(c, h, Errc::capacity,
                          "the stats text this page was asked from is gone (more than " +
                              std::to_string(ServerConn::kStatsReadings) +
                              " stats readings at once on this connection, or no first page); ask again");
      }
      const std::string& text = reading->text;
      if (h.arg0 >= text.size())
        return send_error(
            c, h, Errc::protocol,
            "stats asked from byte " + std::to_string(h.arg0) + " of a " + std::to_string(text.size()) + "-byte text");
      const std::size_t page = std::min<std::size_t>(text.size() - h.arg0, kControlBytes - kHeader);
      const bool sent = reply(c, h, Errc::ok, text.data() + h.arg0, page, wire::kText, text.size());
      if (h.arg0 + page == text.size()) readings.erase(reading);
      return sent;
    }
    case wire::Op::push:
    case wire::Op::init:
    case wire::Op::down_vote:
    case wire::Op::down_certified:
    case wire::Op::hand_back:
    case wire::Op::table_create:
    case wire::Op::table_pull:
    case wire::Op::table_push:
    case wire::Op::replicate:
    case wire::Op::replica_pull:
    case wire::Op::replica_index:
    case wire::Op::replica_table:
    case wire::Op::replica_rows:
    case wire::Op::replica_unrows:
    case wire::Op::replica_table_rows:
    case wire::Op::replica_rows_marked:
      return send_error(
          c, h, Errc::protocol,
          std::string(wire::op_name(h.op)) + " travels by RDMA WRITE into the receive region, not in a SEND");
    case wire::Op::hello:
    case wire::Op::pull:
    case wire::Op::auth:  // handled before dispatch
      return send_error(c, h, Errc::unsupported,
                        std::string(wire::op_name(h.op)) + " is not an rdma:// control message");
    case wire::Op::certificates: {
      std::string text;
      if (Errc e = replication::read_certificates(engine_, h.arg0, &text, &why); e != Errc::ok)
        return send_error(c, h, e, why);
      return reply(c, h, Errc::ok, text.data(), text.size(), wire::kText);
    }
    case wire::Op::replica_clock:
    case wire::Op::replica_barrier:
    case wire::Op::replica_evict: {
      const auto word = static_cast<WorkerWord>(h.op - static_cast<std::uint16_t>(wire::Op::replica_clock));
      if (Errc e = engine_.apply_replica_word(word, wire::replica_clock_origin(h), wire::replica_clock_worker(h),
                                              wire::worker_word_value(h), &why);
          e != Errc::ok)
        return send_error(c, h, e, why);
      return reply(c, h, Errc::ok, nullptr, 0);
    }
  }
  return send_error(c, h, Errc::protocol, "unknown op " + std::to_string(h.op));
}

bool IoThread::authenticate(ServerConn& c, const wire::FrameHeader& h, const auth::Proof& proof) {
  const auth::Token* token = c.token;
  if (!token || !auth::proofs_equal(proof, token->client_proof(c.server_nonce, c.client_nonce)))
    return refuse_unauthenticated(c, &h, "failed the challenge: its token differs from this server's");
  c.authenticated = true;
  c.worker = c.hello_worker;
  if (c.worker != kNoWorker) engine_.worker_joined(c.worker);
  return reply(c, h, Errc::ok, &c.grant, sizeof c.grant);
}

bool IoThread::refuse_replication(ServerConn& c, const wire::FrameHeader& h) {
  send_error(
      c, h, Errc::permission,
      auth::refuse(engine_.options().server_id, c.address,
                   "sent " + std::string(wire::op_name(h.op)) +
                       ", which only another server of the ring may send (servers connect to each other as such)"));
  return false;
}

bool IoThread::refuse_unauthenticated(ServerConn& c, const wire::FrameHeader* h, const std::string& what) {
  const std::string text = auth::refuse(engine_.options().server_id, c.address, what);
  if (h) send_error(c, *h, Errc::permission, text);
  return false;
}

bool IoThread::handle_region_message(ServerConn& c, std::uint32_t imm) {
  const std::uint64_t region = c.region.size();
  const std::uint64_t offset = std::uint64_t{imm} * kDescriptorAlign;
  if (offset > region || region - offset < kHeader) return false;  // no header to answer to
  std::byte* at = c.region.data() + offset;
  wire::FrameHeader h{};
  std::memcpy(&h, at, kHeader);
  std::string why;
  if (Errc e = wire::validate_header(h, server_.options_.limits, false, &why); e != Errc::ok) {
    if (h.magic == wire::kMagic) send_error(c, h, e, why);
    return false;
  }
  const auto op = static_cast<wire::Op>(h.op);
  if (!written_into_region(op)) {
    send_error(c, h, Errc::protocol, std::string(wire::op_name(h.op)) + " cannot arrive by RDMA WRITE");
    return false;
  }
  if (wire::op_is_replication(op) && !c.server_peer) return refuse_replication(c, h);
  const std::uint64_t key_bytes = std::uint64_t{h.num_keys} * sizeof(wire::KeyEntry);
  if (key_bytes + h.payload_bytes > region - offset - kHeader) {
    send_error(c, h, Errc::protocol,
               "the " + std::string(wire::op_name(h.op)) + " declares " + std::to_string(key_bytes + h.payload_bytes) +
                   " bytes past the end of the receive region");
    return false;
  }
  // The key table is copied: the client can still write its region, and lengths must not
  // change between their check and their use. Values are applied in place.
  c.keys.resize(h.num_keys);
  std::memcpy(c.keys.data(), at + kHeader, key_bytes);
  if (Errc e = wire::validate_keys(h, c.keys, &why); e != Errc::ok) {
    send_error(c, h, e, why);
    return false;
  }
  std::byte* const after_keys = at + kHeader + key_bytes;
  const auto* values = reinterpret_cast<const float*>(after_keys);
  if (h.flags & wire::kChecksum) {
    std::uint32_t crc = wire::crc32_update(0, c.keys.data(), key_bytes);
    crc = wire::crc32_update(crc, values, h.payload_bytes);
    if (crc != h.checksum)
      return send_error(c, h, Errc::protocol, "checksum mismatch: the request was corrupted in transit");
  }
  Errc status = Errc::ok;
  switch (op) {
    case wire::Op::table_pull:
    case wire::Op::replica_pull:
    case wire::Op::replica_index:
    case wire::Op::replica_table_rows:
      return answer_into_room(c, h, after_keys, region - offset - kHeader - key_bytes);
    case wire::Op::replicate:
      status = engine_.take_replicate(static_cast<std::uint32_t>(h.arg0), h.arg1, c.keys, values, &why, c.tag,
                                      static_cast<std::uint32_t>(h.arg0 >> 32));
      break;
    case wire::Op::replica_table:
    case wire::Op::replica_rows:
    case wire::Op::replica_unrows:
    case wire::Op::replica_rows_marked:
      status = replication::apply_table_frame(engine_, h, c.keys, values, c.tag, &why);
      break;
    case wire::Op::down_vote:
    case wire::Op::down_certified:
    case wire::Op::hand_back:
      status = replication::take_failover_frame(engine_, op, c.keys, values, h.payload_bytes, &why);
      break;
    case wire::Op::table_push:
    case wire::Op::table_create: {
      bool parked = false;
      const replication::Park park = [&] { return std::make_unique<ParkedReply>(c.shared_from_this(), h); };
      status = op == wire::Op::table_create
                   ? replication::create_table(engine_, c.keys, values, park, &why, &parked)
                   : replication::push_table(engine_, h, c.keys, values, c.worker, park, &why, &parked);
      if (parked) return true;
      break;
    }
    case wire::Op::init:
    case wire::Op::push:
      return apply_push(c, h, values);
    default:
      send_error(c, h, Errc::protocol, std::string(wire::op_name(h.op)) + " is not taken from the receive region");
      return false;
  }
  if (status != Errc::ok) return send_error(c, h, status, why);
  return reply(c, h, Errc::ok, nullptr, 0);
}

bool IoThread::apply_push(ServerConn& c, const wire::FrameHeader& h, const float* values) {
  std::string why;
  const bool init = static_cast<wire::Op>(h.op) == wire::Op::init;
  Replicator* replicator = engine_.replicator();
  if (replicator)
    if (Errc e = replicator->reserve(c.keys, init, &why); e != Errc::ok) return send_error(c, h, e, why);
  // A retrying client's push carries its session and sequence number (wire::push_is_identified):
  // applied whole here, a key that already holds it skips it.
  const Errc status = init ? engine_.init(c.keys, values, &why)
                           : engine_.push(c.worker, wire::push_clock(h), c.keys, values, &why, nullptr,
                                          PushId{.session = wire::push_session(h), .seq = h.arg1});
  if (status != Errc::ok) {
    if (replicator) replicator->release(c.keys);
    return send_error(c, h, status, why);
  }
  // With replicas, the reply waits until every live one holds these keys.
  if (replicator) {
    replicator->ship(c.keys, std::make_unique<ParkedReply>(c.shared_from_this(), h));
    return true;
  }
  return reply(c, h, Errc::ok, nullptr, 0);
}

bool IoThread::answer_into_room(ServerConn& c, const wire::FrameHeader& h, std::byte* room, std::uint64_t left) {
  RowsTarget target{};
  if (left < sizeof target) {
    send_error(c, h, Errc::protocol, "the " + std::string(wire::op_name(h.op)) + " leaves no room for its answer");
    return false;
  }
  std::memcpy(&target, room, sizeof target);  // before the answer overwrites it
  std::uint64_t floats = 0;
  for (const wire::KeyEntry& k : c.keys) floats += k.length;
  const auto op = static_cast<wire::Op>(h.op);
  const std::uint64_t rows = answered_with_bytes(op) ? 0 : floats * sizeof(float);
  if (target.room > left || target.room < sizeof target || rows > target.room) {
    send_error(c, h, Errc::protocol,
               "the " + std::string(wire::op_name(h.op)) + " declares a room of " + std::to_string(target.room) +
                   " bytes for " + std::to_string(rows) + " bytes of answer, with " + std::to_string(left) +
                   " bytes left in the receive region: " +
                   (target.room > left ? "it would pass the end of the receive region" : "too small"));
    return false;
  }
  if (rows > server_.options_.limits.max_payload_bytes)
    return send_error(c, h, Errc::capacity,
                      "a reply of " + std::to_string(rows) +
                          " bytes passes the request limit (--max-request-mb) of server " +
                          std::to_string(engine_.options().server_id) + ": ask for fewer rows at a time");
  std::string why;
  Errc status = Errc::ok;
  std::uint64_t bytes = rows;
  auto* out = reinterpret_cast<float*>(room);
  switch (op) {
    case wire::Op::table_pull:
      // Read into the region, not straight from the table by the NIC: a row is copied under its
      // seqlock, so none is torn by a push racing the reply.
      status = engine_.table_pull(h.arg1, c.keys, out, &why);
      break;
    case wire::Op::replica_pull:
      status = engine_.read_records(static_cast<std::uint32_t>(h.arg0), c.keys, out, &why);
      break;
    case wire::Op::replica_table_rows: {
      // A page no larger than the room its requester left (and than the request limit).
      std::string page;
      status = replication::read_table_page(
          engine_, h, c.keys, std::min<std::uint64_t>(target.room, server_.options_.limits.max_payload_bytes), &page,
          &why);
      if (status == Errc::ok) std::memcpy(room, page.data(), bytes = page.size());
      break;
    }
    default: {
      std::vector<std::pair<Key, std::uint32_t>> keys;
      std::vector<std::uint64_t> words;
      bool synced = false;
      status = engine_.replica_index(static_cast<std::uint32_t>(h.arg0), &keys, &synced, &words, &why);
      const std::string index = status == Errc::ok ? wire::encode_replica_index(synced, keys, words) : "";
      if (status == Errc::ok && index.size() > target.room) {
        status = Errc::capacity;
        why = "the replica index (" + std::to_string(index.size()) + " bytes) does not fit the " +
              std::to_string(target.room) + " bytes its requester left: raise --rdma-recv-mb";
      }
      if (status == Errc::ok) std::memcpy(room, index.data(), bytes = index.size());
    }
  }
  if (status != Errc::ok) return send_error(c, h, status, why);
  const RowsOut answer{room, bytes, c.region.mr.lkey(), target};
  return reply(c, h, Errc::ok, nullptr, 0, 0, engine_.observed_bound(), static_cast<std::uint32_t>(bytes), &answer);
}

bool IoThread::reply(ServerConn& c, const wire::FrameHeader& req, Errc status, const void* payload, std::size_t bytes,
                     std::uint16_t flags, std::uint64_t arg0, std::uint32_t arg1, const RowsOut* rows) {
  if (bytes > kControlBytes - kHeader)
    return send_error(c, req, Errc::capacity,
                      "the reply of " + std::to_string(bytes) + " bytes exceeds the " + std::to_string(kControlBytes) +
                          "-byte control buffer");
  if (rows && rows->bytes > 0 &&
      ((rows->bytes + c.max_write - 1) / c.max_write + 1 > c.wrs_per_reply ||
       rows->target.addr + rows->bytes < rows->target.addr))
    return false;
  wire::FrameHeader h = wire::make_header(static_cast<wire::Op>(req.op), req.request_id, 0, bytes, arg0, arg1);
  h.flags = static_cast<std::uint16_t>(wire::kResponse | flags);
  h.status = static_cast<std::uint16_t>(status);
  // A client holds at most `depth` requests unanswered and has twice as many reply buffers, so
  // none free means its SENDs are not acknowledged yet: it is slow to re-post receives, or takes
  // none at all. The reply then waits in the connection's queue, never in this thread.
  if (c.unsent.empty() && c.free_send.empty() && reap_sends(c) < 0) return false;
  if (!c.unsent.empty() || c.free_send.empty()) {
    // Nothing more of its requests is read while replies wait; what can still come is the rest
    // of a completion batch and the replies of its parked requests, at most `depth`.
    if (c.unsent.size() >= std::size_t{c.depth} + 32) return false;
    UnsentReply& u = c.unsent.emplace_back();
    u.frame.resize(kHeader + bytes);
    std::memcpy(u.frame.data(), &h, kHeader);
    if (bytes) std::memcpy(u.frame.data() + kHeader, payload, bytes);
    if (rows) {
      u.has_rows = true;
      u.rows = *rows;
    }
    if (c.unsent.size() == 1) {
      c.unsent_since = std::chrono::steady_clock::now();
      stalled_.push_back(c.shared_from_this());
    }
    return true;
  }
  const std::uint32_t b = c.free_send.back();
  c.free_send.pop_back();
  std::byte* out = c.send.data() + std::size_t{b} * kControlBytes;
  std::memcpy(out, &h, kHeader);
  if (bytes) std::memcpy(out + kHeader, payload, bytes);
  return post_reply(c, b, kHeader + bytes, rows);
}

bool IoThread::post_reply(ServerConn& c, std::uint32_t b, std::size_t length, const RowsOut* rows) {
  std::byte* out = c.send.data() + std::size_t{b} * kControlBytes;
  ibv_sge sge{reinterpret_cast<std::uint64_t>(out), static_cast<std::uint32_t>(length), c.send.mr.lkey()};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = b;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  // Unsignaled WRITEs ahead of the SEND: their send queue entries are free once it completes,
  // and each reply buffer stands for wrs_per_reply entries (rdma_server.cc sizes the queue).
  thread_local std::vector<ibv_send_wr> writes;
  thread_local std::vector<ibv_sge> pieces;
  ibv_send_wr* first = &wr;
  if (rows && rows->bytes > 0) {
    const std::uint64_t n = (rows->bytes + c.max_write - 1) / c.max_write;  // checked by reply()
    writes.assign(n, ibv_send_wr{});
    pieces.resize(n);
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t done = i * c.max_write;
      pieces[i] = {reinterpret_cast<std::uint64_t>(rows->data + done),
                   static_cast<std::uint32_t>(std::min(c.max_write, rows->bytes - done)), rows->lkey};
      ibv_send_wr& w = writes[i];
      w.wr_id = b;
      w.sg_list = &pieces[i];
      w.num_sge = 1;
      w.opcode = IBV_WR_RDMA_WRITE;
      w.wr.rdma.remote_addr = rows->target.addr + done;
      w.wr.rdma.rkey = rows->target.rkey;
      w.next = i + 1 < n ? &writes[i + 1] : &wr;
    }
    first = writes.data();
  }
  if (ibv_post_send(c.qp, first, &bad) != 0) {
    c.free_send.push_back(b);
    return false;
  }
  return true;
}

bool IoThread::flush_unsent(ServerConn& c) {
  bool moved = false;
  while (!c.unsent.empty() && !c.free_send.empty()) {
    const std::uint32_t b = c.free_send.back();
    c.free_send.pop_back();
    UnsentReply u = std::move(c.unsent.front());
    c.unsent.pop_front();
    std::memcpy(c.send.data() + std::size_t{b} * kControlBytes, u.frame.data(), u.frame.size());
    if (!post_reply(c, b, u.frame.size(), u.has_rows ? &u.rows : nullptr)) return false;
    moved = true;
  }
  if (moved) c.unsent_since = std::chrono::steady_clock::now();
  return true;
}

void IoThread::expire_unsent() {
  const auto now = std::chrono::steady_clock::now();
  const auto limit = server_.options_.reply_timeout;
  sweep(stalled_, [&](ServerConn& c) {
    if (!c.closed.load() && !c.unsent.empty() && now - c.unsent_since > limit) {
      log::warn("rdma.slow-reader",
                "server " + std::to_string(engine_.options().server_id) + ": " + c.address + " took none of its " +
                    std::to_string(c.unsent.size()) + " waiting replies for " + std::to_string(limit.count()) +
                    " ms (--frame-timeout-ms): closed (a client must keep a receive posted per credit)");
      c.unsent.clear();  // none of them could leave: the close need not wait for them
      close(c);
    }
    return c.closed.load() || c.unsent.empty();
  });
}

bool IoThread::send_error(ServerConn& c, const wire::FrameHeader& req, Errc status, const std::string& why) {
  // A malformed frame ends its connection: the operator should see who sent it and why.
  if (status == Errc::protocol)
    log::warn("rdma.bad-frame", "server " + std::to_string(engine_.options().server_id) + ": " + c.address +
                                    " sent a bad " + std::string(wire::op_name(req.op)) + ": " + why);
  const std::size_t n = std::min(why.size(), kControlBytes - kHeader);
  return reply(c, req, status, why.data(), n, wire::kText);
}

void IoThread::close(ServerConn& c) {
  if (c.closed.exchange(true)) return;
  if (c.worker != kNoWorker && !c.finished)
    log::info("rdma.closed", "server " + std::to_string(engine_.options().server_id) + " closed " + c.address +
                                 " (worker " + std::to_string(c.worker) + ") before it finished");
  if (c.worker != kNoWorker) engine_.worker_left(c.worker, c.finished);
  std::shared_ptr<ServerConn> self = c.shared_from_this();
  graveyard_.push_back(self);
  {
    std::lock_guard lock(mu_);
    conns_.erase(std::remove(conns_.begin(), conns_.end(), self), conns_.end());
    ++conns_version_;
  }
  // An error reply already posted (or still queued) gets 200 ms to leave before the disconnect
  // flushes it. The connection waits in lingering_, so a peer that takes no replies holds nothing.
  if (c.send_cq && !replies_left(c)) {
    c.linger_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    lingering_.push_back(std::move(self));
    return;
  }
  finish_close(c);
}

void IoThread::finish_close(ServerConn& c) {
  rdma_disconnect(c.id);
  c.release();
  bool stopping;
  {
    std::lock_guard lock(mu_);
    stopping = stop_;
  }
  // When the server stops, it destroys every id itself once all threads are gone.
  if (!stopping) server_.retire(c.shared_from_this());
}

void IoThread::expire_handshakes() {
  const auto now = std::chrono::steady_clock::now();
  sweep(handshakes_, [&](ServerConn& c) {
    if (!c.closed.load() && !c.authenticated.load() && now >= c.handshake_deadline) {
      auth::refuse(engine_.options().server_id, c.address,
                   "did not prove its token within " + std::to_string(server_.options_.handshake_timeout.count()) +
                       " ms (--handshake-timeout-ms)");
      close(c);
    }
    return c.closed.load() || c.authenticated.load();
  });
}

bool IoThread::replies_left(ServerConn& c) {
  // A broken queue pair (or a failed post) sends nothing more: nothing is left to wait for.
  if (reap_sends(c) < 0 || !flush_unsent(c)) return true;
  return c.unsent.empty() && c.free_send.size() >= 2 * std::size_t{c.depth};
}

void IoThread::end_lingering(bool all) {
  const auto now = std::chrono::steady_clock::now();
  sweep(lingering_, [&](ServerConn& c) {
    if (!all && !replies_left(c) && now < c.linger_until) return false;
    finish_close(c);
    return true;
  });
}

}  // namespace pskv::rdma
