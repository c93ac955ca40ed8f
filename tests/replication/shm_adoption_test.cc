// A restarted shm server adopts its dead predecessor's segment (shm://NAME?adopt=1): SIGKILLed at
// random instants under load, it comes back with every acknowledged push, nothing applied twice
// or torn, the workers' clocks, and a failed start leaves the segment for the next attempt.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include "layout/store_format.h"
#include "pskv/client.h"
#include "support/process.h"
#include "support/replica_tables.h"
#include "support/stats.h"
#include "support/workloads.h"
#include "table/embedding_table.h"
#include "transport/shm/mapped_file.h"
#include "transport/shm/segment.h"

namespace pskv {
namespace {

using testing::fork_worker;
using testing::ServerProcess;
using testing::wait_pid;

std::string segment_name(const std::string& tag, int trial) {
  return "adopt-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(trial);
}

std::uint64_t stat_field(const std::string& json, const std::string& name) {
  return static_cast<std::uint64_t>(testing::stats_field(json, name));
}

class ShmAdoption : public ::testing::TestWithParam<std::string> {};

// Three workers push +1 to four keys (one push of all four at a time, 256 KiB each, so kills land
// inside applies) and reconnect whenever their server fails them. The server is SIGKILLed at a
// random instant and restarted at once with adopt=1. Each key must hold at least every
// acknowledged push and at most those plus one per push that failed (a push cut by the kill may
// have landed, whole per key): nothing acknowledged lost, nothing applied twice, nothing torn.
TEST_P(ShmAdoption, AKilledServerIsAdoptedAndLosesNoAcknowledgedPush) {
  std::mt19937 rng(24);
  constexpr int kWorkers = 3;
  constexpr Key kKeys = 4;
  constexpr std::size_t kLen = 64 * 1024;
  std::uint64_t rolled_back = 0, adopted_runs = 0;
  for (int trial = 0; trial < testing::fault_trials(); ++trial) {
    const std::string uri =
        "shm://" + segment_name(GetParam(), trial) + "?adopt=1&push=" + GetParam() + "&area_mb=4&clients=8";
    const std::vector<std::string> args = {"--uri", uri, "--arena-mb", "16", "--wait-timeout-ms", "2000"};
    auto server = ServerProcess::start(args);
    ClientOptions o;
    o.servers = {server.uri};
    o.io_timeout = std::chrono::seconds(5);
    std::vector<Key> keys(kKeys);
    for (Key k = 0; k < kKeys; ++k) keys[k] = k;
    {
      Client admin(o);
      const std::vector<float> zeros(kLen, 0.0f);
      for (Key k = 0; k < kKeys; ++k) admin.wait(admin.init(k, zeros));
    }
    testing::SharedArray<testing::PushTally> tally(kWorkers);
    testing::SharedArray<std::atomic<int>> stop(1);
    std::vector<pid_t> pids;
    const testing::KillOnExit reap(pids);
    for (int w = 0; w < kWorkers; ++w)
      pids.push_back(fork_worker([&, w] {
        return testing::push_through_failures(o, keys, kLen, tally[w], stop[0], std::chrono::seconds(20));
      }));
    std::this_thread::sleep_for(std::chrono::milliseconds(30 + rng() % 200));
    const std::uint64_t acked_before_kill = [&] {
      std::uint64_t n = 0;
      for (int w = 0; w < kWorkers; ++w) n += tally[w].acknowledged.load();
      return n;
    }();
    // Every other trial a worker dies with the server, perhaps inside a push it applies itself:
    // nobody is left to roll that back but the successor.
    const bool worker_dies = trial % 2 == 1;
    if (worker_dies) kill(pids[0], SIGKILL);
    server.process.signal(SIGKILL);
    server.process.wait();
    server = ServerProcess::start(args);
    std::this_thread::sleep_for(std::chrono::milliseconds(50 + rng() % 150));
    stop[0].store(1);
    for (std::size_t w = 0; w < pids.size(); ++w) {
      const int rc = wait_pid(pids[w], std::chrono::seconds(60));
      if (w == 0 && worker_dies)
        EXPECT_TRUE(rc == 128 + SIGKILL || rc == 0) << "trial " << trial;
      else
        ASSERT_EQ(rc, 0) << "worker " << w << " failed, trial " << trial;
    }

    std::uint64_t acked = 0, failed = 0;
    for (int w = 0; w < kWorkers; ++w) {
      acked += tally[w].acknowledged.load();
      failed += tally[w].failed.load();
    }
    if (worker_dies) ++failed;  // the push it was inside, if any
    EXPECT_GT(acked_before_kill, 0u) << "the kill came before any push: the trial tested nothing";
    Client check(o);
    testing::expect_pushes_between(check, kKeys, kLen, acked, failed, "trial " + std::to_string(trial));
    const std::string stats = check.server_stats(0);
    EXPECT_EQ(stat_field(stats, "adopted_keys"), kKeys) << stats;
    rolled_back += stat_field(stats, "adopted_rolled_back");
    ++adopted_runs;
  }
  std::printf("[ adopt    ] %llu of %llu kills left a push half-applied that adoption rolled back\n",
              static_cast<unsigned long long>(rolled_back), static_cast<unsigned long long>(adopted_runs));
}

INSTANTIATE_TEST_SUITE_P(Push, ShmAdoption, ::testing::Values("worker", "server"),
                         [](const auto& info) { return info.param; });

// Embedding tables too. Two workers push rounds of rows (testing::RowTables: +1 to 300 rows of one
// table, random rows of an Adam table capped at 300 rows with LRU eviction) and reconnect whenever
// their server fails them; the server is SIGKILLed at a random instant and restarted with
// adopt=1. Every counted row ends whole, between the acknowledged rounds and those plus the
// failed ones. Then, with nothing pushing, a second kill: every row of both tables reads back the
// very bytes it had, and on a third table (Adam) the push after the kill gives the very bytes an
// EmbeddingTable of this process gives for the same pushes: the moments and each row's update
// count came back too.
TEST(ShmAdoptionTables, AKilledServerIsAdoptedWithEveryAcknowledgedRow) {
  constexpr int kWorkers = 2;
  const testing::RowTables tables;
  std::mt19937 rng(25);
  std::uint64_t rolled_back = 0;
  const int trials = std::max(2, testing::fault_trials() / 4);
  for (int trial = 0; trial < trials; ++trial) {
    const std::string uri = "shm://" + segment_name("tables", trial) + "?adopt=1&area_mb=4&clients=8";
    const std::vector<std::string> args = {"--uri", uri, "--wait-timeout-ms", "2000"};
    auto server = ServerProcess::start(args);
    ClientOptions o;
    o.servers = {server.uri};
    o.io_timeout = std::chrono::seconds(5);
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
        return tables.push_rounds(o, std::mt19937(static_cast<unsigned>(w + 100 + trial * 10)), tally[w], stop[0],
                                  /*fail_fast=*/false);
      }));
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 300));
    server.process.signal(SIGKILL);
    server.process.wait();
    server = ServerProcess::start(args);
    std::this_thread::sleep_for(std::chrono::milliseconds(100 + rng() % 200));
    stop[0].store(1);
    for (pid_t p : pids) ASSERT_EQ(wait_pid(p, std::chrono::seconds(90)), 0) << "a worker failed, trial " << trial;
    std::uint64_t acked = 0, failed = 0;
    for (int w = 0; w < kWorkers; ++w) {
      acked += tally[w].acknowledged.load();
      failed += tally[w].failed.load();
    }
    EXPECT_GT(failed + acked, 0u) << "nothing was pushed: the trial tested nothing";
    {
      Client check(o);
      tables.expect_counted(check, acked, failed, "trial " + std::to_string(trial));
      const std::string stats = check.server_stats(0);
      EXPECT_EQ(stat_field(stats, "adopted_tables"), 2u) << stats;
      EXPECT_EQ(stat_field(stats, "adopted_rows_torn"), 0u) << stats;
      EXPECT_EQ(stat_field(stats, "adopted_rows_refused"), 0u) << stats;
      rolled_back += stat_field(stats, "adopted_rows_rolled_back");
    }

    // Quiet now: a kill must change no byte of any row, and leave Adam's state as it was.
    std::vector<Key> capped_ids(2000);
    for (Key id = 0; id < 2000; ++id) capped_ids[id] = id;
    auto read_both = [&](Client& c) {
      std::vector<float> rows((capped_ids.size() + tables.ids.size()) * testing::RowTables::kDim);
      const std::span<float> all(rows);
      c.wait(c.pull_rows(1, capped_ids, all.first(capped_ids.size() * testing::RowTables::kDim)));
      c.wait(c.pull_rows(0, tables.ids, all.subspan(capped_ids.size() * testing::RowTables::kDim)));
      return rows;
    };
    TableSpec adam;
    adam.dim = 16;
    adam.init = RowInit::normal;
    adam.seed = 9;
    adam.rule = UpdateRuleConfig{UpdateRule::adam};
    adam.rule.lr = 0.05f;
    EmbeddingTable reference(adam);
    const std::vector<Key> adam_ids = {5, 77, 1234567};
    std::vector<float> grads(adam_ids.size() * adam.dim);
    auto next_grads = [&](int round) {
      for (std::size_t i = 0; i < grads.size(); ++i) grads[i] = 0.1f * float((i * 7 + round * 3) % 11) - 0.5f;
      reference.push(adam_ids, grads.data(), 0);
    };
    std::vector<float> before, after;
    std::uint64_t capped_rows = 0;
    {
      Client c(o);
      tables.create(c);
      c.create_table(2, adam);
      for (int round = 0; round < 3; ++round) {
        next_grads(round);
        c.wait(c.push_rows(2, adam_ids, grads));
      }
      before = read_both(c);
      capped_rows = stat_field(c.server_stats(0), "table_1_rows");
    }
    server.process.signal(SIGKILL);
    server.process.wait();
    server = ServerProcess::start(args);
    Client c(o);
    tables.create(c);
    after = read_both(c);
    ASSERT_EQ(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)), 0)
        << "a row changed across a kill with nothing pushing, trial " << trial;
    const std::string stats = c.server_stats(0);
    EXPECT_EQ(stat_field(stats, "adopted_rows"), tables.ids.size() + capped_rows + adam_ids.size()) << stats;
    EXPECT_EQ(stat_field(stats, "table_1_rows"), capped_rows) << stats;
    c.create_table(2, adam);
    next_grads(3);
    c.wait(c.push_rows(2, adam_ids, grads));
    std::vector<float> got(grads.size()), want(grads.size());
    c.wait(c.pull_rows(2, adam_ids, got));
    reference.pull(adam_ids, want.data());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
        << "the fourth Adam update after the kill differs from one on a table never killed, trial " << trial;
  }
  std::printf("[ adopt    ] %llu row writes cut by %d kills under load were rolled back\n",
              static_cast<unsigned long long>(rolled_back), trials);
}

// The tables a successor makes are the dead server's, whatever else it starts with. Server A
// checkpoints table 7 (capped at 100 rows, LRU) holding ids 0..99 and table 2 (no cap: it gets
// what the table memory has left); B restores that checkpoint, pushes ids 100..199 (evicting
// 0..99) and is SIGKILLed; C restores the same old checkpoint and adopts B's tables: it must
// hold B's rows only, the checkpoint's rows B evicted gone, however they would evict each other. Then C
// is killed and D adopts without a checkpoint, making table 2 before table 7: it must give table
// 2 the cap it had, not all the memory (table 7 would find none and D would not start).
TEST(ShmAdoptionTables, TheSuccessorHoldsTheDeadServersRowsWithTheCapsTheyHad) {
  const std::string dir = ::testing::TempDir() + "adopt-restore-" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  const std::string uri = "shm://" + segment_name("caps", 0) + "?adopt=1";
  const std::vector<std::string> args = {"--uri", uri, "--table-memory-mb", "64", "--checkpoint-dir", dir};
  std::vector<std::string> restoring = args;
  restoring.insert(restoring.end(), {"--restore", dir});
  TableSpec capped;
  capped.dim = 4;
  capped.init = RowInit::zeros;
  capped.rule = UpdateRuleConfig{UpdateRule::add};
  capped.eviction = RowEviction::lru;
  capped.max_rows = 100;
  TableSpec open = capped;
  open.eviction = RowEviction::none;
  open.max_rows = 0;
  std::vector<Key> first(100), second(100), few(10);
  for (Key i = 0; i < 100; ++i) {
    first[i] = i;
    second[i] = 100 + i;
  }
  for (Key i = 0; i < 10; ++i) few[i] = i;
  auto push = [](Client& c, std::uint32_t table, const std::vector<Key>& ids, float x) {
    const std::vector<float> g(ids.size() * 4, x);
    c.wait(c.push_rows(table, ids, g));
  };
  std::vector<Key> all(first);
  all.insert(all.end(), second.begin(), second.end());
  auto rows_of = [&](Client& c, std::uint32_t table) {
    std::vector<float> got(all.size() * 4);
    c.wait(c.pull_rows(table, all, got));
    return got;
  };
  ClientOptions o;
  {
    auto a = ServerProcess::start(args);
    o.servers = {a.uri};
    Client c(o);
    c.create_table(7, capped);
    c.create_table(2, open);
    push(c, 7, first, 1.0f);
    push(c, 2, few, 1.0f);
    a.process.signal(SIGTERM);  // its last checkpoint
    ASSERT_EQ(a.process.wait(), 0);
  }
  std::vector<float> on_b7, on_b2;
  std::uint64_t b_rows = 0;
  {
    auto b = ServerProcess::start(restoring);
    Client c(o);
    c.create_table(7, capped);
    c.create_table(2, open);
    push(c, 7, second, 2.0f);
    push(c, 2, few, 2.0f);
    on_b7 = rows_of(c, 7);
    on_b2 = rows_of(c, 2);
    b_rows = stat_field(c.server_stats(0), "table_7_rows");
    b.process.signal(SIGKILL);
    b.process.wait();
  }
  ASSERT_EQ(b_rows, 100u);
  ASSERT_LT(std::count(on_b7.begin(), on_b7.begin() + 400, 1.0f), 400) << "B evicted none of the checkpoint's rows";
  auto expect_bs_rows = [&](Client& c, const char* when) {
    c.create_table(7, capped);
    c.create_table(2, open);
    const std::vector<float> t7 = rows_of(c, 7), t2 = rows_of(c, 2);
    EXPECT_EQ(std::memcmp(t7.data(), on_b7.data(), t7.size() * sizeof(float)), 0) << "table 7 " << when;
    EXPECT_EQ(std::memcmp(t2.data(), on_b2.data(), t2.size() * sizeof(float)), 0) << "table 2 " << when;
    const std::string stats = c.server_stats(0);
    EXPECT_EQ(stat_field(stats, "table_7_rows"), b_rows) << when << ": " << stats;
    EXPECT_EQ(stat_field(stats, "adopted_rows"), b_rows + few.size()) << when << ": " << stats;
  };
  auto server = ServerProcess::start(restoring);
  {
    Client c(o);
    expect_bs_rows(c, "adopted over the checkpoint");
  }
  server.process.signal(SIGKILL);
  server.process.wait();
  server = ServerProcess::start(args);
  {
    Client c(o);
    expect_bs_rows(c, "adopted without a checkpoint, table 2 made first");
  }
  server.process.signal(SIGTERM);
  server.process.wait();
  std::filesystem::remove_all(dir);
}

// A successor killed while it adopts served nobody: the next one adopts the segment and tables the
// first server left, which the killed one had moved aside, not the part it had copied nor nothing.
// The two states a successor can die in are staged by a child that does what a successor does,
// then exits without serving (a kill between two steps cannot be timed): "aside", it moved the
// segment aside (NAME.adopting-PID) and died; "unready", it also made its own segment under the
// name, never made ready.
class ShmAdoptionTwice : public ::testing::TestWithParam<std::string> {};

TEST_P(ShmAdoptionTwice, ASuccessorKilledWhileAdoptingLeavesTheWholeOriginalToTheNext) {
  const std::string name = segment_name("twice-" + GetParam(), 0);
  const std::string uri = "shm://" + name + "?adopt=1";
  const std::vector<std::string> args = {"--uri", uri, "--table-memory-mb", "2048"};
  constexpr Key kRows = 200000, kBatch = 100000;
  TableSpec spec;
  spec.dim = 16;
  spec.init = RowInit::zeros;
  spec.rule = UpdateRuleConfig{UpdateRule::add};
  ClientOptions o;
  {
    auto first = ServerProcess::start(args);
    o.servers = {first.uri};
    Client c(o);
    c.wait(c.init(1, std::vector<float>(16, 5.0f)));
    c.create_table(0, spec);
    std::vector<Key> ids(kBatch);
    std::vector<float> rows(kBatch * spec.dim);
    for (Key b = 0; b < kRows; b += kBatch) {
      for (Key i = 0; i < kBatch; ++i) {
        ids[i] = b + i;
        std::fill_n(rows.begin() + static_cast<std::ptrdiff_t>(i * spec.dim), spec.dim, float((b + i) % 1000));
      }
      c.wait(c.push_rows(0, ids, rows));
    }
    first.process.signal(SIGKILL);
    first.process.wait();
  }
  const bool unready = GetParam() == "unready";
  const pid_t successor = fork_worker([&] {
    const std::string object = "/dev/shm/pskv-" + name;
    if (::rename(object.c_str(), (object + ".adopting-" + std::to_string(getpid())).c_str()) != 0) return 1;
    if (unready) (void)shm::Segment::create(name, shm::SegmentConfig{}).release();  // stays, never ready
    return 0;
  });
  ASSERT_EQ(wait_pid(successor), 0);
  const std::string expect_in_log = unready ? "before it served anyone; adopting that one instead of its copy"
                                            : "died while adopting the segment it moved to";

  const std::string next_log = ::testing::TempDir() + "adopt-twice-next-" + GetParam() + ".log";
  auto server = ServerProcess::start(args, next_log);
  Client c(o);
  c.create_table(0, spec);
  std::vector<Key> probe;
  for (Key id = 7; id < kRows; id += 997) probe.push_back(id);
  std::vector<float> got(probe.size() * spec.dim);
  c.wait(c.pull_rows(0, probe, got));
  for (std::size_t i = 0; i < probe.size(); ++i)
    ASSERT_EQ(got[i * spec.dim], float(probe[i] % 1000)) << "row " << probe[i];
  std::vector<float> dense(16);
  c.wait(c.pull(1, dense));
  EXPECT_EQ(dense[0], 5.0f);
  const std::string stats = c.server_stats(0);
  EXPECT_EQ(stat_field(stats, "adopted_rows"), kRows) << stats;
  EXPECT_NE(testing::read_file(next_log).find(expect_in_log), std::string::npos) << testing::read_file(next_log);
}

INSTANTIATE_TEST_SUITE_P(DiedWhen, ShmAdoptionTwice, ::testing::Values("aside", "unready"),
                         [](const auto& info) { return info.param; });

// A dead server's segment is writable by every process of the user, so its successor reads the
// geometry as a peer's: offsets whose sums with a size wrap back into the mapping, and a state
// arena shorter than the values need, once crashed the successor at every start (SIGSEGV, or
// state pointers past the region). Each is refused by name, the segment stays for the next
// start, and once the header is whole again the next successor adopts every key.
TEST(ShmAdoptionForged, AHeaderThatDoesNotFitItsMappingIsRefusedAndKept) {
  const std::string name = segment_name("forged", 0);
  const std::vector<std::string> args = {"--uri", "shm://" + name + "?adopt=1", "--rule", "momentum", "--lr", "0.5"};
  ClientOptions o;
  {
    auto first = ServerProcess::start(args);
    o.servers = {first.uri};
    Client c(o);
    c.wait(c.init(1, std::vector<float>(16, 3.0f)));
    first.process.signal(SIGKILL);
    first.process.wait();
  }
  const std::string object = "/dev/shm/pskv-" + name;
  auto mapped = shm::MappedFile::open(object);  // kept when it goes
  std::byte* base = mapped->data();
  auto& h = *reinterpret_cast<shm::SegmentHeader*>(base);
  auto& sh = *reinterpret_cast<StoreHeader*>(base + h.store_offset);
  std::vector<std::byte> saved(offsetof(shm::SegmentHeader, ready)), saved_store(kStoreFixedHeaderBytes);
  std::memcpy(saved.data(), &h, saved.size());
  std::memcpy(saved_store.data(), &sh, saved_store.size());
  const std::vector<std::pair<std::string, std::function<void()>>> forgeries = {
      {"areas wrap",
       [&] {
         h.clients = 1;
         h.areas_offset = 0ull - (1ull << 41);
         h.area_stride = 1ull << 41;
       }},
      {"clock offset wraps", [&] { h.clock_offset = 0ull - 64; }},
      {"store index wraps",
       [&] {
         sh.index_offset = 0ull - (1ull << 40);
         sh.index_capacity = 1ull << 36;
       }},
      {"no state for momentum",
       [&] {
         sh.state_offset = sh.total_bytes;
         sh.state_bytes = 0;
       }},
  };
  for (const auto& [what, forge] : forgeries) {
    forge();
    const std::string log = ::testing::TempDir() + "adopt-forged.log";
    testing::Process successor(PSKV_SERVER_BIN, args, log);
    const int status = successor.wait(std::chrono::seconds(20));
    EXPECT_TRUE(status >= 1 && status < 128) << what << ": exit status " << status << "\n" << testing::read_file(log);
    EXPECT_NE(testing::read_file(log).find("does not describe"), std::string::npos) << what << "\n"
                                                                                    << testing::read_file(log);
    EXPECT_TRUE(std::filesystem::exists(object)) << what << ": the failed start lost the segment";
    std::memcpy(static_cast<void*>(&h), saved.data(), saved.size());
    std::memcpy(static_cast<void*>(&sh), saved_store.data(), saved_store.size());
  }
  mapped.reset();
  auto server = ServerProcess::start(args);
  Client c(o);
  std::vector<float> out(16);
  c.wait(c.pull(1, out));
  EXPECT_EQ(out[0], 3.0f);
  EXPECT_EQ(stat_field(c.server_stats(0), "adopted_keys"), 1u);
}

// The dead server's sync-step file is writable by every process of the user too. A key with two
// records (one record's key word rewritten to another's) had its pending steps adopted twice, so
// a completed step would be applied twice; the second record is now refused, and the key starts
// over at step 0 rather than apply sums twice.
TEST(ShmAdoptionForged, ASecondSyncRecordOfAKeyIsRefused) {
  const std::string name = segment_name("forged-sync", 0);
  const std::vector<std::string> args = {
      "--uri", "shm://" + name + "?adopt=1", "--workers", "2", "--mode", "sync", "--rule",
      "add",   "--wait-timeout-ms",          "20000"};
  ClientOptions o;
  {
    auto first = ServerProcess::start(args);
    o.servers = {first.uri};
    Client c(o);
    c.wait(c.init(1, std::vector<float>(16, 0.0f)));
    c.wait(c.init(2, std::vector<float>(16, 0.0f)));
    ClientOptions w0 = o;
    w0.worker_id = 0;
    Client worker(w0);
    const std::vector<float> one(16, 1.0f);
    const std::vector<Key> keys = {1, 2};
    const std::vector<std::span<const float>> values = {one, one};
    worker.wait(worker.push(keys, values));  // summed into step 0; worker 1 never comes
    first.process.signal(SIGKILL);
    first.process.wait();
  }
  std::string file;
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm"))
    if (e.path().filename().string().rfind("pskv-" + name + ".tables.", 0) == 0) file = e.path().string() + "/sync";
  ASSERT_FALSE(file.empty()) << "no sync-step file of " << name;
  {
    const auto mapped = shm::MappedFile::open(file);  // kept when it goes
    auto* base = reinterpret_cast<std::uint64_t*>(mapped->data());
    std::uint64_t* first = base + 4096 / 8;  // records after the header page: [key | length | words | ...]
    std::uint64_t* second = first + 3 + first[2];
    ASSERT_EQ(first[1], 16u);
    ASSERT_EQ(second[1], 16u);
    second[0] = first[0];
  }
  auto server = ServerProcess::start(args);
  Client check(o);
  const std::string stats = check.server_stats(0);
  EXPECT_EQ(stat_field(stats, "adopted_sync_keys"), 1u) << stats;
  EXPECT_EQ(stat_field(stats, "adopted_sync_refused"), 1u) << stats;
}

// Clocks survive: two BSP workers at clock 3, the server killed and adopted; worker 0 reconnects
// at clock 3 and reads without worker 1 ever coming back (a fresh table would hold the read at
// worker 1's clock 0 and fail it at the wait timeout).
TEST(ShmAdoptionClocks, WorkerClocksAreCarriedOver) {
  const std::string uri = "shm://" + segment_name("clocks", 0) + "?adopt=1";
  const std::vector<std::string> args = {"--uri", uri, "--workers", "2", "--mode", "bsp", "--wait-timeout-ms", "3000"};
  auto server = ServerProcess::start(args);
  ClientOptions o;
  o.servers = {server.uri};
  o.io_timeout = std::chrono::seconds(10);
  std::vector<float> v(16, 1.0f);
  {
    std::vector<std::unique_ptr<Client>> workers;
    for (std::uint32_t w = 0; w < 2; ++w) {
      ClientOptions wo = o;
      wo.worker_id = w;
      workers.push_back(std::make_unique<Client>(wo));
    }
    workers[0]->wait(workers[0]->init(7, v));
    for (int step = 0; step < 3; ++step)
      for (auto& c : workers) {
        c->wait(c->push(7, v));
        c->clock();
      }
    server.process.signal(SIGKILL);
    server.process.wait();
    for (auto& c : workers) c->disconnect();
  }
  server = ServerProcess::start(args);
  ClientOptions wo = o;
  wo.worker_id = 0;
  wo.initial_clock = 3;
  Client c(wo);
  std::vector<float> out(16);
  // Worker 1 never comes back: with a fresh clock table this read would wait for its clock 0 and
  // fail at the wait timeout (straggler policy fail), naming it.
  c.wait(c.pull(7, out));
  EXPECT_EQ(out[0], 7.0f);  // init 1 + six pushes of 1
  EXPECT_EQ(stat_field(c.server_stats(0), "adopted_clocks"), 2u);
}

// Sync mode: a push is acknowledged once it is summed into its step, before the step is applied,
// so the sums are acknowledged state too. Two workers push 1 and 2 to four keys of 256 KiB per
// step (so kills land inside applies) and clock; the server is SIGKILLed at a random instant and
// restarted with adopt=1, and a worker whose server failed it reconnects at the step it was in
// and does that step again (a push that had landed is then a duplicate). Every key must end at
// exactly 1.5 per step (rule add applies the mean): each step applied once, with both
// contributions. Without the pending
// steps carried over, the successor starts every key at step 0 and refuses the workers' next
// pushes as too far ahead.
TEST(ShmAdoptionSync, AKilledServerKeepsEveryStepItsWorkersPushedInto) {
  std::mt19937 rng(25);
  constexpr std::uint32_t kWorkers = 2;
  constexpr Key kKeys = 4;
  constexpr std::size_t kLen = 64 * 1024;
  constexpr std::uint64_t kSteps = 150;
  std::uint64_t rolled_back = 0, trials_with_steps = 0;
  for (int trial = 0; trial < testing::fault_trials(); ++trial) {
    const std::string uri = "shm://" + segment_name("sync", trial) + "?adopt=1&area_mb=4&clients=8";
    const std::vector<std::string> args = {"--uri",  uri,    "--arena-mb", "16",  "--workers",         "2",
                                           "--mode", "sync", "--rule",     "add", "--wait-timeout-ms", "20000"};
    auto server = ServerProcess::start(args);
    ClientOptions o;
    o.servers = {server.uri};
    o.io_timeout = std::chrono::seconds(30);
    const std::vector<Key> keys = testing::make_zero_keys(o, kKeys, kLen);
    testing::SharedArray<std::atomic<std::uint64_t>> steps_done(kWorkers), failures(kWorkers);
    std::vector<pid_t> pids;
    const testing::KillOnExit reap(pids);
    for (std::uint32_t w = 0; w < kWorkers; ++w)
      pids.push_back(fork_worker([&, w] {
        const std::vector<float> grad(kLen, static_cast<float>(w + 1));
        const std::vector<std::span<const float>> values(kKeys, std::span<const float>(grad));
        std::vector<float> out(kLen);
        std::unique_ptr<Client> c;
        const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
        for (std::uint64_t step = 0; step < kSteps;) {
          try {
            if (!c) {
              ClientOptions wo = o;
              wo.worker_id = w;
              wo.initial_clock = step;
              c = std::make_unique<Client>(wo);
            }
            c->wait(c->pull(keys[0], out));
            c->wait(c->push(keys, values));
            c->clock();
            steps_done[w].store(++step);
          } catch (const Error& e) {
            failures[w].fetch_add(1);
            if (c) c->disconnect();
            c.reset();
            if (std::chrono::steady_clock::now() > give_up) {
              std::fprintf(stderr, "worker %u stuck at step %llu: %s\n", w, static_cast<unsigned long long>(step),
                           e.what());
              return 1;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
          }
        }
        return 0;
      }));
    // Somewhere in the middle of the run.
    const std::uint64_t kill_at = 5 + rng() % (kSteps - 40);
    while (steps_done[0].load() < kill_at && steps_done[1].load() < kill_at)
      std::this_thread::sleep_for(std::chrono::microseconds(200 + rng() % 400));
    server.process.signal(SIGKILL);
    server.process.wait();
    server = ServerProcess::start(args);
    for (std::size_t w = 0; w < pids.size(); ++w)
      ASSERT_EQ(wait_pid(pids[w], std::chrono::seconds(180)), 0) << "worker " << w << ", trial " << trial;
    pids.clear();
    EXPECT_GT(failures[0].load() + failures[1].load(), 0u) << "the kill failed no worker: the trial tested nothing";

    Client check(o);
    std::vector<float> out(kLen);
    for (Key k = 0; k < kKeys; ++k) {
      check.wait(check.pull(keys[k], out));
      const auto wrong = std::find_if(out.begin(), out.end(), [](float x) { return x != 1.5f * kSteps; });
      EXPECT_EQ(wrong, out.end()) << "key " << k << " float " << (wrong - out.begin()) << " is "
                                  << (wrong == out.end() ? 0.0f : *wrong) << ", not " << 1.5f * kSteps
                                  << " (1.5 per step): trial " << trial;
    }
    const std::string stats = check.server_stats(0);
    EXPECT_EQ(stat_field(stats, "adopted_keys"), kKeys) << stats;
    EXPECT_EQ(stat_field(stats, "adopted_sync_keys"), kKeys) << stats;
    EXPECT_EQ(stat_field(stats, "adopted_sync_refused"), 0u) << stats;
    rolled_back += stat_field(stats, "adopted_rolled_back");
    ++trials_with_steps;
  }
  std::printf("[ adopt    ] %llu of %llu kills left a step's apply half done, rolled back and applied again\n",
              static_cast<unsigned long long>(rolled_back), static_cast<unsigned long long>(trials_with_steps));
}

// A successor that fails to start (here: another update rule) leaves the segment where it was,
// and the next attempt adopts it; a segment whose server still runs is never adopted.
TEST(ShmAdoptionStart, AFailedStartLeavesTheSegmentForTheNextAndALiveServerIsNeverAdopted) {
  const std::string name = segment_name("start", 0);
  const std::string uri = "shm://" + name + "?adopt=1";
  auto server = ServerProcess::start({"--uri", uri, "--rule", "momentum", "--lr", "0.5"});
  ClientOptions o;
  o.servers = {server.uri};
  std::vector<float> v(32, 2.0f);
  {
    Client c(o);
    c.wait(c.init(1, v));
    c.wait(c.push(1, v));  // momentum state is no longer zero
  }
  const std::string log = ::testing::TempDir() + "adopt-live.log";
  testing::Process live(PSKV_SERVER_BIN, {"--uri", uri, "--rule", "momentum"}, log);
  EXPECT_NE(live.wait(std::chrono::seconds(20)), 0) << "adopted the segment of a running server";
  EXPECT_NE(testing::read_file(log).find("in use by a running pskv-server"), std::string::npos)
      << testing::read_file(log);

  server.process.signal(SIGKILL);
  server.process.wait();
  const std::string bad_log = ::testing::TempDir() + "adopt-bad.log";
  testing::Process wrong(PSKV_SERVER_BIN, {"--uri", uri, "--rule", "sgd"}, bad_log);
  EXPECT_NE(wrong.wait(std::chrono::seconds(20)), 0) << "adopted momentum state into an sgd store";
  EXPECT_NE(testing::read_file(bad_log).find("--rule momentum"), std::string::npos) << testing::read_file(bad_log);
  EXPECT_TRUE(std::filesystem::exists("/dev/shm/pskv-" + name)) << "the failed start lost the segment";

  server = ServerProcess::start({"--uri", uri, "--rule", "momentum", "--lr", "0.5"});
  Client c(o);
  std::vector<float> out(32), grad(32, 1.0f);
  c.wait(c.pull(1, out));
  EXPECT_EQ(out[0], 2.0f - 0.5f * 2.0f);
  // The momentum was adopted too: v = 0.9 * 2 + 1, applied with lr 0.5.
  c.wait(c.push(1, grad));
  c.wait(c.pull(1, out));
  EXPECT_FLOAT_EQ(out[0], 1.0f - 0.5f * (0.9f * 2.0f + 1.0f));
  EXPECT_EQ(stat_field(c.server_stats(0), "adopted_keys"), 1u);
}

}  // namespace
}  // namespace pskv
