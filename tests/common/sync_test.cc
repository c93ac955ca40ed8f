#include "common/sync.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace pskv {
namespace {

TEST(SharedMutex, HolderIsTheOwnerTag) {
  SharedMutex m;
  EXPECT_EQ(m.holder(), 0u);
  m.lock(42);
  EXPECT_EQ(m.holder(), 42u);
  EXPECT_FALSE(m.try_lock(7));
  m.unlock();
  EXPECT_EQ(m.holder(), 0u);
  m.lock();
  EXPECT_EQ(m.holder(), SharedMutex::kAnonymousOwner);
  m.unlock();
}

TEST(SharedMutex, LockForGivesUpOnALockThatStaysHeld) {
  SharedMutex m;
  m.lock(3);
  EXPECT_FALSE(m.lock_for(4, std::chrono::milliseconds(30)));
  EXPECT_EQ(m.holder(), 3u);
  m.unlock();
  EXPECT_TRUE(m.lock_for(4, std::chrono::milliseconds(30)));
  EXPECT_EQ(m.holder(), 4u);
  m.unlock();
}

// A waiter with patience left takes the lock when it is released: it must not give up early.
TEST(SharedMutex, LockForTakesTheLockReleasedWithinItsPatience) {
  SharedMutex m;
  m.lock(3);
  std::atomic<int> outcome{0};  // 1 got it, 2 gave up
  std::thread waiter([&] {
    outcome.store(m.lock_for(4, std::chrono::hours(1)) ? 1 : 2);
    if (outcome.load() == 1) m.unlock();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // most likely asleep by now; either way it must win
  EXPECT_EQ(outcome.load(), 0) << "gave up with an hour of patience left";
  m.unlock();
  waiter.join();
  EXPECT_EQ(outcome.load(), 1);
  EXPECT_EQ(m.holder(), 0u);
}

// A holder that died is released on its behalf; sleeping waiters must be woken by that.
TEST(SharedMutex, ReleaseForWakesTheWaitersOfADeadOwner) {
  SharedMutex m;
  m.lock(9);
  std::atomic<int> got{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i)
    waiters.emplace_back([&, i] {
      m.lock(20 + i);
      got.fetch_add(1);
      m.unlock();
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let them fall asleep
  EXPECT_EQ(got.load(), 0);
  EXPECT_FALSE(m.release_for(10));  // not the holder: nothing happens
  EXPECT_EQ(m.holder(), 9u);
  EXPECT_TRUE(m.release_for(9));
  for (auto& t : waiters) t.join();
  EXPECT_EQ(got.load(), 3);
  EXPECT_EQ(m.holder(), 0u);
}

TEST(SharedMutex, MutualExclusionUnderContention) {
  SharedMutex m;
  std::uint64_t counter = 0;  // plain: the mutex must order every access
  std::vector<std::thread> threads;
  for (std::uint32_t t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) {
        if (i % 3 == 0) {
          while (!m.lock_for(t + 2, std::chrono::microseconds(50))) {
          }
        } else {
          m.lock(t + 2);
        }
        ++counter;
        m.unlock();
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter, 80000u);
  EXPECT_EQ(m.holder(), 0u);
}

}  // namespace
}  // namespace pskv
