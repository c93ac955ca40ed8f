// The shm server's decoder for a client's ring entry: the entry and the client's data area are
// both attacker-controlled.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "transport/shm/segment.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pskv;
  if (size < sizeof(shm::RingEntry)) return 0;
  shm::RingEntry e;
  std::memcpy(&e, data, sizeof e);
  // The data area: the rest of the input, in 64-byte-aligned memory like a real slot.
  const std::size_t area_bytes = size - sizeof e;
  std::vector<std::uint64_t> area((area_bytes + 7) / 8 + 8);
  std::memcpy(area.data(), data + sizeof e, area_bytes);
  std::vector<wire::KeyEntry> keys;
  const float* payload = nullptr;
  wire::Op op{};
  std::string why;
  const auto* base = reinterpret_cast<const std::byte*>(area.data());
  if (shm::decode_entry(e, base, area_bytes, &keys, &payload, &op, &why) == Errc::ok) {
    // What the server would read must be inside the area.
    std::uint64_t floats = 0;
    for (const auto& k : keys) floats += k.length;
    if (wire::op_carries_values(op) && reinterpret_cast<const std::byte*>(payload + floats) > base + area_bytes)
      __builtin_trap();
  }
  return 0;
}
