// Shard checkpoints: every key's value, optimizer state and update count, each with a CRC-32,
// written atomically (temp file, fsync, rename, fsync of the directory) so that a crash at any
// instant leaves the previous checkpoint intact.
//
// File: "PSKVCKP1" | version u32 | server_id u32 | rule u32 | keys u64 | started_unix_ns u64 |
//       header crc u32
//       then per key: key u64 | length u32 | state_floats u32 | update_count u64 | crc u32 |
//                     values[length] | state[state_floats]
//       then "PSKVEND1" | keys u64 | crc over the per-key crcs u32
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "store/store.h"

namespace pskv {

struct CheckpointInfo {
  std::uint64_t keys = 0;
  std::uint64_t bytes = 0;
  // Wall-clock time (CLOCK_REALTIME) before the first key was snapshotted: every push
  // acknowledged before it is in the checkpoint.
  std::uint64_t started_unix_ns = 0;
};

// A file written atomically: into PATH.tmp, then fsynced, renamed over PATH and the directory
// fsynced, so that PATH is always either the previous file or the whole new one. Dropped without
// commit(), the temp file is removed. Throws Error(io) with the path and the OS reason.
// Thread-safety: one thread.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void put(const void* p, std::size_t n);
  void commit();
  std::uint64_t bytes() const noexcept { return bytes_; }

 private:
  void flush();
  void write_all(const char* p, std::size_t n);
  std::string path_, tmp_;
  int fd_ = -1;
  std::vector<char> buf_;
  std::uint64_t bytes_ = 0;
};

// The whole file; Error(not_found) or Error(io) naming it.
std::vector<std::uint8_t> read_file(const std::string& path);

std::string checkpoint_path(const std::string& dir, std::uint32_t server_id);

// Writes the store's shard. Throws Error(io) with the path and the OS reason on failure.
CheckpointInfo write_checkpoint(Store& store, const std::string& dir, std::uint32_t server_id);

// Loads a shard into an empty store with the same update rule. Every length is checked against
// the file before anything is allocated; a corrupt or truncated file throws Error(protocol)
// naming the file, the offset and what is wrong.
CheckpointInfo read_checkpoint(Store& store, const std::string& path);
// Parses a checkpoint image in memory (what read_checkpoint does after reading the file);
// `store` may be null to validate only. Exposed for the fuzzer.
CheckpointInfo parse_checkpoint(const std::uint8_t* data, std::size_t size, Store* store, const std::string& name);

}  // namespace pskv
