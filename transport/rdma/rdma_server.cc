// Control path of the RDMA server: listening through rdma_cm, registering the store and the
// clock table, accepting (or refusing, with the reason in the REJ private data) connections,
// and tearing everything down in reverse order of creation.
#include <arpa/inet.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "transport/rdma/rdma_server_internal.h"

namespace pskv::rdma {
namespace {
constexpr std::uint8_t kAckTimeout = 16, kRetryCount = 7, kRnrRetry = 7;
constexpr int kBacklog = 256;

std::uint64_t physical_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? std::uint64_t(pages) * std::uint64_t(page) : 8ull << 30;
}

bool wildcard(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr == htonl(INADDR_ANY);
  if (a.ss_family == AF_INET6) return IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6&>(a).sin6_addr);
  return false;
}
}  // namespace

void ServerConn::release() {
  if (qp) ibv_destroy_qp(qp);
  qp = nullptr;
  if (send_cq) ibv_destroy_cq(send_cq);
  if (recv_cq) ibv_destroy_cq(recv_cq);
  send_cq = recv_cq = nullptr;
  region = RegisteredBuffer();
  send = RegisteredBuffer();
  recv = RegisteredBuffer();
  if (pinned_total && pinned) pinned_total->fetch_sub(pinned, std::memory_order_relaxed);
  pinned = 0;
}

RdmaServer::RdmaServer(const Uri& uri, ShardEngine& engine, const PinnedBuffer& clocks,
                       const RdmaServerOptions& options)
    : options_(options), engine_(&engine), clock_memory_(&clocks) {
  Uri shown = uri;
  shown.params.clear();
  endpoint_ = shown.str();
  EndpointParams want;
  want.device = options.device;
  want.port = options.ib_port;
  want.gid_index = options.gid_index;
  want.busy_poll = options.busy_poll;
  options_.threads = std::max(1u, options_.threads);
  options_.queue_depth = std::clamp(options_.queue_depth, 1u, 4096u);
  if (options_.region_bytes < 4096 || options_.region_bytes > (kMaxRegionMb << 20))
    throw Error(Errc::invalid_argument,
                "the receive region (recv_mb) must be between 1 and " + std::to_string(kMaxRegionMb) + " MiB");
  if (!options_.pinned) options_.pinned = std::make_shared<std::atomic<std::uint64_t>>(0);
  if (options_.pinned_budget_bytes == 0) options_.pinned_budget_bytes = physical_memory_bytes() / 2;
  if (const std::uint64_t one = pins_of(options_.queue_depth); one > pin_limit(false))
    throw Error(Errc::invalid_argument,
                "one connection would pin " + std::to_string(one >> 20) + " MiB (its --rdma-recv-mb region and " +
                    "buffers), past the 7/8 of --rdma-pin-mb (" + std::to_string(options_.pinned_budget_bytes >> 20) +
                    ") clients may take: no client could connect");
  prepare_process();
  require_device(endpoint_);

  try {
    if (!(events_ = rdma_create_event_channel())) {
      if (errno == ENODEV || errno == ENOENT) require_device(endpoint_);
      throw Error(Errc::io, "rdma_create_event_channel: " + errno_text(errno) + " (is the rdma_ucm module loaded?)");
    }
    set_nonblocking(events_->fd);
    if (rdma_create_id(events_, &listen_id_, nullptr, RDMA_PS_TCP) != 0)
      throw Error(Errc::io, "rdma_create_id: " + errno_text(errno));
    sockaddr_storage addr = resolve_host(uri.host, uri.port, true);
    if (rdma_bind_addr(listen_id_, reinterpret_cast<sockaddr*>(&addr)) != 0) {
      const int err = errno;
      if (err == EADDRINUSE)
        throw Error(Errc::io, "cannot serve " + endpoint_ + ": the port is in use (pick another, or port 0 for any)");
      throw Error(Errc::no_device, "cannot serve " + endpoint_ + ": no RDMA device has the address " + uri.host + " (" +
                                       errno_text(err) +
                                       "); use the IP address of an RDMA interface (`rdma link` lists them; in the "
                                       "Soft-RoCE VM: $RXE_IP, not 127.0.0.1)");
    }
    port_ = ntohs(rdma_get_src_port(listen_id_));  // port 0 asked for one; it is chosen at bind
    shown.port = port_;
    endpoint_ = shown.str();
    if (listen_id_->verbs) {
      ctx_ = open_own_context(listen_id_->verbs);
      check_and_log_device(listen_id_, ctx_, want, "server", endpoint_);
    } else if (wildcard(addr)) {
      // Listening on every address: serve the named device (or the first) and refuse others.
      int n = 0;
      ibv_context** list = rdma_get_devices(&n);
      ibv_context* chosen = nullptr;
      for (int i = 0; i < n && !chosen; ++i)
        if (want.device.empty() || want.device == ibv_get_device_name(list[i]->device)) chosen = list[i];
      if (chosen) ctx_ = open_own_context(chosen);
      if (list) rdma_free_devices(list);
      if (!ctx_)
        throw Error(Errc::no_device, "cannot serve " + endpoint_ + ": no RDMA device named '" + want.device + "'");
      std::fprintf(stderr, "pskv rdma: device %s (all addresses) for server %s\n", ibv_get_device_name(ctx_->device),
                   endpoint_.c_str());
    }
    device_name_ = ibv_get_device_name(ctx_->device);
    if (ibv_query_device(ctx_, &device_) != 0) throw Error(Errc::io, "ibv_query_device: " + errno_text(errno));
    if (!(pd_ = ibv_alloc_pd(ctx_))) throw Error(Errc::io, "ibv_alloc_pd: " + errno_text(errno));
    Store& store = engine_->store();
    store_mr_ = MemoryRegion(pd_, store.region(), store.region_size(), IBV_ACCESS_REMOTE_READ,
                             "the store region, sized by --arena-mb and --max-keys");
    if (clock_memory_->size() > 0)
      clock_mr_ =
          MemoryRegion(pd_, clock_memory_->data(), clock_memory_->size(), IBV_ACCESS_REMOTE_READ, "the clock table");
    for (std::uint32_t t = 0; t < options_.threads; ++t) io_.push_back(std::make_unique<IoThread>(*this, ctx_));
    if (rdma_listen(listen_id_, kBacklog) != 0)
      throw Error(Errc::io, "rdma_listen on " + endpoint_ + ": " + errno_text(errno));
    if ((wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0) throw Error(Errc::io, "eventfd: " + errno_text(errno));
  } catch (...) {
    close();
    throw;
  }
  for (auto& io : io_) io->start();
  cm_thread_ = std::thread([this] { cm_loop(); });
}

RdmaServer::~RdmaServer() {
  stop_accepting();
  drain();
  close();
}

void RdmaServer::stop_accepting() noexcept {
  accepting_.store(false);
}

void RdmaServer::drain() noexcept {
  if (drained_) return;
  drained_ = true;
  stopping_.store(true);
  if (cm_thread_.joinable()) {
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
    cm_thread_.join();
  }
  for (auto& io : io_) io->stop_and_join();
}

void RdmaServer::close() noexcept {
  if (closed_) return;
  closed_ = true;
  drain();
  // Single-threaded from here: every connection's verbs objects, then their ids (no event is
  // outstanding: the cm thread acked all it took), then the listener and the shared objects.
  for (auto& io : io_) io->close_all();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  for (bool done = false; !done; std::this_thread::yield()) {
    const bool late = std::chrono::steady_clock::now() >= deadline;
    done = true;
    for (auto& io : io_) done = io->linger_out(late) && done;
  }
  for (auto& [id, conn] : conns_) rdma_destroy_id(id);
  conns_.clear();
  retired_.clear();
  io_.clear();
  if (listen_id_) rdma_destroy_id(listen_id_);
  listen_id_ = nullptr;
  clock_mr_ = MemoryRegion();
  store_mr_ = MemoryRegion();
  if (pd_) ibv_dealloc_pd(pd_);
  pd_ = nullptr;
  if (ctx_) ibv_close_device(ctx_);
  ctx_ = nullptr;
  if (events_) rdma_destroy_event_channel(events_);
  events_ = nullptr;
  if (wake_fd_ >= 0) ::close(wake_fd_);
  wake_fd_ = -1;
}

std::uint64_t RdmaServer::pins_of(std::uint32_t depth) const noexcept {
  return options_.region_bytes + std::uint64_t{3} * depth * kControlBytes;  // a receive, two reply buffers
}

std::uint64_t RdmaServer::pin_limit(bool server_peer) const noexcept {
  return server_peer ? options_.pinned_budget_bytes : options_.pinned_budget_bytes / 8 * 7;
}

JsonObject RdmaServer::stats_fields() const {
  JsonObject fields;
  fields.add("rdma_pinned_bytes", options_.pinned->load(std::memory_order_relaxed))
      .add("rdma_budget_bytes", options_.pinned_budget_bytes);
  return fields;
}

void RdmaServer::retire(const std::shared_ptr<ServerConn>& conn) {
  {
    std::lock_guard lock(retire_mu_);
    retired_.push_back(conn);
  }
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
}

void RdmaServer::cm_loop() {
  while (!stopping_.load()) {
    pollfd fds[2] = {{events_->fd, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    ::poll(fds, 2, -1);
    if (fds[1].revents & POLLIN) {
      std::uint64_t value;
      [[maybe_unused]] auto n = ::read(wake_fd_, &value, sizeof value);
    }
    rdma_cm_event* ev = nullptr;
    while (rdma_get_cm_event(events_, &ev) == 0) {
      rdma_cm_id* refused = nullptr;
      switch (ev->event) {
        case RDMA_CM_EVENT_CONNECT_REQUEST:
          on_connect_request(ev);
          if (!conns_.count(ev->id)) refused = ev->id;
          break;
        case RDMA_CM_EVENT_DISCONNECTED:
        case RDMA_CM_EVENT_REJECTED:
        case RDMA_CM_EVENT_CONNECT_ERROR:
        case RDMA_CM_EVENT_UNREACHABLE:
        case RDMA_CM_EVENT_DEVICE_REMOVAL:
          if (auto it = conns_.find(ev->id); it != conns_.end()) it->second->owner->request_close(it->second);
          break;
        default:
          break;
      }
      rdma_ack_cm_event(ev);
      if (refused) rdma_destroy_id(refused);  // only once its event is acked
    }
    std::vector<std::shared_ptr<ServerConn>> retired;
    {
      std::lock_guard lock(retire_mu_);
      retired.swap(retired_);
    }
    for (auto& conn : retired) {
      conns_.erase(conn->id);
      rdma_destroy_id(conn->id);
    }
  }
}

void RdmaServer::refuse(rdma_cm_id* id, Errc status, const std::string& why) {
  RejectInfo r{};
  r.magic = kCmMagic;
  r.status = static_cast<std::uint16_t>(status);
  r.length = static_cast<std::uint16_t>(std::min(why.size(), sizeof r.text));
  std::memcpy(r.text, why.data(), r.length);
  rdma_reject(id, &r, sizeof r);
}

void RdmaServer::on_connect_request(rdma_cm_event* ev) {
  rdma_cm_id* id = ev->id;
  if (!accepting_.load()) return refuse(id, Errc::peer_failure, "the server is stopping");
  ConnectRequest req{};
  if (!ev->param.conn.private_data || ev->param.conn.private_data_len < sizeof req)
    return refuse(id, Errc::protocol, "not a pskv client: no connection data");
  std::memcpy(&req, ev->param.conn.private_data, sizeof req);
  if (req.magic != kCmMagic) return refuse(id, Errc::protocol, "not a pskv client: bad magic in its connection data");
  if (req.wire_version != wire::kVersion || req.rdma_version != kRdmaVersion)
    return refuse(id, Errc::protocol,
                  "client speaks protocol " + std::to_string(req.wire_version) + "/rdma " +
                      std::to_string(req.rdma_version) + ", server " + std::to_string(wire::kVersion) + "/rdma " +
                      std::to_string(kRdmaVersion) + ": use matching pskv builds");
  const std::string address = address_text(rdma_get_peer_addr(id));
  const bool server_peer = req.worker_id == wire::kServerPeer;
  if (server_peer && !engine_->takes_server_peers()) {
    log::warn("rdma.refused",
              "server " + std::to_string(engine_->options().server_id) + " refused " + address +
                  ": it connected as a server of a replicating ring, but this server does not replicate");
    return refuse(id, Errc::permission, "connected as a server of a replicating ring; this server does not replicate");
  }
  const auth::Token* token = server_peer && options_.peer_token ? options_.peer_token.get() : options_.token.get();
  if (token && !(req.flags & kHasToken)) {
    // The REJ carries 132 bytes: the hint that matters, not the generic refusal text.
    const std::string what =
        server_peer && options_.peer_token
            ? "says it is a server but has no token: this server requires a token (--peer-token-file)"
            : "has no token: this server requires a token (--auth-token-file)";
    auth::refuse(engine_->options().server_id, address, what);  // logged; its text is longer than a REJ holds
    return refuse(id, Errc::permission, "authentication failed: this connection " + what);
  }
  std::string why;
  if (!server_peer && req.worker_id != kNoWorker && engine_->check_worker(req.worker_id, &why) != Errc::ok)
    return refuse(id, Errc::invalid_argument, why);
  if (conns_.size() >= options_.max_connections)
    return refuse(id, Errc::capacity,
                  "the server already has " + std::to_string(conns_.size()) +
                      " connections (--max-connections); try again later or raise the limit");
  const std::string host = host_text(rdma_get_peer_addr(id));
  const auto from_host = static_cast<std::size_t>(
      std::count_if(conns_.begin(), conns_.end(), [&](const auto& entry) { return entry.second->host == host; }));
  if (from_host >= options_.max_connections_per_address) {
    log::warn("rdma.refused", "server " + std::to_string(engine_->options().server_id) + " refused " + address +
                                  ": its address already has " + std::to_string(from_host) +
                                  " connections (--max-connections-per-address)");
    return refuse(id, Errc::capacity,
                  "the server already has " + std::to_string(from_host) +
                      " connections from this address (--max-connections-per-address)");
  }
  if (!id->verbs || device_name_ != ibv_get_device_name(id->verbs->device))
    return refuse(id, Errc::unsupported,
                  "this server serves device " + device_name_ + " only; connect to an address on that device");
  const std::uint32_t depth = std::clamp(std::min(options_.queue_depth, req.max_in_flight), 1u, options_.queue_depth);
  // Everything a connection registers is pinned for its life: a peer opening connections must
  // not be able to pin the machine's memory away. Clients stop at 7/8 of the budget, so that the
  // ring's other servers (replication, failover votes) still find room past any number of them.
  const std::uint64_t pins = pins_of(depth), limit = pin_limit(server_peer);
  std::atomic<std::uint64_t>& count = *options_.pinned;
  std::uint64_t pinned = count.load(std::memory_order_relaxed);
  do {
    if (pinned + pins > limit) {
      const auto mib = [](std::uint64_t b) { return std::to_string((b + (1u << 20) - 1) >> 20); };
      log::warn("rdma.budget", "server " + std::to_string(engine_->options().server_id) + " refused " + address +
                                   ": connections pin " + mib(pinned) + " MiB of the " + mib(limit) + " MiB " +
                                   (server_peer ? "" : "clients may ") + "take (--rdma-pin-mb " +
                                   mib(options_.pinned_budget_bytes) + "); this one needs " + mib(pins));
      return refuse(id, Errc::capacity,
                    "the server's connections pin " + mib(pinned) + " of the " + mib(limit) +
                        " MiB they may (--rdma-pin-mb); one more needs " + mib(pins) + " (--rdma-recv-mb)");
    }
  } while (!count.compare_exchange_weak(pinned, pinned + pins, std::memory_order_relaxed));

  auto conn = std::make_shared<ServerConn>();
  conn->tag = std::uint64_t{++accepted_} << 32;  // the generation in the high half, as tcp's tags
  conn->id = id;
  conn->owner = io_[next_io_++ % io_.size()].get();
  conn->hello_worker = server_peer ? kNoWorker : req.worker_id;
  conn->server_peer = server_peer;
  conn->token = token;
  conn->address = address;
  conn->host = host;
  conn->authenticated = !token;
  conn->handshake_deadline = std::chrono::steady_clock::now() + options_.handshake_timeout;
  if (conn->authenticated) {
    conn->worker = conn->hello_worker;
    if (conn->worker != kNoWorker) engine_->worker_joined(conn->worker);
  }
  conn->depth = depth;
  conn->pinned = pins;  // charged above
  conn->pinned_total = options_.pinned;
  try {
    // A table_pull's reply WRITEs its rows in pieces no larger than the port's largest message
    // before its SEND, so each reply buffer stands for that many more send queue entries.
    ibv_port_attr port{};
    if (ibv_query_port(ctx_, id->port_num, &port) != 0) throw Error(Errc::io, "ibv_query_port: " + errno_text(errno));
    conn->max_write = std::max<std::uint64_t>(4096, std::min<std::uint64_t>(port.max_msg_sz, 1ull << 30) / 64 * 64);
    conn->wrs_per_reply =
        1 + static_cast<std::uint32_t>((options_.region_bytes + conn->max_write - 1) / conn->max_write);
    const std::uint64_t send_wrs = std::uint64_t{2} * depth * conn->wrs_per_reply;
    if (send_wrs > static_cast<std::uint64_t>(device_.max_qp_wr) ||
        send_wrs > static_cast<std::uint64_t>(device_.max_cqe))
      throw Error(Errc::capacity, "a queue pair of depth " + std::to_string(depth) + " would need " +
                                      std::to_string(send_wrs) + " send queue entries; " + device_name_ + " has " +
                                      std::to_string(device_.max_qp_wr) + " (lower depth or --rdma-recv-mb)");
    // Sized for the whole send queue: a queue pair in error flushes its unsignaled WRITEs too.
    if (!(conn->send_cq = ibv_create_cq(ctx_, static_cast<int>(send_wrs), conn.get(), conn->owner->channel(), 0)) ||
        !(conn->recv_cq = ibv_create_cq(ctx_, static_cast<int>(depth), conn.get(), conn->owner->channel(), 0)))
      throw Error(Errc::io, "ibv_create_cq: " + errno_text(errno));
    ibv_qp_init_attr qa{};
    qa.send_cq = conn->send_cq;
    qa.recv_cq = conn->recv_cq;
    qa.qp_type = IBV_QPT_RC;
    qa.cap.max_send_wr = static_cast<std::uint32_t>(send_wrs);
    qa.cap.max_recv_wr = depth;
    qa.cap.max_send_sge = 1;
    qa.cap.max_recv_sge = 1;
    if (!(conn->qp = ibv_create_qp(pd_, &qa))) throw Error(Errc::io, "ibv_create_qp: " + errno_text(errno));
    const std::uint8_t ack_timeout = kAckTimeout;
    rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, const_cast<std::uint8_t*>(&ack_timeout),
                    sizeof ack_timeout);
    move_qp(id, conn->qp, IBV_QPS_INIT, endpoint_);
    conn->recv = RegisteredBuffer(pd_, std::size_t{depth} * kControlBytes, IBV_ACCESS_LOCAL_WRITE, "receive buffers");
    conn->send = RegisteredBuffer(pd_, std::size_t{2 * depth} * kControlBytes, IBV_ACCESS_LOCAL_WRITE, "reply buffers");
    conn->region = RegisteredBuffer(pd_, options_.region_bytes, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
                                    "a client's receive region (--rdma-recv-mb)");
    for (std::uint32_t i = 2 * depth; i-- > 0;) conn->free_send.push_back(i);
    for (std::uint32_t i = 0; i < depth; ++i) {
      ibv_sge sge{reinterpret_cast<std::uint64_t>(conn->recv.data() + std::size_t{i} * kControlBytes),
                  static_cast<std::uint32_t>(kControlBytes), conn->recv.mr.lkey()};
      ibv_recv_wr wr{}, *bad = nullptr;
      wr.wr_id = i;
      wr.sg_list = &sge;
      wr.num_sge = 1;
      if (const int rc = ibv_post_recv(conn->qp, &wr, &bad); rc != 0)
        throw Error(Errc::io, "ibv_post_recv: " + errno_text(rc));
    }
    // Ready to receive and to answer before the REP leaves, as the kernel does for its own QPs.
    move_qp(id, conn->qp, IBV_QPS_RTR, endpoint_);
    move_qp(id, conn->qp, IBV_QPS_RTS, endpoint_);
    if (!options_.busy_poll)
      for (ibv_cq* cq : {conn->send_cq, conn->recv_cq})
        if (const int rc = ibv_req_notify_cq(cq, 0); rc != 0)
          throw Error(Errc::io, "ibv_req_notify_cq: " + errno_text(rc));
  } catch (const Error& e) {
    conn->release();
    return refuse(id, e.code(), message_of(e));
  }

  const EngineOptions& eo = engine_->options();
  AcceptInfo a{};
  a.magic = kCmMagic;
  a.wire_version = wire::kVersion;
  a.rdma_version = kRdmaVersion;
  a.server_id = eo.server_id;
  a.num_workers = eo.num_workers;
  a.mode = static_cast<std::uint8_t>(eo.mode);
  a.staleness = eo.staleness;
  a.quorum = eo.mode == ConsistencyMode::sync ? (eo.sync_required ? eo.sync_required : eo.num_workers) : 0;
  a.wait_timeout_ms = static_cast<std::uint32_t>(eo.wait_timeout.count());
  a.credits = conn->depth;
  a.incarnation = engine_->epoch_seconds();
  a.control_bytes = static_cast<std::uint32_t>(kControlBytes);
  Grant& g = conn->grant;
  g.store_addr = reinterpret_cast<std::uint64_t>(engine_->store().region());
  g.store_bytes = engine_->store().region_size();
  g.store_rkey = store_mr_.rkey();
  if (eo.num_workers > 0) {
    g.clock_addr = reinterpret_cast<std::uint64_t>(clock_memory_->data());
    g.clock_bytes = ClockTable::bytes_for(eo.num_workers);
    g.clock_rkey = clock_mr_.rkey();
  }
  g.region_addr = reinterpret_cast<std::uint64_t>(conn->region.data());
  g.region_bytes = conn->region.size();
  g.region_rkey = conn->region.mr.rkey();
  if (token) {
    a.flags = kAuthRequired;
    std::memcpy(conn->client_nonce.data(), req.nonce, auth::kNonceBytes);
    conn->server_nonce = auth::random_nonce();
    const auth::Proof proof = token->server_proof(conn->client_nonce, conn->server_nonce);
    std::memcpy(a.nonce, conn->server_nonce.data(), auth::kNonceBytes);
    std::memcpy(a.proof, proof.data(), auth::kProofBytes);
  } else {
    a.grant = g;
  }
  a.max_keys = options_.limits.max_keys;
  a.max_payload_bytes = options_.limits.max_payload_bytes;

  // Adopted only now, so the completion thread sees the connection's grant and nonces complete.
  conn->owner->adopt(conn);
  conns_[id] = conn;

  rdma_conn_param param{};
  param.private_data = &a;
  param.private_data_len = sizeof a;
  param.responder_resources =
      static_cast<std::uint8_t>(std::min<int>(ev->param.conn.initiator_depth, device_.max_qp_rd_atom));
  param.initiator_depth =
      static_cast<std::uint8_t>(std::min<int>(ev->param.conn.responder_resources, device_.max_qp_init_rd_atom));
  param.retry_count = kRetryCount;
  param.rnr_retry_count = kRnrRetry;
  param.qp_num = conn->qp->qp_num;
  if (rdma_accept(id, &param) != 0) conn->owner->request_close(conn);
}

}  // namespace pskv::rdma
