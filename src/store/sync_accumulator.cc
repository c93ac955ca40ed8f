#include "store/sync_accumulator.h"

#include <algorithm>
#include <bit>
#include <cstring>

namespace pskv {

SyncAccumulator::SyncAccumulator(Store& store, SyncOptions options) : store_(store), options_(options) {
  if (options_.num_workers == 0) throw Error(Errc::invalid_argument, "sync aggregation needs at least one worker");
  if (options_.required == 0) options_.required = options_.num_workers;
  if (options_.required > options_.num_workers)
    throw Error(Errc::invalid_argument, "sync aggregation: K=" + std::to_string(options_.required) +
                                            " exceeds N=" + std::to_string(options_.num_workers) + " workers");
  if (options_.window == 0) options_.window = 1;
}

SyncAccumulator::Pending SyncAccumulator::take_spare(KeyState& st) {
  if (st.spare.empty()) return {};
  Pending p = std::move(st.spare.back());
  st.spare.pop_back();
  return p;
}

SyncOutcome SyncAccumulator::add(Key key, std::uint32_t worker, std::uint64_t step, std::span<const float> grad,
                                 Errc* error) {
  auto reject = [&](Errc e) {
    if (error) *error = e;
    return SyncOutcome::rejected;
  };
  if (worker >= options_.num_workers) return reject(Errc::invalid_argument);
  const SlotHeader* slot = store_.find(key);
  if (!slot) return reject(Errc::not_found);
  if (store_.length_of(*slot) != grad.size()) return reject(Errc::length_mismatch);

  Stripe& s = stripe(key);
  std::lock_guard guard(s.mu);
  KeyState& st = s.keys[key];
  if (step < st.next_step) {
    ++s.stats.dropped_late;
    return SyncOutcome::dropped_late;
  }
  if (step >= st.next_step + options_.window) return SyncOutcome::too_far_ahead;

  auto it = std::find_if(st.pending.begin(), st.pending.end(), [&](const Pending& p) { return p.step == step; });
  if (it == st.pending.end()) {
    Pending p = take_spare(st);
    p.step = step;
    p.count = 0;
    p.contributors.assign((options_.num_workers + 63) / 64, 0);
    p.sum.assign(grad.begin(), grad.end());
    st.pending.push_back(std::move(p));
    it = st.pending.end() - 1;
  } else {
    if (it->contributors[worker / 64] & (1ull << (worker % 64))) {
      ++s.stats.duplicates;
      return SyncOutcome::duplicate;
    }
    float* sum = it->sum.data();
    for (std::size_t i = 0; i < grad.size(); ++i) sum[i] += grad[i];
  }
  it->contributors[worker / 64] |= 1ull << (worker % 64);
  ++it->count;

  const std::uint64_t before = st.next_step;
  if (Errc e = apply_ready(key, st, s.stats); e != Errc::ok) return reject(e);
  if (st.next_step > before) return SyncOutcome::applied;
  if (options_.replicated)
    if (Errc e = store_.touch(key); e != Errc::ok) return reject(e);
  return SyncOutcome::accumulated;
}

Errc SyncAccumulator::apply_ready(Key key, KeyState& st, SyncStats& stats) {
  for (;;) {
    auto it =
        std::find_if(st.pending.begin(), st.pending.end(), [&](const Pending& p) { return p.step == st.next_step; });
    if (it == st.pending.end() || it->count < options_.required) return Errc::ok;
    const float inv = 1.0f / static_cast<float>(it->count);
    for (float& x : it->sum) x *= inv;
    const float lr_scale = options_.linear_lr_scaling ? static_cast<float>(it->count) : 1.0f;
    const Errc e = store_.push(key, it->sum, lr_scale);
    ++st.next_step;
    ++stats.applied_steps;
    st.spare.push_back(std::move(*it));
    st.pending.erase(it);
    if (e != Errc::ok) return e;
  }
}

std::uint64_t SyncAccumulator::next_step(Key key) const {
  Stripe& s = stripe(key);
  std::lock_guard guard(s.mu);
  auto it = s.keys.find(key);
  return it == s.keys.end() ? 0 : it->second.next_step;
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

void SyncAccumulator::export_state(Key key, std::uint32_t length, float* out) const {
  std::memset(out, 0, state_floats(length) * sizeof(float));
  const Stripe& s = stripe(key);
  auto it = s.keys.find(key);
  if (it == s.keys.end()) return;
  const KeyState& st = it->second;
  put_word(out, st.next_step);
  for (const Pending& p : st.pending) {
    put_word(out, p.step);
    put_word(out, p.count);
    for (std::uint64_t w : p.contributors) put_word(out, w);
    std::memcpy(out, p.sum.data(), std::size_t{length} * sizeof(float));
    out += length;
  }
}

Errc SyncAccumulator::check_state(std::uint32_t length, const float* in, std::string* why) const {
  auto refuse = [&](const std::string& what) {
    if (why) *why = "sync state: " + what;
    return Errc::protocol;
  };
  const std::uint64_t next = get_word(in);
  if (next > UINT64_MAX - options_.window) return refuse("next step " + std::to_string(next) + " is past any clock");
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
    if (step == next && count >= options_.required)
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
  for (Pending& p : st.pending) st.spare.push_back(std::move(p));
  st.pending.clear();
  st.next_step = get_word(in);
  for (std::uint32_t i = 0; i < options_.window; ++i) {
    const std::uint64_t step = get_word(in), count = get_word(in);
    if (count == 0) {  // unused: costs this key no memory
      in += 2 * bitmap_words() + length;
      continue;
    }
    Pending p = take_spare(st);
    p.step = step;
    p.count = static_cast<std::uint32_t>(count);
    p.contributors.resize(bitmap_words());
    for (std::uint64_t& w : p.contributors) w = get_word(in);
    p.sum.assign(in, in + length);
    in += length;
    st.pending.push_back(std::move(p));
  }
  // Kept for the steps to come, as add() keeps them, but no more than it would.
  if (st.spare.size() > options_.window) st.spare.resize(options_.window);
}

}  // namespace pskv
