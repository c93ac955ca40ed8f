// The one place that maps a URI scheme to a backend.
#include "transport/shm/shm_connection.h"
#include "transport/tcp/tcp_connection.h"
#include "transport/transport.h"

namespace pskv::transport {

std::unique_ptr<Connection> connect(const Uri& uri, const ConnectOptions& options) {
  if (uri.scheme == "tcp") return std::make_unique<tcp::TcpConnection>(uri, options);
  if (uri.scheme == "shm") return std::make_unique<shm::ShmConnection>(uri, options);
  throw Error(Errc::unsupported, "the " + uri.scheme + " transport is not available in this build (" + uri.str() + ")");
}

}  // namespace pskv::transport
