// Reading a server's stats JSON in tests. Header-only, so unit tests that do not link the
// process-spawning support library (the TSan build has no pskv-server) can use it.
#pragma once

#include <string>

namespace pskv::testing {

// A number from a server's stats JSON (Client::server_stats, Server::stats_json), or -1 when
// the field is missing.
inline double stats_field(const std::string& json, const std::string& name) {
  const auto at = json.find("\"" + name + "\":");
  return at == std::string::npos ? -1 : std::stod(json.substr(at + name.size() + 3));
}

}  // namespace pskv::testing
