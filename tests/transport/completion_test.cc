#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "transport/transport.h"

namespace pskv::transport {
namespace {

constexpr int kMax = Completion::kMaxSpinMicros;
constexpr int kContended = Completion::kContendedSpinMicros;

TEST(SpinBudget, AFirstWaitSpinsUpToTheLimit) {
  EXPECT_EQ(Completion::spin_budget_micros(-1, kMax), kMax);
  EXPECT_EQ(Completion::spin_budget_micros(-1, kContended), kContended);
}

TEST(SpinBudget, ShortWaitsSpinTwiceTheirAverage) {
  EXPECT_EQ(Completion::spin_budget_micros(5, kMax), 15);
  EXPECT_EQ(Completion::spin_budget_micros(5, kContended), 15);
  EXPECT_EQ(Completion::spin_budget_micros(20, kContended), kContended);  // capped
}

// The case the contended limit is for: waits of ~50-100 us (a batch of table rows) spin on a
// machine with a core to spare and sleep at once when the server's threads hold every core.
TEST(SpinBudget, WaitsLongerThanTheLimitDoNotSpin) {
  EXPECT_EQ(Completion::spin_budget_micros(60, kMax), kMax);
  EXPECT_EQ(Completion::spin_budget_micros(60, kContended), 0);
  EXPECT_EQ(Completion::spin_budget_micros(kMax + 1, kMax), 0);
}

TEST(SpinBudget, APollerCannotRaiseTheLimit) {
  EXPECT_EQ(Completion::spin_budget_micros(-1, 10 * kMax), kMax);
  EXPECT_EQ(Completion::spin_budget_micros(kMax + 1, 10 * kMax), 0);
}

// A poller that answers whoever polls it, once told to: the answer is there at once for a
// spinner, and only after `kLate` for a thread that sleeps.
class AnsweringPoller final : public Poller {
 public:
  static constexpr auto kLate = std::chrono::microseconds(300);
  void poll() noexcept override {
    if (answer_on_poll && answer()) ++answered_by_poll;
  }
  int max_spin_micros() const noexcept override { return Completion::kContendedSpinMicros; }
  // One wait for one answer: polled, or given late by another thread.
  void wait_once() {
    taken.store(false);
    c.reset(1);
    std::thread late([this] {
      std::this_thread::sleep_for(kLate);
      answer();
    });
    c.wait(std::chrono::steady_clock::now() + std::chrono::seconds(10), this);
    late.join();
  }
  bool answer_on_poll = false;
  int answered_by_poll = 0;

 private:
  bool answer() {
    if (taken.exchange(true)) return false;
    c.complete_part(Errc::ok);
    return true;
  }
  Completion c;
  std::atomic<bool> taken{false};
};

// Waits that were long leave a thread's average past the limit, and then it sleeps at every wait;
// a slept wait counts its wake-up too, so without a look now and then the average could stay
// there after the answers became immediate. One wait in 16 spins briefly and finds out.
TEST(SpinBudget, AThreadWhoseWaitsWereLongSpinsAgainOnceAnswersComeAtOnce) {
  std::thread([] {
    AnsweringPoller p;
    for (int i = 0; i < 24; ++i) p.wait_once();  // answered late: the average passes 25 us
    EXPECT_EQ(p.answered_by_poll, 0);
    p.answer_on_poll = true;
    for (int i = 0; i < 48; ++i) p.wait_once();
    // The first look comes within 16 waits; every wait after it spins and is answered at once.
    EXPECT_GE(p.answered_by_poll, 32);
  }).join();
}

}  // namespace
}  // namespace pskv::transport
