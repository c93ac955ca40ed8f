// One key of a request as every backend carries it (docs/protocol.md): the key and its length in
// floats. The engine takes requests as spans of these, whatever transport decoded them.
#pragma once

#include <cstdint>

namespace pskv {

struct KeyEntry {
  std::uint64_t key;
  std::uint32_t length;  // floats
  std::uint32_t reserved;
};
static_assert(sizeof(KeyEntry) == 16);

}  // namespace pskv
