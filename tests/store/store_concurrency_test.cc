// The two invariants of the store under contention, also run under the thread sanitizer:
// nothing is lost (exact sums) and nothing is torn (every read is one writer's whole vector).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "store/store.h"

namespace pskv {
namespace {

std::unique_ptr<Store> make_store(std::uint32_t stripes) {
  StoreOptions o;
  o.stripes = stripes;
  return Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
}

TEST(StoreConcurrency, OverlappingAddsAreExact) {
  for (std::uint32_t stripes : {1u, 8u, 1024u}) {
    auto s = make_store(stripes);
    constexpr int kThreads = 8, kPushes = 2000, kKeys = 5;
    constexpr std::uint32_t kLen = 33;
    for (Key k = 0; k < kKeys; ++k) ASSERT_EQ(s->init_zero(k, kLen), Errc::ok);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        std::vector<float> one(kLen, 1.0f);
        for (int i = 0; i < kPushes; ++i) ASSERT_EQ(s->push(Key((i + t) % kKeys), one), Errc::ok);
      });
    for (auto& th : threads) th.join();
    float total = 0;
    std::vector<float> out(kLen);
    for (Key k = 0; k < kKeys; ++k) {
      ASSERT_EQ(s->pull(k, out).status, Errc::ok);
      for (float x : out) ASSERT_EQ(x, out[0]);
      total += out[0];
    }
    EXPECT_EQ(total, float(kThreads * kPushes)) << "stripes=" << stripes;
  }
}

TEST(StoreConcurrency, ReadsAreNeverTorn) {
  auto s = make_store(4);
  constexpr std::uint32_t kLen = 4096;  // spans many cache lines
  constexpr int kReadsPerReader = 4000;
  ASSERT_EQ(s->init_zero(1, kLen), Errc::ok);
  ASSERT_EQ(s->init_zero(2, kLen), Errc::ok);
  // Writers run from before the first read until after the last one, so every read races them.
  std::atomic<int> writers_started{0}, readers_done{0};
  std::atomic<std::uint64_t> torn{0}, writes{0}, versions_seen{0};
  UpdateRuleConfig assign;
  assign.rule = UpdateRule::assign;
  std::vector<std::thread> writers, readers;
  for (int w = 0; w < 2; ++w)
    writers.emplace_back([&, w] {
      std::vector<float> v(kLen);
      writers_started.fetch_add(1);
      for (int i = 1; readers_done.load() < 2; ++i) {
        std::fill(v.begin(), v.end(), float(i * 2 + w));
        ASSERT_EQ(s->apply(1 + (i % 2), v, assign), Errc::ok);
        writes.fetch_add(1, std::memory_order_relaxed);
      }
    });
  for (int r = 0; r < 2; ++r)
    readers.emplace_back([&] {
      // Counted however the reader ends: a failed assertion returns early, and writers that
      // waited for a count that never comes would spin until ctest's timeout.
      struct Done {
        std::atomic<int>& n;
        ~Done() { n.fetch_add(1); }
      } done{readers_done};
      while (writers_started.load() < 2) std::this_thread::yield();
      std::vector<float> out(kLen);
      std::uint64_t last = 0;
      for (int i = 0; i < kReadsPerReader; ++i) {
        const ReadResult res = s->pull(Key(1 + i % 2), out);
        ASSERT_EQ(res.status, Errc::ok);
        if (res.version != last) versions_seen.fetch_add(1, std::memory_order_relaxed);
        last = res.version;
        for (float x : out)
          if (x != out[0]) {
            torn.fetch_add(1);
            break;
          }
      }
    });
  for (auto& t : readers) t.join();
  for (auto& t : writers) t.join();
  EXPECT_EQ(torn.load(), 0u);
  EXPECT_GT(writes.load(), 0u);
  EXPECT_GT(versions_seen.load(), 1u) << "readers must have observed writes in progress";
}

// Two writers apply whole pushes in pieces (as the TCP server does with a large push) without
// pause, so optimistic copies of the value keep being spoiled; a server reader still gets its
// reads (after three spoiled copies it copies under the stripe lock), and every piece it reads
// is whole: within a piece all floats are equal. Nothing is lost either.
TEST(StoreConcurrency, ReaderOfAValueChangingPieceByPieceGetsWholePieces) {
  auto s = make_store(64);
  constexpr std::size_t kPiece = 4096, kPieces = 8, kLen = kPiece * kPieces;
  constexpr int kWriters = 2, kPushes = 300;
  ASSERT_EQ(s->init_zero(Key(3), kLen), Errc::ok);
  const SlotRef slot = s->find_ref(Key(3));
  std::atomic<int> writing{kWriters};
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w)
    writers.emplace_back([&] {
      std::vector<float> one(kPiece, 1.0f);
      for (int i = 0; i < kPushes; ++i) {
        std::uint64_t step = 0;
        for (std::size_t p = 0; p < kPieces; ++p) s->apply_part(slot, p * kPiece, one.data(), kPiece, &step);
      }
      writing.fetch_sub(1);
    });
  // Joined however the test ends: a failed assertion below returns with the writers running.
  struct Join {
    std::vector<std::thread>& threads;
    ~Join() {
      for (auto& t : threads)
        if (t.joinable()) t.join();
    }
  } join{writers};
  std::vector<float> out(kLen);
  int reads = 0;
  while (writing.load() > 0 || reads < 10) {
    ASSERT_EQ(s->read_slot_or_lock(slot, out.data()).status, Errc::ok);
    ++reads;
    for (std::size_t p = 0; p < kPieces; ++p)
      for (std::size_t i = 1; i < kPiece; ++i)
        ASSERT_EQ(out[p * kPiece + i], out[p * kPiece]) << "piece " << p << " torn at float " << i;
  }
  for (auto& t : writers) t.join();
  ASSERT_EQ(s->read_slot_or_lock(slot, out.data()).status, Errc::ok);
  for (float x : out) ASSERT_EQ(x, float(kWriters * kPushes));
  EXPECT_EQ(slot.slot->update_count, std::uint64_t(kWriters * kPushes));
}

TEST(StoreConcurrency, ConcurrentCreationOfTheSameKeys) {
  auto s = make_store(16);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (Key k = 0; k < 500; ++k) ASSERT_EQ(s->init_zero(k, 8), Errc::ok);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(s->key_count(), 500u);
  for (Key k = 0; k < 500; ++k) ASSERT_NE(s->find(k), nullptr);
}

}  // namespace
}  // namespace pskv
