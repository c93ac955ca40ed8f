#include "client/placement.h"

#include <gtest/gtest.h>

#include <map>

namespace pskv {
namespace {

TEST(Placement, SmallKeysStayWholeOnTheirHome) {
  PlacementOptions o{.servers = 4, .chunk_floats = 1000};
  std::vector<Part> parts;
  place(o, 42, 1000, parts);
  ASSERT_EQ(parts.size(), 1u);
  EXPECT_EQ(parts[0].server, home_server(o, 42));
  EXPECT_EQ(parts[0].length, 1000u);
}

TEST(Placement, HashSpreadsKeys) {
  PlacementOptions o{.servers = 4};
  std::map<std::uint32_t, int> count;
  for (Key k = 0; k < 4000; ++k) ++count[home_server(o, k)];
  for (std::uint32_t s = 0; s < 4; ++s) EXPECT_NEAR(count[s], 1000, 150);
}

TEST(Placement, RangePartitionIsContiguous) {
  PlacementOptions o{.servers = 4, .partition = Partition::range, .range_keys = 100};
  EXPECT_EQ(home_server(o, 0), 0u);
  EXPECT_EQ(home_server(o, 24), 0u);
  EXPECT_EQ(home_server(o, 25), 1u);
  EXPECT_EQ(home_server(o, 99), 3u);
  EXPECT_EQ(home_server(o, 12345), 3u) << "keys past the range go to the last server";
}

TEST(Placement, LargeValuesSplitEvenlyOverAllServers) {
  PlacementOptions o{.servers = 4, .chunk_floats = 1 << 18};
  std::vector<Part> parts;
  place(o, 7, 10'000'000, parts);
  ASSERT_EQ(parts.size(), 4u);
  std::uint32_t next = 0;
  std::map<std::uint32_t, std::uint32_t> per_server;
  for (const Part& p : parts) {
    EXPECT_EQ(p.offset, next);
    EXPECT_EQ(p.offset % 16, 0u) << "chunks are cache-line aligned";
    next += p.length;
    per_server[p.server] += p.length;
  }
  EXPECT_EQ(next, 10'000'000u);
  EXPECT_EQ(per_server.size(), 4u) << "every server holds one chunk";
  for (auto [s, n] : per_server) EXPECT_NEAR(double(n), 2.5e6, 16.0);
}

TEST(Placement, TinyValuesAboveThresholdStillTerminate) {
  PlacementOptions o{.servers = 8, .chunk_floats = 2};
  std::vector<Part> parts;
  place(o, 1, 5, parts);
  std::uint32_t total = 0;
  for (const Part& p : parts) total += p.length;
  EXPECT_EQ(total, 5u);
}

}  // namespace
}  // namespace pskv
