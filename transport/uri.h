// Endpoint URIs: tcp://host:port, shm://name, rdma://host:port[?dev=mlx5_0&port=1&gid=3].
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace pskv {

struct Uri {
  std::string scheme;  // tcp | shm | rdma
  std::string host;    // tcp/rdma
  std::uint16_t port = 0;
  std::string name;    // shm
  std::map<std::string, std::string> params;

  std::string str() const;
};

// Throws Error(invalid_argument) with the accepted forms on anything malformed.
Uri parse_uri(std::string_view text);

// "host:port" ("[host]:port" for IPv6) of a peer's socket address, for log lines; "?" if null.
std::string address_text(const sockaddr* address);
// The numeric host alone (no port, no brackets): what identifies a peer's machine.
std::string host_text(const sockaddr* address);

}  // namespace pskv
