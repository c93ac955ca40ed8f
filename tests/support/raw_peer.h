// A hand-driven TCP peer for tests that speak the wire protocol themselves (docs/protocol.md):
// frames built byte by byte, replies read one at a time, hang-ups observed. Header-only, like
// pushes.h. Thread-safety: none; one thread drives a RawPeer.
#pragma once

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>

#include <chrono>
#include <span>
#include <string>
#include <utility>

#include "pskv/types.h"
#include "transport/tcp/socket.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv::testing {

class RawPeer {
 public:
  explicit RawPeer(const std::string& uri, std::chrono::milliseconds io_timeout = std::chrono::seconds(10)) {
    const Uri u = parse_uri(uri);
    fd_ = tcp::connect_tcp(u.host, u.port, std::chrono::seconds(5));
    tcp::set_io_timeouts(fd_.get(), io_timeout, io_timeout);
  }
  void send(const void* p, std::size_t n) { ASSERT_EQ(::send(fd_.get(), p, n, MSG_NOSIGNAL), ssize_t(n)); }
  // A request of `op` with these keys and no payload (a pull, a clock, a barrier...).
  void request(wire::Op op, std::uint64_t id, std::span<const wire::KeyEntry> keys, std::uint64_t arg0 = 0) {
    wire::FrameHeader h = wire::make_header(op, id, static_cast<std::uint32_t>(keys.size()), 0, arg0);
    send(&h, sizeof h);
    if (!keys.empty()) send(keys.data(), keys.size_bytes());
  }
  void hello(std::uint32_t worker = kNoWorker) {
    wire::FrameHeader h = wire::make_header(wire::Op::hello, 1, 0, 0, worker, wire::kVersion);
    send(&h, sizeof h);
    wire::FrameHeader r{};
    ASSERT_EQ(tcp::read_full(fd_.get(), &r, sizeof r), tcp::IoResult::ok);
    ASSERT_EQ(r.status, 0);
  }
  // The next reply's status and its payload as text; {-1, "closed"} if the server hung up instead.
  std::pair<int, std::string> reply() {
    wire::FrameHeader r{};
    if (tcp::read_full(fd_.get(), &r, sizeof r) != tcp::IoResult::ok) return {-1, "closed"};
    std::string text(r.payload_bytes, '\0');
    if (!text.empty() && tcp::read_full(fd_.get(), text.data(), text.size()) != tcp::IoResult::ok)
      return {-1, "closed"};
    return {r.status, text};
  }
  bool closed_by_server() {
    char c;
    return ::recv(fd_.get(), &c, 1, 0) <= 0;
  }
  // Whether the server hangs up within `wait` (a byte that arrives instead counts as open).
  bool closed_by_server_within(std::chrono::milliseconds wait) {
    pollfd pfd{fd_.get(), POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(wait.count())) <= 0) return false;
    char c;
    return ::recv(fd_.get(), &c, 1, MSG_DONTWAIT) == 0 || (pfd.revents & (POLLHUP | POLLERR));
  }
  int fd() const { return fd_.get(); }

 private:
  tcp::Fd fd_;
};

}  // namespace pskv::testing
