// Where a key's value lives: which server, and for long values, which contiguous chunk on which
// server. A pure function of (key, length, options), so every worker agrees without talking.
#pragma once

#include <cstdint>
#include <vector>

#include "pskv/types.h"

namespace pskv {

struct PlacementOptions {
  std::uint32_t servers = 1;
  Partition partition = Partition::hash;
  std::uint64_t range_keys = 0;
  std::uint64_t chunk_floats = 0;  // split values longer than this over all servers; 0: never
};

struct Part {
  std::uint32_t server;
  std::uint32_t offset;  // floats into the value
  std::uint32_t length;
};

// Whether a value of `length` floats is cut into chunks over the servers.
inline bool splits(const PlacementOptions& o, std::uint32_t length) noexcept {
  return o.servers > 1 && o.chunk_floats != 0 && length > o.chunk_floats;
}

// Server that owns a whole (unsplit) key.
std::uint32_t home_server(const PlacementOptions& o, Key key) noexcept;
// Appends the parts of `key` to `out`, in offset order. Chunks are 16-float aligned and go to
// consecutive servers starting at the key's home, so big keys spread their first chunks too.
void place(const PlacementOptions& o, Key key, std::uint32_t length, std::vector<Part>& out);

}  // namespace pskv
