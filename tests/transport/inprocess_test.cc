// Both backends with server and clients as threads of one process, so the thread sanitizer sees
// every handoff: pipelined TCP requests, the shm ring, parked reads and completions. shm runs
// twice: with workers applying their own pushes (the default) and with pushes through the ring
// (shm_ring), which is the path that exercises ring polling and parked pulls.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include "pskv/client.h"
#include "pskv/server.h"
#include "support/pushes.h"

namespace pskv {
namespace {

class InProcess : public ::testing::TestWithParam<std::string> {
 protected:
  std::string uri() const {
    const std::string name = "inproc-" + std::to_string(getpid());
    if (GetParam() == "tcp") return "tcp://127.0.0.1:0";
    if (GetParam() == "fake") return "fake://" + name;
    return "shm://" + name + (GetParam() == "shm_ring" ? "?push=server" : "");
  }
  ServerOptions server_options() const {
    ServerOptions so;
    so.uri = uri();
    so.arena_bytes = 16 << 20;
    return so;
  }
  static ClientOptions client_options(const Server& server) {
    ClientOptions o;
    o.servers = {server.uri()};
    return o;
  }
};

TEST_P(InProcess, ConcurrentClientsLoseNothing) {
  ServerOptions so = server_options();
  so.io_threads = 2;
  Server server(so);
  const ClientOptions o = client_options(server);
  {
    Client admin(o);
    std::vector<float> zeros(256, 0.0f);
    for (Key k = 0; k < 4; ++k) admin.wait(admin.init(k, zeros));
  }
  constexpr int kThreads = 4, kPushes = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      Client c(o);
      std::vector<float> one(256, 1.0f), out(256);
      std::vector<Ticket> pending;
      for (int i = 0; i < kPushes; ++i) {
        pending.push_back(c.push(Key((i + t) % 4), one));
        if (i % 8 == 7) {
          for (Ticket x : pending) c.wait(x);
          pending.clear();
          c.wait(c.pull(Key(i % 4), out));
          for (float x : out) ASSERT_EQ(x, out[0]);
        }
      }
      for (Ticket x : pending) c.wait(x);
    });
  for (auto& t : threads) t.join();
  Client check(o);
  float total = 0;
  std::vector<float> out(256);
  for (Key k = 0; k < 4; ++k) {
    check.wait(check.pull(k, out));
    total += out[0];
  }
  EXPECT_EQ(total, float(kThreads * kPushes));
}

// Threads of one client share its connections: one waiter at a time may spin and pick up
// answers for all of them (shm polls the ring itself), the others sleep and are woken by
// whoever completed their request.
TEST_P(InProcess, ThreadsSharingOneClientAllComplete) {
  Server server(server_options());
  Client c(client_options(server));
  constexpr int kThreads = 4, kOps = 400;
  std::vector<float> zeros(64, 0.0f);
  for (Key k = 0; k < kThreads; ++k) c.wait(c.init(k, zeros));
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::vector<float> one(64, 1.0f), out(64);
      for (int i = 0; i < kOps; ++i) {
        c.wait(c.push(Key(t), one));
        if (i % 16 == 15) {
          c.wait(c.pull(Key(t), out));
          ASSERT_EQ(out[0], float(i + 1));  // own pushes are all in, in order
        }
      }
    });
  for (auto& t : threads) t.join();
  std::vector<float> out(64);
  for (Key k = 0; k < kThreads; ++k) {
    c.wait(c.pull(k, out));
    EXPECT_EQ(out[63], float(kOps));
  }
}

// A pull issued while the same client's push is still unanswered waits behind it and then sees
// it. Through the shm ring the pull is parked, and the waiting thread, not only the helper, lets
// it go; a push the worker applies itself is done before push() returns.
TEST_P(InProcess, PullSeesOwnUnwaitedPush) {
  Server server(server_options());
  Client c(client_options(server));
  std::vector<float> v(64, 0.0f), one(64, 1.0f), out(64);
  c.wait(c.init(7, v));
  for (int i = 0; i < 200; ++i) {
    const Ticket push = c.push(7, one);
    c.wait(c.pull(7, out));
    ASSERT_EQ(out[0], float(i + 1));
    c.wait(push);
  }
}

// Answers left unwaited for a while (over tcp, long enough for the connection's reader thread
// to read them) are all kept, and a waiter arriving later takes the reading over. That the
// reader thread does read them is TcpIntegration.AnswersNobodyWaitsForDoNotStallTheServer's to
// prove; here TSan watches the hand-over between it and the waiters.
TEST_P(InProcess, AnswersLeftUnwaitedMeanwhileAreKept) {
  Server server(server_options());
  Client c(client_options(server));
  std::vector<float> v(1024, 0.0f), one(1024, 1.0f), out(1024);
  c.wait(c.init(3, v));
  for (int round = 1; round <= 5; ++round) {
    std::vector<Ticket> pushes;
    for (int i = 0; i < 16; ++i) pushes.push_back(c.push(3, one));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const Ticket pull = c.pull(3, out);
    for (Ticket t : pushes) c.wait(t);
    c.wait(pull);
    ASSERT_EQ(out[1023], float(16 * round));
  }
}

// More requests than the in-flight window: the submitter blocks until answers free a slot,
// which nobody is waiting for, so the transport itself must read them.
TEST_P(InProcess, SubmittingPastTheInFlightWindowCompletes) {
  Server server(server_options());
  ClientOptions o = client_options(server);
  o.max_in_flight = 4;
  Client c(o);
  std::vector<float> v(256, 0.0f), one(256, 1.0f), out(256);
  c.wait(c.init(5, v));
  std::vector<Ticket> pushes;
  for (int i = 0; i < 200; ++i) pushes.push_back(c.push(5, one));
  for (Ticket t : pushes) c.wait(t);
  c.wait(c.pull(5, out));
  EXPECT_EQ(out[255], 200.0f);
}

TEST_P(InProcess, BspClocksAndBarrier) {
  ServerOptions so = server_options();
  so.num_workers = 2;
  so.mode = ConsistencyMode::bsp;
  Server server(so);
  std::vector<std::thread> workers;
  std::atomic<int> violations{0};
  for (std::uint32_t w = 0; w < 2; ++w)
    workers.emplace_back([&, w] {
      ClientOptions o = client_options(server);
      o.worker_id = w;
      Client c(o);
      std::vector<float> zero(1, 0.0f), one(1, 1.0f), out(1);
      c.wait(c.init(Key(w), zero));
      c.barrier();
      for (int step = 0; step < 50; ++step) {
        for (Key k = 0; k < 2; ++k) {
          c.wait(c.pull(k, out));
          if (out[0] < float(step)) violations.fetch_add(1);  // BSP: every earlier step is in
        }
        c.wait(c.push(Key(w), one));
        c.clock();
      }
    });
  for (auto& t : workers) t.join();
  EXPECT_EQ(violations.load(), 0);
}

// Pushes larger than the TCP server's receive buffer, which it applies in pieces as they arrive,
// with another thread pulling the same key (its reads of a value that keeps changing fall back
// to the stripe lock) and small requests pipelined behind each large push, so the bytes after
// such a frame are parsed as the frames they are. A read sees the newer push up to some float
// and the older one after it (pieces land in order, each whole; on shm the value is whole
// outright), and nothing is lost.
TEST_P(InProcess, LargePushesMeetPullsAndPipelinedRequests) {
  Server server(server_options());
  const ClientOptions o = client_options(server);
  constexpr std::size_t kBig = 200000;
  constexpr int kPushes = 20;
  {
    Client admin(o);
    admin.wait(admin.init(Key(1), std::vector<float>(kBig, 0.0f)));
    admin.wait(admin.init(Key(2), std::vector<float>(8, 0.0f)));
  }
  std::atomic<bool> pushing{true};
  auto push_all = [&] {
    Client c(o);
    std::vector<float> ones(kBig, 1.0f), one(8, 1.0f), out(8);
    for (int i = 0; i < kPushes; ++i) {
      const Ticket big = c.push(Key(1), ones);
      const Ticket small = c.push(Key(2), one);
      const Ticket read = c.pull(Key(2), out);
      c.wait(big), c.wait(small), c.wait(read);
      ASSERT_EQ(out[0], float(i + 1));
    }
  };
  std::thread pusher([&] {
    push_all();
    pushing.store(false);
  });
  Client c(o);
  std::vector<float> big(kBig);
  do {
    c.wait(c.pull(Key(1), big));
    ASSERT_TRUE(testing::newer_push_then_older(big));
  } while (pushing.load());
  pusher.join();
  c.wait(c.pull(Key(1), big));
  for (float x : big) ASSERT_EQ(x, float(kPushes));
}

// The documented contract lets push and pull run on other threads while the training loop's
// thread calls clock(): the step a request carries was read unsynchronised (a data race TSan
// reported); now it is one step or the other.
TEST_P(InProcess, PushesFromOtherThreadsMayRaceTheClock) {
  ServerOptions so = server_options();
  so.num_workers = 1;
  so.mode = ConsistencyMode::ssp;
  so.staleness = 1000;
  Server server(so);
  ClientOptions o = client_options(server);
  o.worker_id = 0;
  Client c(o);
  std::vector<float> zero(16, 0.0f), one(16, 1.0f);
  c.wait(c.init(Key(1), zero));
  std::atomic<bool> stop{false};
  std::atomic<int> pushes{0};
  std::thread pusher([&] {
    while (!stop.load()) {
      c.wait(c.push(Key(1), one));
      pushes.fetch_add(1);
    }
  });
  // The clocks start once pushes flow, so the two overlap every time.
  while (pushes.load() == 0) std::this_thread::yield();
  for (int i = 0; i < 200; ++i) c.clock();
  stop.store(true);
  pusher.join();
  EXPECT_EQ(c.current_clock(), 200u);
}

INSTANTIATE_TEST_SUITE_P(Backends, InProcess, ::testing::Values("tcp", "shm", "shm_ring", "fake"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace pskv
