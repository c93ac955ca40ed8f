// Embedding tables of an shm server started to be adopted (shm://NAME?adopt=1) keep their rows in
// files of /dev/shm, so that a successor takes the rows of a dead server as it takes its keys
// (docs/ARCHITECTURE.md, "Restarting an shm server"). One directory per server incarnation,
// /dev/shm/pskv-NAME.tables.NONCE (the segment header's job_nonce: a pid can be reused, by a
// restarted container say), and in it one per table:
//   table-T/spec        what the table was created with
//   table-T/undo        its undo records (EmbeddingTable logs every row write there first)
//   table-T/segment-N   its segments, under this name once published; new-K while being made
// A table's directory is made as table-T.new and renamed once its spec and undo records are
// written, so a server killed while creating a table leaves none half made.
// A table's directory goes when the table does (the server stopped); a killed server leaves
// its directory, which its successor adopts or, not adopting, removes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "pskv/table.h"
#include "pskv/types.h"
#include "table/embedding_table.h"
#include "table/table_storage.h"

namespace pskv::shm {

// Where the server of shm://NAME whose segment carries `job_nonce` keeps its tables.
std::string tables_directory(const std::string& name, std::uint64_t job_nonce);
// Makes `dir` (mode 0700) where a server keeps files for its successor, if absent. Throws
// Error(io) when it cannot, Error(permission) when it is not a directory of this user's.
void make_private_directory(const std::string& dir);
// Removes the table directories of every server of `name` but `keep`: called by the one server
// that holds the name (its segment is made), so none of them belongs to a live server.
void remove_left_tables(const std::string& name, const std::string& keep);

// One table's files. Thread-safety: as TableStorage.
class TableFiles final : public TableStorage {
 public:
  // Makes table `id`'s directory under `root` (made too if absent, mode 0700; refused if it is
  // not a directory of this user's) and writes its spec file; undo() then completes it. Throws
  // Error(io) when they cannot be written.
  // `take_from`: the directory of a dead server's table (LeftTable::dir) whose segments this
  // table takes over in place (take_left): each segment file gets a second name here (a hard
  // link, so the dead server's directory stays whole until its successor has started).
  TableFiles(const std::string& root, std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows,
             const std::string& take_from = {});
  ~TableFiles() override;  // removes the table's directory: the table is gone
  TableFiles(const TableFiles&) = delete;
  TableFiles& operator=(const TableFiles&) = delete;

  std::unique_ptr<MemoryResource> segment(std::size_t bytes) override;
  void publish(MemoryResource& memory, std::uint32_t index) override;
  std::unique_ptr<MemoryResource> undo(std::size_t bytes) override;
  Left take_left() override;

 private:
  std::string take_from_;
  std::string dir_;  // table-T.new until undo() has run, then table-T
  std::string final_dir_;
  std::atomic<std::uint64_t> made_{0};  // names of segments being made
};

// A table a dead server left, as its spec file says.
struct LeftTable {
  std::uint32_t id = 0;
  TableSpec requested;         // the spec its creators gave
  std::uint64_t max_rows = 0;  // the cap it had (its server's, for a table declared without one)
  std::string dir;
};

// Every table under `root` (a tables_directory), by id. Throws Error(stale_resource) naming the
// file when a spec file does not check out.
std::vector<LeftTable> left_tables(const std::string& root);
// Maps the table's undo records and segments (writable: writes the dead server was inside are
// rolled back there) and visits its rows (EmbeddingTable::recover_rows). Throws Error naming
// the file when one is not what the spec lays out.
EmbeddingTable::LeftRows read_left_rows(const LeftTable& table,
                                        const std::function<void(Key, const float*, const float*)>& visit);

}  // namespace pskv::shm
