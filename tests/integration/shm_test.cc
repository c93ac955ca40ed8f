// The shared-memory path end to end: a real pskv-server owning a segment, workers in forked
// processes, and workers killed with SIGKILL at random instants.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <sys/mman.h>
#include <algorithm>
#include <atomic>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include "pskv/client.h"
#include "store/store.h"
#include "support/process.h"
#include "support/stop.h"
#include "support/workloads.h"
#include "transport/shm/segment.h"
#include "transport/transport.h"
#include "transport/uri.h"

namespace pskv {
namespace {

using testing::expect_nothing_lost;
using testing::fork_worker;
using testing::ServerProcess;
using testing::stats_field;
using testing::wait_pid;

std::string unique_name(const char* tag) {
  return std::string(tag) + "-" + std::to_string(getpid());
}

ServerProcess start_shm(const std::string& name, std::vector<std::string> extra = {}) {
  std::vector<std::string> args{"--uri", "shm://" + name};
  if (std::find(extra.begin(), extra.end(), "--io-threads") == extra.end())
    extra.insert(extra.end(), {"--io-threads", "1"});
  args.insert(args.end(), extra.begin(), extra.end());
  return ServerProcess::start(args);
}

ClientOptions shm_client(const std::string& uri) {
  ClientOptions o;
  o.servers = {uri};
  return o;
}

// The tests that push run with both appliers: the client itself (the default) and the server.
class ShmPush : public ::testing::TestWithParam<std::string> {
 protected:
  ServerProcess start(const char* tag, std::vector<std::string> extra = {}) {
    extra.insert(extra.end(), {"--shm-push", GetParam()});
    return start_shm(unique_name(tag), extra);
  }
  bool workers_apply() const { return GetParam() == "worker"; }
};
INSTANTIATE_TEST_SUITE_P(Applier, ShmPush, ::testing::Values("worker", "server"),
                         [](const auto& info) { return info.param; });

TEST_P(ShmPush, MultiProcessPushPull) {
  auto server = start("mp");
  ClientOptions o = shm_client(server.uri);
  {
    Client admin(o);
    for (Key k = 0; k < 16; ++k) {
      std::vector<float> v(1 + k * 100, float(k));
      admin.wait(admin.init(k, v));
    }
  }
  std::vector<pid_t> pids;
  for (int c = 0; c < 4; ++c)
    pids.push_back(fork_worker([&, c] {
      Client client(o);
      for (int r = 0; r < 200; ++r) {
        const Key k = Key((r + c) % 16);
        std::vector<float> d(1 + k * 100, 1.0f), out(1 + k * 100);
        client.wait(client.push(k, d));
        client.wait(client.pull(k, out));
        for (float x : out)
          if (x != out[0]) return 3;
        if (out[0] < float(k) + 1) return 4;  // at least our own push is visible
      }
      return 0;
    }));
  for (pid_t p : pids) EXPECT_EQ(wait_pid(p), 0);
  Client check(o);
  double total = 0;
  for (Key k = 0; k < 16; ++k) {
    std::vector<float> out(1 + k * 100);
    check.wait(check.pull(k, out));
    total += out[0] - float(k);
  }
  EXPECT_EQ(total, 4.0 * 200);
  const std::string stats = check.server_stats(0);
  EXPECT_EQ(stats_field(stats, "pushes"), 800) << stats;
  EXPECT_EQ(stats_field(stats, "worker_pushes"), workers_apply() ? 800 : 0) << stats;
}

TEST_P(ShmPush, NothingLostWith16Processes) {
  auto server = start("lost");
  expect_nothing_lost(shm_client(server.uri), {.clients = 16, .pushes = 500, .keys = 4, .length = 64, .batch = 32});
}

struct KillTrials {
  int trials;
  Key keys;
  std::uint32_t length;        // floats per key
  std::uint32_t max_delay_us;  // a victim is killed up to this long after it starts
  bool after_first_push;       // ... after its first push rather than after its fork
  unsigned seed;
  // The server's segment, to kill each victim only once it is caught (stopped) with a push it
  // applies itself saved under the stripe lock, where a kill leaves a value half-updated.
  const char* catch_in_segment = nullptr;
};

// Stops `victim` until its area's undo record reads `saved`, and leaves it stopped there; false
// if that never happened.
bool stop_inside_a_push(shm::Segment& segment, pid_t victim, std::mt19937& rng) {
  shm::ClientArea* area = nullptr;
  for (std::uint32_t i = 0; i < segment.geometry().clients && !area; ++i)
    if (segment.area(i).owner_pid.load() == victim) area = &segment.area(i);
  return area && testing::stop_when(
                     victim, [&] { return area->undo.phase.load() == UndoPhase::saved; }, rng);
}

// Victims that push forever are SIGKILLed one after another at random instants, while a
// survivor pushes to the same keys and checks every read it makes for tearing. After each kill
// the survivor must make progress within 10 s (so no lock was left held), and at the end a
// fresh client still gets a slot and untorn values.
void run_kill_trials(const ClientOptions& o, const KillTrials& t) {
  {
    Client admin(o);
    std::vector<float> zeros(t.length, 0.0f);
    for (Key k = 0; k < t.keys; ++k) admin.wait(admin.init(k, zeros));
  }
  auto* shared = static_cast<std::atomic<std::uint64_t>*>(
      mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  auto* progress = new (shared) std::atomic<std::uint64_t>(0);
  auto* stop = new (shared + 1) std::atomic<std::uint64_t>(0);
  auto* victim_pushes = new (shared + 2) std::atomic<std::uint64_t>(0);
  const pid_t survivor = fork_worker([&] {
    Client client(o);
    std::vector<float> one(t.length, 1.0f), out(t.length);
    while (stop->load() == 0) {
      for (Key k = 0; k < t.keys; ++k) {
        client.wait(client.push(k, one));
        client.wait(client.pull(k, out));
        for (float x : out)
          if (x != out[0]) return 7;  // torn
      }
      progress->fetch_add(1);
    }
    return 0;
  });
  std::mt19937 rng(t.seed);
  const std::unique_ptr<shm::Segment> segment = t.catch_in_segment ? shm::Segment::open(t.catch_in_segment) : nullptr;
  for (int trial = 0; trial < t.trials; ++trial) {
    victim_pushes->store(0);
    const pid_t victim = fork_worker([&]() -> int {
      Client client(o);
      std::vector<float> one(t.length, 1.0f);
      for (Key i = 0;; ++i) {
        client.wait(client.push(i % t.keys, one));
        victim_pushes->fetch_add(1);
      }
    });
    while (t.after_first_push && victim_pushes->load() == 0)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    std::this_thread::sleep_for(std::chrono::microseconds(200 + rng() % t.max_delay_us));
    if (segment) {
      EXPECT_TRUE(stop_inside_a_push(*segment, victim, rng))
          << "victim " << victim << " was never caught inside a push";
    }
    kill(victim, SIGKILL);
    EXPECT_EQ(wait_pid(victim), 128 + SIGKILL);
    const std::uint64_t before = progress->load();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (progress->load() < before + 2 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    ASSERT_GE(progress->load(), before + 2) << "survivor stalled after kill " << trial;
  }
  stop->store(1);
  EXPECT_EQ(wait_pid(survivor), 0);
  Client check(o);
  std::vector<float> out(t.length);
  for (Key k = 0; k < t.keys; ++k) {
    check.wait(check.pull(k, out));
    for (float x : out) ASSERT_EQ(x, out[0]);
  }
  munmap(shared, 4096);
}

// 64 KiB values, killed from 0.2 ms after the fork: kills land while the victim claims its slot,
// in its copy into the ring, in its undo copy or apply, and between pushes.
TEST_P(ShmPush, SigkillOfPushingWorkersLeavesTheStoreUsable) {
  auto server = start("kill");
  run_kill_trials(
      shm_client(server.uri),
      {.trials = 50, .keys = 4, .length = 16384, .max_delay_us = 20000, .after_first_push = false, .seed = 12345});
}

// Workers that apply their own pushes are killed while they hold a stripe lock with a value
// half-updated: each is stopped until it is caught there, then killed. The server must roll
// every one of them back and release the lock.
TEST(ShmIntegration, SigkillInsideAWorkerAppliedPushIsRolledBack) {
  const std::string name = unique_name("rollback");
  auto server = start_shm(name, {"--shm-push", "worker"});
  const ClientOptions o = shm_client(server.uri);
  constexpr int kTrials = 20;
  run_kill_trials(o, {.trials = kTrials,
                      .keys = 2,
                      .length = 1u << 19,
                      .max_delay_us = 3000,
                      .after_first_push = true,
                      .seed = 99,
                      .catch_in_segment = name.c_str()});
  Client check(o);
  const std::string stats = check.server_stats(0);
  EXPECT_EQ(stats_field(stats, "recovered_pushes"), kTrials) << stats;
}

// Forks a worker pushing `one` to key 0 without end and SIGSTOPs it, 20 ms apart, until
// `while_stopped` (run while it is stopped) says the stop landed inside one of its pushes, at most
// 20 times; then SIGKILLs it. Returns how many stops landed there: 1, or 0 if none did.
int stop_a_pusher_inside_a_push(const ClientOptions& o, const std::vector<float>& one,
                                const std::function<bool(pid_t pusher)>& while_stopped) {
  const pid_t pusher = fork_worker([&]() -> int {
    Client client(o);
    for (;;) client.wait(client.push(Key(0), one));
  });
  int landed = 0;
  for (int attempt = 0; attempt < 20 && landed == 0; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    kill(pusher, SIGSTOP);
    if (while_stopped(pusher)) ++landed;
    kill(pusher, SIGCONT);
  }
  kill(pusher, SIGKILL);
  EXPECT_EQ(wait_pid(pusher), 128 + SIGKILL);
  return landed;
}

// A worker that hangs (SIGSTOP) while it holds a stripe lock is alive, so nothing is rolled
// back: another worker's push to that key must give up after --wait-timeout-ms with an error
// naming the holder's pid, not wait forever. Stops that land outside the lock are retried.
TEST(ShmIntegration, PushBehindAHungLockHolderTimesOutNamingIt) {
  auto server = start_shm(unique_name("hung"), {"--shm-push", "worker", "--wait-timeout-ms", "300"});
  const ClientOptions o = shm_client(server.uri);
  constexpr std::uint32_t kLen = 1u << 19;  // 2 MiB: the pusher holds the lock most of the time
  std::vector<float> one(kLen, 1.0f);
  Client c(o);
  c.wait(c.init(Key(0), std::vector<float>(kLen, 0.0f)));
  const int timeouts = stop_a_pusher_inside_a_push(o, one, [&](pid_t hung) {
    try {
      c.wait(c.push(Key(0), one));
      return false;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::timeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("pid " + std::to_string(hung)), std::string::npos) << e.what();
      return true;
    }
  });
  EXPECT_EQ(timeouts, 1) << "no SIGSTOP in 20 landed while the pusher held the lock";
  // Once the holder is gone (and rolled back), the key takes pushes again.
  c.wait(c.push(Key(0), one));
}

// A pull copies the value itself, validated by the key's seqlock word. A worker stopped inside
// its own push leaves that word odd: the pull once waited for it for good. It now gives up at
// its io timeout, saying why, and reads the key again once the writer is gone.
TEST(ShmIntegration, PullBehindAStoppedWriterTimesOut) {
  auto server = start_shm(unique_name("stopped-writer"), {"--shm-push", "worker"});
  ClientOptions o = shm_client(server.uri);
  o.io_timeout = std::chrono::milliseconds(500);
  constexpr std::uint32_t kLen = 1u << 19;  // 2 MiB: the pusher is inside a write most of the time
  std::vector<float> one(kLen, 1.0f), out(kLen);
  Client c(o);
  c.wait(c.init(Key(0), std::vector<float>(kLen, 0.0f)));
  const int timeouts = stop_a_pusher_inside_a_push(o, one, [&](pid_t) {
    const auto began = std::chrono::steady_clock::now();
    try {
      c.wait(c.pull(Key(0), out));
      return false;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::timeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("stayed inside a write"), std::string::npos) << e.what();
      EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(5));
      return true;
    }
  });
  EXPECT_EQ(timeouts, 1) << "no SIGSTOP in 20 landed while the pusher was inside a write";
  c.wait(c.pull(Key(0), out));  // rolled back by the server's watchdog
}

// A client finds a key through the segment's shared index, which any process of the user can
// rewrite: pointed at another key's slot of the same length, it once returned that key's value.
TEST(ShmIntegration, AnIndexPointingAtAnotherKeysSlotIsRefused) {
  const std::string name = unique_name("misdirected");
  auto server = start_shm(name);
  Client c(shm_client(server.uri));
  c.wait(c.init(Key(1), std::vector<float>(8, 1.0f)));
  c.wait(c.init(Key(2), std::vector<float>(8, 2.0f)));
  auto segment = shm::Segment::open(name);
  auto store = Store::attach(segment->store_memory());
  SlotHeader* slot = store->find(Key(1));
  ASSERT_NE(slot, nullptr);
  slot->key = 2;  // key 1's index entry now leads to a slot naming key 2
  std::vector<float> out(8, 0.0f);
  try {
    c.wait(c.pull(Key(1), out));
    ADD_FAILURE() << "pulled " << out[0] << " for key 1";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::protocol) << e.what();
    EXPECT_NE(std::string(e.what()).find("names key 2"), std::string::npos) << e.what();
  }
  slot->key = 1;
  c.wait(c.pull(Key(1), out));
  EXPECT_EQ(out[0], 1.0f);
}

// A server that lives but answers nothing (SIGSTOPped) fails the requests waiting in its ring
// at the io timeout, as a silent tcp server does; they once waited for good, since the client
// only checked that the server's process existed.
TEST(ShmIntegration, AStoppedServerFailsRingRequestsAtTheIoTimeout) {
  auto server = start_shm(unique_name("stopped-server"));
  ClientOptions o = shm_client(server.uri);
  o.io_timeout = std::chrono::milliseconds(1000);
  Client c(o);
  c.wait(c.init(Key(1), std::vector<float>(8, 1.0f)));
  server.process.signal(SIGSTOP);
  ASSERT_TRUE(testing::wait_stopped(server.process.pid(), std::chrono::seconds(10)));  // kill() only sends it
  const auto began = std::chrono::steady_clock::now();
  try {
    c.wait(c.init(Key(2), std::vector<float>(8, 1.0f)));  // carried by the ring
    ADD_FAILURE() << "a stopped server answered";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::timeout) << e.what();
    EXPECT_NE(std::string(e.what()).find("answered nothing"), std::string::npos) << e.what();
  }
  const auto waited = std::chrono::steady_clock::now() - began;
  server.process.signal(SIGCONT);
  EXPECT_GE(waited, std::chrono::milliseconds(900));
  EXPECT_LT(waited, std::chrono::seconds(5));
  Client again(o);  // the server serves new clients once it runs again
  std::vector<float> out(8);
  again.wait(again.pull(Key(1), out));
  EXPECT_EQ(out[0], 1.0f);
}

// The other side of the test above: a server answering a steady stream of ring requests is
// never taken for silent, although its answers are mostly taken by the waiting threads, not by
// the connection's helper (an earlier version of the check failed such a connection).
TEST(ShmIntegration, BusyRingTrafficIsNotTakenForSilence) {
  auto server = start_shm(unique_name("busy-ring"), {"--shm-push", "server"});
  ClientOptions o = shm_client(server.uri);
  o.io_timeout = std::chrono::milliseconds(300);
  Client c(o);
  c.wait(c.init(Key(0), std::vector<float>(1024, 0.0f)));
  const std::vector<float> one(1024, 1.0f);
  std::uint64_t pushes = 0;
  for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
       std::chrono::steady_clock::now() < until; ++pushes)
    c.wait(c.push(Key(0), one));  // each carried by the ring (--shm-push server)
  std::vector<float> out(1024);
  c.wait(c.pull(Key(0), out));
  EXPECT_EQ(out[0], float(pushes));
}

// A client destroyed while its barrier still waits in the server gave its area back after 2 s,
// but the barrier's answer came later, into the area's ring: a client that took the area got it
// for its own first request (here an init, answered by the barrier's timeout), and the departed
// worker's goodbye clock was never served. Now the area is marked leaving, the server serves what
// it owes, and only then is the area free.
TEST(ShmIntegration, AnAreaIsNotTakenWhileAGoneClientsBarrierWaits) {
  auto server =
      start_shm(unique_name("owed-area"), {"--workers", "2", "--shm-clients", "1", "--wait-timeout-ms", "6000"});
  ClientOptions first = shm_client(server.uri);
  first.worker_id = 0;
  {
    Client a(first);
    a.wait(a.init(Key(1), std::vector<float>(8, 1.0f)));
    const Ticket barrier = a.barrier_async();  // worker 1 never comes
    EXPECT_FALSE(a.wait_for(barrier, std::chrono::milliseconds(100)));
  }  // gives the area back after 2 s; the barrier waits until 6 s
  ClientOptions second = shm_client(server.uri);
  second.worker_id = 1;
  std::unique_ptr<Client> b;
  std::string refused;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!b && std::chrono::steady_clock::now() < deadline) {
    try {
      b = std::make_unique<Client>(second);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::capacity) << e.what();
      refused = e.what();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  ASSERT_TRUE(b) << refused;
  EXPECT_NE(refused.find("the server still owes answers"), std::string::npos) << refused;
  // Worker 0's goodbye (clock = done) was served after its barrier's answer.
  EXPECT_NE(b->server_stats(0).find("\"clocks_by_worker\":[-1,0]"), std::string::npos) << b->server_stats(0);
  b->wait(b->init(Key(2), std::vector<float>(8, 2.0f)));  // carried by the ring
  std::vector<float> out(8);
  b->wait(b->pull(Key(2), out));
  EXPECT_EQ(out[0], 2.0f);
}

TEST(ShmIntegration, SegmentIsPrivateAndRemovedAtExit) {
  const std::string name = unique_name("mode");
  const std::string path = "/dev/shm/pskv-" + name;
  {
    auto server = start_shm(name);
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    server.process.signal(SIGTERM);
    EXPECT_EQ(server.process.wait(), 0);
  }
  struct stat st {};
  EXPECT_NE(::stat(path.c_str(), &st), 0) << "the server removes its segment at exit";
}

TEST(ShmIntegration, StaleSegmentIsReclaimedAndLiveOneIsRefused) {
  const std::string name = unique_name("stale");
  auto first = start_shm(name);
  // A second server on the same name while the first lives: refused, naming the owner.
  testing::Process dup(PSKV_SERVER_BIN, {"--uri", "shm://" + name});
  EXPECT_EQ(dup.wait(), 1);
  first.process.signal(SIGKILL);
  first.process.wait();
  // The dead server's segment is still there: clients are told clearly, not hung.
  try {
    Client c(shm_client("shm://" + name));
    ADD_FAILURE() << "connected to a dead server's segment";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::stale_resource) << e.what();
    EXPECT_NE(std::string(e.what()).find("no longer running"), std::string::npos) << e.what();
  }
  // A new server reclaims the name and serves.
  auto second = start_shm(name);
  Client c(shm_client(second.uri));  // the second server removes the reclaimed name at exit
  std::vector<float> v(4, 2.0f);
  c.wait(c.init(Key(1), v));
  c.wait(c.pull(Key(1), v));
  EXPECT_EQ(v[0], 2.0f);
}

TEST(ShmIntegration, ServerDeathIsReportedToClients) {
  const std::string name = unique_name("death");
  auto server = start_shm(name);
  // The death must be noticed as one (the server's pid is checked), not waited out: a timeout
  // would fail with `timeout` after these 10 minutes, long past ctest's limit.
  ClientOptions o = shm_client(server.uri);
  o.io_timeout = std::chrono::minutes(10);
  Client c(o);
  std::vector<float> v(4, 0.0f);
  c.wait(c.init(Key(1), v));
  server.process.signal(SIGKILL);
  server.process.wait();
  try {
    c.wait(c.push(Key(1), v));
    ADD_FAILURE() << "a push to a dead server succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::peer_failure) << e.what();
  }
  ::unlink(("/dev/shm/pskv-" + name).c_str());
}

// Idle means asleep on a futex, not spinning or ticking (ps-lite's receive threads burn a core
// each). Checked through the flags each side raises around its futex wait, sampled while nothing
// happens: a spinning thread never raises its flag, one that wakes often is seen awake. Some
// samples may catch a thread in its 500 ms timeout tick or preempted around the flag.
TEST(ShmIntegration, IdleServerAndClientsSleep) {
  const std::string name = unique_name("idle");
  auto server = start_shm(name, {"--io-threads", "2"});
  ClientOptions o = shm_client(server.uri);
  // The clients idle until the parent has looked, or has failed an assertion.
  struct Release {
    int fd[2] = {-1, -1};
    ~Release() {
      if (::write(fd[1], "xx", 2) != 2) std::perror("release");
      ::close(fd[0]);
      ::close(fd[1]);
    }
  } release;
  ASSERT_EQ(::pipe(release.fd), 0);
  std::vector<pid_t> clients;
  for (int i = 0; i < 2; ++i)
    clients.push_back(fork_worker([&] {
      ::close(release.fd[1]);
      Client c(o);
      char byte;
      return ::read(release.fd[0], &byte, 1) == 1 ? 0 : 1;
    }));
  const std::unique_ptr<shm::Segment> segment = shm::Segment::open(name);
  const std::uint32_t threads = segment->geometry().server_threads;
  ASSERT_EQ(threads, 2u);
  std::vector<shm::ClientArea*> areas;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (areas.size() < clients.size() && std::chrono::steady_clock::now() < deadline) {
    areas.clear();
    for (std::uint32_t i = 0; i < segment->geometry().clients; ++i)
      for (pid_t p : clients)
        if (segment->area(i).owner_pid.load() == p) areas.push_back(&segment->area(i));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(areas.size(), clients.size()) << "the clients never attached";
  auto all_asleep = [&] {
    for (std::uint32_t t = 0; t < threads; ++t)
      if (segment->header().server_sleeping[t].load() != 1) return false;
    for (shm::ClientArea* a : areas)
      if (a->client_sleeping.load() != 1) return false;
    return segment->header().spinners.load() == 0;
  };
  while (!all_asleep() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  int asleep = 0;
  constexpr int kSamples = 400;
  for (int i = 0; i < kSamples; ++i) {
    asleep += all_asleep();
    std::this_thread::sleep_for(std::chrono::microseconds(2500));
  }
  EXPECT_GE(asleep, kSamples * 9 / 10) << "server threads or client helpers were awake in " << kSamples - asleep
                                       << " of " << kSamples << " samples while idle";
}

// A client of a server whose threads hold every core spins only for short waits: a long one (a
// batch of table rows) is worked out on the core a spinner would take. With a core to spare it
// spins for as long as any transport's waiter does.
TEST(ShmIntegration, ClientsOfAServerHoldingEveryCoreSpinOnlyForShortWaits) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const transport::ConnectOptions c;
  if (cores <= shm::kMaxServerThreads) {  // a server takes at most that many threads
    auto busy = start_shm(unique_name("spin-all"), {"--io-threads", std::to_string(cores)});
    auto conn = transport::connect(parse_uri(busy.uri), c);
    ASSERT_NE(conn->poller(), nullptr);
    EXPECT_EQ(conn->poller()->max_spin_micros(), transport::Completion::kContendedSpinMicros);
  }
  if (cores > 1) {
    const unsigned threads = std::min<unsigned>(cores - 1, shm::kMaxServerThreads);
    auto spare = start_shm(unique_name("spin-spare"), {"--io-threads", std::to_string(threads)});
    auto other = transport::connect(parse_uri(spare.uri), c);
    ASSERT_NE(other->poller(), nullptr);
    EXPECT_EQ(other->poller()->max_spin_micros(), transport::Completion::kMaxSpinMicros);
  }
}

TEST(ShmIntegration, BadNamesAreRejected) {
  for (const char* bad : {"shm://", "shm://a/b", "shm://..", "shm://has space"}) {
    ClientOptions o;
    o.servers = {bad};
    EXPECT_THROW(Client c(o), Error) << bad;
  }
}

}  // namespace
}  // namespace pskv
