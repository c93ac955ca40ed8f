#include "common/json.h"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace pskv {

std::string json_quote(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char esc[8];
          std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
          out += esc;
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

void JsonObject::raw(std::string_view key, std::string_view json) {
  if (!fields_.empty()) fields_ += ',';
  fields_ += '"';
  fields_ += key;
  fields_ += "\":";
  fields_ += json;
}

JsonObject& JsonObject::add(std::string_view key, double value, int decimals) {
  if (!std::isfinite(value)) {
    raw(key, "null");
    return *this;
  }
  char buf[64];
  const auto [end, ec] = decimals >= 0 ? std::to_chars(buf, buf + sizeof buf, value, std::chars_format::fixed, decimals)
                                       : std::to_chars(buf, buf + sizeof buf, value);
  raw(key, ec == std::errc() ? std::string_view(buf, end - buf) : std::string_view("null"));
  return *this;
}

JsonObject& JsonObject::add(std::string_view key, std::string_view value) {
  raw(key, json_quote(value));
  return *this;
}

namespace {
template <class T>
std::string number_array(std::span<const T> values) {
  std::string out = "[";
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(values[i]);
  }
  return out + "]";
}
}  // namespace

JsonObject& JsonObject::add(std::string_view key, std::span<const std::int64_t> values) {
  raw(key, number_array(values));
  return *this;
}

JsonObject& JsonObject::add(std::string_view key, std::span<const std::uint64_t> values) {
  raw(key, number_array(values));
  return *this;
}

JsonObject& JsonObject::merge(const JsonObject& other) {
  if (other.fields_.empty()) return *this;
  if (!fields_.empty()) fields_ += ',';
  fields_ += other.fields_;
  return *this;
}

}  // namespace pskv
