// Store microbenchmarks with their baselines in the same binary: memcpy for pulls and a plain
// vectorised "a += b" for push-add, so results read as ratios on a noisy machine.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "store/store.h"
#include "store/update_kernels.h"
#include "table/embedding_table.h"

namespace pskv {
namespace {

constexpr std::int64_t kMinBytes = 64, kMaxBytes = 16 << 20;

// One store per process, big enough for every value size and two threads' keys.
Store& shared_store(std::uint32_t stripes = 1024) {
  static std::unique_ptr<Store> stores[2];
  auto& s = stores[stripes == 1024 ? 0 : 1];
  if (!s) {
    StoreOptions o;
    o.stripes = stripes;
    o.max_keys = 1 << 21;
    o.arena_bytes = 512ull << 20;
    s = Store::create(std::make_unique<HeapMemory>(Store::required_bytes(o)), o);
  }
  return *s;
}

Key key_for(std::int64_t bytes, int thread) {
  return (static_cast<Key>(bytes) << 8) | static_cast<Key>(thread);
}

std::uint32_t floats(std::int64_t bytes) {
  return static_cast<std::uint32_t>(bytes / 4);
}

void ensure(Store& s, Key k, std::uint32_t n) {
  if (s.init_zero(k, n) != Errc::ok) std::abort();
}

void BM_Memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  std::vector<float> src(bytes / 4, 1.0f), dst(bytes / 4);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
}

// The store's add kernel on plain vectors (multi-threaded from kParallelApplyFloats on, as in
// the store), with no lock or lookup: the ceiling for push-add.
void add_into(float* a, const float* b, std::size_t n) {
  UpdateRuleConfig add;
  add.rule = UpdateRule::add;
  apply_update(add, a, nullptr, b, n, 1, 1.0f);
}

void BM_AddBaseline(benchmark::State& state) {
  const auto n = floats(state.range(0));
  std::vector<float> a(n, 0.0f), b(n, 1.0f);
  for (auto _ : state) {
    add_into(a.data(), b.data(), n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BM_Pull(benchmark::State& state) {
  Store& s = shared_store();
  const auto n = floats(state.range(0));
  const Key k = key_for(state.range(0), state.thread_index());
  ensure(s, k, n);
  std::vector<float> out(n);
  for (auto _ : state) {
    if (s.pull(k, out).status != Errc::ok) state.SkipWithError("pull failed");
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

void BM_PushAdd(benchmark::State& state) {
  Store& s = shared_store();
  const auto n = floats(state.range(0));
  const Key k = key_for(state.range(0), state.thread_index());
  ensure(s, k, n);
  std::vector<float> grad(n, 1.0f);
  for (auto _ : state) {
    if (s.push(k, grad) != Errc::ok) state.SkipWithError("push failed");
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}

// Small values spread over many keys, as an embedding table is pulled.
void BM_PullSmallRandomKeys(benchmark::State& state) {
  Store& s = shared_store();
  constexpr Key kKeys = 1 << 16;
  constexpr Key kBase = 1ull << 40;
  static bool ready = [&] {
    for (Key k = 0; k < kKeys; ++k) ensure(s, kBase + k, 16);
    return true;
  }();
  (void)ready;
  std::vector<Key> order(4096);
  std::mt19937_64 rng(42 + state.thread_index());
  for (auto& k : order) k = kBase + rng() % kKeys;
  float out[16];
  std::size_t i = 0;
  for (auto _ : state) {
    s.pull(order[i++ & 4095], out);
    benchmark::DoNotOptimize(out);
  }
  state.SetItemsProcessed(state.iterations());
}

// Two threads pushing to a small set of shared keys: how much the stripe count matters.
void BM_PushContendedStripes(benchmark::State& state) {
  const auto stripes = static_cast<std::uint32_t>(state.range(0));
  Store& s = shared_store(stripes == 1024 ? 1024 : stripes);
  constexpr Key kBase = 1ull << 50;
  constexpr Key kKeys = 64;
  for (Key k = 0; k < kKeys; ++k) ensure(s, kBase + k, 16);  // idempotent and thread-safe
  std::vector<float> grad(16, 1.0f);
  Key k = static_cast<Key>(state.thread_index());
  for (auto _ : state) {
    s.push(kBase + (k++ % kKeys), grad);
  }
  state.SetItemsProcessed(state.iterations());
}

// An embedding table of 2^20 16-float rows (built once), pulled and pushed in 1,000-row batches
// of uniformly random ids: the server's side of pskv-bench --workload rows, without the network.
// `capped`: made with a cap of its rows, as a server makes a table (its index sized once, a row
// per bucket here); otherwise grown from empty, its shards rehashed at two rows per bucket.
EmbeddingTable& shared_table(bool capped) {
  static EmbeddingTable* tables[2] = {};
  static std::mutex mu;
  std::lock_guard lock(mu);
  if (EmbeddingTable* t = tables[capped]) return *t;
  TableSpec spec;
  spec.dim = 16;
  if (capped) spec.max_rows = 1u << 20;
  auto* table = new EmbeddingTable(spec);
  std::vector<Key> ids(4096);
  std::vector<float> zeros(ids.size() * 16, 0.0f);
  for (Key base = 0; base < (1u << 20); base += ids.size()) {
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = base + i;
    table->push(ids, zeros.data(), 0);
  }
  return *(tables[capped] = table);
}

void BM_TableRows(benchmark::State& state) {
  EmbeddingTable& t = shared_table(state.range(1) == 1);
  const bool push = state.range(0) == 1;
  std::mt19937_64 rng(7 + state.thread_index());
  std::vector<Key> ids(1000);
  std::vector<float> rows(ids.size() * 16, 0.0f);
  for (auto _ : state) {
    state.PauseTiming();
    for (auto& id : ids) id = rng() % (1u << 20);
    state.ResumeTiming();
    if (push)
      t.push(ids, rows.data(), 0);
    else
      t.pull(ids, rows.data());
    benchmark::DoNotOptimize(rows.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(ids.size()));
}

// Creating rows: a fresh table per iteration, 2^18 ids in 1,000-row pushes, split over
// state.range(0) threads (as a server's I/O threads share a table).
void BM_TableInsert(benchmark::State& state) {
  constexpr Key kRows = 1u << 18;
  const auto threads = static_cast<Key>(state.range(0));
  for (auto _ : state) {
    state.PauseTiming();
    TableSpec spec;
    spec.dim = 16;
    auto t = std::make_unique<EmbeddingTable>(spec);
    state.ResumeTiming();
    std::vector<std::thread> workers;
    for (Key w = 0; w < threads; ++w)
      workers.emplace_back([&, w] {
        std::vector<Key> ids(1000);
        std::vector<float> rows(ids.size() * 16, 0.0f);
        for (Key base = w * ids.size(); base < kRows; base += threads * ids.size()) {
          const std::size_t n = std::min<Key>(ids.size(), kRows - base);
          for (std::size_t i = 0; i < n; ++i) ids[i] = (base + i) * 0x9e3779b97f4a7c15ull;
          t->push(std::span<const Key>(ids.data(), n), rows.data(), 0);
        }
      });
    for (auto& w : workers) w.join();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(kRows));
}

BENCHMARK(BM_Memcpy)->RangeMultiplier(4)->Range(kMinBytes, kMaxBytes);
BENCHMARK(BM_AddBaseline)->RangeMultiplier(4)->Range(kMinBytes, kMaxBytes);
BENCHMARK(BM_Pull)->RangeMultiplier(4)->Range(kMinBytes, kMaxBytes)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_PushAdd)->RangeMultiplier(4)->Range(kMinBytes, kMaxBytes)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_PullSmallRandomKeys)->Threads(1)->Threads(2)->UseRealTime();
BENCHMARK(BM_TableRows)
    ->ArgNames({"push", "capped"})
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->Threads(1)
    ->Threads(2)
    ->UseRealTime();
BENCHMARK(BM_TableInsert)->ArgName("threads")->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_PushContendedStripes)->Arg(1)->Arg(1024)->Threads(2)->UseRealTime();

}  // namespace
}  // namespace pskv

BENCHMARK_MAIN();
