// Taking over the segment of an shm server that died (shm://NAME?adopt=1). On one node a failure
// is a server process, not the machine, and the store already lives in the segment: a successor
// fences the dead server's clients out of it, rolls back what they left half-applied, and copies
// every key (value, optimizer state, update count) and every worker's clock into its own, fresh
// segment, so nothing acknowledged is lost. docs/ARCHITECTURE.md, "Restarting an shm server".
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/json.h"
#include "engine/shard_engine.h"
#include "store/store.h"
#include "transport/shm/segment.h"
#include "transport/shm/sync_file.h"

namespace pskv::shm {

struct AdoptionReport {
  std::int32_t predecessor_pid = 0;
  std::uint64_t keys = 0, value_bytes = 0;
  std::uint64_t rolled_back = 0;       // pushes dead clients left half-applied
  std::uint64_t refused = 0;           // keys whose slot did not check out (logged)
  std::uint64_t torn = 0;              // values a writer left inside an update nobody logged (logged)
  std::uint64_t clocks = 0;            // worker clocks carried over
  std::uint64_t tables = 0, rows = 0;  // embedding tables and their rows carried over
  std::uint64_t rows_rolled_back = 0;  // rows a dead server thread left inside a write, put back
  std::uint64_t rows_torn = 0;         // rows inside a write no undo record covers (logged)
  std::uint64_t rows_refused = 0;      // rows this server's table had no room for (logged)
  std::uint64_t sync_keys = 0;         // keys whose pending sync steps were carried over
  std::uint64_t sync_refused = 0;      // ... whose record did not check out (logged)
  double milliseconds = 0;             // fencing, repair and copy
  JsonObject fields() const;
};

// Thread-safety: one thread (the listener's), from take() to copy_into().
class Predecessor {
 public:
  // The segment a dead server left under `name`, with its clients fenced out and what they left
  // half-done repaired; nullptr when there is none. The object is moved aside (to NAME.adopting-PID
  // in /dev/shm), freeing the name for this server's own segment; it is removed once this server
  // serves (served()), and put back under its name if it fails to start before that, so a later
  // attempt can still adopt it. Throws Error(stale_resource) while another server adopts it.
  //
  // Fencing: the segment's `closing` word is set, which a client applying its own push reads
  // after announcing it (both seq_cst, Store::apply_logged): so every such push either sees the
  // word and applies nothing, unacknowledged, or is already announced and is waited for here (up
  // to `patience` plus 1 s; past that it is rolled back, and logged). Clients that died inside
  // one are rolled back from their undo records, and every stripe lock still held by a dead
  // process (the server's tag included) is released. After take() nothing changes the old store.
  static std::unique_ptr<Predecessor> take(const std::string& name, std::chrono::milliseconds patience);
  ~Predecessor();
  Predecessor(const Predecessor&) = delete;
  Predecessor& operator=(const Predecessor&) = delete;

  // Copies every key that checks out, then the workers' clocks and sync mode's pending steps
  // (applying a step the dead server had complete but not applied), into `engine` (whose store must
  // keep the same kind of optimizer state), and takes over every embedding table
  // (transport/shm/table_files.h): its files get names under `tables_root` (this server's) and
  // the engine's table its rows in place. Keys and tables already there (a --restore) are
  // overwritten: the segment and the table files are newer than any checkpoint; such a table
  // gets the dead server's rows one by one and keeps only those.
  AdoptionReport copy_into(ShardEngine& engine, const std::string& tables_root);
  // Where the dead server kept its tables' rows.
  const std::string& tables_directory() const noexcept { return tables_; }
  // This server serves now (its segment is ready): the dead server's segment and table files go
  // with this object. Without it they are put back, for a later attempt to adopt.
  void served() noexcept { copied_ = true; }

 private:
  Predecessor() = default;
  std::unique_ptr<Segment> segment_;
  std::unique_ptr<Store> store_;
  std::vector<Store::Adoptable> slots_;  // what take() accepted; the old store no longer changes
  AdoptionReport report_;
  std::string name_, aside_;  // the object's path in /dev/shm, and where it was moved
  std::string tables_;        // the dead server's table files
  std::string dead_;          // "pskv-server pid N", as messages name it
  void copy_tables_into(ShardEngine& engine, const std::string& tables_root);
  void copy_sync_steps_into(ShardEngine& engine);
  std::unique_ptr<SyncStateFile> sync_;  // sync mode's pending steps, if the dead server kept them
  bool copied_ = false;
  std::chrono::steady_clock::time_point began_;
};

}  // namespace pskv::shm
