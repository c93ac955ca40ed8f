#include "layout/clock_table.h"

#include <algorithm>
#include <new>
#include <string>

#include "common/sync.h"
#include "pskv/error.h"

namespace pskv {

struct alignas(64) ClockTable::Header {
  std::uint64_t magic;
  std::uint32_t workers;
  alignas(64) std::atomic<std::uint32_t> changes;
};

// One cache line per worker so that workers advancing their own clocks do not contend.
struct alignas(64) ClockTable::Entry {
  std::atomic<std::uint64_t> clock;
  std::atomic<std::int64_t> progress_ns;
  std::atomic<std::uint32_t> evicted;
};

namespace {
constexpr std::uint64_t kTableMagic = 0x4b434f4c43564b50ULL;  // "PKVCLOCK"
}

std::size_t ClockTable::bytes_for(std::uint32_t workers) noexcept {
  return sizeof(Header) + std::size_t{workers} * sizeof(Entry);
}

ClockTable::ClockTable(void* memory, std::uint32_t workers, bool initialise) : workers_(workers) {
  if (workers == 0) throw Error(Errc::invalid_argument, "a clock table needs at least one worker");
  if (reinterpret_cast<std::uintptr_t>(memory) % 64 != 0)
    throw Error(Errc::invalid_argument, "clock table memory is not 64-byte aligned");
  header_ = static_cast<Header*>(memory);
  entries_ = reinterpret_cast<Entry*>(static_cast<std::byte*>(memory) + sizeof(Header));
  if (initialise) {
    new (header_) Header{};
    header_->workers = workers;
    const std::int64_t now = steady_now_ns();
    for (std::uint32_t w = 0; w < workers; ++w) {
      auto* e = new (&entries_[w]) Entry{};
      e->progress_ns.store(now, std::memory_order_relaxed);
    }
    std::atomic_ref<std::uint64_t>(header_->magic).store(kTableMagic, std::memory_order_release);
  } else {
    if (std::atomic_ref<std::uint64_t>(header_->magic).load(std::memory_order_acquire) != kTableMagic)
      throw Error(Errc::protocol, "memory does not hold a pskv clock table");
    if (header_->workers != workers)
      throw Error(Errc::invalid_argument, "clock table has " + std::to_string(header_->workers) +
                                              " workers, the caller expects " + std::to_string(workers));
  }
}

std::uint64_t ClockTable::clock(std::uint32_t worker) const noexcept {
  return entries_[worker].clock.load(std::memory_order_acquire);
}

std::uint64_t ClockTable::advance_to(std::uint32_t worker, std::uint64_t clock) noexcept {
  Entry& e = entries_[worker];
  std::uint64_t cur = e.clock.load(std::memory_order_relaxed);
  while (cur < clock && !e.clock.compare_exchange_weak(cur, clock, std::memory_order_release)) {
  }
  if (cur < clock) {
    e.progress_ns.store(steady_now_ns(), std::memory_order_relaxed);
    header_->changes.fetch_add(1, std::memory_order_release);
    futex_wake_all(&header_->changes);
    return clock;
  }
  return cur;
}

bool ClockTable::evict(std::uint32_t worker) noexcept {
  if (entries_[worker].evicted.exchange(1, std::memory_order_acq_rel) != 0) return false;
  header_->changes.fetch_add(1, std::memory_order_release);
  futex_wake_all(&header_->changes);
  return true;
}

bool ClockTable::evicted(std::uint32_t worker) const noexcept {
  return entries_[worker].evicted.load(std::memory_order_acquire) != 0;
}

std::uint64_t ClockTable::bound(std::uint32_t k, std::uint32_t* slowest) const noexcept {
  // Small N (<= a few hundred): a partial selection over a stack copy is cheaper than any index.
  constexpr std::uint32_t kMax = 1024;
  std::uint64_t clocks[kMax];
  std::uint32_t who[kMax];
  std::uint32_t n = 0;
  for (std::uint32_t w = 0; w < workers_ && n < kMax; ++w) {
    if (evicted(w)) continue;
    const std::uint64_t c = clock(w);
    if (c == kClockDone) continue;
    clocks[n] = c;
    who[n++] = w;
  }
  if (n == 0) return kClockDone;
  // Finished or evicted workers shrink the quorum; never require more than remain.
  const std::uint32_t live = n;
  const std::uint32_t need = std::min(k == 0 ? live : k, live);
  // The need-th largest = the (live - need)-th smallest.
  const std::uint32_t rank = live - need;
  std::uint32_t idx[kMax];
  for (std::uint32_t i = 0; i < n; ++i) idx[i] = i;
  std::nth_element(idx, idx + rank, idx + n, [&](std::uint32_t a, std::uint32_t b) { return clocks[a] < clocks[b]; });
  if (slowest) *slowest = who[idx[rank]];
  return clocks[idx[rank]];
}

std::int64_t ClockTable::last_progress_ns(std::uint32_t worker) const noexcept {
  return entries_[worker].progress_ns.load(std::memory_order_relaxed);
}

std::atomic<std::uint32_t>& ClockTable::change_word() noexcept {
  return header_->changes;
}
std::uint32_t ClockTable::change_count() const noexcept {
  return header_->changes.load(std::memory_order_acquire);
}

}  // namespace pskv
