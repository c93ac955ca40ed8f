// Sync mode's pending steps of an shm server started to be adopted live in a file of /dev/shm
// (transport/shm/sync_file.h): whatever instant the process dies at, a successor finds every
// key's steps as some whole accumulation left them, never a sum that disagrees with the
// contributors it names.
#include "transport/shm/sync_file.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include "common/memory.h"
#include "support/shm_files.h"

namespace pskv::shm {
namespace {

namespace fs = std::filesystem;

struct Dir : testing::ScratchTablesDirectory {
  explicit Dir(const std::string& tag) : ScratchTablesDirectory("sync-file-" + tag) {}
};

StoreOptions small_store(std::uint64_t keys, std::uint32_t length) {
  StoreOptions o;
  o.max_keys = keys * 2;
  o.arena_bytes = keys * (64 + std::uint64_t{length} * 4) + 4096;
  o.rule.rule = UpdateRule::add;
  return o;
}

std::unique_ptr<Store> store_with_keys(const StoreOptions& o, std::uint64_t keys, std::uint32_t length) {
  auto store = Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
  for (Key k = 0; k < keys; ++k)
    if (store->init_zero(k, length) != Errc::ok) throw Error(Errc::capacity, "test store too small");
  return store;
}

// Four workers add 1, 2, 4 and 8 (each worker its own power of two, so a sum names its
// contributors) to steps of three keys of 64 K floats in a forked child, which is SIGKILLed at a
// random instant. Each key's steps, read back from the file by a successor's accumulator, must be
// a state some accumulation left: every float of a pending step's sum is the sum of exactly the
// contributors its bitmap names.
TEST(SyncStateFile, AKillLeavesEveryPendingStepWhole) {
  constexpr std::uint32_t kWorkers = 4, kLen = 64 * 1024;
  constexpr std::uint64_t kKeys = 3;
  const SyncOptions so{.num_workers = kWorkers};
  const StoreOptions o = small_store(kKeys, kLen);
  std::mt19937 rng(7);
  std::uint64_t pending = 0;  // steps left part summed: what the trials check
  for (int trial = 0; trial < 12; ++trial) {
    Dir dir("kill");
    const pid_t pid = fork();
    if (pid == 0) {
      auto store = store_with_keys(o, kKeys, kLen);
      SyncAccumulator acc(*store, so, SyncStateFile::create(dir.path, o, so, 1));
      std::vector<std::vector<float>> grads;
      for (std::uint32_t w = 0; w < kWorkers; ++w) grads.emplace_back(kLen, static_cast<float>(1u << w));
      std::mt19937 order(trial);
      std::vector<std::uint32_t> workers{0, 1, 2, 3};
      for (std::uint64_t step = 0;; ++step) {
        std::shuffle(workers.begin(), workers.end(), order);
        for (std::uint32_t w : workers)
          for (Key k = 0; k < kKeys; ++k) acc.add(k, w, step, grads[w]);
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20 + rng() % 60));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child stopped by itself";

    auto left = SyncStateFile::open_left(dir.path);
    ASSERT_NE(left, nullptr);
    EXPECT_EQ(left->workers(), kWorkers);
    auto store = store_with_keys(o, kKeys, kLen);
    SyncAccumulator successor(*store, so);
    std::uint64_t records = 0;
    std::string stopped;
    left->visit(
        [&](Key key, std::uint32_t length, const std::uint64_t* block, std::uint64_t words) {
          ++records;
          std::string why;
          ASSERT_EQ(successor.adopt_block(key, length, block, words, &why), Errc::ok) << why;
          std::vector<float> state(successor.state_floats(kLen));
          successor.with_key(key, [&] { successor.export_state(key, kLen, state.data()); });
          // [next | window x (step | count | bitmap | sum)], each word as 2 floats
          const float* e = state.data() + 2;
          for (std::uint32_t i = 0; i < so.window; ++i, e += 6 + kLen) {
            std::uint64_t count, bitmap;
            std::memcpy(&count, e + 2, 8);
            std::memcpy(&bitmap, e + 4, 8);
            if (count == 0) continue;
            ++pending;
            const float want = static_cast<float>(bitmap);  // worker w added 2^w
            for (std::uint32_t f = 0; f < kLen; ++f)
              if (e[6 + f] != want)
                FAIL() << "key " << key << ": a pending step's float " << f << " is " << e[6 + f]
                       << ", its contributors (bitmap " << bitmap << ") add up to " << want;
          }
        },
        &stopped);
    EXPECT_TRUE(stopped.empty()) << stopped;
    EXPECT_EQ(records, kKeys);
  }
  // Three of every four accumulations leave a step pending: a run that found none checked nothing.
  EXPECT_GT(pending, 0u);
}

// What a successor reads is checked: a file that is not one, a header that does not fit, and a
// record cut short are refused by name; the mark of an apply tells whether it had counted as done.
TEST(SyncStateFile, WhatDoesNotCheckOutIsRefusedByName) {
  const SyncOptions so{.num_workers = 2};
  const StoreOptions o = small_store(2, 8);
  Dir dir("bad");
  EXPECT_EQ(SyncStateFile::open_left(dir.path), nullptr) << "no file: nothing to adopt";
  auto store = store_with_keys(o, 2, 8);
  {
    auto file = SyncStateFile::create(dir.path, o, so, 2);
    SyncAccumulator acc(*store, so, file);
    std::vector<float> g(8, 1.0f);
    ASSERT_EQ(acc.add(0, 0, 0, g), SyncOutcome::accumulated);
    ASSERT_EQ(acc.add(1, 1, 0, g), SyncOutcome::accumulated);
    // Server thread 1 was applying key 1's step 0 when it died, after its control word moved.
    SyncApplyMark* mark = file->mark(1);
    ASSERT_NE(mark, nullptr);
    EXPECT_EQ(file->mark(2), nullptr);
    mark->key = 1;
    mark->control = 0;
    mark->active.store(1);
    auto left = SyncStateFile::open_left(dir.path);
    EXPECT_EQ(left->applied_marks(), 0u) << "key 1's control word is not at the mark";
    std::uint64_t control = 0;
    left->visit(
        [&](Key key, std::uint32_t, const std::uint64_t* block, std::uint64_t) {
          if (key == 1) control = SyncAccumulator::control_of(block);
        },
        nullptr);
    mark->control = control;
    EXPECT_EQ(left->applied_marks(), 0b10u) << "thread 1's apply was whole, thread 0 was inside nothing";
    mark->active.store(0);
    EXPECT_EQ(left->applied_marks(), 0u) << "an inactive mark";
  }
  const std::string path = dir.path + "/sync";
  auto poke = [&](std::size_t at, const void* bytes, std::size_t n) {
    FILE* f = std::fopen(path.c_str(), "r+b");
    ASSERT_NE(f, nullptr);
    std::fseek(f, static_cast<long>(at), SEEK_SET);
    std::fwrite(bytes, 1, n, f);
    std::fclose(f);
  };
  const auto original = fs::file_size(path);
  // A record whose word count runs past what the file holds: the visit stops there.
  const std::uint64_t huge = 1ull << 40;
  poke(4096 + 16, &huge, 8);
  {
    auto left = SyncStateFile::open_left(dir.path);
    std::string stopped;
    int seen = 0;
    left->visit([&](Key, std::uint32_t, const std::uint64_t*, std::uint64_t) { ++seen; }, &stopped);
    EXPECT_EQ(seen, 0);
    EXPECT_NE(stopped.find("cut short"), std::string::npos) << stopped;
    EXPECT_NE(stopped.find(path), std::string::npos) << stopped;
  }
  // Capacity past the file's size.
  const std::uint64_t capacity = original;
  poke(24, &capacity, 8);
  try {
    SyncStateFile::open_left(dir.path);
    ADD_FAILURE() << "a header that does not fit was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::stale_resource);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  poke(0, "NOTASYNC", 8);
  try {
    SyncStateFile::open_left(dir.path);
    ADD_FAILURE() << "a file without the magic was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a pskv sync-step file"), std::string::npos) << e.what();
  }
}

// Room is reserved as keys are pushed, never past what the file was made for.
TEST(SyncStateFile, AFullFileRefusesTheNextKeysSteps) {
  const SyncOptions so{.num_workers = 1};
  StoreOptions o = small_store(2, 8);
  Dir dir("full");
  auto store = store_with_keys(o, 2, 8);
  o.max_keys = 1;  // the file is sized for one key's steps
  o.arena_bytes = 64;
  SyncAccumulator acc(*store, {.num_workers = 1, .required = 1, .window = 4},
                      SyncStateFile::create(dir.path, o, so, 1));
  std::vector<float> g(8, 1.0f);
  EXPECT_EQ(acc.add(0, 0, 0, g), SyncOutcome::applied);
  EXPECT_EQ(acc.prepare(1, 8, 0), Errc::capacity) << "what a push checks before it sums any key";
  Errc e = Errc::ok;
  EXPECT_EQ(acc.add(1, 0, 0, g, &e), SyncOutcome::rejected);
  EXPECT_EQ(e, Errc::capacity);
  EXPECT_EQ(acc.add(0, 0, 1, g), SyncOutcome::applied) << "the first key's steps go on";
}

// The file lives in /dev/shm, writable by every process of the job's user. Its thread count,
// capacity and fill were read again at every use, so one rewritten after it was opened sent the
// successor's mark scan past its header and could put the owner's next record past the file's
// room or over a record. Both go by what was checked when the file was made or opened.
TEST(SyncStateFile, WordsRewrittenAfterOpeningMoveNothing) {
  const SyncOptions so{.num_workers = 2};
  const StoreOptions o = small_store(4, 8);
  Dir dir("rewritten");
  auto made = SyncStateFile::create(dir.path, o, so, 2);
  ASSERT_NE(made->allocate(1, 8, 16), nullptr);
  auto left = SyncStateFile::open_left(dir.path);
  ASSERT_NE(left, nullptr);
  {
    auto file = MappedFile::open(dir.path + "/sync");
    std::byte* h = file->data();
    const std::uint32_t threads = 0xffffffffu;
    const std::uint64_t capacity = ~0ull >> 1, used = ~0ull >> 2;
    std::memcpy(h + 20, &threads, sizeof threads);  // after magic, version, window, workers
    std::memcpy(h + 24, &capacity, sizeof capacity);
    std::memcpy(h + 32, &used, sizeof used);
  }
  EXPECT_EQ(left->threads(), 2u);
  EXPECT_EQ(left->mark(2), nullptr);
  EXPECT_EQ(left->applied_marks(), 0u);
  // The owner places its next record by its own count, right after the first, and its mirror
  // in the file puts the rewritten fill right again.
  std::uint64_t* second = made->allocate(2, 8, 16);
  ASSERT_NE(second, nullptr);
  std::vector<Key> keys;
  left->visit([&](Key key, std::uint32_t, const std::uint64_t*, std::uint64_t) { keys.push_back(key); }, nullptr);
  EXPECT_EQ(keys, (std::vector<Key>{1, 2}));
}

// A key's steps take the memory of the entries they used, not of the whole window: workers in
// lockstep move a step's sum between two entries, and the other three stay holes of the file.
TEST(SyncStateFile, LockstepStepsBackTwoEntriesOfFive) {
  constexpr std::uint32_t kLen = 256 * 1024;  // 1 MiB per entry
  const SyncOptions so{.num_workers = 2};
  const StoreOptions o = small_store(1, kLen);
  Dir dir("sparse");
  auto store = store_with_keys(o, 1, kLen);
  auto file = SyncStateFile::create(dir.path, o, so, 1);
  SyncAccumulator acc(*store, so, file);
  std::vector<float> g(kLen, 1.0f);
  for (std::uint64_t step = 0; step < 20; ++step) {
    ASSERT_EQ(acc.prepare(0, kLen, step), Errc::ok);
    ASSERT_EQ(acc.add(0, 0, step, g), SyncOutcome::accumulated);
    ASSERT_EQ(acc.add(0, 1, step, g), SyncOutcome::applied);
  }
  struct stat st {};
  ASSERT_EQ(::stat(file->path().c_str(), &st), 0);
  const auto backed = static_cast<std::uint64_t>(st.st_blocks) * 512;
  EXPECT_LT(backed, 3ull * kLen * 4) << "the file backs " << backed << " bytes for two entries of " << kLen * 4;
  EXPECT_GE(backed, 2ull * kLen * 4);
  EXPECT_GT(static_cast<std::uint64_t>(st.st_size), 5ull * kLen * 4) << "sized for the whole window";
}

}  // namespace
}  // namespace pskv::shm
