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
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "common/memory.h"
#include "common/sync.h"
#include "layout/hash.h"
#include "layout/key_entry.h"
#include "layout/slot.h"
#include "layout/store_format.h"
#include "pskv/error.h"
#include "pskv/update_rule.h"

namespace pskv {

using Key = std::uint64_t;

// The largest value arena of one store (256 GiB): see Store::Record.
inline constexpr std::uint64_t kMaxArenaBytes = 1ull << 38;

struct StoreOptions {
  std::uint64_t max_keys = 1 << 16;         // key index capacity
  std::uint64_t arena_bytes = 64ull << 20;  // values incl. 64 B slot headers, at most kMaxArenaBytes
  std::uint32_t stripes = 1024;             // power of two
  UpdateRuleConfig rule{};
};

// Where a writer that may die (a shm client, or a shm server a successor may adopt) leaves what
// Store::apply_logged needs to roll its update back: its lock owner tag, the undo record, and a
// buffer of `capacity` floats for the old value and optimizer state.
struct SyncApplyMark;
struct UndoLog {
  std::uint32_t owner = 0;
  UndoRecord* record = nullptr;
  float* buffer = nullptr;
  std::size_t capacity = 0;
  std::chrono::nanoseconds patience{0};  // how long to wait for the stripe lock
  SyncApplyMark* sync_mark = nullptr;    // sync mode: the writer's mark (src/store/sync_accumulator.h)
};

// Which push an update is, so that one sent again (a client retrying after its server failed)
// is applied once: the worker, its client's session (a random word per Client) and the push's
// sequence number in that session. A session's pushes reach a key in sequence order, so a key
// marked with the worker's (session, seq') for seq' at or past seq already holds this push.
// Sequence numbers compare modulo 2^32.
struct PushId {
  std::uint32_t worker = 0;
  std::uint32_t session = 0;  // 0: not identified, never a duplicate
  std::uint32_t seq = 0;
  bool identified() const noexcept { return session != 0; }
  std::uint64_t mark() const noexcept { return (std::uint64_t{session} << 32) | seq; }
  bool already_in(std::uint64_t mark) const noexcept {
    return (mark >> 32) == session && static_cast<std::int32_t>(static_cast<std::uint32_t>(mark) - seq) >= 0;
  }
};

// Result of a read: the seqlock version the copy was validated against.
struct ReadResult {
  Errc status = Errc::ok;
  std::uint64_t version = 0;
};

// A key as a Store trusts it, resolved once by find_batch (or resolve) and used by the later
// passes of the same request without looking again: the slot, its length in floats, its stripe
// and its optimizer state (null when the rule keeps none). On the creating Store every field
// comes from its private record of the key, so nothing in it was read from shared memory. On an
// attached Store (a reader in another process) find_batch fills the slot and its length, read
// from the header and checked against the arena, which is all a reader uses; resolve() fills the
// rest. slot == nullptr: not found (or refused: a header that does not check out). Plain data;
// valid for the Store's lifetime.
struct SlotRef {
  SlotHeader* slot = nullptr;
  std::uint32_t length = 0;
  std::uint32_t stripe = 0;
  float* state = nullptr;
};

// Thread-safety: all member functions may be called concurrently from any thread, and from any
// process that maps the same region. init/push/assign take the key's stripe lock (so must only be
// called by processes whose death ends the job); apply_logged is for processes that may die, and
// recover repairs after them. find/pull never lock and never block writers.
//
// Trust: the region is shared with processes that may be hostile (any process of the job's user
// can map an shm segment). A Store never takes an address, size, count or rule from the region
// after create/attach: the geometry is a private copy. The creating Store (the server) also keeps
// a private record of every key (slot offset, length, optimizer-state offset, stripe) and its own
// index over them, and uses only those: a rewritten slot header or index entry can make the
// server refuse that key, never read or write elsewhere. An attached Store (a client) reads the
// shared index and slot headers, but checks every offset against its private geometry and copies
// only the length its caller checked.
class Store {
 public:
  static constexpr std::size_t kFixedHeaderBytes = kStoreFixedHeaderBytes;
  static std::size_t required_bytes(const StoreOptions& options);
  // Lays out an empty store in `memory` (at least required_bytes). Throws Error on bad options.
  static std::unique_ptr<Store> create(std::unique_ptr<MemoryResource> memory, const StoreOptions& options);
  // Opens a store another process laid out; validates magic, version and the whole layout
  // against the region's size. Such a store can read and apply_logged, not create keys.
  static std::unique_ptr<Store> attach(std::unique_ptr<MemoryResource> memory);

  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  // Creates `key` with `initial` as its value. If the key exists with the same length nothing is
  // changed and ok is returned (first initialiser wins); another length gives length_mismatch.
  // Only on the creating Store (unsupported on an attached one).
  Errc init(Key key, std::span<const float> initial);
  // Creates `key` with `length` zeros (same first-wins semantics).
  Errc init_zero(Key key, std::uint32_t length);
  // init() of every key of a request (values back to back), all or nothing: every key is checked
  // first (its length against an existing key's and against the same key earlier in the
  // request, then room for the new ones), so a refusal creates none. `failed` gets the index of
  // the key refused: length_mismatch (an existing key), invalid_argument (a length of 0, or the
  // key twice with two lengths), capacity.
  Errc init_all(std::span<const KeyEntry> keys, const float* values, std::size_t* failed);

  // nullptr when the key does not exist. The pointer stays valid for the store's lifetime and
  // lies inside the value arena with room for at least its header.
  SlotHeader* find(Key key) const noexcept {
    if (records_) {
      const Record* r = find_record(key);
      return r ? slot_of(*r) : nullptr;
    }
    // The shared index: bounded (it may have been filled with garbage) and every offset checked.
    for (std::uint64_t i = mix64(key) & index_mask_, n = 0; n <= index_mask_; i = (i + 1) & index_mask_, ++n) {
      const std::uint64_t slot = index_[i].slot.load(std::memory_order_acquire);
      if (slot == 0) return nullptr;
      if (index_[i].key.load(std::memory_order_relaxed) == key) {
        const std::uint64_t at = slot - 1 - g_.values_offset;  // wraps to huge below the arena
        return at <= g_.values_bytes - sizeof(SlotHeader) && at % kCacheLine == 0
                   ? reinterpret_cast<SlotHeader*>(base_ + slot - 1)
                   : nullptr;
      }
    }
    return nullptr;
  }

  // Looks up n keys (key_of(i) gives the i-th) into out[0..n), each resolved once (SlotRef) so
  // that the passes that check, copy or update them touch nothing but the slot itself.
  // Software-pipelined: the index bucket of key i+32 is prefetched while key i is resolved, so
  // the cache misses of a large random batch overlap instead of adding up; the passes over the
  // slots pipeline theirs with prefetch_ahead. On an attached store, whose slot headers say
  // what a slot is, each header is prefetched when its key is found and read kLag keys later.
  template <class KeyOf>
  void find_batch(std::size_t n, KeyOf&& key_of, SlotRef* out) const noexcept {
    constexpr std::size_t kAhead = 32, kLag = 16;
    for (std::size_t i = 0; i < std::min(n, kAhead); ++i) prefetch_bucket(key_of(i));
    for (std::size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) prefetch_bucket(key_of(i + kAhead));
      if (records_) {
        const Record* r = find_record(key_of(i));
        out[i] = r ? ref_of(*r) : SlotRef{};
        // Started now, the slot's misses overlap the lookups' instead of waiting for the pass
        // that uses it, whose prefetch_ahead alone keeps only 16 in flight (a 1,000-key pull
        // over tcp spent most of its time there).
        if (r) prefetch_slot(*out[i].slot);
        continue;
      }
      out[i] = SlotRef{};
      out[i].slot = find(key_of(i));
      if (out[i].slot) prefetch(out[i].slot);  // the header only: the passes after prefetch the values
      if (i >= kLag) check_found(out[i - kLag]);
    }
    if (!records_)
      for (std::size_t i = n > kLag ? n - kLag : 0; i < n; ++i) check_found(out[i]);
  }
  // One key, resolved (slot null if it does not exist).
  SlotRef find_ref(Key key) const noexcept {
    SlotRef r;
    find_batch(
        1, [key](std::size_t) { return key; }, &r);
    return r;
  }
  void prefetch_bucket(Key key) const noexcept {
    if (records_)
      prefetch(&records_[mix64(key) & index_mask_]);
    else
      prefetch(&index_[mix64(key) & index_mask_]);
  }
  // For a pass that touches refs[0], refs[1], ... in turn: call before touching refs[i], so the
  // misses of the slots kSlotsAhead further on are in flight meanwhile (a slot prefetched a
  // whole batch earlier has left the near caches by the time it is used).
  static void prefetch_ahead(std::span<const SlotRef> refs, std::size_t i) noexcept {
    constexpr std::size_t kSlotsAhead = 16;
    if (i == 0)
      for (std::size_t j = 0; j < std::min(refs.size(), kSlotsAhead); ++j)
        if (refs[j].slot) prefetch_slot(*refs[j].slot);
    if (i + kSlotsAhead < refs.size() && refs[i + kSlotsAhead].slot) prefetch_slot(*refs[i + kSlotsAhead].slot);
  }

  // The key's length as this Store trusts it: the private record on the creating Store (0 if the
  // slot's header no longer matches it: someone rewrote it), the header's word on an attached
  // one (0 if the value would run past the arena). Callers compare it with the length they
  // expect and then use their own length.
  std::uint32_t length_of(const SlotHeader& slot) const noexcept;
  // Whether `length` floats of values fit inside the arena after this slot's header.
  bool holds(const SlotHeader& slot, std::uint32_t length) const noexcept {
    return slot_offset(slot) - g_.values_offset + slot_bytes(length) <= g_.values_bytes;
  }

  // Copies the key's value into `out` (exact length required), validated by the seqlock.
  ReadResult pull(Key key, std::span<float> out) const noexcept;
  // read_slot of ref.length floats for a server thread, which may take the key's stripe lock:
  // after a few copies spoiled by writers it copies under the lock, so a large value that writers
  // keep changing (a push applied in pieces changes it every few microseconds) is still read.
  // Not for processes that may die (a reader killed under the lock would leave it held).
  ReadResult read_slot_or_lock(const SlotRef& ref, float* out) const noexcept;

  // Applies the store's update rule with `grad`; lr is multiplied by lr_scale.
  Errc push(Key key, std::span<const float> grad, float lr_scale = 1.0f) noexcept;
  // Applies an explicit rule (assign/add are the useful overrides).
  Errc apply(Key key, std::span<const float> grad, const UpdateRuleConfig& rule, float lr_scale = 1.0f) noexcept;
  // `grad` holds ref.length floats. Errc::timeout if the stripe lock stayed held past the lock
  // patience (set_lock_patience). With an identified `id` on a store that keeps push marks, a
  // key that already holds the push is left alone (*duplicate set), and otherwise is marked with
  // it in the same critical section as the update, so every copy taken under the lock (a
  // replica's record) holds the update and its mark, or neither.
  Errc apply_slot(const SlotRef& ref, const float* grad, const UpdateRuleConfig& rule, float lr_scale, PushId id = {},
                  bool* duplicate = nullptr) noexcept;
  // One piece of a push that is applied as it arrives rather than staged whole: the store's rule
  // over floats [begin, begin + n) of the slot, atomic for that piece only. `*step` 0 marks the
  // push's first piece, which counts the update and sets *step for the pieces after it, so every
  // piece of one push sees the same step (Adam's bias correction). A piece outside the slot's
  // length is not applied.
  void apply_part(const SlotRef& ref, std::size_t begin, const float* grad, std::size_t n,
                  std::uint64_t* step) noexcept;
  // How long a writer in this process waits for a stripe lock before apply_slot gives up with
  // Errc::timeout. Unbounded by default (every holder is a thread of this process, holding it
  // for one update); a server whose region other processes lock (shm) bounds it, so a holder
  // that hangs costs its key an error instead of a server thread.
  void set_lock_patience(std::chrono::nanoseconds patience) noexcept { lock_patience_ = patience; }
  // From now on every key keeps the mark of the newest push of each of `workers` workers applied
  // to it (PushId), in private memory. Call once, on the creating Store, before any push.
  void keep_push_marks(std::uint32_t workers);
  std::uint32_t push_marks() const noexcept { return marks_per_key_; }

  // The store's rule applied by `owner` (a SharedMutex owner tag unique to that process), which
  // may die at any instant: the old value, state and count go to `undo` (undo_capacity floats)
  // and `log` says how far it got. `length` is the caller's checked length of the key: a slot
  // that no longer has it, or whose undo copy would not fit, gives length_mismatch. Errc::timeout
  // if the stripe lock was still held after `patience`, with nothing changed. `closing` (may be
  // null): a word the region's owner sets when it stops taking updates; read after the record is
  // announced (both seq_cst), so the owner either sees this update in progress and waits for it,
  // or this update sees the word and gives up with Errc::peer_failure, with nothing changed.
  // `commit` (may be null): a word of the caller's set to `commit_value` once the update is
  // applied, before the log says so, so that a recoverer who reads it knows the update was whole
  // even while `log` still says saved (SyncAccumulator records an applied step so).
  Errc apply_logged(SlotHeader& slot, const float* grad, std::uint32_t length, float lr_scale, std::uint32_t owner,
                    UndoRecord& log, float* undo, std::size_t undo_capacity, std::chrono::nanoseconds patience,
                    const std::atomic<std::uint32_t>* closing = nullptr, std::uint64_t* commit = nullptr,
                    std::uint64_t commit_value = 0) noexcept;
  // Value plus optimizer-state floats an undo copy of the slot takes (0 if it cannot be trusted).
  std::size_t undo_floats(const SlotHeader& slot) const noexcept;
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
  // After `owner` died: releases every stripe lock still tagged with it (a hostile or corrupt
  // process may have left more than its undo record names). Returns how many.
  std::uint32_t release_locks_of(std::uint32_t owner) noexcept;

  // Batches: keys[i] <-> values[i]. Stops at the first failure and returns its index in
  // *failed_at (keys before it are done). One stripe lock acquisition per key.
  Errc pull_batch(std::span<const Key> keys, std::span<const std::span<float>> out,
                  std::size_t* failed_at = nullptr) const noexcept;
  Errc push_batch(std::span<const Key> keys, std::span<const std::span<const float>> grads, float lr_scale = 1.0f,
                  std::size_t* failed_at = nullptr) noexcept;

  // Checkpoint support: a consistent copy of value (length_of(slot) floats), optimizer state and
  // update count (taken under the stripe lock, since optimizer state has no seqlock), and the
  // reverse for restore. `state` must hold state_floats(slot) floats (may be null when that is 0).
  std::uint32_t state_floats(const SlotHeader& slot) const noexcept;
  // `seq`, if given, gets the slot's seqlock version the copy is of: it moves with every write
  // (every piece of a push applied in pieces), so it orders copies that the update count cannot.
  // `origin`, if given, gets the slot's origin_epoch and origin_seq (a replica's store); `marks`,
  // if given, its push_marks() marks. False, with nothing copied, when the stripe lock stays held
  // past `patience`: in an shm store a client that applies its own pushes may be stopped inside
  // one, and a checkpoint must not wait for it forever.
  bool snapshot_slot(SlotHeader& slot, float* value, float* state, std::uint64_t* update_count,
                     std::uint64_t* seq = nullptr, std::uint64_t* origin = nullptr, std::uint64_t* marks = nullptr,
                     std::chrono::nanoseconds patience = std::chrono::nanoseconds::max()) noexcept;
  Errc restore_slot(Key key, std::span<const float> value, std::span<const float> state, std::uint64_t update_count);
  // A replica's write: the key (created if missing) takes this value, state and count unless it
  // already holds a later version of it: versions are (origin_epoch, origin_seq), the origin's
  // start time and the seqlock version of its copy, compared in that order. Records of one key
  // may arrive in any order and more than once; the latest wins, so a replica ends with its
  // origin's very bytes, and a restarted origin's records win over its former life's.
  // `marks` (push_marks() of them, or null) go with the value. `taken`, if given: whether the
  // record was newer and was written.
  Errc put_if_newer(Key key, std::span<const float> value, std::span<const float> state, std::uint64_t update_count,
                    std::uint64_t origin_epoch, std::uint64_t origin_seq, const std::uint64_t* marks = nullptr,
                    bool* taken = nullptr);
  // Moves the key's seqlock version as a write that changes nothing would: state kept beside the
  // slot (sync mode's partial sums) has changed, and a copy of the key must now be newer.
  Errc touch(Key key) noexcept;

  const UpdateRuleConfig& rule() const noexcept { return g_.rule; }
  std::uint32_t stripes() const noexcept { return g_.stripes; }
  std::uint64_t key_count() const noexcept;
  std::uint64_t max_keys() const noexcept { return g_.max_keys; }
  std::uint64_t value_bytes_used() const noexcept { return used_bytes_acquire(); }
  std::uint64_t value_bytes_capacity() const noexcept { return g_.values_bytes; }

  // The whole region (what an RDMA backend registers) and the value arena within it.
  std::byte* region() noexcept { return base_; }
  std::size_t region_size() const noexcept { return memory_->size(); }
  std::byte* value_arena() noexcept { return base_ + g_.values_offset; }
  std::size_t slot_offset(const SlotHeader& slot) const noexcept {
    return static_cast<std::size_t>(reinterpret_cast<const std::byte*>(&slot) - base_);
  }

  // A slot with its key and length as this Store trusts them (see length_of).
  struct SlotEntry {
    SlotHeader* slot;
    Key key;
    std::uint32_t length;
  };
  // Visits every key in creation order (arena order): visit(SlotEntry). Values must be read with
  // read_slot if writers may be active. On an attached store the walk follows the slots' own
  // length words, each checked against the arena; a bad one ends it.
  template <class F>
  void for_each_slot(F&& visit) const {
    for (const SlotEntry& e : slots_in_order()) visit(e);
  }

  // A dead server's store, attached by the server that takes it over: every key the shared index
  // publishes whose slot checks out. Slots are carved from the arena one after another, so the
  // published ones must tile it from its start: each begins where the one before ends, holds the
  // length its header says and carries its index entry's key. A key that does not fit this is left
  // out and described in *refused (the region is writable by every process of the job's user); an
  // index entry past the last slot is a creation cut short by the death. Call only while no
  // process writes the region.
  struct Adoptable {
    Key key;
    SlotRef ref;
  };
  std::vector<Adoptable> adoptable_slots(std::vector<std::string>* refused) const;

 private:
  using Header = StoreHeader;
  // The creating Store's own record of a key, in private memory: 16 bytes, as dense as the
  // shared index, because a sparse batch's lookups are bound by how many of these miss the cache.
  // The stripe is a hash of the key and the optimizer state sits at state_per_value times the
  // slot's offset in the state arena (sized for exactly that), so neither needs storing.
  // Publication as IndexEntry: `key` first, then `where` (release).
  struct Record {
    Key key;
    std::atomic<std::uint64_t> where;  // (slot's offset in the value arena / 64 + 1) << 32 | length; 0 = empty
  };
  static constexpr std::uint64_t where_of(std::uint64_t arena_offset, std::uint32_t length) noexcept {
    return ((arena_offset / kCacheLine + 1) << 32) | length;
  }
  // What every access computes addresses from; a private copy, never re-read from the region.
  struct Geometry {
    std::uint32_t stripes = 0;
    std::uint64_t max_keys = 0, index_capacity = 0, stripes_offset = 0, index_offset = 0, values_offset = 0,
                  values_bytes = 0, state_offset = 0, state_bytes = 0, total_bytes = 0;
    UpdateRuleConfig rule{};
    std::uint32_t state_per_value = 0;  // optimizer-state floats per value float
  };
  Store(std::unique_ptr<MemoryResource> memory, const Geometry& geometry, bool creator);
  Header& header() const noexcept { return *reinterpret_cast<Header*>(base_); }
  // A slot pointer from elsewhere (an offset another process gave, a checkpoint walk) as this
  // Store trusts it (see length_of); false if it does not check out. Fills every field of *out.
  bool resolve(const SlotHeader& slot, SlotRef* out) const noexcept;
  // find_batch on an attached store: a found slot's length from its header, checked against the
  // arena (find already checked the slot's own offset), or the slot refused.
  void check_found(SlotRef& ref) const noexcept {
    if (!ref.slot) return;
    const std::uint32_t length = ref.slot->length;
    if (length == 0 || !holds(*ref.slot, length)) {
      ref = SlotRef{};
      return;
    }
    ref.length = length;
  }
  const Record* record_of(const SlotHeader& slot) const noexcept;
  // The creating Store's record of `key`, from its private index (nullptr: no such key).
  const Record* find_record(Key key) const noexcept {
    for (std::uint64_t i = mix64(key) & index_mask_;; i = (i + 1) & index_mask_) {
      if (records_[i].where.load(std::memory_order_acquire) == 0) return nullptr;
      if (records_[i].key == key) return &records_[i];
    }
  }
  // The slot `arena_offset` bytes into the value arena, with `length` floats, as trusted.
  SlotRef ref_at(std::uint64_t arena_offset, std::uint32_t length, Key key) const noexcept {
    return {reinterpret_cast<SlotHeader*>(base_ + g_.values_offset + arena_offset), length, stripe_of(key),
            g_.state_per_value ? reinterpret_cast<float*>(base_ + g_.state_offset + arena_offset * g_.state_per_value)
                               : nullptr};
  }
  SlotRef ref_of(const Record& r) const noexcept {
    const std::uint64_t where = r.where.load(std::memory_order_relaxed);
    return ref_at(((where >> 32) - 1) * kCacheLine, static_cast<std::uint32_t>(where), r.key);
  }
  SlotHeader* slot_of(const Record& r) const noexcept { return ref_of(r).slot; }
  std::vector<SlotEntry> slots_in_order() const;
  std::uint32_t stripe_of(Key key) const noexcept {
    return static_cast<std::uint32_t>((mix64(key) >> 40) & (g_.stripes - 1));
  }
  SharedMutex& stripe_at(std::uint32_t stripe) const noexcept {
    return *reinterpret_cast<SharedMutex*>(base_ + g_.stripes_offset + std::uint64_t{stripe} * kCacheLine);
  }
  SharedMutex& stripe_lock(Key key) const noexcept { return stripe_at(stripe_of(key)); }
  bool lock_stripe(SharedMutex& lock) const noexcept;
  std::uint64_t used_bytes_acquire() const noexcept;
  Errc create_slot(Key key, std::uint32_t length, const float* initial);
  void create_locked(Key key, std::uint32_t length, const float* initial);  // under create_mu_, checked
  // Under create_mu_: ok if `key` exists with `length`, length_mismatch with another, not_found.
  Errc existing_locked(Key key, std::uint32_t length) const noexcept;
  // Under create_mu_: whether `keys` more keys of `bytes` slot bytes in all still fit.
  bool room_locked(std::uint64_t keys, std::uint64_t bytes) const noexcept;
  // `rule` over floats [begin, begin + n) under the stripe lock and the seqlock; *step 0 counts
  // the update and sets *step (apply_slot: the whole value; apply_part: one piece).
  // The caller holds the stripe lock.
  void apply_seqlocked(const SlotRef& r, const UpdateRuleConfig& rule, std::size_t begin, const float* grad,
                       std::size_t n, float lr_scale, std::uint64_t* step) noexcept;
  // Replaces value, optimizer state and update count under the seqlock; the caller holds the
  // stripe lock.
  void overwrite_slot(const SlotRef& r, const float* value, const float* state, std::uint64_t update_count) noexcept;

  std::unique_ptr<MemoryResource> memory_;
  // Immutable after construction; cached so hot paths make no virtual calls.
  std::byte* base_;
  Geometry g_;
  IndexEntry* index_ = nullptr;
  std::uint64_t index_mask_ = 0;
  std::chrono::nanoseconds lock_patience_ = std::chrono::nanoseconds::max();
  // Parallel to records_: push_marks() words per record, touched only under the key's stripe lock.
  std::unique_ptr<MemoryResource> marks_memory_;
  std::uint64_t* marks_ = nullptr;
  std::uint32_t marks_per_key_ = 0;
  std::uint64_t* marks_of(const SlotHeader& slot) const noexcept {
    const Record* r = marks_ ? record_of(slot) : nullptr;
    return r ? marks_ + static_cast<std::uint64_t>(r - records_) * marks_per_key_ : nullptr;
  }
  // Creating Store only (null/unused on an attached one).
  std::unique_ptr<MemoryResource> records_memory_;
  Record* records_ = nullptr;
  mutable std::mutex create_mu_;      // guards creation and order_
  std::vector<const Record*> order_;  // in creation order
  std::atomic<std::uint64_t> used_{0}, key_count_{0};
};

}  // namespace pskv
