// Where an embedding table keeps its rows when not in its process's own memory. An shm server
// started to be adopted (shm://NAME?adopt=1) keeps them in files of /dev/shm, from which its
// successor takes the rows of a dead server (transport/shm/table_files.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "common/memory.h"

namespace pskv {

// Thread-safety: segment() and publish() may be called from several threads at once (the pushes
// and the table's preparer thread); undo() once, when the table is made.
class TableStorage {
 public:
  virtual ~TableStorage() = default;
  // Zero-filled memory of `bytes`, already backed, so that no write into it can fail later
  // (a file of a full tmpfs would kill the writer with SIGBUS). Throws Error when there is none.
  virtual std::unique_ptr<MemoryResource> segment(std::size_t bytes) = 0;
  // `memory`, from segment(), is now the table's segment `index`; memory never published is
  // dropped with its object. Throws Error when it cannot be recorded.
  virtual void publish(MemoryResource& memory, std::uint32_t index) = 0;
  // The table's undo records, zero-filled (EmbeddingTable keeps one per index shard).
  virtual std::unique_ptr<MemoryResource> undo(std::size_t bytes) = 0;

  // What a dead process's table left, for this one to take over in place: its segments by index
  // (already this table's: published) and its undo records. Empty for a new table. Asked once,
  // when the table is made, after undo().
  struct Left {
    std::vector<std::pair<std::uint32_t, std::unique_ptr<MemoryResource>>> segments;
    std::unique_ptr<MemoryResource> undo;
  };
  virtual Left take_left() { return {}; }
};

}  // namespace pskv
