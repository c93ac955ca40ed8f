#include "server/checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

namespace pskv {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<Store> make_store(UpdateRule rule) {
  StoreOptions o;
  o.rule.rule = rule;
  o.rule.lr = 0.1f;
  return Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
}

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("pskv-ckpt-" + std::to_string(getpid()) + "-" + std::to_string(rand()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

std::vector<char> slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

TEST(Checkpoint, RoundTripWithOptimizerState) {
  TempDir dir;
  auto a = make_store(UpdateRule::adam);
  std::mt19937 rng(3);
  std::normal_distribution<float> d;
  for (Key k = 0; k < 50; ++k) {
    std::vector<float> v(1 + k * 13);
    for (auto& x : v) x = d(rng);
    ASSERT_EQ(a->init(k * 1000, v), Errc::ok);
    for (int step = 0; step < 3; ++step) {
      for (auto& x : v) x = d(rng);
      ASSERT_EQ(a->push(k * 1000, v), Errc::ok);
    }
  }
  const CheckpointInfo w = write_checkpoint(*a, dir.path.string(), 7);
  EXPECT_EQ(w.keys, 50u);
  EXPECT_TRUE(fs::exists(checkpoint_path(dir.path.string(), 7)));
  EXPECT_FALSE(fs::exists(checkpoint_path(dir.path.string(), 7) + ".tmp"));

  auto b = make_store(UpdateRule::adam);
  const CheckpointInfo r = read_checkpoint(*b, checkpoint_path(dir.path.string(), 7));
  EXPECT_EQ(r.keys, 50u);
  // Same values now, and the same values after one more identical Adam step: state came along.
  for (Key k = 0; k < 50; ++k) {
    const std::size_t n = 1 + k * 13;
    std::vector<float> g(n, 0.5f), va(n), vb(n);
    ASSERT_EQ(a->push(k * 1000, g), Errc::ok);
    ASSERT_EQ(b->push(k * 1000, g), Errc::ok);
    a->pull(k * 1000, va);
    b->pull(k * 1000, vb);
    ASSERT_EQ(va, vb) << "key " << k * 1000;
    EXPECT_EQ(b->find(k * 1000)->update_count, 4u);
  }
}

TEST(Checkpoint, InterruptedWriteLeavesThePreviousCheckpointValid) {
  TempDir dir;
  auto a = make_store(UpdateRule::add);
  std::vector<float> v(100, 1.0f);
  ASSERT_EQ(a->init(1, v), Errc::ok);
  write_checkpoint(*a, dir.path.string(), 0);
  const auto good = slurp(checkpoint_path(dir.path.string(), 0));
  // A crash mid-write leaves a partial temp file beside the last good checkpoint.
  {
    std::ofstream partial(checkpoint_path(dir.path.string(), 0) + ".tmp", std::ios::binary);
    partial.write(good.data(), static_cast<std::streamsize>(good.size() / 2));
  }
  auto b = make_store(UpdateRule::add);
  EXPECT_EQ(read_checkpoint(*b, checkpoint_path(dir.path.string(), 0)).keys, 1u);
  // The next successful write replaces both.
  write_checkpoint(*a, dir.path.string(), 0);
  EXPECT_FALSE(fs::exists(checkpoint_path(dir.path.string(), 0) + ".tmp"));
}

TEST(Checkpoint, EveryCorruptionIsDetected) {
  TempDir dir;
  auto a = make_store(UpdateRule::momentum);
  for (Key k = 0; k < 4; ++k) {
    std::vector<float> v(8, float(k));
    ASSERT_EQ(a->init(k, v), Errc::ok);
  }
  write_checkpoint(*a, dir.path.string(), 0);
  const auto good = slurp(checkpoint_path(dir.path.string(), 0));
  for (std::size_t i = 0; i < good.size(); ++i) {
    auto bad = good;
    bad[i] ^= 0x20;
    EXPECT_THROW(parse_checkpoint(reinterpret_cast<const std::uint8_t*>(bad.data()), bad.size(), nullptr, "x"), Error)
        << "flipped byte " << i;
  }
  for (std::size_t n = 0; n < good.size(); ++n)
    EXPECT_THROW(parse_checkpoint(reinterpret_cast<const std::uint8_t*>(good.data()), n, nullptr, "x"), Error)
        << "truncated to " << n;
  try {
    auto bad = good;
    bad[good.size() / 2] ^= 1;
    parse_checkpoint(reinterpret_cast<const std::uint8_t*>(bad.data()), bad.size(), nullptr, "shard-0.ckpt");
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("shard-0.ckpt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("older checkpoint"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, RuleMismatchAndMissingFileAreClear) {
  TempDir dir;
  auto a = make_store(UpdateRule::adam);
  std::vector<float> v(4, 1.0f);
  ASSERT_EQ(a->init(1, v), Errc::ok);
  write_checkpoint(*a, dir.path.string(), 0);
  auto b = make_store(UpdateRule::sgd);
  try {
    read_checkpoint(*b, checkpoint_path(dir.path.string(), 0));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--rule"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_checkpoint(*b, (dir.path / "nope.ckpt").string()), Error);
}

}  // namespace
}  // namespace pskv
