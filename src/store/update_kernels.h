// The update-rule kernels: value and optimizer state updated in place from a gradient, with Eigen
// maps over the arena and no temporaries; the pure streaming rules (add, plain SGD) use
// one hand-unrolled SSE2/AVX2 loop instead. Kept out of store.h so that only one translation unit
// compiles Eigen for them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "pskv/update_rule.h"

namespace pskv {

// Values of at least this many floats are updated by several threads (oneTBB) at once.
inline constexpr std::size_t kParallelApplyFloats = 256u << 10;  // 1 MiB

// `state` holds state_floats_per_value(rule) * n floats (first moment, then second moment).
// `step` is the 1-based count of updates including this one (Adam's bias correction).
void apply_update(const UpdateRuleConfig& rule, float* value, float* state, const float* grad, std::size_t n,
                  std::uint64_t step, float lr_scale) noexcept;
// The same over floats [begin, begin + n) of a value of `length` floats, whose state is laid out
// for all `length`: one piece of a push, applied as it arrives.
void apply_update_part(const UpdateRuleConfig& rule, float* value, float* state, std::size_t length, std::size_t begin,
                       const float* grad, std::size_t n, std::uint64_t step, float lr_scale) noexcept;

// memcpy of n floats, spread over the cores like apply_update for large n.
void copy_floats(float* dst, const float* src, std::size_t n) noexcept;

// The streaming kernels pick AVX2 at run time where the CPU has it. Tests switch to the SSE2
// ones with this to cover both on one machine. Not for concurrent use with apply_update.
void use_baseline_kernels(bool baseline) noexcept;

}  // namespace pskv
