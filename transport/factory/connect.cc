// Client side: a URI scheme to its backend. Adding a backend is a line here and one in listen.cc.
#include "transport/fake/fake_transport.h"
#include "transport/shm/shm_connection.h"
#include "transport/tcp/tcp_connection.h"
#include "transport/transport.h"
#if PSKV_WITH_RDMA
#include "transport/rdma/rdma_connection.h"
#endif

namespace pskv::transport {

std::unique_ptr<Connection> connect(const Uri& uri, const ConnectOptions& options) {
  if (uri.scheme == "tcp") return std::make_unique<tcp::TcpConnection>(uri, options);
  if (uri.scheme == "shm") return std::make_unique<shm::ShmConnection>(uri, options);
  if (uri.scheme == "fake") return fake::connect(uri, options);
#if PSKV_WITH_RDMA
  if (uri.scheme == "rdma") return std::make_unique<rdma::RdmaConnection>(uri, options);
#endif
  throw Error(Errc::unsupported,
              "no " + uri.scheme + " transport in this build (" + uri.str() +
                  "): use tcp://, shm://, rdma:// (when built with rdma-core) or fake:// (in-process)");
}

}  // namespace pskv::transport
