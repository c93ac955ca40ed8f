// The store region as another process sees it: the header it attaches by, the shared key index
// it looks keys up in, and the undo record a process that applies its own pushes leaves for the
// server. Writers are src/store's Store; readers are attached Stores in shm clients. See
// docs/ARCHITECTURE.md, "The store", for the region's layout:
//   StoreHeader | stripe locks | key index | value arena | optimizer-state arena
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "pskv/update_rule.h"

namespace pskv {

inline constexpr std::uint64_t kStoreMagic = 0x31565f564b53505bULL;  // "[PSKV_V1"
// 2: the create lock left the shared header (only the creating process creates keys).
// 3: a key's optimizer state lies at state_per_value x its slot's offset in the value arena.
inline constexpr std::uint32_t kStoreLayoutVersion = 3;
// The header block's size: the first stripe lock starts here.
inline constexpr std::uint64_t kStoreHeaderBlock = 256;

// The fields before values_used never change after the store is created; the counters after it
// are mirrors kept for readers in other processes. Nobody, the creating process included, takes
// an address, size or rule from it after create/attach: each Store keeps its own copy.
struct alignas(64) StoreHeader {
  std::uint64_t magic;
  std::uint32_t layout_version;
  std::uint32_t stripes;
  std::uint64_t max_keys;
  std::uint64_t index_capacity;  // power of two
  std::uint64_t stripes_offset;
  std::uint64_t index_offset;
  std::uint64_t values_offset;
  std::uint64_t values_bytes;
  std::uint64_t state_offset;
  std::uint64_t state_bytes;
  std::uint64_t total_bytes;
  UpdateRuleConfig rule;
  alignas(64) std::atomic<std::uint64_t> values_used;
  std::atomic<std::uint64_t> state_used;
  std::atomic<std::uint64_t> key_count;
};
inline constexpr std::size_t kStoreFixedHeaderBytes = offsetof(StoreHeader, values_used);
static_assert(sizeof(StoreHeader) <= kStoreHeaderBlock);

// One bucket of the shared open-addressing key index (linear probing from mix64(key)). Lookups
// read `slot` (acquire) and then `key`; an insert writes `key` first and publishes with `slot`
// (release), so a reader that sees a slot sees its key. Never removed.
struct IndexEntry {
  std::atomic<std::uint64_t> key;
  std::atomic<std::uint64_t> slot;  // offset of the SlotHeader from the region base + 1; 0 = empty
};
static_assert(sizeof(IndexEntry) == 16);

// The undo record of one update made by a process that may be killed mid-way (a shm worker
// applying its own push). It lives in memory that outlives the process, next to an undo buffer of
// value + optimizer-state floats; the server uses both to roll the update back.
enum class UndoPhase : std::uint32_t { idle = 0, locking = 1, saved = 2, applied = 3 };
struct UndoRecord {
  std::atomic<UndoPhase> phase;
  std::uint32_t stripe;        // the lock the writer takes or holds (phase != idle)
  std::uint64_t slot_offset;   // SlotHeader, from the region base (phase saved)
  std::uint64_t seq;           // the slot's seqlock before the update
  std::uint64_t update_count;  // and its update count
};

}  // namespace pskv
