// Blocking-socket helpers with deadlines, shared by the TCP client and server.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <string>

#include "pskv/error.h"

namespace pskv::tcp {

// Owns a file descriptor. Thread-safety: none; share by reference only while alive.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) noexcept : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  int get() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return fd_ >= 0; }
  int release() noexcept {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset() noexcept;

 private:
  int fd_ = -1;
};

// Resolves and connects (IPv4/IPv6) within `timeout`, or until *cancel turns true; sets
// TCP_NODELAY. Throws Error.
Fd connect_tcp(const std::string& host, std::uint16_t port, std::chrono::milliseconds timeout,
               const std::atomic<bool>* cancel = nullptr);
// poll() of one fd for `events` within `timeout`, looking at *cancel (if given) every 50 ms:
// 1 ready, 0 timed out, -1 cancelled.
int poll_or_cancel(int fd, short events, std::chrono::milliseconds timeout, const std::atomic<bool>* cancel);
// Binds and listens; port 0 picks a free port (see local_port).
Fd listen_tcp(const std::string& host, std::uint16_t port, int backlog);
std::uint16_t local_port(int fd);
// A loopback TCP port that binds now, below the ephemeral range (which connect() and bind(0) draw
// local ports from), for servers that must come back at the same address after a restart: a port
// in that range can meanwhile be taken by a client connection as its local port. Successive calls
// in one process return different ports. Single node only.
std::uint16_t free_loopback_port();
void set_io_timeouts(int fd, std::chrono::milliseconds recv, std::chrono::milliseconds send);
void set_nodelay(int fd);
// TCP keepalive probing after `idle` of silence, so a peer whose link went away without a FIN
// or RST is noticed (its connection errors out) instead of being waited on forever; and the same
// bound (idle + 3 s of probes) on data it never acknowledges (TCP_USER_TIMEOUT).
void set_keepalive(int fd, std::chrono::seconds idle);

// Outcome of a full read/write on a blocking socket with SO_RCVTIMEO/SO_SNDTIMEO set.
enum class IoResult { ok, closed, timeout, error };

// How long a reader in the middle of a large frame retries without sleeping once nothing is
// waiting. Over loopback the sender's core also runs the receiver's TCP input: a receiver asleep
// in recv costs it a wake-up per segment (an IPI, and a VM exit when virtualised), while one that
// polls takes those segments off its socket backlog on its own core. The rest of a frame is
// already on its way, so the wait is short; past this, the reader sleeps as before.
inline constexpr std::chrono::microseconds kMidFrameSpin{50};

// With `spin`, a read that finds nothing waiting retries without sleeping for up to `spin` since
// the last bytes came in, if this thread may spin (SpinTicket), before it blocks. SO_RCVTIMEO
// still bounds the blocking.
// With a `deadline`, a read still short of its bytes then returns IoResult::timeout (checked
// between receives, so up to one SO_RCVTIMEO late): a peer that trickles a frame a byte at a
// time keeps every receive under SO_RCVTIMEO.
IoResult read_full(
    int fd, void* data, std::size_t bytes, std::chrono::nanoseconds spin = {},
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max()) noexcept;
// Reads exactly the bytes the iovecs describe; modifies `iov` while progressing.
IoResult readv_full(
    int fd, iovec* iov, int count, std::chrono::nanoseconds spin = {},
    std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max()) noexcept;
// Whether a receive's result `n` (with errno) says nothing was waiting: a MSG_DONTWAIT receive
// that found the socket empty, or a blocking one that SO_RCVTIMEO cut short.
bool nothing_waiting(ssize_t n) noexcept;
// One receive that never blocks: while nothing is waiting it retries for up to `spin` (under the
// same ration as read_full), then returns -1 with EAGAIN. For non-blocking readers that hand the
// socket back to epoll rather than sleep in recv.
ssize_t recv_spinning(int fd, void* data, std::size_t bytes, std::chrono::nanoseconds spin) noexcept;
// One non-blocking sendmsg(2) of the iovecs (EINTR retried): the bytes taken, or -1 with errno
// (EAGAIN: the socket buffer is full). `more` as for writev_full.
ssize_t send_some(int fd, const iovec* iov, int count, bool more = false) noexcept;
// `more` (MSG_MORE) holds back a last partial segment for the next write, to go out with it.
IoResult writev_full(int fd, iovec* iov, int count, bool more = false) noexcept;
std::string io_result_text(IoResult r);

}  // namespace pskv::tcp
