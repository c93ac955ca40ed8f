// Incremental checkpoints of embedding tables (docs/ARCHITECTURE.md, "Embedding tables"). Per
// table, a generation of files "table-<t>.server-<id>.g<generation>.<seq>.ckpt": seq 0 holds every
// live row, and 1, 2, ... each the rows changed and the ids evicted since the file before it. A
// new generation (a new full snapshot) begins when the deltas since the last one would take
// longer to replay than the snapshot, and the old generation's files go once it is durable.
//
// File: "PSKVTBL1" | version u32 | server_id u32 | table u32 | seq u32 | generation u64 |
//       spec words[16] u32 | state_floats u32 | header crc u32
//       then rows x (id u64 | floats[dim] | state[state_floats]), then removed x id u64,
//       then "PSKVEND1" | rows u64 | removed u64 | crc u32 of everything from the header's end to
//       it (version 1, still read: of the rows and removed ids only)
// (counts at the end, so a table is streamed to disk as it is read). A delta's removed ids are
// applied before its rows: an id evicted and created again since the file before is in both.
//
// After each checkpoint "tables.server-<id>.manifest" (written atomically) names every table's
// newest file and its checksum: "PSKVTMF1" | version u32 | server_id u32 | n u32 |
// n x (table u32 | seq u32 | generation u64 | that file's trailer crc u32) | crc u32 of all
// before. Without it the loss of a generation's newest files could not be told from their
// absence; restore refuses files of version 2 without it.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "engine/shard_engine.h"

namespace pskv {

struct TableCheckpointInfo {
  std::uint64_t files = 0, rows = 0, removed = 0, bytes = 0;
};

// Thread-safety: one thread at a time (the server's checkpoint lock).
class TableCheckpointer {
 public:
  TableCheckpointer(std::string dir, std::uint32_t server_id) : dir_(std::move(dir)), server_id_(server_id) {}
  // Each table's next file: its first a full snapshot (a new generation past any in the
  // directory), then deltas. Throws Error(io) naming the file.
  TableCheckpointInfo write(ShardEngine& engine);
  // Recreates every table checkpointed in `dir` for `server_id` and restores its rows: the newest
  // generation's snapshot, then its deltas in order. A corrupt file throws Error(protocol) naming
  // it and the offset (nothing after a bad delta is applied); so does a gap in the deltas.
  static TableCheckpointInfo restore(ShardEngine& engine, const std::string& dir, std::uint32_t server_id);
  // Parses one file's image; applies it to `table` unless null (validation only). For restore and tests.
  static TableCheckpointInfo apply(const std::uint8_t* data, std::size_t size, std::uint32_t server_id,
                                   std::uint32_t table_id, std::uint64_t generation, std::uint32_t seq, TableSpec* spec,
                                   EmbeddingTable* table, const std::string& name);

 private:
  // A file checked whole: its spec, and where its rows and removed ids lie in the image.
  struct Parsed {
    TableSpec spec;
    std::uint64_t state_floats = 0, row_bytes = 0;
    const std::uint8_t* rows = nullptr;
    const std::uint8_t* removed = nullptr;
    TableCheckpointInfo info;
    std::uint32_t version = 0;
    std::uint32_t crc = 0;  // the trailer's
  };
  static Parsed parse(const std::uint8_t* data, std::size_t size, std::uint32_t server_id, std::uint32_t table_id,
                      std::uint64_t generation, std::uint32_t seq, const std::string& name);
  // Removals first, then rows (an id removed and made again is in both).
  static void apply_rows(const Parsed& p, EmbeddingTable& table, const std::string& name);
  void write_tables(ShardEngine& engine, TableCheckpointInfo& info);
  // Names each table's newest committed file; nothing if none was committed yet, unless `even_empty`.
  void write_manifest(bool even_empty = false);
  struct Chain {
    bool started = false;
    std::uint64_t generation = 0;
    std::uint32_t seq = 0;
    std::uint64_t full_rows = 0, delta_rows = 0;
    // generation and seq name a committed file (the newest: they move only on a commit, and a
    // failed file leaves them), whose trailer checksum is crc; for the manifest.
    bool committed = false;
    std::uint32_t crc = 0;
  };
  std::string dir_;
  std::uint32_t server_id_;
  std::array<Chain, kMaxTables> chains_{};
  bool manifest_seeded_ = false;  // the first write() read the directory's manifest
};

}  // namespace pskv
