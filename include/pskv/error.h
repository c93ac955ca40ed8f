// Typed errors. Every message says what happened and what to do about it.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace pskv {

enum class Errc {
  ok = 0,
  invalid_argument,  // the caller passed something malformed; fix the call
  not_found,         // unknown key: initialise it first
  length_mismatch,   // value length differs from the key's fixed length
  capacity,          // an arena, index or queue is full: raise the named limit
  timeout,           // a peer did not answer in time
  peer_failure,      // a peer died or closed the connection
  protocol,          // a malformed or incompatible message
  io,                // an operating-system call failed
  no_device,         // no RDMA device usable
  permission,        // access refused (auth, file mode, memlock limit)
  stale_resource,    // a leftover from a crashed run was found
  unsupported,       // the operation is not available on this backend/build
};

std::string_view errc_name(Errc code) noexcept;

// Thread-safety: immutable after construction; safe to share.
class Error : public std::runtime_error {
 public:
  Error(Errc code, const std::string& message);
  Errc code() const noexcept { return code_; }

 private:
  Errc code_;
};

}  // namespace pskv
