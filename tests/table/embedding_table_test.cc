// An embedding table's semantics on one thread: initial values, admission, per-row rules,
// eviction under a cap, growth, and what it costs per row.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <numeric>
#include <thread>
#include <vector>

#include "table/embedding_table.h"

namespace pskv {
namespace {

TableSpec spec(std::uint32_t dim = 16) {
  TableSpec s;
  s.dim = dim;
  s.seed = 42;
  s.rule.rule = UpdateRule::sgd;
  s.rule.lr = 0.5f;
  return s;
}

std::vector<float> row_of(const EmbeddingTable& t, Key id) {
  std::vector<float> out(t.dim());
  t.pull({&id, 1}, out.data());
  return out;
}

void push_one(EmbeddingTable& t, Key id, float g, std::uint64_t step = 0) {
  std::vector<float> grad(t.dim(), g);
  t.push({&id, 1}, grad.data(), step);
}

TEST(EmbeddingTable, InitialRowsDependOnlyOnTheSpecAndTheId) {
  TableSpec s = spec(17);  // odd: the last normal float comes from a pair of its own
  for (RowInit init : {RowInit::uniform, RowInit::normal}) {
    s.init = init;
    EmbeddingTable a(s), b(s);
    for (Key id : {0ull, 1ull, 123456789ull, ~0ull}) EXPECT_EQ(row_of(a, id), row_of(b, id)) << to_string(init);
    EXPECT_NE(row_of(a, 1), row_of(a, 2));
    TableSpec other = s;
    other.seed = 43;
    EXPECT_NE(row_of(EmbeddingTable(other), 1), row_of(a, 1));
    EXPECT_EQ(a.stats().rows, 0u) << "a pull creates nothing";
  }
  s.init = RowInit::zeros;
  EXPECT_EQ(row_of(EmbeddingTable(s), 7), std::vector<float>(17, 0.0f));
}

TEST(EmbeddingTable, InitialValuesHaveTheirDistribution) {
  TableSpec s = spec(64);
  s.init_scale = 0.25f;
  s.init = RowInit::uniform;
  EmbeddingTable u(s);
  s.init = RowInit::normal;
  EmbeddingTable n(s);
  double sum = 0, sq = 0, usum = 0;
  float umin = 1, umax = -1;
  const int rows = 4000;
  for (Key id = 0; id < rows; ++id) {
    for (float x : row_of(n, id)) sum += x, sq += double(x) * x;
    for (float x : row_of(u, id)) usum += x, umin = std::min(umin, x), umax = std::max(umax, x);
  }
  const double count = rows * 64.0;
  EXPECT_NEAR(sum / count, 0.0, 0.005);
  EXPECT_NEAR(std::sqrt(sq / count), 0.25, 0.005);
  EXPECT_NEAR(usum / count, 0.0, 0.005);
  EXPECT_GE(umin, -0.25f);
  EXPECT_LE(umax, 0.25f);
  EXPECT_LT(umin, -0.24f);
  EXPECT_GT(umax, 0.24f);
}

TEST(EmbeddingTable, APushCreatesTheRowFromItsInitialValue) {
  EmbeddingTable t(spec());
  const std::vector<float> initial = row_of(t, 5);
  EXPECT_FALSE(t.contains(5));
  push_one(t, 5, 1.0f);
  EXPECT_TRUE(t.contains(5));
  const std::vector<float> after = row_of(t, 5);
  for (std::uint32_t i = 0; i < t.dim(); ++i) EXPECT_FLOAT_EQ(after[i], initial[i] - 0.5f);
  push_one(t, 5, 1.0f);
  EXPECT_FLOAT_EQ(row_of(t, 5)[0], initial[0] - 1.0f);
  EXPECT_EQ(t.stats().rows, 1u);
  EXPECT_EQ(t.stats().created, 1u);
}

TEST(EmbeddingTable, ARepeatedIdInABatchIsUpdatedOncePerOccurrence) {
  EmbeddingTable t(spec(4));
  const Key ids[] = {9, 3, 9};
  const float grads[] = {1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4};
  const std::vector<float> initial = row_of(t, 9);
  t.push(ids, grads, 0);
  EXPECT_FLOAT_EQ(row_of(t, 9)[0], initial[0] - 0.5f * 5);
  EXPECT_EQ(t.stats().rows, 2u);
}

TEST(EmbeddingTable, AnIdIsAdmittedAtItsNthPush) {
  TableSpec s = spec();
  s.admit_after = 3;
  EmbeddingTable t(s);
  const std::vector<float> initial = row_of(t, 77);
  push_one(t, 77, 1.0f);
  push_one(t, 77, 1.0f);
  EXPECT_FALSE(t.contains(77));
  EXPECT_EQ(row_of(t, 77), initial) << "not admitted: pulls read the initial value";
  EXPECT_EQ(t.stats().not_admitted, 2u);
  push_one(t, 77, 1.0f);
  EXPECT_TRUE(t.contains(77));
  EXPECT_FLOAT_EQ(row_of(t, 77)[0], initial[0] - 0.5f) << "only the admitting push is applied";
  // Other ids keep their own counts (the filter over-counts only on collisions, rare at this size).
  push_one(t, 78, 1.0f);
  EXPECT_FALSE(t.contains(78));
}

TEST(EmbeddingTable, AdamAndAdagradKeepTheirStatePerRow) {
  for (UpdateRule rule : {UpdateRule::adam, UpdateRule::adagrad}) {
    TableSpec s = spec(3);
    s.init = RowInit::zeros;
    s.rule.rule = rule;
    s.rule.lr = 0.1f;
    EmbeddingTable t(s);
    // Row 1 is updated three times, row 2 once: row 2's update must be a first update (Adam's
    // bias correction counts the row's own updates), whatever row 1 went through.
    for (int i = 0; i < 3; ++i) push_one(t, 1, 2.0f);
    push_one(t, 2, 2.0f);
    TableSpec fresh_spec = s;
    EmbeddingTable fresh(fresh_spec);
    push_one(fresh, 2, 2.0f);
    EXPECT_EQ(row_of(t, 2), row_of(fresh, 2)) << to_string(rule);
    // Against the rule written out.
    double w = 0, m = 0, v = 0, G = 0;
    for (int k = 1; k <= 3; ++k) {
      const double g = 2.0;
      if (rule == UpdateRule::adam) {
        m = 0.9 * m + 0.1 * g;
        v = 0.999 * v + 0.001 * g * g;
        const double mh = m / (1 - std::pow(0.9, k)), vh = v / (1 - std::pow(0.999, k));
        w -= 0.1 * mh / (std::sqrt(vh) + 1e-8);
      } else {
        G += g * g;
        w -= 0.1 * g / (std::sqrt(G) + 1e-8);
      }
    }
    for (float x : row_of(t, 1)) EXPECT_NEAR(x, w, 1e-5) << to_string(rule);
  }
}

TEST(EmbeddingTable, AFullTableWithoutEvictionAdmitsNoMoreRows) {
  TableSpec s = spec(4);
  s.max_rows = 10;
  EmbeddingTable t(s);
  for (Key id = 0; id < 25; ++id) push_one(t, id, 1.0f);
  const TableStats st = t.stats();
  EXPECT_EQ(st.rows, 10u);
  EXPECT_EQ(st.not_admitted, 15u);
  EXPECT_EQ(st.evicted, 0u);
  for (Key id = 0; id < 10; ++id) EXPECT_TRUE(t.contains(id));
  for (Key id = 10; id < 25; ++id) EXPECT_FALSE(t.contains(id));
  push_one(t, 3, 1.0f);  // an existing row is still updated
  EXPECT_EQ(t.stats().not_admitted, 15u);
}

// Under each policy, the rows it ranks highest survive a stream of new ids.
TEST(EmbeddingTable, EvictionKeepsTheRowsItsPolicyRanksHighest) {
  for (RowEviction policy : {RowEviction::lru, RowEviction::lfu, RowEviction::step}) {
    TableSpec s = spec(4);
    s.max_rows = 200;
    s.eviction = policy;
    EmbeddingTable t(s);
    const std::vector<Key> hot = {1000001, 1000002, 1000003, 1000004, 1000005};
    std::uint64_t step = 1;
    for (Key id : hot) push_one(t, id, 0.0f, 1u << 20);  // step: the newest clock there will be
    for (Key id = 0; id < 5000; ++id) {
      if (policy != RowEviction::step)
        for (Key h : hot) push_one(t, h, 0.0f, 1u << 20);
      push_one(t, id, 1.0f, ++step);
      ASSERT_LE(t.stats().rows, 200u);
    }
    const TableStats st = t.stats();
    EXPECT_EQ(st.rows, 200u) << to_string(policy);
    EXPECT_EQ(st.created, 5005u) << to_string(policy);
    EXPECT_EQ(st.evicted, 4805u) << to_string(policy);
    EXPECT_EQ(st.not_admitted, 0u) << to_string(policy);
    for (Key h : hot) EXPECT_TRUE(t.contains(h)) << to_string(policy) << " evicted hot row " << h;
    if (policy != RowEviction::lfu) {  // (to LFU every cold row is alike: used once)
      // The survivors are mostly recent ids: sampling keeps the newest far more often than not.
      int recent = 0;
      for (Key id = 4800; id < 5000; ++id) recent += t.contains(id);
      EXPECT_GT(recent, 150) << to_string(policy);
    }
    // An evicted row comes back from its initial value.
    EXPECT_FALSE(t.contains(0));
    EXPECT_EQ(row_of(t, 0), row_of(EmbeddingTable(s), 0)) << to_string(policy);
  }
}

TEST(EmbeddingTable, GrowsToManyRowsAndFindsEveryOne) {
  TableSpec s = spec(8);
  s.init = RowInit::zeros;
  s.rule.rule = UpdateRule::assign;
  EmbeddingTable t(s);
  constexpr Key kRows = 300000;
  std::vector<Key> ids(1000);
  std::vector<float> values(ids.size() * 8);
  for (Key base = 0; base < kRows; base += ids.size()) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      ids[i] = (base + i) * 0x9e3779b97f4a7c15ull;  // spread over the 64 bits
      std::fill_n(values.begin() + i * 8, 8, float(base + i));
    }
    t.push(ids, values.data(), 0);
  }
  const TableStats st = t.stats();
  EXPECT_EQ(st.rows, kRows);
  EXPECT_GT(st.grows, 0u);
  std::vector<float> out(8);
  for (Key i = 0; i < kRows; i += 7) {
    const Key id = i * 0x9e3779b97f4a7c15ull;
    t.pull({&id, 1}, out.data());
    ASSERT_EQ(out, std::vector<float>(8, float(i))) << "row " << i;
  }
}

TEST(EmbeddingTable, A16FloatRowCostsAtMost96Bytes) {
  EmbeddingTable t(spec(16));
  constexpr Key kRows = 1u << 20;
  std::vector<Key> ids(4096);
  std::vector<float> grads(ids.size() * 16, 0.0f);
  for (Key base = 0; base < kRows; base += ids.size()) {
    std::iota(ids.begin(), ids.end(), base);
    t.push(ids, grads.data(), 0);
  }
  const TableStats st = t.stats();
  ASSERT_EQ(st.rows, kRows);
  const double per_row = double(st.bytes) / double(st.rows);
  EXPECT_LE(per_row, 96.0);
  EXPECT_GE(per_row, 80.0) << "16 bytes of key and links plus 64 of floats: less means the count is wrong";
}

// The table's segment count once it reaches `want`, or after 10 s, whatever it is then: the
// segments ahead of the pushes come from the table's own thread.
std::uint64_t segments_once(const EmbeddingTable& t, std::uint64_t want) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (t.stats().segments < want && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return t.stats().segments;
}

// No push waits for a segment's memory: once half of its first segment is used, a capped table
// makes segments ahead of the rows handed out, within its cap, and every row still lands where it
// is found.
TEST(EmbeddingTable, ACappedTableMakesItsSegmentsAheadOfThePushesWithinItsCap) {
  TableSpec s = spec(16);
  s.init = RowInit::zeros;
  s.rule.rule = UpdateRule::assign;
  s.max_rows = 8 * 65536 - 1;  // eight whole segments (row 0 is never used)
  EmbeddingTable t(s);
  std::vector<Key> ids(1000);
  std::vector<float> values(ids.size() * 16);
  auto fill = [&](Key from, Key to) {
    for (Key base = from; base < to; base += ids.size()) {
      const std::size_t n = std::min<Key>(ids.size(), to - base);
      for (std::size_t i = 0; i < n; ++i) {
        ids[i] = base + i;
        std::fill_n(values.begin() + i * 16, 16, float(base + i));
      }
      t.push(std::span<const Key>(ids.data(), n), values.data(), 0);
    }
  };
  fill(0, 30000);
  EXPECT_EQ(t.stats().segments, 1u) << "before half of the first segment is used, nothing ahead";
  fill(30000, 40000);
  // More segments come without another push.
  EXPECT_GT(segments_once(t, 3), 2u);
  fill(40000, s.max_rows);
  const TableStats st = t.stats();
  EXPECT_EQ(st.rows, s.max_rows);
  EXPECT_EQ(st.segments, 8u) << "never a segment past the cap";
  std::vector<float> out(16);
  for (Key id = 0; id < s.max_rows; id += 997) {
    t.pull({&id, 1}, out.data());
    ASSERT_EQ(out, std::vector<float>(16, float(id))) << "row " << id;
  }
}

// A replica's copy of a table has no cap of its own (it takes what its origin ships) but is
// sized for its origin's: nothing is made ahead past that bound.
TEST(EmbeddingTable, AnUncappedTableWithABoundMakesNothingPastIt) {
  EmbeddingTable t(spec(16), /*index_rows=*/100000);  // rows up to 100,000: segments 0 and 1
  std::vector<Key> ids(1000);
  std::vector<float> grads(ids.size() * 16, 0.0f);
  auto fill = [&](Key from, Key to) {
    for (Key base = from; base < to; base += ids.size()) {
      std::iota(ids.begin(), ids.end(), base);
      t.push(ids, grads.data(), 0);
    }
  };
  fill(0, 40000);
  // No push has reached row 65,536 yet: segment 1 comes from the table's thread, within the bound.
  EXPECT_EQ(segments_once(t, 2), 2u);
  fill(40000, 99000);
  // Segment 2 would hold only rows past the bound. Without a cap, the thread would be asked for
  // it here: a window to make it in, since nothing says when a thread has nothing to do.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(t.stats().segments, 2u) << "segment 2 would hold only rows past the bound";
}

// A table without a cap may stop growing anywhere: it makes one segment ahead, from the middle of
// the current one, and no more.
TEST(EmbeddingTable, ATableWithoutACapMakesOneSegmentAhead) {
  EmbeddingTable t(spec(16));
  std::vector<Key> ids(1000);
  std::vector<float> grads(ids.size() * 16, 0.0f);
  for (Key base = 0; base < 20000; base += ids.size()) {
    std::iota(ids.begin(), ids.end(), base);
    t.push(ids, grads.data(), 0);
  }
  EXPECT_EQ(t.stats().segments, 1u) << "before the middle of the first segment, nothing ahead";
  for (Key base = 20000; base < 40000; base += ids.size()) {
    std::iota(ids.begin(), ids.end(), base);
    t.push(ids, grads.data(), 0);
  }
  EXPECT_EQ(segments_once(t, 2), 2u);
  // A window for a second segment ahead to appear, were one asked for (see above).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(t.stats().segments, 2u);
}

// A table with a cap gets the buckets for it when it is made: filling it never rehashes.
TEST(EmbeddingTable, ACappedTableIsIndexedForItsCapFromTheStart) {
  TableSpec s = spec(16);
  s.max_rows = 4 * 65536 - 1;  // four whole segments (row 0 is never used)
  EmbeddingTable t(s);
  std::vector<Key> ids(1000);
  std::vector<float> grads(ids.size() * 16, 0.0f);
  for (Key base = 0; base < s.max_rows; base += ids.size()) {
    std::iota(ids.begin(), ids.end(), base);
    t.push(std::span<const Key>(ids.data(), std::min<Key>(ids.size(), s.max_rows - base)), grads.data(), 0);
  }
  const TableStats st = t.stats();
  ASSERT_EQ(st.rows, s.max_rows);
  EXPECT_EQ(st.not_admitted, 0u);
  EXPECT_EQ(st.grows, 0u);
  EXPECT_LE(double(st.bytes) / double(st.rows), 96.0);
}

// A push takes rows in blocks; those it does not use go back and are the next ones handed out,
// so a stream of pushes that each create a few rows among many updates fills one segment of
// 65,535 rows before it allocates another (the table's bytes stay those of the first push).
TEST(EmbeddingTable, RowsAPushTookButDidNotUseAreReused) {
  TableSpec s = spec(4);
  s.max_rows = 60000;  // a cap: buckets sized up front, so only a new segment changes the bytes
  EmbeddingTable t(s);
  std::vector<Key> ids = {0, 1, 2, 0, 0};
  std::vector<float> grads(ids.size() * 4, 1.0f);
  t.push(ids, grads.data(), 0);
  const std::uint64_t bytes = t.stats().bytes;
  for (Key next = 3; next + 1 < s.max_rows; next += 2) {
    ids = {0, next, 1, next + 1, 2};  // two new rows: a block of one, then a block of two
    t.push(ids, grads.data(), 0);
  }
  const TableStats st = t.stats();
  EXPECT_EQ(st.rows, s.max_rows - 1);
  EXPECT_EQ(st.created, s.max_rows - 1);
  EXPECT_EQ(st.bytes, bytes) << "rows a push left unused were not handed out again";
  for (Key id = 0; id + 1 < s.max_rows; id += 997) EXPECT_TRUE(t.contains(id)) << id;
}

TEST(EmbeddingTable, RefusesSpecsItCannotServe) {
  auto refused = [](TableSpec s, const char* what) {
    try {
      EmbeddingTable t(s);
      ADD_FAILURE() << "accepted " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  TableSpec s = spec();
  s.dim = 0;
  refused(s, "dimension");
  s = spec();
  s.admit_after = 0;
  refused(s, "admit_after");
  s = spec();
  s.eviction = RowEviction::lru;
  refused(s, "max_rows");
  s = spec();
  s.rule.lr = NAN;
  refused(s, "finite");
}

}  // namespace
}  // namespace pskv
