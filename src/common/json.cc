#include "common/json.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace pskv {

std::string abridge_arrays(std::string_view json, std::size_t max_items) {
  std::string out;
  out.reserve(std::min(json.size(), std::size_t{4096}));
  std::string_view last_string;  // the key of the array that follows it
  for (std::size_t i = 0; i < json.size();) {
    if (json[i] == '"') {
      std::size_t end = i + 1;
      while (end < json.size() && json[end] != '"') end += json[end] == '\\' ? 2 : 1;
      end = std::min(end + 1, json.size());
      last_string = json.substr(i + 1, end - i - 2);
      out.append(json.substr(i, end - i));
      i = end;
      continue;
    }
    if (json[i] != '[') {
      out += json[i++];
      continue;
    }
    const std::size_t close = json.find(']', i);
    if (close == std::string_view::npos) {  // not an object JsonObject wrote: left as it is
      out.append(json.substr(i));
      break;
    }
    const std::string_view items = json.substr(i + 1, close - i - 1);
    std::size_t count = items.empty() ? 0 : 1, kept_end = max_items == 0 ? 0 : items.size();
    for (std::size_t at = 0; at < items.size(); ++at)
      if (items[at] == ',' && ++count == max_items + 1) kept_end = at;
    out += '[';
    out.append(items.substr(0, count > max_items ? kept_end : items.size()));
    out += ']';
    if (count > max_items) {
      out += ",\"";
      out.append(last_string);
      out += "_length\":" + std::to_string(count);
    }
    i = close + 1;
  }
  return out;
}

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
