#include "store/store.h"

#include <bit>
#include <cstring>
#include <new>
#include <string>
#include <thread>

#include "store/update_kernels.h"

namespace pskv {

namespace {
constexpr std::uint64_t kMagic = 0x31565f564b53505bULL;  // "[PSKV_V1"
constexpr std::uint32_t kLayoutVersion = 1;
constexpr std::uint64_t kEmpty = 0;
constexpr std::uint64_t kHeaderBlock = 256;
}  // namespace

struct alignas(64) Store::Header {
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
  alignas(64) SharedMutex create_lock;
  alignas(64) std::atomic<std::uint64_t> values_used;
  std::atomic<std::uint64_t> state_used;
  std::atomic<std::uint64_t> key_count;
};


namespace {
struct Layout {
  std::uint64_t stripes_offset, index_offset, index_capacity, values_offset, state_offset, state_bytes, total;
};

Layout layout_for(const StoreOptions& o) {
  Layout l{};
  std::uint64_t off = kHeaderBlock;
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
  if (o.arena_bytes < kCacheLine * 2 || o.arena_bytes > (1ull << 42))
    throw Error(Errc::invalid_argument, "arena_bytes must be in [128, 2^42], got " + std::to_string(o.arena_bytes));
}
}  // namespace

Store::Store(std::unique_ptr<MemoryResource> memory) : memory_(std::move(memory)), base_(memory_->data()) {
  index_ = reinterpret_cast<IndexEntry*>(base_ + header().index_offset);
  index_mask_ = header().index_capacity - 1;
}
Store::~Store() = default;

std::size_t Store::required_bytes(const StoreOptions& options) {
  validate(options);
  return layout_for(options).total;
}

std::unique_ptr<Store> Store::create(std::unique_ptr<MemoryResource> memory, const StoreOptions& options) {
  static_assert(sizeof(Header) <= kHeaderBlock);
  static_assert(sizeof(IndexEntry) == 16);
  validate(options);
  if (!memory) throw Error(Errc::invalid_argument, "Store::create: no memory");
  const Layout l = layout_for(options);
  if (memory->size() < l.total)
    throw Error(Errc::capacity, "store region has " + std::to_string(memory->size()) + " bytes, needs " +
                                    std::to_string(l.total));
  if (reinterpret_cast<std::uintptr_t>(memory->data()) % kCacheLine != 0)
    throw Error(Errc::invalid_argument, "store region is not 64-byte aligned");
  std::byte* base = memory->data();
  // The index and locks must start zeroed; the arenas are written before they are published.
  std::memset(base, 0, l.values_offset);
  auto* h = new (base) Header{};
  h->layout_version = kLayoutVersion;
  h->stripes = options.stripes;
  h->max_keys = options.max_keys;
  h->index_capacity = l.index_capacity;
  h->stripes_offset = l.stripes_offset;
  h->index_offset = l.index_offset;
  h->values_offset = l.values_offset;
  h->values_bytes = options.arena_bytes;
  h->state_offset = l.state_offset;
  h->state_bytes = l.state_bytes;
  h->total_bytes = l.total;
  h->rule = options.rule;
  for (std::uint32_t i = 0; i < options.stripes; ++i) new (base + l.stripes_offset + i * kCacheLine) SharedMutex();
  std::atomic_thread_fence(std::memory_order_release);
  std::atomic_ref<std::uint64_t>(h->magic).store(kMagic, std::memory_order_release);
  return std::unique_ptr<Store>(new Store(std::move(memory)));
}

std::unique_ptr<Store> Store::attach(std::unique_ptr<MemoryResource> memory) {
  if (!memory || memory->size() < sizeof(Header))
    throw Error(Errc::invalid_argument, "Store::attach: region too small to hold a store");
  auto* h = reinterpret_cast<Header*>(memory->data());
  if (std::atomic_ref<std::uint64_t>(h->magic).load(std::memory_order_acquire) != kMagic)
    throw Error(Errc::protocol, "region does not hold a pskv store (bad magic); was it created by pskv-server?");
  if (h->layout_version != kLayoutVersion)
    throw Error(Errc::protocol, "store layout version " + std::to_string(h->layout_version) + " but this build reads " +
                                    std::to_string(kLayoutVersion) + "; use matching pskv builds");
  if (h->total_bytes > memory->size())
    throw Error(Errc::protocol, "store header claims " + std::to_string(h->total_bytes) + " bytes but the region has " +
                                    std::to_string(memory->size()));
  return std::unique_ptr<Store>(new Store(std::move(memory)));
}

Store::Header& Store::header() const noexcept { return *reinterpret_cast<Header*>(base_); }
Store::IndexEntry* Store::index() const noexcept {
  return reinterpret_cast<IndexEntry*>(base_ + header().index_offset);
}
std::uint32_t Store::stripe_of(Key key) const noexcept {
  return static_cast<std::uint32_t>((mix64(key) >> 40) & (header().stripes - 1));
}
SharedMutex& Store::stripe_at(std::uint32_t stripe) const noexcept {
  return *reinterpret_cast<SharedMutex*>(base_ + header().stripes_offset + std::uint64_t{stripe} * kCacheLine);
}
SharedMutex& Store::stripe_lock(Key key) const noexcept { return stripe_at(stripe_of(key)); }
std::byte* Store::value_arena() noexcept { return base_ + header().values_offset; }
std::byte* Store::value_arena_const() const noexcept { return base_ + header().values_offset; }
std::uint64_t Store::used_bytes_acquire() const noexcept { return header().values_used.load(std::memory_order_acquire); }
float* Store::state_of(SlotHeader& slot) const noexcept {
  return reinterpret_cast<float*>(base_ + header().state_offset + slot.state_offset);
}

const UpdateRuleConfig& Store::rule() const noexcept { return header().rule; }
std::uint32_t Store::stripes() const noexcept { return header().stripes; }
std::uint64_t Store::key_count() const noexcept { return header().key_count.load(std::memory_order_relaxed); }
std::uint64_t Store::max_keys() const noexcept { return header().max_keys; }
std::uint64_t Store::value_bytes_used() const noexcept { return used_bytes_acquire(); }
std::uint64_t Store::value_bytes_capacity() const noexcept { return header().values_bytes; }

Errc Store::create_slot(Key key, std::uint32_t length, const float* initial) {
  if (length == 0) return Errc::invalid_argument;
  Header& h = header();
  std::lock_guard guard(h.create_lock);
  if (SlotHeader* existing = find(key)) return existing->length == length ? Errc::ok : Errc::length_mismatch;
  if (h.key_count.load(std::memory_order_relaxed) >= h.max_keys) return Errc::capacity;
  const std::uint64_t bytes = slot_bytes(length);
  const std::uint64_t used = h.values_used.load(std::memory_order_relaxed);
  if (used + bytes > h.values_bytes) return Errc::capacity;
  const std::uint64_t state_floats = std::uint64_t{state_floats_per_value(h.rule.rule)} * length;
  const std::uint64_t state_bytes = align_up(state_floats * sizeof(float), kCacheLine);
  const std::uint64_t state_used = h.state_used.load(std::memory_order_relaxed);
  if (state_used + state_bytes > h.state_bytes) return Errc::capacity;

  std::byte* base = base_;
  auto* slot = new (base + h.values_offset + used) SlotHeader{};
  slot->key = key;
  slot->length = length;
  slot->state_offset = state_used;
  if (initial)
    std::memcpy(slot->values(), initial, std::size_t{length} * sizeof(float));
  else
    std::memset(slot->values(), 0, std::size_t{length} * sizeof(float));
  if (state_bytes) std::memset(base + h.state_offset + state_used, 0, state_bytes);
  h.state_used.store(state_used + state_bytes, std::memory_order_relaxed);
  h.values_used.store(used + bytes, std::memory_order_release);

  IndexEntry* idx = index();
  const std::uint64_t mask = h.index_capacity - 1;
  std::uint64_t i = mix64(key) & mask;
  while (idx[i].slot.load(std::memory_order_relaxed) != kEmpty) i = (i + 1) & mask;
  idx[i].key.store(key, std::memory_order_relaxed);
  idx[i].slot.store(h.values_offset + used + 1, std::memory_order_release);
  h.key_count.fetch_add(1, std::memory_order_relaxed);
  return Errc::ok;
}

Errc Store::init(Key key, std::span<const float> initial) {
  if (initial.size() > UINT32_MAX) return Errc::invalid_argument;
  return create_slot(key, static_cast<std::uint32_t>(initial.size()), initial.data());
}

Errc Store::init_zero(Key key, std::uint32_t length) { return create_slot(key, length, nullptr); }

bool Store::copy_if_unchanged(const SlotHeader& slot, float* out, std::uint64_t* version) noexcept {
  const std::uint64_t before = stable_version(slot);
  seqlock_copy(out, slot.values(), std::size_t{slot.length} * sizeof(float));
  std::atomic_thread_fence(std::memory_order_acquire);
  *version = before;
  return slot.seq.load(std::memory_order_relaxed) == before;
}

ReadResult Store::read_slot(const SlotHeader& slot, float* out) noexcept {
  std::uint64_t version = 0;
  while (!copy_if_unchanged(slot, out, &version)) {
  }
  return {Errc::ok, version};
}

ReadResult Store::read_slot_or_lock(const SlotHeader& slot, float* out) const noexcept {
  std::uint64_t version = 0;
  for (int attempt = 0; !copy_if_unchanged(slot, out, &version); ++attempt) {
    if (attempt < 2) continue;
    // Bounded patience: a holder that is stopped (a SIGSTOPped shm worker) must not take this
    // thread with it; the optimistic copy is tried again in between.
    SharedMutex& lock = stripe_lock(slot.key);
    if (lock.lock_for(SharedMutex::kAnonymousOwner, std::chrono::milliseconds(1))) {
      std::memcpy(out, slot.values(), std::size_t{slot.length} * sizeof(float));
      version = slot.seq.load(std::memory_order_relaxed);
      lock.unlock();
      break;
    }
  }
  return {Errc::ok, version};
}

std::uint64_t Store::stable_version(const SlotHeader& slot) noexcept {
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

ReadResult Store::pull(Key key, std::span<float> out) const noexcept {
  const SlotHeader* slot = find(key);
  if (!slot) return {Errc::not_found, 0};
  if (slot->length != out.size()) return {Errc::length_mismatch, 0};
  return read_slot(*slot, out.data());
}

Errc Store::apply_slot(SlotHeader& slot, const float* grad, const UpdateRuleConfig& rule, float lr_scale) noexcept {
  // The state arena was sized for the store's own rule; a rule needing more state cannot run.
  if (state_floats_per_value(rule.rule) > state_floats_per_value(header().rule.rule)) return Errc::unsupported;
  std::uint64_t step = 0;
  apply_locked(slot, rule, 0, grad, slot.length, lr_scale, &step);
  return Errc::ok;
}

void Store::apply_part(SlotHeader& slot, std::size_t begin, const float* grad, std::size_t n,
                       std::uint64_t* step) noexcept {
  apply_locked(slot, header().rule, begin, grad, n, 1.0f, step);
}

void Store::apply_locked(SlotHeader& slot, const UpdateRuleConfig& rule, std::size_t begin, const float* grad,
                         std::size_t n, float lr_scale, std::uint64_t* step) noexcept {
  std::lock_guard guard(stripe_lock(slot.key));
  apply_seqlocked(slot, rule, begin, grad, n, lr_scale, step);
}

void Store::apply_seqlocked(SlotHeader& slot, const UpdateRuleConfig& rule, std::size_t begin, const float* grad,
                            std::size_t n, float lr_scale, std::uint64_t* step) noexcept {
  float* state = state_floats_per_value(rule.rule) ? state_of(slot) : nullptr;
  const std::uint64_t seq = slot.seq.load(std::memory_order_relaxed);
  slot.seq.store(seq + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  if (*step == 0) *step = ++slot.update_count;
  apply_update_part(rule, slot.values(), state, slot.length, begin, grad, n, *step, lr_scale);
  slot.seq.store(seq + 2, std::memory_order_release);
}

Errc Store::apply_logged(SlotHeader& slot, const float* grad, float lr_scale, std::uint32_t owner, UndoRecord& log,
                         float* undo, std::chrono::nanoseconds patience) noexcept {
  const std::size_t length = slot.length;
  const std::size_t state_count = state_floats(slot);
  const std::uint32_t stripe = stripe_of(slot.key);
  log.stripe = stripe;
  log.slot_offset = slot_offset(slot);
  // Announced before the lock is taken, so that a recoverer knows which lock to look at.
  log.phase.store(UndoPhase::locking, std::memory_order_seq_cst);
  SharedMutex& lock = stripe_at(stripe);
  if (!lock.lock_for(owner, patience)) {
    log.phase.store(UndoPhase::idle, std::memory_order_release);
    return Errc::timeout;
  }
  log.seq = slot.seq.load(std::memory_order_relaxed);
  log.update_count = slot.update_count;
  copy_floats(undo, slot.values(), length);
  if (state_count) copy_floats(undo + length, state_of(slot), state_count);
  log.phase.store(UndoPhase::saved, std::memory_order_release);
  std::uint64_t step = 0;
  apply_seqlocked(slot, header().rule, 0, grad, length, lr_scale, &step);
  log.phase.store(UndoPhase::applied, std::memory_order_release);
  lock.unlock();
  log.phase.store(UndoPhase::idle, std::memory_order_release);
  return Errc::ok;
}

Store::Recovery Store::recover(UndoRecord& log, std::uint32_t owner, const float* undo,
                               std::size_t undo_capacity) noexcept {
  const UndoPhase phase = log.phase.load(std::memory_order_acquire);
  if (phase == UndoPhase::idle || log.stripe >= header().stripes) {
    log.phase.store(UndoPhase::idle, std::memory_order_relaxed);
    return Recovery::nothing;
  }
  SharedMutex& lock = stripe_at(log.stripe);
  // In phase locking the owner may have died before its compare-and-swap: then it holds nothing.
  if (lock.holder() != owner) {
    log.phase.store(UndoPhase::idle, std::memory_order_relaxed);
    return Recovery::nothing;
  }
  Recovery done = Recovery::released;
  if (phase == UndoPhase::saved) {
    // Only a slot the index knows, on this stripe, is touched.
    SlotHeader* slot = slot_at(log.slot_offset);
    if (slot && stripe_of(slot->key) == log.stripe && undo_floats(*slot) <= undo_capacity) {
      overwrite_slot(*slot, undo, undo + slot->length, log.update_count);
      done = Recovery::rolled_back;
    }
  }
  log.phase.store(UndoPhase::idle, std::memory_order_release);
  lock.release_for(owner);
  return done;
}

SlotHeader* Store::slot_at(std::uint64_t offset) const noexcept {
  const Header& h = header();
  if (offset < h.values_offset || offset >= h.values_offset + used_bytes_acquire() || offset % kCacheLine != 0)
    return nullptr;
  auto* candidate = reinterpret_cast<SlotHeader*>(base_ + offset);
  return find(candidate->key) == candidate ? candidate : nullptr;
}

void Store::overwrite_slot(SlotHeader& slot, const float* value, const float* state, std::uint64_t update_count) noexcept {
  // An odd version is left by a writer that stopped half-way (recover); either way readers must
  // retry across the copy, and never see again a version they already validated against.
  std::uint64_t seq = slot.seq.load(std::memory_order_relaxed);
  if ((seq & 1) == 0) {
    slot.seq.store(++seq, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
  }
  std::memcpy(slot.values(), value, std::size_t{slot.length} * sizeof(float));
  if (const std::size_t n = state_floats(slot)) std::memcpy(state_of(slot), state, n * sizeof(float));
  slot.update_count = update_count;
  slot.seq.store(seq + 1, std::memory_order_release);
}

Errc Store::apply(Key key, std::span<const float> grad, const UpdateRuleConfig& rule, float lr_scale) noexcept {
  SlotHeader* slot = find(key);
  if (!slot) return Errc::not_found;
  if (slot->length != grad.size()) return Errc::length_mismatch;
  return apply_slot(*slot, grad.data(), rule, lr_scale);
}

Errc Store::push(Key key, std::span<const float> grad, float lr_scale) noexcept {
  return apply(key, grad, header().rule, lr_scale);
}

std::uint32_t Store::state_floats(const SlotHeader& slot) const noexcept {
  return state_floats_per_value(header().rule.rule) * slot.length;
}

void Store::snapshot_slot(SlotHeader& slot, float* value, float* state, std::uint64_t* update_count) noexcept {
  std::lock_guard guard(stripe_lock(slot.key));
  std::memcpy(value, slot.values(), std::size_t{slot.length} * sizeof(float));
  if (const std::uint32_t n = state_floats(slot)) std::memcpy(state, state_of(slot), std::size_t{n} * sizeof(float));
  *update_count = slot.update_count;
}

Errc Store::restore_slot(Key key, std::span<const float> value, std::span<const float> state, std::uint64_t update_count) {
  if (Errc e = init(key, value); e != Errc::ok) return e;
  SlotHeader* slot = find(key);
  if (state.size() != state_floats(*slot)) return Errc::length_mismatch;
  std::lock_guard guard(stripe_lock(key));
  overwrite_slot(*slot, value.data(), state.data(), update_count);
  return Errc::ok;
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
