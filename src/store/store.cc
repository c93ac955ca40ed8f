#include "store/store.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "store/update_kernels.h"

namespace pskv {

namespace {
constexpr std::uint64_t kEmpty = 0;
}  // namespace

namespace {
struct Layout {
  std::uint64_t stripes_offset, index_offset, index_capacity, values_offset, state_offset, state_bytes, total;
};

Layout layout_for(const StoreOptions& o) {
  Layout l{};
  std::uint64_t off = kStoreHeaderBlock;
  l.stripes_offset = off;
  off += std::uint64_t{o.stripes} * kCacheLine;
  l.index_offset = off;
  l.index_capacity = std::bit_ceil(std::max<std::uint64_t>(16, o.max_keys * 2));
  off = align_up(off + l.index_capacity * 16, kCacheLine);
  l.values_offset = off;
  off = align_up(off + o.arena_bytes, kCacheLine);
  l.state_offset = off;
  l.state_bytes = o.arena_bytes * state_floats_per_value(o.rule.rule);
  off = align_up(off + l.state_bytes, kCacheLine);
  l.total = off;
  return l;
}

void validate(const StoreOptions& o) {
  if (o.stripes == 0 || !std::has_single_bit(o.stripes))
    throw Error(Errc::invalid_argument, "stripe count " + std::to_string(o.stripes) + " is not a power of two");
  if (o.max_keys == 0 || o.max_keys > (1ull << 34))
    throw Error(Errc::invalid_argument, "max_keys must be in [1, 2^34], got " + std::to_string(o.max_keys));
  // A private record holds a slot's offset in 64-byte units in 32 bits (Store::Record).
  if (o.arena_bytes < kCacheLine * 2 || o.arena_bytes > kMaxArenaBytes)
    throw Error(Errc::invalid_argument,
                "arena_bytes must be in [128, 2^38] (256 GiB per server; shard over more "
                "servers for more), got " +
                    std::to_string(o.arena_bytes));
}
}  // namespace

Store::Store(std::unique_ptr<MemoryResource> memory, const Geometry& geometry, bool creator)
    : memory_(std::move(memory)), base_(memory_->data()), g_(geometry) {
  index_ = reinterpret_cast<IndexEntry*>(base_ + g_.index_offset);
  index_mask_ = g_.index_capacity - 1;
  if (creator) {
    static_assert(sizeof(Record) == 16);
    records_memory_ = std::make_unique<HeapMemory>(g_.index_capacity * sizeof(Record));
    records_ = reinterpret_cast<Record*>(records_memory_->data());
  }
}
Store::~Store() = default;

std::size_t Store::required_bytes(const StoreOptions& options) {
  validate(options);
  return layout_for(options).total;
}

std::unique_ptr<Store> Store::create(std::unique_ptr<MemoryResource> memory, const StoreOptions& options) {
  static_assert(sizeof(Header) <= kStoreHeaderBlock);
  static_assert(sizeof(IndexEntry) == 16);
  validate(options);
  if (!memory) throw Error(Errc::invalid_argument, "Store::create: no memory");
  const Layout l = layout_for(options);
  if (memory->size() < l.total)
    throw Error(Errc::capacity,
                "store region has " + std::to_string(memory->size()) + " bytes, needs " + std::to_string(l.total));
  if (reinterpret_cast<std::uintptr_t>(memory->data()) % kCacheLine != 0)
    throw Error(Errc::invalid_argument, "store region is not 64-byte aligned");
  Geometry g;
  g.stripes = options.stripes;
  g.max_keys = options.max_keys;
  g.index_capacity = l.index_capacity;
  g.stripes_offset = l.stripes_offset;
  g.index_offset = l.index_offset;
  g.values_offset = l.values_offset;
  g.values_bytes = options.arena_bytes;
  g.state_offset = l.state_offset;
  g.state_bytes = l.state_bytes;
  g.total_bytes = l.total;
  g.rule = options.rule;
  g.state_per_value = state_floats_per_value(options.rule.rule);
  std::byte* base = memory->data();
  // The index and locks must start zeroed; the arenas are written before they are published.
  std::memset(base, 0, l.values_offset);
  auto* h = new (base) Header{};
  h->layout_version = kStoreLayoutVersion;
  h->stripes = g.stripes;
  h->max_keys = g.max_keys;
  h->index_capacity = g.index_capacity;
  h->stripes_offset = g.stripes_offset;
  h->index_offset = g.index_offset;
  h->values_offset = g.values_offset;
  h->values_bytes = g.values_bytes;
  h->state_offset = g.state_offset;
  h->state_bytes = g.state_bytes;
  h->total_bytes = g.total_bytes;
  h->rule = g.rule;
  for (std::uint32_t i = 0; i < options.stripes; ++i) new (base + l.stripes_offset + i * kCacheLine) SharedMutex();
  std::atomic_thread_fence(std::memory_order_release);
  std::atomic_ref<std::uint64_t>(h->magic).store(kStoreMagic, std::memory_order_release);
  return std::unique_ptr<Store>(new Store(std::move(memory), g, true));
}

std::unique_ptr<Store> Store::attach(std::unique_ptr<MemoryResource> memory) {
  if (!memory || memory->size() < sizeof(Header))
    throw Error(Errc::invalid_argument, "Store::attach: region too small to hold a store");
  auto* h = reinterpret_cast<Header*>(memory->data());
  if (std::atomic_ref<std::uint64_t>(h->magic).load(std::memory_order_acquire) != kStoreMagic)
    throw Error(Errc::protocol, "region does not hold a pskv store (bad magic); was it created by pskv-server?");
  if (h->layout_version != kStoreLayoutVersion)
    throw Error(Errc::protocol, "store layout version " + std::to_string(h->layout_version) + " but this build reads " +
                                    std::to_string(kStoreLayoutVersion) + "; use matching pskv builds");
  // Read once into private memory and checked as a whole; nothing is read from the header again.
  Geometry g;
  g.stripes = h->stripes;
  g.max_keys = h->max_keys;
  g.index_capacity = h->index_capacity;
  g.stripes_offset = h->stripes_offset;
  g.index_offset = h->index_offset;
  g.values_offset = h->values_offset;
  g.values_bytes = h->values_bytes;
  g.state_offset = h->state_offset;
  g.state_bytes = h->state_bytes;
  g.total_bytes = h->total_bytes;
  std::memcpy(static_cast<void*>(&g.rule), &h->rule, sizeof g.rule);
  const std::uint64_t size = memory->size();
  const auto rule = static_cast<std::uint8_t>(g.rule.rule);
  // Every offset is bounded by the region before any sum below uses it: each addend is then
  // below 2^45 and no sum can wrap past the region's end back into it.
  const bool offsets_inside =
      g.stripes_offset <= size && g.index_offset <= size && g.values_offset <= size && g.state_offset <= size;
  const bool sane =
      offsets_inside && rule <= static_cast<std::uint8_t>(UpdateRule::adagrad) && g.total_bytes <= size &&
      g.stripes != 0 && std::has_single_bit(g.stripes) && g.stripes <= (1u << 24) &&
      std::has_single_bit(g.index_capacity) && g.index_capacity <= (1ull << 40) && g.stripes_offset >= sizeof(Header) &&
      g.stripes_offset % kCacheLine == 0 && g.index_offset % kCacheLine == 0 && g.values_offset % kCacheLine == 0 &&
      g.state_offset % kCacheLine == 0 && g.index_offset >= g.stripes_offset + std::uint64_t{g.stripes} * kCacheLine &&
      g.values_offset >= g.index_offset + g.index_capacity * sizeof(IndexEntry) && g.values_bytes >= 2 * kCacheLine &&
      g.values_bytes <= kMaxArenaBytes && g.state_offset >= g.values_offset + g.values_bytes &&
      g.state_bytes <= (1ull << 44) && g.state_offset + g.state_bytes <= g.total_bytes &&
      g.state_bytes >= g.values_bytes * state_floats_per_value(g.rule.rule);
  if (!sane) throw Error(Errc::protocol, "store header does not describe a store that fits its region");
  g.state_per_value = state_floats_per_value(g.rule.rule);
  return std::unique_ptr<Store>(new Store(std::move(memory), g, false));
}

std::uint64_t Store::used_bytes_acquire() const noexcept {
  if (records_) return used_.load(std::memory_order_acquire);
  return std::min(header().values_used.load(std::memory_order_acquire), g_.values_bytes);
}
std::uint64_t Store::key_count() const noexcept {
  return records_ ? key_count_.load(std::memory_order_relaxed) : header().key_count.load(std::memory_order_relaxed);
}

const Store::Record* Store::record_of(const SlotHeader& slot) const noexcept {
  // For a slot pointer from elsewhere (an offset another process gave, a checkpoint walk); the
  // hot paths carry the SlotRef find_batch made instead.
  const std::uint64_t offset = slot_offset(slot) - g_.values_offset;  // wraps to huge below the arena
  if (offset >= g_.values_bytes) return nullptr;
  const std::uint64_t unit = offset / kCacheLine + 1;
  const std::uint64_t hint = slot.record_hint - 1;
  if (hint <= index_mask_ && (records_[hint].where.load(std::memory_order_acquire) >> 32) == unit)
    return &records_[hint];
  const Record* r = find_record(slot.key);
  return r && (r->where.load(std::memory_order_relaxed) >> 32) == unit ? r : nullptr;
}

bool Store::resolve(const SlotHeader& slot, SlotRef* out) const noexcept {
  if (records_) {
    // The slot's own key word only finds the record; the record says what the slot is. A
    // rewritten key finds no record, or one for another slot: the slot is refused.
    const Record* r = record_of(slot);
    if (!r) return false;
    *out = ref_of(*r);
    return true;
  }
  const std::uint32_t length = slot.length;
  const Key key = slot.key;
  if (length == 0 || !holds(slot, length)) return false;
  // The state's place follows from the slot's (never from the header's word), and lies inside
  // the state arena whenever the slot lies inside the value arena.
  *out = ref_at(slot_offset(slot) - g_.values_offset, length, key);
  return true;
}

std::uint32_t Store::length_of(const SlotHeader& slot) const noexcept {
  SlotRef r;
  return resolve(slot, &r) ? r.length : 0;
}

bool Store::lock_stripe(SharedMutex& lock) const noexcept {
  if (lock_patience_ == std::chrono::nanoseconds::max()) {
    lock.lock();
    return true;
  }
  return lock.lock_for(SharedMutex::kAnonymousOwner, lock_patience_);
}

Errc Store::create_slot(Key key, std::uint32_t length, const float* initial) {
  if (length == 0) return Errc::invalid_argument;
  if (!records_) return Errc::unsupported;
  std::lock_guard guard(create_mu_);
  if (const Errc e = existing_locked(key, length); e != Errc::not_found) return e;
  if (!room_locked(1, slot_bytes(length))) return Errc::capacity;
  create_locked(key, length, initial);
  return Errc::ok;
}

Errc Store::existing_locked(Key key, std::uint32_t length) const noexcept {
  const Record* existing = find_record(key);
  if (!existing) return Errc::not_found;
  return static_cast<std::uint32_t>(existing->where.load(std::memory_order_relaxed)) == length ? Errc::ok
                                                                                               : Errc::length_mismatch;
}

bool Store::room_locked(std::uint64_t keys, std::uint64_t bytes) const noexcept {
  // The state arena holds state_per_value x as much as the values.
  return key_count_.load(std::memory_order_relaxed) + keys <= g_.max_keys &&
         used_.load(std::memory_order_relaxed) + bytes <= g_.values_bytes;
}

Errc Store::init_all(std::span<const KeyEntry> keys, const float* values, std::size_t* failed) {
  if (!records_) return Errc::unsupported;
  std::lock_guard guard(create_mu_);
  std::unordered_map<Key, std::uint32_t> fresh;  // the keys this request creates, with their lengths
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    *failed = i;
    const KeyEntry& k = keys[i];
    if (k.length == 0) return Errc::invalid_argument;
    if (const Errc e = existing_locked(k.key, k.length); e != Errc::not_found) {
      if (e != Errc::ok) return e;
      continue;
    }
    const auto [at, made] = fresh.emplace(k.key, k.length);
    if (!made) {
      if (at->second != k.length) return Errc::invalid_argument;
      continue;
    }
    bytes += slot_bytes(k.length);
    if (!room_locked(fresh.size(), bytes)) return Errc::capacity;
  }
  order_.reserve(order_.size() + fresh.size());  // the one allocation of creating: none is half made
  for (const KeyEntry& k : keys) {
    if (const auto it = fresh.find(k.key); it != fresh.end()) {
      create_locked(k.key, k.length, values);
      fresh.erase(it);  // a repeat keeps the first value, as init() one at a time would
    }
    values += k.length;
  }
  return Errc::ok;
}

void Store::create_locked(Key key, std::uint32_t length, const float* initial) {
  const std::uint64_t bytes = slot_bytes(length);
  const std::uint64_t used = used_.load(std::memory_order_relaxed);
  const SlotRef ref = ref_at(used, length, key);
  auto* slot = new (ref.slot) SlotHeader{};
  slot->key = key;
  slot->length = length;
  slot->state_offset = used * g_.state_per_value;
  if (initial)
    std::memcpy(slot->values(), initial, std::size_t{length} * sizeof(float));
  else
    std::memset(slot->values(), 0, std::size_t{length} * sizeof(float));
  if (ref.state) std::memset(ref.state, 0, std::size_t{length} * g_.state_per_value * sizeof(float));
  used_.store(used + bytes, std::memory_order_release);
  key_count_.fetch_add(1, std::memory_order_relaxed);

  std::uint64_t i = mix64(key) & index_mask_;
  while (records_[i].where.load(std::memory_order_relaxed) != kEmpty) i = (i + 1) & index_mask_;
  slot->record_hint = i + 1;
  records_[i].key = key;
  records_[i].where.store(where_of(used, length), std::memory_order_release);
  order_.push_back(&records_[i]);

  // The mirrors other processes read. The shared index may have been filled with garbage by
  // then: the probe is bounded, and a key it has no room for is still served from records_.
  Header& h = header();
  h.state_used.store((used + bytes) * g_.state_per_value, std::memory_order_relaxed);
  h.values_used.store(used + bytes, std::memory_order_release);
  h.key_count.store(key_count_.load(std::memory_order_relaxed), std::memory_order_relaxed);
  const std::uint64_t offset = slot_offset(*slot);
  std::uint64_t j = mix64(key) & index_mask_, n = 0;
  while (index_[j].slot.load(std::memory_order_relaxed) != kEmpty && n++ <= index_mask_) j = (j + 1) & index_mask_;
  if (n <= index_mask_) {
    index_[j].key.store(key, std::memory_order_relaxed);
    index_[j].slot.store(offset + 1, std::memory_order_release);
  }
}

Errc Store::init(Key key, std::span<const float> initial) {
  if (initial.size() > UINT32_MAX) return Errc::invalid_argument;
  return create_slot(key, static_cast<std::uint32_t>(initial.size()), initial.data());
}

Errc Store::init_zero(Key key, std::uint32_t length) {
  return create_slot(key, length, nullptr);
}

ReadResult Store::read_slot_or_lock(const SlotRef& ref, float* out) const noexcept {
  const SlotHeader& slot = *ref.slot;
  const std::size_t length = ref.length;
  std::uint64_t version = 0;
  for (int attempt = 0; !copy_if_unchanged(slot, out, length, &version); ++attempt) {
    if (attempt < 2) continue;
    // Bounded patience: a holder that is stopped (a SIGSTOPped shm worker) must not take this
    // thread with it; the optimistic copy is tried again in between.
    SharedMutex& lock = stripe_at(ref.stripe);
    if (lock.lock_for(SharedMutex::kAnonymousOwner, std::chrono::milliseconds(1))) {
      std::memcpy(out, slot.values(), length * sizeof(float));
      version = slot.seq.load(std::memory_order_relaxed);
      lock.unlock();
      break;
    }
  }
  return {Errc::ok, version};
}

ReadResult Store::pull(Key key, std::span<float> out) const noexcept {
  const SlotRef ref = find_ref(key);
  if (!ref.slot) return {Errc::not_found, 0};
  if (ref.length != out.size()) return {Errc::length_mismatch, 0};
  return {Errc::ok, read_slot(*ref.slot, out.data(), out.size())};
}

Errc Store::apply_slot(const SlotRef& ref, const float* grad, const UpdateRuleConfig& rule, float lr_scale, PushId id,
                       bool* duplicate) noexcept {
  // The state arena was sized for the store's own rule; a rule needing more state cannot run.
  if (state_floats_per_value(rule.rule) > g_.state_per_value) return Errc::unsupported;
  std::uint64_t* mark = nullptr;
  if (id.identified() && id.worker < marks_per_key_) {
    mark = marks_of(*ref.slot);
    if (mark) mark += id.worker;
  }
  SharedMutex& lock = stripe_at(ref.stripe);
  if (!lock_stripe(lock)) return Errc::timeout;
  if (mark && id.already_in(*mark)) {
    lock.unlock();
    if (duplicate) *duplicate = true;
    return Errc::ok;
  }
  std::uint64_t step = 0;
  apply_seqlocked(ref, rule, 0, grad, ref.length, lr_scale, &step);
  if (mark) *mark = id.mark();
  lock.unlock();
  if (duplicate) *duplicate = false;
  return Errc::ok;
}

void Store::keep_push_marks(std::uint32_t workers) {
  if (!records_ || marks_ || workers == 0) return;
  marks_memory_ =
      std::make_unique<HeapMemory>(g_.index_capacity * workers * sizeof(std::uint64_t), "the push marks", false);
  marks_ = reinterpret_cast<std::uint64_t*>(marks_memory_->data());
  marks_per_key_ = workers;
}

void Store::apply_part(const SlotRef& ref, std::size_t begin, const float* grad, std::size_t n,
                       std::uint64_t* step) noexcept {
  if (begin > ref.length || n > ref.length - begin) return;
  SharedMutex& lock = stripe_at(ref.stripe);
  if (!lock_stripe(lock)) return;
  apply_seqlocked(ref, g_.rule, begin, grad, n, 1.0f, step);
  lock.unlock();
}

void Store::apply_seqlocked(const SlotRef& r, const UpdateRuleConfig& rule, std::size_t begin, const float* grad,
                            std::size_t n, float lr_scale, std::uint64_t* step) noexcept {
  SlotHeader& slot = *r.slot;
  float* state = state_floats_per_value(rule.rule) ? r.state : nullptr;
  const std::uint64_t seq = slot.seq.load(std::memory_order_relaxed);
  slot.seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  if (*step == 0) *step = ++slot.update_count;
  apply_update_part(rule, slot.values(), state, r.length, begin, grad, n, *step, lr_scale);
  slot.seq.store(seq + 2, std::memory_order_release);
}

std::size_t Store::undo_floats(const SlotHeader& slot) const noexcept {
  SlotRef r;
  return resolve(slot, &r) ? std::size_t{r.length} * (1 + g_.state_per_value) : 0;
}

Errc Store::apply_logged(SlotHeader& slot, const float* grad, std::uint32_t length, float lr_scale, std::uint32_t owner,
                         UndoRecord& log, float* undo, std::size_t undo_capacity, std::chrono::nanoseconds patience,
                         const std::atomic<std::uint32_t>* closing, std::uint64_t* commit,
                         std::uint64_t commit_value) noexcept {
  SlotRef r;
  if (!resolve(slot, &r) || r.length != length) return Errc::length_mismatch;
  const std::size_t state_count = std::size_t{length} * g_.state_per_value;
  if (length + state_count > undo_capacity) return Errc::length_mismatch;
  log.stripe = r.stripe;
  log.slot_offset = slot_offset(slot);
  // Announced before the lock is taken, so that a recoverer knows which lock to look at.
  log.phase.store(UndoPhase::locking, std::memory_order_seq_cst);
  if (closing && closing->load(std::memory_order_seq_cst) != 0) {
    log.phase.store(UndoPhase::idle, std::memory_order_release);
    return Errc::peer_failure;
  }
  SharedMutex& lock = stripe_at(r.stripe);
  if (!lock.lock_for(owner, patience)) {
    log.phase.store(UndoPhase::idle, std::memory_order_release);
    return Errc::timeout;
  }
  log.seq = slot.seq.load(std::memory_order_relaxed);
  log.update_count = slot.update_count;
  copy_floats(undo, slot.values(), length);
  if (state_count) copy_floats(undo + length, r.state, state_count);
  log.phase.store(UndoPhase::saved, std::memory_order_release);
  std::uint64_t step = 0;
  apply_seqlocked(r, g_.rule, 0, grad, length, lr_scale, &step);
  if (commit) {
    // A kill is the only reader to order against: the compiler's order is the order it sees.
    std::atomic_signal_fence(std::memory_order_seq_cst);
    std::atomic_ref<std::uint64_t>(*commit).store(commit_value, std::memory_order_release);
  }
  log.phase.store(UndoPhase::applied, std::memory_order_release);
  lock.unlock();
  log.phase.store(UndoPhase::idle, std::memory_order_release);
  return Errc::ok;
}

Store::Recovery Store::recover(UndoRecord& log, std::uint32_t owner, const float* undo,
                               std::size_t undo_capacity) noexcept {
  // Every field is read once: the record's writer may have been hostile, and another process
  // may still be changing it.
  const UndoPhase phase = log.phase.load(std::memory_order_acquire);
  const std::uint32_t stripe = log.stripe;
  const std::uint64_t offset = log.slot_offset, update_count = log.update_count;
  const bool known = phase == UndoPhase::locking || phase == UndoPhase::saved || phase == UndoPhase::applied;
  if (!known || stripe >= g_.stripes) {
    log.phase.store(UndoPhase::idle, std::memory_order_relaxed);
    return Recovery::nothing;
  }
  SharedMutex& lock = stripe_at(stripe);
  // In phase locking the owner may have died before its compare-and-swap: then it holds nothing.
  if (lock.holder() != owner) {
    log.phase.store(UndoPhase::idle, std::memory_order_relaxed);
    return Recovery::nothing;
  }
  Recovery done = Recovery::released;
  if (phase == UndoPhase::saved) {
    // Only a slot the index knows, on this stripe, is touched, with its trusted length.
    SlotHeader* slot = slot_at(offset);
    SlotRef r;
    if (slot && resolve(*slot, &r) && r.stripe == stripe &&
        std::size_t{r.length} * (1 + g_.state_per_value) <= undo_capacity) {
      overwrite_slot(r, undo, undo + r.length, update_count);
      done = Recovery::rolled_back;
    }
  }
  log.phase.store(UndoPhase::idle, std::memory_order_release);
  lock.release_for(owner);
  return done;
}

std::uint32_t Store::release_locks_of(std::uint32_t owner) noexcept {
  std::uint32_t released = 0;
  for (std::uint32_t i = 0; i < g_.stripes; ++i) released += stripe_at(i).release_for(owner) ? 1 : 0;
  return released;
}

SlotHeader* Store::slot_at(std::uint64_t offset) const noexcept {
  if (offset < g_.values_offset || offset - g_.values_offset >= used_bytes_acquire() || offset % kCacheLine != 0)
    return nullptr;
  auto* candidate = reinterpret_cast<SlotHeader*>(base_ + offset);
  if (records_) return record_of(*candidate) ? candidate : nullptr;
  return find(candidate->key) == candidate ? candidate : nullptr;
}

void Store::overwrite_slot(const SlotRef& r, const float* value, const float* state,
                           std::uint64_t update_count) noexcept {
  SlotHeader& slot = *r.slot;
  // An odd version is left by a writer that stopped half-way (recover); either way readers must
  // retry across the copy, and never see again a version they already validated against.
  std::uint64_t seq = slot.seq.load(std::memory_order_relaxed);
  if ((seq & 1) == 0) {
    slot.seq.store(++seq, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
  }
  std::memcpy(slot.values(), value, std::size_t{r.length} * sizeof(float));
  if (r.state) std::memcpy(r.state, state, std::size_t{r.length} * g_.state_per_value * sizeof(float));
  slot.update_count = update_count;
  slot.seq.store(seq + 1, std::memory_order_release);
}

Errc Store::apply(Key key, std::span<const float> grad, const UpdateRuleConfig& rule, float lr_scale) noexcept {
  const SlotRef ref = find_ref(key);
  if (!ref.slot) return Errc::not_found;
  if (ref.length != grad.size()) return Errc::length_mismatch;
  return apply_slot(ref, grad.data(), rule, lr_scale);
}

Errc Store::push(Key key, std::span<const float> grad, float lr_scale) noexcept {
  return apply(key, grad, g_.rule, lr_scale);
}

std::uint32_t Store::state_floats(const SlotHeader& slot) const noexcept {
  return g_.state_per_value * length_of(slot);
}

bool Store::snapshot_slot(SlotHeader& slot, float* value, float* state, std::uint64_t* update_count, std::uint64_t* seq,
                          std::uint64_t* origin, std::uint64_t* marks, std::chrono::nanoseconds patience) noexcept {
  SlotRef r;
  if (!resolve(slot, &r)) return true;
  const std::uint64_t* mine = marks ? marks_of(slot) : nullptr;
  SharedMutex& lock = stripe_at(r.stripe);
  if (patience == std::chrono::nanoseconds::max())
    lock.lock();
  else if (!lock.lock_for(SharedMutex::kAnonymousOwner, patience))
    return false;
  if (marks) {
    if (mine)
      std::memcpy(marks, mine, marks_per_key_ * sizeof *marks);
    else
      std::memset(marks, 0, marks_per_key_ * sizeof *marks);
  }
  std::memcpy(value, slot.values(), std::size_t{r.length} * sizeof(float));
  if (r.state) std::memcpy(state, r.state, std::size_t{r.length} * g_.state_per_value * sizeof(float));
  *update_count = slot.update_count;
  if (seq) *seq = slot.seq.load(std::memory_order_relaxed);  // even: writers hold the lock while it is odd
  if (origin) {
    origin[0] = slot.origin_epoch;
    origin[1] = slot.origin_seq;
  }
  lock.unlock();
  return true;
}

Errc Store::restore_slot(Key key, std::span<const float> value, std::span<const float> state,
                         std::uint64_t update_count) {
  if (Errc e = init(key, value); e != Errc::ok) return e;
  SlotHeader* slot = find(key);
  SlotRef r;
  if (!slot || !resolve(*slot, &r)) return Errc::protocol;
  if (state.size() != std::size_t{r.length} * g_.state_per_value) return Errc::length_mismatch;
  SharedMutex& lock = stripe_at(r.stripe);
  lock.lock();
  overwrite_slot(r, value.data(), state.data(), update_count);
  lock.unlock();
  return Errc::ok;
}

Errc Store::put_if_newer(Key key, std::span<const float> value, std::span<const float> state,
                         std::uint64_t update_count, std::uint64_t origin_epoch, std::uint64_t origin_seq,
                         const std::uint64_t* marks, bool* taken) {
  if (taken) *taken = false;
  if (value.size() > UINT32_MAX) return Errc::invalid_argument;
  if (Errc e = create_slot(key, static_cast<std::uint32_t>(value.size()), nullptr); e != Errc::ok) return e;
  const SlotRef r = find_ref(key);
  if (!r.slot) return Errc::protocol;
  if (state.size() != std::size_t{r.length} * g_.state_per_value) return Errc::length_mismatch;
  std::uint64_t* mine = marks ? marks_of(*r.slot) : nullptr;
  SharedMutex& lock = stripe_at(r.stripe);
  lock.lock();
  SlotHeader& slot = *r.slot;
  if (origin_epoch > slot.origin_epoch || (origin_epoch == slot.origin_epoch && origin_seq > slot.origin_seq)) {
    overwrite_slot(r, value.data(), state.data(), update_count);
    slot.origin_epoch = origin_epoch;
    slot.origin_seq = origin_seq;
    if (mine) std::memcpy(mine, marks, marks_per_key_ * sizeof *marks);
    if (taken) *taken = true;
  }
  lock.unlock();
  return Errc::ok;
}

Errc Store::touch(Key key) noexcept {
  const SlotRef r = find_ref(key);
  if (!r.slot) return Errc::not_found;
  SharedMutex& lock = stripe_at(r.stripe);
  if (!lock_stripe(lock)) return Errc::timeout;
  // An odd version (a writer that stopped half-way) is closed, as overwrite_slot does.
  const std::uint64_t seq = r.slot->seq.load(std::memory_order_relaxed);
  r.slot->seq.store(seq + 1, std::memory_order_relaxed);
  if ((seq & 1) == 0) {
    std::atomic_thread_fence(std::memory_order_release);
    r.slot->seq.store(seq + 2, std::memory_order_release);
  }
  lock.unlock();
  return Errc::ok;
}

std::vector<Store::SlotEntry> Store::slots_in_order() const {
  std::vector<SlotEntry> out;
  if (records_) {
    std::lock_guard guard(create_mu_);
    out.reserve(order_.size());
    for (const Record* r : order_) {
      const SlotRef ref = ref_of(*r);
      out.push_back({ref.slot, r->key, ref.length});
    }
    return out;
  }
  // An attached store follows the length words, each checked: a bad one ends the walk.
  const std::uint64_t used = used_bytes_acquire();
  for (std::uint64_t off = 0; off + sizeof(SlotHeader) <= used;) {
    auto* slot = reinterpret_cast<SlotHeader*>(base_ + g_.values_offset + off);
    const std::uint32_t length = slot->length;
    if (length == 0 || slot_bytes(length) > used - off) break;
    out.push_back({slot, slot->key, length});
    off += slot_bytes(length);
  }
  return out;
}

std::vector<Store::Adoptable> Store::adoptable_slots(std::vector<std::string>* refused) const {
  struct Published {
    std::uint64_t at;  // offset in the value arena
    Key key;
  };
  std::vector<Published> published;
  for (std::uint64_t i = 0; i <= index_mask_; ++i) {
    const std::uint64_t slot = index_[i].slot.load(std::memory_order_acquire);
    if (slot == kEmpty) continue;
    const Key key = index_[i].key.load(std::memory_order_relaxed);
    const std::uint64_t at = slot - 1 - g_.values_offset;  // wraps to huge below the arena
    if (at > g_.values_bytes - sizeof(SlotHeader) || at % kCacheLine != 0) {
      refused->push_back("index entry " + std::to_string(i) + " (key " + std::to_string(key) +
                         ") points outside the value arena");
      continue;
    }
    published.push_back({at, key});
  }
  std::sort(published.begin(), published.end(), [](const Published& a, const Published& b) { return a.at < b.at; });
  std::unordered_set<Key> taken;  // a key published twice (a scribbled index) is taken at its first slot
  std::vector<Adoptable> out;
  out.reserve(published.size());
  std::uint64_t expected = 0;  // where the next slot starts
  for (std::size_t i = 0; i < published.size(); ++i) {
    const Published& p = published[i];
    const auto* slot = reinterpret_cast<const SlotHeader*>(base_ + g_.values_offset + p.at);
    const std::uint32_t length = slot->length;
    const std::uint64_t end = i + 1 < published.size() ? published[i + 1].at : g_.values_bytes;
    const auto k = [&] { return "key " + std::to_string(p.key); };  // for refusals only
    // Each accepted slot ends exactly where the next published one starts, so a gap is a slot whose
    // index entry was lost (its key is unknown), never an overlap.
    if (p.at != expected)
      refused->push_back("arena bytes " + std::to_string(expected) + " to " + std::to_string(p.at) +
                         " hold no published key (an index entry was overwritten?)");
    if (slot->key != p.key)
      refused->push_back(k() + ": its slot header names key " + std::to_string(slot->key));
    else if (length == 0 || slot_bytes(length) > end - p.at ||
             (i + 1 < published.size() && slot_bytes(length) != end - p.at))
      refused->push_back(k() + ": its slot header's length " + std::to_string(length) + " floats does not fit the " +
                         std::to_string(end - p.at) + " bytes up to the next slot");
    else {
      expected = p.at + slot_bytes(length);
      if (taken.insert(p.key).second)
        out.push_back({p.key, ref_at(p.at, length, p.key)});
      else
        refused->push_back(k() + ": published again at a later slot");
      continue;
    }
    // A refused slot still ends where the next one starts, so one bad header costs one key.
    expected = end;
  }
  return out;
}

Errc Store::pull_batch(std::span<const Key> keys, std::span<const std::span<float>> out,
                       std::size_t* failed_at) const noexcept {
  if (keys.size() != out.size()) return Errc::invalid_argument;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const ReadResult r = pull(keys[i], out[i]);
    if (r.status != Errc::ok) {
      if (failed_at) *failed_at = i;
      return r.status;
    }
  }
  return Errc::ok;
}

Errc Store::push_batch(std::span<const Key> keys, std::span<const std::span<const float>> grads, float lr_scale,
                       std::size_t* failed_at) noexcept {
  if (keys.size() != grads.size()) return Errc::invalid_argument;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const Errc e = push(keys[i], grads[i], lr_scale);
    if (e != Errc::ok) {
      if (failed_at) *failed_at = i;
      return e;
    }
  }
  return Errc::ok;
}

}  // namespace pskv
