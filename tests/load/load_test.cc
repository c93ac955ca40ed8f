// Load on the TCP path (ctest label `load`): one real pskv-server process, clients in
// forked processes.
//
//   Load.SixtyFourClientsLoseNothingAndServerMemoryStaysBounded
//     64 concurrent clients (4 processes x 16 threads, one Client = one TCP connection each) do
//     PSKV_LOAD_OPS operations each (default 10,000): pushes of +1 to a few shared keys and pulls
//     that check every value is untorn (all floats of a key equal), integral, monotonic and
//     reflects this client's own earlier pushes. The final sums must be exact, and the server's
//     VmRSS after warm-up and at the end (both with all 64 connections open) must differ by less
//     than 64 MiB; both figures are printed.
// The connection and request-size limits are in limits_test.cc.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "pskv/client.h"
#include "support/process.h"
#include "support/workloads.h"

namespace pskv {
namespace {

using Clock = std::chrono::steady_clock;
using testing::fork_worker;
using testing::ServerProcess;
using testing::stats_field;
using testing::wait_pid;

constexpr int kProcesses = 4;
constexpr int kThreadsPerProcess = 16;
constexpr int kClients = kProcesses * kThreadsPerProcess;
constexpr int kKeys = 4;          // shared by every client: maximum contention
constexpr std::size_t kLen = 64;  // floats per key; a torn read shows unequal floats
constexpr Key kFirstKey = 100;

long ops_per_client() {
  if (const char* env = std::getenv("PSKV_LOAD_OPS")) {
    const long n = std::strtol(env, nullptr, 10);
    if (n >= 2) return n;
  }
  return 10'000;
}

// Operation i of client c: even i push +1 to push_key, odd i pull pull_key. The pattern spreads
// every client over every key, so the expected final values are known exactly.
int push_key(int c, long i) {
  return static_cast<int>((c * 7 + i / 2) % kKeys);
}
int pull_key(int c, long i) {
  return static_cast<int>((c * 3 + i / 2 + 1) % kKeys);
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Lives in a MAP_SHARED mapping made before fork, so the parent can watch the children.
struct Shared {
  std::atomic<int> warmed{0};    // clients past the warm-up
  std::atomic<int> finished{0};  // clients done with every operation (connections still open)
  std::atomic<int> failed{0};    // clients that hit an error (they count as warmed and finished)
  std::atomic<int> release{0};   // parent: clients may disconnect now
  char first_error[512] = {};
  std::atomic<int> error_claimed{0};
};

void report(Shared* shared, const std::string& what) {
  if (shared->error_claimed.exchange(1) == 0)
    std::snprintf(shared->first_error, sizeof shared->first_error, "%s", what.c_str());
  std::fprintf(stderr, "load client: %s\n", what.c_str());
}

// One client's run. Returns false after reporting the first problem.
bool run_client(const ClientOptions& o, int c, long ops, Shared* shared) {
  const long warmup = std::max(1L, ops / 10);
  bool counted_warm = false, counted_done = false;
  auto count_warm = [&] {
    if (!counted_warm) shared->warmed.fetch_add(1);
    counted_warm = true;
  };
  try {
    Client client(o);
    std::vector<float> one(kLen, 1.0f), out(kLen);
    std::vector<double> last(kKeys, 0.0), mine(kKeys, 0.0);
    const double ceiling = double(kClients) * double((ops + 1) / 2);
    for (long i = 0; i < ops; i += 2) {
      // A push and a pull back to back on one connection: the server handles a connection's
      // requests in order, so the pull must already see this push (and all earlier ones).
      const int pk = push_key(c, i), rk = pull_key(c, i + 1);
      const Ticket pushed = client.push(kFirstKey + pk, one);
      Ticket pulled = 0;
      const bool do_pull = i + 1 < ops;
      if (do_pull) pulled = client.pull(kFirstKey + rk, out);
      client.wait(pushed);
      mine[pk] += 1;
      if (do_pull) {
        client.wait(pulled);
        const float v = out[0];
        std::string problem;
        for (std::size_t j = 1; j < kLen && problem.empty(); ++j)
          if (out[j] != v)
            problem = "torn read (float 0 = " + std::to_string(v) + ", float " + std::to_string(j) + " = " +
                      std::to_string(out[j]) + ")";
        if (problem.empty() && (v != std::floor(v) || v < last[rk] || v < mine[rk] || v > ceiling))
          problem = "reads " + std::to_string(v) + " after " + std::to_string(last[rk]) + " (own pushes " +
                    std::to_string(mine[rk]) + ", at most " + std::to_string(ceiling) + ")";
        if (!problem.empty()) {
          report(shared, "client " + std::to_string(c) + " op " + std::to_string(i + 1) + ", key " +
                             std::to_string(kFirstKey + rk) + ": " + problem);
          shared->failed.fetch_add(1);
          return false;
        }
        last[rk] = v;
      }
      if (i + 2 >= warmup) count_warm();
    }
    count_warm();
    shared->finished.fetch_add(1);
    counted_done = true;
    // Stay connected until the parent has measured the server with every connection open.
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    while (!shared->release.load() && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    return true;
  } catch (const std::exception& e) {
    report(shared, "client " + std::to_string(c) + ": " + e.what());
    if (!counted_done) shared->failed.fetch_add(1);
    return false;
  }
}

// Waits (bounded) until `ready()`; false on timeout.
template <class F>
bool wait_until(F ready, std::chrono::seconds bound) {
  const auto deadline = Clock::now() + bound;
  while (!ready()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

TEST(Load, SixtyFourClientsLoseNothingAndServerMemoryStaysBounded) {
  const long ops = ops_per_client();
  auto server = ServerProcess::start({"--uri", "tcp://127.0.0.1:0", "--io-threads", "2", "--max-connections", "128"});
  const pid_t server_pid = server.process.pid();
  ClientOptions o;
  o.servers = {server.uri};
  o.io_timeout = std::chrono::seconds(60);
  o.connect_timeout = std::chrono::seconds(20);
  {
    Client admin(o);
    std::vector<float> zeros(kLen, 0.0f);
    for (int k = 0; k < kKeys; ++k) admin.wait(admin.init(kFirstKey + k, zeros));
  }
  const long rss_idle = testing::rss_kib(server_pid);

  void* mem = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(mem, MAP_FAILED);
  auto* shared = new (mem) Shared();
  struct Unmap {
    void* p;
    ~Unmap() { munmap(p, sizeof(Shared)); }
  } unmap{mem};

  const auto start = Clock::now();
  std::vector<pid_t> pids;
  for (int p = 0; p < kProcesses; ++p)
    pids.push_back(fork_worker([&, p] {
      std::vector<std::thread> threads;
      std::atomic<int> bad{0};
      for (int t = 0; t < kThreadsPerProcess; ++t)
        threads.emplace_back([&, t] {
          if (!run_client(o, p * kThreadsPerProcess + t, ops, shared)) bad.fetch_add(1);
        });
      for (auto& t : threads) t.join();
      return bad.load() ? 1 : 0;
    }));
  // Kills the children if an assertion below returns early.
  struct Reap {
    std::vector<pid_t>& pids;
    Shared* shared;
    ~Reap() {
      shared->release.store(1);
      for (pid_t p : pids)
        if (wait_pid(p, std::chrono::seconds(30)) == -1) {
          ::kill(p, SIGKILL);
          wait_pid(p, std::chrono::seconds(10));
        }
    }
  } reap{pids, shared};

  const auto bound = std::chrono::seconds(600);
  ASSERT_TRUE(wait_until([&] { return shared->warmed.load() + shared->failed.load() >= kClients; }, bound))
      << shared->warmed.load() << " of " << kClients << " clients warmed up";
  const long rss_warm = testing::rss_kib(server_pid);
  const double warm_s = seconds_since(start);
  ASSERT_TRUE(wait_until([&] { return shared->finished.load() + shared->failed.load() >= kClients; }, bound))
      << shared->finished.load() << " of " << kClients << " clients finished";
  const double run_s = seconds_since(start);
  const long rss_end = testing::rss_kib(server_pid);
  const long peak = testing::peak_rss_kib(server_pid);
  shared->release.store(1);
  for (pid_t p : pids) EXPECT_EQ(wait_pid(p, std::chrono::seconds(60)), 0) << "client process " << p;
  pids.clear();
  EXPECT_EQ(shared->failed.load(), 0) << "first problem: " << shared->first_error;

  const double total_ops = double(kClients) * double(ops);
  std::printf("load: %d clients x %ld ops = %.0f ops in %.1f s (%.0f ops/s, warm-up done at %.1f s)\n", kClients, ops,
              total_ops, run_s, total_ops / run_s, warm_s);
  std::printf(
      "load: server VmRSS idle %ld KiB, after warm-up %ld KiB, at the end %ld KiB (growth %ld KiB), "
      "peak VmHWM %ld KiB\n",
      rss_idle, rss_warm, rss_end, rss_end - rss_warm, peak);
  RecordProperty("ops_per_s", std::to_string(static_cast<long>(total_ops / run_s)));
  RecordProperty("server_rss_warm_kib", std::to_string(rss_warm));
  RecordProperty("server_rss_end_kib", std::to_string(rss_end));
  RecordProperty("server_peak_rss_kib", std::to_string(peak));
  ASSERT_GT(rss_warm, 0);
  ASSERT_GT(rss_end, 0);
  EXPECT_LT(rss_end - rss_warm, 64 * 1024) << "server RSS grew from " << rss_warm << " to " << rss_end << " KiB";

  // Nothing lost, nothing applied twice: each key holds exactly the pushes aimed at it.
  std::vector<double> expect(kKeys, 0.0);
  for (int c = 0; c < kClients; ++c)
    for (long i = 0; i < ops; i += 2) expect[push_key(c, i)] += 1;
  Client check(o);
  double total = 0;
  std::vector<float> out(kLen);
  for (int k = 0; k < kKeys; ++k) {
    check.wait(check.pull(kFirstKey + k, out));
    for (float x : out) ASSERT_EQ(x, out[0]) << "key " << kFirstKey + k;
    EXPECT_EQ(double(out[0]), expect[k]) << "key " << kFirstKey + k;
    total += out[0];
  }
  EXPECT_EQ(total, double(kClients) * double((ops + 1) / 2));
  const std::string stats = check.server_stats(0);
  EXPECT_EQ(stats_field(stats, "pushes"), double(kClients) * double((ops + 1) / 2)) << stats;
}

}  // namespace
}  // namespace pskv
