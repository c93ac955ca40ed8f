#include "pskv/error.h"

namespace pskv {

std::string_view errc_name(Errc code) noexcept {
  switch (code) {
    case Errc::ok:
      return "ok";
    case Errc::invalid_argument:
      return "invalid_argument";
    case Errc::not_found:
      return "not_found";
    case Errc::length_mismatch:
      return "length_mismatch";
    case Errc::capacity:
      return "capacity";
    case Errc::timeout:
      return "timeout";
    case Errc::peer_failure:
      return "peer_failure";
    case Errc::protocol:
      return "protocol";
    case Errc::io:
      return "io";
    case Errc::no_device:
      return "no_device";
    case Errc::permission:
      return "permission";
    case Errc::stale_resource:
      return "stale_resource";
    case Errc::unsupported:
      return "unsupported";
  }
  return "unknown";
}

Error::Error(Errc code, const std::string& message)
    : std::runtime_error("pskv " + std::string(errc_name(code)) + ": " + message), code_(code) {}

}  // namespace pskv
