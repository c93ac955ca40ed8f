#include "transport/uri.h"

#include <netdb.h>
#include <netinet/in.h>

#include <charconv>
#include <optional>

#include "pskv/error.h"

namespace pskv {

namespace {
[[noreturn]] void bad(std::string_view text, const std::string& why) {
  throw Error(Errc::invalid_argument, "bad endpoint '" + std::string(text) + "': " + why +
                                          " (expected tcp://host:port, shm://name or rdma://host:port)");
}
}  // namespace

namespace {
struct NumericName {
  char host[NI_MAXHOST] = "?", port[NI_MAXSERV] = "?";
  bool v6 = false;
};
NumericName numeric_name(const sockaddr* address) {
  NumericName n;
  if (!address) return n;
  n.v6 = address->sa_family == AF_INET6;
  getnameinfo(address, n.v6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in), n.host, sizeof n.host, n.port, sizeof n.port,
              NI_NUMERICHOST | NI_NUMERICSERV);
  return n;
}
}  // namespace

std::string address_text(const sockaddr* address) {
  if (!address) return "?";
  const NumericName n = numeric_name(address);
  std::string text = n.host;
  if (n.v6) text.insert(0, 1, '[').push_back(']');
  text.push_back(':');
  text.append(n.port);
  return text;
}

std::string host_text(const sockaddr* address) {
  return numeric_name(address).host;
}

bool named_scheme(std::string_view scheme) noexcept {
  return scheme == "shm" || scheme == "fake";
}

Uri parse_uri(std::string_view text) {
  Uri u;
  const auto sep = text.find("://");
  if (sep == std::string_view::npos) bad(text, "no scheme");
  u.scheme = std::string(text.substr(0, sep));
  std::string_view rest = text.substr(sep + 3);
  if (const auto q = rest.find('?'); q != std::string_view::npos) {
    std::string_view query = rest.substr(q + 1);
    rest = rest.substr(0, q);
    while (!query.empty()) {
      const auto amp = query.find('&');
      std::string_view kv = query.substr(0, amp);
      const auto eq = kv.find('=');
      if (eq == std::string_view::npos || eq == 0)
        bad(text, "query parameter '" + std::string(kv) + "' is not key=value");
      u.params[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
      query = amp == std::string_view::npos ? std::string_view{} : query.substr(amp + 1);
    }
  }
  if (u.scheme.empty()) bad(text, "no scheme");
  if (named_scheme(u.scheme)) {
    if (rest.empty() || rest.size() > 200) bad(text, "the " + u.scheme + " name must have 1-200 characters");
    for (char c : rest)
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.'))
        bad(text, "the " + u.scheme + " name may hold only letters, digits, '-', '_' and '.'");
    u.name = std::string(rest);
    return u;
  }
  std::string_view host = rest, port;
  if (!rest.empty() && rest.front() == '[') {  // [v6]:port
    const auto close = rest.find(']');
    if (close == std::string_view::npos) bad(text, "unclosed '['");
    host = rest.substr(1, close - 1);
    if (close + 1 >= rest.size() || rest[close + 1] != ':') bad(text, "missing port");
    port = rest.substr(close + 2);
  } else {
    const auto colon = rest.rfind(':');
    if (colon == std::string_view::npos) bad(text, "missing port");
    host = rest.substr(0, colon);
    port = rest.substr(colon + 1);
  }
  if (host.empty()) bad(text, "missing host");
  unsigned value = 0;
  auto [p, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || p != port.data() + port.size() || value > 65535) bad(text, "port must be 0-65535");
  u.host = std::string(host);
  u.port = static_cast<std::uint16_t>(value);
  return u;
}

std::string Uri::str() const {
  // Appends instead of operator+ chains: GCC 12 warns falsely (-Wrestrict) on those.
  std::string s = scheme;
  s.append("://");
  if (named_scheme(scheme)) {
    s.append(name);
  } else {
    const bool v6 = host.find(':') != std::string::npos;
    if (v6) s.push_back('[');
    s.append(host);
    if (v6) s.push_back(']');
    s.push_back(':');
    s.append(std::to_string(port));
  }
  char sep = '?';
  for (const auto& [k, v] : params) {
    s.push_back(sep);
    s.append(k);
    s.push_back('=');
    s.append(v);
    sep = '&';
  }
  return s;
}

UriParams::UriParams(const Uri& uri) : uri_(uri), left_(uri.params) {}

std::optional<std::string> UriParams::take(const std::string& name) {
  const auto it = left_.find(name);
  if (it == left_.end()) return std::nullopt;
  std::string value = it->second;
  left_.erase(it);
  return value;
}

std::uint64_t UriParams::number(const std::string& name, std::uint64_t fallback, std::uint64_t min, std::uint64_t max) {
  const auto value = take(name);
  if (!value) return fallback;
  std::uint64_t n = 0;
  const auto [p, ec] = std::from_chars(value->data(), value->data() + value->size(), n);
  if (ec != std::errc() || p != value->data() + value->size() || n < min || n > max)
    throw Error(Errc::invalid_argument, uri_.scheme + " URI parameter " + name + "=" + *value +
                                            " must be a number in [" + std::to_string(min) + ", " +
                                            std::to_string(max) + "]");
  return n;
}

std::string UriParams::choice(const std::string& name, const std::string& fallback,
                              std::initializer_list<std::string_view> allowed) {
  const auto value = take(name);
  if (!value) return fallback;
  std::string list;
  for (std::string_view a : allowed) {
    if (*value == a) return *value;
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  throw Error(Errc::invalid_argument,
              uri_.scheme + " URI parameter " + name + "=" + *value + " must be one of " + list);
}

std::string UriParams::text(const std::string& name, const std::string& fallback) {
  return take(name).value_or(fallback);
}

void UriParams::finish() const {
  if (left_.empty()) return;
  std::string names;
  for (const auto& [k, v] : left_) names += (names.empty() ? "" : ", ") + k;
  throw Error(Errc::invalid_argument, uri_.scheme + "://: unknown URI parameter(s) " + names +
                                          " (docs/protocol.md, \"Server URIs\", lists each backend's)");
}

}  // namespace pskv
