// An embedding table under contention, also run under the thread sanitizer: pushes are never
// lost (exact sums), and a pull never returns a torn row or another id's row, while the index
// grows and rows are evicted and reused under it.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "common/sync.h"
#include "table/embedding_table.h"

namespace pskv {
namespace {

#if PSKV_TSAN
constexpr int kScale = 1;
#else
constexpr int kScale = 8;
#endif

TEST(EmbeddingTableConcurrency, ConcurrentAddsToSharedRowsAreExact) {
  TableSpec s;
  s.dim = 16;
  s.init = RowInit::zeros;
  s.rule.rule = UpdateRule::add;
  EmbeddingTable t(s);
  constexpr int kThreads = 4, kIds = 64;
  const int pushes = 500 * kScale;
  std::vector<std::thread> threads;
  for (int w = 0; w < kThreads; ++w)
    threads.emplace_back([&, w] {
      std::vector<Key> ids(kIds);
      std::vector<float> ones(kIds * 16, 1.0f);
      for (int i = 0; i < pushes; ++i) {
        for (int k = 0; k < kIds; ++k) ids[k] = Key((k * 7 + w + i) % kIds);  // every row, different orders
        t.push(ids, ones.data(), 0);
      }
    });
  for (auto& th : threads) th.join();
  std::vector<float> out(16);
  for (Key id = 0; id < kIds; ++id) {
    t.pull({&id, 1}, out.data());
    for (float x : out) ASSERT_EQ(x, float(kThreads * pushes)) << "id " << id;
  }
}

// Threads creating rows at once (each push takes room under the cap in blocks) fill the cap
// exactly: no row past it, none refused while room was left.
TEST(EmbeddingTableConcurrency, ConcurrentCreatorsFillTheCapExactly) {
  TableSpec s;
  s.dim = 8;
  s.init = RowInit::zeros;
  s.rule.rule = UpdateRule::add;
  s.max_rows = 1000 * kScale + 77;
  EmbeddingTable t(s);
  constexpr int kThreads = 4;
  const Key per_thread = 1000 * kScale;
  std::vector<std::thread> threads;
  for (int w = 0; w < kThreads; ++w)
    threads.emplace_back([&, w] {
      std::vector<Key> ids(100);
      std::vector<float> ones(ids.size() * 8, 1.0f);
      for (Key base = 0; base < per_thread; base += ids.size()) {
        for (std::size_t k = 0; k < ids.size(); ++k) ids[k] = (base + k) * kThreads + w;
        t.push(ids, ones.data(), 0);
      }
    });
  for (auto& th : threads) th.join();
  const TableStats st = t.stats();
  EXPECT_EQ(st.rows, s.max_rows);
  EXPECT_EQ(st.created, s.max_rows);
  EXPECT_EQ(st.not_admitted, kThreads * per_thread - s.max_rows);
  std::uint64_t found = 0;
  for (Key id = 0; id < kThreads * per_thread; ++id) found += t.contains(id);
  EXPECT_EQ(found, s.max_rows);
}

// Writers assign rows [id, c, c, ..., c] (c: a counter of the writer's) to a few hot ids that the
// readers read all the time, and create new ids all along in the same batches (the index
// rehashes shard by shard; with a cap, rows are evicted and reused for other ids). Readers check
// every row they get is whole (one c) and belongs to its id. Rows are long so that a write takes
// long enough for a reader to land in it.
void torn_read_run(std::uint64_t max_rows) {
  constexpr std::uint32_t kDim = 256;
  TableSpec s;
  s.dim = kDim;
  s.init = RowInit::zeros;
  s.rule.rule = UpdateRule::assign;
  s.max_rows = max_rows;
  s.eviction = max_rows ? RowEviction::lru : RowEviction::none;
  EmbeddingTable t(s);
  constexpr Key kHot = 32;
  // Past 8192 shards x 8 buckets x 2 rows, so every shard rehashes at least once.
  const Key new_ids = max_rows ? 20000 * kScale : 300000;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> checked{0}, bad{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w)
    threads.emplace_back([&, w] {
      constexpr std::size_t kBatch = 16;
      std::vector<Key> ids(2 * kBatch);
      std::vector<float> rows(ids.size() * kDim);
      float c = 0;
      for (Key next = kHot + w; next < kHot + new_ids; next += 2 * kBatch) {
        for (std::size_t i = 0; i < ids.size(); ++i) {
          ids[i] = i < kBatch ? (next + i) % kHot : next + 2 * (i - kBatch);
          c += 1;
          std::fill_n(rows.begin() + i * kDim, kDim, c);
          rows[i * kDim] = float(ids[i]);
        }
        t.push(ids, rows.data(), 1);
      }
      stop.store(true);
    });
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      std::vector<Key> ids(16);
      std::vector<float> out(ids.size() * kDim);
      std::uint64_t x = 12345 + r;
      while (!stop.load()) {
        for (std::size_t i = 0; i < ids.size(); ++i) {
          x = x * 6364136223846793005ull + 1442695040888963407ull;
          ids[i] = i % 2 ? (x >> 33) % kHot : (x >> 33) % (kHot + new_ids);
        }
        t.pull(ids, out.data());
        for (std::size_t i = 0; i < ids.size(); ++i) {
          const float* row = &out[i * kDim];
          bool ok = row[0] == float(ids[i]) || (row[0] == 0.0f && row[1] == 0.0f);
          for (std::uint32_t j = 2; j < kDim; ++j) ok &= row[j] == row[1];
          if (!ok) bad.fetch_add(1);
          checked.fetch_add(1);
        }
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0u) << "of " << checked.load() << " rows read";
  EXPECT_GT(checked.load(), 0u);
  const TableStats st = t.stats();
  if (max_rows) {
    EXPECT_EQ(st.rows, max_rows);
    EXPECT_GT(st.evicted, 0u);
  } else {
    EXPECT_GE(st.rows, new_ids);
    EXPECT_GT(st.grows, 8192u);
  }
}

TEST(EmbeddingTableConcurrency, ReadsAreNeverTornWhileTheIndexGrows) {
  torn_read_run(0);
}
TEST(EmbeddingTableConcurrency, ReadsAreNeverTornWhileRowsAreEvictedAndReused) {
  torn_read_run(1000);
}

}  // namespace
}  // namespace pskv
