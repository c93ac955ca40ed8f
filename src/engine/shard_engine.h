// One server shard, independent of the transport: the store, the sync accumulator, the clock
// table, and the operations parked until the consistency bound or a barrier lets them go.
// Transports decode requests and call in here; they implement Parked to send deferred replies.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "common/json.h"
#include "layout/clock_table.h"
#include "layout/key_entry.h"
#include "pskv/table.h"
#include "pskv/types.h"
#include "store/store.h"
#include "store/sync_accumulator.h"

namespace pskv {

class EmbeddingTable;
class TableStorage;

// How far a replica is from holding all of its origin's keys: a full transfer from the origin
// marks it syncing, then synced once every key has arrived (the values of the wire's
// kReplicaSyncing / kReplicaSynced).
enum class ReplicaMark : std::uint32_t { syncing = 1, synced = 2 };

// What a replica keeps of each worker of its origin, each only ever raised: the clock it entered
// there, the barrier generation it entered, and 1 once the origin evicted it (so a full
// transfer's 0 undoes nothing). Shipped as replica_clock, replica_barrier and replica_evict.
enum class WorkerWord : std::uint8_t { clock, barrier, evicted };
inline constexpr std::size_t kWorkerWords = 3;

struct EngineOptions {
  StoreOptions store;
  std::uint32_t num_workers = 0;  // 0: no worker clocks (ASP only, anonymous clients)
  ConsistencyMode mode = ConsistencyMode::asp;
  std::uint32_t staleness = 0;      // ssp only
  std::uint32_t sync_required = 0;  // sync only: K of N (0 = N)
  std::chrono::milliseconds wait_timeout{10000};
  StragglerPolicy straggler = StragglerPolicy::fail;
  std::uint32_t server_id = 0;
  // Servers whose keys this one keeps a replica of (--replicas: its predecessors on the ring).
  std::vector<std::uint32_t> replica_of;
  // What all embedding tables' rows may take at their caps (--table-memory-mb).
  std::uint64_t table_memory_bytes = 4ull << 30;
  // How many servers hold each table (R): a replicated server charges its tables that many
  // times, since each of them keeps the copies of its predecessors' alike. 0: replica_of's
  // servers and this one (a failover's takeover engine, which keeps no replicas, says R).
  std::uint32_t table_copies = 0;
  // Tables mark the rows each push changes, for incremental checkpoints (--checkpoint-dir).
  bool track_table_changes = false;
  // With a replicator: the transport ships tables' rows too (tcp and rdma servers do), so table
  // ops are served; otherwise a replicated server refuses them.
  bool replicate_tables = false;
  // Marks every key and table with its workers' newest pushes (as a replicated server does)
  // without keeping replicas: a failover's takeover engine, built from a replica whose records
  // carry the marks, applies a push retried there once (src/server/failover.h).
  bool mark_pushes = false;
  // This engine's incarnation (its start, in seconds: epoch_seconds) is at least this, even if
  // the clock says otherwise: a failover server restarted within the second of its previous
  // start must still be a later incarnation.
  std::uint32_t min_incarnation = 0;
};

// A replica's copy of one of its origin's tables, as replica_table_rows reads it out.
struct ReplicaTableRows {
  bool exists = false;         // the replica holds this table of the origin
  bool synced = false;         // ... and every key and row of the origin
  std::uint32_t position = 0;  // how far along the origin's table stream the replica is
  std::uint32_t epoch = 0;     // ... of the origin's incarnation (seconds) that transferred to it
  std::uint32_t next = 0;      // the cursor to go on from; 0 once every row was read
  TableSpec requested{};       // the spec the origin's table was created with
  std::uint64_t max_rows = 0;  // its cap there
  std::uint32_t record_floats = 0;
  std::vector<Key> ids;
  std::vector<float> records;        // record_floats per id
  std::vector<std::uint64_t> marks;  // per worker, the newest identified push the rows hold
};

// A deferred reply. resume() runs exactly once, on an engine or transport thread, never under
// an engine lock.
class Parked {
 public:
  virtual ~Parked() = default;
  // status ok: the wait is over and the reply may be produced. Otherwise `why` explains.
  virtual void resume(Errc status, const std::string& why) = 0;
};

// The origin's side of replication (src/server/replicator.h): once an init, push or clock is
// applied, the state of its keys (or the clock) is shipped to the live replicas and the reply
// waits for them.
// Thread-safety: ship() from any thread.
class Replicator {
 public:
  virtual ~Replicator() = default;
  // Room for the records of an init or push of `keys`, taken before it is applied, so that a
  // refusal leaves nothing applied. Errc::capacity, with `why`: a key of an init (`creating`)
  // whose record could not cross to a replica in one request, or the records in flight to the
  // replicas would pass their bound. ship() gives the room back once the replicas have answered;
  // release() gives it back for a request that failed before it was shipped.
  virtual Errc reserve(std::span<const KeyEntry> keys, bool creating, std::string* why) = 0;
  virtual void release(std::span<const KeyEntry> keys) = 0;
  // `keys` were just applied here (after reserve()); `reply` resumes (ok) once every live replica
  // holds them. A replica that fails meanwhile is no longer live and is not waited for. A null
  // `reply`: ship the keys' state, answer nobody (a push cut short after some pieces applied).
  virtual void ship(std::span<const KeyEntry> keys, std::unique_ptr<Parked> reply) = 0;
  // `worker` just entered `clock` here; `reply` resumes (ok) once every live replica knows, in
  // order with what was shipped before it.
  virtual void ship_clock(std::uint32_t worker, std::uint64_t clock, std::unique_ptr<Parked> reply) = 0;
  // `worker` enters barrier `generation` here once `reply` resumes (ok): every live replica
  // knows it by then.
  virtual void ship_barrier(std::uint32_t worker, std::uint64_t generation, std::unique_ptr<Parked> reply) = 0;
  // `worker` was evicted here (a straggler); shipped in order, answering nobody.
  virtual void ship_eviction(std::uint32_t worker) = 0;
  // Tables (EngineOptions::replicate_tables). Room for `bytes` of row records, taken before a
  // table_push is applied and given back as reserve()'s is.
  virtual Errc reserve_bytes(std::uint64_t bytes, std::string* why) = 0;
  virtual void release_bytes(std::uint64_t bytes) = 0;
  // Creates table `id` in the engine (ShardEngine::create_table) and, if this call made it, queues
  // its empty copy to every live replica in the same step, so that no row of it can reach a
  // replica before the copy; *parked is then set and park()'s reply resumes once they have it.
  // A create of a table made already (with the same spec) is parked too, until everything
  // queued before it is acknowledged: the first create's copy may still be on its way.
  virtual Errc create_table(std::uint32_t id, const TableSpec& spec, std::string* why,
                            const std::function<std::unique_ptr<Parked>()>& park, bool* parked) = 0;
  // A table_push of `ids` was just applied to `table` (after reserve_bytes of `reserved`): the
  // rows of those ids as they are now, and every row the table lost since the last shipment,
  // reach every live replica in the order they were read before `reply` resumes.
  virtual void ship_rows(std::uint32_t table, std::span<const KeyEntry> ids, std::uint64_t reserved,
                         std::unique_ptr<Parked> reply) = 0;
  // An identified table_push (a retrying client's, by `worker`): apply() (ShardEngine::table_push
  // with its PushId) runs in the order of the table stream, and its rows go out with the worker's
  // push mark in one frame, so that every replica holds the rows and the mark of a push, or
  // neither, and no frame holds part of it. On success *parked is set and park()'s reply resumes
  // once every live replica has the frame; an error (from apply(), or a push whose rows would
  // not fit one frame) is returned with nothing parked and nothing applied.
  virtual Errc push_rows_in_order(std::uint32_t table, std::uint32_t worker, std::span<const KeyEntry> ids,
                                  std::uint64_t reserved, const std::function<Errc()>& apply,
                                  const std::function<std::unique_ptr<Parked>()>& park, std::string* why,
                                  bool* parked) = 0;
  virtual JsonObject stats() const = 0;
};

// Failover's votes and certificates (src/replication/failover.h), as a transport serves them:
// down(server, incarnation, holder) says that incarnation of `server` may no longer acknowledge
// anything and its keys are served by `holder` at `uri` (docs/ARCHITECTURE.md, "Failover").
// Thread-safety: every member from any thread.
class Membership {
 public:
  virtual ~Membership() = default;
  // `requester` asks for this server's vote: ok (granted, recorded before this returns), or a
  // refusal with *why; stale_resource when the requester itself is certified down here.
  virtual Errc vote(std::uint32_t server, std::uint32_t incarnation, std::uint32_t holder, const std::string& uri,
                    std::uint32_t requester, std::string* why) = 0;
  // A majority granted it (the winner says so): recorded, and acted on if it concerns this server.
  virtual Errc certified(std::uint32_t server, std::uint32_t incarnation, std::uint32_t holder, const std::string& uri,
                         std::string* why) = 0;
  // What the certificates op answers: every certificate known to have won about server `about`
  // (every one with kAllServers), as wire::encode_certificates writes them.
  static constexpr std::uint32_t kAllServers = UINT32_MAX;
  virtual std::string certificates(std::uint32_t about) const = 0;
  // Restarted server `server` (incarnation `incarnation`, the requester) asks for its keys back
  // from this server, which holds them, with its own claim (holder == server, no URI): ok once
  // this server has taken the request on (it gives them back in the background); not_found if
  // it does not hold them.
  virtual Errc hand_back(std::uint32_t server, std::uint32_t incarnation, std::uint32_t holder, const std::string& uri,
                         std::uint32_t requester, std::string* why) = 0;
  virtual JsonObject stats() const = 0;  // merged into the engine's stats
};

struct EngineStats {
  std::uint64_t pushes = 0, pulls = 0, clocks = 0, parked = 0, timeouts = 0, evictions = 0;
  SyncStats sync;
};

// The options of an engine's sync accumulators (its own and its replicas'), in sync mode.
SyncOptions sync_options(const EngineOptions& options);

// Makes the storage of the engine's own table `id` (src/table/table_storage.h), created with
// `requested` and capped at `max_rows` rows; throws Error when it cannot.
using TableStorageMaker =
    std::function<std::unique_ptr<TableStorage>(std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows)>;

// Thread-safety: every member may be called concurrently from any thread.
class ShardEngine {
 public:
  // `store_memory` null: anonymous heap memory sized for options.store. `table_storage` empty:
  // tables keep their rows in the process's memory (replicas' copies always do). `sync_space`
  // null: sync mode's pending steps do too.
  ShardEngine(const EngineOptions& options, std::unique_ptr<MemoryResource> store_memory = nullptr,
              void* clock_memory = nullptr, TableStorageMaker table_storage = {},
              std::shared_ptr<SyncSpace> sync_space = nullptr);
  ~ShardEngine();
  ShardEngine(const ShardEngine&) = delete;
  ShardEngine& operator=(const ShardEngine&) = delete;

  Store& store() noexcept { return *store_; }
  const EngineOptions& options() const noexcept { return options_; }
  ClockTable* clocks() noexcept { return clocks_.get(); }
  SyncAccumulator* sync() noexcept { return sync_.get(); }  // null outside sync mode

  // Each returns ok or an Errc with a message in *why naming the key.
  Errc init(std::span<const KeyEntry> keys, const float* values, std::string* why);
  // With `undo` (shm: the server thread's log in the segment), each key is applied through
  // Store::apply_logged, so a successor can roll back the one a death cut short. Sync mode sums
  // first, and applies each completed step so (with undo->sync_mark).
  // `id` (its session and seq; the worker is `worker`): on a replicated server, a key that already
  // holds this push is skipped (a client sent it again after a failure) and counted in
  // pushes_already_applied.
  Errc push(std::uint32_t worker, std::uint64_t clock, std::span<const KeyEntry> keys, const float* values,
            std::string* why, const UndoLog* undo = nullptr, PushId id = {});
  // Finds every key's slot and checks it exists with the length asked for, counting nothing.
  // For a push its transport applies in pieces as the values arrive (Store::apply_part, only
  // when pushes_apply_in_pieces(); count_pushes() once the keys are applied), and for a pull
  // checked before it is parked, so a parked pull holds only what it will be answered with.
  Errc find_slots(std::span<const KeyEntry> keys, std::vector<SlotRef>& slots, std::string* why) const {
    return lookup(keys, slots, why);
  }
  // Not in sync mode, where the workers' pushes are summed per step before anything is applied,
  // nor for an identified push (PushId) on a replicated server: a key's record must never hold
  // part of a push that may be sent again, or no server could tell whether that push is in it.
  bool pushes_apply_in_pieces(bool identified = false) const noexcept {
    return !sync_ && !(identified && store_->push_marks() > 0);
  }
  void count_pushes(std::uint64_t keys) noexcept { pushes_.fetch_add(keys, std::memory_order_relaxed); }
  void count_pulls(std::uint64_t keys) noexcept { pulls_.fetch_add(keys, std::memory_order_relaxed); }
  // Copies values under seqlock validation; checks every key before copying any.
  Errc pull(std::span<const KeyEntry> keys, float* out, std::string* why);

  // The clock a worker's reads are bounded by, and whether a read at `clock` may go ahead.
  std::uint64_t read_bound() const noexcept;
  // The same clock, reported in every mode (ASP included) so clients can measure staleness.
  std::uint64_t observed_bound() const noexcept;
  bool pull_allowed(std::uint32_t worker, std::uint64_t clock) const noexcept;
  // A worker's pull carries the clock it has announced (its clock op precedes the pull on the
  // same connection), so a later one can only come from a broken or hostile peer, and would
  // wait out the whole timeout for nothing: invalid_argument.
  Errc check_pull_clock(std::uint32_t worker, std::uint64_t clock, std::string* why) const;
  // Parks a pull until pull_allowed(worker, clock) holds, the timeout passes, or shutdown.
  void park_pull(std::uint32_t worker, std::uint64_t clock, std::unique_ptr<Parked> op);

  // Sets the worker's clock; resumes whatever it unblocks. Returns the read bound after it.
  std::uint64_t advance_clock(std::uint32_t worker, std::uint64_t clock);
  // The worker has gone (disconnected or finished): finish or evict it per policy.
  void worker_left(std::uint32_t worker, bool cleanly);
  // The worker connected (again): a failure recorded because it disconnected is withdrawn,
  // since a worker that reconnects (e.g. after a server restart) has not died.
  void worker_joined(std::uint32_t worker);

  // Completes when all live workers reached generation `generation`. With a replicator, the
  // worker enters it once the replicas know it has: a server restarted with --rejoin then knows
  // every arrival it counted, and a worker sending a barrier again after the restart is not left
  // waiting for workers that passed it and never send it again.
  void barrier(std::uint32_t worker, std::uint64_t generation, std::unique_ptr<Parked> op);
  // A rejoining server takes back the barrier generation its replicas say `worker` entered, and
  // an eviction they say it made.
  void restore_barrier(std::uint32_t worker, std::uint64_t generation);
  void restore_eviction(std::uint32_t worker);

  // Replication. A key's record is [its version: the origin's epoch and seqlock version | update
  // count | each worker's push mark (PushId) | value | optimizer state], the words as 2 floats
  // each: record_floats(length) floats. The epoch is the origin's start time (ns), so a restarted
  // origin's records are newer. The marks say which pushes the value holds, so a push retried on
  // a server restored from the records is applied once.
  // In sync mode the key's pending steps follow (SyncAccumulator::export_state), so a replica
  // holds the partial sums its origin acknowledged.
  static constexpr std::uint32_t kRecordHeaderFloats = 6;
  std::uint64_t record_floats(std::uint32_t length) const noexcept {
    return record_head_ + std::uint64_t{length} * (1 + spv_) + (sync_ ? sync_->state_floats(length) : 0);
  }
  // This server's replica of `origin` (one of options().replica_of) takes the records.
  Errc apply_replica(std::uint32_t origin, std::span<const KeyEntry> keys, const float* records, std::string* why);
  // `connection`: the transport's tag of the connection the mark came on. A transfer's syncing
  // mark makes it the one the origin's table frames are taken from, and drops the copies of the
  // origin's tables (its transfer sends them again).
  // A syncing mark also carries the origin's incarnation (`epoch_seconds`: its start, in
  // seconds), which the copies then report: a rejoin prefers a later incarnation's copies to
  // an earlier one's, whatever their positions in the table stream.
  Errc mark_replica(std::uint32_t origin, ReplicaMark mark, std::string* why, std::uint64_t connection = 0,
                    std::uint32_t epoch_seconds = 0);
  // A `replicate` request as every backend takes it: records for `keys`, or, with no keys, the
  // mark `mark` (a ReplicaMark's value; anything else is a protocol error).
  Errc take_replicate(std::uint32_t origin, std::uint32_t mark, std::span<const KeyEntry> keys, const float* records,
                      std::string* why, std::uint64_t connection = 0, std::uint32_t epoch_seconds = 0);
  // This server's incarnation in seconds, as its syncing marks carry it.
  std::uint32_t epoch_seconds() const noexcept { return static_cast<std::uint32_t>(epoch_ / 1000000000u); }
  // The replica of `origin` learns a word of `worker` there, kept if higher than what it holds (so
  // that a restarted origin knows every clock, barrier arrival and eviction it acknowledged).
  Errc apply_replica_word(WorkerWord word, std::uint32_t origin, std::uint32_t worker, std::uint64_t value,
                          std::string* why);
  // Each worker's word in the replica of `origin`, or this server's own when origin is its id
  // (empty without workers).
  Errc replica_words(WorkerWord word, std::uint32_t origin, std::vector<std::uint64_t>* values, std::string* why) const;
  // The records of `keys` (lengths are record lengths) from the replica of `origin`, or from this
  // server's own store when origin is its own id.
  Errc read_records(std::uint32_t origin, std::span<const KeyEntry> keys, float* out, std::string* why);
  // Every key of the replica of `origin` (or of this server's own store) with its value length,
  // and whether that replica is synced (the own store always is).
  Errc replica_keys(std::uint32_t origin, std::vector<std::pair<Key, std::uint32_t>>* keys, bool* synced,
                    std::string* why);
  // What replica_index answers for `origin`: every key with its value length, whether the replica
  // is synced, and every word of every worker (all clocks, then generations, then evictions).
  Errc replica_index(std::uint32_t origin, std::vector<std::pair<Key, std::uint32_t>>* keys, bool* synced,
                     std::vector<std::uint64_t>* words, std::string* why);
  // The own store takes the records where they are newer than what it holds (a rejoining server
  // restoring its keys from its replicas).
  Errc restore_records(std::span<const KeyEntry> keys, const float* records, std::string* why);
  // Failover: a sealed replica of `origin` refuses its frames (permission), so that nothing
  // `origin` ships after the seal is acknowledged by this server; a frame being applied finishes
  // first. Unsealed again when the takeover it was for does not happen.
  Errc seal_replica(std::uint32_t origin, bool seal, std::string* why);
  // Failover's hand-back: runs `fill` with the sealed replica of `origin` writable from this
  // thread alone, through the replica calls above (the origin's own frames stay refused).
  Errc refill_sealed_replica(std::uint32_t origin, const std::function<Errc(std::string*)>& fill, std::string* why);
  // Whether the replica of `origin` holds all of its keys (a full transfer completed), and the
  // incarnation (start, seconds) that transferred them.
  bool replica_synced(std::uint32_t origin, std::uint32_t* incarnation = nullptr) const;
  // Which transfer the replica of `origin` holds (its syncing mark's connection tag): it changes
  // with every transfer that restarts the copy. 0 if none came.
  std::uint64_t replica_transfer(std::uint32_t origin) const;
  void set_replicator(Replicator* replicator) noexcept { replicator_ = replicator; }
  void set_membership(Membership* membership) noexcept { membership_ = membership; }
  Membership* membership() const noexcept { return membership_; }
  Replicator* replicator() const noexcept { return replicator_; }
  // Whether another server of a ring has business here: replicas to ship to, copies kept for
  // others, or failover (votes, and a takeover's start, which a restarting origin reads).
  bool takes_server_peers() const noexcept { return replicator_ || !options_.replica_of.empty() || membership_; }

  // Embedding tables (docs/ARCHITECTURE.md, "Embedding tables"), ids below kMaxTables.
  // Creates table `id`, or checks that the table of that id was created with this very spec
  // (the first creator wins, as with init; another spec is invalid_argument). A spec without
  // max_rows gets the rows the table memory budget has left; one whose rows at its cap would
  // pass the budget is refused (capacity). A replicated server refuses these three (unsupported)
  // unless its transport ships rows (EngineOptions::replicate_tables). *created: whether this
  // call made the table.
  Errc create_table(std::uint32_t id, const TableSpec& spec, std::string* why, bool* created = nullptr);
  // Rows of `ids` (each entry's length must be the table's dimension) into out, one after another.
  Errc table_pull(std::uint32_t id, std::span<const KeyEntry> ids, float* out, std::string* why);
  // An identified push (a retrying client's) is applied once: on a server that keeps table push
  // marks, one at or before its worker's mark of the table is left alone (*duplicate set). The
  // marks are per table, not per row, so such pushes must reach the table one at a time, with
  // the reading of their rows for the replicas: the replicator orders them (push_rows_in_order).
  Errc table_push(std::uint32_t id, std::uint64_t clock, std::span<const KeyEntry> ids, const float* grads,
                  std::string* why, PushId push = {}, bool* duplicate = nullptr);
  // Marks per table (one per worker) when identified table pushes are tracked: on servers whose
  // tables are replicated; 0 elsewhere.
  std::uint32_t table_push_marks() const noexcept { return table_marks_per_table_; }
  std::vector<std::uint64_t> table_marks(std::uint32_t id) const;
  std::uint64_t table_mark(std::uint32_t id, std::uint32_t worker) const;  // 0: none kept
  // Table `id` (null if there is none) and the spec it was created with (for checkpoints).
  EmbeddingTable* table_at(std::uint32_t id, TableSpec* requested = nullptr);
  std::uint64_t table_record_floats(std::uint32_t id) const noexcept;  // 0: no such table

  // Replicas of the origins' tables, applied in the order they come (the origin queues them in
  // the order it read them). replica_table (re)starts the copy of table `id`, empty and without
  // eviction of its own; replica_rows writes rows as the origin holds them ([value | state]
  // each), or, with `records` null, removes them. The origin's cap comes from a peer, so a copy is
  // held to it: the copies together are charged at their caps against this server's table memory
  // (an honest ring's copies take (R-1)/R of it, since create_table charges each table R times),
  // and a copy holds at most twice its cap and kCopySlack rows, room for the rows the origin
  // evicted whose removals are still on their way (so the copies take at most about twice the
  // table memory). Past either, the frame is refused with Errc::capacity and the copy is broken
  // until a new transfer. `position`: the frame's place in the
  // origin's table stream, which a rejoin compares. Frames that come on another connection than
  // the current transfer's (mark_replica) are checked, then dropped: a connection the origin gave
  // up on may still deliver what it had queued, after the new transfer's copy.
  // A copy keeps its origin's push marks: all of them from replica_table (`marks`, empty or one
  // per worker), and one worker's from each replica_rows frame of an identified push (`marked`).
  // Errc::protocol unless `count` push marks are what a copy of origin's table `id` comes with:
  // none, or one per worker (checked before a frame's marks are copied out).
  Errc check_table_marks(std::uint32_t origin, std::uint32_t id, std::uint64_t count, std::string* why) const;
  Errc apply_replica_table(std::uint32_t origin, std::uint64_t connection, std::uint32_t position, std::uint32_t id,
                           const TableSpec& requested, std::uint64_t max_rows, std::span<const std::uint64_t> marks,
                           std::string* why);
  struct RowsMark {
    std::uint32_t worker = 0;
    std::uint64_t mark = 0;
  };
  Errc apply_replica_rows(std::uint32_t origin, std::uint64_t connection, std::uint32_t position, std::uint32_t id,
                          std::span<const KeyEntry> rows, const float* records, std::string* why,
                          const RowsMark* marked = nullptr);
  // Up to max_rows rows (and at most max_bytes of ids and records) of the replica of `origin`'s
  // table `id`, from `cursor` on.
  Errc replica_table_rows(std::uint32_t origin, std::uint32_t id, std::uint32_t cursor, std::uint32_t max_rows,
                          std::uint64_t max_bytes, ReplicaTableRows* out, std::string* why) const;
  // A rejoining server takes table `id` back: created with the spec and cap it had, then the rows.
  Errc restore_table_rows(std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows,
                          std::span<const Key> ids, const float* records, std::string* why);
  // An shm successor takes table `id` over from the files a dead server left: made with the spec
  // and cap it had, on `storage`, whose TableStorage::take_left() gives the table its rows in
  // place. False with *why when the table exists already (then its rows go in one by one) or
  // cannot be made.
  Errc adopt_table(std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows,
                   std::unique_ptr<TableStorage> storage, std::string* why);
  // ... and its push marks (table_push_marks() of them, or none).
  Errc restore_table_marks(std::uint32_t id, std::span<const std::uint64_t> marks, std::string* why);
  Errc check_worker(std::uint32_t worker, std::string* why) const;
  // A replicated server ships clocks and barrier generations in 32 bits (UINT32_MAX standing for
  // a finished worker): invalid_argument for a larger one, which its replicas could not hold.
  Errc check_replicable(std::uint64_t value, const char* what, std::string* why) const;
  // Under the fail policy, why the job can no longer make progress (a worker died or stalled
  // past the timeout); empty while it can.
  std::string failure() const;
  EngineStats stats() const;
  // `external_pushes`: keys applied without the engine (shm clients applying their own pushes);
  // `extra_fields`: more ,"name":value pairs from the transport.
  std::string stats_json(std::uint64_t external_pushes = 0, const JsonObject& extra = {}) const;
  void shutdown();

 private:
  struct Waiter {
    std::uint64_t need;  // read_bound() >= need (pull) / arrivals (barrier)
    std::uint32_t worker;
    bool barrier;
    std::uint64_t generation;
    std::chrono::steady_clock::time_point deadline;
    std::unique_ptr<Parked> op;
  };
  // Finds every key's slot (pipelined) and checks each exists with the requested length.
  Errc lookup(std::span<const KeyEntry> keys, std::vector<SlotRef>& slots, std::string* why) const;
  class EnterBarrier;
  void enter_barrier(std::uint32_t worker, std::uint64_t generation, std::unique_ptr<Parked> op);
  // Evicts a straggler and tells the replicas (not under mu_: shipping may wait for room).
  void evict(std::uint32_t worker);
  void release_ready();
  void watchdog();
  std::string describe_laggard(std::uint64_t need) const;
  std::uint32_t quorum() const noexcept;
  std::uint64_t barrier_arrivals(std::uint64_t generation) const;

  EngineOptions options_;
  std::unique_ptr<Store> store_;
  std::vector<std::byte> clock_storage_;
  std::unique_ptr<ClockTable> clocks_;
  std::unique_ptr<SyncAccumulator> sync_;
  std::uint32_t spv_ = 0;    // optimizer-state floats per value float
  std::uint64_t epoch_ = 0;  // this server's start (system clock, ns): the version of its records
  struct Replica {
    std::uint32_t origin;
    std::unique_ptr<Store> store;
    std::atomic<std::uint32_t> mark{0};  // ReplicaMark, 0 before any transfer
    // Per WorkerWord, one per worker: the origin's.
    std::array<std::unique_ptr<std::atomic<std::uint64_t>[]>, kWorkerWords> words;
    std::unique_ptr<SyncAccumulator> sync;  // sync mode: the origin's pending steps
    // The origin's tables; a copy is replaced whole by replica_table, so readers hold a share.
    mutable std::mutex tables_mu;
    std::array<std::shared_ptr<EmbeddingTable>, kMaxTables> tables;
    std::array<TableSpec, kMaxTables> table_requested{};
    std::array<std::uint64_t, kMaxTables> table_cap{};               // the origin's caps
    std::array<std::uint64_t, kMaxTables> table_charge{};            // each copy's share of copies_charged_
    std::array<std::vector<std::uint64_t>, kMaxTables> table_marks;  // the origin's push marks
    std::uint64_t table_connection = 0;                              // under tables_mu: see mark_replica
    // Held while a table frame is applied, and while replica_table_rows reads a page: a page is
    // of one point of the origin's stream, its marks agreeing with its rows.
    mutable std::mutex table_apply_mu;
    std::atomic<std::uint32_t> table_position{0};
    std::atomic<std::uint32_t> table_epoch{0};  // the incarnation (seconds) of the latest transfer
    // A table frame of the current transfer failed here (no memory): the copy misses something,
    // so no synced mark counts until a new transfer's syncing mark restarts it. Under tables_mu.
    bool tables_broken = false;
    // Held shared while a frame of the origin is applied or the store is read, exclusively to
    // seal the replica or to restart its copy (a syncing mark replaces `store`).
    std::shared_mutex seal_mu;
    bool sealed = false;  // under seal_mu
  };
  std::vector<std::unique_ptr<Replica>> replicas_;
  // What the copies of the predecessors' tables are charged, over every replica: at most
  // options_.table_memory_bytes (see apply_replica_table).
  std::atomic<std::uint64_t> copies_charged_{0};
  static constexpr std::uint64_t kCopySlack = 64;  // rows a copy may hold past twice its cap
  // Under r.tables_mu: drops r's copy of table `id` and its charge.
  void drop_copy(Replica& r, std::uint32_t id) noexcept;
  Replicator* replicator_ = nullptr;
  Membership* membership_ = nullptr;
  // A table is published once whole and never removed while the engine lives, so lookups take
  // no lock.
  std::array<std::atomic<EmbeddingTable*>, kMaxTables> tables_{};
  mutable std::mutex tables_mu_;  // creating one
  std::vector<std::unique_ptr<EmbeddingTable>> table_owner_;
  TableStorageMaker table_storage_;
  std::array<TableSpec, kMaxTables> table_requested_{};  // the spec each table was created with
  std::uint64_t table_bytes_promised_ = 0;               // under tables_mu_
  std::uint32_t table_marks_per_table_ = 0;
  mutable std::mutex table_marks_mu_;
  std::array<std::vector<std::uint64_t>, kMaxTables> table_marks_;  // under table_marks_mu_
  // Table `id`, with the ids of `entries` in `keys` once every entry is checked to be one row of
  // it; null, with *why, if there is no such table or a row is of another length.
  // On a replicated server whose transport does not ship rows: table ops are refused (*why says so).
  bool tables_refused(std::string* why) const;
  // Makes table `id` under tables_mu_ (the caller checked it is absent), charged to the table
  // memory; with the cap `max_rows` when given (a rejoin restores the cap the table had).
  // `storage`: the table's, instead of one from table_storage_.
  Errc make_table(std::uint32_t id, const TableSpec& spec, std::string* why, std::uint64_t max_rows = 0,
                  std::unique_ptr<TableStorage> storage = nullptr);
  // make_table for a table coming back (a rejoin, an adoption) with the spec and cap it had,
  // both checked first: they come from a peer or a file.
  Errc remake_table(std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows,
                    std::unique_ptr<TableStorage> storage, std::string* why);
  // What a table of `spec` takes at the cap `max_rows`; its cap from what is left when 0.
  std::uint64_t table_cost(const TableSpec& spec, std::uint64_t* max_rows) const noexcept;
  EmbeddingTable* table_rows(std::uint32_t id, std::span<const KeyEntry> entries, std::vector<Key>& keys,
                             std::string* why) const;
  Replica* replica(std::uint32_t origin, std::string* why) const;
  Errc sealed(std::uint32_t origin, std::string* why) const;  // a frame refused by a sealed replica
  // A replica's store (its origin's keys), as made at start and again by each full transfer's
  // syncing mark.
  std::unique_ptr<Store> new_replica_store() const;
  // Writes the records into `store` (with its pending steps into `sync`, in sync mode) where
  // they are newer (Store::put_if_newer).
  Errc put_records(Store& store, SyncAccumulator* sync, std::span<const KeyEntry> keys, const float* records,
                   std::string* why);
  std::uint32_t record_length_of(std::uint32_t record_floats) const noexcept;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Waiter> waiters_;
  std::vector<std::uint64_t> barrier_gen_;   // last barrier generation each worker entered
  std::vector<std::uint64_t> barrier_seen_;  // ... or asked to enter (entered once replicated)
  bool stopping_ = false;
  std::string failure_;
  std::uint32_t failure_worker_ = kNoWorker;  // the worker whose disconnect caused failure_
  mutable EngineStats stats_;
  std::atomic<std::uint64_t> pushes_{0}, pulls_{0}, clock_ops_{0}, duplicate_pushes_{0};
  std::uint32_t record_head_ = kRecordHeaderFloats;  // floats before a record's value
  std::thread watchdog_;
};

}  // namespace pskv
