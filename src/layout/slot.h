// A key's slot in a store region, and the seqlock protocol every reader of one follows: the
// server's threads, shm clients reading the segment directly, rdma clients reading it with
// one-sided READs. A cross-process format: writers (src/store) and readers in other processes
// must agree on every byte here.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

#include "common/memory.h"

namespace pskv {

// 64 bytes, the seqlock word first, followed by the values padded to 64 bytes. Keeping the
// version next to the values lets an RDMA READ fetch both in one operation and read the 8-byte
// version again after. Readers in other processes may trust no word but `seq` (and only as the
// protocol below says): the server keeps every key's length and offsets in private memory.
struct alignas(64) SlotHeader {
  std::atomic<std::uint64_t> seq;  // odd while a writer is inside
  std::uint64_t key;
  std::uint32_t length;  // floats
  std::uint32_t flags;
  std::uint64_t state_offset;  // into the state arena: state_per_value x the slot's offset in
                               // the value arena (unused when the rule keeps no state)
  std::uint64_t update_count;  // updates applied so far (Adam's t)
  // The creating store's private record of this slot, plus 1: a hint that saves a probe for a
  // slot pointer that reached the server some other way. It lies in memory others may write,
  // so it is believed only when that record names this very slot.
  std::uint64_t record_hint;
  // In a replica's store (server heap only, never shared): the version of its origin's record
  // that the slot holds, compared by Store::put_if_newer. Zero elsewhere.
  std::uint64_t origin_epoch;
  std::uint64_t origin_seq;

  float* values() noexcept { return reinterpret_cast<float*>(this + 1); }
  const float* values() const noexcept { return reinterpret_cast<const float*>(this + 1); }
};
static_assert(sizeof(SlotHeader) == 64);

inline constexpr std::size_t slot_bytes(std::uint32_t length) noexcept {
  return sizeof(SlotHeader) + align_up(std::size_t{length} * sizeof(float), kCacheLine);
}

// The header line and the first value line of a slot, for a pass about to touch it.
inline void prefetch_slot(const SlotHeader& slot) noexcept {
  prefetch(&slot);
  prefetch(reinterpret_cast<const char*>(&slot) + 64);
}

// The seqlock read protocol. A writer makes `seq` odd, changes the values, and makes it even
// again (release). A reader takes an even version (acquire), copies, and checks after an acquire
// fence that `seq` still holds it; otherwise a write got in and it copies again.

// The slot's version once no writer is inside (even). Readers that copy the values some other
// way (a socket send, an RDMA READ) compare it with `seq` afterwards, after an acquire fence.
std::uint64_t stable_version(const SlotHeader& slot) noexcept;
// One validated copy of `length` floats (the caller's checked length, never the header's word):
// false if a writer got in (copy again). *version gets the version the copy is valid for.
bool copy_if_unchanged(const SlotHeader& slot, float* out, std::size_t length, std::uint64_t* version) noexcept;
// Copies until a copy is valid; returns its version. For readers that may not take the stripe
// lock (they may die holding it); a server thread uses Store::read_slot_or_lock.
std::uint64_t read_slot(const SlotHeader& slot, float* out, std::size_t length) noexcept;
// read_slot for a reader in another process than the writers: false once `deadline` passes
// without a valid copy. A writer that is stopped or died inside its write (and not yet rolled
// back), or a word left odd in a corrupt segment, would otherwise hold the reader for good.
// `deadline` is set to now + patience the first time a copy has to wait (it stays if set): one
// deadline for a batch of keys, and no clock read for a copy that does not wait.
bool read_slot_until(const SlotHeader& slot, float* out, std::size_t length, std::chrono::nanoseconds patience,
                     std::chrono::steady_clock::time_point* deadline, std::uint64_t* version) noexcept;

}  // namespace pskv
