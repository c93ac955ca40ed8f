#include "store/sync_accumulator.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace pskv {
namespace {

struct Fixture {
  StoreOptions o;
  std::unique_ptr<Store> store;
  explicit Fixture(UpdateRule rule = UpdateRule::sgd, float lr = 0.1f) {
    o.rule.rule = rule;
    o.rule.lr = lr;
    store = Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
  }
  float value(Key k) {
    std::vector<float> out(store->find(k)->length);
    store->pull(k, out);
    return out[0];
  }
};

TEST(SyncAccumulator, AppliesMeanOnceWithLinearLr) {
  Fixture f;
  ASSERT_EQ(f.store->init_zero(1, 2), Errc::ok);
  SyncAccumulator acc(*f.store, {.num_workers = 4});
  std::vector<float> g{1, 1};
  for (std::uint32_t w = 0; w < 3; ++w) {
    g = {float(w + 1), float(w + 1)};
    EXPECT_EQ(acc.add(1, w, 0, g), SyncOutcome::accumulated);
    EXPECT_EQ(f.value(1), 0.0f) << "nothing is applied before all N arrive";
  }
  g = {4, 4};
  EXPECT_EQ(acc.add(1, 3, 0, g), SyncOutcome::applied);
  // mean = 2.5, lr * N = 0.4  ->  -1.0
  EXPECT_FLOAT_EQ(f.value(1), -1.0f);
  EXPECT_EQ(acc.next_step(1), 1u);
  EXPECT_EQ(f.store->find(1)->update_count, 1u) << "exactly one update per step";
  EXPECT_EQ(acc.stats().applied_steps, 1u);
}

TEST(SyncAccumulator, WithoutLinearScalingUsesPlainLr) {
  Fixture f;
  ASSERT_EQ(f.store->init_zero(1, 1), Errc::ok);
  SyncAccumulator acc(*f.store, {.num_workers = 2, .linear_lr_scaling = false});
  std::vector<float> a{1}, b{3};
  acc.add(1, 0, 0, a);
  acc.add(1, 1, 0, b);
  EXPECT_FLOAT_EQ(f.value(1), -0.2f);
}

TEST(SyncAccumulator, BackupWorkersDropTheLateGradient) {
  Fixture f(UpdateRule::add);
  ASSERT_EQ(f.store->init_zero(1, 1), Errc::ok);
  SyncAccumulator acc(*f.store, {.num_workers = 3, .required = 2, .linear_lr_scaling = false});
  std::vector<float> g{10};
  EXPECT_EQ(acc.add(1, 0, 0, g), SyncOutcome::accumulated);
  EXPECT_EQ(acc.add(1, 1, 0, g), SyncOutcome::applied);
  EXPECT_FLOAT_EQ(f.value(1), 10.0f);
  std::vector<float> straggler{1000};
  EXPECT_EQ(acc.add(1, 2, 0, straggler), SyncOutcome::dropped_late);
  // Step 1 must not contain the straggler's step-0 gradient.
  std::vector<float> h{1};
  acc.add(1, 0, 1, h);
  acc.add(1, 2, 1, h);
  EXPECT_FLOAT_EQ(f.value(1), 11.0f);
  EXPECT_EQ(acc.stats().dropped_late, 1u);
}

TEST(SyncAccumulator, DuplicatesWindowAndBadInput) {
  Fixture f(UpdateRule::add);
  ASSERT_EQ(f.store->init_zero(1, 1), Errc::ok);
  SyncAccumulator acc(*f.store, {.num_workers = 2, .window = 2});
  std::vector<float> g{1};
  EXPECT_EQ(acc.add(1, 0, 0, g), SyncOutcome::accumulated);
  EXPECT_EQ(acc.add(1, 0, 0, g), SyncOutcome::duplicate);
  EXPECT_EQ(acc.add(1, 0, 1, g), SyncOutcome::accumulated) << "one step ahead is buffered";
  EXPECT_EQ(acc.add(1, 0, 2, g), SyncOutcome::too_far_ahead);
  std::uint64_t next = 9;
  EXPECT_EQ(acc.prepare(1, 1, 2, &next), Errc::invalid_argument) << "a push checks each key's window first";
  EXPECT_EQ(next, 0u);
  EXPECT_EQ(acc.prepare(1, 1, 1), Errc::ok);
  Errc e{};
  EXPECT_EQ(acc.add(1, 5, 0, g, &e), SyncOutcome::rejected);
  EXPECT_EQ(e, Errc::invalid_argument);
  EXPECT_EQ(acc.add(2, 0, 0, g, &e), SyncOutcome::rejected);
  EXPECT_EQ(e, Errc::not_found);
  std::vector<float> wrong{1, 2};
  EXPECT_EQ(acc.add(1, 1, 0, wrong, &e), SyncOutcome::rejected);
  EXPECT_EQ(e, Errc::length_mismatch);
  // Completing step 0 also completes the buffered step 1 once its second gradient arrives.
  EXPECT_EQ(acc.add(1, 1, 0, g), SyncOutcome::applied);
  EXPECT_EQ(acc.add(1, 1, 1, g), SyncOutcome::applied);
  EXPECT_EQ(acc.next_step(1), 2u);
  EXPECT_EQ(acc.prepare(1, 1, 0), Errc::ok) << "a late step is dropped, not refused";
  EXPECT_THROW(SyncAccumulator(*f.store, {.num_workers = 2, .required = 3}), Error);
  EXPECT_THROW(SyncAccumulator(*f.store, {.num_workers = 2, .window = 16}), Error);
}

// A key's pending steps leave with its record and come back whole: a second accumulator that
// imports them completes each step exactly as the first would have, and contributions already
// in them count as duplicates. Every accumulation also moves the key's store version, which is
// what orders replication records.
TEST(SyncAccumulator, PendingStepsTravelWholeAndOrderTheRecords) {
  Fixture a, b;
  ASSERT_EQ(a.store->init_zero(1, 3), Errc::ok);
  ASSERT_EQ(b.store->init_zero(1, 3), Errc::ok);
  const SyncOptions o{.num_workers = 70, .required = 3, .replicated = true};  // two bitmap words
  SyncAccumulator from(*a.store, o), to(*b.store, o);
  std::vector<float> g{1, 2, 3};
  ASSERT_EQ(from.add(1, 0, 0, g), SyncOutcome::accumulated);
  const std::uint64_t before = a.store->find(1)->seq.load();
  ASSERT_EQ(from.add(1, 69, 0, g), SyncOutcome::accumulated);
  EXPECT_GT(a.store->find(1)->seq.load(), before) << "an accumulation must make the key's record newer";
  ASSERT_EQ(from.add(1, 5, 2, g), SyncOutcome::accumulated);  // a later step, waiting for step 0
  std::vector<float> state(from.state_floats(3));
  from.with_key(1, [&] { from.export_state(1, 3, state.data()); });
  std::string why;
  ASSERT_EQ(to.check_state(3, state.data(), &why), Errc::ok) << why;
  to.with_key(1, [&] { to.import_state(1, 3, state.data()); });
  EXPECT_EQ(to.add(1, 69, 0, g), SyncOutcome::duplicate);
  EXPECT_EQ(to.add(1, 7, 0, g), SyncOutcome::applied);
  EXPECT_EQ(from.add(1, 7, 0, g), SyncOutcome::applied);
  EXPECT_EQ(to.next_step(1), 1u);
  std::vector<float> x(3), y(3);
  a.store->pull(1, x);
  b.store->pull(1, y);
  EXPECT_EQ(x, y);
  std::vector<float> again(from.state_floats(3)), there(to.state_floats(3));
  from.with_key(1, [&] { from.export_state(1, 3, again.data()); });
  to.with_key(1, [&] { to.export_state(1, 3, there.data()); });
  EXPECT_EQ(0, std::memcmp(again.data(), there.data(), again.size() * sizeof(float)));
}

// A peer's record is checked before anything of it is written: each inconsistency a hostile or
// broken peer could send is refused, and a valid state is taken.
TEST(SyncAccumulator, AStateFromAPeerIsCheckedBeforeItIsTaken) {
  Fixture a;
  ASSERT_EQ(a.store->init_zero(1, 2), Errc::ok);
  SyncAccumulator acc(*a.store, {.num_workers = 3, .replicated = true});
  std::vector<float> g{1, 1};
  ASSERT_EQ(acc.add(1, 1, 4, g), SyncOutcome::too_far_ahead);
  ASSERT_EQ(acc.add(1, 1, 2, g), SyncOutcome::accumulated);
  std::vector<float> good(acc.state_floats(2));
  acc.with_key(1, [&] { acc.export_state(1, 2, good.data()); });
  auto word = [](std::vector<float>& s, std::size_t at, std::uint64_t w) { std::memcpy(&s[at], &w, sizeof w); };
  // Layout: next step (0), then entries of step, count, 1 bitmap word, 2 floats.
  constexpr std::size_t kEntry = 2 + 2 + 2 + 2;
  std::string why;
  auto bad = good;
  word(bad, 2 + 2, 2);  // entry 0 counts 2 contributors, its bitmap has 1
  EXPECT_EQ(acc.check_state(2, bad.data(), &why), Errc::protocol);
  EXPECT_NE(why.find("counts 2 contributors of 1"), std::string::npos) << why;
  bad = good;
  word(bad, 2 + 4, 1u << 3);  // worker 3 of 3
  EXPECT_EQ(acc.check_state(2, bad.data(), &why), Errc::protocol);
  EXPECT_NE(why.find("past worker 2"), std::string::npos) << why;
  bad = good;
  word(bad, 2, 9);  // step 9, outside the window at 0
  EXPECT_EQ(acc.check_state(2, bad.data(), &why), Errc::protocol);
  bad = good;
  for (std::size_t f = 0; f < kEntry; ++f) bad[2 + kEntry + f] = bad[2 + f];  // entry 1 repeats step 2
  EXPECT_EQ(acc.check_state(2, bad.data(), &why), Errc::protocol);
  EXPECT_NE(why.find("pending twice"), std::string::npos) << why;
  bad = good;
  word(bad, 2 + kEntry + 4, 1);  // contributors in an unused entry
  EXPECT_EQ(acc.check_state(2, bad.data(), &why), Errc::protocol);
  bad = good;
  word(bad, 0, ~std::uint64_t{0} - 1);  // a next step whose window would wrap
  EXPECT_EQ(acc.check_state(2, bad.data(), &why), Errc::protocol);
  bad = good;
  word(bad, 0, 2);  // entry 0 (step 2) becomes the next step, complete with all 3 contributors
  word(bad, 2 + 2, 3);
  word(bad, 2 + 4, 0b111);
  EXPECT_EQ(acc.check_state(2, bad.data(), &why), Errc::protocol);
  EXPECT_NE(why.find("never applied"), std::string::npos) << why;
  EXPECT_EQ(acc.check_state(2, good.data(), &why), Errc::ok) << why;
}

TEST(SyncAccumulator, ConcurrentWorkersApplyEveryStepExactlyOnce) {
  Fixture f(UpdateRule::add);
  constexpr std::uint32_t kWorkers = 4, kSteps = 200;
  for (Key k = 0; k < 8; ++k) ASSERT_EQ(f.store->init_zero(k, 16), Errc::ok);
  // The widest window: a worker that runs past it is refused and tries again, as a worker's
  // bounded read would hold it back.
  SyncAccumulator acc(*f.store, {.num_workers = kWorkers, .linear_lr_scaling = false, .window = 15});
  std::vector<std::thread> threads;
  for (std::uint32_t w = 0; w < kWorkers; ++w)
    threads.emplace_back([&, w] {
      std::vector<float> g(16, 1.0f);
      for (std::uint64_t step = 0; step < kSteps; ++step)
        for (Key k = 0; k < 8; ++k)
          while (acc.add(k, w, step, g) == SyncOutcome::too_far_ahead) std::this_thread::yield();
    });
  for (auto& t : threads) t.join();
  for (Key k = 0; k < 8; ++k) {
    EXPECT_FLOAT_EQ(f.value(k), float(kSteps)) << "mean of ones, once per step";
    EXPECT_EQ(acc.next_step(k), kSteps);
    EXPECT_EQ(f.store->find(k)->update_count, kSteps);
  }
}

}  // namespace
}  // namespace pskv
