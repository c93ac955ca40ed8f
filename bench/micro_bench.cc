// Microbenchmarks of the pieces on every hot path: the wire codec, the seqlock read, the clock
// table, and the store's batch lookups over a large random key set.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "layout/clock_table.h"
#include "store/store.h"
#include "transport/wire.h"

namespace pskv {
namespace {

// A push frame of n 16-float keys, parsed as the TCP server parses it.
void BM_ParseRequest(benchmark::State& state) {
  const auto n = static_cast<std::uint32_t>(state.range(0));
  std::vector<std::byte> frame(sizeof(wire::FrameHeader) + n * (sizeof(wire::KeyEntry) + 64));
  const wire::FrameHeader h = wire::make_header(wire::Op::push, 1, n, std::uint64_t{n} * 64);
  std::memcpy(frame.data(), &h, sizeof h);
  for (std::uint32_t i = 0; i < n; ++i) {
    const wire::KeyEntry k{i, 16, 0};
    std::memcpy(frame.data() + sizeof h + i * sizeof k, &k, sizeof k);
  }
  std::vector<wire::KeyEntry> keys;
  keys.reserve(n);
  for (auto _ : state) {
    wire::ParsedFrame f;
    Errc status;
    std::string why;
    benchmark::DoNotOptimize(wire::parse_request(frame.data(), frame.size(), {}, &f, &keys, &status, &why));
  }
  state.SetItemsProcessed(state.iterations() * n);
}

std::unique_ptr<Store> big_store(std::uint64_t keys, std::uint32_t floats) {
  StoreOptions o;
  o.max_keys = keys;
  o.arena_bytes = keys * slot_bytes(floats) + (1 << 20);
  auto s = Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
  for (Key k = 0; k < keys; ++k) s->init_zero(k, floats);
  return s;
}

// One validated read of a 16-float value, with and without a writer on another thread.
void BM_SeqlockRead(benchmark::State& state) {
  static auto s = big_store(64, 16);
  float out[16];
  const SlotRef slot = s->find_ref(7);
  std::vector<float> g(16, 1.0f);
  for (auto _ : state) {
    if (state.thread_index() == 1) {
      s->apply_slot(slot, g.data(), s->rule(), 1.0f);
    } else {
      benchmark::DoNotOptimize(read_slot(*slot.slot, out, 16));
    }
  }
  state.SetItemsProcessed(state.iterations());
}

// Batched lookups + copies over a table of 1M keys, as a sparse pull runs on the server.
void BM_StorePullBatch(benchmark::State& state) {
  static auto s = big_store(1 << 20, 16);
  const auto n = static_cast<std::size_t>(state.range(0));
  std::mt19937_64 rng(1);
  std::vector<Key> keys(n);
  std::vector<SlotRef> slots(n);
  std::vector<float> out(n * 16);
  for (auto _ : state) {
    state.PauseTiming();
    for (auto& k : keys) k = rng() % (1 << 20);
    state.ResumeTiming();
    s->find_batch(
        n, [&](std::size_t i) { return keys[i]; }, slots.data());
    for (std::size_t i = 0; i < n; ++i) read_slot(*slots[i].slot, out.data() + i * 16, 16);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
}

void BM_StorePushBatch(benchmark::State& state) {
  static auto s = big_store(1 << 20, 16);
  const auto n = static_cast<std::size_t>(state.range(0));
  std::mt19937_64 rng(2);
  std::vector<Key> keys(n);
  std::vector<SlotRef> slots(n);
  std::vector<float> grad(16, 1.0f);
  for (auto _ : state) {
    state.PauseTiming();
    for (auto& k : keys) k = rng() % (1 << 20);
    state.ResumeTiming();
    s->find_batch(
        n, [&](std::size_t i) { return keys[i]; }, slots.data());
    for (std::size_t i = 0; i < n; ++i) s->apply_slot(slots[i], grad.data(), s->rule(), 1.0f);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(n));
}

struct Clocks {
  std::vector<std::byte> mem;
  std::unique_ptr<ClockTable> table;
  explicit Clocks(std::uint32_t workers) : mem(ClockTable::bytes_for(workers) + 64) {
    void* p = reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(mem.data()) + 63) & ~std::uintptr_t{63});
    table = std::make_unique<ClockTable>(p, workers, true);
  }
};

void BM_ClockAdvance(benchmark::State& state) {
  Clocks c(16);
  std::uint64_t clock = 0;
  for (auto _ : state) benchmark::DoNotOptimize(c.table->advance_to(3, ++clock));
  state.SetItemsProcessed(state.iterations());
}

void BM_ClockBound(benchmark::State& state) {
  Clocks c(static_cast<std::uint32_t>(state.range(0)));
  for (std::uint32_t w = 0; w < c.table->workers(); ++w) c.table->advance_to(w, w * 3 + 1);
  for (auto _ : state) benchmark::DoNotOptimize(c.table->min_clock());
  state.SetItemsProcessed(state.iterations());
}

BENCHMARK(BM_ParseRequest)->Arg(1)->Arg(1000);
BENCHMARK(BM_SeqlockRead)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_StorePullBatch)->Arg(1000);
BENCHMARK(BM_StorePushBatch)->Arg(1000);
BENCHMARK(BM_ClockAdvance);
BENCHMARK(BM_ClockBound)->Arg(4)->Arg(64);

}  // namespace
}  // namespace pskv

BENCHMARK_MAIN();
