// tcp://HOST:PORT as a transport::Listener (the TcpServer does the serving). URI parameter:
// push=pieces|whole, how a push larger than a connection's receive buffer (256 KiB) is applied:
// as it arrives, each key or 256 KiB piece of a longer key as soon as it is in (so such a key is
// atomic per piece), or staged whole first and then applied atomically per key (pieces).
#pragma once

#include <memory>

#include "transport/listener.h"

namespace pskv::tcp {

std::unique_ptr<transport::Listener> make_listener(const Uri& uri, const transport::ListenOptions& options);

}  // namespace pskv::tcp
