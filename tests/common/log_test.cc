#include "common/log.h"
#include <chrono>
#include <thread>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace pskv {
namespace {

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    log::set_level(log::Level::info);
    log::set_sink([this](std::string_view line) { lines.emplace_back(line); });
  }
  void TearDown() override { log::set_sink(nullptr); }
  std::vector<std::string> lines;
};

TEST_F(LogTest, LineNamesLevelCategoryAndMessage) {
  log::warn("tcp.refused", "peer 127.0.0.1:4000 sent a pull before hello");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find(" warn tcp.refused: peer 127.0.0.1:4000 sent a pull before hello"), std::string::npos)
      << lines[0];
  EXPECT_NE(lines[0].back(), '\n') << "the sink gets lines without their newline";
}

TEST_F(LogTest, LevelsAboveTheSetOneAreDropped) {
  log::set_level(log::Level::warn);
  log::info("x", "not shown");
  log::debug("x", "not shown");
  log::error("x", "shown");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find("shown"), std::string::npos);
}

TEST_F(LogTest, AFloodIsCutToTheBurstAndTheCountIsReported) {
  // Runs within one wall-clock second or straddles two; either way at most 2 bursts get through.
  const unsigned long long before = log::suppressed();
  for (int i = 0; i < 1000; ++i) log::warn("flood", "line " + std::to_string(i));
  EXPECT_GE(lines.size(), static_cast<std::size_t>(log::kBurst));
  EXPECT_LE(lines.size(), static_cast<std::size_t>(2 * log::kBurst));
  EXPECT_EQ(log::suppressed() - before, 1000 - lines.size());
  // Another category is not held back by this one's flood.
  log::warn("other", "still heard");
  EXPECT_NE(lines.back().find("still heard"), std::string::npos);
}

TEST_F(LogTest, TheNextLineAfterAFloodSaysHowManyWereSuppressed) {
  for (int i = 0; i < 100; ++i) log::warn("counted", "x");
  // A later second's first line carries the count. (A flood that straddles a second boundary
  // may be counted in the next window instead: wait for the line that reports it, bounded.)
  const auto start = std::chrono::steady_clock::now();
  const std::size_t before = lines.size();
  bool reported = false;
  while (!reported && std::chrono::steady_clock::now() - start < std::chrono::seconds(3)) {
    log::warn("counted", "after");
    for (std::size_t i = before; i < lines.size() && !reported; ++i)
      reported = lines[i].find("more like this suppressed)") != std::string::npos;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(reported) << "no line reported the suppressed flood";
}

}  // namespace
}  // namespace pskv
