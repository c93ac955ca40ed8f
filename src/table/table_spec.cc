#include <cmath>

#include "pskv/table.h"

namespace pskv {

std::string_view to_string(RowInit init) noexcept {
  switch (init) {
    case RowInit::zeros:
      return "zeros";
    case RowInit::uniform:
      return "uniform";
    case RowInit::normal:
      return "normal";
  }
  return "?";
}

std::optional<RowInit> parse_row_init(std::string_view name) noexcept {
  for (RowInit i : {RowInit::zeros, RowInit::uniform, RowInit::normal})
    if (name == to_string(i)) return i;
  return std::nullopt;
}

std::string_view to_string(RowEviction eviction) noexcept {
  switch (eviction) {
    case RowEviction::none:
      return "none";
    case RowEviction::lru:
      return "lru";
    case RowEviction::lfu:
      return "lfu";
    case RowEviction::step:
      return "step";
  }
  return "?";
}

std::optional<RowEviction> parse_row_eviction(std::string_view name) noexcept {
  for (RowEviction e : {RowEviction::none, RowEviction::lru, RowEviction::lfu, RowEviction::step})
    if (name == to_string(e)) return e;
  return std::nullopt;
}

std::string check_table_spec(const TableSpec& spec) {
  constexpr std::uint32_t kMaxDim = 4096;
  if (spec.dim == 0 || spec.dim > kMaxDim)
    return "table dimension " + std::to_string(spec.dim) + " is outside [1, " + std::to_string(kMaxDim) + "]";
  if (!std::isfinite(spec.init_scale) || spec.init_scale < 0) return "table init_scale must be finite and not negative";
  if (!std::isfinite(spec.rule.lr) || !std::isfinite(spec.rule.beta1) || !std::isfinite(spec.rule.beta2) ||
      !std::isfinite(spec.rule.eps) || !std::isfinite(spec.rule.momentum) || !std::isfinite(spec.rule.weight_decay))
    return "table update rule parameters must be finite";
  if (spec.admit_after == 0) return "table admit_after must be at least 1 (1: create a row at its first push)";
  if (spec.admit_after > 255) return "table admit_after is counted in 8 bits: at most 255";
  if (spec.eviction != RowEviction::none && spec.max_rows == 0)
    return "table eviction " + std::string(to_string(spec.eviction)) + " needs max_rows (the cap it evicts under)";
  if (spec.max_rows > (std::uint64_t{1} << 32) - 2) return "table max_rows is above 2^32 - 2 rows per server";
  return {};
}

}  // namespace pskv
