#include "store/sync_accumulator.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>

namespace pskv {

namespace {

// The control word keeps the next step in 48 bits; a window past it must not wrap either.
constexpr std::uint64_t kMaxNextStep = (std::uint64_t{1} << 48) - 16;

std::uint64_t load_control(const std::uint64_t* block) noexcept {
  return std::atomic_ref<std::uint64_t>(*const_cast<std::uint64_t*>(block)).load(std::memory_order_acquire);
}

// The one store that makes an accumulation or an applied step happen, for a kill as for anyone.
void store_control(std::uint64_t* block, std::uint64_t control) noexcept {
  std::atomic_signal_fence(std::memory_order_seq_cst);
  std::atomic_ref<std::uint64_t>(*block).store(control, std::memory_order_release);
}

}  // namespace

SyncAccumulator::SyncAccumulator(Store& store, SyncOptions options, std::shared_ptr<SyncSpace> space)
    : store_(store), options_(options), space_(std::move(space)) {
  if (options_.num_workers == 0) throw Error(Errc::invalid_argument, "sync aggregation needs at least one worker");
  if (options_.required == 0) options_.required = options_.num_workers;
  if (options_.required > options_.num_workers)
    throw Error(Errc::invalid_argument, "sync aggregation: K=" + std::to_string(options_.required) +
                                            " exceeds N=" + std::to_string(options_.num_workers) + " workers");
  if (options_.window == 0) options_.window = 1;
  if (options_.window > kMaxWindow)
    throw Error(Errc::invalid_argument, "sync aggregation: a window of " + std::to_string(options_.window) +
                                            " steps is past the largest, " + std::to_string(kMaxWindow));
}

std::uint64_t SyncAccumulator::control_of(const std::uint64_t* block) noexcept {
  return load_control(block);
}

std::uint64_t* SyncAccumulator::block_of(Key key, std::uint32_t length, KeyState& st) {
  if (st.block) return st.block;
  const std::uint64_t words = block_words(length);
  if (space_) {
    st.block = space_->allocate(key, length, words);
  } else {
    // Zeroed (next step 0, no entry in use), by fresh pages for a large block.
    st.owned.reset(static_cast<std::uint64_t*>(std::calloc(words, sizeof(std::uint64_t))));
    if (!st.owned) throw Error(Errc::capacity, "no memory for the sync steps of key " + std::to_string(key));
    st.block = st.owned.get();
    st.backed = ~0u;
  }
  return st.block;
}

std::uint64_t* SyncAccumulator::writable_entry(KeyState& st, std::uint32_t length, unsigned e) {
  std::uint64_t* at = entry(st.block, length, e);
  if (!(st.backed >> e & 1)) {
    space_->back(at, entry_words(length));
    st.backed |= 1u << e;
  }
  return at;
}

Errc SyncAccumulator::prepare(Key key, std::uint32_t length, std::uint64_t step, std::uint64_t* next) {
  Stripe& s = stripe(key);
  std::lock_guard guard(s.mu);
  KeyState& st = s.keys[key];
  try {
    block_of(key, length, st);
    // Two entries carry a worker's lockstep steps (a step's sum moves between them), so only a
    // push that runs ahead may still need one backed.
    writable_entry(st, length, 0);
    writable_entry(st, length, 1);
  } catch (const Error& e) {
    return e.code();
  }
  const std::uint64_t at = Control(load_control(st.block)).next;
  if (next) *next = at;
  return step < at || step - at < options_.window ? Errc::ok : Errc::invalid_argument;
}

SyncOutcome SyncAccumulator::add(Key key, std::uint32_t worker, std::uint64_t step, std::span<const float> grad,
                                 Errc* error, const UndoLog* undo) {
  auto reject = [&](Errc e) {
    if (error) *error = e;
    return SyncOutcome::rejected;
  };
  if (worker >= options_.num_workers) return reject(Errc::invalid_argument);
  const SlotHeader* slot = store_.find(key);
  if (!slot) return reject(Errc::not_found);
  const auto length = static_cast<std::uint32_t>(grad.size());
  if (store_.length_of(*slot) != length) return reject(Errc::length_mismatch);

  Stripe& s = stripe(key);
  std::lock_guard guard(s.mu);
  KeyState& st = s.keys[key];
  std::uint64_t* block;
  try {
    block = block_of(key, length, st);
  } catch (const Error& e) {
    return reject(e.code());  // the space is full: nothing of this key is summed
  }
  const auto [next, mask] = Control(load_control(block));
  if (step < next) {
    ++s.stats.dropped_late;
    return SyncOutcome::dropped_late;
  }
  if (step >= next + options_.window) return SyncOutcome::too_far_ahead;

  const std::uint32_t bw = bitmap_words();
  const std::uint64_t bit_word = worker / 64, bit = 1ull << (worker % 64);
  const unsigned found = find_entry(block, length, mask, step);
  const std::uint64_t* from = found < entries() ? entry(block, length, found) : nullptr;
  if (from && (from[2 + bit_word] & bit)) {
    ++s.stats.duplicates;
    // Its first push may have been cut off between its sum and the step's apply.
    if (Errc e = apply_ready(key, *slot, length, block, s.stats, undo); e != Errc::ok) return reject(e);
    return SyncOutcome::duplicate;
  }
  // A step within the window has an entry or a free one: at most `window` are in use.
  const auto free_entry = static_cast<unsigned>(std::countr_one(mask));
  if (free_entry >= entries()) return reject(Errc::protocol);
  std::uint64_t* to;
  try {
    to = writable_entry(st, length, free_entry);
  } catch (const Error& e) {
    return reject(e.code());
  }
  float* to_sum = reinterpret_cast<float*>(to + 2 + bw);
  std::uint32_t new_mask = mask | (1u << free_entry);
  to[0] = step;
  if (!from) {
    to[1] = 1;
    for (std::uint32_t w = 0; w < bw; ++w) to[2 + w] = 0;
    std::memcpy(to_sum, grad.data(), grad.size_bytes());
  } else {
    to[1] = from[1] + 1;
    for (std::uint32_t w = 0; w < bw; ++w) to[2 + w] = from[2 + w];
    const auto* from_sum = reinterpret_cast<const float*>(from + 2 + bw);
    for (std::uint32_t i = 0; i < length; ++i) to_sum[i] = from_sum[i] + grad[i];
    new_mask &= ~(1u << found);
  }
  to[2 + bit_word] |= bit;
  store_control(block, Control(next, new_mask).word());

  if (Errc e = apply_ready(key, *slot, length, block, s.stats, undo); e != Errc::ok) return reject(e);
  if (Control(load_control(block)).next > next) return SyncOutcome::applied;
  if (options_.replicated)
    if (Errc e = store_.touch(key); e != Errc::ok) return reject(e);
  return SyncOutcome::accumulated;
}

Errc SyncAccumulator::apply_ready(Key key, const SlotHeader& slot, std::uint32_t length, std::uint64_t* block,
                                  SyncStats& stats, const UndoLog* undo) {
  thread_local std::vector<float> mean;
  const std::uint32_t bw = bitmap_words();
  for (;;) {
    const auto [next, mask] = Control(load_control(block));
    const unsigned ready = find_entry(block, length, mask, next);
    if (ready == entries()) return Errc::ok;
    const std::uint64_t* en = entry(block, length, ready);
    const auto count = static_cast<std::uint32_t>(en[1]);
    if (count < options_.required) return Errc::ok;
    // The mean goes elsewhere: the entry stays as it was until the step counts as applied.
    const auto* sum = reinterpret_cast<const float*>(en + 2 + bw);
    const float inv = 1.0f / static_cast<float>(count);
    mean.resize(length);
    for (std::uint32_t i = 0; i < length; ++i) mean[i] = sum[i] * inv;
    const float lr_scale = options_.linear_lr_scaling ? static_cast<float>(count) : 1.0f;
    const std::uint64_t applied = Control(next + 1, mask & ~(1u << ready)).word();
    Errc e;
    if (undo && undo->sync_mark) {
      SyncApplyMark& mark = *undo->sync_mark;
      mark.key = key;
      mark.control = applied;
      mark.active.store(1, std::memory_order_release);
      std::atomic_signal_fence(std::memory_order_seq_cst);
      e = store_.apply_logged(const_cast<SlotHeader&>(slot), mean.data(), length, lr_scale, undo->owner, *undo->record,
                              undo->buffer, undo->capacity, undo->patience, nullptr, block, applied);
      std::atomic_signal_fence(std::memory_order_seq_cst);
      mark.active.store(0, std::memory_order_release);
      if (e != Errc::ok) return e;  // nothing changed: the step stays ready for the next push
    } else {
      e = store_.push(key, mean, lr_scale);
      store_control(block, applied);
    }
    ++stats.applied_steps;
    if (e != Errc::ok) return e;
  }
}

std::uint64_t SyncAccumulator::next_step(Key key) const {
  Stripe& s = stripe(key);
  std::lock_guard guard(s.mu);
  auto it = s.keys.find(key);
  return it == s.keys.end() || !it->second.block ? 0 : Control(load_control(it->second.block)).next;
}

SyncStats SyncAccumulator::stats() const {
  SyncStats total;
  for (const Stripe& s : stripes_) {
    std::lock_guard guard(s.mu);
    total.applied_steps += s.stats.applied_steps;
    total.dropped_late += s.stats.dropped_late;
    total.duplicates += s.stats.duplicates;
  }
  return total;
}

namespace {
void put_word(float*& out, std::uint64_t w) noexcept {
  std::memcpy(out, &w, sizeof w);
  out += 2;
}
std::uint64_t get_word(const float*& in) noexcept {
  std::uint64_t w;
  std::memcpy(&w, in, sizeof w);
  in += 2;
  return w;
}
}  // namespace

bool SyncAccumulator::export_block(const std::uint64_t* block, std::uint32_t length, float* out) const {
  std::memset(out, 0, state_floats(length) * sizeof(float));
  const auto [next, mask] = Control(load_control(block));
  if (static_cast<unsigned>(std::popcount(mask)) > options_.window || (mask >> entries()) != 0) return false;
  put_word(out, next);
  const std::uint32_t bw = bitmap_words();
  for (unsigned e = 0; e < entries(); ++e) {
    if (!(mask >> e & 1)) continue;
    const std::uint64_t* en = entry(block, length, e);
    for (std::uint32_t w = 0; w < 2 + bw; ++w) put_word(out, en[w]);
    std::memcpy(out, en + 2 + bw, std::size_t{length} * sizeof(float));
    out += length;
  }
  return true;
}

void SyncAccumulator::export_state(Key key, std::uint32_t length, float* out) const {
  const Stripe& s = stripe(key);
  auto it = s.keys.find(key);
  if (it == s.keys.end() || !it->second.block) {
    std::memset(out, 0, state_floats(length) * sizeof(float));
    return;
  }
  export_block(it->second.block, length, out);  // this process's blocks hold at most a window
}

std::uint64_t SyncAccumulator::used_state_floats(std::uint32_t length, const float* state) const noexcept {
  const std::uint64_t entry_floats = state_entry_floats(options_.num_workers, length);
  const float* at = state;
  const std::uint64_t next = get_word(at);
  std::uint64_t used = 2;
  for (std::uint32_t i = 0; i < options_.window; ++i) {
    at = state + used + 2;  // the entry's contributor count
    if (get_word(at) == 0) break;
    used += entry_floats;
  }
  return used == 2 && next == 0 ? 0 : used;
}

Errc SyncAccumulator::check_state(std::uint32_t length, const float* in, std::string* why, bool complete_ok) const {
  auto refuse = [&](const std::string& what) {
    if (why) *why = "sync state: " + what;
    return Errc::protocol;
  };
  const std::uint64_t next = get_word(in);
  if (next >= kMaxNextStep) return refuse("next step " + std::to_string(next) + " is past any clock");
  std::vector<std::uint64_t> steps;
  for (std::uint32_t i = 0; i < options_.window; ++i) {
    const std::uint64_t step = get_word(in), count = get_word(in);
    std::uint64_t set = 0;
    for (std::uint32_t w = 0; w < bitmap_words(); ++w) {
      const std::uint64_t word = get_word(in);
      const std::uint32_t first = w * 64;
      if (options_.num_workers - first < 64 && (word >> (options_.num_workers - first)) != 0)
        return refuse("a contributor past worker " + std::to_string(options_.num_workers - 1));
      set += static_cast<std::uint64_t>(std::popcount(word));
    }
    in += length;
    if (count == 0) {
      if (set != 0) return refuse("contributors in an unused entry");
      continue;
    }
    if (set != count)
      return refuse("a step counts " + std::to_string(count) + " contributors of " + std::to_string(set));
    if (step < next || step - next >= options_.window)
      return refuse("step " + std::to_string(step) + " is outside the window at " + std::to_string(next));
    if (step == next && count >= options_.required && !complete_ok)
      return refuse("step " + std::to_string(step) + " has its " + std::to_string(count) +
                    " contributors and was never applied");
    if (std::find(steps.begin(), steps.end(), step) != steps.end())
      return refuse("step " + std::to_string(step) + " is pending twice");
    steps.push_back(step);
  }
  return Errc::ok;
}

void SyncAccumulator::import_state(Key key, std::uint32_t length, const float* in) {
  Stripe& s = stripe(key);
  KeyState& st = s.keys[key];
  std::uint64_t* block = block_of(key, length, st);
  const std::uint64_t next = get_word(in);
  const std::uint32_t bw = bitmap_words();
  std::uint32_t mask = 0;
  unsigned e = 0;
  for (std::uint32_t i = 0; i < options_.window; ++i) {
    const std::uint64_t step = get_word(in), count = get_word(in);
    if (count == 0) {
      in += 2 * bw + length;
      continue;
    }
    std::uint64_t* en = writable_entry(st, length, e);
    en[0] = step;
    en[1] = count;
    for (std::uint32_t w = 0; w < bw; ++w) en[2 + w] = get_word(in);
    std::memcpy(en + 2 + bw, in, std::size_t{length} * sizeof(float));
    in += length;
    mask |= 1u << e++;
  }
  store_control(block, Control(next, mask).word());
}

Errc SyncAccumulator::adopt_block(Key key, std::uint32_t length, const std::uint64_t* block, std::uint64_t words,
                                  std::string* why) {
  if (words != block_words(length)) {
    if (why)
      *why = "sync state: a block of " + std::to_string(words) + " words, not " + std::to_string(block_words(length));
    return Errc::protocol;
  }
  std::vector<float> state(state_floats(length));
  if (!export_block(block, length, state.data())) {
    if (why) *why = "sync state: more entries in use than a window holds";
    return Errc::protocol;
  }
  return restore_state(key, length, state.data(), why);
}

Errc SyncAccumulator::restore_state(Key key, std::uint32_t length, const float* state, std::string* why) {
  const SlotHeader* slot = store_.find(key);
  if (!slot || store_.length_of(*slot) != length) {
    if (why) *why = "sync state: no key of " + std::to_string(length) + " floats here";
    return Errc::protocol;
  }
  // A dead process may have left its next step complete, its apply undone: apply it here.
  if (Errc e = check_state(length, state, why, true); e != Errc::ok) return e;
  Stripe& s = stripe(key);
  std::lock_guard guard(s.mu);
  try {
    import_state(key, length, state);
  } catch (const Error& e) {
    if (why) *why = std::string("sync state: ") + e.what();
    return e.code();
  }
  return apply_ready(key, *slot, length, s.keys[key].block, s.stats, nullptr);
}

}  // namespace pskv
