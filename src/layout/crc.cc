#include "layout/crc.h"

#include <zlib.h>

#include <algorithm>

namespace pskv {

std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t bytes) noexcept {
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {  // zlib takes a uInt length
    const auto n = static_cast<uInt>(std::min<std::size_t>(bytes, 1u << 30));
    crc = static_cast<std::uint32_t>(::crc32(crc, p, n));
    p += n;
    bytes -= n;
  }
  return crc;
}

}  // namespace pskv
