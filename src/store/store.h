// The lock-striped parameter store: uint64 keys mapped to fixed-length float32 vectors, laid out
// in one contiguous region so that the same bytes can live on the heap, in a shared-memory
// segment, or under one RDMA memory region, and be checkpointed in one pass.
//
// Region layout (all offsets from the region base, every part 64-byte aligned):
//   StoreHeader | stripe locks | key index | value arena | optimizer-state arena
// A value slot is a 64-byte SlotHeader (seqlock word first) followed by the floats, padded to 64 B.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "common/memory.h"
#include "common/sync.h"
#include "pskv/error.h"
#include "pskv/update_rule.h"

namespace pskv {

using Key = std::uint64_t;

struct StoreOptions {
  std::uint64_t max_keys = 1 << 16;          // key index capacity
  std::uint64_t arena_bytes = 64ull << 20;   // values incl. 64 B slot headers
  std::uint32_t stripes = 1024;              // power of two
  UpdateRuleConfig rule{};
};

struct alignas(64) SlotHeader {
  std::atomic<std::uint64_t> seq;  // seqlock: odd while a writer is inside
  std::uint64_t key;
  std::uint32_t length;            // floats
  std::uint32_t flags;
  std::uint64_t state_offset;      // into the state arena; unused when the rule has no state
  std::uint64_t update_count;      // updates applied so far (Adam's t)
  std::uint64_t reserved[3];

  float* values() noexcept { return reinterpret_cast<float*>(this + 1); }
  const float* values() const noexcept { return reinterpret_cast<const float*>(this + 1); }
};
static_assert(sizeof(SlotHeader) == 64);

inline constexpr std::size_t slot_bytes(std::uint32_t length) noexcept {
  return sizeof(SlotHeader) + align_up(std::size_t{length} * sizeof(float), kCacheLine);
}

inline std::uint64_t mix64(std::uint64_t x) noexcept {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

// Result of a read: the seqlock version the copy was validated against.
struct ReadResult {
  Errc status = Errc::ok;
  std::uint64_t version = 0;
};

// Undo record of one update made by a process that may be killed mid-way (a shm worker applying
// its own push). It lives in memory that outlives the process, next to an undo buffer of
// value + optimizer-state floats; Store::recover uses both to roll the update back.
enum class UndoPhase : std::uint32_t { idle = 0, locking = 1, saved = 2, applied = 3 };
struct UndoRecord {
  std::atomic<UndoPhase> phase;
  std::uint32_t stripe;        // the lock the writer takes or holds (phase != idle)
  std::uint64_t slot_offset;   // SlotHeader, from the region base (phase saved)
  std::uint64_t seq;           // the slot's seqlock before the update
  std::uint64_t update_count;  // and its update count
};

// Thread-safety: all member functions may be called concurrently from any thread, and from any
// process that maps the same region. init/push/assign take the key's stripe lock (so must only be
// called by processes whose death ends the job); apply_logged is for processes that may die, and
// recover repairs after them. find/pull never lock and never block writers.
class Store {
 public:
  static std::size_t required_bytes(const StoreOptions& options);
  // Lays out an empty store in `memory` (at least required_bytes). Throws Error on bad options.
  static std::unique_ptr<Store> create(std::unique_ptr<MemoryResource> memory, const StoreOptions& options);
  // Opens a store another process laid out; validates magic, version and sizes.
  static std::unique_ptr<Store> attach(std::unique_ptr<MemoryResource> memory);

  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Creates `key` with `initial` as its value. If the key exists with the same length nothing is
  // changed and ok is returned (first initialiser wins); another length gives length_mismatch.
  Errc init(Key key, std::span<const float> initial);
  // Creates `key` with `length` zeros (same first-wins semantics).
  Errc init_zero(Key key, std::uint32_t length);

  // nullptr when the key does not exist. The pointer stays valid for the store's lifetime.
  SlotHeader* find(Key key) const noexcept {
    for (std::uint64_t i = mix64(key) & index_mask_;; i = (i + 1) & index_mask_) {
      const std::uint64_t slot = index_[i].slot.load(std::memory_order_acquire);
      if (slot == 0) return nullptr;
      if (index_[i].key.load(std::memory_order_relaxed) == key) return reinterpret_cast<SlotHeader*>(base_ + slot - 1);
    }
  }

  // Looks up n keys (key_of(i) gives the i-th) into out[0..n). Software-pipelined: the index
  // bucket of key i+16 is prefetched while key i is resolved, and each found slot's first two
  // lines are prefetched for the pass that copies or updates them, so the cache misses of a
  // large random batch overlap instead of adding up.
  template <class KeyOf>
  void find_batch(std::size_t n, KeyOf&& key_of, SlotHeader** out) const noexcept {
    constexpr std::size_t kAhead = 32;
    for (std::size_t i = 0; i < std::min(n, kAhead); ++i) prefetch_bucket(key_of(i));
    for (std::size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) prefetch_bucket(key_of(i + kAhead));
      out[i] = find(key_of(i));
      if (out[i]) prefetch_slot(*out[i]);
    }
  }
  void prefetch_bucket(Key key) const noexcept { __builtin_prefetch(&index_[mix64(key) & index_mask_]); }
  // The header line and the first value line of a slot.
  static void prefetch_slot(const SlotHeader& slot) noexcept {
    __builtin_prefetch(&slot);
    __builtin_prefetch(reinterpret_cast<const char*>(&slot) + 64);
  }

  // Copies the key's value into `out` (exact length required), validated by the seqlock.
  ReadResult pull(Key key, std::span<float> out) const noexcept;
  static ReadResult read_slot(const SlotHeader& slot, float* out) noexcept;
  // read_slot for a server thread, which may take the key's stripe lock: after a few copies
  // spoiled by writers it copies under the lock, so a large value that writers keep changing
  // (a push applied in pieces changes it every few microseconds) is still read. Not for
  // processes that may die (a reader killed under the lock would leave it held).
  ReadResult read_slot_or_lock(const SlotHeader& slot, float* out) const noexcept;
  // The slot's seqlock version once no writer is inside (even). Readers that copy the values
  // some other way compare it with seq afterwards (after an acquire fence) to detect a write.
  static std::uint64_t stable_version(const SlotHeader& slot) noexcept;

  // Applies the store's update rule with `grad`; lr is multiplied by lr_scale.
  Errc push(Key key, std::span<const float> grad, float lr_scale = 1.0f) noexcept;
  // Applies an explicit rule (assign/add are the useful overrides).
  Errc apply(Key key, std::span<const float> grad, const UpdateRuleConfig& rule, float lr_scale = 1.0f) noexcept;
  Errc apply_slot(SlotHeader& slot, const float* grad, const UpdateRuleConfig& rule, float lr_scale) noexcept;
  // One piece of a push that is applied as it arrives rather than staged whole: the store's rule
  // over floats [begin, begin + n) of the slot, atomic for that piece only. `*step` 0 marks the
  // push's first piece, which counts the update and sets *step for the pieces after it, so every
  // piece of one push sees the same step (Adam's bias correction).
  void apply_part(SlotHeader& slot, std::size_t begin, const float* grad, std::size_t n, std::uint64_t* step) noexcept;

  // The store's rule applied by `owner` (a SharedMutex owner tag unique to that process), which
  // may die at any instant: the old value, state and count go to `undo` (room for
  // undo_floats(slot)) and `log` says how far it got. Errc::timeout if the stripe lock was still
  // held after `patience`, with nothing changed.
  Errc apply_logged(SlotHeader& slot, const float* grad, float lr_scale, std::uint32_t owner, UndoRecord& log,
                    float* undo, std::chrono::nanoseconds patience) noexcept;
  std::size_t undo_floats(const SlotHeader& slot) const noexcept { return std::size_t{slot.length} + state_floats(slot); }
  // The slot whose header is `offset` bytes from the region base, if the index knows one there;
  // nullptr for anything else (offsets from other processes are untrusted).
  SlotHeader* slot_at(std::uint64_t offset) const noexcept;
  // The owner tag holding key's stripe lock (0: free), for diagnostics.
  std::uint32_t stripe_holder(Key key) const noexcept { return stripe_lock(key).holder(); }
  // After `owner` died: if it held a stripe lock per `log`, rolls a half-made update back from
  // `undo` (undo_capacity floats) and releases the lock. The record is untrusted (its writer may
  // have been hostile) and is checked against the store. Call from one thread at a time per log.
  enum class Recovery { nothing, released, rolled_back };
  Recovery recover(UndoRecord& log, std::uint32_t owner, const float* undo, std::size_t undo_capacity) noexcept;

  // Batches: keys[i] <-> values[i]. Stops at the first failure and returns its index in
  // *failed_at (keys before it are done). One stripe lock acquisition per key.
  Errc pull_batch(std::span<const Key> keys, std::span<const std::span<float>> out, std::size_t* failed_at = nullptr) const noexcept;
  Errc push_batch(std::span<const Key> keys, std::span<const std::span<const float>> grads, float lr_scale = 1.0f,
                  std::size_t* failed_at = nullptr) noexcept;

  // Checkpoint support: a consistent copy of value, optimizer state and update count (taken
  // under the stripe lock, since optimizer state has no seqlock), and the reverse for restore.
  // `state` must hold state_floats(slot) floats (may be null when that is 0).
  std::uint32_t state_floats(const SlotHeader& slot) const noexcept;
  void snapshot_slot(SlotHeader& slot, float* value, float* state, std::uint64_t* update_count) noexcept;
  Errc restore_slot(Key key, std::span<const float> value, std::span<const float> state, std::uint64_t update_count);

  const UpdateRuleConfig& rule() const noexcept;
  std::uint32_t stripes() const noexcept;
  std::uint64_t key_count() const noexcept;
  std::uint64_t max_keys() const noexcept;
  std::uint64_t value_bytes_used() const noexcept;
  std::uint64_t value_bytes_capacity() const noexcept;

  // The whole region (what an RDMA backend registers) and the value arena within it.
  std::byte* region() noexcept { return base_; }
  std::size_t region_size() const noexcept { return memory_->size(); }
  std::byte* value_arena() noexcept;
  std::size_t slot_offset(const SlotHeader& slot) const noexcept {
    return static_cast<std::size_t>(reinterpret_cast<const std::byte*>(&slot) - base_);
  }

  // Visits every key in creation order (arena order). The callback gets the slot; values must be
  // read with read_slot if writers may be active.
  template <class F>
  void for_each_slot(F&& visit) const {
    std::uint64_t used = used_bytes_acquire();
    std::uint64_t off = 0;
    while (off < used) {
      auto* slot = reinterpret_cast<SlotHeader*>(value_arena_const() + off);
      visit(*slot);
      off += slot_bytes(slot->length);
    }
  }

 private:
  struct Header;
  // Lookups read `slot` (acquire) and then `key`; an insert writes `key` first and publishes
  // with `slot` (release), so a reader that sees a slot sees its key. Never removed.
  struct IndexEntry {
    std::atomic<std::uint64_t> key;
    std::atomic<std::uint64_t> slot;  // offset of the SlotHeader from the region base + 1; 0 = empty
  };
  explicit Store(std::unique_ptr<MemoryResource> memory);
  Header& header() const noexcept;
  IndexEntry* index() const noexcept;
  std::uint32_t stripe_of(Key key) const noexcept;
  SharedMutex& stripe_lock(Key key) const noexcept;
  SharedMutex& stripe_at(std::uint32_t stripe) const noexcept;
  float* state_of(SlotHeader& slot) const noexcept;
  std::byte* value_arena_const() const noexcept;
  std::uint64_t used_bytes_acquire() const noexcept;
  Errc create_slot(Key key, std::uint32_t length, const float* initial);
  // One seqlock-validated copy of the slot's values; false if a writer got in (copy again).
  static bool copy_if_unchanged(const SlotHeader& slot, float* out, std::uint64_t* version) noexcept;
  // `rule` over floats [begin, begin + n) under the stripe lock and the seqlock; *step 0 counts
  // the update and sets *step (apply_slot: the whole value; apply_part: one piece).
  void apply_locked(SlotHeader& slot, const UpdateRuleConfig& rule, std::size_t begin, const float* grad,
                    std::size_t n, float lr_scale, std::uint64_t* step) noexcept;
  // The same for a caller that already holds the stripe lock (apply_logged, after its undo copy).
  void apply_seqlocked(SlotHeader& slot, const UpdateRuleConfig& rule, std::size_t begin, const float* grad,
                       std::size_t n, float lr_scale, std::uint64_t* step) noexcept;
  // Replaces value, optimizer state (state_floats(slot) floats) and update count under the
  // seqlock; the caller holds the stripe lock.
  void overwrite_slot(SlotHeader& slot, const float* value, const float* state, std::uint64_t update_count) noexcept;

  std::unique_ptr<MemoryResource> memory_;
  // Immutable after construction; cached so hot paths make no virtual calls.
  std::byte* base_;
  IndexEntry* index_ = nullptr;
  std::uint64_t index_mask_ = 0;
};

}  // namespace pskv
