// Server side: a URI scheme to its backend. Adding a backend is a line here and one in connect.cc.
#include "transport/fake/fake_transport.h"
#include "transport/listener.h"
#include "transport/shm/shm_listener.h"
#include "transport/tcp/tcp_listener.h"
#if PSKV_WITH_RDMA
#include "transport/rdma/rdma_listener.h"
#endif

namespace pskv::transport {

std::unique_ptr<Listener> listen(const Uri& uri, const ListenOptions& options) {
  if (uri.scheme == "tcp") return tcp::make_listener(uri, options);
  if (uri.scheme == "shm") return shm::make_listener(uri, options);
  if (uri.scheme == "fake") return fake::make_listener(uri, options);
#if PSKV_WITH_RDMA
  if (uri.scheme == "rdma") return rdma::make_listener(uri, options);
#endif
  throw Error(Errc::unsupported,
              "no " + uri.scheme + " transport in this build (" + uri.str() +
                  "): serve tcp://, shm://, rdma:// (when built with rdma-core) or fake:// (in-process)");
}

}  // namespace pskv::transport
