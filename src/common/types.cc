#include "pskv/types.h"

namespace pskv {

std::string_view to_string(ConsistencyMode mode) noexcept {
  switch (mode) {
    case ConsistencyMode::asp:
      return "asp";
    case ConsistencyMode::bsp:
      return "bsp";
    case ConsistencyMode::ssp:
      return "ssp";
    case ConsistencyMode::sync:
      return "sync";
  }
  return "unknown";
}

std::optional<ConsistencyMode> parse_consistency_mode(std::string_view name) noexcept {
  for (auto m : {ConsistencyMode::asp, ConsistencyMode::bsp, ConsistencyMode::ssp, ConsistencyMode::sync})
    if (to_string(m) == name) return m;
  return std::nullopt;
}

}  // namespace pskv
