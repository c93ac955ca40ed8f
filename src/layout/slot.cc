#include "layout/slot.h"

#include <thread>

#include "common/sync.h"

namespace pskv {

std::uint64_t stable_version(const SlotHeader& slot) noexcept {
  // A writer inside holds the slot for at most one update: spin briefly, then yield.
  for (unsigned attempt = 0;; ++attempt) {
    const std::uint64_t v = slot.seq.load(std::memory_order_acquire);
    if ((v & 1) == 0) return v;
    if (attempt < 64)
      cpu_relax();
    else
      std::this_thread::yield();
  }
}

bool copy_if_unchanged(const SlotHeader& slot, float* out, std::size_t length, std::uint64_t* version) noexcept {
  const std::uint64_t before = stable_version(slot);
  seqlock_copy(out, slot.values(), length * sizeof(float));
  std::atomic_thread_fence(std::memory_order_acquire);
  *version = before;
  return slot.seq.load(std::memory_order_relaxed) == before;
}

std::uint64_t read_slot(const SlotHeader& slot, float* out, std::size_t length) noexcept {
  std::uint64_t version = 0;
  while (!copy_if_unchanged(slot, out, length, &version)) {
  }
  return version;
}

bool read_slot_until(const SlotHeader& slot, float* out, std::size_t length, std::chrono::nanoseconds patience,
                     std::chrono::steady_clock::time_point* deadline, std::uint64_t* version) noexcept {
  for (unsigned attempt = 0;; ++attempt) {
    const std::uint64_t v = slot.seq.load(std::memory_order_acquire);
    if ((v & 1) == 0) {
      seqlock_copy(out, slot.values(), length * sizeof(float));
      std::atomic_thread_fence(std::memory_order_acquire);
      if (slot.seq.load(std::memory_order_relaxed) == v) {
        *version = v;
        return true;
      }
    }
    if (attempt < 64) {
      cpu_relax();
      continue;
    }
    // The clock only every 64 looks past the first 64: a write holds the slot for microseconds.
    if (attempt % 64 == 0) {
      const auto now = std::chrono::steady_clock::now();
      if (*deadline == std::chrono::steady_clock::time_point{}) *deadline = now + patience;
      if (now > *deadline) return false;
    }
    std::this_thread::yield();
  }
}

}  // namespace pskv
