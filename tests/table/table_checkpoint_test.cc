// Incremental table checkpoints: a snapshot and its deltas restore the exact rows, optimizer
// state and evictions; every corruption of a delta is refused before anything of it is applied.
#include "server/table_checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <random>

#include "server/checkpoint.h"
#include "table/embedding_table.h"

namespace pskv {
namespace {

namespace fs = std::filesystem;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("pskv-tckpt-" + std::to_string(getpid()) + "-" + std::to_string(rand()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

EngineOptions engine_options() {
  EngineOptions o;
  o.store.arena_bytes = 1 << 20;
  o.store.max_keys = 1024;
  o.track_table_changes = true;
  o.table_memory_bytes = 512ull << 20;
  return o;
}

TableSpec adam_spec() {
  TableSpec s;
  s.dim = 6;
  s.rule.rule = UpdateRule::adam;
  s.rule.lr = 0.01f;
  s.max_rows = 300;
  s.eviction = RowEviction::lru;
  return s;
}

// Every live row of `t`: id -> floats and state, read whole.
std::map<Key, std::vector<float>> dump(EmbeddingTable& t) {
  std::map<Key, std::vector<float>> out;
  std::vector<Key> ignored;
  // A dump of every row clears the marks too: only for tables no checkpoint follows.
  t.take_changes(
      true,
      [&](Key id, const float* row, const float* state) {
        std::vector<float> all(row, row + t.dim());
        all.insert(all.end(), state, state + t.state_floats_per_row());
        out[id] = all;
      },
      &ignored);
  return out;
}

void push_random(EmbeddingTable& t, std::mt19937_64& rng, int batches, Key id_range) {
  std::normal_distribution<float> d;
  std::vector<Key> ids(20);
  std::vector<float> grads(ids.size() * t.dim());
  for (int b = 0; b < batches; ++b) {
    for (auto& id : ids) id = rng() % id_range;
    for (auto& g : grads) g = d(rng);
    t.push(ids, grads.data(), b);
  }
}

std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(TableCheckpoint, ASnapshotAndItsDeltasRestoreTheExactRows) {
  TempDir dir;
  ShardEngine a(engine_options());
  std::string why;
  ASSERT_EQ(a.create_table(3, adam_spec(), &why), Errc::ok) << why;
  EmbeddingTable& ta = *a.table_at(3);
  TableCheckpointer writer(dir.path.string(), 7);
  std::mt19937_64 rng(11);
  push_random(ta, rng, 20, 200);
  EXPECT_EQ(writer.write(a).files, 1u);  // the snapshot
  push_random(ta, rng, 5, 200);
  const TableCheckpointInfo d1 = writer.write(a);  // a delta: the rows those pushes touched
  EXPECT_GT(d1.rows, 0u);
  EXPECT_LT(d1.rows, ta.stats().rows);
  push_random(ta, rng, 40, 100000);  // new ids past the cap of 300: evictions
  ASSERT_GT(ta.stats().evicted, 0u);
  const TableCheckpointInfo d2 = writer.write(a);
  EXPECT_GT(d2.removed, 0u);
  EXPECT_EQ(files_in(dir.path).size(), 3u);

  ShardEngine b(engine_options());
  const TableCheckpointInfo got = TableCheckpointer::restore(b, dir.path.string(), 7);
  EXPECT_EQ(got.files, 3u);
  ASSERT_NE(b.table_at(3), nullptr);
  const auto restored = dump(*b.table_at(3));
  EXPECT_EQ(restored.size(), 300u);
  EXPECT_EQ(restored, dump(ta));
  EXPECT_EQ(TableCheckpointer::restore(b, dir.path.string(), 8).files, 0u) << "another server's files are not ours";
}

TEST(TableCheckpoint, ANewSnapshotStartsAGenerationAndTheOldOneGoes) {
  TempDir dir;
  ShardEngine a(engine_options());
  std::string why;
  ASSERT_EQ(a.create_table(0, adam_spec(), &why), Errc::ok);
  EmbeddingTable& t = *a.table_at(0);
  std::mt19937_64 rng(5);
  push_random(t, rng, 10, 100);
  {
    TableCheckpointer first(dir.path.string(), 1);
    first.write(a);
    push_random(t, rng, 2, 100);
    first.write(a);
  }
  // A restarted server's checkpointer begins with a snapshot of a newer generation.
  TableCheckpointer second(dir.path.string(), 1);
  second.write(a);
  const auto files = files_in(dir.path);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0].filename().string(), "table-0.server-1.g2.0.ckpt");
  // Deltas pile up until replaying them costs more than a snapshot, then a new one begins.
  for (int i = 0; i < 30; ++i) {
    push_random(t, rng, 3, 100);
    second.write(a);
  }
  for (const auto& f : files_in(dir.path)) EXPECT_EQ(f.filename().string().find("g2."), std::string::npos) << f;
  ShardEngine b(engine_options());
  TableCheckpointer::restore(b, dir.path.string(), 1);
  EXPECT_EQ(dump(*b.table_at(0)), dump(t));
}

TEST(TableCheckpoint, EveryFlippedByteOfADeltaIsRefused) {
  TempDir dir;
  ShardEngine a(engine_options());
  std::string why;
  TableSpec spec = adam_spec();
  spec.dim = 2;
  ASSERT_EQ(a.create_table(1, spec, &why), Errc::ok);
  EmbeddingTable& t = *a.table_at(1);
  std::mt19937_64 rng(9);
  TableCheckpointer writer(dir.path.string(), 0);
  push_random(t, rng, 3, 50);
  writer.write(a);
  push_random(t, rng, 1, 400);  // a few rows changed, a few evicted
  writer.write(a);
  const std::string delta = (dir.path / "table-1.server-0.g1.1.ckpt").string();
  const CheckpointFile file(delta);
  std::vector<std::uint8_t> bytes(file.data(), file.data() + file.size());
  TableSpec parsed;
  const TableCheckpointInfo ok =
      TableCheckpointer::apply(bytes.data(), bytes.size(), 0, 1, 1, 1, &parsed, nullptr, delta);
  EXPECT_GT(ok.rows, 0u);
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] ^= 0x5a;
    try {
      TableCheckpointer::apply(bytes.data(), bytes.size(), 0, 1, 1, 1, &parsed, nullptr, delta);
      ADD_FAILURE() << "byte " << i << " of " << bytes.size() << " flipped and accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::protocol) << e.what();
    }
    bytes[i] ^= 0x5a;
  }
  // Cut short, or a delta missing from the middle of the chain: refused by name.
  EXPECT_THROW(TableCheckpointer::apply(bytes.data(), bytes.size() - 1, 0, 1, 1, 1, &parsed, nullptr, delta), Error);
  push_random(t, rng, 1, 50);
  writer.write(a);
  fs::remove(delta);
  ShardEngine b(engine_options());
  try {
    TableCheckpointer::restore(b, dir.path.string(), 0);
    ADD_FAILURE() << "a gap in the deltas was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing delta 1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pskv
