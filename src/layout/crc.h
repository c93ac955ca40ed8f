// CRC-32 (zlib's polynomial) as the wire protocol's optional checksum and the checkpoint files
// use it: both sides of either must compute the same value.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pskv {

// The CRC of a sequence of buffers: start with 0, feed each buffer in order.
std::uint32_t crc32_update(std::uint32_t crc, const void* data, std::size_t bytes) noexcept;

}  // namespace pskv
