// Each rule, run through the store (Eigen kernels), against a plain scalar reference.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "store/store.h"
#include "store/update_kernels.h"

namespace pskv {
namespace {

struct Reference {
  std::vector<double> v, m, s;
  std::uint64_t t = 0;

  void step(const UpdateRuleConfig& r, const std::vector<float>& grad, double lr_scale) {
    ++t;
    const double lr = double{r.lr} * lr_scale;
    for (std::size_t i = 0; i < v.size(); ++i) {
      double g = grad[i];
      if (r.rule != UpdateRule::assign && r.rule != UpdateRule::add) g += double{r.weight_decay} * v[i];
      switch (r.rule) {
        case UpdateRule::assign:
          v[i] = grad[i];
          break;
        case UpdateRule::add:
          v[i] += grad[i];
          break;
        case UpdateRule::sgd:
          v[i] -= lr * g;
          break;
        case UpdateRule::momentum:
          m[i] = r.momentum * m[i] + g;
          v[i] -= lr * m[i];
          break;
        case UpdateRule::adam: {
          m[i] = r.beta1 * m[i] + (1 - double{r.beta1}) * g;
          s[i] = r.beta2 * s[i] + (1 - double{r.beta2}) * g * g;
          const double mhat = m[i] / (1 - std::pow(double{r.beta1}, double(t)));
          const double shat = s[i] / (1 - std::pow(double{r.beta2}, double(t)));
          v[i] -= lr * mhat / (std::sqrt(shat) + r.eps);
          break;
        }
        case UpdateRule::adagrad:
          s[i] += g * g;
          v[i] -= lr * g / (std::sqrt(s[i]) + r.eps);
          break;
      }
    }
  }
};

struct Case {
  UpdateRule rule;
  float weight_decay;
};

// The streaming rules have two kernels (SSE2 and, where the CPU has it, AVX2): run both.
class UpdateRuleTest : public ::testing::TestWithParam<std::tuple<Case, bool>> {
 protected:
  void TearDown() override { use_baseline_kernels(false); }
};

TEST_P(UpdateRuleTest, MatchesScalarReference) {
  const Case c = std::get<0>(GetParam());
  use_baseline_kernels(std::get<1>(GetParam()));
  UpdateRuleConfig cfg;
  cfg.rule = c.rule;
  cfg.lr = 0.05f;
  cfg.weight_decay = c.weight_decay;
  StoreOptions o;
  o.rule = cfg;
  auto store = Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);

  // Small: not a multiple of any SIMD width. Large: past kParallelApplyFloats, so oneTBB splits
  // it, with a tail that is not a whole cache line.
  for (const std::size_t n : {std::size_t{1037}, kParallelApplyFloats + 1037}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    std::mt19937 rng(1234);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> init(n);
    for (auto& x : init) x = dist(rng);
    ASSERT_EQ(store->init(Key(n), init), Errc::ok);
    Reference ref{std::vector<double>(init.begin(), init.end()), std::vector<double>(n), std::vector<double>(n)};

    std::vector<float> grad(n), out(n);
    for (int step = 0; step < 25; ++step) {
      for (auto& x : grad) x = dist(rng);
      const float lr_scale = step % 3 == 0 ? 2.0f : 1.0f;
      ASSERT_EQ(store->push(Key(n), grad, lr_scale), Errc::ok);
      ref.step(cfg, grad, lr_scale);
    }
    ASSERT_EQ(store->pull(Key(n), out).status, Errc::ok);
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_NEAR(out[i], ref.v[i], 2e-4 * (1 + std::abs(ref.v[i])))
          << "element " << i << " rule " << to_string(c.rule);
  }
}

// A push applied in pieces, as the TCP server applies a large one while it arrives, gives what
// the whole push gives: the pieces share the optimizer state and one step count.
TEST_P(UpdateRuleTest, PiecesMatchAWholePush) {
  const Case c = std::get<0>(GetParam());
  use_baseline_kernels(std::get<1>(GetParam()));
  StoreOptions o;
  o.rule.rule = c.rule;
  o.rule.lr = 0.05f;
  o.rule.weight_decay = c.weight_decay;
  auto store = Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
  constexpr std::size_t n = 3 * 65536 + 1037;
  // Uneven piece boundaries, one of them off any SIMD width or cache line.
  const std::size_t cuts[] = {0, 1000, 70001, 2 * 65536, n};
  std::mt19937 rng(99);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> init(n), grad(n), whole(n), pieces(n);
  for (auto& x : init) x = dist(rng);
  ASSERT_EQ(store->init(Key(1), init), Errc::ok);
  ASSERT_EQ(store->init(Key(2), init), Errc::ok);
  const SlotRef slot = store->find_ref(Key(2));
  for (int step = 0; step < 6; ++step) {
    for (auto& x : grad) x = dist(rng);
    ASSERT_EQ(store->push(Key(1), grad), Errc::ok);
    std::uint64_t piece_step = 0;
    for (std::size_t i = 0; i + 1 < std::size(cuts); ++i)
      store->apply_part(slot, cuts[i], grad.data() + cuts[i], cuts[i + 1] - cuts[i], &piece_step);
    EXPECT_EQ(piece_step, std::uint64_t(step + 1));
  }
  ASSERT_EQ(store->pull(Key(1), whole).status, Errc::ok);
  ASSERT_EQ(store->pull(Key(2), pieces).status, Errc::ok);
  EXPECT_EQ(store->find(Key(2))->update_count, store->find(Key(1))->update_count);
  // Equal but for the last bit or two: near an unaligned cut Eigen evaluates Adam's and Adagrad's
  // square roots and quotients on the scalar path instead of the vector one.
  for (std::size_t i = 0; i < n; ++i)
    ASSERT_NEAR(pieces[i], whole[i], 1e-6 * (1 + std::abs(whole[i])))
        << "element " << i << " rule " << to_string(c.rule);
}

INSTANTIATE_TEST_SUITE_P(
    AllRules, UpdateRuleTest,
    ::testing::Combine(::testing::Values(Case{UpdateRule::assign, 0}, Case{UpdateRule::add, 0},
                                         Case{UpdateRule::sgd, 0}, Case{UpdateRule::sgd, 0.01f},
                                         Case{UpdateRule::momentum, 0}, Case{UpdateRule::momentum, 0.01f},
                                         Case{UpdateRule::adam, 0}, Case{UpdateRule::adam, 0.01f},
                                         Case{UpdateRule::adagrad, 0}, Case{UpdateRule::adagrad, 0.01f}),
                       ::testing::Bool()),
    [](const auto& info) {
      const Case c = std::get<0>(info.param);
      return std::string(to_string(c.rule)) + (c.weight_decay != 0 ? "_wd" : "") +
             (std::get<1>(info.param) ? "_baseline" : "");
    });

TEST(UpdateRuleNames, RoundTrip) {
  for (auto r : {UpdateRule::assign, UpdateRule::add, UpdateRule::sgd, UpdateRule::momentum, UpdateRule::adam,
                 UpdateRule::adagrad})
    EXPECT_EQ(parse_update_rule(to_string(r)), r);
  EXPECT_FALSE(parse_update_rule("rmsprop").has_value());
}

}  // namespace
}  // namespace pskv
