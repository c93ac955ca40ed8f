#include "transport/tcp/socket.h"

#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
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

// Runs `read` on a thread of its own: a reader whose spin ran dry skips spinning for its next
// reads (a thread-local count), and a test after one that left it so would never spin.
template <class Read>
void on_fresh_thread(Read read) {
  std::thread(read).join();
}

// Bytes that come in pieces, each after a pause far longer than the spin: the reader spins,
// gives up and sleeps until the first piece wakes it, then (backed off) sleeps at once for the
// others.
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
  on_fresh_thread([&] { EXPECT_EQ(readv_full(p.reader.get(), iov, 2, kMidFrameSpin), IoResult::ok); });
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
  on_fresh_thread([&] { EXPECT_EQ(read_full(p.reader.get(), buf, sizeof buf, kMidFrameSpin), IoResult::timeout); });
  // A receive timeout never fires early, so this cannot flake under load: it tells a read that
  // blocked until SO_RCVTIMEO from one that gave up when its 50 us spin ran out.
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 90ms);
}

TEST(SocketSpin, RecvSpinningNeverBlocksAndReportsAClosedPeer) {
  Pair p;
  ASSERT_EQ(::write(p.writer.get(), "xyz", 3), 3);
  char buf[16];
  on_fresh_thread([&] {
    EXPECT_EQ(recv_spinning(p.reader.get(), buf, sizeof buf, kMidFrameSpin), 3);
    // Nothing more is coming yet: past its spin it says so instead of sleeping in recv.
    errno = 0;
    EXPECT_EQ(recv_spinning(p.reader.get(), buf, sizeof buf, kMidFrameSpin), -1);
    EXPECT_TRUE(errno == EAGAIN || errno == EWOULDBLOCK) << std::strerror(errno);
    p.writer.reset();
    EXPECT_EQ(recv_spinning(p.reader.get(), buf, sizeof buf, kMidFrameSpin), 0);
  });
}

}  // namespace
}  // namespace pskv::tcp
