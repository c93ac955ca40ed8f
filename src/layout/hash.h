// The key hash every process must agree on: a key's stripe on the server, its home server on
// the client (placement), its bucket in the store's index. A cross-process format like the rest
// of src/layout: changing it changes where keys live.
#pragma once

#include <cstdint>

namespace pskv {

// Murmur3's 64-bit finalizer: cheap, and every output bit depends on every input bit, so
// sequential keys spread over buckets, stripes and servers.
inline std::uint64_t mix64(std::uint64_t x) noexcept {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

}  // namespace pskv
