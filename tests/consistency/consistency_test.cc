// BSP/SSP/ASP and sync aggregation, checked rather than assumed, on every backend. With a real
// backend the server is a pskv-server process and workers are forked processes; on fake:// the
// server and its workers are threads of this process (a worker is "killed" by cutting its
// connections), so the engine's consistency logic is checked without sockets or segments.
// Built twice: consistency_test runs tcp, shm and fake; rdma_consistency_test (label rdma, with
// PSKV_CONSISTENCY_OVER_RDMA) runs the same workloads over rdma:// in the Soft-RoCE VM, where
// reads are one-sided RDMA READs gated by the bound and clocks are SENDs behind the pushes.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <thread>

#include "pskv/client.h"
#include "pskv/server.h"
#include "support/process.h"
#include "transport/fake/fake_transport.h"
#ifdef PSKV_CONSISTENCY_OVER_RDMA
#include "rdma/rdma_support.h"
#endif

namespace pskv {
namespace {

using testing::ServerProcess;
using Clock = std::chrono::steady_clock;

// A server under test: a pskv-server process, or (fake://) a Server in this process.
struct TestServer {
  ServerProcess process;
  std::unique_ptr<Server> in_process;
  std::string uri;
};

// A worker under test: a forked process, or (fake://) a thread whose status is its body's result.
struct Worker {
  pid_t pid = -1;
  std::thread thread;
  std::shared_ptr<std::atomic<int>> status;
};

// The pskv-server flags these tests use, for a Server in this process.
ServerOptions in_process_options(const std::string& uri, const std::vector<std::string>& args) {
  ServerOptions o;
  o.uri = uri;
  for (std::size_t i = 0; i + 1 < args.size(); i += 2) {
    const std::string& flag = args[i];
    const std::string& value = args[i + 1];
    if (flag == "--workers")
      o.num_workers = std::stoul(value);
    else if (flag == "--mode")
      o.mode = *parse_consistency_mode(value);
    else if (flag == "--staleness")
      o.staleness = std::stoul(value);
    else if (flag == "--sync-required")
      o.sync_required = std::stoul(value);
    else if (flag == "--rule")
      o.rule.rule = *parse_update_rule(value);
    else if (flag == "--lr")
      o.rule.lr = std::stof(value);
    else if (flag == "--wait-timeout-ms")
      o.wait_timeout = std::chrono::milliseconds(std::stol(value));
    else if (flag == "--straggler-policy")
      o.straggler = value == "evict" ? StragglerPolicy::evict : StragglerPolicy::fail;
    else
      throw std::invalid_argument("in_process_options does not know " + flag);
  }
  return o;
}

// State shared with forked workers.
template <class T>
T* shared_array(std::size_t n) {
  void* p = mmap(nullptr, sizeof(T) * n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return new (p) T[n]();
}

// Soft-RoCE runs inside an emulated (TCG) VM, several times slower than the host, so rdma
// gets wider margins; what is checked stays the same.
struct Margins {
  int stall_ms;         // how long a worker stalls before its first clock
  int wait_timeout_ms;  // the server's --wait-timeout-ms in the kill tests
};

class Consistency : public ::testing::TestWithParam<std::string> {
 public:
  void SetUp() override {
#ifdef PSKV_CONSISTENCY_OVER_RDMA
    PSKV_REQUIRE_RDMA();
#endif
  }
  bool rdma() const {
    return GetParam() == "rdma";
  }
  Margins margins() const {
    return rdma() ? Margins{1500, 3000} : Margins{800, 1500};
  }
  bool in_process() const {
    return GetParam() == "fake";
  }
  TestServer start(std::vector<std::string> args) {
    TestServer s;
    if (in_process()) {
      s.in_process = std::make_unique<Server>(
          in_process_options("fake://cons-" + std::to_string(getpid()) + "-" + std::to_string(++n_), args));
      s.uri = s.in_process->uri();
      return s;
    }
#ifdef PSKV_CONSISTENCY_OVER_RDMA
    s.process = testing::start_rdma_server(args);
    s.uri = s.process.uri;
#else
    const std::string uri = GetParam() == "tcp" ? "tcp://127.0.0.1:0"
                                                : "shm://cons-" + std::to_string(getpid()) + "-" + std::to_string(++n_);
    args.insert(args.begin(), {"--uri", uri, "--io-threads", "2"});
    s.process = ServerProcess::start(args);
    s.uri = s.process.uri;
#endif
    return s;
  }
  ClientOptions client(const TestServer& s) const {
#ifdef PSKV_CONSISTENCY_OVER_RDMA
    return testing::rdma_client({s.uri});
#else
    ClientOptions o;
    o.servers = {s.uri};
    o.io_timeout = std::chrono::seconds(20);
    return o;
#endif
  }
  ClientOptions worker(const TestServer& s, std::uint32_t id) const {
    ClientOptions o = client(s);
    o.worker_id = id;
    return o;
  }
  void init_keys(const TestServer& s, std::uint32_t n, std::uint32_t len = 1) {
    Client admin(client(s));
    std::vector<float> zeros(len, 0.0f);
    for (Key k = 0; k < n; ++k) admin.wait(admin.init(k, zeros));
  }
  // Runs `body` as a worker; its status is body's result, 1 if it threw.
  Worker spawn(const std::function<int()>& body) const {
    Worker w;
    if (!in_process()) {
      w.pid = testing::fork_worker(body);
      return w;
    }
    w.status = std::make_shared<std::atomic<int>>(-1);
    w.thread = std::thread([body, status = w.status] {
      try {
        status->store(body());
      } catch (...) {
        status->store(1);
      }
    });
    return w;
  }
  // The worker's status once it ended (128 + signal if killed), -1 if it did not in `timeout`
  // (a thread is then still joined: it cannot be abandoned).
  int join(Worker& w, std::chrono::milliseconds timeout = std::chrono::seconds(120)) const {
    if (w.pid >= 0) return testing::wait_pid(w.pid, timeout);
    w.thread.join();
    return w.status->load();
  }
  // Ends a worker as SIGKILL would: no goodbye, no finishing clock. Its status is then
  // 128 + SIGKILL for a process; a thread's requests fail from here on, so its body throws (1).
  void kill_worker(const TestServer& s, const Worker& w, std::uint32_t worker_id) const {
    if (w.pid >= 0) {
      ::kill(w.pid, SIGKILL);
      return;
    }
    EXPECT_GE(fake::sever(s.uri.substr(std::string("fake://").size()), worker_id), 1u);
  }
  int killed_status() const {
    return in_process() ? 1 : 128 + SIGKILL;
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
  std::vector<Worker> workers;
  for (std::uint32_t w = 0; w < kWorkers; ++w)
    workers.push_back(t->spawn([&, w] {
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
  for (Worker& w : workers) EXPECT_EQ(t->join(w, std::chrono::seconds(600)), 0);
  EXPECT_EQ(violations->load(), 0) << mode << " s=" << s;
  if (s >= 0) {
    EXPECT_LE(max_staleness->load(), std::uint64_t(s)) << "observed staleness exceeds the bound";
  }
  munmap(violations, sizeof(std::atomic<int>));
  munmap(max_staleness, sizeof(std::atomic<std::uint64_t>));
}

TEST_P(Consistency, BspReadsSeeEveryEarlierStep) {
  checker_workload(this, "bsp", 0);
}
TEST_P(Consistency, SspStaleness1) {
  checker_workload(this, "ssp", 1);
}
TEST_P(Consistency, SspStaleness3) {
  checker_workload(this, "ssp", 3);
}
TEST_P(Consistency, AspNeverWaitsAndStillCountsEverything) {
  checker_workload(this, "asp", -1);
}

// Worker 0 stalls at clock 0 until released. Under SSP(s) worker 1's reads at clocks 0..s must
// complete while it stalls, and its read at s + 1 must wait for worker 0's first clock; under ASP
// every read completes during the stall. Checked by the order of events (one shared counter),
// never by wall-clock time: the stall only gives a read that wrongly runs ahead the chance to.
void runner_test(Consistency* t, const std::string& mode, int s) {
  std::vector<std::string> args{"--workers", "2", "--mode", mode};
  if (mode == "ssp") args.insert(args.end(), {"--staleness", std::to_string(s)});
  auto server = t->start(args);
  t->init_keys(server, 2);
  constexpr int kSteps = 8;
  // [0] event counter, [1] release, [2] worker 0's clock event, [3 + c] worker 1's read at clock c.
  auto* shared = shared_array<std::atomic<std::int64_t>>(4 + kSteps);
  std::atomic<std::int64_t>& events = shared[0];
  std::atomic<std::int64_t>* read_event = shared + 3;
  Worker slow = t->spawn([&] {
    Client c(t->worker(server, 0));
    std::vector<float> out(1);
    c.wait(c.pull(Key(0), out));
    while (shared[1].load() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    shared[2].store(events.fetch_add(1) + 1);
    c.clock();
    for (int i = 1; i < kSteps + 4; ++i) c.clock();
    return 0;
  });
  Worker fast = t->spawn([&] {
    Client c(t->worker(server, 1));
    std::vector<float> out(1);
    for (int clock = 0; clock < kSteps; ++clock) {
      c.wait(c.pull(Key(0), out));
      read_event[clock].store(events.fetch_add(1) + 1);
      c.clock();
    }
    return 0;
  });
  // Every read the mode allows during the stall must happen during it (a minute is "never").
  const int allowed = mode == "asp" ? kSteps : s + 1;
  const auto deadline = Clock::now() + std::chrono::minutes(1);
  while (read_event[allowed - 1].load() == 0 && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_NE(read_event[allowed - 1].load(), 0)
      << "worker 1's read at clock " << allowed - 1 << " never completed while worker 0 stalled at clock 0";
  std::this_thread::sleep_for(std::chrono::milliseconds(t->margins().stall_ms));
  shared[1].store(1);
  EXPECT_EQ(t->join(fast), 0);
  EXPECT_EQ(t->join(slow), 0);
  const std::int64_t released = shared[2].load();
  for (int clock = 0; clock < allowed; ++clock)
    EXPECT_LT(read_event[clock].load(), released) << "read at clock " << clock << " is within the bound";
  if (mode != "asp") {
    EXPECT_GT(read_event[s + 1].load(), released) << "read at clock " << s + 1 << " ran ahead of the bound";
  }
  munmap(shared, (4 + kSteps) * sizeof(std::atomic<std::int64_t>));
}

TEST_P(Consistency, SspBlocksAWorkerThatRunsAhead) {
  runner_test(this, "ssp", 2);
}
TEST_P(Consistency, BspBlocksAWorkerThatRunsAhead) {
  runner_test(this, "bsp", 0);
}
TEST_P(Consistency, AspLetsAWorkerRunAhead) {
  runner_test(this, "asp", 0);
}

// Sync aggregation with backup workers: with K=2 of N=3 and worker 2 always behind, each step is
// applied exactly once from the two fast workers' mean; the laggard's gradients (1000) arrive
// late and are dropped, never folded into a later step. The laggard is behind by construction:
// it pushes step i only once both fast workers have clocked it.
TEST_P(Consistency, SyncAggregationAppliesOneMeanPerStepAndDropsLateGradients) {
  auto server = start({"--workers", "3", "--mode", "sync", "--sync-required", "2", "--rule", "sgd", "--lr", "1"});
  init_keys(server, 2, 8);
  constexpr int kSteps = 20;
  auto* fast_clocked = shared_array<std::atomic<int>>(2);
  std::vector<Worker> workers;
  for (std::uint32_t w = 0; w < 3; ++w)
    workers.push_back(spawn([&, w] {
      Client c(worker(server, w));
      std::vector<float> grad(8, w == 2 ? 1000.0f : float(w + 1)), out(8);
      for (int step = 0; step < kSteps; ++step) {
        while (w == 2 && std::min(fast_clocked[0].load(), fast_clocked[1].load()) <= step)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        for (Key k = 0; k < 2; ++k) c.wait(c.pull(k, out));
        for (Key k = 0; k < 2; ++k) c.wait(c.push(k, grad));
        c.clock();
        if (w < 2) fast_clocked[w].store(step + 1);
      }
      return 0;
    }));
  for (Worker& w : workers) EXPECT_EQ(join(w, std::chrono::seconds(600)), 0);
  munmap(fast_clocked, 2 * sizeof(std::atomic<int>));
  Client check(client(server));
  std::vector<float> out(8);
  for (Key k = 0; k < 2; ++k) {
    check.wait(check.pull(k, out));
    // Each step: mean(1, 2) = 1.5, lr scaled by K = 2  ->  -3 per step.
    for (float x : out) EXPECT_FLOAT_EQ(x, -3.0f * kSteps) << "key " << k;
  }
  const std::string stats = check.server_stats(0);
  EXPECT_NE(stats.find("\"sync_applied_steps\":" + std::to_string(2 * kSteps)), std::string::npos) << stats;
  EXPECT_EQ(stats.find("\"sync_dropped_late\":0,"), std::string::npos)
      << "the laggard's gradients were dropped: " << stats;
}

// A worker that goes away mid-run, killed or failing with an exception (its client must then not
// announce that it finished): under --straggler-policy fail the survivors' bounded reads fail
// with an error naming it (so it came from the straggler policy, not a client's own timeout);
// under evict they finish without it.
enum class Departure { killed, threw };
void departure_test(Consistency* t, const std::string& policy, Departure how) {
  const int kTimeoutMs = t->margins().wait_timeout_ms;
  auto server = t->start({"--workers", "3", "--mode", "bsp", "--wait-timeout-ms", std::to_string(kTimeoutMs),
                          "--straggler-policy", policy});
  t->init_keys(server, 3);
  auto* outcome = shared_array<std::atomic<std::int64_t>>(8);  // [w]: 1 finished, 2 error naming worker 2; [4+w]: time
  auto* victim_clock = shared_array<std::atomic<int>>(1);
  constexpr int kSteps = 400;
  Worker victim = t->spawn([&]() -> int {
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
  std::vector<Worker> survivors;
  for (std::uint32_t w = 0; w < 2; ++w)
    survivors.push_back(t->spawn([&, w] {
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
      return 0;
    }));
  while (victim_clock->load() < 5) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  if (how == Departure::killed) t->kill_worker(server, victim, 2);
  EXPECT_EQ(t->join(victim), how == Departure::killed ? t->killed_status() : 1);
  for (Worker& w : survivors) EXPECT_EQ(t->join(w), 0);
  for (int w = 0; w < 2; ++w) EXPECT_EQ(outcome[w].load(), policy == "evict" ? 1 : 2) << "survivor " << w;
  munmap(outcome, 8 * sizeof(std::atomic<std::int64_t>));
  munmap(victim_clock, sizeof(std::atomic<int>));
}

TEST_P(Consistency, KilledWorkerFailsSurvivorsWithItsName) {
  departure_test(this, "fail", Departure::killed);
}
TEST_P(Consistency, KilledWorkerIsEvictedAndTheJobGoesOn) {
  departure_test(this, "evict", Departure::killed);
}
TEST_P(Consistency, WorkerEndedByAnExceptionFailsSurvivorsWithItsName) {
  departure_test(this, "fail", Departure::threw);
}

#ifdef PSKV_CONSISTENCY_OVER_RDMA
INSTANTIATE_TEST_SUITE_P(Backends, Consistency, ::testing::Values("rdma"));
#else
INSTANTIATE_TEST_SUITE_P(Backends, Consistency, ::testing::Values("tcp", "shm", "fake"));
#endif

}  // namespace
}  // namespace pskv
