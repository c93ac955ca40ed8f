#include "transport/rdma/verbs.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/mman.h>

#include <charconv>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

namespace pskv::rdma {

void prepare_process() {
  static std::once_flag once;
  std::call_once(once, [] {
    // A failure leaves fork-unsafe (but working) verbs; there is nothing better to do than say so.
    if (const int rc = ibv_fork_init(); rc != 0)
      std::fprintf(stderr, "pskv rdma: ibv_fork_init failed (%s); do not fork() after connecting\n", std::strerror(rc));
  });
}

void require_device(const std::string& endpoint) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list) ibv_free_device_list(list);
  if (n > 0) return;
  throw Error(Errc::no_device,
              "cannot use " + endpoint +
                  ": no RDMA device found (ibv_get_device_list is empty): load a driver (e.g. `modprobe rdma_rxe` and "
                  "`rdma link add rxe0 type rxe netdev eth0` for Soft-RoCE) or use tcp://");
}

EndpointParams parse_params(const Uri& uri) {
  EndpointParams p;
  auto number = [&](const std::string& key, const std::string& v, int max) {
    int value = -1;
    auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), value);
    if (ec != std::errc() || end != v.data() + v.size() || value < 0 || value > max)
      throw Error(Errc::invalid_argument,
                  "bad " + key + "=" + v + " in " + uri.str() + ": expected 0-" + std::to_string(max));
    return value;
  };
  for (const auto& [k, v] : uri.params) {
    if (k == "dev") {
      p.device = v;
    } else if (k == "port") {
      p.port = number(k, v, 255);
    } else if (k == "gid") {
      p.gid_index = number(k, v, 65535);
    } else if (k == "poll") {
      if (v != "busy" && v != "event")
        throw Error(Errc::invalid_argument,
                    "bad poll=" + v + " in " + uri.str() + ": expected poll=busy or poll=event");
      p.busy_poll = v == "busy";
    } else {
      throw Error(Errc::invalid_argument, "unknown parameter '" + k + "' in " + uri.str() +
                                              " (rdma URIs accept dev=NAME, port=N, gid=INDEX and poll=busy|event)");
    }
  }
  return p;
}

namespace {

const char* gid_type_name(std::uint32_t type) {
  switch (type) {
    case IBV_GID_TYPE_IB:
      return "IB";
    case IBV_GID_TYPE_ROCE_V1:
      return "RoCE v1";
    case IBV_GID_TYPE_ROCE_V2:
      return "RoCE v2";
  }
  return "unknown type";
}

std::string gid_text(const ibv_gid& gid) {
  char buf[INET6_ADDRSTRLEN] = {};
  inet_ntop(AF_INET6, gid.raw, buf, sizeof buf);
  return buf;
}

// The GID RoCE derives from an IP address: IPv4 maps to ::ffff:a.b.c.d.
ibv_gid gid_of(const sockaddr* addr) {
  ibv_gid g{};
  if (addr->sa_family == AF_INET) {
    g.raw[10] = g.raw[11] = 0xff;
    std::memcpy(&g.raw[12], &reinterpret_cast<const sockaddr_in*>(addr)->sin_addr, 4);
  } else if (addr->sa_family == AF_INET6) {
    std::memcpy(g.raw, &reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr, 16);
  }
  return g;
}

}  // namespace

void check_and_log_device(rdma_cm_id* id, ibv_context* ctx, const EndpointParams& want, const std::string& role,
                          const std::string& endpoint) {
  const std::string device = ibv_get_device_name(ctx->device);
  const int port = id->port_num;
  ibv_gid sgid = id->route.addr.addr.ibaddr.sgid;
  const ibv_gid zero{};
  if (std::memcmp(&sgid, &zero, sizeof sgid) == 0) sgid = gid_of(rdma_get_local_addr(id));
  // rdma_cm picks the GID of the address (RoCE v2 by default): find its index for the log.
  int gid_index = -1;
  std::uint32_t gid_type = IBV_GID_TYPE_IB;
  ibv_port_attr pa{};
  if (ibv_query_port(ctx, static_cast<std::uint8_t>(port), &pa) == 0) {
    for (int i = 0; i < pa.gid_tbl_len; ++i) {
      ibv_gid_entry e{};
      if (ibv_query_gid_ex(ctx, port, i, &e, 0) != 0) continue;
      if (std::memcmp(e.gid.raw, sgid.raw, 16) != 0) continue;
      if (gid_index < 0 || e.gid_type == IBV_GID_TYPE_ROCE_V2) {
        gid_index = i;
        gid_type = e.gid_type;
      }
    }
  }
  const std::string chosen = "device " + device + " port " + std::to_string(port) + " gid " +
                             (gid_index < 0 ? std::string("?") : std::to_string(gid_index));
  auto mismatch = [&](const std::string& asked) {
    throw Error(Errc::invalid_argument, endpoint + ": " + asked +
                                            " was asked for, but rdma_cm routes that address over " + chosen +
                                            "; use an IP address of the wanted device and port (see `rdma link`)");
  };
  if (!want.device.empty() && want.device != device) mismatch("dev=" + want.device);
  if (want.port >= 0 && want.port != port) mismatch("port=" + std::to_string(want.port));
  if (want.gid_index >= 0 && want.gid_index != gid_index) mismatch("gid=" + std::to_string(want.gid_index));

  const std::string line = "pskv rdma: " + chosen + " (" + (gid_index < 0 ? "" : gid_type_name(gid_type)) +
                           (gid_index < 0 ? "" : ", ") + gid_text(sgid) + ", MTU " +
                           std::to_string(pa.active_mtu ? 128 << pa.active_mtu : 0) + ") for " + role + " " + endpoint +
                           (want.busy_poll ? ", busy polling" : ", event-driven completions");
  static std::mutex mu;
  static std::set<std::string> logged;
  std::lock_guard lock(mu);
  if (logged.insert(role + chosen).second) std::fprintf(stderr, "%s\n", line.c_str());
}

ibv_context* open_own_context(ibv_context* cm_context) {
  const std::string name = ibv_get_device_name(cm_context->device);
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  ibv_context* ctx = nullptr;
  int err = ENODEV;
  for (int i = 0; i < n && !ctx; ++i)
    if (name == ibv_get_device_name(list[i])) {
      ctx = ibv_open_device(list[i]);
      err = errno;
    }
  if (list) ibv_free_device_list(list);
  if (!ctx) throw Error(Errc::io, "cannot open RDMA device " + name + ": " + errno_text(err));
  return ctx;
}

void move_qp(rdma_cm_id* id, ibv_qp* qp, ibv_qp_state state, const std::string& endpoint) {
  ibv_qp_attr attr{};
  int mask = 0;
  attr.qp_state = state;
  if (rdma_init_qp_attr(id, &attr, &mask) != 0)
    throw Error(Errc::peer_failure,
                endpoint + ": rdma_init_qp_attr(" + std::to_string(state) + "): " + errno_text(errno));
  if (state == IBV_QPS_INIT)
    attr.qp_access_flags |= IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
  if (const int rc = ibv_modify_qp(qp, &attr, mask); rc != 0)
    throw Error(Errc::io, endpoint + ": ibv_modify_qp to state " + std::to_string(state) + ": " + errno_text(rc));
}

sockaddr_storage resolve_host(const std::string& host, std::uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0 || !res)
    throw Error(Errc::invalid_argument, "cannot resolve host '" + host + "': " + gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  freeaddrinfo(res);
  return ss;
}

PinnedBuffer::PinnedBuffer(std::size_t bytes) : size_(bytes) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    throw Error(Errc::capacity,
                "cannot map " + std::to_string(bytes) + " bytes for RDMA buffers (" + errno_text(errno) + ")");
  data_ = static_cast<std::byte*>(p);
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) munmap(data_, size_);
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(size_, o.size_);
  return *this;
}

void throw_registration_error(int err, std::size_t bytes, const std::string& what) {
  const std::string base =
      "ibv_reg_mr of " + std::to_string(bytes) + " bytes (" + what + ") failed: " + errno_text(err);
  if (err == ENOMEM || err == EPERM || err == EACCES)
    throw Error(Errc::permission,
                base +
                    ": the locked-memory limit is too low; raise the memlock limit: ulimit -l unlimited "
                    "(or memlock in /etc/security/limits.conf, LimitMEMLOCK= for systemd services)");
  throw Error(Errc::io, base);
}

MemoryRegion::MemoryRegion(ibv_pd* pd, void* addr, std::size_t bytes, int access, const std::string& what) {
  mr_ = ibv_reg_mr(pd, addr, bytes, access);
  if (!mr_) throw_registration_error(errno, bytes, what);
}

MemoryRegion::~MemoryRegion() {
  if (mr_) ibv_dereg_mr(mr_);
}

MemoryRegion& MemoryRegion::operator=(MemoryRegion&& o) noexcept {
  std::swap(mr_, o.mr_);
  return *this;
}

rdma_cm_event* next_cm_event(rdma_event_channel* channel, Deadline deadline, const std::atomic<bool>* cancel) {
  for (;;) {
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(channel, &ev) == 0) return ev;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
      throw Error(Errc::io, "rdma_get_cm_event: " + errno_text(errno));
    if (cancel && cancel->load(std::memory_order_acquire))
      throw Error(Errc::peer_failure, "the connection's set-up was cancelled");
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return nullptr;
    pollfd p{channel->fd, POLLIN, 0};
    ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count() + 1, cancel ? 50 : 1000)));
  }
}

std::string message_of(const Error& e) {
  const std::string what = e.what();
  const std::string prefix = "pskv " + std::string(errc_name(e.code())) + ": ";
  return what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what;
}

void set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0)
    throw Error(Errc::io, "fcntl(O_NONBLOCK): " + errno_text(errno));
}

std::string errno_text(int err) {
  return std::strerror(err);
}

std::string wc_text(const ibv_wc& wc) {
  std::string name;
  switch (wc.status) {
    case IBV_WC_RETRY_EXC_ERR:
      name = "RETRY_EXC_ERR";
      break;
    case IBV_WC_RNR_RETRY_EXC_ERR:
      name = "RNR_RETRY_EXC_ERR";
      break;
    case IBV_WC_REM_ACCESS_ERR:
      name = "REM_ACCESS_ERR";
      break;
    case IBV_WC_REM_INV_REQ_ERR:
      name = "REM_INV_REQ_ERR";
      break;
    case IBV_WC_REM_OP_ERR:
      name = "REM_OP_ERR";
      break;
    case IBV_WC_LOC_PROT_ERR:
      name = "LOC_PROT_ERR";
      break;
    case IBV_WC_LOC_LEN_ERR:
      name = "LOC_LEN_ERR";
      break;
    case IBV_WC_WR_FLUSH_ERR:
      name = "WR_FLUSH_ERR";
      break;
    default:
      name = "status " + std::to_string(wc.status);
      break;
  }
  return name + " (" + ibv_wc_status_str(wc.status) + ")";
}

}  // namespace pskv::rdma
