// BSP/SSP/ASP and sync aggregation, checked rather than assumed, on every backend with real
// processes: the server is a pskv-server process, workers are forked processes.
// Built twice: consistency_test runs tcp and shm; rdma_consistency_test (label rdma, with
// PSKV_CONSISTENCY_OVER_RDMA) runs the same workloads over rdma:// in the Soft-RoCE VM, where
// reads are one-sided RDMA READs gated by the bound and clocks are SENDs behind the pushes.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <random>
#include <stdexcept>
#include <thread>

#include "pskv/client.h"
#include "support/process.h"
#ifdef PSKV_CONSISTENCY_OVER_RDMA
#include "rdma/rdma_support.h"
#endif

namespace pskv {
namespace {

using testing::fork_worker;
using testing::ServerProcess;
using testing::wait_pid;
using Clock = std::chrono::steady_clock;

// State shared with forked workers.
template <class T>
T* shared_array(std::size_t n) {
  void* p = mmap(nullptr, sizeof(T) * n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return new (p) T[n]();
}

std::int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now().time_since_epoch()).count();
}

// Soft-RoCE runs inside an emulated (TCG) VM, several times slower than the host, so rdma
// gets wider margins; what is checked stays the same.
struct Margins {
  int stall_ms;         // how long a worker stalls before its first clock
  int wait_timeout_ms;  // the server's --wait-timeout-ms in the kill tests
  int slack_ms;         // how far past that timeout the survivors may notice
  int laggard_ms;       // the sync laggard's extra delay per step
};

class Consistency : public ::testing::TestWithParam<std::string> {
 public:
  void SetUp() override {
#ifdef PSKV_CONSISTENCY_OVER_RDMA
    PSKV_REQUIRE_RDMA();
#endif
  }
  bool rdma() const { return GetParam() == "rdma"; }
  Margins margins() const { return rdma() ? Margins{1500, 3000, 3000, 100} : Margins{800, 1500, 2000, 20}; }
  ServerProcess start(std::vector<std::string> args) {
#ifdef PSKV_CONSISTENCY_OVER_RDMA
    return testing::start_rdma_server(args);
#else
    const std::string uri = GetParam() == "tcp" ? "tcp://127.0.0.1:0"
                                                : "shm://cons-" + std::to_string(getpid()) + "-" + std::to_string(++n_);
    args.insert(args.begin(), {"--uri", uri, "--io-threads", "2"});
    return ServerProcess::start(args);
#endif
  }
  ClientOptions client(const ServerProcess& s) const {
#ifdef PSKV_CONSISTENCY_OVER_RDMA
    return testing::rdma_client({s.uri});
#else
    ClientOptions o;
    o.servers = {s.uri};
    o.io_timeout = std::chrono::seconds(20);
    return o;
#endif
  }
  ClientOptions worker(const ServerProcess& s, std::uint32_t id) const {
    ClientOptions o = client(s);
    o.worker_id = id;
    return o;
  }
  void init_keys(const ServerProcess& s, std::uint32_t n, std::uint32_t len = 1) {
    Client admin(client(s));
    std::vector<float> zeros(len, 0.0f);
    for (Key k = 0; k < n; ++k) admin.wait(admin.init(k, zeros));
  }
  int n_ = 0;
};

// Worker w adds 1 to its own key at every clock; a read at clock c must see >= c - s counts
// from every worker. Workers run at different speeds so the bound is actually exercised.
void checker_workload(Consistency* t, const std::string& mode, int s) {
  constexpr std::uint32_t kWorkers = 4;
  constexpr int kSteps = 40;
  std::vector<std::string> args{"--workers", std::to_string(kWorkers), "--mode", mode};
  if (mode == "ssp") args.insert(args.end(), {"--staleness", std::to_string(s)});
  auto server = t->start(args);
  t->init_keys(server, kWorkers);
  auto* violations = shared_array<std::atomic<int>>(1);
  auto* max_staleness = shared_array<std::atomic<std::uint64_t>>(1);
  std::vector<pid_t> pids;
  for (std::uint32_t w = 0; w < kWorkers; ++w)
    pids.push_back(fork_worker([&, w] {
      Client c(t->worker(server, w));
      std::vector<float> one{1.0f}, out(1);
      std::mt19937 rng(w);
      for (int clock = 0; clock < kSteps; ++clock) {
        for (Key k = 0; k < kWorkers; ++k) {
          c.wait(c.pull(k, out));
          if (s >= 0 && out[0] < float(clock - s)) violations->fetch_add(1);
        }
        c.wait(c.push(Key(w), one));
        c.clock();
        // Worker w is (w+1) times slower than worker 0.
        std::this_thread::sleep_for(std::chrono::microseconds((w + 1) * 300 + rng() % 300));
      }
      std::uint64_t cur = max_staleness->load();
      const std::uint64_t mine = c.staleness().max;
      while (mine > cur && !max_staleness->compare_exchange_weak(cur, mine)) {
      }
      return c.staleness().reads == std::uint64_t(kSteps) * kWorkers ? 0 : 4;  // every read was recorded
    }));
  for (pid_t p : pids) EXPECT_EQ(wait_pid(p, std::chrono::seconds(600)), 0);
  EXPECT_EQ(violations->load(), 0) << mode << " s=" << s;
  if (s >= 0) {
    EXPECT_LE(max_staleness->load(), std::uint64_t(s)) << "observed staleness exceeds the bound";
  }
  munmap(violations, sizeof(std::atomic<int>));
  munmap(max_staleness, sizeof(std::atomic<std::uint64_t>));
}

TEST_P(Consistency, BspReadsSeeEveryEarlierStep) { checker_workload(this, "bsp", 0); }
TEST_P(Consistency, SspStaleness1) { checker_workload(this, "ssp", 1); }
TEST_P(Consistency, SspStaleness3) { checker_workload(this, "ssp", 3); }
TEST_P(Consistency, AspNeverWaitsAndStillCountsEverything) { checker_workload(this, "asp", -1); }

// Worker 0 stalls at clock 0. Under SSP(s) worker 1 may reach clock s but its read at clock
// s + 1 must wait for worker 0's first clock; under ASP it must not wait at all.
void runner_test(Consistency* t, const std::string& mode, int s) {
  std::vector<std::string> args{"--workers", "2", "--mode", mode};
  if (mode == "ssp") args.insert(args.end(), {"--staleness", std::to_string(s)});
  auto server = t->start(args);
  t->init_keys(server, 2);
  auto* times = shared_array<std::atomic<std::int64_t>>(64);  // [0]: worker 0 clocked; [1+c]: worker 1 read at c
  constexpr int kSteps = 8;
  const pid_t slow = fork_worker([&] {
    Client c(t->worker(server, 0));
    std::vector<float> out(1);
    c.wait(c.pull(Key(0), out));
    std::this_thread::sleep_for(std::chrono::milliseconds(t->margins().stall_ms));
    times[0].store(now_us());
    c.clock();
    for (int i = 1; i < kSteps + 4; ++i) c.clock();
    return 0;
  });
  const pid_t fast = fork_worker([&] {
    Client c(t->worker(server, 1));
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
  if (mode == "asp") {
    EXPECT_LT(times[kSteps].load(), unblocked) << "ASP finished every read before the slow worker clocked";
  } else {
    for (int clock = 0; clock <= s; ++clock)
      EXPECT_LT(times[1 + clock].load(), unblocked) << "read at clock " << clock << " is within the bound";
    EXPECT_GE(times[1 + s + 1].load(), unblocked) << "read at clock " << s + 1 << " ran ahead of the bound";
  }
  munmap(times, 64 * sizeof(std::atomic<std::int64_t>));
}

TEST_P(Consistency, SspBlocksAWorkerThatRunsAhead) { runner_test(this, "ssp", 2); }
TEST_P(Consistency, BspBlocksAWorkerThatRunsAhead) { runner_test(this, "bsp", 0); }
TEST_P(Consistency, AspLetsAWorkerRunAhead) { runner_test(this, "asp", 0); }

// Sync aggregation with backup workers: with K=2 of N=3 and worker 2 far behind, each step is
// applied exactly once from the two fast workers' mean; the laggard's gradients (1000) arrive
// late and are dropped, never folded into a later step.
TEST_P(Consistency, SyncAggregationAppliesOneMeanPerStepAndDropsLateGradients) {
  auto server = start({"--workers", "3", "--mode", "sync", "--sync-required", "2", "--rule", "sgd", "--lr", "1"});
  const int laggard_ms = margins().laggard_ms;
  init_keys(server, 2, 8);
  constexpr int kSteps = 20;
  // Connecting takes longer than a step in the Soft-RoCE VM: a fast worker that connected late
  // once let the laggard into the first steps. So all start together, the laggard a bit later.
  auto* connected = shared_array<std::atomic<int>>(1);
  std::vector<pid_t> pids;
  for (std::uint32_t w = 0; w < 3; ++w)
    pids.push_back(fork_worker([&, w] {
      Client c(worker(server, w));
      std::vector<float> grad(8, w == 2 ? 1000.0f : float(w + 1)), out(8);
      connected->fetch_add(1);
      while (connected->load() < 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (w == 2) std::this_thread::sleep_for(std::chrono::milliseconds(4 * laggard_ms));
      for (int step = 0; step < kSteps; ++step) {
        if (w == 2) std::this_thread::sleep_for(std::chrono::milliseconds(laggard_ms));
        for (Key k = 0; k < 2; ++k) c.wait(c.pull(k, out));
        for (Key k = 0; k < 2; ++k) c.wait(c.push(k, grad));
        c.clock();
      }
      return 0;
    }));
  for (pid_t p : pids) EXPECT_EQ(wait_pid(p, std::chrono::seconds(600)), 0);
  munmap(connected, sizeof(std::atomic<int>));
  Client check(client(server));
  std::vector<float> out(8);
  for (Key k = 0; k < 2; ++k) {
    check.wait(check.pull(k, out));
    // Each step: mean(1, 2) = 1.5, lr scaled by K = 2  ->  -3 per step.
    for (float x : out) EXPECT_FLOAT_EQ(x, -3.0f * kSteps) << "key " << k;
  }
  const std::string stats = check.server_stats(0);
  EXPECT_NE(stats.find("\"sync_applied_steps\":" + std::to_string(2 * kSteps)), std::string::npos) << stats;
  EXPECT_EQ(stats.find("\"sync_dropped_late\":0,"), std::string::npos) << "the laggard's gradients were dropped: " << stats;
}

// A worker that goes away mid-run, killed or failing with an exception (its client must then not
// announce that it finished): under --straggler-policy fail the survivors' bounded reads fail
// with an error naming it; under evict they finish without it. Either within the timeout + slack.
enum class Departure { killed, threw };
void departure_test(Consistency* t, const std::string& policy, Departure how) {
  const int kTimeoutMs = t->margins().wait_timeout_ms;
  auto server = t->start({"--workers", "3", "--mode", "bsp", "--wait-timeout-ms", std::to_string(kTimeoutMs),
                          "--straggler-policy", policy});
  t->init_keys(server, 3);
  auto* outcome = shared_array<std::atomic<std::int64_t>>(8);  // [w]: 1 finished, 2 error naming worker 2; [4+w]: time
  auto* victim_clock = shared_array<std::atomic<int>>(1);
  constexpr int kSteps = 400;
  const pid_t victim = fork_worker([&]() -> int {
    Client c(t->worker(server, 2));
    std::vector<float> one{1.0f}, out(1);
    for (int clock = 0;; ++clock) {
      c.wait(c.pull(Key(0), out));
      c.wait(c.push(Key(2), one));
      c.clock();
      victim_clock->store(clock + 1);
      if (how == Departure::threw && clock + 1 == 5) throw std::runtime_error("the victim's step failed");
    }
  });
  std::vector<pid_t> survivors;
  for (std::uint32_t w = 0; w < 2; ++w)
    survivors.push_back(fork_worker([&, w] {
      Client c(t->worker(server, w));
      std::vector<float> one{1.0f}, out(1);
      try {
        for (int clock = 0; clock < kSteps; ++clock) {
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
  if (how == Departure::killed) kill(victim, SIGKILL);
  const std::int64_t killed_at = now_us();
  EXPECT_EQ(wait_pid(victim), how == Departure::killed ? 128 + SIGKILL : 1);
  for (pid_t p : survivors) EXPECT_EQ(wait_pid(p), 0);
  for (int w = 0; w < 2; ++w) {
    EXPECT_EQ(outcome[w].load(), policy == "evict" ? 1 : 2) << "survivor " << w;
    if (policy == "fail") {
      EXPECT_LT(outcome[4 + w].load() - killed_at, std::int64_t{kTimeoutMs + t->margins().slack_ms} * 1000)
          << "survivor " << w;
    }
  }
  munmap(outcome, 8 * sizeof(std::atomic<std::int64_t>));
  munmap(victim_clock, sizeof(std::atomic<int>));
}

TEST_P(Consistency, KilledWorkerFailsSurvivorsWithItsName) { departure_test(this, "fail", Departure::killed); }
TEST_P(Consistency, KilledWorkerIsEvictedAndTheJobGoesOn) { departure_test(this, "evict", Departure::killed); }
TEST_P(Consistency, WorkerEndedByAnExceptionFailsSurvivorsWithItsName) {
  departure_test(this, "fail", Departure::threw);
}

#ifdef PSKV_CONSISTENCY_OVER_RDMA
INSTANTIATE_TEST_SUITE_P(Backends, Consistency, ::testing::Values("rdma"));
#else
INSTANTIATE_TEST_SUITE_P(Backends, Consistency, ::testing::Values("tcp", "shm"));
#endif

}  // namespace
}  // namespace pskv
