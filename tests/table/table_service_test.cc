// Embedding tables served over tcp:// and shm://: rows spread over the servers by id, created on
// first push, repeated ids merged by the client, and every bad request answered with an error that
// says why. Built twice: rdma_table_test (label rdma, with PSKV_TABLES_OVER_RDMA) runs the same
// tests over rdma:// in the Soft-RoCE VM, where rows come back by the server's RDMA WRITE.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <filesystem>
#include <string>
#include <vector>

#include "pskv/client.h"
#include "pskv/server.h"
#include "table/embedding_table.h"
#include "transport/transport.h"
#include "transport/uri.h"
#ifdef PSKV_TABLES_OVER_RDMA
#include "rdma/rdma_support.h"
#endif

namespace pskv {
namespace {

#ifdef PSKV_TABLES_OVER_RDMA
const std::string kDefaultScheme = "rdma";
#else
const std::string kDefaultScheme = "tcp";
#endif

// tcp, shm (where table ops travel through each client's ring), or rdma.
ServerOptions server_options(std::uint32_t id, const std::string& scheme = kDefaultScheme) {
  ServerOptions so;
  if (scheme == "tcp") {
    so.uri = "tcp://127.0.0.1:0";
  } else if (scheme == "shm") {
    so.uri = "shm://tables-" + std::to_string(getpid()) + "-" + std::to_string(id);
  } else {
#ifdef PSKV_TABLES_OVER_RDMA
    // Small: the VM has 2 GiB, and a server pins its store and each client's receive region.
    so.uri = "rdma://" + testing::rdma_ip() + ":0?recv_mb=16";
    so.max_keys = 4096;
#endif
  }
  so.server_id = id;
  so.arena_bytes = 4 << 20;
  so.io_threads = 1;
  so.table_memory_bytes = 256ull << 20;
  return so;
}

TableSpec spec() {
  TableSpec s;
  s.dim = 8;
  s.seed = 7;
  s.rule.rule = UpdateRule::add;
  s.max_rows = 100000;
  return s;
}

#ifdef PSKV_TABLES_OVER_RDMA
#define PSKV_TABLES_REQUIRE_BACKEND() PSKV_REQUIRE_RDMA()
#else
#define PSKV_TABLES_REQUIRE_BACKEND() \
  do {                                \
  } while (0)
#endif

// The servers start in SetUp, once the rdma tests know there is a device to serve.
class Tables : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    PSKV_TABLES_REQUIRE_BACKEND();
    s0_ = std::make_unique<Server>(server_options(0, GetParam()));
    s1_ = std::make_unique<Server>(server_options(1, GetParam()));
  }
  std::unique_ptr<Server> s0_, s1_;
  ClientOptions options() const {
    ClientOptions o;
    o.servers = {s0_->uri(), s1_->uri()};
    return o;
  }
  static std::uint64_t stat(Client& c, std::size_t server, const std::string& name) {
    const std::string json = c.server_stats(server);
    const auto at = json.find("\"" + name + "\":");
    if (at == std::string::npos) return ~0ull;
    return std::stoull(json.substr(at + name.size() + 3));
  }
};

TEST_P(Tables, RowsStartFromTheSpecsInitialValueOnEveryServer) {
  Client c(options());
  c.create_table(3, spec());
  std::vector<Key> ids(200);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = i * 1000003;
  std::vector<float> out(ids.size() * 8);
  c.wait(c.pull_rows(3, ids, out));
  EmbeddingTable local(spec());
  std::vector<float> expected(8);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    local.initial_row(ids[i], expected.data());
    ASSERT_EQ(std::vector<float>(out.begin() + i * 8, out.begin() + (i + 1) * 8), expected) << "id " << ids[i];
  }
  // A pull creates nothing; both servers hold some of the ids once pushed.
  EXPECT_EQ(stat(c, 0, "table_3_rows") + stat(c, 1, "table_3_rows"), 0u);
  std::vector<float> grads(out.size(), 1.0f);
  c.wait(c.push_rows(3, ids, grads));
  EXPECT_GT(stat(c, 0, "table_3_rows"), 0u);
  EXPECT_GT(stat(c, 1, "table_3_rows"), 0u);
  EXPECT_EQ(stat(c, 0, "table_3_rows") + stat(c, 1, "table_3_rows"), ids.size());
  std::vector<float> after(out.size());
  c.wait(c.pull_rows(3, ids, after));
  for (std::size_t i = 0; i < out.size(); ++i) ASSERT_EQ(after[i], out[i] + 1.0f);
}

TEST_P(Tables, RepeatedIdsAreSentOnceWithTheirGradientsSummed) {
  Client c(options());
  TableSpec s = spec();
  s.init = RowInit::zeros;
  c.create_table(0, s);
  const std::vector<Key> ids = {5, 9, 5, 5};
  std::vector<float> grads(ids.size() * 8);
  for (std::size_t i = 0; i < ids.size(); ++i) std::fill_n(grads.begin() + i * 8, 8, float(i + 1));
  c.wait(c.push_rows(0, ids, grads));
  const std::uint64_t sent = stat(c, 0, "pushes") + stat(c, 1, "pushes");
  EXPECT_EQ(sent, 2u) << "two distinct ids";
  std::vector<float> out(ids.size() * 8, -1.0f);
  c.wait(c.pull_rows(0, ids, out));
  EXPECT_EQ(stat(c, 0, "pulls") + stat(c, 1, "pulls"), 2u);
  for (std::size_t i : {0, 2, 3}) EXPECT_EQ(out[i * 8 + 7], 1.0f + 3.0f + 4.0f) << "repeat " << i;
  EXPECT_EQ(out[1 * 8], 2.0f);
}

// A pull_rows with a repeated id copies the first occurrence's row to the repeat once it is
// done. The op is reused by the next request: that one must not copy into the old buffer.
TEST_P(Tables, AnOpReusedAfterAPullWithRepeatsLeavesItsBufferAlone) {
  Client c(options());
  c.create_table(7, spec());
  const std::vector<Key> ids = {4, 4};
  std::vector<float> out(16);
  c.wait(c.pull_rows(7, ids, out));
  EXPECT_TRUE(std::equal(out.begin(), out.begin() + 8, out.begin() + 8));
  std::fill(out.begin(), out.begin() + 8, 1.0f);
  std::fill(out.begin() + 8, out.end(), 2.0f);
  c.server_stats(0);  // takes the same op; an op that is not a pull_rows, which would reset it
  EXPECT_EQ(out[8], 2.0f) << "a later op copied rows into an earlier pull's buffer";
}

TEST_P(Tables, EveryWorkerMayCreateTheTableButOnlyWithTheSameSpec) {
  Client a(options()), b(options());
  a.create_table(1, spec());
  b.create_table(1, spec());
  TableSpec other = spec();
  other.seed = 8;
  try {
    b.create_table(1, other);
    ADD_FAILURE() << "a second spec was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("another spec"), std::string::npos) << e.what();
  }
}

TEST_P(Tables, ATableWhoseCapPassesTheMemoryBudgetIsRefused) {
  Client c(options());
  TableSpec s = spec();
  s.max_rows = 100000000;  // 100M rows of 8 floats: far past 256 MiB
  try {
    c.create_table(2, s);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::capacity);
    EXPECT_NE(std::string(e.what()).find("--table-memory-mb"), std::string::npos) << e.what();
  }
  // Without a cap, a table gets what the budget has left.
  s.max_rows = 0;
  c.create_table(2, s);
  const std::uint64_t cap = stat(c, 0, "table_2_max_rows");
  EXPECT_GT(cap, 1000000u);
  EXPECT_LT(cap, 256u << 20 >> 5);
  // That cap is the server's, not the workers': the index starts small (as a table without a
  // cap does) rather than with buckets for millions of rows nobody declared.
  TableSpec empty = s;
  empty.max_rows = 0;
  EXPECT_LE(stat(c, 0, "table_2_bytes"), EmbeddingTable::fixed_bytes(empty));
}

TEST_P(Tables, ClientSideMisuseIsRefusedBeforeAnythingIsSent) {
  Client c(options());
  std::vector<Key> ids = {1, 2};
  std::vector<float> out(16);
  EXPECT_THROW(c.pull_rows(4, ids, out), Error) << "not created by this client";
  c.create_table(4, spec());
  std::vector<float> short_out(15);
  EXPECT_THROW(c.pull_rows(4, ids, short_out), Error);
  EXPECT_THROW(c.create_table(64, spec()), Error);
  TableSpec bad = spec();
  bad.dim = 0;
  EXPECT_THROW(c.create_table(5, bad), Error);
}

// Many pulls in flight at once, for long enough that rdma's rows ring wraps twice over: each
// gets its own ids' rows.
TEST_P(Tables, ManyPullsInFlightEachGetTheirOwnRows) {
  Client c(options());
  TableSpec s = spec();
  s.init = RowInit::zeros;
  c.create_table(8, s);
  constexpr std::size_t kBatch = 1000, kBatches = 8;
  std::vector<Key> ids(kBatch * kBatches);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = i * 2654435761u % 1000003;
  std::vector<float> grads(ids.size() * 8);
  for (std::size_t i = 0; i < ids.size(); ++i)
    for (std::size_t j = 0; j < 8; ++j) grads[i * 8 + j] = float(ids[i] % 1000) + 0.125f * float(j);
  c.wait(c.push_rows(8, ids, grads));
  std::vector<std::vector<float>> out(kBatches, std::vector<float>(kBatch * 8));
  // 200 rounds: about 38 MB of messages to each server, past twice rdma's 16 MiB region.
  for (int round = 0; round < 200; ++round) {
    std::vector<Ticket> tickets;
    for (std::size_t b = 0; b < kBatches; ++b) {
      std::fill(out[b].begin(), out[b].end(), -1.0f);
      tickets.push_back(c.pull_rows(8, std::span(ids).subspan(b * kBatch, kBatch), out[b]));
    }
    for (Ticket t : tickets) c.wait(t);
    for (std::size_t b = 0; b < kBatches; ++b)
      ASSERT_TRUE(std::equal(out[b].begin(), out[b].end(), grads.begin() + b * kBatch * 8))
          << "round " << round << ", batch " << b << " came back with other rows";
  }
}

// Rows of 2 KiB: 10 MiB of them from one server, more than one RDMA WRITE carries on
// Soft-RoCE (8 MiB), so the rdma reply comes in pieces.
TEST_P(Tables, ALargePullComesBackWhole) {
  ClientOptions o = options();
  o.servers.resize(1);
  Client c(o);
  TableSpec s = spec();
  s.dim = 512;
  s.max_rows = 6000;
  c.create_table(9, s);
  std::vector<Key> ids(5120);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = i;
  std::vector<float> grads(ids.size() * 512);
  for (std::size_t i = 0; i < grads.size(); ++i) grads[i] = float(i % 4099);
  std::vector<float> before(grads.size()), after(grads.size());
  c.wait(c.pull_rows(9, ids, before));
  c.wait(c.push_rows(9, ids, grads));
  c.wait(c.pull_rows(9, ids, after));
  for (std::size_t i = 0; i < after.size(); ++i) ASSERT_EQ(after[i], before[i] + grads[i]) << "float " << i;
}

#ifdef PSKV_TABLES_OVER_RDMA
INSTANTIATE_TEST_SUITE_P(Backends, Tables, ::testing::Values("rdma"), [](const auto& info) { return info.param; });
#else
INSTANTIATE_TEST_SUITE_P(Backends, Tables, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });
#endif

TEST(TableLimits, ABatchWhoseReplyPassesTheRequestLimitIsRefusedByName) {
  PSKV_TABLES_REQUIRE_BACKEND();
  ServerOptions so = server_options(0);
  so.max_request_bytes = 1 << 20;
  Server server(so);
  ClientOptions o;
  o.servers = {server.uri()};
  Client c(o);
  TableSpec s = spec();
  s.dim = 64;
  c.create_table(0, s);
  std::vector<Key> ids(5000);  // 5,000 rows of 256 bytes: a 1.2 MiB reply
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = i;
  std::vector<float> out(ids.size() * 64);
  try {
    c.wait(c.pull_rows(0, ids, out));
    ADD_FAILURE() << "a reply over --max-request-mb was sent";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::capacity);
    EXPECT_NE(std::string(e.what()).find("pull fewer rows at a time"), std::string::npos) << e.what();
  }
  ids.resize(1000);  // within the limit: served, on the same connection
  out.resize(ids.size() * 64);
  c.wait(c.pull_rows(0, ids, out));
}

#ifndef PSKV_TABLES_OVER_RDMA
// An shm server made to be adopted keeps a table's rows in files of /dev/shm, each segment
// (65,536 rows) fallocated whole from its first row: a table is charged its whole segments, so
// that a cap of one wide row cannot back a quarter of a GiB outside the budget.
TEST(TableLimits, AnAdoptableShmTableIsChargedItsWholeSegments) {
  ServerOptions so = server_options(0, "shm");
  so.uri = "shm://tables-segments-" + std::to_string(getpid()) + "?adopt=1";
  Server server(so);
  ClientOptions o;
  o.servers = {server.uri()};
  Client c(o);
  TableSpec wide = spec();
  wide.dim = 1024;  // a segment of these rows: 256 MiB of floats alone, the whole budget
  wide.max_rows = 1;
  try {
    c.create_table(0, wide);
    ADD_FAILURE() << "a table backing 256 MiB of /dev/shm was charged for one row";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::capacity) << e.what();
    EXPECT_NE(std::string(e.what()).find("--table-memory-mb"), std::string::npos) << e.what();
  }
  TableSpec narrow = spec();
  narrow.max_rows = 1;  // 8 floats: a segment takes a few MiB
  c.create_table(1, narrow);
  narrow.max_rows = 0;  // gets what is left, in whole segments
  c.create_table(2, narrow);
  const std::string stats = c.server_stats(0);
  const std::string field = "\"table_2_max_rows\":";
  const std::size_t at = stats.find(field);
  ASSERT_NE(at, std::string::npos) << stats;
  const std::uint64_t cap = std::stoull(stats.substr(at + field.size()));
  EXPECT_GT(cap, 0u);
  EXPECT_EQ(cap % EmbeddingTable::kSegmentRows, 0u) << cap;
}
#endif

// A retrying worker's table pushes carry their identity (session, sequence number) as the first
// key of each server's part; a server that does not replicate takes it off and applies the rows
// as any push. (What a replicated server does with it: tests/replication.)
TEST(TablesRetrying, ARetryingWorkerPushesAndPullsRowsAsAnyOther) {
  PSKV_TABLES_REQUIRE_BACKEND();
  std::vector<std::unique_ptr<Server>> servers;
  ClientOptions o;
  for (std::uint32_t id = 0; id < 2; ++id) {
    ServerOptions so = server_options(id);
    so.num_workers = 1;
    servers.push_back(std::make_unique<Server>(so));
    o.servers.push_back(servers.back()->uri());
  }
  o.worker_id = 0;
  o.retry_timeout = std::chrono::seconds(10);
  Client c(o);
  TableSpec s = spec();
  s.init = RowInit::zeros;
  c.create_table(2, s);
  std::vector<Key> ids(300);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = i * 7919;
  ids.push_back(ids[5]);  // a repeat, summed before it is sent
  std::vector<float> ones(ids.size() * 8, 1.0f);
  for (int round = 0; round < 3; ++round) c.wait(c.push_rows(2, ids, ones));
  std::vector<float> out(ids.size() * 8);
  c.wait(c.pull_rows(2, ids, out));
  for (std::size_t i = 0; i < ids.size(); ++i)
    ASSERT_EQ(out[i * 8], i == 5 || i == 300 ? 6.0f : 3.0f) << "row " << ids[i];
}

TEST(TablesAcrossARestart, AServerRestoredFromItsCheckpointHasEveryRow) {
  PSKV_TABLES_REQUIRE_BACKEND();
  const auto dir = std::filesystem::temp_directory_path() / ("pskv-tables-" + std::to_string(getpid()));
  ServerOptions so = server_options(0);
  so.checkpoint_dir = dir.string();
  std::vector<Key> ids(500);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = i * 7919;
  std::vector<float> before(ids.size() * 8), after(ids.size() * 8);
  TableSpec s = spec();
  s.rule.rule = UpdateRule::adagrad;
  std::string uri;
  {
    Server server(so);
    ClientOptions o;
    o.servers = {server.uri()};
    Client c(o);
    c.create_table(2, s);
    std::vector<float> grads(before.size(), 0.5f);
    for (int i = 0; i < 3; ++i) c.wait(c.push_rows(2, ids, grads));
    c.wait(c.pull_rows(2, ids, before));
  }  // stopping writes the last checkpoint
  so.restore_dir = dir.string();
  {
    Server server(so);
    ClientOptions o;
    o.servers = {server.uri()};
    Client c(o);
    c.create_table(2, s);  // the same spec: the restored table is taken as it is
    c.wait(c.pull_rows(2, ids, after));
    EXPECT_EQ(after, before);
    std::vector<float> grads(before.size(), 0.5f);
    c.wait(c.push_rows(2, ids, grads));  // Adagrad's state came back too: a 4th step, not a 1st
    c.wait(c.pull_rows(2, ids, after));
    EmbeddingTable local(s);
    std::vector<float> one(8, 0.5f), row(8);
    for (int i = 0; i < 4; ++i) local.push({&ids[0], 1}, one.data(), 0);
    local.pull({&ids[0], 1}, row.data());
    EXPECT_EQ(std::vector<float>(after.begin(), after.begin() + 8), row);
  }
  std::filesystem::remove_all(dir);
}

// What a client of this build would never send, sent on a raw connection: each gets its error.
TEST_P(Tables, TheServerChecksTableAndDimensionOfEveryRow) {
  Client c(options());
  c.create_table(6, spec());
  transport::ConnectOptions co;
  auto conn = transport::connect(parse_uri(s0_->uri()), co);
  auto ask = [&](wire::Op op, std::uint32_t table, std::vector<transport::KeySlice> keys) {
    transport::Completion done;
    done.reset(1);
    transport::Request r;
    r.op = op;
    r.arg1 = table;
    r.keys = keys;
    r.completion = &done;
    conn->submit(r);
    done.wait(std::chrono::steady_clock::now() + std::chrono::seconds(10), conn->poller());
    return std::make_pair(done.status(), std::string(done.message()));
  };
  std::vector<float> row(16);
  auto [e1, m1] = ask(wire::Op::table_pull, 9, {{1, 8, row.data()}});
  EXPECT_EQ(e1, Errc::invalid_argument);
  EXPECT_NE(m1.find("no table 9"), std::string::npos) << m1;
  auto [e2, m2] = ask(wire::Op::table_push, 6, {{1, 16, row.data()}});
  EXPECT_EQ(e2, Errc::invalid_argument);
  EXPECT_NE(m2.find("has 16 floats; the table's rows have 8"), std::string::npos) << m2;
  auto [e3, m3] = ask(wire::Op::table_create, 0, {{1, 3, row.data()}});
  EXPECT_EQ(e3, Errc::protocol);
  std::vector<float> words(wire::kTableSpecFloats);
  wire::encode_table_spec(spec(), words.data());
  words[13] = std::bit_cast<float>(7u);  // no such eviction policy
  auto [e4, m4] = ask(wire::Op::table_create, 0, {{1, wire::kTableSpecFloats, words.data()}});
  EXPECT_EQ(e4, Errc::invalid_argument);
  EXPECT_NE(m4.find("unknown"), std::string::npos) << m4;
  // The connection is still served after all that.
  auto [e5, m5] = ask(wire::Op::table_pull, 6, {{1, 8, row.data()}});
  EXPECT_EQ(e5, Errc::ok) << m5;
}

}  // namespace
}  // namespace pskv
