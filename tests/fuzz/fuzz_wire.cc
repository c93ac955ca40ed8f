// The TCP/RDMA frame decoder as the server runs it: frames parsed back to back from a buffer
// (request direction), and reply headers as a client checks them.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pskv::wire;
  Limits limits{.max_keys = 4096, .max_payload_bytes = 1 << 20};
  std::vector<KeyEntry> keys;
  std::size_t at = 0;
  while (at < size) {
    ParsedFrame f;
    pskv::Errc status = pskv::Errc::ok;
    std::string why;
    const auto r =
        parse_request(reinterpret_cast<const std::byte*>(data + at), size - at, limits, &f, &keys, &status, &why);
    if (r != ParseResult::complete) break;
    // The payload must lie inside what was parsed.
    if (f.payload + f.header.payload_bytes > reinterpret_cast<const std::byte*>(data + size)) __builtin_trap();
    at += f.frame_bytes;
  }
  if (size >= sizeof(FrameHeader)) {
    FrameHeader h;
    __builtin_memcpy(&h, data, sizeof h);
    std::string why;
    validate_header(h, limits, true, &why);
  }
  return 0;
}
