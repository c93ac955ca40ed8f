// The clock table: one atomic uint64 step counter per worker, placed in whatever memory the
// backend shares (server heap for TCP, the segment for shm, a registered region for RDMA).
// A worker at clock c has finished steps 0..c-1. Every change bumps a 32-bit futex word so
// waiters in any process can sleep instead of polling.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace pskv {

inline constexpr std::uint64_t kClockDone = std::numeric_limits<std::uint64_t>::max();

// Thread-safety: every member is safe from any thread in any process that maps the table.
class ClockTable {
 public:
  static std::size_t bytes_for(std::uint32_t workers) noexcept;
  // `memory` must be 64-byte aligned and bytes_for(workers) long. `initialise` lays out a fresh
  // table (all clocks 0); otherwise the existing table is opened and `workers` must match.
  ClockTable(void* memory, std::uint32_t workers, bool initialise);

  std::uint32_t workers() const noexcept { return workers_; }
  std::uint64_t clock(std::uint32_t worker) const noexcept;
  // Moves the worker's clock forward to `clock` (never backwards). Returns the clock now held.
  std::uint64_t advance_to(std::uint32_t worker, std::uint64_t clock) noexcept;
  // Marks the worker as finished: it no longer holds anyone back.
  void finish(std::uint32_t worker) noexcept { advance_to(worker, kClockDone); }
  // Whether this call evicted it (false: it already was).
  bool evict(std::uint32_t worker) noexcept;
  bool evicted(std::uint32_t worker) const noexcept;

  // The clock that bounds readers: the k-th largest clock among live workers (k = number of
  // live workers gives the minimum). Evicted and finished workers do not count. Returns
  // kClockDone when no live worker remains. `slowest` receives the worker that sets the bound.
  std::uint64_t bound(std::uint32_t k, std::uint32_t* slowest = nullptr) const noexcept;
  std::uint64_t min_clock(std::uint32_t* slowest = nullptr) const noexcept { return bound(workers_, slowest); }

  // Nanoseconds (steady clock) of the worker's last advance, for stall detection.
  std::int64_t last_progress_ns(std::uint32_t worker) const noexcept;

  std::atomic<std::uint32_t>& change_word() noexcept;
  std::uint32_t change_count() const noexcept;

 private:
  struct Header;
  struct Entry;
  Header* header_;
  Entry* entries_;
  std::uint32_t workers_;
};

}  // namespace pskv
