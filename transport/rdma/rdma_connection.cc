// Control path of the RDMA client: rdma_cm connection setup with retries and deadlines, the
// exchange of everything the data path needs (in the connect/accept private data), memory
// registration, and teardown in reverse order of creation.
#include "transport/rdma/rdma_connection.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "layout/clock_table.h"

namespace pskv::rdma {

namespace {

// A send-queue depth that leaves room for several pull rounds per slot.
constexpr std::uint32_t kMinSendDepth = 256, kMaxSendDepth = 4096;
constexpr std::uint32_t kMaxGather = 16;
// RC transport: 7 retries of a 4.096 us * 2^16 = 268 ms ACK timeout, about 2 s before a dead
// peer fails the queue pair (RETRY_EXC_ERR); 7 RNR retries means "retry forever", and credits
// keep receivers from ever running dry anyway.
constexpr std::uint8_t kAckTimeout = 16, kRetryCount = 7, kRnrRetry = 7;
constexpr std::uint8_t kMaxReadsInFlight = 16;
constexpr int kIbCmRejInvalidServiceId = 8, kIbCmRejConsumerDefined = 28;

// One rdma_cm event, acked when it goes out of scope (rdma_destroy_id waits for unacked events).
struct CmEvent {
  rdma_cm_event* ev;
  ~CmEvent() {
    if (ev) rdma_ack_cm_event(ev);
  }
};

long long ms_left(Deadline deadline) {
  return std::max<long long>(
      1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
}

}  // namespace

RdmaConnection::Verbs::~Verbs() {
  destroy_qp();
  if (cq) {
    ibv_ack_cq_events(cq, unacked_events);
    ibv_destroy_cq(cq);
  }
  if (channel) ibv_destroy_comp_channel(channel);
  if (pd) ibv_dealloc_pd(pd);
  if (ctx) ibv_close_device(ctx);
  if (id) rdma_destroy_id(id);
  if (events) rdma_destroy_event_channel(events);
}

void RdmaConnection::Verbs::destroy_qp() {
  if (qp) ibv_destroy_qp(qp);
  qp = nullptr;
}

RdmaConnection::RdmaConnection(const Uri& uri, const transport::ConnectOptions& options)
    : options_(options), endpoint_(uri.str()) {
  if (options_.max_in_flight == 0) options_.max_in_flight = 1;
  params_ = parse_params(uri);
  prepare_process();
  require_device(endpoint_);
  const Deadline deadline = Clock::now() + options.connect_timeout;
  // The server may still be starting (the first run of a binary can take seconds to load), so
  // a connection nobody accepted is retried until the deadline, with growing pauses.
  auto pause = std::chrono::milliseconds(20);
  std::string refusal;  // why the last attempt was rejected
  auto nothing_accepts = [&] {
    const std::string retried =
        options_.wait_for_listener ? ", retried for " + std::to_string(options.connect_timeout.count()) + " ms" : "";
    return Error(Errc::peer_failure, "nothing accepts connections at " + endpoint_ + " (" + refusal + retried +
                                         "); is pskv-server running with that --uri?");
  };
  for (;;) {
    std::string this_refusal;
    bool connected = false;
    try {
      connected = connect_once(uri, deadline, &this_refusal);
    } catch (const Error& e) {
      // The deadline passed while a retry still waited for its answer: the earlier rejections,
      // not that last wait, say what is wrong.
      if (e.code() == Errc::timeout && !refusal.empty()) throw nothing_accepts();
      throw;
    }
    if (connected) break;
    refusal = this_refusal;
    if (!options_.wait_for_listener || Clock::now() + pause >= deadline) throw nothing_accepts();
    for (auto slept = std::chrono::milliseconds(0); slept < pause; slept += std::chrono::milliseconds(10)) {
      if (options_.cancelled()) throw Error(Errc::peer_failure, "connecting to " + endpoint_ + " was cancelled");
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    pause = std::min(pause * 2, std::chrono::milliseconds(500));
  }
  if (const auto proof =
          auth::answer(options_.token.get(), client_nonce_, server_.flags & kAuthRequired ? server_.nonce : nullptr,
                       server_.proof, endpoint_))
    authenticate(*proof, deadline);
  // Sizes this client allocates and pins by (the clock table's staging, the rows ring that
  // mirrors the receive region): checked against what any pskv server grants.
  const std::uint64_t clock_bytes = server_.num_workers ? ClockTable::bytes_for(server_.num_workers) : 0;
  if (server_.grant.region_bytes < kDescriptorAlign || server_.grant.region_bytes > (kMaxRegionMb << 20) ||
      server_.num_workers > kMaxWorkers || server_.grant.clock_bytes != clock_bytes)
    throw Error(Errc::protocol, endpoint_ + " sent inconsistent connection data (receive region of " +
                                    std::to_string(server_.grant.region_bytes) + " bytes, " +
                                    std::to_string(server_.num_workers) + " workers, a clock table of " +
                                    std::to_string(server_.grant.clock_bytes) + " bytes)");

  info_.server_id = server_.server_id;
  info_.num_workers = server_.num_workers;
  info_.incarnation = server_.incarnation;
  const auto mode = static_cast<ConsistencyMode>(server_.mode);
  bounded_ = server_.num_workers > 0 && mode != ConsistencyMode::asp;
  staleness_ = mode == ConsistencyMode::ssp ? server_.staleness : 0;
  if (options_.worker_id != kNoWorker && options_.worker_id != wire::kServerPeer &&
      options_.worker_id >= server_.num_workers)
    throw Error(Errc::invalid_argument, "worker id " + std::to_string(options_.worker_id) +
                                            " is out of range: " + endpoint_ + " was started with --workers " +
                                            std::to_string(server_.num_workers));
  credits_ = std::min(server_.credits, recv_depth_);
  cache_ = std::make_unique<MrCache>(verbs_->pd);
  in_flight_.resize(options_.max_in_flight);
  for (std::uint32_t i = options_.max_in_flight; i-- > 0;) free_.push_back(i);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake_fd_ < 0) throw Error(Errc::io, "eventfd: " + errno_text(errno));
  last_progress_ = Clock::now();
  completer_ = std::thread([this] { completion_loop(); });
}

RdmaConnection::~RdmaConnection() {
  stopping_.store(true);
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_, &one, sizeof one);
  if (completer_.joinable()) completer_.join();
  {
    std::lock_guard lock(mu_);
    fail_all(Errc::peer_failure, "the connection to " + endpoint_ + " was closed by the client");
    // Nobody polls any more: whatever still waits for a flush is released now (the queue pair
    // is in the error state, so the NIC no longer touches those buffers).
    for (std::uint32_t i = 0; i < in_flight_.size(); ++i) {
      in_flight_[i].chains = 0;
      maybe_release(i);
    }
  }
  flush_deliveries();
  rdma_disconnect(verbs_->id);
  // Reverse order of creation: queue pair, then the memory it used, then CQ, PD, id, channel.
  verbs_->destroy_qp();
  in_flight_.clear();
  cache_.reset();
  rows_ring_ = RegisteredBuffer();
  recv_ = RegisteredBuffer();
  verbs_.reset();
  ::close(wake_fd_);
}

bool RdmaConnection::connect_once(const Uri& uri, Deadline deadline, std::string* refusal) {
  auto v = std::make_unique<Verbs>();
  v->events = rdma_create_event_channel();
  if (!v->events) {
    if (errno == ENODEV || errno == ENOENT) require_device(endpoint_);
    throw Error(Errc::io, "rdma_create_event_channel: " + errno_text(errno) + " (is the rdma_ucm module loaded?)");
  }
  set_nonblocking(v->events->fd);
  if (rdma_create_id(v->events, &v->id, nullptr, RDMA_PS_TCP) != 0)
    throw Error(Errc::io, "rdma_create_id: " + errno_text(errno));

  auto wait_event = [&](rdma_cm_event_type want, const char* step) -> CmEvent {
    rdma_cm_event* ev = next_cm_event(v->events, deadline, options_.cancel);
    if (!ev)
      throw Error(Errc::timeout, "no answer from " + endpoint_ + " within " +
                                     std::to_string(options_.connect_timeout.count()) + " ms (" + step +
                                     "); is the address reachable over RDMA and the server running?");
    CmEvent e{ev};
    if (ev->event == want) return e;
    switch (ev->event) {
      case RDMA_CM_EVENT_ADDR_ERROR:
        throw Error(Errc::peer_failure, endpoint_ + ": rdma_cm cannot map " + uri.host + " to an RDMA device (" +
                                            errno_text(-ev->status) +
                                            "); use the address of the server's RDMA interface (in the Soft-RoCE VM: "
                                            "$RXE_IP, not 127.0.0.1)");
      case RDMA_CM_EVENT_ROUTE_ERROR:
        throw Error(Errc::peer_failure,
                    endpoint_ + ": no RDMA route to " + uri.host + " (" + errno_text(-ev->status) + ")");
      case RDMA_CM_EVENT_UNREACHABLE:
        throw Error(Errc::peer_failure, endpoint_ + " is unreachable over RDMA (" + std::string(step) +
                                            " got no response); is the server host up?");
      case RDMA_CM_EVENT_CONNECT_ERROR:
        throw Error(Errc::peer_failure, "connecting to " + endpoint_ + " failed (" + errno_text(-ev->status) + ")");
      default:
        throw Error(Errc::peer_failure, "connecting to " + endpoint_ + ": unexpected rdma_cm event " +
                                            rdma_event_str(ev->event) + " during " + step);
    }
  };

  sockaddr_storage addr = resolve_host(uri.host, uri.port, false);
  if (rdma_resolve_addr(v->id, nullptr, reinterpret_cast<sockaddr*>(&addr),
                        static_cast<int>(std::min<long long>(ms_left(deadline), 5000))) != 0)
    throw Error(Errc::peer_failure, endpoint_ + ": rdma_resolve_addr: " + errno_text(errno) +
                                        " (use the address of an RDMA interface; in the Soft-RoCE VM: $RXE_IP)");
  wait_event(RDMA_CM_EVENT_ADDR_RESOLVED, "address resolution");
  ibv_context* ctx = v->ctx = open_own_context(v->id->verbs);
  check_and_log_device(v->id, ctx, params_, "client of", endpoint_);

  ibv_device_attr dev{};
  if (ibv_query_device(ctx, &dev) != 0) throw Error(Errc::io, "ibv_query_device: " + errno_text(errno));
  recv_depth_ = std::min<std::uint32_t>(options_.max_in_flight, static_cast<std::uint32_t>(dev.max_qp_wr));
  send_depth_ = std::clamp<std::uint32_t>(options_.max_in_flight * 4, kMinSendDepth, kMaxSendDepth);
  send_depth_ = std::min<std::uint32_t>(send_depth_, static_cast<std::uint32_t>(dev.max_qp_wr));
  max_sge_ = std::min<std::uint32_t>({kMaxGather, static_cast<std::uint32_t>(dev.max_sge),
                                      static_cast<std::uint32_t>(dev.max_sge_rd ? dev.max_sge_rd : dev.max_sge)});
  if (max_sge_ < 2)
    throw Error(Errc::unsupported, endpoint_ + ": the RDMA device supports fewer than 2 SGEs per request");
  const int cqe = std::min<int>(dev.max_cqe, static_cast<int>(send_depth_ + recv_depth_));
  ibv_port_attr port{};
  if (ibv_query_port(ctx, v->id->port_num, &port) != 0) throw Error(Errc::io, "ibv_query_port: " + errno_text(errno));
  max_message_ = port.max_msg_sz;

  if (!(v->pd = ibv_alloc_pd(ctx))) throw Error(Errc::io, "ibv_alloc_pd: " + errno_text(errno));
  if (!(v->channel = ibv_create_comp_channel(ctx)))
    throw Error(Errc::io, "ibv_create_comp_channel: " + errno_text(errno));
  set_nonblocking(v->channel->fd);
  if (!(v->cq = ibv_create_cq(ctx, cqe, nullptr, v->channel, 0)))
    throw Error(Errc::io, "ibv_create_cq(" + std::to_string(cqe) + "): " + errno_text(errno));
  ibv_qp_init_attr qa{};
  qa.send_cq = qa.recv_cq = v->cq;
  qa.qp_type = IBV_QPT_RC;
  qa.sq_sig_all = 0;
  qa.cap.max_send_wr = send_depth_;
  qa.cap.max_recv_wr = recv_depth_;
  qa.cap.max_send_sge = max_sge_;
  qa.cap.max_recv_sge = 1;
  if (!(v->qp = ibv_create_qp(v->pd, &qa)))
    throw Error(Errc::io, "ibv_create_qp (send depth " + std::to_string(send_depth_) + ", receive depth " +
                              std::to_string(recv_depth_) + "): " + errno_text(errno));
  const std::uint8_t ack_timeout = kAckTimeout;
  rdma_set_option(v->id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, const_cast<std::uint8_t*>(&ack_timeout),
                  sizeof ack_timeout);  // best effort: older kernels keep their default
  if (rdma_resolve_route(v->id, static_cast<int>(std::min<long long>(ms_left(deadline), 5000))) != 0)
    throw Error(Errc::peer_failure, endpoint_ + ": rdma_resolve_route: " + errno_text(errno));
  wait_event(RDMA_CM_EVENT_ROUTE_RESOLVED, "route resolution");
  move_qp(v->id, v->qp, IBV_QPS_INIT, endpoint_);

  RegisteredBuffer recv(v->pd, std::size_t{recv_depth_} * kControlBytes, IBV_ACCESS_LOCAL_WRITE, "reply buffers");
  for (std::uint32_t i = 0; i < recv_depth_; ++i) {
    ibv_sge sge{reinterpret_cast<std::uint64_t>(recv.data() + std::size_t{i} * kControlBytes),
                static_cast<std::uint32_t>(kControlBytes), recv.mr.lkey()};
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = make_wr_id(WrKind::recv, i);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (const int rc = ibv_post_recv(v->qp, &wr, &bad); rc != 0)
      throw Error(Errc::io, "ibv_post_recv: " + errno_text(rc));
  }

  ConnectRequest req{kCmMagic, wire::kVersion, kRdmaVersion, options_.worker_id, recv_depth_, 0, {}};
  if (options_.token) {
    client_nonce_ = auth::random_nonce();
    req.flags = kHasToken;
    std::memcpy(req.nonce, client_nonce_.data(), auth::kNonceBytes);
  }
  rdma_conn_param param{};
  param.private_data = &req;
  param.private_data_len = sizeof req;
  param.initiator_depth = static_cast<std::uint8_t>(std::min<int>(dev.max_qp_init_rd_atom, kMaxReadsInFlight));
  param.responder_resources = static_cast<std::uint8_t>(std::min<int>(dev.max_qp_rd_atom, kMaxReadsInFlight));
  param.retry_count = kRetryCount;
  param.rnr_retry_count = kRnrRetry;
  param.qp_num = v->qp->qp_num;
  if (rdma_connect(v->id, &param) != 0)
    throw Error(Errc::peer_failure, "rdma_connect to " + endpoint_ + ": " + errno_text(errno));

  rdma_cm_event* raw = next_cm_event(v->events, deadline, options_.cancel);
  if (!raw)
    throw Error(Errc::timeout, endpoint_ + " did not accept the connection within " +
                                   std::to_string(options_.connect_timeout.count()) +
                                   " ms; is the server overloaded or hung?");
  CmEvent ev{raw};
  if (raw->event == RDMA_CM_EVENT_REJECTED) {
    const void* data = raw->param.conn.private_data;
    RejectInfo r{};
    if (raw->status == kIbCmRejConsumerDefined && data && raw->param.conn.private_data_len >= sizeof r) {
      std::memcpy(&r, data, sizeof r);
      if (r.magic == kCmMagic)
        throw Error(static_cast<Errc>(r.status),
                    endpoint_ + " refused the connection: " +
                        std::string(r.text, std::min<std::size_t>(r.length, sizeof r.text)));
    }
    *refusal = raw->status == kIbCmRejInvalidServiceId ? std::string("rejected: no listener on that port")
                                                       : "rejected with IB CM reason " + std::to_string(raw->status);
    return false;
  }
  // With a queue pair of our own, rdma_cm reports the server's answer as CONNECT_RESPONSE and
  // leaves the state changes (and the final RTU, rdma_establish) to us.
  if (raw->event != RDMA_CM_EVENT_CONNECT_RESPONSE) {
    if (raw->event == RDMA_CM_EVENT_UNREACHABLE)
      throw Error(Errc::peer_failure, endpoint_ + " is unreachable over RDMA (the connection request timed out)");
    throw Error(Errc::peer_failure, "connecting to " + endpoint_ + ": " + rdma_event_str(raw->event) + " (" +
                                        errno_text(raw->status < 0 ? -raw->status : raw->status) + ")");
  }
  if (!raw->param.conn.private_data || raw->param.conn.private_data_len < sizeof(AcceptInfo))
    throw Error(Errc::protocol, endpoint_ + " accepted without pskv connection data: is it a pskv-server?");
  std::memcpy(&server_, raw->param.conn.private_data, sizeof server_);
  if (server_.magic != kCmMagic)
    throw Error(Errc::protocol, endpoint_ + " is not a pskv rdma server (bad magic in its accept data)");
  if (server_.wire_version != wire::kVersion || server_.rdma_version != kRdmaVersion)
    throw Error(Errc::protocol, endpoint_ + " speaks protocol " + std::to_string(server_.wire_version) + "/rdma " +
                                    std::to_string(server_.rdma_version) + ", this client " +
                                    std::to_string(wire::kVersion) + "/rdma " + std::to_string(kRdmaVersion) +
                                    ": run matching pskv builds");
  if (server_.credits == 0 || server_.control_bytes != kControlBytes)
    throw Error(Errc::protocol, endpoint_ + " sent inconsistent connection data (credits " +
                                    std::to_string(server_.credits) + ", control buffers " +
                                    std::to_string(server_.control_bytes) + " bytes)");
  move_qp(v->id, v->qp, IBV_QPS_RTR, endpoint_);
  move_qp(v->id, v->qp, IBV_QPS_RTS, endpoint_);
  if (rdma_establish(v->id) != 0)
    throw Error(Errc::peer_failure, "rdma_establish with " + endpoint_ + ": " + errno_text(errno));
  verbs_ = std::move(v);
  recv_ = std::move(recv);
  return true;
}

void RdmaConnection::authenticate(const auth::Proof& proof, Deadline deadline) {
  constexpr std::size_t kHeader = sizeof(wire::FrameHeader);
  RegisteredBuffer out(verbs_->pd, kHeader + auth::kProofBytes, IBV_ACCESS_LOCAL_WRITE, "the authentication message");
  const wire::FrameHeader h = wire::make_header(wire::Op::auth, 0, 0, auth::kProofBytes);
  std::memcpy(out.data(), &h, kHeader);
  std::memcpy(out.data() + kHeader, proof.data(), auth::kProofBytes);
  ibv_sge sge{reinterpret_cast<std::uint64_t>(out.data()), static_cast<std::uint32_t>(out.size()), out.mr.lkey()};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = make_wr_id(WrKind::send_end, 0, 1);
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (const int rc = ibv_post_send(verbs_->qp, &wr, &bad); rc != 0)
    throw Error(Errc::io, "ibv_post_send (authentication): " + errno_text(rc));
  // The one exchange before the completion thread exists: poll for the send and the reply.
  bool sent = false;
  std::uint32_t reply = UINT32_MAX, reply_bytes = 0;
  while (!sent || reply == UINT32_MAX) {
    ibv_wc wc[4];
    const int n = ibv_poll_cq(verbs_->cq, 4, wc);
    if (n < 0) throw Error(Errc::io, "ibv_poll_cq during authentication with " + endpoint_);
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS)
        throw Error(Errc::permission, endpoint_ + " closed the connection during authentication (" +
                                          ibv_wc_status_str(wc[i].status) + "); does its token match this client's?");
      if (wr_kind(wc[i].wr_id) == WrKind::recv) {
        reply = wr_index(wc[i].wr_id);
        reply_bytes = wc[i].byte_len;
      } else {
        sent = true;
      }
    }
    if (n == 0) {
      if (options_.cancelled()) throw Error(Errc::peer_failure, "authenticating with " + endpoint_ + " was cancelled");
      if (Clock::now() >= deadline)
        throw Error(Errc::timeout, endpoint_ + " did not answer the authentication within " +
                                       std::to_string(options_.connect_timeout.count()) + " ms");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  const std::byte* p = recv_.data() + std::size_t{reply} * kControlBytes;
  wire::FrameHeader r{};
  std::string why;
  if (reply_bytes < kHeader) throw Error(Errc::protocol, endpoint_ + " sent a truncated authentication reply");
  std::memcpy(&r, p, kHeader);
  if (Errc e = wire::validate_header(r, options_.limits, true, &why); e != Errc::ok)
    throw Error(e, "authentication reply from " + endpoint_ + ": " + why);
  if (r.payload_bytes > reply_bytes - kHeader)
    throw Error(Errc::protocol, endpoint_ + " sent a truncated authentication reply");
  if (r.status != 0)
    throw Error(static_cast<Errc>(r.status), endpoint_ + " refused the connection: " +
                                                 std::string(reinterpret_cast<const char*>(p + kHeader),
                                                             std::min<std::uint64_t>(r.payload_bytes, 4096)));
  if (r.payload_bytes != sizeof(Grant))
    throw Error(Errc::protocol, endpoint_ + " sent a malformed authentication reply");
  std::memcpy(&server_.grant, p + kHeader, sizeof(Grant));
  ibv_sge rsge{reinterpret_cast<std::uint64_t>(p), static_cast<std::uint32_t>(kControlBytes), recv_.mr.lkey()};
  ibv_recv_wr rwr{}, *rbad = nullptr;
  rwr.wr_id = make_wr_id(WrKind::recv, reply);
  rwr.sg_list = &rsge;
  rwr.num_sge = 1;
  if (const int rc = ibv_post_recv(verbs_->qp, &rwr, &rbad); rc != 0)
    throw Error(Errc::io, "ibv_post_recv: " + errno_text(rc));
}

void RdmaConnection::register_buffer(void* data, std::size_t bytes) {
  cache_->add(data, bytes);
}

void RdmaConnection::ensure_staging(InFlight& op, std::size_t bytes) {
  if (op.staging.size() >= bytes) return;
  std::size_t size = 4096;
  while (size < bytes) size *= 2;
  op.staging = RegisteredBuffer(verbs_->pd, size, IBV_ACCESS_LOCAL_WRITE, "request staging");
}

std::uint32_t RdmaConnection::local_key(InFlight& op, const void* data, std::size_t bytes) {
  if (const std::uint32_t lkey = cache_->find(data, bytes)) return lkey;
  if (bytes <= kBounceBytes) return 0;
  op.temporary.emplace_back(verbs_->pd, const_cast<void*>(data), bytes, IBV_ACCESS_LOCAL_WRITE,
                            "an unregistered request buffer (call Client::register_buffer to register it once)");
  return op.temporary.back().lkey();
}

}  // namespace pskv::rdma
