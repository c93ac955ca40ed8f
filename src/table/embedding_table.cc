#include "table/embedding_table.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <random>
#include <system_error>
#include <utility>

#include "common/memory.h"
#include "layout/hash.h"
#include "store/update_kernels.h"

namespace pskv {

// One mapping per segment, on huge pages where the kernel gives them: a pull of random rows
// misses the TLB on every row otherwise (2^20 rows span 20,000 4 KiB pages).
struct EmbeddingTable::Segment {
  std::unique_ptr<MemoryResource> memory;
  RowMeta* meta = nullptr;
  float* data = nullptr;
  float* state = nullptr;
  std::atomic<std::uint32_t>* stamps = nullptr;
  // One bit per row: changed since the last checkpoint took it (take_changes).
  std::atomic<std::uint64_t>* marks = nullptr;
};

namespace {

constexpr std::uint32_t kFilterBits = 23;  // 2 x 8 Mi one-byte counters: 16 MiB per table
constexpr std::uint32_t kMinBuckets = 8;
constexpr int kVictimSamples = 5;
constexpr int kVictimRounds = 16;

// Two uniform floats in [0, 1), 24 bits each, for pair `k` of a row whose stream is `base`
// (the seed and the id mixed once per row): a counter-based generator, so any server computes
// any row's initial value alone, at one mix per two floats.
std::pair<float, float> unit_pair(std::uint64_t base, std::uint64_t k) noexcept {
  const std::uint64_t u = mix64(base ^ ((k + 1) * 0x9e3779b97f4a7c15ull));
  constexpr float kScale = 1.0f / 16777216.0f;
  return {static_cast<float>(u >> 40) * kScale, static_cast<float>((u >> 16) & 0xFFFFFF) * kScale};
}

// A shard's buckets when the table is made: for the shard's share of the rows expected, four
// standard deviations above its mean, so that a table with a cap does not rehash on its way
// there; up to 2^14 (512 MiB of buckets for the table, what 10^8 rows need). Past that the shards
// grow as a table without a cap does. One row per bucket where that costs at most two buckets
// (8 bytes) per row expected, as row_bytes_bound allows: fewer ids then find another row first,
// and pulls from 100M rows ran 1.11-1.73x faster than at two rows per bucket (docs/bench/tables.md).
// Otherwise (small shares, where the deviations weigh more) two rows per bucket.
constexpr std::uint32_t kMaxInitialBuckets = 1u << 14;

std::uint32_t initial_buckets(std::uint64_t rows_expected, std::uint32_t shard_bits) noexcept {
  const double mean = std::ldexp(double(rows_expected), -int(shard_bits));
  // 6 standard deviations: over 8192 shards a 4-sigma margin still let about one table in 300
  // sized for 2^18 rows grow a shard while it filled (a Poisson tail, not a normal one).
  const auto rows = static_cast<std::uint64_t>(std::min(mean + 6 * std::sqrt(mean) + 8, 1e12));
  std::uint64_t buckets = std::bit_ceil(rows + 1);
  if (double(buckets) > 2 * mean) buckets = std::bit_ceil(rows / 2 + 1);
  return static_cast<std::uint32_t>(std::clamp<std::uint64_t>(buckets, kMinBuckets, kMaxInitialBuckets));
}

}  // namespace

EmbeddingTable::EmbeddingTable(const TableSpec& spec, std::uint64_t index_rows, std::unique_ptr<TableStorage> storage)
    : spec_(spec),
      storage_(std::move(storage)),
      index_key_((std::uint64_t{std::random_device{}()} << 32) | std::random_device{}()) {
  if (std::string why = check_table_spec(spec); !why.empty()) throw Error(Errc::invalid_argument, why);
  state_floats_ = state_floats_for(spec);
  stamps_ = spec.eviction != RowEviction::none;
  if (storage_) {
    undo_stride_ = undo_stride(spec.dim, state_floats_);
    undo_ = storage_->undo(undo_stride_ << kShardBits);
    for (std::size_t s = 0; s < (std::size_t{1} << kShardBits); ++s)
      new (&reinterpret_cast<UndoHead*>(undo_->data() + s * undo_stride_)->row) std::atomic<std::uint32_t>(0);
  }
  shards_ = std::make_unique<Shard[]>(std::size_t{1} << kShardBits);
  const std::uint32_t buckets =
      initial_buckets(spec.max_rows ? std::min(index_rows, spec.max_rows) : index_rows, kShardBits);
  initial_heads_ = std::make_unique<HeapMemory>(
      (std::size_t{buckets} * sizeof(std::atomic<std::uint32_t>)) << kShardBits, "an embedding table's index");
  auto* heads = reinterpret_cast<std::atomic<std::uint32_t>*>(initial_heads_->data());
  for (std::size_t i = 0; i < (std::size_t{buckets} << kShardBits); ++i) new (&heads[i]) std::atomic<std::uint32_t>(0);
  for (std::size_t s = 0; s < (std::size_t{1} << kShardBits); ++s) {
    auto b = std::make_unique<Buckets>();
    b->mask = buckets - 1;
    b->heads = heads + s * buckets;
    shards_[s].buckets.store(b.get(), std::memory_order_relaxed);
    shards_[s].all.push_back(std::move(b));
  }
  index_bytes_ = (std::uint64_t{sizeof(Shard)} + sizeof(Buckets) + std::uint64_t{buckets} * 4) << kShardBits;
  segments_ = std::make_unique<std::atomic<Segment*>[]>(kMaxSegments);
  if (!storage_) segment_arena_ = SliceArena::make(segment_layout().bytes(), "an embedding table's rows");
  prepare_limit_rows_ = spec.max_rows ? spec.max_rows : index_rows;
  const std::size_t segment = segment_layout().bytes();
  prepare_lead_ = segment > kPrepareBytes ? 0 : prepare_limit_rows_ ? kPrepareBytes / segment : 1;
  if (spec.admit_after > 1) filter_ = std::make_unique<std::atomic<std::uint8_t>[]>(std::size_t{2} << kFilterBits);
  if (storage_) {
    TableStorage::Left left = storage_->take_left();
    if (!left.segments.empty()) {
      try {
        take_left(std::move(left));
      } catch (...) {
        for (std::uint32_t s = 0; s < kMaxSegments; ++s) delete segments_[s].load(std::memory_order_relaxed);
        throw;
      }
    }
  }
}

std::uint64_t EmbeddingTable::state_floats_for(const TableSpec& spec) noexcept {
  return std::uint64_t{state_floats_per_value(spec.rule.rule)} * spec.dim +
         (spec.rule.rule == UpdateRule::adam ? 1 : 0);  // the row's own update count
}

std::uint64_t EmbeddingTable::row_bytes_bound(const TableSpec& spec) noexcept {
  // Key, link and seqlock word; floats; state; stamp; and at most 8 bytes of buckets (the
  // current array at two rows per bucket, and the arrays it outgrew; or, sized for the cap when
  // the table is made, at most two buckets per row of the cap: initial_buckets).
  return sizeof(RowMeta) + 4ull * spec.dim + 4 * state_floats_for(spec) + (spec.eviction != RowEviction::none ? 4 : 0) +
         8;
}

std::uint64_t EmbeddingTable::fixed_bytes(const TableSpec& spec) noexcept {
  const std::uint64_t index = (std::uint64_t{sizeof(Shard)} + sizeof(Buckets) + kMinBuckets * 4) << kShardBits;
  const std::uint64_t segment_table = std::uint64_t{sizeof(std::atomic<Segment*>)} * kMaxSegments;
  const std::uint64_t bytes = index + segment_table + (spec.admit_after > 1 ? (std::uint64_t{2} << kFilterBits) : 0);
  return (bytes + (1u << 20) - 1) >> 20 << 20;  // whole MiB: the allocator's slack on the many small arrays
}

std::uint32_t EmbeddingTable::begin_write(std::atomic<std::uint32_t>& version) noexcept {
  // A row's word lives in the table's files when it has a TableStorage, where another process of
  // the user could leave it odd: the write starts from the next even value, so the word is odd
  // while the write runs and even after it, whatever it held.
  const std::uint32_t v = (version.load(std::memory_order_relaxed) + 1) & ~1u;
  version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  return v;
}

bool EmbeddingTable::settle_odd(RowMeta& m, Key id, std::uint32_t* looks) const noexcept {
  if (++*looks < kOddLooks) {
    cpu_relax();
    return false;
  }
  *looks = 0;
  // Writers hold the id's shard lock while the word is odd: odd under that lock, no writer is
  // inside, and the word was left so in the files. It is made even again, with a value no reader
  // has seen.
  Shard& shard = shard_of(index_hash(id));
  std::lock_guard lock(shard.lock);
  const std::uint32_t v = m.version.load(std::memory_order_relaxed);
  if (!(v & 1) || m.key.load(std::memory_order_relaxed) != id) return false;
  m.version.store(v + 1, std::memory_order_release);
  return true;
}

void EmbeddingTable::end_write(std::atomic<std::uint32_t>& version, std::uint32_t begun) noexcept {
  version.store(begun + 2, std::memory_order_release);
}

EmbeddingTable::~EmbeddingTable() {
  {
    std::lock_guard lock(prepare_mu_);
    prepare_stop_.store(true, std::memory_order_relaxed);
  }
  prepare_cv_.notify_one();
  if (preparer_.joinable()) preparer_.join();
  for (std::uint32_t s = 0; s < kMaxSegments; ++s) delete segments_[s].load(std::memory_order_relaxed);
}

EmbeddingTable::RowMeta& EmbeddingTable::meta(std::uint32_t row) const noexcept {
  return segments_[row >> kSegmentBits].load(std::memory_order_acquire)->meta[row & (kSegmentRows - 1)];
}
float* EmbeddingTable::data(std::uint32_t row) const noexcept {
  return segments_[row >> kSegmentBits].load(std::memory_order_acquire)->data +
         std::size_t{row & (kSegmentRows - 1)} * spec_.dim;
}
float* EmbeddingTable::state(std::uint32_t row) const noexcept {
  return segments_[row >> kSegmentBits].load(std::memory_order_acquire)->state +
         std::size_t{row & (kSegmentRows - 1)} * state_floats_;
}
std::atomic<std::uint32_t>* EmbeddingTable::stamp(std::uint32_t row) const noexcept {
  return &segments_[row >> kSegmentBits].load(std::memory_order_acquire)->stamps[row & (kSegmentRows - 1)];
}

void EmbeddingTable::initial_row(Key id, float* out) const noexcept {
  const std::uint32_t dim = spec_.dim;
  const float scale = spec_.init_scale;
  const std::uint64_t base = spec_.seed ^ mix64(id ^ 0x5851f42d4c957f2dull);
  switch (spec_.init) {
    case RowInit::zeros:
      std::fill(out, out + dim, 0.0f);
      return;
    case RowInit::uniform:
      for (std::uint32_t i = 0; i < dim; i += 2) {
        const auto [a, b] = unit_pair(base, i / 2);
        out[i] = (2.0f * a - 1.0f) * scale;
        if (i + 1 < dim) out[i + 1] = (2.0f * b - 1.0f) * scale;
      }
      return;
    case RowInit::normal:
      // Box-Muller: floats 2k and 2k+1 from the same pair of uniforms.
      for (std::uint32_t i = 0; i < dim; i += 2) {
        const auto [a, b] = unit_pair(base, i / 2);
        const float r = std::sqrt(-2.0f * std::log(1.0f - a)) * scale;  // 1 - a in (0, 1]: log() stays finite
        out[i] = r * std::cos(6.2831853f * b);
        if (i + 1 < dim) out[i + 1] = r * std::sin(6.2831853f * b);
      }
      return;
  }
}

bool EmbeddingTable::read_row(Key id, std::uint64_t hash, float* out) const noexcept {
  Shard& shard = shard_of(hash);
  std::uint32_t odd_looks = 0;
  for (;;) {
    const std::uint32_t sv = shard.version.load(std::memory_order_acquire);
    if (sv & 1) {
      cpu_relax();
      continue;
    }
    const Buckets* b = shard.buckets.load(std::memory_order_acquire);
    std::uint32_t row = b->heads[hash & b->mask].load(std::memory_order_acquire);
    // A chain relinked under us can loop; the shard's version tells, and the bound stops the walk.
    std::uint32_t steps = 0;
    while (row != 0 && row != kFreeRow && ++steps < (1u << 20)) {
      const RowMeta& m = meta(row);
      if (m.key.load(std::memory_order_relaxed) == id) break;
      row = m.next.load(std::memory_order_acquire);
    }
    bool found = false;
    if (row != 0 && row != kFreeRow && steps < (1u << 20)) {
      RowMeta& m = meta(row);
      const std::uint32_t rv = m.version.load(std::memory_order_acquire);
      if (rv & 1) {
        settle_odd(m, id, &odd_looks);
        continue;
      }
      seqlock_copy(out, data(row), std::size_t{spec_.dim} * sizeof(float));
      std::atomic_thread_fence(std::memory_order_acquire);
      if (m.version.load(std::memory_order_relaxed) != rv || m.key.load(std::memory_order_relaxed) != id) continue;
      found = true;
      if (stamps_) touch(row, 0);
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    if (shard.version.load(std::memory_order_relaxed) == sv) return found;
  }
}

void EmbeddingTable::touch(std::uint32_t row, std::uint64_t step) const noexcept {
  std::atomic<std::uint32_t>* s = stamp(row);
  switch (spec_.eviction) {
    case RowEviction::lru:
      s->store(static_cast<std::uint32_t>(tick_.load(std::memory_order_relaxed)), std::memory_order_relaxed);
      break;
    case RowEviction::lfu:
      // Lost increments under contention are fine: the count only ranks victims.
      if (const std::uint32_t c = s->load(std::memory_order_relaxed); c != UINT32_MAX)
        s->store(c + 1, std::memory_order_relaxed);
      break;
    case RowEviction::step:
      if (step > 0) s->store(static_cast<std::uint32_t>(std::min<std::uint64_t>(step, UINT32_MAX)));
      break;
    case RowEviction::none:
      break;
  }
}

// An id costs four dependent misses: its index shard (which names the bucket array), its bucket,
// its row's key and link, its floats; and two more for each row of its chain before its own (a
// bucket holds up to one row on average in a table sized for 100M rows, up to two in a small or
// grown one: about 30% to half the ids or more have one). advance(i), called
// before id i is handled, keeps them in flight for ids further on: shards 32 ahead, buckets 24,
// the first row of the chain 16 and the second 8, each stage finding the one before it in cache
// (a stale guess only costs a useless prefetch; the lookup itself checks everything). Without the
// second row's stage, pulls from a table at 1 row per bucket ran at half the rate of one at 1/16
// (docs/bench/tables.md).
//
// Each stage keeps what it found for the next (an id's hash, its bucket, the chain's first row)
// in a ring of the ids in flight, so that an id is hashed once and its shard's bucket array read
// once. Computed again at every stage, they cost more than the misses the stages hide.
class EmbeddingTable::Lookahead {
 public:
  Lookahead(const EmbeddingTable& table, std::span<const Key> ids) noexcept : t_(table), ids_(ids) {
    for (std::size_t j = 0; j < std::min(ids.size(), kShardsAhead); ++j) shard_stage(j);
    for (std::size_t j = 0; j < std::min(ids.size(), kBucketsAhead); ++j) bucket_stage(j);
    for (std::size_t j = 0; j < std::min(ids.size(), kRowsAhead); ++j) first_stage(j);
  }
  // Before ids[i] is handled, in order of i from 0: its hash (index_hash).
  std::uint64_t advance(std::size_t i) noexcept {
    const std::size_t n = ids_.size();
    if (i + kShardsAhead < n) shard_stage(i + kShardsAhead);
    if (i + kBucketsAhead < n) bucket_stage(i + kBucketsAhead);
    if (i + kRowsAhead < n) first_stage(i + kRowsAhead);
    if (i + kSecondsAhead < n) second_stage(i + kSecondsAhead);
    return hash_[i % kRing];
  }

 private:
  static constexpr std::size_t kShardsAhead = 32, kBucketsAhead = 24, kRowsAhead = 16, kSecondsAhead = 8;
  static constexpr std::size_t kRing = 64;  // > kShardsAhead: a slot is written again only once its id is done
  static bool live(std::uint32_t row) noexcept { return row != 0 && row != kFreeRow; }
  void prefetch_row(std::uint32_t row) const noexcept {
    __builtin_prefetch(&t_.meta(row));
    __builtin_prefetch(t_.data(row));
  }
  void shard_stage(std::size_t j) noexcept {
    const std::uint64_t h = t_.index_hash(ids_[j]);
    hash_[j % kRing] = h;
    __builtin_prefetch(&t_.shard_of(h));
  }
  void bucket_stage(std::size_t j) noexcept {
    const std::uint64_t h = hash_[j % kRing];
    const Buckets* b = t_.shard_of(h).buckets.load(std::memory_order_acquire);
    const std::atomic<std::uint32_t>* bucket = &b->heads[h & b->mask];
    bucket_[j % kRing] = bucket;
    __builtin_prefetch(bucket);
  }
  void first_stage(std::size_t j) noexcept {
    const std::uint32_t row = bucket_[j % kRing]->load(std::memory_order_acquire);
    first_[j % kRing] = row;
    if (live(row)) prefetch_row(row);
  }
  void second_stage(std::size_t j) const noexcept {
    const std::uint32_t row = first_[j % kRing];
    if (!live(row)) return;
    const RowMeta& m = t_.meta(row);
    if (m.key.load(std::memory_order_relaxed) == ids_[j]) return;
    if (const std::uint32_t next = m.next.load(std::memory_order_acquire); live(next)) prefetch_row(next);
  }

  const EmbeddingTable& t_;
  std::span<const Key> ids_;
  std::array<std::uint64_t, kRing> hash_;
  std::array<const std::atomic<std::uint32_t>*, kRing> bucket_;
  std::array<std::uint32_t, kRing> first_;
};

void EmbeddingTable::pull(std::span<const Key> ids, float* out) const noexcept {
  tick_.fetch_add(1, std::memory_order_relaxed);
  const std::uint32_t dim = spec_.dim;
  Lookahead ahead(*this, ids);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::uint64_t hash = ahead.advance(i);
    float* row = out + i * dim;
    if (!read_row(ids[i], hash, row)) initial_row(ids[i], row);
  }
}

bool EmbeddingTable::contains(Key id) const noexcept {
  std::vector<float> scratch(spec_.dim);
  return read_row(id, index_hash(id), scratch.data());
}

std::uint32_t EmbeddingTable::find_locked(Shard& shard, Key id, std::uint64_t hash,
                                          std::atomic<std::uint32_t>** link) const noexcept {
  Buckets* b = shard.buckets.load(std::memory_order_relaxed);
  std::atomic<std::uint32_t>* at = &b->heads[hash & b->mask];
  for (std::uint32_t row = at->load(std::memory_order_relaxed); row != 0;) {
    RowMeta& m = meta(row);
    if (m.key.load(std::memory_order_relaxed) == id) {
      if (link) *link = at;
      return row;
    }
    at = &m.next;
    row = at->load(std::memory_order_relaxed);
  }
  return 0;
}

bool EmbeddingTable::admitted(Key id) noexcept {
  if (!filter_) return true;
  // Count-min over two rows: the estimate is the smaller counter, which over-counts only when
  // both of an id's counters are shared with others.
  const std::uint64_t h = mix64(id ^ 0xa0761d6478bd642full);
  const std::uint64_t mask = (std::uint64_t{1} << kFilterBits) - 1;
  std::atomic<std::uint8_t>* c[2] = {&filter_[h & mask],
                                     &filter_[(std::uint64_t{1} << kFilterBits) + ((h >> 32) & mask)]};
  std::uint32_t estimate = UINT32_MAX;
  for (auto* counter : c) {
    std::uint8_t v = counter->load(std::memory_order_relaxed);
    while (v != UINT8_MAX && !counter->compare_exchange_weak(v, static_cast<std::uint8_t>(v + 1))) {
    }
    estimate = std::min<std::uint32_t>(estimate, v == UINT8_MAX ? UINT8_MAX : v + 1u);
  }
  return estimate >= std::min<std::uint32_t>(spec_.admit_after, UINT8_MAX);
}

bool EmbeddingTable::take_live(Grant& g) noexcept {
  if (g.live == 0) {
    std::uint64_t live = rows_.load(std::memory_order_relaxed);
    std::uint64_t take;
    do {
      take = g.live_block;
      if (spec_.max_rows != 0) {
        if (live >= spec_.max_rows) return false;
        // Near the cap room is taken a row at a time: room one push holds must not make
        // another evict (or drop a row) meanwhile.
        const std::uint64_t room = spec_.max_rows - live;
        take = room > 4 * kGrantRows ? take : 1;
      }
    } while (!rows_.compare_exchange_weak(live, live + take, std::memory_order_relaxed));
    g.live = take;
    g.live_block = std::min(g.live_block * 2, kGrantRows);
  }
  --g.live;
  return true;
}

std::uint32_t EmbeddingTable::take_row(Grant& g) noexcept {
  if (g.count == 0) {
    if (free_count_.load(std::memory_order_relaxed) > 0) {
      std::lock_guard lock(free_mu_);
      while (g.count < g.row_block && !free_rows_.empty()) {
        g.rows[g.count++] = free_rows_.back();
        free_rows_.pop_back();
      }
      free_count_.store(free_rows_.size(), std::memory_order_relaxed);
    }
    if (g.count == 0) {
      const std::uint64_t first = next_row_.fetch_add(g.row_block, std::memory_order_relaxed);
      if (first >= kFreeRow) return 0;  // 2^32 - 2 rows made: no row number left
      prepare_after(first + g.row_block);
      // Kept in reverse, so that the push takes them (from the back) in increasing order.
      for (std::uint64_t r = std::min<std::uint64_t>(first + g.row_block, kFreeRow); r > first;)
        g.rows[g.count++] = static_cast<std::uint32_t>(--r);
    }
    g.row_block = std::min(g.row_block * 2, kGrantRows);
  }
  const std::uint32_t row = g.rows[g.count - 1];
  if (!ensure_segment(row)) return 0;  // kept in the grant: give_back frees it for a later try
  --g.count;
  return row;
}

void EmbeddingTable::give_back(Grant& g) noexcept {
  if (g.live > 0) rows_.fetch_sub(g.live, std::memory_order_relaxed);
  if (g.created > 0) created_.fetch_add(g.created, std::memory_order_relaxed);
  if (g.count > 0) {
    std::lock_guard lock(free_mu_);
    free_rows_.insert(free_rows_.end(), g.rows.begin(), g.rows.begin() + g.count);
    free_count_.store(free_rows_.size(), std::memory_order_relaxed);
  }
  g = Grant{};
}

bool EmbeddingTable::ensure_segment(std::uint32_t row) noexcept {
  const std::uint32_t s = row >> kSegmentBits;
  if (segments_[s].load(std::memory_order_acquire) != nullptr) return true;
  std::lock_guard lock(grow_mu_);
  if (segments_[s].load(std::memory_order_relaxed) != nullptr) return true;
  auto seg = make_segment(/*touch=*/false);
  return seg && install_segment(s, std::move(seg));
}

bool EmbeddingTable::install_segment(std::uint32_t s, std::unique_ptr<Segment> seg) noexcept {
  if (storage_) {
    try {
      storage_->publish(*seg->memory, s);
    } catch (const std::exception&) {
      return false;  // a segment its storage does not keep would lose its rows to a successor
    }
  }
  segment_bytes_.fetch_add(seg->memory->size(), std::memory_order_relaxed);
  segments_[s].store(seg.release(), std::memory_order_release);
  segment_count_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

EmbeddingTable::SegmentLayout EmbeddingTable::segment_layout_for(const TableSpec& spec) noexcept {
  return {align_up(sizeof(RowMeta) * kSegmentRows, kCacheLine),
          align_up(std::size_t{spec.dim} * sizeof(float) * kSegmentRows, kCacheLine),
          align_up(state_floats_for(spec) * sizeof(float) * kSegmentRows, kCacheLine),
          spec.eviction != RowEviction::none ? align_up(4 * kSegmentRows, kCacheLine) : 0, kSegmentRows / 8};
}

std::unique_ptr<EmbeddingTable::Segment> EmbeddingTable::carve_segment(
    std::unique_ptr<MemoryResource> memory) const noexcept {
  const SegmentLayout layout = segment_layout();
  auto seg = std::unique_ptr<Segment>(new (std::nothrow) Segment);
  if (!seg) return nullptr;
  seg->memory = std::move(memory);
  std::byte* at = seg->memory->data();
  auto carve = [&at](std::size_t bytes) { return std::exchange(at, at + bytes); };
  seg->meta = reinterpret_cast<RowMeta*>(carve(layout.meta));
  seg->data = reinterpret_cast<float*>(carve(layout.data));
  seg->state = layout.state ? reinterpret_cast<float*>(carve(layout.state)) : nullptr;
  seg->stamps = layout.stamps ? reinterpret_cast<std::atomic<std::uint32_t>*>(carve(layout.stamps)) : nullptr;
  seg->marks = reinterpret_cast<std::atomic<std::uint64_t>*>(carve(layout.marks));
  return seg;
}

void EmbeddingTable::take_left(TableStorage::Left left) {
  std::vector<std::span<std::byte>> spans;
  for (const auto& [index, memory] : left.segments) {
    if (index >= kMaxSegments) throw Error(Errc::invalid_argument, "a left segment past the last a table has");
    // roll_back_left takes an empty span for a segment that is not there; a file that is there
    // but empty (truncated) would then be carved from no memory at all.
    if (memory->size() != segment_layout().bytes())
      throw Error(Errc::invalid_argument, "left segment " + std::to_string(index) + " has " +
                                              std::to_string(memory->size()) + " bytes; this spec lays out " +
                                              std::to_string(segment_layout().bytes()));
    if (spans.size() <= index) spans.resize(std::size_t{index} + 1);
    spans[index] = {memory->data(), memory->size()};
  }
  if (!left.undo) throw Error(Errc::invalid_argument, "left segments without their undo records");
  adopted_.rolled_back = roll_back_left(spec_, spans, {left.undo->data(), left.undo->size()});
  std::uint64_t end = 1;  // past the last row of the last segment
  std::vector<std::pair<std::uint32_t, std::unique_ptr<Segment>>> carved;
  for (auto& [index, memory] : left.segments) {
    carved.emplace_back(index, carve_segment(std::move(memory)));
    if (!carved.back().second) throw Error(Errc::capacity, "no memory for a segment's bookkeeping");
  }
  // From here nothing throws but the free list's growth, after which the constructor deletes
  // what is installed.
  for (auto& [index, seg] : carved) {
    // Its checkpoint marks and eviction stamps were the dead table's: a checkpoint of this one
    // starts with a snapshot, and its LRU clock starts again at 0.
    std::memset(static_cast<void*>(seg->marks), 0, segment_layout().marks);
    if (seg->stamps) std::memset(static_cast<void*>(seg->stamps), 0, segment_layout().stamps);
    segment_bytes_ += seg->memory->size();
    ++segment_count_;
    segments_[index].store(seg.release(), std::memory_order_relaxed);
    end = std::max(end, std::uint64_t{index + 1} << kSegmentBits);
  }
  // Not yet shared with any thread: the index is built without its locks. Live rows are those
  // whose link is not the free mark (recover_rows); the others are free to hand out again.
  for (std::uint64_t r = 1; r < std::min<std::uint64_t>(end, kFreeRow); ++r) {
    if (segments_[r >> kSegmentBits].load(std::memory_order_relaxed) == nullptr) {
      r |= kSegmentRows - 1;
      continue;
    }
    const auto row = static_cast<std::uint32_t>(r);
    RowMeta& m = meta(row);
    if (m.next.load(std::memory_order_relaxed) == kFreeRow) {
      free_rows_.push_back(row);
      continue;
    }
    if (const std::uint32_t v = m.version.load(std::memory_order_relaxed); v & 1) {
      m.version.store(v + 1, std::memory_order_relaxed);  // inside a write no record covers: as it is
      ++adopted_.torn;
    }
    const Key id = m.key.load(std::memory_order_relaxed);
    const std::uint64_t hash = index_hash(id);
    Shard& shard = shard_of(hash);
    if (find_locked(shard, id, hash, nullptr) != 0) {  // twice: cannot be, unless the files were changed
      m.next.store(kFreeRow, std::memory_order_relaxed);
      free_rows_.push_back(row);
      continue;
    }
    if (shard.rows + 1 > 2 * (shard.buckets.load(std::memory_order_relaxed)->mask + 1)) grow(shard);
    Buckets* b = shard.buckets.load(std::memory_order_relaxed);
    auto& head = b->heads[hash & b->mask];
    m.next.store(head.load(std::memory_order_relaxed), std::memory_order_relaxed);
    head.store(row, std::memory_order_relaxed);
    ++shard.rows;
    ++adopted_.rows;
  }
  // Handed out first, the lowest rows first (take_row takes from the back).
  std::reverse(free_rows_.begin(), free_rows_.end());
  free_count_ = free_rows_.size();
  next_row_ = std::min<std::uint64_t>(end, kFreeRow);
  // Segments below the adopted ones' end are made (or are holes, which rows never reach again):
  // the preparer starts past them.
  prepare_from_ = static_cast<std::uint32_t>(std::min<std::uint64_t>(end >> kSegmentBits, kMaxSegments));
  rows_ = adopted_.rows;
  created_ = adopted_.rows;
  grows_ = 0;
}

std::unique_ptr<EmbeddingTable::Segment> EmbeddingTable::make_segment(bool touch) const noexcept {
  // Zero pages as mapped: every atomic starts at 0, and only `next` needs another value.
  const SegmentLayout layout = segment_layout();
  std::unique_ptr<Segment> seg;
  try {
    seg = carve_segment(storage_ ? storage_->segment(layout.bytes()) : segment_arena_->take());
  } catch (const std::exception&) {
    return nullptr;
  }
  if (!seg) return nullptr;
  for (std::uint32_t i = 0; i < kSegmentRows; ++i) {
    new (&seg->meta[i].key) std::atomic<std::uint64_t>(0);
    new (&seg->meta[i].next) std::atomic<std::uint32_t>(kFreeRow);
    new (&seg->meta[i].version) std::atomic<std::uint32_t>(0);
  }
  if (touch && !storage_) {  // a storage's memory comes backed
    // Not yet shared with anyone: a zero written over a zero page only makes the kernel back it.
    // A table being destroyed stops this within 2 MiB (its destructor may run under a replica's
    // locks, and fresh memory here backs at ~0.5 GB/s).
    constexpr std::size_t kPage = 4096, kPagesBetweenLooks = 512;
    std::byte* end = seg->memory->data() + seg->memory->size();
    std::size_t pages = 0;
    for (std::byte* p = reinterpret_cast<std::byte*>(seg->data); p < end; p += kPage) {
      if (++pages % kPagesBetweenLooks == 0 && prepare_stop_.load(std::memory_order_relaxed)) return nullptr;
      *reinterpret_cast<volatile std::byte*>(p) = std::byte{0};
    }
  }
  return seg;
}

void EmbeddingTable::prepare_after(std::uint64_t handed_out) noexcept {
  // Nothing ahead before half of the first segment is used (most tables stay small), nor for
  // segments larger than the whole lead (rows that wide amortise their own page faults). Then a
  // table with a bound (its cap, or for a replica's copy its origin's) keeps about kPrepareBytes
  // made ahead within it: memory it is charged for. A table without one, whose growth may stop
  // anywhere, keeps one segment ahead, from the middle of the current one.
  if (prepare_lead_ == 0 || handed_out < kSegmentRows / 2) return;
  std::uint64_t next = ((handed_out + kSegmentRows / 2) >> kSegmentBits) - 1 + prepare_lead_;
  if (prepare_limit_rows_) next = std::min(next, prepare_limit_rows_ >> kSegmentBits);
  if (next >= kMaxSegments || next == 0) return;
  // Both checks without a lock: every block of rows handed out comes here.
  if (segments_[next].load(std::memory_order_acquire) != nullptr ||
      next <= prepare_up_to_.load(std::memory_order_relaxed))
    return;
  std::lock_guard lock(prepare_mu_);
  if (prepare_stop_.load(std::memory_order_relaxed) || next <= prepare_up_to_.load(std::memory_order_relaxed)) return;
  prepare_up_to_.store(static_cast<std::uint32_t>(next), std::memory_order_relaxed);
  if (!preparer_.joinable()) {
    try {
      preparer_ = std::thread([this] { prepare_segments(); });
    } catch (const std::system_error&) {
      return;  // no thread: the pushes make their segments themselves, as before
    }
  }
  prepare_cv_.notify_one();
}

void EmbeddingTable::prepare_segments() noexcept {
  // Segments below `done` are made (segment 0 by the first push, before any is wanted ahead), or
  // were passed over: one the pushes already made costs a look.
  std::uint32_t done = prepare_from_;
  std::unique_lock lock(prepare_mu_);
  for (;;) {
    prepare_cv_.wait(lock, [&] {
      return prepare_stop_.load(std::memory_order_relaxed) || prepare_up_to_.load(std::memory_order_relaxed) >= done;
    });
    if (prepare_stop_.load(std::memory_order_relaxed)) return;
    const std::uint32_t s = done++;
    lock.unlock();
    if (segments_[s].load(std::memory_order_acquire) == nullptr) {
      // Made and touched outside grow_mu_: a push that needs this segment first makes its own,
      // and this one is dropped.
      auto seg = make_segment(/*touch=*/true);
      std::lock_guard grow(grow_mu_);
      if (seg && segments_[s].load(std::memory_order_relaxed) == nullptr) (void)install_segment(s, std::move(seg));
    }
    lock.lock();
  }
}

std::uint32_t EmbeddingTable::victim_score(std::uint32_t row) const noexcept {
  const std::uint32_t stamp_now = stamp(row)->load(std::memory_order_relaxed);
  if (spec_.eviction != RowEviction::lru) return stamp_now;  // lfu: the count; step: the clock
  // LRU stamps are the 32-bit tick: ranked by age, which survives the tick wrapping around.
  const auto now = static_cast<std::uint32_t>(tick_.load(std::memory_order_relaxed));
  return UINT32_MAX - (now - stamp_now);
}

void EmbeddingTable::unlink(Shard& shard, std::atomic<std::uint32_t>* link, std::uint32_t row) noexcept {
  // A reader standing on `row` must not follow it into whatever chain it joins next: the shard's
  // version tells it to walk again.
  const std::uint32_t sv = begin_write(shard.version);
  link->store(meta(row).next.load(std::memory_order_relaxed), std::memory_order_release);
  meta(row).next.store(kFreeRow, std::memory_order_release);
  end_write(shard.version, sv);
  --shard.rows;
}

std::uint32_t EmbeddingTable::evict_one(Shard& locked) noexcept {
  const std::uint32_t made = rows_handed_out();
  if (made <= 1) return 0;
  for (int round = 0; round < kVictimRounds; ++round) {
    // The lowest score of a few random rows (the approximation Redis makes for LRU and LFU).
    std::uint32_t best = 0, best_score = UINT32_MAX;
    for (int k = 0; k < kVictimSamples; ++k) {
      const std::uint64_t r = mix64(sample_seed_.fetch_add(0x9e3779b97f4a7c15ull, std::memory_order_relaxed));
      const auto row = static_cast<std::uint32_t>(1 + r % (made - 1));
      // Its segment may still be being allocated by the push that drew the row.
      if (segments_[row >> kSegmentBits].load(std::memory_order_acquire) == nullptr) continue;
      if (meta(row).next.load(std::memory_order_acquire) == kFreeRow) continue;
      if (const std::uint32_t s = victim_score(row); best == 0 || s < best_score) {
        best = row;
        best_score = s;
      }
    }
    if (best == 0) continue;
    const Key id = meta(best).key.load(std::memory_order_relaxed);
    const std::uint64_t hash = index_hash(id);
    Shard& shard = shard_of(hash);
    // Never wait for a second shard while holding one: another push may hold it and want ours.
    if (&shard != &locked && !shard.lock.try_lock()) continue;
    std::atomic<std::uint32_t>* link = nullptr;
    const bool still = find_locked(shard, id, hash, &link) == best;
    if (still) {
      unlink(shard, link, best);
      // Listed before the shard is let go: no push can create the id again before it is listed.
      note_removal(id);
    }
    if (&shard != &locked) shard.lock.unlock();
    if (!still) continue;
    evicted_.fetch_add(1, std::memory_order_relaxed);
    return best;
  }
  return 0;
}

void EmbeddingTable::grow(Shard& shard) noexcept {
  Buckets* old = shard.buckets.load(std::memory_order_relaxed);
  const std::uint32_t n = (old->mask + 1) * 2;
  auto b = std::unique_ptr<Buckets>(new (std::nothrow) Buckets);
  if (!b) return;
  b->mask = n - 1;
  b->owned.reset(new (std::nothrow) std::atomic<std::uint32_t>[n]);
  if (!b->owned) return;  // stays at the old size: chains get longer, nothing is lost
  b->heads = b->owned.get();
  for (std::uint32_t i = 0; i < n; ++i) b->heads[i].store(0, std::memory_order_relaxed);
  const std::uint32_t sv = begin_write(shard.version);
  for (std::uint32_t i = 0; i <= old->mask; ++i) {
    for (std::uint32_t row = old->heads[i].load(std::memory_order_relaxed); row != 0;) {
      RowMeta& m = meta(row);
      const std::uint32_t next = m.next.load(std::memory_order_relaxed);
      auto& head = b->heads[index_hash(m.key.load(std::memory_order_relaxed)) & b->mask];
      m.next.store(head.load(std::memory_order_relaxed), std::memory_order_relaxed);
      head.store(row, std::memory_order_relaxed);
      row = next;
    }
  }
  shard.buckets.store(b.get(), std::memory_order_release);
  end_write(shard.version, sv);
  index_bytes_.fetch_add(sizeof(Buckets) + std::uint64_t{n} * 4, std::memory_order_relaxed);
  shard.all.push_back(std::move(b));
  grows_.fetch_add(1, std::memory_order_relaxed);
}

std::uint32_t EmbeddingTable::create_row(Shard& shard, Key id, std::uint64_t hash, Grant& grant) noexcept {
  // A live row is counted before it is made, so concurrent creators never pass the cap together.
  std::uint32_t row = 0;
  if (take_live(grant)) {
    row = take_row(grant);
    if (row == 0) ++grant.live;  // no row to be had: the room goes back with the grant
  }
  if (row == 0 && spec_.eviction != RowEviction::none) row = evict_one(shard);  // reused at once: the count stays
  if (row == 0) return 0;
  // Two rows per bucket on average before the shard doubles: four bytes of bucket per row at
  // most, plus as much again in the arrays it outgrew (see Shard::all).
  if (shard.rows + 1 > 2 * (shard.buckets.load(std::memory_order_relaxed)->mask + 1)) grow(shard);
  RowMeta& m = meta(row);
  // The row's version only ever grows, through every reuse, so a reader that copied it for
  // the id it held before sees the change.
  save_undo(shard, row);
  const std::uint32_t rv = begin_write(m.version);
  m.key.store(id, std::memory_order_relaxed);
  initial_row(id, data(row));
  if (state_floats_ > 0) std::memset(state(row), 0, state_floats_ * sizeof(float));
  if (stamps_) stamp(row)->store(0, std::memory_order_relaxed);
  end_write(m.version, rv);
  clear_undo(shard);
  Buckets* b = shard.buckets.load(std::memory_order_relaxed);
  auto& head = b->heads[hash & b->mask];
  m.next.store(head.load(std::memory_order_relaxed), std::memory_order_relaxed);
  head.store(row, std::memory_order_release);
  ++shard.rows;
  mark(row);
  ++grant.created;
  return row;
}

void EmbeddingTable::push(std::span<const Key> ids, const float* grads, std::uint64_t step) noexcept {
  tick_.fetch_add(1, std::memory_order_relaxed);
  const std::uint32_t dim = spec_.dim;
  Grant grant;
  Lookahead ahead(*this, ids);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::uint64_t hash = ahead.advance(i);
    const Key id = ids[i];
    Shard& shard = shard_of(hash);
    std::lock_guard lock(shard.lock);
    std::uint32_t row = find_locked(shard, id, hash, nullptr);
    if (row == 0 && admitted(id)) row = create_row(shard, id, hash, grant);
    if (row == 0) {
      not_admitted_.fetch_add(1, std::memory_order_relaxed);
      continue;
    }
    RowMeta& m = meta(row);
    save_undo(shard, row);
    const std::uint32_t rv = begin_write(m.version);
    float* st = state(row);
    std::uint64_t updates = 0;
    if (spec_.rule.rule == UpdateRule::adam) {
      std::uint32_t count;
      std::memcpy(&count, st + state_floats_ - 1, sizeof count);
      updates = ++count;
      std::memcpy(st + state_floats_ - 1, &count, sizeof count);
    }
    apply_update(spec_.rule, data(row), state_floats_ > 0 ? st : nullptr, grads + i * dim, dim, updates, 1.0f);
    end_write(m.version, rv);
    clear_undo(shard);
    mark(row);
    if (stamps_) touch(row, step);
  }
  give_back(grant);
}

void EmbeddingTable::save_undo(const Shard& shard, std::uint32_t row) const noexcept {
  if (!undo_) return;
  std::byte* record = undo_->data() + static_cast<std::size_t>(&shard - shards_.get()) * undo_stride_;
  auto* head = reinterpret_cast<UndoHead*>(record);
  head->key = meta(row).key.load(std::memory_order_relaxed);
  auto* old = reinterpret_cast<float*>(record + sizeof(UndoHead));
  std::memcpy(old, data(row), std::size_t{spec_.dim} * sizeof(float));
  if (state_floats_ > 0) std::memcpy(old + spec_.dim, state(row), state_floats_ * sizeof(float));
  head->row.store(row, std::memory_order_release);
  // The record must be in memory before the row's word turns odd (a store that follows): a
  // process killed between the two leaves an odd row with nothing to put back otherwise. What a
  // kill leaves is the order of the stores as compiled (x86 keeps it): the fence stops the
  // compiler from moving the word's store, relaxed, above the record's.
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

void EmbeddingTable::clear_undo(const Shard& shard) const noexcept {
  if (!undo_) return;
  // A release store: the row's even word (end_write) is in memory before the record goes. The
  // fence keeps the stores after it (create_row links the row) below it as compiled: a row
  // linked while its record still names it would be put back to the id it held before.
  reinterpret_cast<UndoHead*>(undo_->data() + static_cast<std::size_t>(&shard - shards_.get()) * undo_stride_)
      ->row.store(0, std::memory_order_release);
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

EmbeddingTable::LeftRows EmbeddingTable::recover_rows(
    const TableSpec& spec, std::span<const std::span<std::byte>> segments, std::span<std::byte> undo,
    const std::function<void(Key id, const float* row, const float* state)>& visit) {
  LeftRows left;
  left.rolled_back = roll_back_left(spec, segments, undo);
  const SegmentLayout layout = segment_layout_for(spec);
  const std::uint64_t state_floats = state_floats_for(spec);
  for (std::size_t s = 0; s < segments.size(); ++s) {
    if (segments[s].empty()) continue;
    const auto* meta = reinterpret_cast<const RowMeta*>(segments[s].data());
    const auto* data = reinterpret_cast<const float*>(segments[s].data() + layout.meta);
    const auto* state = reinterpret_cast<const float*>(segments[s].data() + layout.meta + layout.data);
    for (std::uint32_t i = s == 0 ? 1 : 0; i < kSegmentRows; ++i) {
      if (meta[i].next.load(std::memory_order_relaxed) == kFreeRow) continue;
      if (meta[i].version.load(std::memory_order_relaxed) & 1) ++left.torn;
      visit(meta[i].key.load(std::memory_order_relaxed), data + std::size_t{i} * spec.dim,
            state_floats > 0 ? state + std::size_t{i} * state_floats : nullptr);
      ++left.rows;
    }
  }
  return left;
}

std::uint64_t EmbeddingTable::roll_back_left(const TableSpec& spec, std::span<const std::span<std::byte>> segments,
                                             std::span<std::byte> undo) {
  if (std::string why = check_table_spec(spec); !why.empty()) throw Error(Errc::invalid_argument, why);
  const SegmentLayout layout = segment_layout_for(spec);
  const std::uint64_t state_floats = state_floats_for(spec);
  const std::size_t stride = undo_stride(spec.dim, state_floats);
  if (undo.size() != stride << kShardBits)
    throw Error(Errc::invalid_argument, "its undo records take " + std::to_string(undo.size()) +
                                            " bytes; this spec's take " + std::to_string(stride << kShardBits));
  if (segments.size() > kMaxSegments)
    throw Error(Errc::invalid_argument, std::to_string(segments.size()) + " segments, past the " +
                                            std::to_string(kMaxSegments) + " a table has");
  for (std::size_t i = 0; i < segments.size(); ++i)
    if (!segments[i].empty() && segments[i].size() != layout.bytes())
      throw Error(Errc::invalid_argument, "segment " + std::to_string(i) + " has " +
                                              std::to_string(segments[i].size()) + " bytes; this spec lays out " +
                                              std::to_string(layout.bytes()));
  auto meta_of = [&](std::uint32_t row) {
    return reinterpret_cast<RowMeta*>(segments[row >> kSegmentBits].data()) + (row & (kSegmentRows - 1));
  };
  auto data_of = [&](std::uint32_t row) {
    return reinterpret_cast<float*>(segments[row >> kSegmentBits].data() + layout.meta) +
           std::size_t{row & (kSegmentRows - 1)} * spec.dim;
  };
  auto state_of = [&](std::uint32_t row) {
    return reinterpret_cast<float*>(segments[row >> kSegmentBits].data() + layout.meta + layout.data) +
           std::size_t{row & (kSegmentRows - 1)} * state_floats;
  };
  std::uint64_t rolled_back = 0;
  for (std::size_t s = 0; s < (std::size_t{1} << kShardBits); ++s) {
    std::byte* record = undo.data() + s * stride;
    const std::uint32_t row = reinterpret_cast<UndoHead*>(record)->row.load(std::memory_order_acquire);
    // A record names its row last, so one naming a row is whole; the row is put back only if its
    // write never ended (an even word: the write ended and the record was about to go).
    if (row == 0 || (row >> kSegmentBits) >= segments.size() || segments[row >> kSegmentBits].empty()) continue;
    RowMeta& m = *meta_of(row);
    const std::uint32_t v = m.version.load(std::memory_order_relaxed);
    if ((v & 1) == 0) continue;
    const auto* old = reinterpret_cast<const float*>(record + sizeof(UndoHead));
    m.key.store(reinterpret_cast<UndoHead*>(record)->key, std::memory_order_relaxed);
    std::memcpy(data_of(row), old, std::size_t{spec.dim} * sizeof(float));
    if (state_floats > 0) std::memcpy(state_of(row), old + spec.dim, state_floats * sizeof(float));
    m.version.store(v + 1, std::memory_order_relaxed);
    ++rolled_back;
  }
  return rolled_back;
}

void EmbeddingTable::mark(std::uint32_t row) noexcept {
  if (!tracking_.load(std::memory_order_relaxed)) return;
  const std::uint32_t i = row & (kSegmentRows - 1);
  segments_[row >> kSegmentBits]
      .load(std::memory_order_acquire)
      ->marks[i >> 6]
      .fetch_or(std::uint64_t{1} << (i & 63), std::memory_order_release);
}

bool EmbeddingTable::take_mark(std::uint32_t row) noexcept {
  const std::uint32_t i = row & (kSegmentRows - 1);
  const std::uint64_t bit = std::uint64_t{1} << (i & 63);
  auto& word = segments_[row >> kSegmentBits].load(std::memory_order_acquire)->marks[i >> 6];
  return (word.load(std::memory_order_relaxed) & bit) && (word.fetch_and(~bit, std::memory_order_acq_rel) & bit);
}

bool EmbeddingTable::marks_from(std::uint32_t row) const noexcept {
  const std::uint32_t i = row & (kSegmentRows - 1);
  return segments_[row >> kSegmentBits]
             .load(std::memory_order_acquire)
             ->marks[i >> 6]
             .load(std::memory_order_acquire) != 0;
}

bool EmbeddingTable::read_live(std::uint32_t row, Key* id, float* out, float* out_state) const noexcept {
  RowMeta& m = meta(row);
  std::uint32_t odd_looks = 0;
  std::chrono::steady_clock::time_point odd_since{};
  for (;;) {
    const std::uint32_t rv = m.version.load(std::memory_order_acquire);
    if (rv & 1) {
      if (m.next.load(std::memory_order_acquire) != kFreeRow) {
        settle_odd(m, m.key.load(std::memory_order_relaxed), &odd_looks);
        continue;
      }
      // Unlinked: a row being made for an id its key word does not name yet, under a shard lock
      // this reader cannot know. Its writer is done within microseconds unless preempted; past
      // 100 ms the word was left odd in the files, and the row is taken as not live.
      if (++odd_looks < kOddLooks) {
        cpu_relax();
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      if (odd_since == std::chrono::steady_clock::time_point{}) odd_since = now;
      if (now - odd_since > std::chrono::milliseconds(100)) return false;
      std::this_thread::yield();
      continue;
    }
    if (m.next.load(std::memory_order_acquire) == kFreeRow) return false;
    const Key key = m.key.load(std::memory_order_relaxed);
    seqlock_copy(out, data(row), std::size_t{spec_.dim} * sizeof(float));
    if (state_floats_ > 0) seqlock_copy(out_state, state(row), state_floats_ * sizeof(float));
    std::atomic_thread_fence(std::memory_order_acquire);
    if (m.version.load(std::memory_order_relaxed) != rv) continue;
    if (m.next.load(std::memory_order_relaxed) == kFreeRow) return false;  // evicted meanwhile
    *id = key;
    return true;
  }
}

std::uint32_t EmbeddingTable::live_row(Key id) noexcept {
  const std::uint64_t hash = index_hash(id);
  Shard& shard = shard_of(hash);
  std::lock_guard lock(shard.lock);
  return find_locked(shard, id, hash, nullptr);
}

bool EmbeddingTable::restore_row(Key id, const float* values, const float* st) noexcept {
  const std::uint64_t hash = index_hash(id);
  Shard& shard = shard_of(hash);
  std::lock_guard lock(shard.lock);
  std::uint32_t row = find_locked(shard, id, hash, nullptr);
  if (row == 0) {
    Grant grant;
    row = create_row(shard, id, hash, grant);
    give_back(grant);
  }
  if (row == 0) return false;
  RowMeta& m = meta(row);
  save_undo(shard, row);
  const std::uint32_t rv = begin_write(m.version);
  std::memcpy(data(row), values, std::size_t{spec_.dim} * sizeof(float));
  if (state_floats_ > 0) std::memcpy(state(row), st, state_floats_ * sizeof(float));
  end_write(m.version, rv);
  clear_undo(shard);
  mark(row);
  return true;
}

void EmbeddingTable::remove_row(Key id) noexcept {
  const std::uint64_t hash = index_hash(id);
  Shard& shard = shard_of(hash);
  std::uint32_t row;
  {
    std::lock_guard lock(shard.lock);
    std::atomic<std::uint32_t>* link = nullptr;
    row = find_locked(shard, id, hash, &link);
    if (row == 0) return;
    unlink(shard, link, row);
    note_removal(id);
  }
  rows_.fetch_sub(1, std::memory_order_relaxed);
  std::lock_guard lock(free_mu_);
  free_rows_.push_back(row);
  free_count_.store(free_rows_.size(), std::memory_order_relaxed);
}

void EmbeddingTable::note_removal(Key id) {
  const bool tracking = tracking_.load(std::memory_order_relaxed), listing = listing_.load(std::memory_order_relaxed);
  if (!tracking && !listing) return;
  std::lock_guard lock(removed_mu_);
  if (tracking) removed_.push_back(id);
  if (listing) removals_.push_back(id);
}

void EmbeddingTable::take_removals(std::vector<Key>* out) {
  out->clear();
  std::lock_guard lock(removed_mu_);
  out->swap(removals_);
}

bool EmbeddingTable::read_record(Key id, float* row, float* st) const noexcept {
  const std::uint64_t hash = index_hash(id);
  Shard& shard = shard_of(hash);
  for (;;) {
    std::uint32_t r;
    {
      std::lock_guard lock(shard.lock);
      r = find_locked(shard, id, hash, nullptr);
    }
    if (r == 0) return false;
    Key again;
    // Evicted and given to another id after the lookup: look again.
    if (read_live(r, &again, row, st) && again == id) return true;
  }
}

TableStats EmbeddingTable::stats() const noexcept {
  TableStats s;
  s.rows = rows_.load(std::memory_order_relaxed);
  s.created = created_.load(std::memory_order_relaxed);
  s.evicted = evicted_.load(std::memory_order_relaxed);
  s.not_admitted = not_admitted_.load(std::memory_order_relaxed);
  s.grows = grows_.load(std::memory_order_relaxed);
  s.segments = segment_count_.load(std::memory_order_relaxed);
  s.bytes = index_bytes_.load(std::memory_order_relaxed) + segment_bytes_.load(std::memory_order_relaxed) +
            segment_count_.load(std::memory_order_relaxed) * sizeof(Segment) +
            std::uint64_t{sizeof(std::atomic<Segment*>)} * kMaxSegments +
            (filter_ ? (std::uint64_t{2} << kFilterBits) : 0) + (undo_ ? undo_->size() : 0);
  return s;
}

}  // namespace pskv
