#include <gtest/gtest.h>

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

}  // namespace
}  // namespace pskv::transport
