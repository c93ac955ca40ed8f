// Embedding tables: key spaces of fixed-dimension rows that nobody enumerates in advance (feature
// ids of a recommendation model). A row is created the first time an id is admitted, initialised
// from a seed and the id alone (so every server and replica creates the same bits), updated by a
// per-row rule that touches only the rows of a batch, and evicted under a row cap.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "pskv/update_rule.h"

namespace pskv {

enum class RowInit : std::uint8_t {
  zeros,
  uniform,  // uniform in [-scale, scale]
  normal,   // mean 0, standard deviation scale
};

// Which row makes room when a table at its cap must create one. Each is approximated by
// sampling (Redis's way): the worst of a few random live rows goes, not the worst of all.
enum class RowEviction : std::uint8_t {
  none,  // at the cap, a push that would create a row is refused (capacity)
  lru,   // the row read or written least recently
  lfu,   // the row read or written least often
  step,  // the row whose last update carried the oldest worker clock
};

// Table ids a server holds: [0, kMaxTables).
inline constexpr std::uint32_t kMaxTables = 64;

struct TableSpec {
  std::uint32_t dim = 16;
  RowInit init = RowInit::uniform;
  float init_scale = 0.01f;
  std::uint64_t seed = 0;
  // Per-row state: sgd none, adagrad one accumulator per float, adam two moments and a step
  // count (its bias correction counts this row's updates, not the job's). assign and add work too.
  UpdateRuleConfig rule{UpdateRule::sgd};
  // A row is created at the push that brings the pushes seen for its id to this many (a
  // counting filter, which may over-count and so admit early, never late). 1: the first push.
  // Until then its pushes are dropped and pulls return the initializer's value.
  std::uint32_t admit_after = 1;
  RowEviction eviction = RowEviction::none;
  // Live rows per server; 0: no cap.
  std::uint64_t max_rows = 0;

  // Field by field: every creator of a table must give the same spec.
  friend bool operator==(const TableSpec&, const TableSpec&) = default;
};

std::string_view to_string(RowInit init) noexcept;
std::optional<RowInit> parse_row_init(std::string_view name) noexcept;
std::string_view to_string(RowEviction eviction) noexcept;
std::optional<RowEviction> parse_row_eviction(std::string_view name) noexcept;
// Empty when the spec can be served; otherwise what is wrong with it.
std::string check_table_spec(const TableSpec& spec);

}  // namespace pskv
