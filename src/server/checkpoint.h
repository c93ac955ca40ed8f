// Shard checkpoints: every key's value, optimizer state and update count, and in sync mode its
// pending steps (gradients summed and acknowledged, not yet applied), each key with a CRC-32,
// written atomically (temp file, fsync, rename, fsync of the directory) so that a crash at any
// instant leaves the previous checkpoint intact.
//
// File: "PSKVCKP1" | version u32 (2) | server_id u32 | rule u32 | keys u64 | started_unix_ns u64 |
//       sync workers u32 | sync required u32 | sync window u32 (all 0 outside sync mode) |
//       header crc u32
//       then per key: key u64 | length u32 | state_floats u32 | update_count u64 | sync_floats u32 |
//                     crc u32 | values[length] | state[state_floats] | sync[sync_floats]
//       then "PSKVEND1" | keys u64 | crc over the per-key crcs u32
// sync[] is SyncAccumulator::export_state's layout cut after its entries in use. Version 1 files
// (the same without the sync fields) are still read; their keys start at step 0.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "store/store.h"
#include "store/sync_accumulator.h"

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

// A checkpoint file, mapped read-only: nothing is allocated for it, so its size (a file
// truncated up to a terabyte, say) costs address space only, and what a parser never reads is
// never paged in. Only a regular file is opened (a FIFO would hold the start). Error(not_found)
// or Error(io) naming it. Thread-safety: none needed after construction.
class CheckpointFile {
 public:
  explicit CheckpointFile(const std::string& path);
  ~CheckpointFile();
  CheckpointFile(const CheckpointFile&) = delete;
  CheckpointFile& operator=(const CheckpointFile&) = delete;
  const std::uint8_t* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

std::string checkpoint_path(const std::string& dir, std::uint32_t server_id);

// Writes the store's shard, with `sync`'s pending steps (null outside sync mode): each key's
// value and steps as of one moment (SyncAccumulator::with_key). Throws Error(io) with the path
// and the OS reason on failure.
CheckpointInfo write_checkpoint(Store& store, const SyncAccumulator* sync, const std::string& dir,
                                std::uint32_t server_id);

// Loads a shard into an empty store with the same update rule, and into `sync` (null outside
// sync mode) the steps each key had. Every length is checked against the file before anything
// is allocated; a corrupt or truncated file throws Error(protocol) naming the file, the offset
// and what is wrong. A file with pending steps that `sync` cannot take (another mode, or other
// workers or window) throws Error(invalid_argument): those pushes were acknowledged.
// With `server_id`, a file of another server's shard (copied over, say) throws
// Error(invalid_argument) before anything is loaded.
CheckpointInfo read_checkpoint(Store& store, SyncAccumulator* sync, const std::string& path,
                               std::optional<std::uint32_t> server_id = std::nullopt);
// Parses a checkpoint image in memory (what read_checkpoint does after reading the file);
// `store` may be null to validate only. Exposed for the fuzzer.
CheckpointInfo parse_checkpoint(const std::uint8_t* data, std::size_t size, Store* store, SyncAccumulator* sync,
                                const std::string& name, std::optional<std::uint32_t> server_id = std::nullopt);

}  // namespace pskv
