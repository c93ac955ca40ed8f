// One raw request to a server, below the Client: what tests of the server-to-server ops send.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "transport/transport.h"
#include "transport/wire.h"

namespace pskv::testing {

struct Answer {
  Errc code = Errc::ok;
  std::string text;  // the reply's text payload (an index, a page) if it succeeded, else why not
};

// Submits one request over `conn` and waits up to `limit` for its answer: {timeout, "no answer"}
// if none came, and then `conn` is dropped (and null) before this call's locals, which the
// request it still holds points at.
Answer ask(std::shared_ptr<transport::Connection>& conn, wire::Op op, std::uint64_t arg0, std::uint32_t arg1 = 0,
           std::span<const transport::KeySlice> keys = {}, std::chrono::seconds limit = std::chrono::seconds(20));

}  // namespace pskv::testing
