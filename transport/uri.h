// Endpoint URIs: SCHEME://host:port or SCHEME://name (shm, fake), each with ?key=value parameters:
// tcp://10.0.0.1:9700, shm://job?clients=64, rdma://10.0.0.1:9700?dev=mlx5_0&port=1&gid=3. Which
// schemes exist is the transport factories' business (transport/factory).
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace pskv {

struct Uri {
  std::string scheme;
  std::string host;  // host:port schemes
  std::uint16_t port = 0;
  std::string name;  // named schemes (named_scheme)
  std::map<std::string, std::string> params;

  std::string str() const;
};

// Schemes whose URI names an object on this machine (shm://NAME, fake://NAME) rather than a
// host and port.
bool named_scheme(std::string_view scheme) noexcept;

// Throws Error(invalid_argument) with the accepted forms on anything malformed.
Uri parse_uri(std::string_view text);

// A backend's reading of its URI's parameters: each taken at most once, with its bounds, and
// finish() refusing any nobody took, naming them. Keeps its own copy of the URI, so it may be built
// from a temporary. Thread-safety: none (one reader).
class UriParams {
 public:
  explicit UriParams(const Uri& uri);
  std::uint64_t number(const std::string& name, std::uint64_t fallback, std::uint64_t min, std::uint64_t max);
  std::string choice(const std::string& name, const std::string& fallback,
                     std::initializer_list<std::string_view> allowed);
  std::string text(const std::string& name, const std::string& fallback);
  void finish() const;

 private:
  std::optional<std::string> take(const std::string& name);
  Uri uri_;
  std::map<std::string, std::string> left_;
};

// "host:port" ("[host]:port" for IPv6) of a peer's socket address, for log lines; "?" if null.
std::string address_text(const sockaddr* address);
// The numeric host alone (no port, no brackets): what identifies a peer's machine.
std::string host_text(const sockaddr* address);

}  // namespace pskv
