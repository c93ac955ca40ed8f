// fake://NAME: a server and its clients in one process, requests handed over in memory. Tests of
// the client, the engine and the consistency modes run on it without sockets, segments or a VM
// (eRPC's FakeTransport is the model). It keeps what the real backends promise: a connection's
// requests are applied in order by the server's thread, a pull waits at the consistency bound in
// the engine, completions come from another thread than the submitter's, a connection that goes
// away counts as its worker leaving. It is not zero copy: values are staged in the server's
// memory, as a wire frame would carry them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "transport/listener.h"
#include "transport/transport.h"

namespace pskv::fake {

// Throws Error(peer_failure) if no fake server of that name is accepting clients.
std::unique_ptr<transport::Connection> connect(const Uri& uri, const transport::ConnectOptions& options);
// No URI parameters.
std::unique_ptr<transport::Listener> make_listener(const Uri& uri, const transport::ListenOptions& options);

// Cuts every connection of `worker` to the fake server `name` as its process dying would: the
// worker leaves without having finished, and its requests in flight or submitted later fail with
// peer_failure. How a test kills a worker that is a thread. Returns the connections cut.
std::size_t sever(const std::string& name, std::uint32_t worker);

}  // namespace pskv::fake
