// Aggregate-then-apply: gathers the gradients of step t from N workers (or the first K of N, with
// N - K backup workers as in TF's SyncReplicasOptimizer), then applies their mean once through the
// store's update rule, with the learning rate scaled linearly by the number averaged (Ray's sync PS).
// A gradient for a step that was already applied arrives late and is dropped, never carried into
// a later step.
#pragma once

#include <array>
#include <cstdint>
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
  std::uint32_t window = 4;       // steps ahead of the oldest pending one that may be buffered
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

struct SyncStats {
  std::uint64_t applied_steps = 0;
  std::uint64_t dropped_late = 0;
  std::uint64_t duplicates = 0;
};

// Thread-safety: add() may be called concurrently from any number of threads; per-key state is
// guarded by a striped mutex, and applies go through the store's own stripe locks.
class SyncAccumulator {
 public:
  SyncAccumulator(Store& store, SyncOptions options);

  SyncOutcome add(Key key, std::uint32_t worker, std::uint64_t step, std::span<const float> grad,
                  Errc* error = nullptr);
  // The first step of `key` that has not been applied yet (0 before any).
  std::uint64_t next_step(Key key) const;
  // Whether add() would take (or drop as late) a gradient for `step`, rather than refuse it as
  // too far ahead. Stays true once true: the next step only moves forward.
  bool within_window(Key key, std::uint64_t step) const {
    const std::uint64_t next = next_step(key);
    return step < next || step - next < options_.window;
  }
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
  // Whether `in` could be a key's pending steps here (it comes from a peer): Errc::protocol,
  // with `why`, if not. Checked before anything of the record is written.
  Errc check_state(std::uint32_t length, const float* in, std::string* why) const;
  // Under with_key(key), after check_state.
  void import_state(Key key, std::uint32_t length, const float* in);

 private:
  struct Pending {
    std::uint64_t step = 0;
    std::uint32_t count = 0;
    std::vector<std::uint64_t> contributors;  // bitmap over workers
    std::vector<float> sum;
  };
  struct KeyState {
    std::uint64_t next_step = 0;
    std::vector<Pending> pending;  // unordered, at most `window` entries
    std::vector<Pending> spare;    // recycled buffers so steady state does not allocate
  };
  struct alignas(64) Stripe {
    mutable std::mutex mu;
    std::unordered_map<Key, KeyState> keys;
    SyncStats stats;
  };
  static constexpr std::size_t kStripes = 64;
  Stripe& stripe(Key key) const noexcept { return stripes_[mix64(key) & (kStripes - 1)]; }
  std::uint32_t bitmap_words() const noexcept { return (options_.num_workers + 63) / 64; }
  Errc apply_ready(Key key, KeyState& state, SyncStats& stats);
  // A recycled buffer for a new pending step (its sum keeps its capacity), or a fresh one.
  static Pending take_spare(KeyState& state);

  Store& store_;
  SyncOptions options_;
  mutable std::array<Stripe, kStripes> stripes_;
};

}  // namespace pskv
