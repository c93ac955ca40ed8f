#include "store/update_kernels.h"

#include <Eigen/Core>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <atomic>
#include <cmath>
#include <cstring>

#include "common/sync.h"

namespace pskv {
namespace {
using Arr = Eigen::Map<Eigen::ArrayXf>;
using ConstArr = Eigen::Map<const Eigen::ArrayXf>;
constexpr std::size_t kAlign = 16;               // floats per cache line
constexpr std::size_t kGrainFloats = 64u << 10;  // 256 KiB per task

// The streaming kernel behind `add` and plain `sgd`: v -= lr * g (add is lr = -1, which gives
// exactly v + g). Eigen's `v += g` ran at 15-20 GB/s on a hot 1 MiB value where this runs at
// 26-29 GB/s (memcpy: 25-28), and the apply is half the cost of every push. Four independent
// vectors per iteration keep enough loads in flight. Multiply then subtract, never fused:
// results are identical on both paths. AVX2 is chosen at run time: binaries must also run on
// CPUs without it (the Soft-RoCE VM's).
#if defined(__x86_64__)
void subtract_scaled_sse2(float* v, const float* g, float lr, std::size_t n) noexcept {
  const __m128 l = _mm_set1_ps(lr);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128 a = _mm_sub_ps(_mm_loadu_ps(v + i), _mm_mul_ps(l, _mm_loadu_ps(g + i)));
    const __m128 b = _mm_sub_ps(_mm_loadu_ps(v + i + 4), _mm_mul_ps(l, _mm_loadu_ps(g + i + 4)));
    const __m128 c = _mm_sub_ps(_mm_loadu_ps(v + i + 8), _mm_mul_ps(l, _mm_loadu_ps(g + i + 8)));
    const __m128 d = _mm_sub_ps(_mm_loadu_ps(v + i + 12), _mm_mul_ps(l, _mm_loadu_ps(g + i + 12)));
    _mm_storeu_ps(v + i, a), _mm_storeu_ps(v + i + 4, b), _mm_storeu_ps(v + i + 8, c), _mm_storeu_ps(v + i + 12, d);
  }
  for (; i < n; ++i) v[i] -= lr * g[i];
}

__attribute__((target("avx2"))) void subtract_scaled_avx2(float* v, const float* g, float lr, std::size_t n) noexcept {
  const __m256 l = _mm256_set1_ps(lr);
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256 a = _mm256_sub_ps(_mm256_loadu_ps(v + i), _mm256_mul_ps(l, _mm256_loadu_ps(g + i)));
    const __m256 b = _mm256_sub_ps(_mm256_loadu_ps(v + i + 8), _mm256_mul_ps(l, _mm256_loadu_ps(g + i + 8)));
    const __m256 c = _mm256_sub_ps(_mm256_loadu_ps(v + i + 16), _mm256_mul_ps(l, _mm256_loadu_ps(g + i + 16)));
    const __m256 d = _mm256_sub_ps(_mm256_loadu_ps(v + i + 24), _mm256_mul_ps(l, _mm256_loadu_ps(g + i + 24)));
    _mm256_storeu_ps(v + i, a), _mm256_storeu_ps(v + i + 8, b), _mm256_storeu_ps(v + i + 16, c),
        _mm256_storeu_ps(v + i + 24, d);
  }
  for (; i < n; ++i) v[i] -= lr * g[i];
}

const bool g_cpu_has_avx2 = __builtin_cpu_supports("avx2");
#else
// Elsewhere the compiler vectorizes this for the target's own SIMD.
void subtract_scaled_sse2(float* v, const float* g, float lr, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) v[i] -= lr * g[i];
}
void subtract_scaled_avx2(float* v, const float* g, float lr, std::size_t n) noexcept {
  subtract_scaled_sse2(v, g, lr, n);
}
const bool g_cpu_has_avx2 = false;
#endif
std::atomic<bool> g_use_avx2{g_cpu_has_avx2};

void subtract_scaled(float* v, const float* g, float lr, std::size_t n) noexcept {
  if (g_use_avx2.load(std::memory_order_relaxed))
    subtract_scaled_avx2(v, g, lr, n);
  else
    subtract_scaled_sse2(v, g, lr, n);
}

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
      subtract_scaled(value, grad, -1.0f, n);
      return;
    case UpdateRule::sgd:
      if (wd != 0.0f)
        v -= lr * (g + wd * v);
      else
        subtract_scaled(value, grad, lr, n);
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

// Runs piece(begin, end) over [0, n). A large array is memory-bound and its caller holds the
// key's write lock: spread it over the cores (oneTBB), in cache-line-aligned pieces so no two
// threads share a line.
template <class Piece>
void in_pieces(std::size_t n, Piece&& piece) noexcept {
  if (n < kParallelApplyFloats || PSKV_TSAN) {
    piece(std::size_t{0}, n);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n / kAlign, kGrainFloats / kAlign),
                    [&](const tbb::blocked_range<std::size_t>& b) {
                      piece(b.begin() * kAlign, b.end() == n / kAlign ? n : b.end() * kAlign);
                    });
}

}  // namespace

void copy_floats(float* dst, const float* src, std::size_t n) noexcept {
  in_pieces(n, [&](std::size_t begin, std::size_t end) {
    std::memcpy(dst + begin, src + begin, (end - begin) * sizeof(float));
  });
}

void use_baseline_kernels(bool baseline) noexcept {
  g_use_avx2.store(g_cpu_has_avx2 && !baseline);
}

void apply_update(const UpdateRuleConfig& r, float* value, float* state, const float* grad, std::size_t n,
                  std::uint64_t step, float lr_scale) noexcept {
  apply_update_part(r, value, state, n, 0, grad, n, step, lr_scale);
}

void apply_update_part(const UpdateRuleConfig& r, float* value, float* state, std::size_t length, std::size_t begin,
                       const float* grad, std::size_t n, std::uint64_t step, float lr_scale) noexcept {
  // Adam keeps [m(length) | s(length)]; momentum and Adagrad keep one array of length.
  float* first = state ? state + begin : nullptr;
  float* second = r.rule == UpdateRule::adam ? state + length + begin : nullptr;
  value += begin;
  in_pieces(n, [&](std::size_t b, std::size_t e) {
    apply_range(r, value + b, first ? first + b : nullptr, second ? second + b : nullptr, grad + b, e - b, step,
                lr_scale);
  });
}

}  // namespace pskv
