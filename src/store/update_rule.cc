#include "pskv/update_rule.h"

namespace pskv {

std::string_view to_string(UpdateRule rule) noexcept {
  switch (rule) {
    case UpdateRule::assign:
      return "assign";
    case UpdateRule::add:
      return "add";
    case UpdateRule::sgd:
      return "sgd";
    case UpdateRule::momentum:
      return "momentum";
    case UpdateRule::adam:
      return "adam";
    case UpdateRule::adagrad:
      return "adagrad";
  }
  return "unknown";
}

std::optional<UpdateRule> parse_update_rule(std::string_view name) noexcept {
  for (auto r : {UpdateRule::assign, UpdateRule::add, UpdateRule::sgd, UpdateRule::momentum, UpdateRule::adam,
                 UpdateRule::adagrad})
    if (to_string(r) == name) return r;
  return std::nullopt;
}

std::uint32_t state_floats_per_value(UpdateRule rule) noexcept {
  switch (rule) {
    case UpdateRule::momentum:
    case UpdateRule::adagrad:
      return 1;
    case UpdateRule::adam:
      return 2;
    default:
      return 0;
  }
}

}  // namespace pskv
