#include "transport/tcp/socket.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

namespace pskv::tcp {
namespace {

using namespace std::chrono_literals;

struct Pair {
  Pair() {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    reader = Fd(fds[0]);
    writer = Fd(fds[1]);
  }
  Fd reader, writer;
};

// Bytes that come in pieces, each after a pause far longer than the spin, so the reader
// spins, gives up, sleeps, and is woken by the next piece several times over.
TEST(SocketSpin, ReadvFullGathersBytesThatArriveLongAfterTheSpin) {
  Pair p;
  std::vector<unsigned char> sent(3 * 4096);
  std::iota(sent.begin(), sent.end(), 0);
  std::thread writer([&] {
    for (std::size_t at = 0; at < sent.size(); at += 4096) {
      std::this_thread::sleep_for(20ms);
      ASSERT_EQ(::write(p.writer.get(), sent.data() + at, 4096), 4096);
    }
  });
  std::vector<unsigned char> a(5000), b(sent.size() - a.size());
  iovec iov[] = {{a.data(), a.size()}, {b.data(), b.size()}};
  EXPECT_EQ(readv_full(p.reader.get(), iov, 2, kMidFrameSpin), IoResult::ok);
  writer.join();
  a.insert(a.end(), b.begin(), b.end());
  EXPECT_EQ(a, sent);
}

TEST(SocketSpin, ReceiveTimeoutStillBoundsAReaderThatSpun) {
  Pair p;
  set_io_timeouts(p.reader.get(), 100ms, 100ms);
  ASSERT_EQ(::write(p.writer.get(), "ab", 2), 2);  // half of what the reader wants
  char buf[4];
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(read_full(p.reader.get(), buf, sizeof buf, kMidFrameSpin), IoResult::timeout);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 90ms);
  EXPECT_LT(took, 5s);
}

TEST(SocketSpin, RecvSomeReportsAClosedPeerAndReturnsWhatIsThere) {
  Pair p;
  ASSERT_EQ(::write(p.writer.get(), "xyz", 3), 3);
  char buf[16];
  EXPECT_EQ(recv_some(p.reader.get(), buf, sizeof buf, kMidFrameSpin), 3);
  std::thread closer([&] {
    std::this_thread::sleep_for(20ms);
    p.writer.reset();
  });
  EXPECT_EQ(recv_some(p.reader.get(), buf, sizeof buf, kMidFrameSpin), 0);
  closer.join();
}

}  // namespace
}  // namespace pskv::tcp
