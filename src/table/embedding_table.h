// One embedding table of one server: rows of `dim` floats keyed by 64-bit ids, created when an id
// is admitted, updated by a per-row rule, evicted under a row cap. docs/ARCHITECTURE.md,
// "Embedding tables", gives the layout and why it grows without stopping anyone.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/memory.h"
#include "common/sync.h"
#include "layout/hash.h"
#include "pskv/error.h"
#include "pskv/table.h"
#include "pskv/types.h"
#include "table/table_storage.h"

namespace pskv {

struct TableStats {
  std::uint64_t rows = 0;          // alive now
  std::uint64_t created = 0;       // rows ever created (evicted ones included)
  std::uint64_t evicted = 0;       // rows removed to make room under max_rows
  std::uint64_t not_admitted = 0;  // row updates dropped: the id was not admitted (yet), or no room
  std::uint64_t grows = 0;         // index shards rehashed to twice their buckets
  std::uint64_t segments = 0;      // row segments allocated, those made ahead of the pushes included
  std::uint64_t bytes = 0;         // everything the table has allocated
};

// Rows live in segments of 2^16 that never move once allocated: a table grows by adding a
// segment, and its index by rehashing one shard (of 8192) at a time, so no operation ever waits
// for more than one shard's rehash. A row is [key, chain link, seqlock word] (16 bytes) in one
// array, its floats (64-byte aligned when dim is a multiple of 16) in another, and its optimizer
// state and eviction stamp in two more, allocated only when the spec needs them.
//
// Thread-safety: every member may be called concurrently from any thread. pull() never locks and
// never blocks a writer: it validates what it copied against the row's and the shard's seqlock
// words and retries, so it never returns a torn row or another id's row. push() takes the lock of
// the shard of each id it touches (and try-locks the shard of an eviction victim, so two pushes
// never wait on each other in a cycle). A table that grows past half a segment runs a thread of
// its own, which makes segments ahead of the pushes; the destructor stops and joins it, so a
// table must be destroyed in the process that made it grow (not in a fork()ed child).
//
// With a TableStorage, the segments live where it puts them and every row write is logged
// first: the row's id, floats and state go to the undo record of its index shard (written under
// the shard's lock) before the row's seqlock word turns odd, and the record is cleared once the
// word is even again. A process that dies inside a write thus leaves each row whole, or odd with
// its old bytes in a record, which recover_rows puts back.
class EmbeddingTable {
 public:
  // Throws Error(invalid_argument) when check_table_spec refuses `spec`. The index starts with
  // buckets for `index_rows` rows (spec.max_rows by default): a server gives a table declared
  // without a cap one from its memory, which the table may never approach, and sizes it for 0.
  explicit EmbeddingTable(const TableSpec& spec) : EmbeddingTable(spec, spec.max_rows) {}
  EmbeddingTable(const TableSpec& spec, std::uint64_t index_rows, std::unique_ptr<TableStorage> storage = nullptr);
  ~EmbeddingTable();
  EmbeddingTable(const EmbeddingTable&) = delete;
  EmbeddingTable& operator=(const EmbeddingTable&) = delete;

  const TableSpec& spec() const noexcept { return spec_; }
  std::uint32_t dim() const noexcept { return spec_.dim; }

  // Copies each id's row into out[i * dim ..]; an id without a row reads as its initial value.
  // Creates nothing.
  void pull(std::span<const Key> ids, float* out) const noexcept;
  // Applies grads[i * dim ..] to each id's row in order (a repeated id is updated twice),
  // creating the rows that are admitted. `step`: the pushing worker's clock (RowEviction::step).
  void push(std::span<const Key> ids, const float* grads, std::uint64_t step) noexcept;
  // The value a row of `id` starts with: the same on every server for the same spec.
  void initial_row(Key id, float* out) const noexcept;
  bool contains(Key id) const noexcept;
  TableStats stats() const noexcept;

  // Incremental checkpoints. Once track_changes() is called (before any push), every row a push
  // creates or updates is marked, and every id evicted is listed, until take_changes hands them
  // over: `all` visits every live row instead (a full snapshot), and clears the marks too.
  // visit(id, row floats, state floats) sees a copy validated against the row's seqlock word.
  void track_changes() noexcept { tracking_.store(true, std::memory_order_relaxed); }
  template <class Visit>
  void take_changes(bool all, Visit&& visit, std::vector<Key>* removed);
  // Puts a row back as a checkpoint holds it (created if absent, whatever admission says).
  // False if no row can be had (the cap is full and nothing can be evicted).
  bool restore_row(Key id, const float* row, const float* state) noexcept;
  // Removes id's row, if any (an eviction recorded by a later checkpoint).
  void remove_row(Key id) noexcept;

  // Replication. read_record copies id's row and state as they are now (validated against the
  // row's seqlock word); false if id has no row. Once list_removals() is called, every id whose
  // row goes (evicted, or remove_row) is listed until take_removals hands the list over: an origin
  // ships those to its replicas before the rows it reads after them.
  bool read_record(Key id, float* row, float* state) const noexcept;
  void list_removals() noexcept { listing_.store(true, std::memory_order_relaxed); }
  void take_removals(std::vector<Key>* out);
  // Visits up to max_rows live rows from row index `cursor` on (0 or 1: the first):
  // visit(id, row floats, state floats). Returns the cursor to go on from, 0 past the last row.
  template <class Visit>
  std::uint32_t scan(std::uint32_t cursor, std::uint32_t max_rows, Visit&& visit) const;
  std::uint64_t state_floats_per_row() const noexcept { return state_floats_; }

  // What a spec costs, from this layout: optimizer-state floats per row (Adam's moments and its
  // per-row count), an upper bound on the bytes of one row with its index, and what the table
  // takes empty (its shards and bucket arrays, the segment table, the admission filter). A
  // server charges a table's cap against its table memory with these.
  // Rows are allocated a segment of kSegmentRows at a time.
  static constexpr std::uint32_t kSegmentBits = 16;
  static constexpr std::uint32_t kSegmentRows = 1u << kSegmentBits;
  static std::uint64_t state_floats_for(const TableSpec& spec) noexcept;
  static std::uint64_t row_bytes_bound(const TableSpec& spec) noexcept;
  static std::uint64_t fixed_bytes(const TableSpec& spec) noexcept;
  // What its undo records take, for a table with a TableStorage.
  static std::uint64_t undo_bytes_for(const TableSpec& spec) noexcept {
    return std::uint64_t{undo_stride(spec.dim, state_floats_for(spec))} << kShardBits;
  }

  // The rows a dead process left in a table's storage. `segments[i]`: the memory it published as
  // segment i (empty: none), `undo`: its undo records, both as mapped here and writable. Writes
  // the process died inside are rolled back from their undo records first (into that memory);
  // then visit(id, row floats, state floats) sees every live row, in row order. Throws
  // Error(invalid_argument) when a segment or the records are not the size this spec lays out.
  struct LeftRows {
    std::uint64_t rows = 0;         // live rows visited
    std::uint64_t rolled_back = 0;  // rows put back from an undo record
    std::uint64_t torn = 0;         // rows inside a write that no record covers (visited as they are)
  };
  static LeftRows recover_rows(const TableSpec& spec, std::span<const std::span<std::byte>> segments,
                               std::span<std::byte> undo,
                               const std::function<void(Key id, const float* row, const float* state)>& visit);
  // What this table took over from its storage's TableStorage::take_left() when it was made
  // (zero for a new table): its rows are those, in place.
  const LeftRows& adopted() const noexcept { return adopted_; }

 private:
  static constexpr std::uint32_t kMaxSegments = 1u << (32 - kSegmentBits);
  static constexpr std::uint32_t kShardBits = 13;
  static constexpr std::uint32_t kFreeRow = UINT32_MAX;  // `next` of a row in no chain

  // Reads row `row` whole (floats into out, state into out_state) if it is live; its id.
  bool read_live(std::uint32_t row, Key* id, float* out, float* out_state) const noexcept;
  // The row id holds now (0: none), found under its shard's lock.
  std::uint32_t live_row(Key id) noexcept;
  void mark(std::uint32_t row) noexcept;
  bool take_mark(std::uint32_t row) noexcept;
  bool marks_from(std::uint32_t row) const noexcept;  // any mark among rows [row, row + 64)

  struct RowMeta {
    std::atomic<std::uint64_t> key;
    std::atomic<std::uint32_t> next;     // the following row of its bucket's chain, 0 for none
    std::atomic<std::uint32_t> version;  // odd while its floats are being written
  };
  // An index shard's undo record (with a TableStorage): the row being written (0: none), the id
  // it held, then its floats and state as they were.
  struct UndoHead {
    std::atomic<std::uint32_t> row;
    std::uint32_t reserved;
    std::uint64_t key;
  };
  static std::size_t undo_stride(std::uint32_t dim, std::uint64_t state_floats) noexcept {
    return align_up(sizeof(UndoHead) + (dim + state_floats) * sizeof(float), kCacheLine);
  }
  struct Segment;
  // A shard's bucket array: heads[b] is the first row of bucket b's chain (0: empty). The arrays
  // a table starts with are slices of one mapping (initial_heads_); a rehash's own their memory.
  struct Buckets {
    std::uint32_t mask;
    std::atomic<std::uint32_t>* heads = nullptr;
    std::unique_ptr<std::atomic<std::uint32_t>[]> owned;
  };
  struct alignas(64) Shard {
    SharedMutex lock;
    std::atomic<std::uint32_t> version{0};  // odd while a chain is being relinked
    std::atomic<Buckets*> buckets{nullptr};
    std::uint32_t rows = 0;  // under lock
    // Arrays replaced by a rehash. A reader may still be walking one, so they live as long as the
    // table: together they are smaller than the current one.
    std::vector<std::unique_ptr<Buckets>> all;
  };

  // Under shard's lock, before and after a write of `row` (nothing without a TableStorage).
  void save_undo(const Shard& shard, std::uint32_t row) const noexcept;
  void clear_undo(const Shard& shard) const noexcept;
  RowMeta& meta(std::uint32_t row) const noexcept;
  float* data(std::uint32_t row) const noexcept;
  float* state(std::uint32_t row) const noexcept;
  std::atomic<std::uint32_t>* stamp(std::uint32_t row) const noexcept;
  Shard& shard_of(std::uint64_t hash) const noexcept { return shards_[hash >> (64 - kShardBits)]; }
  // The index's hash of an id, keyed per table: ids are the peers', and unkeyed they could be
  // chosen to share one bucket (a chain walked under its lock at every push).
  std::uint64_t index_hash(Key id) const noexcept { return mix64(id ^ index_key_); }
  // The row of `id` in `shard` (locked by the caller), and the link that points at it.
  std::uint32_t find_locked(Shard& shard, Key id, std::uint64_t hash, std::atomic<std::uint32_t>** link) const noexcept;
  // The prefetch pipeline of a batch (see the .cc). Thread-safety: one per batch and thread.
  class Lookahead;
  // Copies id's row into out; false if it has none. Lock-free, validated.
  bool read_row(Key id, std::uint64_t hash, float* out) const noexcept;
  // Under shard's lock: a new row for id, linked into its chain, holding the initial value; 0
  // when none can be had (at the cap, and nothing could be evicted).
  // Live-count room and free rows taken for one push in blocks that double up to kGrantRows, so
  // that a push creating many rows does not bounce the table's shared counters between the
  // threads pushing at every row; give_back returns what the push did not use.
  static constexpr std::uint32_t kGrantRows = 64;
  struct Grant {
    std::uint64_t live = 0;  // creations already counted in rows_, not made yet
    std::uint64_t created = 0;
    std::uint32_t live_block = 1, row_block = 1;
    std::uint32_t count = 0;  // rows[0, count): free rows held for this push
    std::array<std::uint32_t, kGrantRows> rows;
  };
  std::uint32_t create_row(Shard& shard, Key id, std::uint64_t hash, Grant& grant) noexcept;
  bool take_live(Grant& grant) noexcept;          // false at the cap
  std::uint32_t take_row(Grant& grant) noexcept;  // 0: none left, or no memory for its segment
  void give_back(Grant& grant) noexcept;
  bool ensure_segment(std::uint32_t row) noexcept;
  // A segment's memory, carved and its rows marked free; null without memory. `touch`: every
  // page written too, so that the rows written into it later take no page fault.
  std::unique_ptr<Segment> make_segment(bool touch) const noexcept;
  // The bytes of a segment's arrays, in the order make_segment carves them.
  struct SegmentLayout {
    std::size_t meta, data, state, stamps, marks;
    std::size_t bytes() const noexcept { return meta + data + state + stamps + marks; }
  };
  static SegmentLayout segment_layout_for(const TableSpec& spec) noexcept;
  // recover_rows' first half: checks the sizes, puts back the rows left inside a write; how many.
  static std::uint64_t roll_back_left(const TableSpec& spec, std::span<const std::span<std::byte>> segments,
                                      std::span<std::byte> undo);
  // Carves `memory` into a segment's arrays (make_segment's layout).
  std::unique_ptr<Segment> carve_segment(std::unique_ptr<MemoryResource> memory) const noexcept;
  // The constructor's last step with left segments: installs them and links their live rows.
  void take_left(TableStorage::Left left);
  SegmentLayout segment_layout() const noexcept { return segment_layout_for(spec_); }
  // Publishes segment `s` (null until now); under grow_mu_. False (and `seg` dropped) when the
  // table's storage cannot record it.
  [[nodiscard]] bool install_segment(std::uint32_t s, std::unique_ptr<Segment> seg) noexcept;
  // Growth ahead of the pushes: once half of the first segment is handed out, the next segments
  // are made and their pages touched by the table's preparer thread (started on first need),
  // so that no push waits for a segment's allocation or its first page faults (a few ms each
  // for fresh memory on a VM, and the other I/O threads wait on grow_mu_ for the same segment).
  void prepare_after(std::uint64_t handed_out) noexcept;
  void prepare_segments() noexcept;  // the preparer thread
  // Row numbers below this have been handed to a grant (used or free); none at or above it has.
  std::uint32_t rows_handed_out() const noexcept {
    return static_cast<std::uint32_t>(std::min<std::uint64_t>(next_row_.load(std::memory_order_acquire), kFreeRow));
  }
  // Takes a row out of a full table for `locked` (the shard the caller holds). 0 if none.
  std::uint32_t evict_one(Shard& locked) noexcept;
  void unlink(Shard& shard, std::atomic<std::uint32_t>* link, std::uint32_t row) noexcept;
  void grow(Shard& shard) noexcept;
  bool admitted(Key id) noexcept;
  std::uint32_t victim_score(std::uint32_t row) const noexcept;
  void touch(std::uint32_t row, std::uint64_t step) const noexcept;
  // The seqlock writer's side, for a row's or a shard's word (under the shard's lock): odd while
  // the writer is inside, and never back to a value a reader may have seen.
  static std::uint32_t begin_write(std::atomic<std::uint32_t>& version) noexcept;
  static void end_write(std::atomic<std::uint32_t>& version, std::uint32_t begun) noexcept;
  // A reader's wait on a row of `id` whose word it found odd: a pause for the first kOddLooks
  // looks, then a check under the id's shard lock, which makes even a word no writer holds odd
  // (left so in a TableStorage's files). True if it did.
  static constexpr std::uint32_t kOddLooks = 4096;
  bool settle_odd(RowMeta& m, Key id, std::uint32_t* looks) const noexcept;

  TableSpec spec_;
  std::unique_ptr<TableStorage> storage_;      // null: segments are the process's own memory
  std::shared_ptr<SliceArena> segment_arena_;  // without storage_: where segments are carved
  std::unique_ptr<MemoryResource> undo_;       // with storage_: one record per shard, undo_stride_ apart
  std::size_t undo_stride_ = 0;
  LeftRows adopted_;
  std::uint64_t index_key_;         // random per table: see index_hash
  std::uint64_t state_floats_ = 0;  // per row
  bool stamps_ = false;
  std::unique_ptr<Shard[]> shards_;
  // Every shard's first bucket array, in one mapping on huge pages: a capped table's index is
  // sized for 10^8 rows up front (512 MiB), and in 4 KiB pages each lookup would miss the TLB.
  std::unique_ptr<HeapMemory> initial_heads_;
  std::unique_ptr<std::atomic<Segment*>[]> segments_;
  std::mutex grow_mu_;  // allocating a segment
  std::mutex prepare_mu_;
  std::condition_variable prepare_cv_;
  std::atomic<std::uint32_t> prepare_up_to_{0};            // the last segment wanted ahead; written under prepare_mu_
  std::atomic<bool> prepare_stop_{false};                  // set under prepare_mu_; the touch loop reads it too
  static constexpr std::size_t kPrepareBytes = 32u << 20;  // how far ahead a bounded table goes
  std::uint64_t prepare_limit_rows_ = 0;                   // rows past which nothing is made ahead (0: no bound)
  std::uint64_t prepare_lead_ = 0;                         // segments made ahead (0: none)
  std::thread preparer_;                                   // started under prepare_mu_
  std::uint32_t prepare_from_ = 1;                         // the first segment the preparer may make
  // Rows never handed out start here (up to kFreeRow). The counters pushes move get a cache
  // line each: two I/O threads creating rows would otherwise share one.
  alignas(64) std::atomic<std::uint64_t> next_row_{1};
  alignas(64) std::atomic<std::uint64_t> rows_{0};
  alignas(64) std::atomic<std::size_t> free_count_{0};  // free_rows_.size(), read without its lock
  // The admission filter (admit_after > 1): two rows of saturating counters, count-min.
  std::unique_ptr<std::atomic<std::uint8_t>[]> filter_;
  alignas(64) mutable std::atomic<std::uint64_t> tick_{0};  // LRU's clock: one per operation
  alignas(64) std::atomic<std::uint64_t> created_{0}, evicted_{0}, not_admitted_{0}, grows_{0};
  std::atomic<std::uint64_t> index_bytes_{0}, segment_count_{0}, segment_bytes_{0};
  std::atomic<std::uint64_t> sample_seed_{0x9e3779b97f4a7c15ull};
  std::atomic<bool> tracking_{false};
  std::mutex removed_mu_;
  std::vector<Key> removed_;  // ids evicted since the last take_changes, while tracking
  std::atomic<bool> listing_{false};
  std::vector<Key> removals_;  // under removed_mu_: ids gone since the last take_removals, while listing
  void note_removal(Key id);   // under the id's shard lock, so no push makes it again before it is listed
  std::mutex free_mu_;
  std::vector<std::uint32_t> free_rows_;  // rows of removed ids and of grants given back, reused first
};

template <class Visit>
std::uint32_t EmbeddingTable::scan(std::uint32_t cursor, std::uint32_t max_rows, Visit&& visit) const {
  std::vector<float> row(spec_.dim), st(state_floats_);
  const std::uint32_t made = rows_handed_out();
  std::uint32_t seen = 0;
  for (std::uint32_t r = std::max<std::uint32_t>(cursor, 1); r < made; ++r) {
    if (seen == max_rows) return r;
    if (segments_[r >> kSegmentBits].load(std::memory_order_acquire) == nullptr) {
      r |= kSegmentRows - 1;
      continue;
    }
    Key id;
    if (!read_live(r, &id, row.data(), st.data())) continue;
    visit(id, row.data(), st.data());
    ++seen;
  }
  return 0;
}

template <class Visit>
void EmbeddingTable::take_changes(bool all, Visit&& visit, std::vector<Key>* removed) {
  {
    std::lock_guard lock(removed_mu_);
    removed->swap(removed_);
    removed_.clear();
  }
  if (all) removed->clear();  // a full snapshot lists what is live; nothing before it matters
  std::vector<float> row(spec_.dim), st(state_floats_);
  const std::uint32_t made = rows_handed_out();
  for (std::uint32_t r = 1; r < made; ++r) {
    if (segments_[r >> kSegmentBits].load(std::memory_order_acquire) == nullptr) {
      r |= kSegmentRows - 1;  // a segment still being allocated holds no live row yet
      continue;
    }
    if (!all && (r & 63) == 0 && !marks_from(r)) {
      r += 63;  // none of these 64 rows changed
      continue;
    }
    if (!take_mark(r) && !all) continue;
    Key id;
    if (read_live(r, &id, row.data(), st.data())) visit(id, row.data(), st.data());
  }
  // An id evicted and made again since the last call may have had its new row taken by that
  // call's scan: the removal is replayed first, so its row must follow it here.
  for (const Key id : *removed) {
    const std::uint32_t r = live_row(id);
    Key again;
    if (r != 0 && read_live(r, &again, row.data(), st.data()) && again == id) visit(id, row.data(), st.data());
  }
}

}  // namespace pskv
