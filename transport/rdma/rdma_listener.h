// rdma://HOST:PORT as a transport::Listener. URI parameters: dev=NAME, port=N, gid=INDEX (checked
// against the device rdma_cm routes HOST to, failing with both named if they differ), depth=N
// (receive buffers per client: its messages in flight, 1-4096, 64), recv_mb=N (each client's
// receive region: bounds one push, 1-262143, 32), poll=busy|event (completion threads spin on
// their queues instead of sleeping; event).
#pragma once

#include <memory>

#include "transport/listener.h"

namespace pskv::rdma {

std::unique_ptr<transport::Listener> make_listener(const Uri& uri, const transport::ListenOptions& options);

}  // namespace pskv::rdma
