#include "server/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "layout/crc.h"
#include "layout/hash.h"
#include "layout/store_format.h"

namespace pskv {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<Store> make_store(UpdateRule rule, float lr = 0.1f) {
  StoreOptions o;
  o.rule.rule = rule;
  o.rule.lr = lr;
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
  const CheckpointInfo w = write_checkpoint(*a, nullptr, dir.path.string(), 7);
  EXPECT_EQ(w.keys, 50u);
  EXPECT_TRUE(fs::exists(checkpoint_path(dir.path.string(), 7)));
  EXPECT_FALSE(fs::exists(checkpoint_path(dir.path.string(), 7) + ".tmp"));

  auto b = make_store(UpdateRule::adam);
  const CheckpointInfo r = read_checkpoint(*b, nullptr, checkpoint_path(dir.path.string(), 7));
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
  write_checkpoint(*a, nullptr, dir.path.string(), 0);
  const auto good = slurp(checkpoint_path(dir.path.string(), 0));
  // A crash mid-write leaves a partial temp file beside the last good checkpoint.
  {
    std::ofstream partial(checkpoint_path(dir.path.string(), 0) + ".tmp", std::ios::binary);
    partial.write(good.data(), static_cast<std::streamsize>(good.size() / 2));
  }
  auto b = make_store(UpdateRule::add);
  EXPECT_EQ(read_checkpoint(*b, nullptr, checkpoint_path(dir.path.string(), 0)).keys, 1u);
  // The next successful write replaces both.
  write_checkpoint(*a, nullptr, dir.path.string(), 0);
  EXPECT_FALSE(fs::exists(checkpoint_path(dir.path.string(), 0) + ".tmp"));
}

// In an shm store a client applying its own push holds its key's stripe; stopped there, it once
// held the checkpointing thread forever, and with it the server's stop. The checkpoint now gives
// up after its patience with the key named, and the last good file stays.
TEST(Checkpoint, AStripeHeldByAStoppedClientAbandonsTheCheckpointNotTheServer) {
  for (const bool sync_mode : {false, true}) {
    SCOPED_TRACE(sync_mode ? "with sync steps" : "without sync steps");
    TempDir dir;
    auto a = make_store(UpdateRule::add);
    SyncOptions so;
    so.num_workers = 1;
    SyncAccumulator sa(*a, so);
    SyncAccumulator* sync = sync_mode ? &sa : nullptr;
    ASSERT_EQ(a->init(7, std::vector<float>(8, 1.0f)), Errc::ok);
    write_checkpoint(*a, sync, dir.path.string(), 0);
    const auto good = slurp(checkpoint_path(dir.path.string(), 0));
    ASSERT_EQ(a->push(7, std::vector<float>(8, 1.0f)), Errc::ok);
    const auto& header = *reinterpret_cast<const StoreHeader*>(a->region());
    auto& stripe = *reinterpret_cast<SharedMutex*>(a->region() + header.stripes_offset +
                                                   ((mix64(7) >> 40) & (header.stripes - 1)) * kCacheLine);
    stripe.lock(5);  // an shm client's owner tag, never let go
    const auto began = std::chrono::steady_clock::now();
    try {
      write_checkpoint(*a, sync, dir.path.string(), 0);
      ADD_FAILURE() << "the checkpoint went on past a held stripe";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::timeout);
      EXPECT_NE(std::string(e.what()).find("key 7"), std::string::npos) << e.what();
    }
    EXPECT_LT(std::chrono::steady_clock::now() - began, std::chrono::seconds(10));
    EXPECT_EQ(slurp(checkpoint_path(dir.path.string(), 0)), good);
    EXPECT_FALSE(fs::exists(checkpoint_path(dir.path.string(), 0) + ".tmp"));
    stripe.unlock();
    write_checkpoint(*a, sync, dir.path.string(), 0);
    auto b = make_store(UpdateRule::add);
    SyncAccumulator sb(*b, so);
    read_checkpoint(*b, sync_mode ? &sb : nullptr, checkpoint_path(dir.path.string(), 0));
    std::vector<float> out(8);
    ASSERT_EQ(b->pull(7, out).status, Errc::ok);
    EXPECT_EQ(out[0], 2.0f);
  }
}

TEST(Checkpoint, EveryCorruptionIsDetected) {
  for (const bool sync_mode : {false, true}) {
    SCOPED_TRACE(sync_mode ? "with pending sync steps" : "without sync steps");
    TempDir dir;
    auto a = make_store(UpdateRule::momentum);
    SyncOptions so;
    so.num_workers = 2;
    SyncAccumulator sync(*a, so);
    for (Key k = 0; k < 4; ++k) {
      std::vector<float> v(8, float(k));
      ASSERT_EQ(a->init(k, v), Errc::ok);
      if (sync_mode) {
        ASSERT_EQ(sync.add(k, k % 2, k, v), SyncOutcome::accumulated);
      }
    }
    write_checkpoint(*a, sync_mode ? &sync : nullptr, dir.path.string(), 0);
    const auto good = slurp(checkpoint_path(dir.path.string(), 0));
    for (std::size_t i = 0; i < good.size(); ++i) {
      auto bad = good;
      bad[i] ^= 0x20;
      EXPECT_THROW(
          parse_checkpoint(reinterpret_cast<const std::uint8_t*>(bad.data()), bad.size(), nullptr, nullptr, "x"), Error)
          << "flipped byte " << i;
    }
    for (std::size_t n = 0; n < good.size(); ++n)
      EXPECT_THROW(parse_checkpoint(reinterpret_cast<const std::uint8_t*>(good.data()), n, nullptr, nullptr, "x"),
                   Error)
          << "truncated to " << n;
    try {
      auto bad = good;
      bad[good.size() / 2] ^= 1;
      parse_checkpoint(reinterpret_cast<const std::uint8_t*>(bad.data()), bad.size(), nullptr, nullptr, "shard-0.ckpt");
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("shard-0.ckpt"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("older checkpoint"), std::string::npos) << e.what();
    }
  }
}

// A checkpoint file is hostile input like any other: another server's shard copied over this
// one's, a file truncated up to a terabyte (it used to be read whole into a vector: bad_alloc,
// which nothing caught, so the server aborted), and a FIFO (it used to hold the start in open())
// each get an Error naming the file, and nothing is loaded.
TEST(Checkpoint, AnotherServersShardAHugeFileAndAFifoAreRefused) {
  TempDir dir;
  auto a = make_store(UpdateRule::sgd);
  std::vector<float> v(4, 1.0f);
  ASSERT_EQ(a->init(1, v), Errc::ok);
  write_checkpoint(*a, nullptr, dir.path.string(), 1);
  const std::string one = checkpoint_path(dir.path.string(), 1), zero = checkpoint_path(dir.path.string(), 0);
  fs::copy_file(one, zero);
  auto b = make_store(UpdateRule::sgd);
  try {
    read_checkpoint(*b, nullptr, zero, 0u);
    ADD_FAILURE() << "server 1's shard was restored into server 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("holds server 1's shard, not server 0's"), std::string::npos) << e.what();
  }
  EXPECT_EQ(b->key_count(), 0u);
  EXPECT_EQ(read_checkpoint(*b, nullptr, one, 1u).keys, 1u);

  fs::resize_file(zero, std::uintmax_t{1} << 40);  // sparse: a terabyte of zeros after the shard
  auto c = make_store(UpdateRule::sgd);
  EXPECT_THROW(read_checkpoint(*c, nullptr, zero, 0u), Error);
  EXPECT_THROW(read_checkpoint(*c, nullptr, zero), Error);

  const std::string fifo = (dir.path / "shard-2.ckpt").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    read_checkpoint(*c, nullptr, fifo);
    ADD_FAILURE() << "a FIFO was read as a checkpoint";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, RuleMismatchAndMissingFileAreClear) {
  TempDir dir;
  auto a = make_store(UpdateRule::adam);
  std::vector<float> v(4, 1.0f);
  ASSERT_EQ(a->init(1, v), Errc::ok);
  write_checkpoint(*a, nullptr, dir.path.string(), 0);
  auto b = make_store(UpdateRule::sgd);
  try {
    read_checkpoint(*b, nullptr, checkpoint_path(dir.path.string(), 0));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--rule"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_checkpoint(*b, nullptr, (dir.path / "nope.ckpt").string()), Error);
}

// Sync mode: gradients summed into steps that still wait for workers were acknowledged, so a
// checkpoint keeps them with each key's next step. A server restored from it goes on exactly as
// one never stopped: the same steps complete with the same means, and a worker that already
// contributed to a pending step is still a duplicate there.
TEST(Checkpoint, PendingSyncStepsComeBackWithTheirKeys) {
  TempDir dir;
  auto a = make_store(UpdateRule::sgd, 0.5f);
  SyncOptions so;
  so.num_workers = 3;
  so.window = 4;
  SyncAccumulator sa(*a, so);
  std::vector<float> g(8);
  auto grad = [&](float x) -> std::span<const float> {
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = x + 0.25f * float(i);
    return g;
  };
  for (Key k : {1, 2, 3}) ASSERT_EQ(a->init(k, std::vector<float>(8, 1.0f)), Errc::ok);
  ASSERT_EQ(sa.add(1, 0, 0, grad(1)), SyncOutcome::accumulated);
  ASSERT_EQ(sa.add(1, 1, 0, grad(2)), SyncOutcome::accumulated);
  ASSERT_EQ(sa.add(1, 0, 1, grad(4)), SyncOutcome::accumulated);
  for (std::uint32_t w = 0; w < 3; ++w) sa.add(2, w, 0, grad(float(w)));
  ASSERT_EQ(sa.add(2, 2, 1, grad(7)), SyncOutcome::accumulated);
  write_checkpoint(*a, &sa, dir.path.string(), 0);

  auto b = make_store(UpdateRule::sgd, 0.5f);
  SyncAccumulator sb(*b, so);
  read_checkpoint(*b, &sb, checkpoint_path(dir.path.string(), 0));
  EXPECT_EQ(sb.next_step(1), 0u);
  EXPECT_EQ(sb.next_step(2), 1u);
  EXPECT_EQ(sb.next_step(3), 0u);
  EXPECT_EQ(sb.add(1, 1, 0, grad(9)), SyncOutcome::duplicate);
  // The same pushes from here on, to the server that went on and to the restored one.
  for (SyncAccumulator* s : {&sa, &sb}) {
    EXPECT_EQ(s->add(1, 2, 0, grad(3)), SyncOutcome::applied);
    EXPECT_EQ(s->add(1, 1, 1, grad(5)), SyncOutcome::accumulated);
    EXPECT_EQ(s->add(1, 2, 1, grad(6)), SyncOutcome::applied);
    EXPECT_EQ(s->add(2, 0, 1, grad(8)), SyncOutcome::accumulated);
    EXPECT_EQ(s->add(2, 1, 1, grad(9)), SyncOutcome::applied);
    EXPECT_EQ(s->add(3, 0, 0, grad(1)), SyncOutcome::accumulated);
  }
  for (Key k : {1, 2, 3}) {
    std::vector<float> va(8), vb(8);
    a->pull(k, va);
    b->pull(k, vb);
    EXPECT_EQ(va, vb) << "key " << k;
    EXPECT_EQ(sa.next_step(k), sb.next_step(k)) << "key " << k;
  }
  std::vector<float> v(8);
  b->pull(1, v);
  // Two steps of lr * K * mean = 0.5 * sum: (1 + 2 + 3) and (4 + 5 + 6), plus 3 x 0.25 i each.
  EXPECT_FLOAT_EQ(v[0], 1.0f - 0.5f * 6.0f - 0.5f * 15.0f);
  EXPECT_EQ(sb.stats().applied_steps, 3u);
}

// Pending steps are pushes a worker was told succeeded: a server that cannot take them (another
// mode, or other workers or window) refuses the checkpoint by name rather than drop them. Next
// steps alone go anywhere.
TEST(Checkpoint, PendingSyncStepsNeedTheSameWorkers) {
  TempDir dir;
  auto a = make_store(UpdateRule::sgd);
  SyncOptions so;
  so.num_workers = 3;
  SyncAccumulator sa(*a, so);
  const std::vector<float> g(4, 1.0f);
  ASSERT_EQ(a->init(1, g), Errc::ok);
  ASSERT_EQ(a->init(2, g), Errc::ok);
  for (std::uint32_t w = 0; w < 3; ++w) sa.add(1, w, 0, g);
  ASSERT_EQ(sa.next_step(1), 1u);
  write_checkpoint(*a, &sa, dir.path.string(), 0);
  const std::string only_next = (dir.path / "only-next.ckpt").string();
  fs::copy_file(checkpoint_path(dir.path.string(), 0), only_next);
  ASSERT_EQ(sa.add(2, 0, 0, g), SyncOutcome::accumulated);
  write_checkpoint(*a, &sa, dir.path.string(), 0);
  const std::string pending = checkpoint_path(dir.path.string(), 0);

  SyncOptions fewer = so;
  fewer.num_workers = 2;
  for (const SyncOptions* other : std::initializer_list<const SyncOptions*>{&fewer, nullptr}) {
    auto b = make_store(UpdateRule::sgd);
    std::unique_ptr<SyncAccumulator> sb = other ? std::make_unique<SyncAccumulator>(*b, *other) : nullptr;
    try {
      read_checkpoint(*b, sb.get(), pending);
      ADD_FAILURE() << "pending steps dropped";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("key 2"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--workers"), std::string::npos) << e.what();
    }
    auto c = make_store(UpdateRule::sgd);
    std::unique_ptr<SyncAccumulator> sc = other ? std::make_unique<SyncAccumulator>(*c, *other) : nullptr;
    EXPECT_EQ(read_checkpoint(*c, sc.get(), only_next).keys, 2u);
    if (sc) {
      EXPECT_EQ(sc->next_step(1), 1u);
    }
  }
}

// A version 2 file of one key (rule sgd, no optimizer state) whose sync steps are `steps`, with
// every checksum right: what the reader makes of a file only a bug or an attacker writes.
// Checkpoint bytes written by hand, checksums included.
struct FileBytes {
  std::vector<std::uint8_t> bytes;
  template <class T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof v);
  }
  std::uint32_t crc_from(std::size_t at) const { return crc32_update(0, bytes.data() + at, bytes.size() - at); }
  // Magic, version, server 0, `rule`, one key, started at 42.
  void header(std::uint32_t version, UpdateRule rule) {
    bytes.insert(bytes.end(), {'P', 'S', 'K', 'V', 'C', 'K', 'P', '1'});
    put(version);
    put(std::uint32_t{0});
    put(static_cast<std::uint32_t>(rule));
    put(std::uint64_t{1});
    put(std::uint64_t{42});
  }
  // The footer of a file whose one key's crc is `key_crc`.
  void footer(std::uint32_t key_crc) {
    bytes.insert(bytes.end(), {'P', 'S', 'K', 'V', 'E', 'N', 'D', '1'});
    put(std::uint64_t{1});
    put(crc32_update(0, &key_crc, sizeof key_crc));
  }
};

// A version 2 file of one key (rule sgd, no optimizer state) whose sync steps are `steps`, with
// every checksum right: what the reader makes of a file only a bug or an attacker writes.
std::vector<std::uint8_t> sync_file(std::uint32_t workers, std::uint32_t required, std::uint32_t window,
                                    const std::vector<float>& value, const std::vector<float>& steps) {
  FileBytes f;
  f.header(2, UpdateRule::sgd);
  f.put(workers);
  f.put(required);
  f.put(window);
  f.put(f.crc_from(0));
  const std::size_t key_at = f.bytes.size();
  f.put(Key{9});
  f.put(static_cast<std::uint32_t>(value.size()));
  f.put(std::uint32_t{0});  // state floats
  f.put(std::uint64_t{0});  // update count
  f.put(static_cast<std::uint32_t>(steps.size()));
  std::uint32_t crc = f.crc_from(key_at);
  crc = crc32_update(crc, value.data(), value.size() * sizeof(float));
  crc = crc32_update(crc, steps.data(), steps.size() * sizeof(float));
  f.put(crc);
  for (float x : value) f.put(x);
  for (float x : steps) f.put(x);
  f.footer(crc);
  return f.bytes;
}

// Sync steps as export_state lays them out: a next step, then entries of step, contributor count,
// bitmap (one word up to 64 workers) and sum.
struct Steps {
  std::vector<float> floats;
  void word(std::uint64_t w) {
    float f[2];
    std::memcpy(f, &w, sizeof w);
    floats.insert(floats.end(), f, f + 2);
  }
  Steps& next(std::uint64_t n) {
    word(n);
    return *this;
  }
  Steps& entry(std::uint64_t step, std::uint64_t count, std::uint64_t bitmap, std::vector<float> sum) {
    word(step);
    word(count);
    word(bitmap);
    floats.insert(floats.end(), sum.begin(), sum.end());
    return *this;
  }
};

TEST(Checkpoint, SyncStepsThatDoNotCheckOutAreRefusedByName) {
  const std::vector<float> value{1.0f, 2.0f};
  const std::vector<float> sum{4.0f, 4.0f};
  struct Case {
    const char* what;
    std::vector<std::uint8_t> file;
    const char* says;
    bool validate_only_finds_it;
  };
  const std::vector<Case> cases = {
      {"one float", sync_file(2, 2, 4, value, {0.0f}), "not a next step and whole entries", true},
      {"an entry cut short",
       sync_file(2, 2, 4, value,
                 [&] {
                   auto f = Steps().next(3).entry(3, 1, 1, sum).floats;
                   f.pop_back();
                   return f;
                 }()),
       "not a next step and whole entries", true},
      {"more entries than the window",
       sync_file(2, 2, 1, value, Steps().next(3).entry(3, 1, 1, sum).entry(4, 1, 1, sum).floats),
       "not a next step and whole entries", true},
      {"steps outside sync mode", sync_file(0, 0, 0, value, Steps().next(3).floats),
       "not a next step and whole entries", true},
      {"a window outside sync mode", sync_file(0, 0, 4, value, {}), "sync mode with 0 workers", true},
      {"a window past 15", sync_file(2, 2, 16, value, Steps().next(3).floats), "a window of 16", true},
      {"K past N", sync_file(2, 3, 4, value, Steps().next(3).floats), "K=3", true},
      {"a count the bitmap does not make", sync_file(2, 2, 4, value, Steps().next(3).entry(4, 2, 1, sum).floats),
       "counts 2 contributors of 1", false},
      {"a step behind the next", sync_file(2, 2, 4, value, Steps().next(3).entry(2, 1, 1, sum).floats),
       "outside the window", false},
      {"a contributor past the workers", sync_file(2, 2, 4, value, Steps().next(3).entry(3, 1, 4, sum).floats),
       "a contributor past worker 1", false},
      {"an unused entry first", sync_file(2, 2, 4, value, Steps().next(3).entry(0, 0, 0, sum).floats),
       "not as a checkpoint writes them", false},
      {"step 0 written out", sync_file(2, 2, 4, value, Steps().next(0).floats), "not as a checkpoint writes them",
       false},
  };
  for (const Case& c : cases) {
    if (c.validate_only_finds_it) {
      EXPECT_THROW(parse_checkpoint(c.file.data(), c.file.size(), nullptr, nullptr, "x"), Error) << c.what;
    }
    auto store = make_store(UpdateRule::sgd);
    SyncOptions so;
    so.num_workers = 2;
    SyncAccumulator sync(*store, so);
    try {
      parse_checkpoint(c.file.data(), c.file.size(), store.get(), &sync, "shard-0.ckpt");
      ADD_FAILURE() << c.what << ": taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::protocol) << c.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(c.says), std::string::npos) << c.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("shard-0.ckpt"), std::string::npos) << e.what();
    }
  }
}

// A step whose contributors are all in but whose apply failed (an shm server's store lock held
// past its patience) waits for the next push, and a checkpoint can find it so: restored, it is
// applied before anyone is served rather than refused.
TEST(Checkpoint, AStepLeftCompleteIsAppliedOnRestore) {
  const auto file = sync_file(2, 2, 4, {1.0f, 2.0f}, Steps().next(3).entry(3, 2, 3, {4.0f, 8.0f}).floats);
  auto store = make_store(UpdateRule::sgd, 0.5f);
  SyncOptions so;
  so.num_workers = 2;
  SyncAccumulator sync(*store, so);
  parse_checkpoint(file.data(), file.size(), store.get(), &sync, "x");
  EXPECT_EQ(sync.next_step(9), 4u);
  std::vector<float> v(2);
  store->pull(9, v);
  EXPECT_EQ(v, (std::vector<float>{1.0f - 2.0f, 2.0f - 4.0f}));  // lr x K x mean = 0.5 x sum
}

// Each key's value and its steps are checkpointed as of one moment while workers push: with sgd
// at lr 1 and every gradient 1, a key whose next step is n holds exactly -2n (2 workers, K=N),
// in every checkpoint taken under the pushes.
TEST(Checkpoint, AKeysValueAndStepsAreOfOneMomentUnderPushes) {
  TempDir dir;
  auto a = make_store(UpdateRule::sgd, 1.0f);
  SyncOptions so;
  so.num_workers = 2;
  SyncAccumulator sa(*a, so);
  constexpr Key kKeys = 4;
  for (Key k = 0; k < kKeys; ++k) ASSERT_EQ(a->init(k, std::vector<float>(16, 0.0f)), Errc::ok);
  std::atomic<bool> stop{false};
  std::vector<std::thread> workers;
  struct JoinAtExit {  // an assertion that fails returns early: the pushers stop first
    std::atomic<bool>& stop;
    std::vector<std::thread>& threads;
    ~JoinAtExit() {
      stop = true;
      for (auto& t : threads) t.join();
    }
  } join_at_exit{stop, workers};
  for (std::uint32_t w = 0; w < 2; ++w)
    workers.emplace_back([&, w] {
      const std::vector<float> one(16, 1.0f);
      for (std::uint64_t step = 0; !stop.load(); ++step)
        for (Key k = 0; k < kKeys && !stop.load(); ++k)
          while (sa.add(k, w, step, one) == SyncOutcome::too_far_ahead && !stop.load()) std::this_thread::yield();
    });
  std::uint64_t checked = 0, pending = 0;
  for (int round = 0; round < 200; ++round) {
    write_checkpoint(*a, &sa, dir.path.string(), 0);
    auto b = make_store(UpdateRule::sgd, 1.0f);
    SyncAccumulator sb(*b, so);
    read_checkpoint(*b, &sb, checkpoint_path(dir.path.string(), 0));
    for (Key k = 0; k < kKeys; ++k) {
      std::vector<float> v(16);
      b->pull(k, v);
      const std::uint64_t next = sb.next_step(k);
      ASSERT_EQ(v[0], -2.0f * static_cast<float>(next)) << "round " << round << ", key " << k;
      checked += next;
      // A worker ahead of the other has summed into the next step: it is there too.
      pending += sb.add(k, 0, next, std::vector<float>(16, 1.0f)) == SyncOutcome::duplicate ||
                 sb.add(k, 1, next, std::vector<float>(16, 1.0f)) == SyncOutcome::duplicate;
    }
  }
  EXPECT_GT(checked, 0u) << "no step was applied while the checkpoints were taken";
  EXPECT_GT(pending, 0u) << "no checkpoint found a step pending";
}

// A checkpoint written before pending steps were kept (version 1) is still read: its keys start
// at step 0.
TEST(Checkpoint, AVersionOneFileIsStillRead) {
  FileBytes f;
  f.header(1, UpdateRule::momentum);
  f.put(f.crc_from(0));
  const std::size_t key_at = f.bytes.size();
  f.put(Key{5});
  f.put(std::uint32_t{2});  // length
  f.put(std::uint32_t{2});  // state floats
  f.put(std::uint64_t{3});  // update count
  std::uint32_t crc = f.crc_from(key_at);
  const float floats[4] = {1.5f, -2.0f, 0.25f, 0.5f};
  crc = crc32_update(crc, floats, sizeof floats);
  f.put(crc);
  for (float x : floats) f.put(x);
  f.footer(crc);
  const std::vector<std::uint8_t>& file = f.bytes;

  auto b = make_store(UpdateRule::momentum);
  SyncOptions so;
  so.num_workers = 2;
  SyncAccumulator sync(*b, so);
  const CheckpointInfo r = parse_checkpoint(file.data(), file.size(), b.get(), &sync, "v1");
  EXPECT_EQ(r.keys, 1u);
  EXPECT_EQ(r.started_unix_ns, 42u);
  std::vector<float> v(2);
  b->pull(5, v);
  EXPECT_EQ(v, (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(b->find(5)->update_count, 3u);
  EXPECT_EQ(sync.next_step(5), 0u);
}

}  // namespace
}  // namespace pskv
