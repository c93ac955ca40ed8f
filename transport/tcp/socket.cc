#include "transport/tcp/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>

#include "common/sync.h"

namespace pskv::tcp {

void Fd::reset() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

void set_keepalive(int fd, std::chrono::seconds idle) {
  int one = 1, secs = static_cast<int>(idle.count()), interval = 1, probes = 3;
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &secs, sizeof secs);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  // Keepalive stays silent while anything sent is unacknowledged, and retransmissions go on for
  // some 15 minutes (tcp_retries2): a peer cut off just after we sent it something would be
  // waited on that long. The same bound then holds for unacknowledged data too.
  unsigned user_timeout_ms = static_cast<unsigned>((secs + interval * probes) * 1000);
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

void set_io_timeouts(int fd, std::chrono::milliseconds recv, std::chrono::milliseconds send) {
  auto tv = [](std::chrono::milliseconds ms) {
    timeval t{};
    t.tv_sec = static_cast<time_t>(ms.count() / 1000);
    t.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
    return t;
  };
  const timeval r = tv(recv), s = tv(send);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &r, sizeof r);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &s, sizeof s);
}

namespace {
addrinfo* resolve(const std::string& host, std::uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &res); rc != 0)
    throw Error(Errc::invalid_argument, "cannot resolve host '" + host + "': " + gai_strerror(rc));
  return res;
}
}  // namespace

int poll_or_cancel(int fd, short events, std::chrono::milliseconds timeout, const std::atomic<bool>* cancel) {
  constexpr std::chrono::milliseconds kSlice{50};
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (cancel && cancel->load(std::memory_order_acquire)) return -1;
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return 0;
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(cancel ? std::min(left, kSlice).count() : left.count()));
    if (rc > 0) return 1;
    if (rc < 0 && errno != EINTR) return 1;  // the caller's next call reports the error
  }
}

Fd connect_tcp(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout,
               const std::atomic<bool>* cancel) {
  addrinfo* res = resolve(host, port, false);
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
    if (!fd) continue;
    int rc = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      rc = poll_or_cancel(fd.get(), POLLOUT, timeout, cancel);
      if (rc < 0) {
        freeaddrinfo(res);
        throw Error(Errc::peer_failure, "connecting to " + host + ":" + std::to_string(port) + " was cancelled");
      }
      if (rc == 0) {
        last_error = "no answer within " + std::to_string(timeout.count()) + " ms";
        continue;
      }
      int err = 0;
      socklen_t len = sizeof err;
      getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        last_error = std::strerror(err);
        continue;
      }
    } else if (rc != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    const int flags = fcntl(fd.get(), F_GETFL);
    fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
    set_nodelay(fd.get());
    freeaddrinfo(res);
    return fd;
  }
  freeaddrinfo(res);
  throw Error(Errc::peer_failure, "cannot connect to " + host + ":" + std::to_string(port) + " (" + last_error +
                                      "); is pskv-server running there and reachable?");
}

Fd listen_tcp(const std::string& host, std::uint16_t port, int backlog) {
  addrinfo* res = resolve(host, port, true);
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) continue;
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), backlog) != 0) {
      last_error = std::strerror(errno);
      continue;
    }
    freeaddrinfo(res);
    return fd;
  }
  freeaddrinfo(res);
  throw Error(Errc::io, "cannot listen on " + host + ":" + std::to_string(port) + " (" + last_error +
                            "); pick a free port or another address");
}

std::uint16_t local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len);
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
}

std::uint16_t free_loopback_port() {
  int low = 32768, high = 60999;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> low >> high;
  const int first = 10000, span = std::max(1, low - first);
  static std::atomic<int> next{static_cast<int>(::getpid() * 37 % span)};
  for (int tries = 0; tries < span; ++tries) {
    const auto port = static_cast<std::uint16_t>(first + next.fetch_add(1) % span);
    const Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) break;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(port);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return port;
  }
  throw Error(Errc::io, "no free loopback port below the ephemeral range; give the servers ports yourself");
}

namespace {
IoResult classify(ssize_t n) noexcept {
  if (n == 0) return IoResult::closed;
  if (nothing_waiting(n)) return IoResult::timeout;
  if (errno == ECONNRESET || errno == EPIPE) return IoResult::closed;
  return IoResult::error;
}

void advance(iovec*& iov, int& count, std::size_t n) noexcept {
  while (count > 0 && n >= iov->iov_len) {
    n -= iov->iov_len;
    ++iov;
    --count;
  }
  if (count > 0 && n > 0) {
    iov->iov_base = static_cast<char*>(iov->iov_base) + n;
    iov->iov_len -= n;
  }
}
}  // namespace

bool nothing_waiting(ssize_t n) noexcept {
  return n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
}

IoResult read_full(int fd, void* data, std::size_t bytes, std::chrono::nanoseconds spin,
                   std::chrono::steady_clock::time_point deadline) noexcept {
  iovec iov{data, bytes};
  return readv_full(fd, &iov, 1, spin, deadline);
}

namespace {
// Reads this thread skips spinning for after a spin that ran out: the sender is not keeping up
// (descheduled, or the cores are oversubscribed), and the spin only took a core from it.
constexpr int kSkipAfterFruitlessSpin = 16;
thread_local int t_reads_without_spin = 0;

// recvmsg(2) into the iovecs; while nothing is waiting, retries for up to `spin` (if this thread
// may spin at all), then blocks, or with `block` false returns the EAGAIN.
ssize_t receive_into(int fd, iovec* iov, int count, std::chrono::nanoseconds spin, bool block = true) noexcept {
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = static_cast<std::size_t>(std::min(count, IOV_MAX));
  ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT);
  if (!nothing_waiting(n)) return n;
  if (t_reads_without_spin > 0) {
    --t_reads_without_spin;
  } else if (const SpinTicket ticket; ticket) {
    const std::int64_t until = steady_now_ns() + spin.count();
    do {
      cpu_relax();
      n = ::recvmsg(fd, &msg, MSG_DONTWAIT);
      if (!nothing_waiting(n)) return n;
    } while (steady_now_ns() < until);
    t_reads_without_spin = kSkipAfterFruitlessSpin;
  }
  return block ? ::recvmsg(fd, &msg, 0) : ::recvmsg(fd, &msg, MSG_DONTWAIT);
}
}  // namespace

IoResult readv_full(int fd, iovec* iov, int count, std::chrono::nanoseconds spin,
                    std::chrono::steady_clock::time_point deadline) noexcept {
  const bool bounded = deadline != std::chrono::steady_clock::time_point::max();
  while (count > 0 && iov->iov_len == 0) ++iov, --count;
  while (count > 0) {
    const ssize_t n =
        spin.count() > 0 ? receive_into(fd, iov, count, spin) : ::readv(fd, iov, std::min(count, IOV_MAX));
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return classify(n);
    }
    advance(iov, count, static_cast<std::size_t>(n));
    if (bounded && count > 0 && std::chrono::steady_clock::now() > deadline) return IoResult::timeout;
  }
  return IoResult::ok;
}

ssize_t recv_spinning(int fd, void* data, std::size_t bytes, std::chrono::nanoseconds spin) noexcept {
  iovec iov{data, bytes};
  return receive_into(fd, &iov, 1, spin, /*block=*/false);
}

namespace {
// One sendmsg(2) of the iovecs with `flags` (MSG_NOSIGNAL always), EINTR retried.
ssize_t send_iov(int fd, const iovec* iov, int count, int flags) noexcept {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = static_cast<std::size_t>(std::min(count, IOV_MAX));
  ssize_t n;
  do n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | flags);
  while (n < 0 && errno == EINTR);
  return n;
}
}  // namespace

ssize_t send_some(int fd, const iovec* iov, int count, bool more) noexcept {
  return send_iov(fd, iov, count, MSG_DONTWAIT | (more ? MSG_MORE : 0));
}

IoResult writev_full(int fd, iovec* iov, int count, bool more) noexcept {
  while (count > 0 && iov->iov_len == 0) ++iov, --count;
  while (count > 0) {
    const ssize_t n = send_iov(fd, iov, count, more ? MSG_MORE : 0);
    if (n <= 0) return classify(n);
    advance(iov, count, static_cast<std::size_t>(n));
  }
  return IoResult::ok;
}

std::string io_result_text(IoResult r) {
  switch (r) {
    case IoResult::ok:
      return "ok";
    case IoResult::closed:
      return "connection closed by peer";
    case IoResult::timeout:
      return "timed out";
    case IoResult::error:
      return std::strerror(errno);
  }
  return "?";
}

}  // namespace pskv::tcp
