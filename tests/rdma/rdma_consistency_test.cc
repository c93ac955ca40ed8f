// BSP/SSP/ASP over rdma://, checked rather than assumed, as tests/consistency does for tcp and
// shm: reads are one-sided RDMA READs gated by the bound the client knows, reads of the
// server's clock table, and WAITs the server parks; clocks are SENDs behind the step's pushes.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>

#include "rdma_support.h"

namespace pskv {
namespace {

using testing::fork_worker;
using testing::ServerProcess;
using testing::start_rdma_server;
using testing::wait_pid;
using Clock = std::chrono::steady_clock;

template <class T>
T* shared_array(std::size_t n) {
  void* p = mmap(nullptr, sizeof(T) * n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return new (p) T[n]();
}

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
}

ClientOptions worker(const ServerProcess& s, std::uint32_t id) {
  ClientOptions o = testing::rdma_client({s.uri});
  o.worker_id = id;
  return o;
}

void init_keys(const ServerProcess& s, std::uint32_t n) {
  Client admin(testing::rdma_client({s.uri}));
  std::vector<float> zero{0.0f};
  for (Key k = 0; k < n; ++k) admin.wait(admin.init(k, zero));
}

// Worker w adds 1 to its own key at every clock; a read at clock c must see >= c - s counts
// from every worker. Workers run at different speeds so the bound is actually exercised.
void checker_workload(const std::string& mode, int s) {
  constexpr std::uint32_t kWorkers = 4;
  constexpr int kSteps = 40;
  std::vector<std::string> args{"--workers", std::to_string(kWorkers), "--mode", mode};
  if (mode == "ssp") args.insert(args.end(), {"--staleness", std::to_string(s)});
  auto server = start_rdma_server(args);
  init_keys(server, kWorkers);
  auto* violations = shared_array<std::atomic<int>>(1);
  auto* max_staleness = shared_array<std::atomic<std::uint64_t>>(1);
  std::vector<pid_t> pids;
  for (std::uint32_t w = 0; w < kWorkers; ++w)
    pids.push_back(fork_worker([&, w] {
      Client c(worker(server, w));
      std::vector<float> one{1.0f}, out(1);
      std::mt19937 rng(w);
      for (int clock = 0; clock < kSteps; ++clock) {
        for (Key k = 0; k < kWorkers; ++k) {
          c.wait(c.pull(k, out));
          if (s >= 0 && out[0] < float(clock - s)) violations->fetch_add(1);
        }
        c.wait(c.push(Key(w), one));
        c.clock();
        std::this_thread::sleep_for(std::chrono::microseconds((w + 1) * 300 + rng() % 300));
      }
      std::uint64_t cur = max_staleness->load();
      const std::uint64_t mine = c.staleness().max;
      while (mine > cur && !max_staleness->compare_exchange_weak(cur, mine)) {
      }
      return c.staleness().reads == std::uint64_t(kSteps) * kWorkers ? 0 : 4;
    }));
  for (pid_t p : pids) EXPECT_EQ(wait_pid(p, std::chrono::seconds(600)), 0);
  EXPECT_EQ(violations->load(), 0) << mode << " s=" << s;
  if (s >= 0) {
    EXPECT_LE(max_staleness->load(), std::uint64_t(s)) << "observed staleness exceeds the bound";
  }
  munmap(violations, sizeof(std::atomic<int>));
  munmap(max_staleness, sizeof(std::atomic<std::uint64_t>));
}

TEST(RdmaConsistency, BspReadsSeeEveryEarlierStep) {
  PSKV_REQUIRE_RDMA();
  checker_workload("bsp", 0);
}
TEST(RdmaConsistency, SspStaleness2) {
  PSKV_REQUIRE_RDMA();
  checker_workload("ssp", 2);
}
TEST(RdmaConsistency, AspNeverWaitsAndStillCountsEverything) {
  PSKV_REQUIRE_RDMA();
  checker_workload("asp", -1);
}

// Worker 0 stalls at clock 0. Under SSP(2) worker 1 reads at clocks 0..2 at once, but its read
// at clock 3 must wait (a WAIT parked on the server) for worker 0's first clock.
TEST(RdmaConsistency, SspBlocksAWorkerThatRunsAhead) {
  PSKV_REQUIRE_RDMA();
  constexpr int s = 2, kSteps = 6;
  auto server = start_rdma_server({"--workers", "2", "--mode", "ssp", "--staleness", std::to_string(s)});
  init_keys(server, 2);
  auto* times = shared_array<std::atomic<std::int64_t>>(16);  // [0]: worker 0 clocked; [1+c]: worker 1 read at c
  const pid_t slow = fork_worker([&] {
    Client c(worker(server, 0));
    std::vector<float> out(1);
    c.wait(c.pull(Key(0), out));
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    times[0].store(now_us());
    for (int i = 0; i < kSteps + 4; ++i) c.clock();
    return 0;
  });
  const pid_t fast = fork_worker([&] {
    Client c(worker(server, 1));
    std::vector<float> out(1);
    for (int clock = 0; clock < kSteps; ++clock) {
      c.wait(c.pull(Key(0), out));
      times[1 + clock].store(now_us());
      c.clock();
    }
    return 0;
  });
  EXPECT_EQ(wait_pid(fast), 0);
  EXPECT_EQ(wait_pid(slow), 0);
  const std::int64_t unblocked = times[0].load();
  for (int clock = 0; clock <= s; ++clock)
    EXPECT_LT(times[1 + clock].load(), unblocked) << "read at clock " << clock << " is within the bound";
  EXPECT_GE(times[1 + s + 1].load(), unblocked) << "read at clock " << s + 1 << " ran ahead of the bound";
  munmap(times, 16 * sizeof(std::atomic<std::int64_t>));
}

// A worker killed mid-run: its connection dies, the server calls worker_left, and under
// --straggler-policy fail the survivors' parked reads fail naming it, within the timeout.
TEST(RdmaConsistency, KilledWorkerFailsSurvivorsWithItsName) {
  PSKV_REQUIRE_RDMA();
  constexpr int kTimeoutMs = 3000;
  auto server = start_rdma_server(
      {"--workers", "3", "--mode", "bsp", "--wait-timeout-ms", std::to_string(kTimeoutMs), "--straggler-policy", "fail"});
  init_keys(server, 3);
  auto* outcome = shared_array<std::atomic<std::int64_t>>(8);  // [w]: 1 finished, 2 error naming worker 2; [4+w]: time
  auto* victim_clock = shared_array<std::atomic<int>>(1);
  const pid_t victim = fork_worker([&]() -> int {
    Client c(worker(server, 2));
    std::vector<float> one{1.0f}, out(1);
    for (int clock = 0;; ++clock) {
      c.wait(c.pull(Key(0), out));
      c.wait(c.push(Key(2), one));
      c.clock();
      victim_clock->store(clock + 1);
    }
  });
  std::vector<pid_t> survivors;
  for (std::uint32_t w = 0; w < 2; ++w)
    survivors.push_back(fork_worker([&, w] {
      Client c(worker(server, w));
      std::vector<float> one{1.0f}, out(1);
      try {
        for (int clock = 0; clock < 100000; ++clock) {
          for (Key k = 0; k < 3; ++k) c.wait(c.pull(k, out));
          c.wait(c.push(Key(w), one));
          c.clock();
        }
        outcome[w].store(1);
      } catch (const Error& e) {
        const std::string what = e.what();
        outcome[w].store(what.find("worker 2") != std::string::npos ? 2 : 3);
        if (what.find("worker 2") == std::string::npos) std::fprintf(stderr, "unexpected error: %s\n", e.what());
      }
      outcome[4 + w].store(now_us());
      return 0;
    }));
  while (victim_clock->load() < 5) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  kill(victim, SIGKILL);
  const std::int64_t killed_at = now_us();
  EXPECT_EQ(wait_pid(victim), 128 + SIGKILL);
  for (pid_t p : survivors) EXPECT_EQ(wait_pid(p), 0);
  for (int w = 0; w < 2; ++w) {
    EXPECT_EQ(outcome[w].load(), 2) << "survivor " << w;
    EXPECT_LT(outcome[4 + w].load() - killed_at, (kTimeoutMs + 3000) * 1000) << "survivor " << w;
  }
  munmap(outcome, 8 * sizeof(std::atomic<std::int64_t>));
  munmap(victim_clock, sizeof(std::atomic<int>));
}

}  // namespace
}  // namespace pskv
