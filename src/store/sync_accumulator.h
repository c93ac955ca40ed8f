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
#include <unordered_map>
#include <vector>

#include "store/store.h"

namespace pskv {

struct SyncOptions {
  std::uint32_t num_workers = 1;  // N
  std::uint32_t required = 0;     // K; 0 means N
  bool linear_lr_scaling = true;  // lr * K when applying the mean of K gradients
  std::uint32_t window = 4;       // steps ahead of the oldest pending one that may be buffered
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
  SyncStats stats() const;
  const SyncOptions& options() const noexcept { return options_; }

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
  Errc apply_ready(Key key, KeyState& state, SyncStats& stats);

  Store& store_;
  SyncOptions options_;
  mutable std::array<Stripe, kStripes> stripes_;
};

}  // namespace pskv
