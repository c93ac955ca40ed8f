#include "client/placement.h"

#include <algorithm>

#include "layout/hash.h"

namespace pskv {

std::uint32_t home_server(const PlacementOptions& o, Key key) noexcept {
  if (o.servers <= 1) return 0;
  if (o.partition == Partition::range && o.range_keys > 0) {
    const std::uint64_t per = (o.range_keys + o.servers - 1) / o.servers;
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(key / per, o.servers - 1));
  }
  return static_cast<std::uint32_t>(mix64(key) % o.servers);
}

void place(const PlacementOptions& o, Key key, std::uint32_t length, std::vector<Part>& out) {
  const std::uint32_t home = home_server(o, key);
  if (!splits(o, length)) {
    out.push_back({home, 0, length});
    return;
  }
  constexpr std::uint32_t kAlign = 16;  // 64-byte chunks keep every part cache-line aligned
  const std::uint32_t per = std::max(kAlign, (length / o.servers + kAlign - 1) / kAlign * kAlign);
  std::uint32_t offset = 0;
  for (std::uint32_t i = 0; offset < length; ++i) {
    const std::uint32_t n = std::min(per, length - offset);
    out.push_back({(home + i) % o.servers, offset, n});
    offset += n;
  }
}

}  // namespace pskv
