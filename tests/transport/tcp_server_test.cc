// The TCP server's connection state machine with server and peers in one process, so the thread
// sanitizer sees the hand-offs the non-blocking design adds: replies queued because their peer
// did not read them, drained later by another I/O thread, while pulls parked at a consistency
// bound are answered from the thread that moves it.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <atomic>
#include <thread>

#include "pskv/client.h"
#include "pskv/server.h"
#include "support/raw_peer.h"
#include "support/stats.h"
#include "transport/tcp/socket.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv {
namespace {

using testing::RawPeer;

// Waits up to 30 s for `done()`; a server that stalls fails the test instead of hanging it.
template <class Done>
bool within_30s(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

// A peer pipelines more pull replies than fit the socket buffers and does not read for a while:
// its replies queue, the server stops reading it past its queue bound, and serves everyone
// else meanwhile; once it reads, every reply arrives whole and in order.
TEST(TcpServer, RepliesAPeerDoesNotReadAreQueuedAndDeliveredWhole) {
  ServerOptions so;
  so.uri = "tcp://127.0.0.1:0";
  so.io_threads = 2;
  so.arena_bytes = 32 << 20;
  Server server(so);
  ClientOptions o;
  o.servers = {server.uri()};
  constexpr std::uint32_t kFloats = 256u << 10;  // 1 MiB, a copied reply (no kFromStore)
  {
    Client admin(o);
    std::vector<float> v(kFloats);
    for (std::uint32_t i = 0; i < kFloats; ++i) v[i] = float(i);
    admin.wait(admin.init(Key(1), v));
    admin.wait(admin.init(Key(2), std::vector<float>(16, 0.0f)));
  }
  RawPeer slow(server.uri(), std::chrono::seconds(20));
  slow.hello();
  constexpr int kPulls = 24;
  const wire::KeyEntry key{1, kFloats, 0};
  for (int i = 0; i < kPulls; ++i) slow.request(wire::Op::pull, 100 + i, {&key, 1});
  std::atomic<bool> stop{false};
  std::atomic<int> served{0};
  std::string healthy_error;  // read once the thread is joined
  std::atomic<bool> healthy_failed{false};
  std::jthread healthy([&] {
    try {
      Client c(o);
      std::vector<float> one(16, 1.0f), out(16);
      while (!stop.load()) {
        c.wait(c.push(Key(2), one));
        c.wait(c.pull(Key(2), out));
        served.fetch_add(1);
      }
    } catch (const std::exception& e) {
      healthy_error = e.what();
      healthy_failed.store(true);
    }
  });
  // Stopped however the test ends: an assertion below returns with the client running.
  struct StopAtExit {
    std::atomic<bool>& stop;
    ~StopAtExit() { stop.store(true); }
  } stop_at_exit{stop};
  ASSERT_TRUE(within_30s([&] { return served.load() >= 200 || healthy_failed.load(); }))
      << "the healthy client was not served while another peer left its replies unread";
  std::vector<float> got(kFloats);
  for (int i = 0; i < kPulls; ++i) {
    wire::FrameHeader r{};
    ASSERT_EQ(tcp::read_full(slow.fd(), &r, sizeof r), tcp::IoResult::ok) << "reply " << i;
    ASSERT_EQ(r.status, 0);
    ASSERT_EQ(r.request_id, std::uint64_t(100 + i)) << "replies of one connection's unparked pulls keep their order";
    ASSERT_EQ(r.payload_bytes, kFloats * sizeof(float));
    ASSERT_EQ(tcp::read_full(slow.fd(), got.data(), r.payload_bytes), tcp::IoResult::ok);
    for (std::uint32_t f = 0; f < kFloats; f += 4099) ASSERT_EQ(got[f], float(f)) << "reply " << i;
    ASSERT_EQ(got[kFloats - 1], float(kFloats - 1));
  }
  stop.store(true);
  healthy.join();
  EXPECT_EQ(healthy_error, "");
}

// Pulls parked at the SSP bound on a connection whose peer reads slowly: the thread that moves
// the bound queues their replies while the connection's own thread may be writing to it.
TEST(TcpServer, ParkedPullsAnsweredFromAnotherThreadWhileTheConnectionIsBusy) {
  ServerOptions so;
  so.uri = "tcp://127.0.0.1:0";
  so.io_threads = 2;
  so.num_workers = 2;
  so.mode = ConsistencyMode::bsp;
  Server server(so);
  ClientOptions o;
  o.servers = {server.uri()};
  o.worker_id = 1;
  Client w1(o);
  constexpr std::uint32_t kFloats = 64u << 10;
  w1.wait(w1.init(Key(1), std::vector<float>(kFloats, 3.0f)));
  RawPeer w0(server.uri(), std::chrono::seconds(20));
  w0.hello(0);
  // Worker 0 enters clock 1 and pulls at it: parked until worker 1 reaches clock 1.
  constexpr int kPulls = 40;
  w0.request(wire::Op::clock, 1, {}, 1);
  const wire::KeyEntry key{1, kFloats, 0};
  for (int i = 0; i < kPulls; ++i) w0.request(wire::Op::pull, 10 + i, {&key, 1}, 1);
  ASSERT_TRUE(within_30s([&] { return testing::stats_field(server.stats_json(), "parked") >= kPulls; }))
      << server.stats_json();
  w1.clock();  // releases every parked pull at once, on this thread's request
  int pulls = 0, clocks = 0;
  std::vector<float> got(kFloats);
  while (pulls + clocks < kPulls + 1) {
    wire::FrameHeader r{};
    ASSERT_EQ(tcp::read_full(w0.fd(), &r, sizeof r), tcp::IoResult::ok);
    ASSERT_EQ(r.status, 0);
    if (r.op == std::uint16_t(wire::Op::clock)) {
      ++clocks;
      continue;
    }
    ASSERT_EQ(r.payload_bytes, kFloats * sizeof(float));
    ASSERT_EQ(tcp::read_full(w0.fd(), got.data(), r.payload_bytes), tcp::IoResult::ok);
    ASSERT_EQ(got.front(), 3.0f);
    ASSERT_EQ(got.back(), 3.0f);
    ++pulls;
  }
  EXPECT_EQ(pulls, kPulls);
  EXPECT_EQ(clocks, 1);
}

}  // namespace
}  // namespace pskv
