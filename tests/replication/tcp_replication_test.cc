// Replication over tcp (--replicas R --peers ...): every replica ends with its origin's very bytes
// (values, optimizer state, update counts), and a server SIGKILLed at a random instant under load
// comes back with --rejoin holding every push it acknowledged: nothing lost, nothing applied twice.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>

#include "client/placement.h"
#include "pskv/client.h"
#include "pskv/server.h"
#include "support/process.h"
#include "support/replica_tables.h"
#include "support/requests.h"
#include "support/stats.h"
#include "support/stop.h"
#include "support/token_file.h"
#include "support/workloads.h"
#include "transport/auth.h"
#include "transport/tcp/socket.h"
#include "transport/transport.h"
#include "transport/uri.h"

namespace pskv {
namespace {

using testing::fork_worker;
using testing::ServerProcess;
using testing::wait_pid;

// A ring of `n` tcp servers on fixed ports, so that a restarted one comes back at its address.
class Ring {
 public:
  // Ports the kernel hands out as free now (a fixed formula could land on a port some client
  // connection holds as its local port); a restarted server comes back at the same one.
  Ring(int n, std::uint32_t replicas, std::vector<std::string> extra) : replicas_(replicas), extra_(std::move(extra)) {
    for (int s = 0; s < n; ++s) uris_.push_back("tcp://127.0.0.1:" + std::to_string(tcp::free_loopback_port()));
    for (int s = 0; s < n; ++s) servers_.push_back(start(s, false));
  }
  ServerProcess start(int s, bool rejoin) {
    std::string peers;
    for (const auto& u : uris_) {
      if (!peers.empty()) peers += ',';
      peers += u;
    }
    std::vector<std::string> args = {"--uri",      uris_[std::size_t(s)],     "--server-id", std::to_string(s),
                                     "--replicas", std::to_string(replicas_), "--peers",     peers};
    args.insert(args.end(), extra_.begin(), extra_.end());
    if (rejoin) args.push_back("--rejoin");
    return ServerProcess::start(args);
  }
  void kill(int s, int sig = SIGKILL) {
    servers_[std::size_t(s)].process.signal(sig);
    servers_[std::size_t(s)].process.wait();
  }
  void restart(int s) { servers_[std::size_t(s)] = start(s, true); }
  // Back at its address as a new incarnation that takes nothing from its replicas.
  void restart_empty(int s) { servers_[std::size_t(s)] = start(s, false); }
  void signal(int s, int sig) { servers_[std::size_t(s)].process.signal(sig); }
  // SIGSTOPs server s and returns once it is stopped (kill() only queues the signal).
  bool stop(int s) { return testing::stop_process(servers_[std::size_t(s)].process.pid()); }
  const std::vector<std::string>& uris() const { return uris_; }
  int size() const { return static_cast<int>(uris_.size()); }

 private:
  std::uint32_t replicas_;
  std::vector<std::string> extra_, uris_;
  std::vector<ServerProcess> servers_;
};

// The records (version, update count, value, state) of `keys` (with their record lengths) as the
// server at `uri` holds them for `origin`.
std::vector<float> records(const std::string& uri, std::uint32_t origin,
                           const std::vector<std::pair<Key, std::uint32_t>>& keys) {
  transport::ConnectOptions c;
  c.worker_id = wire::kServerPeer;  // the replication ops are taken from servers only
  auto conn = transport::connect(parse_uri(uri), c);
  std::size_t total = 0;
  for (const auto& k : keys) total += k.second;
  std::vector<float> out(total);
  std::vector<transport::KeySlice> slices;
  float* at = out.data();
  for (const auto& [key, floats] : keys) {
    slices.push_back({key, floats, at});
    at += floats;
  }
  transport::Completion done;
  done.reset(1);
  transport::Request q;
  q.op = wire::Op::replica_pull;
  q.arg0 = origin;
  q.keys = slices;
  q.completion = &done;
  conn->submit(q);
  EXPECT_TRUE(done.wait(std::chrono::steady_clock::now() + std::chrono::seconds(20)));
  EXPECT_EQ(done.status(), Errc::ok) << done.message();
  return out;
}

// Waits until every server reports each of its replicas synced.
void wait_synced(const Ring& ring, std::uint32_t replicas, const std::string& token_file = {}) {
  ClientOptions o;
  o.servers = ring.uris();
  o.auth_token_file = token_file;
  Client c(o);
  testing::wait_replicas_synced(c, replicas);
}

// What a connection that says hello as `hello_as` gets asking `uri` for its replica index of
// `origin`: ok and the index, or the error it was refused with (at the handshake or after).
struct IndexReply {
  Errc code;
  std::string text;  // the index, or why it was refused
};
IndexReply ask_replica_index(const std::string& uri, std::uint32_t origin, std::uint32_t hello_as = wire::kServerPeer,
                             const std::string& token_file = {}) {
  transport::ConnectOptions c;
  c.worker_id = hello_as;
  if (!token_file.empty()) c.token = auth::Token::load_file(token_file);
  try {
    std::shared_ptr<transport::Connection> conn = transport::connect(parse_uri(uri), c);
    testing::Answer got = testing::ask(conn, wire::Op::replica_index, origin);
    return {got.code, std::move(got.text)};
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
}

// Every key of every server, read from the server and from each of its replicas, byte for byte.
// `workers`: the servers' --workers, whose push marks each record carries. `sync_window`: in
// sync mode, the pending steps each record carries (SyncOptions::window).
void expect_replicas_equal(const Ring& ring, std::uint32_t replicas, std::uint32_t state_per_value,
                           std::uint32_t workers = 0, std::uint32_t sync_window = 0) {
  const auto n = static_cast<std::uint32_t>(ring.size());
  // Placement is the client's: each server says which keys it holds through its own index.
  for (std::uint32_t s = 0; s < n; ++s) {
    const auto [code, index] = ask_replica_index(ring.uris()[s], s);
    ASSERT_EQ(code, Errc::ok) << index;
    wire::ReplicaIndexHeader head{};
    std::memcpy(&head, index.data(), sizeof head);
    std::vector<std::pair<Key, std::uint32_t>> held;  // with record lengths (ShardEngine::record_floats)
    for (std::uint64_t i = 0; i < head.keys; ++i) {
      wire::ReplicaIndexEntry e{};
      std::memcpy(&e, index.data() + sizeof head + i * sizeof e, sizeof e);
      const std::uint64_t sync = sync_window ? 2 + sync_window * (4 + 2 * ((workers + 63) / 64) + e.length) : 0;
      held.emplace_back(e.key, static_cast<std::uint32_t>(6 + 2 * workers + e.length * (1 + state_per_value) + sync));
    }
    ASSERT_FALSE(held.empty()) << "server " << s << " holds no key";
    const std::vector<float> own = records(ring.uris()[s], s, held);
    for (std::uint32_t j = 1; j < replicas; ++j) {
      const std::vector<float> copy = records(ring.uris()[(s + j) % n], s, held);
      ASSERT_EQ(own.size(), copy.size());
      EXPECT_EQ(std::memcmp(own.data(), copy.data(), own.size() * sizeof(float)), 0)
          << "server " << (s + j) % n << "'s replica of server " << s << " differs from it";
    }
  }
}

TEST(TcpReplication, ReplicasHoldTheOriginsVeryBytes) {
  constexpr std::uint32_t kReplicas = 3;
  Ring ring(3, kReplicas, {"--rule", "adam", "--lr", "0.01"});
  ClientOptions o;
  o.servers = ring.uris();
  Client c(o);
  constexpr Key kKeys = 60;
  constexpr std::uint32_t kLen = 100;
  std::mt19937 rng(5);
  std::normal_distribution<float> g;
  std::vector<float> v(kLen);
  for (Key k = 0; k < kKeys; ++k) {
    for (float& x : v) x = g(rng);
    c.wait(c.init(k, v));
  }
  for (int step = 0; step < 20; ++step)
    for (Key k = 0; k < kKeys; ++k) {
      for (float& x : v) x = g(rng);
      c.wait(c.push(k, v));
    }
  wait_synced(ring, kReplicas);
  expect_replicas_equal(ring, kReplicas, 2);
}

// Pushes of 1 MiB are applied in 256 KiB pieces, each under the stripe lock, all with one update
// count; two clients pushing the same keys make one push's record be read between the pieces of
// the other. The replica must still end with the origin's bytes (records are ordered by the
// seqlock version, which moves with every piece, not by the update count).
TEST(TcpReplication, PushesAppliedInPiecesReachTheReplicaWhole) {
  Ring ring(2, 2, {"--rule", "momentum", "--lr", "0.01"});
  ClientOptions o;
  o.servers = ring.uris();
  o.chunk_floats = 0;  // whole keys, so each is applied in pieces on its server
  constexpr std::uint32_t kLen = 1u << 18;
  {
    Client c(o);
    const std::vector<float> zeros(kLen, 0.0f);
    for (Key k = 0; k < 4; ++k) c.wait(c.init(k, zeros));
  }
  std::vector<std::thread> pushers;
  for (int t = 0; t < 2; ++t)
    pushers.emplace_back([&, t] {
      Client c(o);
      std::vector<float> g(kLen);
      for (int i = 0; i < 40; ++i) {
        for (std::uint32_t j = 0; j < kLen; ++j) g[j] = float((i * 7 + t * 3 + int(j)) % 13) - 6.0f;
        for (Key k = 0; k < 4; ++k) c.wait(c.push(k, g));
      }
    });
  for (auto& p : pushers) p.join();
  wait_synced(ring, 2);
  expect_replicas_equal(ring, 2, 1);
}

// A replica that hangs (SIGSTOP) holds up its origin's acknowledgements only until the io timeout
// drops it, and meanwhile costs a bounded amount: once the records in flight would pass half the
// memory budget, pushes are refused (capacity, nothing applied) rather than buffered.
TEST(TcpReplication, AHungReplicaCostsABoundedAmountAndIsDroppedAtTheTimeout) {
  Ring ring(2, 2,
            {"--memory-budget-mb", "16", "--max-request-mb", "8", "--frame-timeout-ms", "3000", "--io-threads", "2"});
  ClientOptions o;
  o.servers = ring.uris();
  o.chunk_floats = 0;
  o.io_timeout = std::chrono::seconds(20);
  o.partition = Partition::range;  // key 0 on server 0, key 1 on server 1
  o.range_keys = 2;
  constexpr std::uint32_t kLen = 1u << 18;  // 1 MiB
  constexpr Key on_zero = 0;
  {
    Client c(o);
    const std::vector<float> zeros(kLen, 0.0f);
    for (Key k = 0; k < 2; ++k) c.wait(c.init(k, zeros));
  }
  wait_synced(ring, 2);
  Client c(o);
  ASSERT_TRUE(ring.stop(1));  // server 1 keeps server 0's keys, and now answers nothing
  const std::vector<float> one(kLen, 1.0f);
  std::vector<Ticket> tickets;
  for (int i = 0; i < 24; ++i) tickets.push_back(c.push(on_zero, one));
  int refused = 0, done = 0;
  std::string why;
  for (Ticket t : tickets) {
    try {
      c.wait(t);
      ++done;
    } catch (const Error& e) {
      if (e.code() == Errc::capacity) ++refused;
      why = e.what();
    }
  }
  ring.signal(1, SIGCONT);
  EXPECT_GT(refused, 0) << "24 MiB of pushes were all buffered for a hung replica";
  EXPECT_NE(why.find("replicas are behind"), std::string::npos) << why;
  EXPECT_GT(done, 0) << "the pushes within the bound were never acknowledged (the hung replica was not dropped)";
  // Every acknowledged push is in the value (the refused ones changed nothing).
  std::vector<float> out(kLen);
  c.wait(c.pull(on_zero, out));
  EXPECT_EQ(out[0], float(done));
}

// A trial's client options.
ClientOptions trial_options(const Ring& ring) {
  ClientOptions o;
  o.servers = ring.uris();
  o.io_timeout = std::chrono::seconds(5);
  o.connect_timeout = std::chrono::seconds(2);
  return o;
}
// Worker `w` of `o`'s servers, sending what a server's failure left unanswered again once it
// is back (for up to 30 s) instead of failing.
ClientOptions retrying_worker(const ClientOptions& o, std::uint32_t w) {
  ClientOptions mine = o;
  mine.worker_id = w;
  mine.retry_timeout = std::chrono::seconds(30);
  return mine;
}

// An origin with nothing to ship still notices that its replica died and came back (empty of
// the origin's keys) and transfers them again: otherwise the origin, killed next, could not
// rejoin, since no replica of its keys would be synced.
TEST(TcpReplication, AnIdleOriginNoticesItsReplicaRestartedAndSyncsItAgain) {
  Ring ring(2, 2, {"--rule", "add"});
  ClientOptions o;
  o.servers = ring.uris();
  const std::vector<Key> keys = testing::make_zero_keys(o, 8, 16);
  {
    Client c(o);
    const std::vector<float> ones(16, 1.0f);
    for (Key k : keys) c.wait(c.push(k, ones));
  }
  wait_synced(ring, 2);
  ring.kill(1);  // server 0's replica; server 0 ships nothing from here on
  ring.restart(1);
  wait_synced(ring, 2);  // a replica_1_state that went down and is synced again...
  ClientOptions admin = o;
  admin.servers = {ring.uris()[0]};
  Client stats(admin);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (testing::stats_field(stats.server_stats(0), "replica_1_transfers") < 2) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "server 0 never noticed: " << stats.server_stats(0);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  wait_synced(ring, 2);  // ...after a second transfer
  ring.kill(0);
  ring.restart(0);  // rejoins from server 1, which holds its keys again
  Client c(o);
  std::vector<float> out(16);
  for (Key k : keys) {
    c.wait(c.pull(k, out));
    EXPECT_EQ(out[0], 1.0f) << "key " << k;
  }
}

// Stops a random server with `sig` (with R=3, on every other trial, two) and restarts them with
// --rejoin a random moment later. Returns them, the first chosen first.
std::vector<int> kill_and_rejoin(Ring& ring, std::mt19937& rng, std::uint32_t replicas, int trial, int sig = SIGKILL) {
  const int first = static_cast<int>(rng() % 3);
  std::vector<int> victims = {first};
  if (replicas == 3 && trial % 2 == 1) victims.push_back((first + 1 + int(rng() % 2)) % 3);
  for (int v : victims) ring.kill(v, sig);
  std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 200));
  for (int v : victims) ring.restart(v);
  return victims;
}

// The workers' acknowledged and failed pushes, summed.
std::pair<std::uint64_t, std::uint64_t> totals(const testing::SharedArray<testing::PushTally>& tally, int workers) {
  std::uint64_t acked = 0, failed = 0;
  for (int w = 0; w < workers; ++w) {
    acked += tally[w].acknowledged.load();
    failed += tally[w].failed.load();
  }
  return {acked, failed};
}

class TcpReplicationFault : public ::testing::TestWithParam<std::uint32_t> {};

// Three workers push +1 to 12 keys over 3 servers (every push touches every server) and
// reconnect whenever a server fails them. One server (two with R=3) is SIGKILLed at a random
// instant and restarted with --rejoin. Each key must hold at least every acknowledged push and at
// most those plus one per failed push; once all is synced, every replica equals its origin.
// during_transfer: the restarted server's replica is killed too, a moment later, while the full
// transfer to it (of the restarted server's keys, with 8 MiB of ballast) is under way.
void kill_trials(std::uint32_t replicas, bool during_transfer) {
  std::mt19937 rng(replicas * 31);
  constexpr int kWorkers = 3;
  constexpr Key kKeys = 12;
  constexpr std::size_t kLen = 4096;
  const int n = testing::fault_trials();
  for (int trial = 0; trial < n; ++trial) {
    Ring ring(3, replicas, {"--rule", "add", "--frame-timeout-ms", "2000"});
    const ClientOptions o = trial_options(ring);
    const std::vector<Key> keys = testing::make_zero_keys(o, kKeys, kLen);
    if (during_transfer) {
      Client admin(o);
      const std::vector<float> ballast(1024, 1.0f);
      for (Key k = 1000; k < 3000; ++k) admin.wait(admin.init(k, ballast));
    }
    testing::SharedArray<testing::PushTally> tally(kWorkers);
    testing::SharedArray<std::atomic<int>> stop(1);
    std::vector<pid_t> pids;
    const testing::KillOnExit reap(pids);
    for (int w = 0; w < kWorkers; ++w)
      pids.push_back(fork_worker([&, w] {
        return testing::push_through_failures(o, keys, kLen, tally[w], stop[0], std::chrono::seconds(60));
      }));
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 300));
    const std::vector<int> victims = kill_and_rejoin(ring, rng, replicas, trial);
    if (during_transfer) {
      const int replica = (victims[0] + 1) % 3;
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 20));
      ring.kill(replica);
      ring.restart(replica);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 200));
    stop[0].store(1);
    for (pid_t p : pids) ASSERT_EQ(wait_pid(p, std::chrono::seconds(120)), 0) << "a worker failed, trial " << trial;

    const auto [acked, failed] = totals(tally, kWorkers);
    Client check(o);
    testing::expect_pushes_between(
        check, kKeys, kLen, acked, failed,
        "trial " + std::to_string(trial) + " (killed " + std::to_string(victims.size()) + ")");
    wait_synced(ring, replicas);
    expect_replicas_equal(ring, replicas, 0);
  }
}

TEST_P(TcpReplicationFault, KilledServersRejoinAndLoseNoAcknowledgedPush) {
  kill_trials(GetParam(), false);
}

std::string replicas_name(const ::testing::TestParamInfo<std::uint32_t>& info) {
  std::string name = "R";
  name += static_cast<char>('0' + info.param);
  return name;
}
INSTANTIATE_TEST_SUITE_P(Replicas, TcpReplicationFault, ::testing::Values(2u, 3u), replicas_name);

TEST(TcpReplicationTransfer, AReplicaKilledWhileItReceivesAFullTransferLosesNothing) {
  kill_trials(2, true);
}

class TcpReplicationRetry : public ::testing::TestWithParam<std::uint32_t> {};

// Workers with retry_timeout never see a server die: each reconnects to it once it is back
// (restarted with --rejoin) and sends its unanswered requests again, in order. Every third
// trial stops the server with SIGTERM instead (a graceful stop, then the same restart). Two
// pushes are kept in flight and each round ends with a clock and an SSP-bounded pull, so what
// is sent again is a sequence, and the workers wait on each other's clocks across the restart.
// The marks that the restored keys carry make every push land exactly once, so each key ends
// equal to the number of pushes, every one of them acknowledged.
TEST_P(TcpReplicationRetry, WorkersThatRetrySeeNoErrorAndEveryPushLandsOnce) {
  const std::uint32_t replicas = GetParam();
  std::mt19937 rng(replicas * 71);
  constexpr std::uint32_t kWorkers = 3;
  constexpr Key kKeys = 12;
  constexpr std::size_t kLen = 1024;
  const int n = testing::fault_trials();
  for (int trial = 0; trial < n; ++trial) {
    Ring ring(3, replicas,
              {"--rule", "add", "--frame-timeout-ms", "2000", "--workers", std::to_string(kWorkers), "--mode", "ssp",
               "--staleness", "1", "--wait-timeout-ms", "30000"});
    const ClientOptions o = trial_options(ring);
    const std::vector<Key> keys = testing::make_zero_keys(o, kKeys, kLen);
    testing::SharedArray<testing::PushTally> tally(kWorkers);
    testing::SharedArray<std::atomic<int>> stop(1);
    std::vector<pid_t> pids;
    const testing::KillOnExit reap(pids);
    for (std::uint32_t w = 0; w < kWorkers; ++w)
      pids.push_back(fork_worker([&, w] {
        try {
          Client c(retrying_worker(o, w));
          const std::vector<float> ones(kLen, 1.0f);
          const std::vector<std::span<const float>> values(kKeys, ones);
          std::vector<std::vector<float>> read(kKeys, std::vector<float>(kLen));
          const std::vector<std::span<float>> into(read.begin(), read.end());
          while (!stop[0].load()) {
            const Ticket a = c.push(keys, values);
            const Ticket b = c.push(keys, values);
            c.wait(a);
            c.wait(b);
            tally[w].acknowledged.fetch_add(2);
            c.clock();
            c.wait(c.pull(keys, into));  // bounded: waits for the others' clocks, on every server
          }
          return 0;
        } catch (const Error& e) {
          std::fprintf(stderr, "worker %u: %s\n", w, e.what());
          return 1;
        }
      }));
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 300));
    const std::vector<int> victims = kill_and_rejoin(ring, rng, replicas, trial, trial % 3 == 2 ? SIGTERM : SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 200));
    stop[0].store(1);
    for (pid_t p : pids)
      ASSERT_EQ(wait_pid(p, std::chrono::seconds(120)), 0) << "a worker saw an error, trial " << trial;

    std::uint64_t acked = 0;
    for (std::uint32_t w = 0; w < kWorkers; ++w) acked += tally[w].acknowledged.load();
    Client check(o);
    std::vector<float> out(kLen);
    for (Key k = 0; k < kKeys; ++k) {
      check.wait(check.pull(k, out));
      for (float x : out) ASSERT_EQ(x, out[0]) << "key " << k << " is torn, trial " << trial;
      EXPECT_EQ(out[0], float(acked)) << "key " << k << ": " << acked << " pushes acknowledged, trial " << trial
                                      << " (killed " << victims.size() << ")";
    }
    wait_synced(ring, replicas);
    expect_replicas_equal(ring, replicas, 0, kWorkers);
  }
}
INSTANTIATE_TEST_SUITE_P(Replicas, TcpReplicationRetry, ::testing::Values(2u, 3u), replicas_name);

// Sync mode: a step is applied once all 3 workers pushed it, so a contribution acknowledged and
// then lost with its server would hold its step back forever (the others wait in their bounded
// reads until the wait timeout). The partial sums travel in the records, so a server SIGKILLed
// at a random instant comes back with --rejoin holding every contribution it acknowledged; the
// retrying workers resend the rest, which the step's contributor bitmap takes once. Each step
// applies the mean of 1, 2, 3 with sgd at lr 1 scaled by 3: every value ends at -6 per step.
TEST(TcpReplicationSync, AKilledServerKeepsTheStepsPartialSums) {
  constexpr std::uint32_t kWorkers = 3;
  constexpr Key kKeys = 8;
  constexpr std::size_t kLen = 512;
  constexpr int kSteps = 300;
  std::mt19937 rng(97);
  const int n = std::max(2, testing::fault_trials() / 4);
  for (int trial = 0; trial < n; ++trial) {
    Ring ring(3, 2,
              {"--rule", "sgd", "--lr", "1", "--frame-timeout-ms", "2000", "--workers", std::to_string(kWorkers),
               "--mode", "sync", "--wait-timeout-ms", "30000"});
    const ClientOptions o = trial_options(ring);
    const std::vector<Key> keys = testing::make_zero_keys(o, kKeys, kLen);
    testing::SharedArray<std::atomic<int>> progress(1);  // worker 0's steps done
    std::vector<pid_t> pids;
    const testing::KillOnExit reap(pids);
    const auto began = std::chrono::steady_clock::now();
    for (std::uint32_t w = 0; w < kWorkers; ++w)
      pids.push_back(fork_worker([&, w] {
        try {
          Client c(retrying_worker(o, w));
          const std::vector<float> grad(kLen, float(w + 1));
          const std::vector<std::span<const float>> values(kKeys, grad);
          std::vector<std::vector<float>> read(kKeys, std::vector<float>(kLen));
          const std::vector<std::span<float>> into(read.begin(), read.end());
          for (int step = 0; step < kSteps; ++step) {
            c.wait(c.pull(keys, into));  // waits for every worker's previous step
            c.wait(c.push(keys, values));
            c.clock();
            if (w == 0) progress[0].store(step + 1);
          }
          return 0;
        } catch (const Error& e) {
          std::fprintf(stderr, "worker %u: %s\n", w, e.what());
          return 1;
        }
      }));
    // Killed mid-run, at a step between 50 and 249 of 300.
    const int at = 50 + static_cast<int>(rng() % 200);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (progress[0].load() < at && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    ASSERT_GE(progress[0].load(), at) << "worker 0 never reached step " << at << ", trial " << trial;
    const std::vector<int> victims = kill_and_rejoin(ring, rng, 2, trial);
    for (pid_t p : pids)
      ASSERT_EQ(wait_pid(p, std::chrono::seconds(120)), 0) << "a worker saw an error, trial " << trial;
    std::fprintf(stderr, "trial %d: server %d killed at step %d; %d steps in %.0f ms\n", trial, victims[0], at, kSteps,
                 std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count());
    Client check(o);
    std::vector<float> out(kLen);
    for (Key k : keys) {
      check.wait(check.pull(k, out));
      for (float x : out) ASSERT_EQ(x, -6.0f * kSteps) << "key " << k << ", trial " << trial;
    }
    wait_synced(ring, 2);
    expect_replicas_equal(ring, 2, 0, kWorkers, 4);
  }
}

// A clock is answered once the replicas know it, and a server restarted with --rejoin takes the
// clocks back with the keys. Without that, worker 1's bounded read below waits on the restarted
// server for worker 0's clock 5, which worker 0 saw answered and never sends again (in a job,
// worker 0 may itself be waiting on worker 1 elsewhere: a deadlock until the wait timeout).
TEST(TcpReplicationClocks, ARejoinedServerKnowsEveryClockItAcknowledged) {
  Ring ring(2, 2, {"--workers", "2", "--mode", "ssp", "--staleness", "1", "--wait-timeout-ms", "3000"});
  ClientOptions o;
  o.servers = ring.uris();
  const std::vector<Key> keys = testing::make_zero_keys(o, 8, 16);  // on both servers
  ClientOptions w0 = o;
  w0.worker_id = 0;
  Client ahead(w0);
  for (int i = 0; i < 5; ++i) ahead.clock();
  wait_synced(ring, 2);
  ring.kill(1);
  ring.restart(1);
  // Worker 0 stays connected (a disconnect fails the job under the default policy) and silent.
  ClientOptions w1 = o;
  w1.worker_id = 1;
  w1.initial_clock = 6;  // a read at 6 with staleness 1 needs worker 0 at 5
  Client behind(w1);
  std::vector<std::vector<float>> out(keys.size(), std::vector<float>(16));
  std::vector<std::span<float>> spans(out.begin(), out.end());
  EXPECT_NO_THROW(behind.wait(behind.pull(keys, spans)));
}

// Barrier arrivals are replicated like clocks: both workers pass barrier 1 on server 0, which
// is then killed and restarted with --rejoin. Worker 1 sends barrier 1 again (as a retrying
// client whose answer was lost would): the restarted server must know that worker 0 arrived,
// or worker 1 waits for a worker that passed and never sends it again, until the wait timeout.
TEST(TcpReplicationClocks, ARejoinedServerKnowsEveryBarrierArrival) {
  Ring ring(2, 2, {"--workers", "2", "--wait-timeout-ms", "3000"});
  ClientOptions o;
  o.servers = ring.uris();
  ClientOptions w0 = o, w1 = o;
  w0.worker_id = 0;
  w1.worker_id = 1;
  {
    Client first(w0);  // stays connected: under the default policy a departure fails the job
    {
      Client second(w1);
      const Ticket a = first.barrier_async();
      second.barrier();
      first.wait(a);
      wait_synced(ring, 2);
      ring.kill(0);
      ring.restart(0);
    }
    Client again(w1);
    EXPECT_NO_THROW(again.barrier());
  }
}

// So are evictions: worker 1 never moves, and server 0 evicts it after the wait timeout so that
// worker 0's bounded read goes on. Killed and restarted with --rejoin, server 0 must still know
// it evicted worker 1; otherwise worker 0's next read waits a whole timeout again and the
// straggler is evicted a second time.
TEST(TcpReplicationClocks, ARejoinedServerKnowsWhomItEvicted) {
  Ring ring(2, 2, {"--workers", "2", "--mode", "bsp", "--straggler-policy", "evict", "--wait-timeout-ms", "1000"});
  ClientOptions o;
  o.servers = {ring.uris()[0]};  // everything on server 0
  const std::vector<Key> keys = testing::make_zero_keys(o, 4, 16);
  ClientOptions w0 = o, w1 = o;
  w0.worker_id = 0;
  w1.worker_id = 1;
  std::vector<std::vector<float>> out(keys.size(), std::vector<float>(16));
  std::vector<std::span<float>> spans(out.begin(), out.end());
  Client straggler(w1);  // connected and silent: a departure would evict it at once
  {
    Client ahead(w0);
    for (int i = 0; i < 3; ++i) ahead.clock();
    ahead.wait(ahead.pull(keys, spans));  // answered once worker 1 is evicted
    EXPECT_EQ(testing::stats_field(ahead.server_stats(0), "evictions"), 1);
  }
  wait_synced(ring, 2);
  // The eviction is shipped without waiting for the replica: wait until server 1 holds it.
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    const auto [code, index] = ask_replica_index(ring.uris()[1], 0);
    ASSERT_EQ(code, Errc::ok) << index;
    wire::ReplicaIndexHeader head{};
    std::memcpy(&head, index.data(), sizeof head);
    std::uint64_t evicted = 0;  // after the key entries, each worker's clock and generation
    std::memcpy(&evicted, index.data() + sizeof head + head.keys * sizeof(wire::ReplicaIndexEntry) + 5 * 8, 8);
    if (evicted == 1) break;
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "server 1 never learned of the eviction";
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ring.kill(0);
  ring.restart(0);
  w0.initial_clock = 4;
  Client again(w0);
  again.wait(again.pull(keys, spans));
  EXPECT_EQ(testing::stats_field(again.server_stats(0), "evictions"), 0)
      << "the restarted server waited for, and evicted again, a worker evicted before: " << again.server_stats(0);
}

// The other half: a clock is not answered before the replicas know it. Server 1, server 0's
// replica, is stopped (SIGSTOP), so server 0 cannot answer a clock until it drops server 1 at
// the frame timeout (5 s). The worker's client names server 0 alone, so its clock waits for
// nothing else.
TEST(TcpReplicationClocks, AClockIsAnsweredOnceTheReplicasKnowIt) {
  Ring ring(3, 2, {"--workers", "1", "--mode", "ssp", "--frame-timeout-ms", "5000"});
  wait_synced(ring, 2);
  ClientOptions o;
  o.servers = {ring.uris()[0]};
  o.worker_id = 0;
  Client c(o);
  c.clock();  // answered: every replica is up
  ASSERT_TRUE(ring.stop(1));
  const Ticket t = c.clock_async();
  const bool answered = c.wait_for(t, std::chrono::milliseconds(1000));
  EXPECT_FALSE(answered) << "a clock was answered before its replica knew it";
  ring.signal(1, SIGCONT);
  if (!answered) {
    EXPECT_TRUE(c.wait_for(t, std::chrono::seconds(10)));
  }
}

// A retrying worker sends a part lost with its server again as soon as it fails, even while an
// earlier part of the same request is still unanswered elsewhere. Here worker 1's pull waits on
// server 0 for worker 0's next clock; server 1 is killed under the pull and restarted. The pull's
// part for server 1 must reach the new server 1 before server 0 answers: in a job, whoever would
// move server 0 along (worker 0) may be waiting on server 1 for this worker's clock.
TEST(TcpReplicationClocks, APartLostWithItsServerIsSentAgainWhileTheOthersWait) {
  Ring ring(2, 2, {"--workers", "2", "--mode", "ssp", "--staleness", "0", "--wait-timeout-ms", "20000"});
  ClientOptions o;
  o.servers = ring.uris();
  const std::vector<Key> keys = testing::make_zero_keys(o, 8, 16);  // on both servers
  wait_synced(ring, 2);
  ClientOptions w0 = o, w1 = o;
  w0.worker_id = 0;
  w0.retry_timeout = w1.retry_timeout = std::chrono::seconds(20);
  w1.worker_id = 1;
  w1.initial_clock = 1;  // its reads wait for worker 0's clock 1
  Client first(w0), second(w1);
  std::vector<std::vector<float>> out(keys.size(), std::vector<float>(16));
  std::vector<std::span<float>> spans(out.begin(), out.end());
  std::atomic<bool> answered{false};
  std::string error;
  std::thread reader([&] {
    try {
      second.wait(second.pull(keys, spans));
    } catch (const Error& e) {
      error = e.what();
    }
    answered.store(true);
  });
  // The pull's part on server 1 parks on server 1, so the server dies under the waiting pull.
  auto parked_on_server_1 = [&] {
    ClientOptions admin = o;
    admin.servers = {ring.uris()[1]};
    Client stats(admin);
    double parked = 0;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while ((parked = testing::stats_field(stats.server_stats(0), "parked")) < 1 &&
           std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return parked;
  };
  ASSERT_GE(parked_on_server_1(), 1);
  ring.kill(1);
  ring.restart(1);
  EXPECT_GE(parked_on_server_1(), 1) << "worker 1 did not send its pull again to the restarted server 1";
  EXPECT_FALSE(answered.load()) << error;
  first.clock();  // lets the pull go on both servers
  reader.join();
  EXPECT_EQ(error, "");
}

// Only a connection that says hello as a server may send the replication ops (a worker could
// otherwise overwrite a replica, or mark one synced), and with --peer-token-file it must prove
// that secret, which the clients do not hold.
TEST(TcpReplicationPeers, OnlyServersMaySendTheReplicationOps) {
  {
    Ring ring(2, 2, {"--workers", "1"});
    for (std::uint32_t client : {kNoWorker, 0u}) {
      const auto [code, why] = ask_replica_index(ring.uris()[1], 0, client);
      EXPECT_EQ(code, Errc::permission) << why;
      EXPECT_NE(why.find("only another server"), std::string::npos) << why;
    }
    EXPECT_EQ(ask_replica_index(ring.uris()[1], 0).code, Errc::ok);
  }
  {
    // A server that does not replicate has nothing for a server peer.
    auto lone = ServerProcess::start({"--uri", "tcp://127.0.0.1:0"});
    const auto [code, why] = ask_replica_index(lone.uri, 0);
    EXPECT_EQ(code, Errc::permission) << why;
    EXPECT_NE(why.find("does not replicate"), std::string::npos) << why;
  }
  testing::TokenFile clients("the clients' secret"), servers("the servers' own secret");
  Ring ring(3, 2, {"--workers", "1", "--auth-token-file", clients.path, "--peer-token-file", servers.path});
  wait_synced(ring, 2, clients.path);  // the servers replicate to each other with their own secret...
  // ...which a client's token cannot stand in for, said as a server or not.
  const auto [as_server, why] = ask_replica_index(ring.uris()[0], 0, wire::kServerPeer, clients.path);
  EXPECT_EQ(as_server, Errc::permission) << why;
  EXPECT_EQ(ask_replica_index(ring.uris()[0], 0, kNoWorker, clients.path).code, Errc::permission);
  EXPECT_EQ(ask_replica_index(ring.uris()[0], 0, wire::kServerPeer, servers.path).code, Errc::ok);
  // A server that has it rejoins with it.
  ring.kill(1);
  ring.restart(1);
  EXPECT_EQ(ask_replica_index(ring.uris()[1], 0, wire::kServerPeer, servers.path).code, Errc::ok);
}

// A ring runs on one transport: the servers' --uri, or, for rdma:// servers with --peer-uri, tcp.
// --peers naming another is refused before anything starts, saying which list it should be.
TEST(TcpReplicationPeers, PeersOfAnotherTransportAreRefusedByName) {
  auto refusal = [](ServerOptions so) {
    so.replicas = 2;
    try {
      Server s(so);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  ServerOptions tcp;
  tcp.uri = "tcp://127.0.0.1:0";
  tcp.peers = {"rdma://10.0.0.1:9700", "rdma://10.0.0.2:9700"};
  const std::string a = refusal(tcp);
  EXPECT_NE(a.find("this ring replicates over tcp:// (--peers lists each server's --uri)"), std::string::npos) << a;
  ServerOptions rdma_over_tcp;
  rdma_over_tcp.uri = "rdma://10.0.0.1:9700";
  rdma_over_tcp.peer_uri = "tcp://10.0.0.1:9800";
  rdma_over_tcp.peers = {"rdma://10.0.0.1:9700", "rdma://10.0.0.2:9700"};
  const std::string b = refusal(rdma_over_tcp);
  EXPECT_NE(b.find("this ring replicates over tcp:// (--peers lists each server's --peer-uri)"), std::string::npos)
      << b;
  ServerOptions verbs = rdma_over_tcp;
  verbs.peer_uri.clear();
  verbs.peers = {"tcp://10.0.0.1:9800", "tcp://10.0.0.2:9800"};
  const std::string c = refusal(verbs);
  EXPECT_NE(c.find("this ring replicates over rdma:// (--peers lists each server's --uri)"), std::string::npos) << c;
  rdma_over_tcp.peer_uri = "udp://10.0.0.1:9800";
  const std::string d = refusal(rdma_over_tcp);
  EXPECT_NE(d.find("--peer-uri is a tcp://HOST:PORT"), std::string::npos) << d;
}

// The first `count` ids whose home is server `s` of `servers`: a push of them touches it alone.
std::vector<Key> ids_homed_on(std::size_t s, std::uint32_t servers, std::size_t count) {
  PlacementOptions placement;
  placement.servers = servers;
  std::vector<Key> ids;
  for (Key id = 0; ids.size() < count; ++id)
    if (home_server(placement, id) == s) ids.push_back(id);
  return ids;
}

void expect_table_replicas_equal(const Ring& ring, std::uint32_t replicas, std::uint32_t table) {
  testing::expect_table_copies_equal(ring.uris(), replicas, table);
}

// Rows reach every replica as their origin holds them (values and Adam's moments), evictions
// included: each copy holds exactly the rows its origin holds, never one it evicted. Two clients
// create the table at the same moment and push overlapping ids at once, with rows admitted at
// their second sighting, so one push's admissions and evictions land between another's removals
// and its rows.
TEST(TcpReplicationTables, EveryReplicaHoldsItsOriginsRowsThroughEvictions) {
  constexpr std::uint32_t kReplicas = 3, kDim = 16;
  Ring ring(3, kReplicas, {});
  ClientOptions o;
  o.servers = ring.uris();
  TableSpec spec;
  spec.dim = kDim;
  spec.init = RowInit::normal;
  spec.seed = 7;
  spec.rule = UpdateRuleConfig{UpdateRule::adam};
  spec.rule.lr = 0.01f;
  spec.admit_after = 2;
  spec.eviction = RowEviction::lru;
  spec.max_rows = 400;
  std::vector<std::thread> clients;
  for (int w = 0; w < 2; ++w)
    clients.emplace_back([&, w] {
      Client c(o);
      c.create_table(3, spec);
      std::mt19937 rng(11 + w);
      std::normal_distribution<float> g;
      std::vector<Key> ids;
      std::vector<float> grads(200 * kDim);
      for (int batch = 0; batch < 80; ++batch) {
        std::set<Key> distinct;
        while (distinct.size() < 200) distinct.insert(rng() % 3000);
        ids.assign(distinct.begin(), distinct.end());
        for (float& x : grads) x = g(rng);
        c.wait(c.push_rows(3, ids, grads));
      }
    });
  for (auto& t : clients) t.join();
  Client c(o);
  for (std::uint32_t s = 0; s < 3; ++s)
    EXPECT_GT(testing::stats_field(c.server_stats(s), "table_3_evicted"), 0) << c.server_stats(s);
  wait_synced(ring, kReplicas);
  expect_table_replicas_equal(ring, kReplicas, 3);
}

// Two workers push rounds of rows (testing::RowTables: +1 to 300 rows of one table, random rows
// of a capped Adam table) to 3 servers (R=2) while a random server is SIGKILLed and comes back
// with --rejoin, taking its rows back from its replica. Reconnecting workers: every counted row
// ends between the acknowledged rounds and those plus the failed ones. Retrying workers
// (retry_timeout): no error, and every row at exactly the acknowledged rounds, each push applied
// once whether it was sent again to the restarted server or not. Either way both tables' copies
// end equal to their origins, push marks included; a reconnecting trial then restarts the
// victim's replica, to which its origin transfers every table again.
void row_kill_trials(bool retrying) {
  constexpr int kWorkers = 2;
  const testing::RowTables tables;
  std::mt19937 rng(retrying ? 29 : 23);
  for (int trial = 0; trial < std::max(2, testing::fault_trials() / 4); ++trial) {
    Ring ring(3, 2, {"--frame-timeout-ms", "5000", "--workers", std::to_string(kWorkers)});
    const ClientOptions o = trial_options(ring);
    wait_synced(ring, 2);  // a server killed before its first transfer has no replica to rejoin from
    {
      Client admin(o);
      tables.create(admin);
    }
    testing::SharedArray<testing::PushTally> tally(kWorkers);
    testing::SharedArray<std::atomic<int>> stop(1);
    std::vector<pid_t> pids;
    const testing::KillOnExit reap(pids);
    for (int w = 0; w < kWorkers; ++w)
      pids.push_back(fork_worker([&, w] {
        return tables.push_rounds(retrying ? retrying_worker(o, static_cast<std::uint32_t>(w)) : o,
                                  std::mt19937(static_cast<unsigned>(w) + 100), tally[w], stop[0], retrying);
      }));
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 300));
    const int victim = static_cast<int>(rng() % 3);
    ring.kill(victim);
    std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 200));
    ring.restart(victim);
    std::this_thread::sleep_for(std::chrono::milliseconds(200 + rng() % 200));
    stop[0].store(1);
    for (pid_t p : pids) ASSERT_EQ(wait_pid(p, std::chrono::seconds(120)), 0) << "a worker failed, trial " << trial;
    const auto [acked, failed] = totals(tally, kWorkers);
    Client check(o);
    tables.expect_counted(check, acked, failed,
                          "trial " + std::to_string(trial) + ", killed " + std::to_string(victim));
    wait_synced(ring, 2);
    expect_table_replicas_equal(ring, 2, 0);
    expect_table_replicas_equal(ring, 2, 1);
    if (retrying) continue;
    // The victim's replica restarts empty; its origin transfers the tables to it again.
    const int replica = (victim + 1) % 3;
    ring.kill(replica);
    ring.restart(replica);
    wait_synced(ring, 2);
    expect_table_replicas_equal(ring, 2, 0);
    expect_table_replicas_equal(ring, 2, 1);
  }
}

TEST(TcpReplicationTables, AKilledServerRejoinsWithEveryAcknowledgedRow) {
  row_kill_trials(false);
}

TEST(TcpReplicationTables, RetryingWorkersSeeNoErrorAndEveryRowPushLandsOnce) {
  row_kill_trials(true);
}

// A row push is answered only once its replica holds it: with the replica stopped (SIGSTOP), the
// answer waits until the origin gives up on it (the frame timeout) and drops it, which its stats
// record before the answer comes (an order, not a timing).
TEST(TcpReplicationTables, ARowPushIsAnsweredOnlyOnceTheReplicaHoldsIt) {
  Ring ring(2, 2, {"--frame-timeout-ms", "3000"});
  ClientOptions o;
  o.servers = ring.uris();
  o.io_timeout = std::chrono::seconds(20);
  Client c(o);
  TableSpec spec;
  spec.dim = 16;
  spec.init = RowInit::zeros;
  spec.rule = UpdateRuleConfig{UpdateRule::add};
  c.create_table(0, spec);
  // Ids that live on server 0 only, so nothing of the push waits for the stopped server itself.
  const std::vector<Key> ids = ids_homed_on(0, 2, 50);
  const std::vector<float> ones(ids.size() * spec.dim, 1.0f);
  c.wait(c.push_rows(0, ids, ones));
  wait_synced(ring, 2);
  ASSERT_TRUE(ring.stop(1));
  c.wait(c.push_rows(0, ids, ones));
  // Answered only after the origin gave up on its silent replica: an answer that did not wait for
  // it would come while the replica is still counted live, with no failure on record.
  const double failures = testing::stats_field(c.server_stats(0), "replica_1_failures");
  ring.signal(1, SIGCONT);
  EXPECT_GE(failures, 1) << "answered before its replica could hold it";
  // The replica comes back: the origin, having dropped it, syncs it again, and whatever its old
  // connection still delivers does not undo the new copy.
  for (int i = 0; i < 20; ++i) c.wait(c.push_rows(0, ids, ones));
  wait_synced(ring, 2);
  expect_table_replicas_equal(ring, 2, 0);
  std::vector<float> rows(ones.size());
  c.wait(c.pull_rows(0, ids, rows));
  for (float x : rows) ASSERT_EQ(x, 22.0f);
}

// The workers of a job create their tables at once: a create of a table that another's create
// made a moment before is answered only once the replica holds the table too. With the replica
// stopped (SIGSTOP), both creates wait until the origin gives up on it (the frame timeout), which
// its stats record before either answer. Answered at once, a worker pushed rows that a takeover
// built from that replica refused ("no table 0": rdma_failover_test, a server stalled in the VM).
TEST(TcpReplicationTables, ASecondCreateOfATableIsAnsweredOnlyOnceTheReplicaHoldsIt) {
  Ring ring(2, 2, {"--frame-timeout-ms", "3000"});
  wait_synced(ring, 2);
  ClientOptions o;
  o.servers = {ring.uris()[0]};  // server 0's part of the table only: server 1 is stopped
  o.io_timeout = std::chrono::seconds(20);
  TableSpec spec;
  spec.dim = 16;
  spec.init = RowInit::zeros;
  spec.rule = UpdateRuleConfig{UpdateRule::add};
  ASSERT_TRUE(ring.stop(1));
  std::vector<double> failures_at_answer(2, -1);
  std::vector<std::thread> creators;
  for (int w = 0; w < 2; ++w)
    creators.emplace_back([&, w] {
      try {
        Client c(o);
        c.create_table(0, spec);
        failures_at_answer[std::size_t(w)] = testing::stats_field(c.server_stats(0), "replica_1_failures");
      } catch (const Error& e) {
        ADD_FAILURE() << "creator " << w << ": " << e.what();
      }
    });
  for (auto& t : creators) t.join();
  ring.signal(1, SIGCONT);
  for (int w = 0; w < 2; ++w)
    EXPECT_GE(failures_at_answer[std::size_t(w)], 1)
        << "creator " << w << " was answered before the replica could hold the table";
}

// What a server answers one table frame from a connection that says hello as `hello_as`.
std::pair<Errc, std::string> send_table_frame(const std::string& uri, wire::Op op, std::uint64_t arg0,
                                              std::uint32_t table, std::vector<transport::KeySlice> keys,
                                              std::uint32_t hello_as = wire::kServerPeer) {
  transport::ConnectOptions c;
  c.worker_id = hello_as;
  try {
    std::shared_ptr<transport::Connection> conn = transport::connect(parse_uri(uri), c);
    const testing::Answer got = testing::ask(conn, op, arg0, table, keys);
    return {got.code, got.code == Errc::ok ? std::string() : got.text};
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
}

// The table ops between servers take nothing unchecked: a client may not send them, and a peer's
// frames of the wrong shape are refused by name while the ring goes on serving.
TEST(TcpReplicationTables, BadTableFramesAreRefusedByName) {
  Ring ring(2, 2, {});
  ClientOptions o;
  o.servers = ring.uris();
  Client c(o);
  TableSpec spec;
  spec.dim = 4;
  spec.init = RowInit::zeros;
  spec.rule = UpdateRuleConfig{UpdateRule::add};
  c.create_table(1, spec);
  wait_synced(ring, 2);
  const std::string& replica = ring.uris()[1];  // server 1 keeps server 0's copies
  std::vector<float> row(4, 1.0f);
  const auto [by_client, why_client] =
      send_table_frame(replica, wire::Op::replica_rows, 0, 1, {{7, 4, row.data()}}, kNoWorker);
  EXPECT_EQ(by_client, Errc::permission) << why_client;
  std::vector<float> five(5, 1.0f);  // `add` keeps no state: a row's record is its 4 floats
  const auto [wrong_length, why_length] =
      send_table_frame(replica, wire::Op::replica_rows, 0, 1, {{7, 5, five.data()}});
  EXPECT_EQ(wrong_length, Errc::protocol) << why_length;
  EXPECT_NE(why_length.find("comes with"), std::string::npos) << why_length;
  std::vector<float> bad_spec(wire::kTableSpecFloats + 2, 0.0f);  // dimension 0
  const auto [spec_code, why_spec] =
      send_table_frame(replica, wire::Op::replica_table, 0, 2, {{2, wire::kTableSpecFloats + 2, bad_spec.data()}});
  EXPECT_EQ(spec_code, Errc::invalid_argument) << why_spec;
  std::vector<float> huge(wire::kTableSpecFloats + 2);
  wire::encode_table_spec(spec, huge.data());
  const std::uint64_t cap = std::uint64_t{1} << 40;
  std::memcpy(huge.data() + wire::kTableSpecFloats, &cap, sizeof cap);
  const auto [cap_code, why_cap] =
      send_table_frame(replica, wire::Op::replica_table, 0, 2, {{2, wire::kTableSpecFloats + 2, huge.data()}});
  EXPECT_EQ(cap_code, Errc::invalid_argument) << why_cap;
  EXPECT_NE(why_cap.find("cannot have a cap"), std::string::npos) << why_cap;
  const auto [pages, why_pages] =
      send_table_frame(replica, wire::Op::replica_table_rows, 0, 1, {{0, 1, nullptr}, {0, 1, nullptr}});
  EXPECT_EQ(pages, Errc::protocol) << why_pages;
  const auto [origin, why_origin] = send_table_frame(replica, wire::Op::replica_rows, 5, 1, {{7, 4, row.data()}});
  EXPECT_EQ(origin, Errc::invalid_argument) << why_origin;  // server 1 keeps no replica of a server 5
  // The ring serves on, and the copy holds what the origin does.
  std::vector<Key> ids = {1, 2, 3, 4, 5, 6};
  std::vector<float> ones(ids.size() * 4, 1.0f);
  c.wait(c.push_rows(1, ids, ones));
  expect_table_replicas_equal(ring, 2, 1);
}

// A retrying client's table push carries its identity (session, sequence number) in its first
// key, and a replicated server keeps, per table and worker, the mark of the newest one applied:
// the same push sent again, or an older one, is answered and left alone, and the copies hold the
// mark with the rows.
TEST(TcpReplicationTables, ATablePushSentAgainIsAppliedOnce) {
  Ring ring(2, 2, {"--workers", "2"});
  ClientOptions o;
  o.servers = ring.uris();
  Client c(o);
  TableSpec spec;
  spec.dim = 4;
  spec.init = RowInit::zeros;
  spec.rule = UpdateRuleConfig{UpdateRule::add};
  c.create_table(2, spec);
  wait_synced(ring, 2);
  const Key id = ids_homed_on(0, 2, 1)[0];
  std::vector<float> row(4, 1.0f);
  float none = 0;
  const std::string& origin = ring.uris()[0];
  auto push = [&](std::uint64_t session, std::uint32_t seq, std::uint32_t worker) {
    return send_table_frame(origin, wire::Op::table_push, 0, 2,
                            {{(session << 32) | seq, 0, &none}, {id, 4, row.data()}}, worker);
  };
  auto value = [&] {
    std::vector<float> out(4);
    c.wait(c.pull_rows(2, std::vector<Key>{id}, out));
    return out[0];
  };
  EXPECT_EQ(push(7, 1, 0).first, Errc::ok);
  EXPECT_EQ(value(), 1.0f);
  EXPECT_EQ(push(7, 1, 0).first, Errc::ok);  // sent again: answered, not applied
  EXPECT_EQ(value(), 1.0f);
  EXPECT_EQ(push(7, 3, 0).first, Errc::ok);
  EXPECT_EQ(push(7, 2, 0).first, Errc::ok);  // older than the mark: it reached the table before
  EXPECT_EQ(value(), 2.0f);
  EXPECT_EQ(push(7, 1, 1).first, Errc::ok);  // another worker's marks are its own
  EXPECT_EQ(push(9, 1, 0).first, Errc::ok);  // a new session of worker 0
  EXPECT_EQ(value(), 4.0f);
  EXPECT_EQ(testing::stats_field(c.server_stats(0), "pushes_already_applied"), 2) << c.server_stats(0);
  const testing::TableCopy own = testing::table_copy(origin, 0, 2);
  EXPECT_EQ(own.marks, (std::vector<std::uint64_t>{(9ull << 32) | 1, (7ull << 32) | 1}));
  expect_table_replicas_equal(ring, 2, 2);
  // An identity without a session, and a client pushing as nobody.
  EXPECT_EQ(push(0, 4, 0).first, Errc::protocol);
  const auto [nobody, why_nobody] = push(7, 4, kNoWorker);
  EXPECT_EQ(nobody, Errc::invalid_argument) << why_nobody;
  EXPECT_EQ(value(), 4.0f);
  // The copies' marks are checked like their rows.
  std::uint64_t mark = 1;
  std::vector<float> mark_floats(2);
  std::memcpy(mark_floats.data(), &mark, sizeof mark);
  const auto [stray, why_stray] =
      send_table_frame(ring.uris()[1], wire::Op::replica_rows_marked, 0, 2, {{9, 2, mark_floats.data()}});
  EXPECT_EQ(stray, Errc::protocol) << why_stray;  // worker 9 of 2
  const auto [shape, why_shape] =
      send_table_frame(ring.uris()[1], wire::Op::replica_rows_marked, 0, 2, {{0, 4, row.data()}});
  EXPECT_EQ(shape, Errc::protocol) << why_shape;
  expect_table_replicas_equal(ring, 2, 2);
}

// A server restarted without --rejoin is a new incarnation whose table stream counts from 0 again.
// A replica stopped meanwhile (SIGSTOP) keeps the earlier incarnation's copy, further along that
// stream and still saying synced. Killed again and restarted with --rejoin, the server must take
// its tables from the copy its latest incarnation transferred, not from the stale one: the
// syncing mark names the incarnation, and a rejoin compares it before the position.
// Its dense keys too: a key only the earlier incarnation wrote does not come back.
TEST(TcpReplicationTables, ARejoinPrefersTheLatestIncarnationsCopyToAStaleOne) {
  Ring ring(3, 3, {"--frame-timeout-ms", "1000"});
  ClientOptions o = trial_options(ring);
  o.io_timeout = std::chrono::seconds(20);
  TableSpec spec;
  spec.dim = 4;
  spec.init = RowInit::zeros;
  spec.rule = UpdateRuleConfig{UpdateRule::add};
  spec.max_rows = 10000;
  const std::vector<Key> ids = ids_homed_on(0, 3, 50);
  const std::vector<float> ones(ids.size() * spec.dim, 1.0f);
  // A dense key only the first incarnation holds (table rows and keys are spaces of their own).
  const Key only_first = ids.front();
  {
    Client c(o);
    c.create_table(0, spec);
    for (int i = 0; i < 100; ++i) c.wait(c.push_rows(0, ids, ones));  // a long stream
    c.wait(c.init(only_first, std::vector<float>(4, 7.0f)));
  }
  wait_synced(ring, 3);
  ASSERT_TRUE(ring.stop(2));  // server 2 keeps that incarnation's copy
  ring.kill(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // incarnations are named in seconds
  ring.restart_empty(0);
  // A short one, over a connection of its own (a client would also connect to server 2).
  std::vector<float> words(wire::kTableSpecFloats);
  wire::encode_table_spec(spec, words.data());
  ASSERT_EQ(send_table_frame(ring.uris()[0], wire::Op::table_create, 0, 0, {{0, wire::kTableSpecFloats, words.data()}},
                             kNoWorker)
                .first,
            Errc::ok);
  std::vector<transport::KeySlice> rows;
  for (std::size_t i = 0; i < ids.size(); ++i)
    rows.push_back({ids[i], spec.dim, const_cast<float*>(ones.data()) + i * spec.dim});
  for (int i = 0; i < 3; ++i) {
    const auto [pushed, why] = send_table_frame(ring.uris()[0], wire::Op::table_push, 0, 0, rows, kNoWorker);
    ASSERT_EQ(pushed, Errc::ok) << why;
  }
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  testing::TableCopy fresh;
  while (!(fresh = testing::table_copy(ring.uris()[1], 0, 0)).synced || fresh.rows.size() != ids.size()) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up) << "server 1 never held the new incarnation's copy";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ring.kill(0);
  ring.signal(2, SIGCONT);
  // Server 2 answers again with the first incarnation's copy, synced, further along: the rejoin
  // must pass it over.
  const testing::TableCopy stale = testing::table_copy(ring.uris()[2], 0, 0);
  ASSERT_TRUE(stale.exists && stale.synced);
  ASSERT_EQ(stale.rows.begin()->second[0], 100.0f);
  ring.restart(0);
  Client c(o);
  c.create_table(0, spec);
  std::vector<float> back(ones.size());
  c.wait(c.pull_rows(0, ids, back));
  for (std::size_t i = 0; i < ids.size(); ++i)
    ASSERT_EQ(back[i * spec.dim], 3.0f) << "row " << ids[i] << " came back from the earlier incarnation";
  // Nor do dense keys: server 1's copy was restarted by the later incarnation's transfer.
  std::vector<float> value(4);
  try {
    c.wait(c.pull(only_first, value));
    ADD_FAILURE() << "key " << only_first << " came back from the earlier incarnation, holding " << value[0];
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::not_found) << e.what();
  }
}

}  // namespace
}  // namespace pskv
