// One small JSON writer for everything pskv prints as JSON: the servers' stats and the bench's
// result lines. Flat objects of numbers, strings and arrays of numbers cover all of it, so a
// full JSON library (and its compile time in every stats-printing unit) is not needed.
#pragma once

#include <concepts>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace pskv {

// Builds one JSON object field by field, in the order added. Keys are written as given (callers
// pass literals); string values are escaped. Non-finite doubles are written as null, which JSON
// can carry, rather than nan/inf, which it cannot. Thread-safety: none; one builder per thread.
class JsonObject {
 public:
  template <std::integral T>
  JsonObject& add(std::string_view key, T value) {
    if constexpr (std::same_as<T, bool>) {
      raw(key, value ? "true" : "false");
    } else if constexpr (std::is_signed_v<T>) {
      raw(key, std::to_string(static_cast<long long>(value)));
    } else {
      raw(key, std::to_string(static_cast<unsigned long long>(value)));
    }
    return *this;
  }
  // Shortest text that reads back as the same double; with decimals >= 0, fixed-point.
  JsonObject& add(std::string_view key, double value, int decimals = -1);
  JsonObject& add(std::string_view key, std::string_view value);
  JsonObject& add(std::string_view key, const char* value) { return add(key, std::string_view(value)); }
  JsonObject& add(std::string_view key, std::span<const std::int64_t> values);
  JsonObject& add(std::string_view key, std::span<const std::uint64_t> values);
  // Appends the fields of `other` (both stay flat: no nesting).
  JsonObject& merge(const JsonObject& other);

  bool empty() const noexcept { return fields_.empty(); }
  std::string str() const { return "{" + fields_ + "}"; }

 private:
  void raw(std::string_view key, std::string_view json);
  std::string fields_;  // "k":v,"k":v without the braces
};

// `text` as a JSON string literal, quotes included.
std::string json_quote(std::string_view text);

// `json`, a flat object as JsonObject writes it, with every array of more than `max_items`
// numbers cut to its first max_items and followed by a field "KEY_length": how many it had. For
// log lines: a job of 20,000 workers has a stats text of 40 KB, nearly all of it one array.
std::string abridge_arrays(std::string_view json, std::size_t max_items);

}  // namespace pskv
