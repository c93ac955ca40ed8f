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
  ASSERT_EQ(s->init_zero(1, kLen), Errc::ok);
  ASSERT_EQ(s->init_zero(2, kLen), Errc::ok);
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> reads{0}, torn{0};
  UpdateRuleConfig assign;
  assign.rule = UpdateRule::assign;
  std::vector<std::thread> writers, readers;
  for (int w = 0; w < 2; ++w)
    writers.emplace_back([&, w] {
      std::vector<float> v(kLen);
      for (int i = 1; i <= 3000; ++i) {
        std::fill(v.begin(), v.end(), float(i * 2 + w));
        ASSERT_EQ(s->apply(1 + (i % 2), v, assign), Errc::ok);
      }
    });
  for (int r = 0; r < 2; ++r)
    readers.emplace_back([&] {
      std::vector<float> out(kLen);
      while (!stop.load(std::memory_order_relaxed)) {
        for (Key k : {Key{1}, Key{2}}) {
          ASSERT_EQ(s->pull(k, out).status, Errc::ok);
          for (float x : out)
            if (x != out[0]) {
              torn.fetch_add(1);
              break;
            }
          reads.fetch_add(1, std::memory_order_relaxed);
        }
      }
    });
  for (auto& t : writers) t.join();
  stop = true;
  for (auto& t : readers) t.join();
  EXPECT_EQ(torn.load(), 0u);
  EXPECT_GT(reads.load(), 0u);
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
