// The shared-memory path end to end: a real pskv-server owning a segment, workers in forked
// processes, and workers killed with SIGKILL at random instants.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <sstream>
#include <sys/mman.h>
#include <random>
#include <thread>

#include "pskv/client.h"
#include "support/process.h"
#include "support/workloads.h"

namespace pskv {
namespace {

using testing::fork_worker;
using testing::ServerProcess;
using testing::wait_pid;
using testing::expect_nothing_lost;

std::string unique_name(const char* tag) { return std::string(tag) + "-" + std::to_string(getpid()); }

ServerProcess start_shm(const std::string& name, std::vector<std::string> extra = {}) {
  std::vector<std::string> args{"--uri", "shm://" + name};
  if (std::find(extra.begin(), extra.end(), "--io-threads") == extra.end()) extra.insert(extra.end(), {"--io-threads", "1"});
  args.insert(args.end(), extra.begin(), extra.end());
  return ServerProcess::start(args);
}

ClientOptions shm_client(const std::string& uri) {
  ClientOptions o;
  o.servers = {uri};
  return o;
}

long cpu_ticks(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  std::getline(in, stat);
  std::istringstream rest(stat.substr(stat.rfind(')') + 2));
  std::string f;
  long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> f; ++i) {
    if (i == 14) utime = std::stol(f);
    if (i == 15) stime = std::stol(f);
  }
  return utime + stime;
}

TEST(ShmIntegration, MultiProcessPushPull) {
  const std::string name = unique_name("mp");
  auto server = start_shm(name);
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
}

TEST(ShmIntegration, NothingLostWith16Processes) {
  const std::string name = unique_name("lost");
  auto server = start_shm(name);
  expect_nothing_lost(shm_client(server.uri), {.clients = 16, .pushes = 500, .keys = 4, .length = 64, .batch = 32});
}

// Kill a pushing worker at a random instant, 50 times. After each kill, the survivors keep
// making progress, every read is untorn, and no lock is left held (pushes still complete).
TEST(ShmIntegration, SigkillOfPushingWorkersLeavesTheStoreUsable) {
  const std::string name = unique_name("kill");
  auto server = start_shm(name);
  ClientOptions o = shm_client(server.uri);
  constexpr std::uint32_t kLen = 16384;  // 64 KiB values: a kill lands mid-copy often
  {
    Client admin(o);
    std::vector<float> zeros(kLen, 0.0f);
    for (Key k = 0; k < 4; ++k) admin.wait(admin.init(k, zeros));
  }
  // A survivor that pushes and checks for torn reads until told to stop, reporting progress.
  auto* progress = static_cast<std::atomic<std::uint64_t>*>(
      mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  new (progress) std::atomic<std::uint64_t>(0);
  auto* stop = new (progress + 1) std::atomic<std::uint64_t>(0);
  const pid_t survivor = fork_worker([&] {
    Client client(o);
    std::vector<float> one(kLen, 1.0f), out(kLen);
    while (stop->load() == 0) {
      for (Key k = 0; k < 4; ++k) {
        client.wait(client.push(k, one));
        client.wait(client.pull(k, out));
        for (float x : out)
          if (x != out[0]) return 7;  // torn
      }
      progress->fetch_add(1);
    }
    return 0;
  });
  std::mt19937 rng(12345);
  for (int trial = 0; trial < 50; ++trial) {
    const pid_t victim = fork_worker([&]() -> int {
      Client client(o);
      std::vector<float> one(kLen, 1.0f);
      for (int i = 0;; ++i) client.wait(client.push(Key(i % 4), one));
    });
    std::this_thread::sleep_for(std::chrono::microseconds(200 + rng() % 20000));
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
  // A fresh client still gets a slot and an untorn, consistent value after all the kills.
  Client check(o);
  std::vector<float> out(kLen);
  for (Key k = 0; k < 4; ++k) {
    check.wait(check.pull(k, out));
    for (float x : out) ASSERT_EQ(x, out[0]);
  }
  munmap(progress, 4096);
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
  Client c(shm_client(server.uri));
  std::vector<float> v(4, 0.0f);
  c.wait(c.init(Key(1), v));
  server.process.signal(SIGKILL);
  server.process.wait();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(c.wait(c.push(Key(1), v)), Error);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ::unlink(("/dev/shm/pskv-" + name).c_str());
}

TEST(ShmIntegration, IdleServerAndClientsUseAlmostNoCpu) {
  const std::string name = unique_name("idle");
  auto server = start_shm(name, {"--io-threads", "2"});
  ClientOptions o = shm_client(server.uri);
  std::vector<pid_t> clients;
  for (int i = 0; i < 2; ++i)
    clients.push_back(fork_worker([&] {
      Client c(o);
      std::this_thread::sleep_for(std::chrono::seconds(4));
      return 0;
    }));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const long s0 = cpu_ticks(server.process.pid()), c0 = cpu_ticks(clients[0]);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const long s1 = cpu_ticks(server.process.pid()), c1 = cpu_ticks(clients[0]);
  const long hz = sysconf(_SC_CLK_TCK);
  // 2 s of wall time: allow 5% of one core (ps-lite's receive threads would burn 100% each).
  EXPECT_LE(s1 - s0, hz / 10) << "server used " << (s1 - s0) << " ticks while idle";
  EXPECT_LE(c1 - c0, hz / 10) << "client used " << (c1 - c0) << " ticks while idle";
  for (pid_t p : clients) EXPECT_EQ(wait_pid(p), 0);
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
