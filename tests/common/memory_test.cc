#include "common/memory.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <thread>
#include <vector>

namespace pskv {
namespace {

constexpr std::size_t kHugePage = 2u << 20;
constexpr std::size_t kSegmentLike = (5u << 20) + 8192;  // an embedding table's 16-float segment

bool all_zero(const MemoryResource& m) {
  const std::byte* p = const_cast<MemoryResource&>(m).data();
  return std::all_of(p, p + m.size(), [](std::byte b) { return b == std::byte{0}; });
}

TEST(SliceArena, SlicesArePackedFromAHugePageBoundaryAndZeroFilled) {
  auto arena = SliceArena::make(kSegmentLike, "a test");
  auto a = arena->take();
  auto b = arena->take();
  ASSERT_EQ(a->size(), kSegmentLike);
  // The first slice opens its mapping, which starts on a huge page; the next follows it at the
  // next page, so only the mapping's own tail may miss a huge page.
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a->data()) % kHugePage, 0u);
  EXPECT_EQ(b->data(), a->data() + align_up(kSegmentLike, 4096));
  EXPECT_TRUE(all_zero(*a));
  EXPECT_TRUE(all_zero(*b));
}

TEST(SliceArena, AFullMappingIsFollowedByANewOne) {
  auto arena = SliceArena::make(kSegmentLike, "a test");
  std::vector<std::unique_ptr<MemoryResource>> slices;
  std::set<std::byte*> starts;
  for (int i = 0; i < 20; ++i) {  // 32 MiB mappings hold 6 of these
    slices.push_back(arena->take());
    starts.insert(slices.back()->data());
    std::fill_n(slices.back()->data(), slices.back()->size(), std::byte{0xab});
  }
  EXPECT_EQ(starts.size(), slices.size());
  std::vector<std::byte*> sorted(starts.begin(), starts.end());
  for (std::size_t i = 1; i < sorted.size(); ++i)
    EXPECT_GE(sorted[i] - sorted[i - 1], static_cast<std::ptrdiff_t>(kSegmentLike)) << "slices overlap";
  for (const auto& s : slices) EXPECT_EQ(s->data()[s->size() - 1], std::byte{0xab});
}

TEST(SliceArena, ASliceGivenBackIsTakenAgainZeroed) {
  auto arena = SliceArena::make(kSegmentLike, "a test");
  auto a = arena->take();
  std::byte* where = a->data();
  std::fill_n(a->data(), a->size(), std::byte{0x5a});
  a.reset();
  auto again = arena->take();
  EXPECT_EQ(again->data(), where);
  EXPECT_TRUE(all_zero(*again));
}

TEST(SliceArena, SlicesOutliveTheirArena) {
  auto arena = SliceArena::make(4096 * 3, "a test");
  auto a = arena->take();
  auto b = arena->take();
  arena.reset();
  std::fill_n(a->data(), a->size(), std::byte{1});  // still mapped
  b.reset();                                        // no arena to give it back to
  EXPECT_EQ(a->data()[a->size() - 1], std::byte{1});
}

TEST(SliceArena, ThreadsTakingAtOnceGetDisjointSlices) {
  auto arena = SliceArena::make(64 * 1024, "a test");
  constexpr int kThreads = 4, kEach = 300;  // several mappings of 512 slices, some slices given back
  std::vector<std::vector<std::unique_ptr<MemoryResource>>> kept(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) {
        auto s = arena->take();
        EXPECT_EQ(s->data()[0], std::byte{0});
        s->data()[0] = std::byte{1};
        if (i % 3 == 0) continue;  // given back: another thread may take it, zeroed
        kept[t].push_back(std::move(s));
      }
    });
  for (auto& th : threads) th.join();
  std::set<std::byte*> starts;
  std::size_t n = 0;
  for (const auto& v : kept)
    for (const auto& s : v) {
      starts.insert(s->data());
      ++n;
    }
  EXPECT_EQ(starts.size(), n);
}

}  // namespace
}  // namespace pskv
