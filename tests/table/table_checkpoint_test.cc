// Incremental table checkpoints: a snapshot and its deltas restore the exact rows, optimizer
// state and evictions; every corruption of a delta is refused before anything of it is applied.
#include "server/table_checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "layout/crc.h"
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

// The table files in `dir` (the manifest left out).
std::vector<fs::path> files_in(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".ckpt") out.push_back(e.path());
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

std::vector<std::uint8_t> read_all(const fs::path& path) {
  const CheckpointFile file(path.string());
  return {file.data(), file.data() + file.size()};
}

void write_all(const fs::path& path, const std::vector<std::uint8_t>& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// The message of what restoring `dir` as server 0 throws, or "" if it does not.
std::string restore_error(const fs::path& dir) {
  ShardEngine b(engine_options());
  try {
    TableCheckpointer::restore(b, dir.string(), 0);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::protocol) << e.what();
    return e.what();
  }
  return "";
}

// The trailer: magic[8] | rows u64 | removed u64 | crc u32, at the end of the file.
constexpr std::size_t kTrailer = 28, kRowsAt = 8, kRemovedAt = 16, kTrailerCrcAt = 24;
constexpr std::size_t kHeader = 104, kHeaderCrcAt = 100, kVersionAt = 8;

// Rewrites a file image's version, and its header's checksum to match.
void set_version(std::vector<std::uint8_t>& bytes, std::uint32_t version) {
  std::memcpy(&bytes[kVersionAt], &version, 4);
  const std::uint32_t header_crc = crc32_update(0, bytes.data(), kHeaderCrcAt);
  std::memcpy(&bytes[kHeaderCrcAt], &header_crc, 4);
}

TEST(TableCheckpoint, CountsMovedTogetherInTheTrailerAreRefused) {
  // Eight rows taken from the rows and given to the removed ids keep the sizes adding up; before
  // version 2 the counts were not under the checksum, and restore took the rows' bytes for ids.
  TempDir dir;
  ShardEngine a(engine_options());
  std::string why;
  ASSERT_EQ(a.create_table(0, adam_spec(), &why), Errc::ok);
  std::mt19937_64 rng(3);
  push_random(*a.table_at(0), rng, 10, 200);
  TableCheckpointer(dir.path.string(), 0).write(a);
  const fs::path snapshot = dir.path / "table-0.server-0.g1.0.ckpt";
  std::vector<std::uint8_t> bytes = read_all(snapshot);
  std::uint64_t rows, removed;
  const std::size_t t = bytes.size() - kTrailer;
  std::memcpy(&rows, &bytes[t + kRowsAt], 8);
  std::memcpy(&removed, &bytes[t + kRemovedAt], 8);
  ASSERT_GE(rows, 8u);
  const std::uint64_t row_bytes = (bytes.size() - kHeader - kTrailer - removed * 8) / rows;
  rows -= 8;
  removed += row_bytes;
  std::memcpy(&bytes[t + kRowsAt], &rows, 8);
  std::memcpy(&bytes[t + kRemovedAt], &removed, 8);
  TableSpec spec;
  try {
    TableCheckpointer::apply(bytes.data(), bytes.size(), 0, 0, 1, 0, &spec, nullptr, snapshot.string());
    ADD_FAILURE() << "counts moved together were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("checksum mismatch"), std::string::npos) << e.what();
  }
}

TEST(TableCheckpoint, FilesOfVersionOneAreStillReadAndUnknownVersionsAreNot) {
  TempDir dir;
  ShardEngine a(engine_options());
  std::string why;
  ASSERT_EQ(a.create_table(0, adam_spec(), &why), Errc::ok);
  EmbeddingTable& t = *a.table_at(0);
  std::mt19937_64 rng(4);
  push_random(t, rng, 10, 200);
  TableCheckpointer writer(dir.path.string(), 0);
  writer.write(a);
  push_random(t, rng, 3, 200);
  writer.write(a);
  // Rewritten as a build before the manifest wrote them: version 1, the trailer's checksum of the
  // rows and removed ids alone, no manifest.
  for (const fs::path& f : files_in(dir.path)) {
    std::vector<std::uint8_t> bytes = read_all(f);
    set_version(bytes, 1);
    const std::uint32_t body_crc = crc32_update(0, bytes.data() + kHeader, bytes.size() - kHeader - kTrailer);
    std::memcpy(&bytes[bytes.size() - kTrailer + kTrailerCrcAt], &body_crc, 4);
    write_all(f, bytes);
  }
  fs::remove(dir.path / "tables.server-0.manifest");
  ShardEngine b(engine_options());
  EXPECT_EQ(TableCheckpointer::restore(b, dir.path.string(), 0).files, 2u);
  EXPECT_EQ(dump(*b.table_at(0)), dump(t));

  std::vector<std::uint8_t> bytes = read_all(dir.path / "table-0.server-0.g1.0.ckpt");
  set_version(bytes, 3);
  write_all(dir.path / "table-0.server-0.g1.0.ckpt", bytes);
  EXPECT_NE(restore_error(dir.path).find("version 3 is not readable"), std::string::npos);
}

TEST(TableCheckpoint, TheManifestCatchesFilesThatWentMissing) {
  TempDir dir;
  const fs::path manifest = dir.path / "tables.server-0.manifest";
  ShardEngine a(engine_options());
  std::string why;
  ASSERT_EQ(a.create_table(0, adam_spec(), &why), Errc::ok);
  ASSERT_EQ(a.create_table(5, adam_spec(), &why), Errc::ok);
  std::mt19937_64 rng(6);
  TableCheckpointer writer(dir.path.string(), 0);
  push_random(*a.table_at(0), rng, 10, 200);
  push_random(*a.table_at(5), rng, 10, 200);
  writer.write(a);
  push_random(*a.table_at(0), rng, 2, 200);
  writer.write(a);
  const std::vector<std::uint8_t> older_manifest = read_all(manifest);
  push_random(*a.table_at(0), rng, 2, 200);
  writer.write(a);
  ASSERT_EQ(restore_error(dir.path), "");

  // A crash between the newest delta and its manifest: the delta is whole and still restored.
  const std::vector<std::uint8_t> newest_manifest = read_all(manifest);
  write_all(manifest, older_manifest);
  {
    ShardEngine b(engine_options());
    EXPECT_EQ(TableCheckpointer::restore(b, dir.path.string(), 0).files, 6u);
    EXPECT_EQ(dump(*b.table_at(0)), dump(*a.table_at(0)));
  }
  write_all(manifest, newest_manifest);

  // Every byte of the manifest flipped: refused.
  for (std::size_t i = 0; i < newest_manifest.size(); ++i) {
    std::vector<std::uint8_t> bytes = newest_manifest;
    bytes[i] ^= 0x21;
    write_all(manifest, bytes);
    EXPECT_NE(restore_error(dir.path).find("manifest"), std::string::npos) << "byte " << i;
  }
  write_all(manifest, newest_manifest);

  // The newest delta gone: before the manifest the chain 0, 1 looked whole.
  const fs::path newest = dir.path / "table-0.server-0.g1.2.ckpt";
  const std::vector<std::uint8_t> delta = read_all(newest);
  fs::remove(newest);
  EXPECT_NE(restore_error(dir.path).find("table-0.server-0.g1.2.ckpt, which is missing"), std::string::npos);
  // The same file of another run in its place: refused by the checksum the manifest recorded.
  {
    TempDir other;
    ShardEngine c(engine_options());
    ASSERT_EQ(c.create_table(0, adam_spec(), &why), Errc::ok);
    TableCheckpointer w(other.path.string(), 0);
    std::mt19937_64 other_rng(99);
    for (int i = 0; i < 3; ++i) {
      push_random(*c.table_at(0), other_rng, 3, 200);
      w.write(c);
    }
    write_all(newest, read_all(other.path / newest.filename()));
  }
  EXPECT_NE(restore_error(dir.path).find("is not the file the manifest"), std::string::npos);
  write_all(newest, delta);
  ASSERT_EQ(restore_error(dir.path), "");

  // Every file of a table gone.
  for (const fs::path& f : files_in(dir.path))
    if (f.filename().string().rfind("table-5.", 0) == 0) fs::remove(f);
  EXPECT_NE(restore_error(dir.path).find("table 5 is named by the manifest"), std::string::npos);

  // The manifest itself gone, with files of this version left.
  fs::remove(manifest);
  EXPECT_NE(restore_error(dir.path).find("was written with a manifest"), std::string::npos);
}

TEST(TableCheckpoint, ACrashBeforeTheFirstManifestLeavesARestorableDirectory) {
  // A directory's first checkpoint writes its (empty) manifest before any table file: a crash
  // between the files and the manifest naming them must not leave files that restore refuses
  // for having no manifest.
  TempDir dir;
  const fs::path manifest = dir.path / "tables.server-0.manifest";
  ShardEngine a(engine_options());
  TableCheckpointer writer(dir.path.string(), 0);
  writer.write(a);  // no table yet
  ASSERT_TRUE(fs::exists(manifest));
  const std::vector<std::uint8_t> empty = read_all(manifest);
  std::string why;
  ASSERT_EQ(a.create_table(2, adam_spec(), &why), Errc::ok);
  std::mt19937_64 rng(8);
  push_random(*a.table_at(2), rng, 10, 200);
  writer.write(a);
  write_all(manifest, empty);  // the crash: the snapshot committed, its manifest not
  ShardEngine b(engine_options());
  EXPECT_EQ(TableCheckpointer::restore(b, dir.path.string(), 0).files, 1u);
  EXPECT_EQ(dump(*b.table_at(2)), dump(*a.table_at(2)));
}

}  // namespace
}  // namespace pskv
