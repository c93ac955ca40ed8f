#include "store/store.h"

#include <gtest/gtest.h>

#include <vector>

namespace pskv {
namespace {

std::unique_ptr<Store> make_store(StoreOptions o = {}) {
  return Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
}

TEST(Store, InitPullRoundTrip) {
  auto s = make_store();
  std::vector<float> v{1, 2, 3, 4, 5};
  ASSERT_EQ(s->init(7, v), Errc::ok);
  std::vector<float> out(5);
  ASSERT_EQ(s->pull(7, out).status, Errc::ok);
  EXPECT_EQ(out, v);
  EXPECT_EQ(s->key_count(), 1u);
}

TEST(Store, UnknownKeyAndWrongLength) {
  auto s = make_store();
  std::vector<float> out(3);
  EXPECT_EQ(s->pull(1, out).status, Errc::not_found);
  EXPECT_EQ(s->push(1, out), Errc::not_found);
  ASSERT_EQ(s->init_zero(1, 4), Errc::ok);
  EXPECT_EQ(s->pull(1, out).status, Errc::length_mismatch);
  EXPECT_EQ(s->push(1, out), Errc::length_mismatch);
  EXPECT_EQ(s->init_zero(1, 3), Errc::length_mismatch);
  EXPECT_EQ(s->init_zero(2, 0), Errc::invalid_argument);
}

TEST(Store, FirstInitialiserWins) {
  auto s = make_store();
  std::vector<float> a{1, 1}, b{2, 2}, out(2);
  ASSERT_EQ(s->init(3, a), Errc::ok);
  ASSERT_EQ(s->init(3, b), Errc::ok);
  s->pull(3, out);
  EXPECT_EQ(out, a);
  EXPECT_EQ(s->key_count(), 1u);
}

TEST(Store, SlotsAreCacheAlignedAndContiguous) {
  auto s = make_store();
  for (Key k = 0; k < 100; ++k) ASSERT_EQ(s->init_zero(k * 7919, 1 + k % 37), Errc::ok);
  std::size_t expected_offset = 0;
  std::size_t n = 0;
  s->for_each_slot([&](const SlotHeader& slot) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(slot.values()) % 64, 0u);
    EXPECT_EQ(reinterpret_cast<const std::byte*>(&slot) - s->value_arena(), static_cast<std::ptrdiff_t>(expected_offset));
    expected_offset += slot_bytes(slot.length);
    ++n;
  });
  EXPECT_EQ(n, 100u);
  EXPECT_EQ(s->value_bytes_used(), expected_offset);
}

TEST(Store, CapacityLimitsAreReported) {
  StoreOptions o;
  o.max_keys = 4;
  o.arena_bytes = 4096;
  auto s = make_store(o);
  for (Key k = 0; k < 4; ++k) ASSERT_EQ(s->init_zero(k, 1), Errc::ok);
  EXPECT_EQ(s->init_zero(99, 1), Errc::capacity);
  StoreOptions small;
  small.arena_bytes = 256;
  auto t = make_store(small);
  EXPECT_EQ(t->init_zero(1, 1000), Errc::capacity);
  EXPECT_EQ(t->key_count(), 0u);
}

TEST(Store, RejectsBadOptions) {
  StoreOptions o;
  o.stripes = 6;
  EXPECT_THROW(Store::required_bytes(o), Error);
  o.stripes = 8;
  o.max_keys = 0;
  EXPECT_THROW(Store::required_bytes(o), Error);
}

TEST(Store, AttachSeesTheSameData) {
  StoreOptions o;
  auto mem = std::make_unique<HeapMemory>(Store::required_bytes(o));
  std::byte* base = mem->data();
  std::size_t size = mem->size();
  auto s = Store::create(std::move(mem), o);
  std::vector<float> v{4, 5, 6};
  ASSERT_EQ(s->init(42, v), Errc::ok);

  // A non-owning view of the same bytes, as a second process mapping the segment would have.
  struct View final : MemoryResource {
    std::byte* p;
    std::size_t n;
    View(std::byte* p, std::size_t n) : p(p), n(n) {}
    std::byte* data() noexcept override { return p; }
    std::size_t size() const noexcept override { return n; }
  };
  auto view = Store::attach(std::make_unique<View>(base, size));
  std::vector<float> out(3);
  ASSERT_EQ(view->pull(42, out).status, Errc::ok);
  EXPECT_EQ(out, v);
  std::vector<float> bad(64, 0.0f);
  EXPECT_THROW(Store::attach(std::make_unique<View>(reinterpret_cast<std::byte*>(bad.data()), 256)), Error);
}

TEST(Store, BatchOperations) {
  auto s = make_store();
  std::vector<Key> keys{1, 2, 3};
  for (Key k : keys) ASSERT_EQ(s->init_zero(k, 4), Errc::ok);
  std::vector<float> g1(4, 1.0f), g2(4, 2.0f), g3(4, 3.0f);
  std::vector<std::span<const float>> grads{g1, g2, g3};
  ASSERT_EQ(s->push_batch(keys, grads), Errc::ok);
  std::vector<float> o1(4), o2(4), o3(4);
  std::vector<std::span<float>> outs{o1, o2, o3};
  ASSERT_EQ(s->pull_batch(keys, outs), Errc::ok);
  EXPECT_EQ(o3, g3);
  std::vector<Key> with_unknown{1, 99, 3};
  std::size_t failed = 0;
  EXPECT_EQ(s->pull_batch(with_unknown, outs, &failed), Errc::not_found);
  EXPECT_EQ(failed, 1u);
}

TEST(Store, VersionAdvancesByTwoPerUpdate) {
  auto s = make_store();
  ASSERT_EQ(s->init_zero(5, 8), Errc::ok);
  std::vector<float> g(8, 1.0f), out(8);
  const auto v0 = s->pull(5, out).version;
  ASSERT_EQ(s->push(5, g), Errc::ok);
  const auto v1 = s->pull(5, out).version;
  EXPECT_EQ(v1, v0 + 2);
  EXPECT_EQ(v1 % 2, 0u);
}

TEST(Store, StatefulOverrideOnStatelessStoreIsRefused) {
  auto s = make_store();  // rule add: no state arena
  ASSERT_EQ(s->init_zero(1, 4), Errc::ok);
  std::vector<float> g(4, 1.0f);
  UpdateRuleConfig adam;
  adam.rule = UpdateRule::adam;
  EXPECT_EQ(s->apply(1, g, adam), Errc::unsupported);
  UpdateRuleConfig assign;
  assign.rule = UpdateRule::assign;
  EXPECT_EQ(s->apply(1, g, assign), Errc::ok);
}

}  // namespace
}  // namespace pskv
