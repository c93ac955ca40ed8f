// shm://NAME as a transport::Listener: the segment (laid out when the engine asks for its memory)
// and the ShmServer that serves it. URI parameters: clients=N (client areas: clients at once, 1-4096, 64),
// area_mb=N (each client's staging area: bounds one push and one value's undo copy, 1-4096, 32),
// push=worker|server (who applies a push: the client itself, under the stripe lock with an undo
// record, or a server thread from the client's area; worker).
#pragma once

#include <memory>

#include "transport/listener.h"

namespace pskv::shm {

std::unique_ptr<transport::Listener> make_listener(const Uri& uri, const transport::ListenOptions& options);

}  // namespace pskv::shm
