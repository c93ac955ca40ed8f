// Aggregate-then-apply: gathers the gradients of step t from N workers (or the first K of N, with
// N - K backup workers as in TF's SyncReplicasOptimizer), then applies their mean once through the
// store's update rule, with the learning rate scaled linearly by the number averaged (Ray's sync PS).
// A gradient for a step that was already applied arrives late and is dropped, never carried into
// a later step.
//
// A key's pending steps live in one block of 64-bit words (SyncSpace: process memory, or a file a
// successor reads after this process is killed, shm://NAME?adopt=1), laid out so that a kill at
// any instant leaves a state a successor can go on from: window + 1 entries of [step | count |
// contributor bitmap | sum], and a control word [next step (48 bits) | mask of the entries in use
// (16 bits)]. An accumulation writes the new sum into a free entry and then stores the control
// word once (copy on write: the entry it replaces is never touched), and an applied step leaves
// its entry by the same store, made with the store's update, so a step is applied exactly once.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "store/store.h"

namespace pskv {

struct SyncOptions {
  std::uint32_t num_workers = 1;  // N
  std::uint32_t required = 0;     // K; 0 means N
  bool linear_lr_scaling = true;  // lr * K when applying the mean of K gradients
  std::uint32_t window = 4;       // steps ahead of the oldest pending one that may be buffered, 1-15
  // Replicated (ShardEngine ships each key's pending steps with its record): every change of a
  // key's pending steps also moves its store version, which orders the records.
  bool replicated = false;
};

enum class SyncOutcome : std::uint8_t {
  accumulated,    // counted; the step still waits for more workers
  applied,        // this gradient completed its step (and maybe later buffered ones)
  dropped_late,   // the step was already applied without it
  duplicate,      // this worker already contributed to this step
  too_far_ahead,  // step is beyond the buffering window
  rejected,       // bad key, length or worker id: see the Errc
};

// Where the keys' pending steps live. Thread-safety: allocate() may be called from several
// threads at once (each under one of the accumulator's stripes).
class SyncSpace {
 public:
  virtual ~SyncSpace() = default;
  // `words` words for the pending steps of `key` (`length` floats), kept as long as the space,
  // reading as zero. Only the first may be written before back() covered the rest: a key's
  // entries are backed as its steps first need them. Throws Error when there is no room.
  virtual std::uint64_t* allocate(Key key, std::uint32_t length, std::size_t words) = 0;
  // Makes `words` words from `at` (inside an allocated block) writable, or throws Error.
  virtual void back(std::uint64_t* at, std::size_t words) = 0;
};

// Written by a thread that applies a step through Store::apply_logged, where a successor reads it
// if the process dies (UndoLog::sync_mark): while `active`, `key`'s control word turns to
// `control` in the same instant as the update counts as applied. A successor that finds the word
// at `control` keeps the update; otherwise the store's undo record rolls it back.
struct alignas(64) SyncApplyMark {
  std::atomic<std::uint64_t> active;
  std::uint64_t key;
  std::uint64_t control;
};

struct SyncStats {
  std::uint64_t applied_steps = 0;
  std::uint64_t dropped_late = 0;
  std::uint64_t duplicates = 0;
};

// Thread-safety: add() may be called concurrently from any number of threads; per-key state is
// guarded by a striped mutex, and applies go through the store's own stripe locks.
class SyncAccumulator {
 public:
  // `space` null: process memory.
  SyncAccumulator(Store& store, SyncOptions options, std::shared_ptr<SyncSpace> space = nullptr);

  // `undo` (a process a successor may adopt): a completed step is applied with the store's undo
  // record and undo->sync_mark, so a kill leaves it either applied and recorded, or neither.
  SyncOutcome add(Key key, std::uint32_t worker, std::uint64_t step, std::span<const float> grad, Errc* error = nullptr,
                  const UndoLog* undo = nullptr);
  // Checked for every key of a push before any is summed, so that a refused push leaves nothing
  // summed: makes room for `key`'s pending steps (Errc::capacity or io when the space has none)
  // and says whether add() would take (or drop as late) a gradient for `step` rather than refuse
  // it as too far ahead (Errc::invalid_argument, the key's next step in *next). Stays ok once
  // ok: the next step only moves forward.
  Errc prepare(Key key, std::uint32_t length, std::uint64_t step, std::uint64_t* next = nullptr);
  // The first step of `key` that has not been applied yet (0 before any).
  std::uint64_t next_step(Key key) const;
  SyncStats stats() const;
  const SyncOptions& options() const noexcept { return options_; }

  // A key's pending steps as they travel in its replication record: [next step | window x (step |
  // contributor count | contributor bitmap | sum)], each 64-bit word as 2 floats, unused entries
  // zero. state_floats(length) floats, fixed for a key of `length` floats.
  std::uint64_t state_floats(std::uint32_t length) const noexcept {
    return state_fixed_floats() + std::uint64_t{options_.window} * length;
  }
  std::uint64_t state_fixed_floats() const noexcept {
    return 2 + std::uint64_t{options_.window} * (4 + 2 * bitmap_words());
  }
  std::uint32_t state_floats_per_value() const noexcept { return options_.window; }
  // Runs f() holding the key's stripe: its pending steps do not change meanwhile, nor its value
  // in the store (add() applies under it).
  template <class F>
  decltype(auto) with_key(Key key, F&& f) const {
    std::lock_guard guard(stripe(key).mu);
    return f();
  }
  // Under with_key(key).
  void export_state(Key key, std::uint32_t length, float* out) const;
  // How many of an exported state's floats say anything: its next step and the entries in use,
  // which export_state packs first (the rest are zero). 2 when no step is pending (a state that
  // short is any accumulator's, whatever its window and workers), 0 for a key still at step 0.
  std::uint64_t used_state_floats(std::uint32_t length, const float* state) const noexcept;
  // The floats of one entry in use of an exported state, for `num_workers` workers.
  static std::uint64_t state_entry_floats(std::uint32_t num_workers, std::uint32_t length) noexcept {
    return 4 + 2 * ((std::uint64_t{num_workers} + 63) / 64) + length;
  }
  static constexpr std::uint32_t kMaxWindow = 15;
  // Whether `in` could be a key's pending steps here (it comes from a peer): Errc::protocol,
  // with `why`, if not. Checked before anything of the record is written.
  // `complete_ok`: a next step with all its contributors is taken (adopt_block applies it).
  Errc check_state(std::uint32_t length, const float* in, std::string* why, bool complete_ok = false) const;
  // Under with_key(key), after check_state. Not atomic against a kill: for replicas and for a
  // successor before it serves. Throws Error when the space has no room.
  void import_state(Key key, std::uint32_t length, const float* in);

  // A key's block of pending steps as a dead process left it (SyncSpace, SyncApplyMark).
  std::uint64_t block_words(std::uint32_t length) const noexcept { return block_words(options_, length); }
  static std::uint64_t block_words(const SyncOptions& o, std::uint32_t length) noexcept {
    return 1 + (std::uint64_t{o.window} + 1) *
                   (2 + (std::uint64_t{o.num_workers} + 63) / 64 + (std::uint64_t{length} + 1) / 2);
  }
  // The words of the blocks of `keys` keys whose values take `value_bytes` together, at most:
  // what a SyncSpace for a whole store may have to hold.
  static std::uint64_t store_words(const SyncOptions& o, std::uint64_t keys, std::uint64_t value_bytes) noexcept {
    return keys * block_words(o, 1) + (std::uint64_t{o.window} + 1) * (value_bytes / 8 + 1);
  }
  // The control word a block holds (mark checks read it). `block` is block_words(length) long.
  static std::uint64_t control_of(const std::uint64_t* block) noexcept;
  // Takes `key`'s pending steps from a dead process's block of `words`: checked as a peer's state
  // is, and a step that was complete but not yet applied when it died is applied now.
  // Errc::protocol with *why when the block does not check out (nothing is taken then).
  Errc adopt_block(Key key, std::uint32_t length, const std::uint64_t* block, std::uint64_t words, std::string* why);
  // The same for a state in export_state's layout (a checkpoint's), before anyone is served: a
  // step left complete (its apply failed and waited for the next push) is applied now.
  Errc restore_state(Key key, std::uint32_t length, const float* state, std::string* why);

 private:
  struct FreeDeleter {
    void operator()(std::uint64_t* p) const noexcept { std::free(p); }
  };
  struct KeyState {
    std::uint64_t* block = nullptr;  // block_words(length): [control | entries()]
    std::uint32_t backed = 0;        // entries SyncSpace::back made writable (all, without a space)
    // The block, without a space: calloc'ed, so that entries no step used stay untouched pages.
    std::unique_ptr<std::uint64_t, FreeDeleter> owned;
  };
  struct alignas(64) Stripe {
    mutable std::mutex mu;
    std::unordered_map<Key, KeyState> keys;
    SyncStats stats;
  };
  static constexpr std::size_t kStripes = 64;
  static constexpr unsigned kMaskBits = 16;
  static_assert(kMaxWindow < kMaskBits, "window + 1 entries, one bit each");
  Stripe& stripe(Key key) const noexcept { return stripes_[mix64(key) & (kStripes - 1)]; }
  std::uint32_t bitmap_words() const noexcept { return (options_.num_workers + 63) / 64; }
  std::uint32_t entries() const noexcept { return options_.window + 1; }
  std::uint64_t entry_words(std::uint32_t length) const noexcept {
    return 2 + bitmap_words() + (std::uint64_t{length} + 1) / 2;
  }
  std::uint64_t* entry(std::uint64_t* block, std::uint32_t length, unsigned e) const noexcept {
    return block + 1 + e * entry_words(length);
  }
  const std::uint64_t* entry(const std::uint64_t* block, std::uint32_t length, unsigned e) const noexcept {
    return block + 1 + e * entry_words(length);
  }
  // A control word: [next step | mask of the entries in use].
  struct Control {
    std::uint64_t next;
    std::uint32_t mask;
    explicit Control(std::uint64_t word) noexcept : next(word >> kMaskBits), mask(word & ((1u << kMaskBits) - 1)) {}
    Control(std::uint64_t next_step, std::uint32_t in_use) noexcept : next(next_step), mask(in_use) {}
    std::uint64_t word() const noexcept { return next << kMaskBits | mask; }
  };
  // The entry in use that holds `step`, or entries() if none does.
  unsigned find_entry(const std::uint64_t* block, std::uint32_t length, std::uint32_t mask,
                      std::uint64_t step) const noexcept {
    for (unsigned e = 0; e < entries(); ++e)
      if ((mask >> e & 1) && entry(block, length, e)[0] == step) return e;
    return entries();
  }
  std::uint64_t* block_of(Key key, std::uint32_t length, KeyState& state);
  // Entry e of the block made writable (SyncSpace::back) if it was not yet; throws Error.
  std::uint64_t* writable_entry(KeyState& state, std::uint32_t length, unsigned e);
  // The pending steps of a block in export_state's layout; false if its mask names more entries
  // than a window holds.
  bool export_block(const std::uint64_t* block, std::uint32_t length, float* out) const;
  Errc apply_ready(Key key, const SlotHeader& slot, std::uint32_t length, std::uint64_t* block, SyncStats& stats,
                   const UndoLog* undo);

  Store& store_;
  SyncOptions options_;
  std::shared_ptr<SyncSpace> space_;
  mutable std::array<Stripe, kStripes> stripes_;
};

}  // namespace pskv
