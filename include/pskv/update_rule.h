// Server-side update rules, applied to a key's value when a push arrives.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pskv {

enum class UpdateRule : std::uint8_t {
  assign,    // value = pushed
  add,       // value += pushed (Ray's async PS)
  sgd,       // value -= lr * (grad + wd * value)
  momentum,  // v = mu * v + grad + wd * value; value -= lr * v
  adam,      // Kingma & Ba with bias correction, per-key step count
  adagrad,   // G += grad^2; value -= lr * grad / (sqrt(G) + eps)
};

struct UpdateRuleConfig {
  UpdateRule rule = UpdateRule::add;
  float lr = 0.01f;
  float momentum = 0.9f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;

  friend bool operator==(const UpdateRuleConfig&, const UpdateRuleConfig&) = default;
};

std::string_view to_string(UpdateRule rule) noexcept;
std::optional<UpdateRule> parse_update_rule(std::string_view name) noexcept;

// Floats of optimizer state kept per float of value (momentum 1, adam 2, adagrad 1).
std::uint32_t state_floats_per_value(UpdateRule rule) noexcept;

}  // namespace pskv
