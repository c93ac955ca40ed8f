#include "store/update_kernels.h"

#include <Eigen/Core>
#include <cmath>
#include <cstring>

namespace pskv {
namespace {
using Arr = Eigen::Map<Eigen::ArrayXf>;
using ConstArr = Eigen::Map<const Eigen::ArrayXf>;
}  // namespace

void apply_update(const UpdateRuleConfig& r, float* value, float* state, const float* grad, std::size_t n,
                  std::uint64_t step, float lr_scale) noexcept {
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
      Arr m(state, len);
      if (wd != 0.0f)
        m = r.momentum * m + g + wd * v;
      else
        m = r.momentum * m + g;
      v -= lr * m;
      return;
    }
    case UpdateRule::adam: {
      Arr m(state, len);
      Arr s(state + n, len);
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
      Arr s(state, len);
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

}  // namespace pskv
