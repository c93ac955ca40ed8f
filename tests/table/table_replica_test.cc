// A replicated server's side of tables, on the engine alone: the copies it keeps of its
// predecessor's tables take frames only from the connection of the latest transfer (a late mark
// or frame from one the origin gave up on changes nothing), they keep the origin's push marks,
// and the origin applies an identified push once.
#include <gtest/gtest.h>

#include <vector>

#include "engine/shard_engine.h"
#include "table/embedding_table.h"

namespace pskv {
namespace {

constexpr std::uint32_t kOrigin = 0, kTable = 3, kDim = 4;
// Connection tags as the backends make them: the accept count in the high half.
constexpr std::uint64_t kOld = std::uint64_t{1} << 32, kNew = std::uint64_t{2} << 32;

EngineOptions replica_options() {
  EngineOptions o;
  o.server_id = 1;
  o.replica_of = {kOrigin};
  o.num_workers = 2;
  o.replicate_tables = true;
  o.store.arena_bytes = 1 << 20;
  o.store.max_keys = 1024;
  o.table_memory_bytes = 64ull << 20;
  return o;
}

TableSpec spec() {
  TableSpec s;
  s.dim = kDim;
  s.init = RowInit::zeros;
  s.rule.rule = UpdateRule::add;
  s.max_rows = 100;
  return s;
}

// The replica's copy of the origin's table, read as a rejoin reads it.
ReplicaTableRows copy_of(const ShardEngine& e) {
  ReplicaTableRows got;
  std::string why;
  EXPECT_EQ(e.replica_table_rows(kOrigin, kTable, 0, 1000, 1 << 20, &got, &why), Errc::ok) << why;
  return got;
}

Errc row_from(ShardEngine& e, std::uint64_t connection, std::uint32_t position, Key id, float value,
              const ShardEngine::RowsMark* marked = nullptr) {
  const std::vector<float> record(kDim, value);  // `add` keeps no state: a record is the row
  const KeyEntry row{id, kDim, 0};
  std::string why;
  return e.apply_replica_rows(kOrigin, connection, position, kTable, {&row, 1}, record.data(), &why, marked);
}

TEST(TableReplica, FramesAndMarksOfAConnectionGivenUpOnChangeNothing) {
  ShardEngine e(replica_options());
  std::string why;
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kOld), Errc::ok) << why;
  ASSERT_EQ(e.apply_replica_table(kOrigin, kOld, 1, kTable, spec(), 100, {}, &why), Errc::ok) << why;
  ASSERT_EQ(row_from(e, kOld, 2, 5, 1.0f), Errc::ok);
  EXPECT_EQ(copy_of(e).ids.size(), 1u);
  // The origin gave up on the old connection and transfers again on a new one: the copies go.
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kNew), Errc::ok) << why;
  EXPECT_FALSE(copy_of(e).exists);
  ASSERT_EQ(e.apply_replica_table(kOrigin, kNew, 3, kTable, spec(), 100, {}, &why), Errc::ok) << why;
  ASSERT_EQ(row_from(e, kNew, 4, 7, 2.0f), Errc::ok);
  // What the old connection still delivers: a late syncing mark, a table, rows, a synced mark.
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kOld), Errc::ok) << why;
  ASSERT_EQ(e.apply_replica_table(kOrigin, kOld, 5, kTable, spec(), 100, {}, &why), Errc::ok) << why;
  ASSERT_EQ(row_from(e, kOld, 6, 9, 3.0f), Errc::ok);
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::synced, &why, kOld), Errc::ok) << why;
  ReplicaTableRows got = copy_of(e);
  ASSERT_TRUE(got.exists);
  EXPECT_FALSE(got.synced) << "a synced mark of the old connection counted";
  ASSERT_EQ(got.ids, std::vector<Key>{7}) << "the old connection's frames were applied";
  EXPECT_EQ(got.position, 4u);
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::synced, &why, kNew), Errc::ok) << why;
  EXPECT_TRUE(copy_of(e).synced);
}

TEST(TableReplica, ACopyReportsTheIncarnationThatTransferredIt) {
  ShardEngine e(replica_options());
  std::string why;
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kOld, 1000), Errc::ok) << why;
  EXPECT_EQ(copy_of(e).epoch, 1000u);  // even before it holds a table
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kNew, 2000), Errc::ok) << why;
  EXPECT_EQ(copy_of(e).epoch, 2000u);
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kOld, 1000), Errc::ok) << why;  // late
  EXPECT_EQ(copy_of(e).epoch, 2000u);
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::synced, &why, kNew), Errc::ok) << why;
  EXPECT_EQ(copy_of(e).epoch, 2000u);
  EXPECT_TRUE(copy_of(e).synced);
}

TEST(TableReplica, ACopyKeepsItsOriginsPushMarksAndChecksThem) {
  ShardEngine e(replica_options());
  std::string why;
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kNew), Errc::ok) << why;
  const std::vector<std::uint64_t> marks = {(7ull << 32) | 3, 0};
  ASSERT_EQ(e.apply_replica_table(kOrigin, kNew, 1, kTable, spec(), 100, marks, &why), Errc::ok) << why;
  EXPECT_EQ(copy_of(e).marks, marks);
  const ShardEngine::RowsMark second{1, (9ull << 32) | 1};
  ASSERT_EQ(row_from(e, kNew, 2, 5, 1.0f, &second), Errc::ok);
  EXPECT_EQ(copy_of(e).marks, (std::vector<std::uint64_t>{(7ull << 32) | 3, (9ull << 32) | 1}));
  // A worker past --workers, and a table with marks for another number of workers.
  const ShardEngine::RowsMark stray{2, 1};
  EXPECT_EQ(row_from(e, kNew, 3, 6, 1.0f, &stray), Errc::protocol);
  const std::vector<std::uint64_t> three(3, 1);
  EXPECT_EQ(e.apply_replica_table(kOrigin, kNew, 4, kTable, spec(), 100, three, &why), Errc::protocol);
  EXPECT_NE(why.find("--workers"), std::string::npos) << why;
  const ReplicaTableRows got = copy_of(e);
  EXPECT_EQ(got.ids, std::vector<Key>{5});
  EXPECT_EQ(got.position, 2u);
}

TEST(TableReplica, AnIdentifiedPushIsAppliedOnceAndItsMarkComesBackWithTheRows) {
  EngineOptions o = replica_options();
  ShardEngine origin(o);
  std::string why;
  ASSERT_EQ(origin.create_table(kTable, spec(), &why), Errc::ok) << why;
  const KeyEntry row{11, kDim, 0};
  const std::vector<float> ones(kDim, 1.0f);
  auto push = [&](std::uint32_t worker, std::uint32_t session, std::uint32_t seq) {
    bool duplicate = false;
    EXPECT_EQ(origin.table_push(kTable, 0, {&row, 1}, ones.data(), &why,
                                PushId{.worker = worker, .session = session, .seq = seq}, &duplicate),
              Errc::ok)
        << why;
    return duplicate;
  };
  EXPECT_FALSE(push(0, 7, 1));
  EXPECT_TRUE(push(0, 7, 1));   // sent again
  EXPECT_TRUE(push(0, 7, 0));   // older
  EXPECT_FALSE(push(1, 7, 1));  // another worker's marks are its own
  EXPECT_FALSE(push(0, 8, 1));  // a new session
  std::vector<float> out(kDim);
  ASSERT_EQ(origin.table_pull(kTable, {&row, 1}, out.data(), &why), Errc::ok) << why;
  EXPECT_EQ(out[0], 3.0f);
  EXPECT_EQ(origin.table_marks(kTable), (std::vector<std::uint64_t>{(8ull << 32) | 1, (7ull << 32) | 1}));
  bool duplicate = false;
  EXPECT_EQ(origin.table_push(kTable, 0, {&row, 1}, ones.data(), &why, PushId{.worker = 2, .session = 7, .seq = 9},
                              &duplicate),
            Errc::invalid_argument);
  // A rejoin takes the marks back with the rows, for as many workers as the server marks.
  ShardEngine rejoined(o);
  ASSERT_EQ(rejoined.restore_table_rows(kTable, spec(), 100, std::vector<Key>{11}, out.data(), &why), Errc::ok) << why;
  EXPECT_EQ(rejoined.restore_table_marks(kTable, std::vector<std::uint64_t>(3, 1), &why), Errc::invalid_argument);
  ASSERT_EQ(rejoined.restore_table_marks(kTable, origin.table_marks(kTable), &why), Errc::ok) << why;
  bool again = false;
  ASSERT_EQ(
      rejoined.table_push(kTable, 0, {&row, 1}, ones.data(), &why, PushId{.worker = 1, .session = 7, .seq = 1}, &again),
      Errc::ok);
  EXPECT_TRUE(again) << "a push the restored rows hold was applied again";
}

// The origin's cap comes from a peer: a copy holds at most twice it and 64 rows more, and the
// copies together are charged at their caps against this server's table memory.
TEST(TableReplica, ACopyIsHeldToTwiceItsOriginsCapAndALittle) {
  ShardEngine e(replica_options());
  std::string why;
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kNew), Errc::ok) << why;
  ASSERT_EQ(e.apply_replica_table(kOrigin, kNew, 1, kTable, spec(), 100, {}, &why), Errc::ok) << why;
  const std::uint64_t bound = 2 * 100 + 64;
  const std::vector<float> records(std::size_t{1000} * kDim, 1.0f);
  std::vector<KeyEntry> rows;
  Key next = 1;
  std::uint32_t position = 2;
  while (next <= bound) {
    rows.clear();
    for (; rows.size() < 1000 && next <= bound; ++next) rows.push_back({next, kDim, 0});
    ASSERT_EQ(e.apply_replica_rows(kOrigin, kNew, position++, kTable, rows, records.data(), &why), Errc::ok) << why;
  }
  // Rows it holds are still rewritten at the bound; one more is refused, and the copy is broken.
  const KeyEntry again{bound, kDim, 0}, past{bound + 1, kDim, 0};
  ASSERT_EQ(e.apply_replica_rows(kOrigin, kNew, position++, kTable, {&again, 1}, records.data(), &why), Errc::ok)
      << why;
  EXPECT_EQ(e.apply_replica_rows(kOrigin, kNew, position++, kTable, {&past, 1}, records.data(), &why), Errc::capacity);
  EXPECT_NE(why.find("no room for row " + std::to_string(bound + 1)), std::string::npos) << why;
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::synced, &why, kNew), Errc::ok) << why;
  EXPECT_FALSE(copy_of(e).synced) << "a copy that missed a row was taken for whole";
  std::uint64_t held = 0;
  for (std::uint32_t cursor = 0;;) {
    ReplicaTableRows page;
    ASSERT_EQ(e.replica_table_rows(kOrigin, kTable, cursor, 4096, 1 << 20, &page, &why), Errc::ok) << why;
    held += page.ids.size();
    if ((cursor = page.next) == 0) break;
  }
  EXPECT_EQ(held, bound);
}

TEST(TableReplica, TheCopiesAreChargedAtTheirCapsAgainstTheTableMemory) {
  ShardEngine e(replica_options());  // 64 MiB of table memory
  std::string why;
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kNew), Errc::ok) << why;
  TableSpec wide = spec();
  wide.max_rows = 0;  // declared without a cap: the origin ships the one its memory gave it
  const std::uint64_t rows_per_mib = (1u << 20) / EmbeddingTable::row_bytes_bound(wide);
  // Two copies of 40 MiB do not fit in 64; the same table sent again replaces its charge.
  std::uint32_t position = 1;
  ASSERT_EQ(e.apply_replica_table(kOrigin, kNew, position++, kTable, wide, 40 * rows_per_mib, {}, &why), Errc::ok)
      << why;
  ASSERT_EQ(e.apply_replica_table(kOrigin, kNew, position++, kTable, wide, 40 * rows_per_mib, {}, &why), Errc::ok)
      << why;
  EXPECT_EQ(e.apply_replica_table(kOrigin, kNew, position++, kTable + 1, wide, 40 * rows_per_mib, {}, &why),
            Errc::capacity);
  EXPECT_NE(why.find("--table-memory-mb"), std::string::npos) << why;
  ReplicaTableRows refused;
  ASSERT_EQ(e.replica_table_rows(kOrigin, kTable + 1, 0, 10, 1 << 20, &refused, &why), Errc::ok) << why;
  EXPECT_FALSE(refused.exists);
  // A new transfer frees every charge; a cap past the whole table memory is refused on its own.
  ASSERT_EQ(e.mark_replica(kOrigin, ReplicaMark::syncing, &why, kNew + 1), Errc::ok) << why;
  EXPECT_EQ(e.apply_replica_table(kOrigin, kNew + 1, 1, kTable + 2, wide, 65 * rows_per_mib, {}, &why), Errc::capacity);
  EXPECT_EQ(e.apply_replica_table(kOrigin, kNew + 1, 2, kTable + 1, wide, 40 * rows_per_mib, {}, &why), Errc::ok)
      << why;
  EXPECT_EQ(e.apply_replica_table(kOrigin, kNew + 1, 3, kTable + 2, wide, 16 * rows_per_mib, {}, &why), Errc::ok)
      << why;
}

}  // namespace
}  // namespace pskv
