#include "store/update_kernels.h"

#include <Eigen/Core>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <cmath>
#include <cstring>

#include "common/sync.h"

namespace pskv {
namespace {
using Arr = Eigen::Map<Eigen::ArrayXf>;
using ConstArr = Eigen::Map<const Eigen::ArrayXf>;
constexpr std::size_t kAlign = 16;                 // floats per cache line
constexpr std::size_t kGrainFloats = 64u << 10;    // 256 KiB per task

// The rule over one range: `m` and `s` are the first and second state arrays for that range.
void apply_range(const UpdateRuleConfig& r, float* value, float* m_state, float* s_state, const float* grad,
                 std::size_t n, std::uint64_t step, float lr_scale) noexcept {
  const auto len = static_cast<Eigen::Index>(n);
  Arr v(value, len);
  ConstArr g(grad, len);
  const float lr = r.lr * lr_scale;
  const float wd = r.weight_decay;
  switch (r.rule) {
    case UpdateRule::assign:
      std::memcpy(value, grad, n * sizeof(float));
      return;
    case UpdateRule::add:
      v += g;
      return;
    case UpdateRule::sgd:
      if (wd != 0.0f)
        v -= lr * (g + wd * v);
      else
        v -= lr * g;
      return;
    case UpdateRule::momentum: {
      Arr m(m_state, len);
      if (wd != 0.0f)
        m = r.momentum * m + g + wd * v;
      else
        m = r.momentum * m + g;
      v -= lr * m;
      return;
    }
    case UpdateRule::adam: {
      Arr m(m_state, len);
      Arr s(s_state, len);
      const auto t = static_cast<double>(step);
      const float c1 = static_cast<float>(1.0 - std::pow(double{r.beta1}, t));
      const float c2 = static_cast<float>(1.0 - std::pow(double{r.beta2}, t));
      if (wd != 0.0f) {
        m = r.beta1 * m + (1.0f - r.beta1) * (g + wd * v);
        s = r.beta2 * s + (1.0f - r.beta2) * (g + wd * v).square();
      } else {
        m = r.beta1 * m + (1.0f - r.beta1) * g;
        s = r.beta2 * s + (1.0f - r.beta2) * g.square();
      }
      v -= lr * (m / c1) / ((s / c2).sqrt() + r.eps);
      return;
    }
    case UpdateRule::adagrad: {
      Arr s(m_state, len);
      if (wd != 0.0f) {
        s += (g + wd * v).square();
        v -= lr * (g + wd * v) / (s.sqrt() + r.eps);
      } else {
        s += g.square();
        v -= lr * g / (s.sqrt() + r.eps);
      }
      return;
    }
  }
}

}  // namespace

void apply_update(const UpdateRuleConfig& r, float* value, float* state, const float* grad, std::size_t n,
                  std::uint64_t step, float lr_scale) noexcept {
  // Adam keeps [m(n) | s(n)]; momentum and Adagrad keep one array of n.
  float* second = r.rule == UpdateRule::adam ? state + n : nullptr;
  if (n < kParallelApplyFloats || PSKV_TSAN) {
    apply_range(r, value, state, second, grad, n, step, lr_scale);
    return;
  }
  // A large value is memory-bound and the caller holds its write lock: spread it over the cores
  // (oneTBB), in cache-line-aligned pieces so no two threads share a line.
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n / kAlign, kGrainFloats / kAlign),
                    [&](const tbb::blocked_range<std::size_t>& b) {
                      const std::size_t begin = b.begin() * kAlign;
                      const std::size_t end = b.end() == n / kAlign ? n : b.end() * kAlign;
                      apply_range(r, value + begin, state ? state + begin : nullptr, second ? second + begin : nullptr,
                                  grad + begin, end - begin, step, lr_scale);
                    });
}

}  // namespace pskv
