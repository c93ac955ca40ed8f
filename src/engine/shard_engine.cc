#include "engine/shard_engine.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <sstream>
#include <type_traits>
#include <utility>

#include "table/embedding_table.h"

namespace pskv {

namespace {

// Each field in which `asked` differs from the table's spec `held`, as "name: held here, asked".
std::string spec_differences(const TableSpec& held, const TableSpec& asked) {
  std::ostringstream out;
  // Floats in their shortest form that reads back the same: two that differ never print alike.
  auto show = [](const auto& v) {
    if constexpr (std::is_same_v<std::decay_t<decltype(v)>, float>) {
      char buf[32];
      return std::string(buf, std::to_chars(buf, buf + sizeof buf, v).ptr);
    } else {
      std::ostringstream one;
      one << v;
      return one.str();
    }
  };
  auto field = [&](const char* name, const auto& here, const auto& there) {
    if (here == there) return;
    out << (out.tellp() > 0 ? "; " : "") << name << " " << show(here) << " here, " << show(there) << " asked";
  };
  field("dim", held.dim, asked.dim);
  field("init", to_string(held.init), to_string(asked.init));
  field("init_scale", held.init_scale, asked.init_scale);
  field("seed", held.seed, asked.seed);
  field("rule", to_string(held.rule.rule), to_string(asked.rule.rule));
  field("lr", held.rule.lr, asked.rule.lr);
  field("momentum", held.rule.momentum, asked.rule.momentum);
  field("beta1", held.rule.beta1, asked.rule.beta1);
  field("beta2", held.rule.beta2, asked.rule.beta2);
  field("eps", held.rule.eps, asked.rule.eps);
  field("weight_decay", held.rule.weight_decay, asked.rule.weight_decay);
  field("admit_after", held.admit_after, asked.admit_after);
  field("eviction", to_string(held.eviction), to_string(asked.eviction));
  field("max_rows", held.max_rows, asked.max_rows);
  return out.str();
}
// The replica a failover hand-back refills on this thread (refill_sealed_replica): writable here
// though sealed, while the origin's own frames stay refused.
thread_local const void* refilling = nullptr;
std::string key_error(Errc e, std::uint64_t key, std::uint32_t length, const Store& store) {
  const std::string k = "key " + std::to_string(key);
  switch (e) {
    case Errc::not_found:
      return k + " does not exist on this server: init it before pushing or pulling";
    case Errc::length_mismatch: {
      const SlotHeader* s = store.find(key);
      const std::uint32_t has = s ? store.length_of(*s) : 0;
      if (has == 0)
        return k +
               "'s slot header in shared memory was overwritten by another process; the server no longer touches it";
      return k + " has " + std::to_string(has) + " floats, the request says " + std::to_string(length);
    }
    case Errc::protocol:
      return k + "'s slot header in shared memory was overwritten by another process; the server no longer touches it";
    case Errc::timeout:
      return k +
             ": its stripe lock stayed held by another process past the server's patience (a client that hangs "
             "inside a push?); nothing of this key was applied";
    case Errc::capacity:
      return k + ": the server is full (" + std::to_string(store.key_count()) + " keys, " +
             std::to_string(store.value_bytes_used() >> 20) + " MiB used): raise --arena-mb or --max-keys";
    case Errc::unsupported:
      return k + ": the update rule needs optimizer state this store was not sized for";
    default:
      return k + ": " + std::string(errc_name(e));
  }
}
}  // namespace

ShardEngine::ShardEngine(const EngineOptions& options, std::unique_ptr<MemoryResource> store_memory, void* clock_memory,
                         TableStorageMaker table_storage, std::shared_ptr<SyncSpace> sync_space)
    : options_(options), table_storage_(std::move(table_storage)) {
  if (!store_memory) store_memory = std::make_unique<HeapMemory>(Store::required_bytes(options.store));
  store_ = Store::create(std::move(store_memory), options.store);
  if (options.num_workers > 0) {
    if (!clock_memory) {
      clock_storage_.resize(ClockTable::bytes_for(options.num_workers) + 64);
      auto p = reinterpret_cast<std::uintptr_t>(clock_storage_.data());
      clock_memory = reinterpret_cast<void*>((p + 63) & ~std::uintptr_t{63});
    }
    clocks_ = std::make_unique<ClockTable>(clock_memory, options.num_workers, true);
    barrier_gen_.assign(options.num_workers, 0);
    barrier_seen_.assign(options.num_workers, 0);
  } else if (options.mode != ConsistencyMode::asp) {
    throw Error(Errc::invalid_argument, std::string("mode ") + std::string(to_string(options.mode)) +
                                            " needs the number of workers (--workers N)");
  }
  spv_ = state_floats_per_value(options.store.rule.rule);
  epoch_ = std::max(static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                                   std::chrono::system_clock::now().time_since_epoch())
                                                   .count()),
                    std::uint64_t{options.min_incarnation} * 1000000000u);
  // A replicated server marks every key with its workers' newest pushes, and the marks travel
  // in the records, so that whichever server a retried push reaches applies it once.
  const std::uint32_t marks = options.replica_of.empty() && !options.mark_pushes ? 0 : options.num_workers;
  store_->keep_push_marks(marks);
  table_marks_per_table_ = options.replicate_tables || options.mark_pushes ? marks : 0;
  record_head_ = kRecordHeaderFloats + 2 * marks;
  for (std::uint32_t origin : options.replica_of) {
    auto r = std::make_unique<Replica>();
    r->origin = origin;
    r->store = new_replica_store();
    for (auto& words : r->words) words = std::make_unique<std::atomic<std::uint64_t>[]>(options.num_workers);
    replicas_.push_back(std::move(r));
  }
  if (options.mode == ConsistencyMode::sync) {
    sync_ = std::make_unique<SyncAccumulator>(*store_, sync_options(options_), std::move(sync_space));
    for (auto& r : replicas_) r->sync = std::make_unique<SyncAccumulator>(*r->store, sync_options(options_));
  }
  watchdog_ = std::thread([this] { watchdog(); });
}

ShardEngine::~ShardEngine() {
  shutdown();
}

void ShardEngine::shutdown() {
  std::vector<Waiter> orphans;
  {
    std::lock_guard lock(mu_);
    if (stopping_ && !watchdog_.joinable()) return;
    stopping_ = true;
    orphans.swap(waiters_);
  }
  cv_.notify_all();
  for (auto& w : orphans) w.op->resume(Errc::peer_failure, "the server is shutting down");
  if (watchdog_.joinable() && watchdog_.get_id() != std::this_thread::get_id()) watchdog_.join();
}

Errc ShardEngine::check_worker(std::uint32_t worker, std::string* why) const {
  if (!clocks_) {
    if (why)
      *why = "this server runs without worker clocks (--workers 0); clock, barrier and bounded reads need --workers N";
    return Errc::invalid_argument;
  }
  if (worker >= clocks_->workers()) {
    if (why)
      *why = "worker id " + std::to_string(worker) + " is out of range: the server was started with --workers " +
             std::to_string(clocks_->workers());
    return Errc::invalid_argument;
  }
  return Errc::ok;
}

Errc ShardEngine::init(std::span<const KeyEntry> keys, const float* values, std::string* why) {
  std::size_t failed = 0;
  const Errc e = store_->init_all(keys, values, &failed);
  if (e == Errc::ok || !why) return e;
  const KeyEntry& k = keys[failed];
  if (e != Errc::invalid_argument)
    *why = key_error(e, k.key, k.length, *store_) + "; no key of this init was created";
  else if (k.length == 0)
    *why = "key " + std::to_string(k.key) + " is given 0 floats; no key of this init was created";
  else
    *why = "key " + std::to_string(k.key) + " appears twice in one init with two lengths (" + std::to_string(k.length) +
           " floats the second time); no key of this init was created";
  return e;
}

Errc ShardEngine::lookup(std::span<const KeyEntry> keys, std::vector<SlotRef>& slots, std::string* why) const {
  slots.resize(keys.size());
  store_->find_batch(
      keys.size(), [&](std::size_t i) { return keys[i].key; }, slots.data());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const Errc e = !slots[i].slot                      ? Errc::not_found
                   : slots[i].length != keys[i].length ? Errc::length_mismatch
                                                       : Errc::ok;
    if (e != Errc::ok) {
      if (why) *why = key_error(e, keys[i].key, keys[i].length, *store_);
      return e;
    }
  }
  return Errc::ok;
}

Errc ShardEngine::push(std::uint32_t worker, std::uint64_t clock, std::span<const KeyEntry> keys, const float* values,
                       std::string* why, const UndoLog* undo, PushId id) {
  // Look everything up and validate the whole request first, so a bad key leaves nothing
  // half-applied; the lookups are pipelined and the slots stay cached for the apply pass.
  thread_local std::vector<SlotRef> slots;
  if (Errc e = lookup(keys, slots, why); e != Errc::ok) return e;
  if (sync_) {
    if (Errc e = check_worker(worker, why); e != Errc::ok) return e;
    // Every key is checked before any is summed: a refusal must leave nothing applied (nor
    // anything its replicas would not be sent). A key's next step only moves forward, so a step
    // within its window now still is when it is added.
    // Room for each key's steps is made here too (an shm server made to be adopted keeps them in
    // /dev/shm).
    for (const auto& k : keys) {
      std::uint64_t next = 0;
      const Errc e = sync_->prepare(k.key, k.length, clock, &next);
      if (e == Errc::ok) continue;
      if (why)
        *why = e == Errc::invalid_argument
                   ? "worker " + std::to_string(worker) + " pushed step " + std::to_string(clock) + " of key " +
                         std::to_string(k.key) + ", too far ahead of step " + std::to_string(next)
                   : "no room for the sync steps of key " + std::to_string(k.key) + ": " + std::string(errc_name(e));
      return e;
    }
    // What can still fail from here (a step running ahead that needs an entry backed, a store
    // lock held past the patience) leaves the keys before it summed, as a plain push leaves them
    // applied; the worker's push sent again is a duplicate there.
    for (const auto& k : keys) {
      Errc err = Errc::ok;
      const SyncOutcome out = sync_->add(k.key, worker, clock, {values, k.length}, &err, undo);
      if (out == SyncOutcome::rejected) {
        if (why) *why = key_error(err, k.key, k.length, *store_);
        return err;
      }
      values += k.length;
    }
  } else {
    const UpdateRuleConfig& rule = store_->rule();
    id.worker = worker;
    std::uint64_t duplicates = 0;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      Store::prefetch_ahead(slots, i);
      // Fails only where other processes share the store (shm): a lock held past the patience.
      // The keys before it stay applied.
      bool duplicate = false;
      const Errc e = undo ? store_->apply_logged(*slots[i].slot, values, slots[i].length, 1.0f, undo->owner,
                                                 *undo->record, undo->buffer, undo->capacity, undo->patience)
                          : store_->apply_slot(slots[i], values, rule, 1.0f, id, &duplicate);
      duplicates += duplicate;
      if (e != Errc::ok) {
        if (why)
          *why = key_error(e, keys[i].key, keys[i].length, *store_) + " (" + std::to_string(i) + " of " +
                 std::to_string(keys.size()) + " keys of this push were applied)";
        pushes_.fetch_add(i, std::memory_order_relaxed);
        return e;
      }
      values += keys[i].length;
    }
    if (duplicates) duplicate_pushes_.fetch_add(duplicates, std::memory_order_relaxed);
  }
  pushes_.fetch_add(keys.size(), std::memory_order_relaxed);
  return Errc::ok;
}

Errc ShardEngine::pull(std::span<const KeyEntry> keys, float* out, std::string* why) {
  thread_local std::vector<SlotRef> slots;
  if (Errc e = lookup(keys, slots, why); e != Errc::ok) return e;
  count_pulls(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    Store::prefetch_ahead(slots, i);
    store_->read_slot_or_lock(slots[i], out);
    out += keys[i].length;
  }
  return Errc::ok;
}

std::uint32_t ShardEngine::quorum() const noexcept {
  return options_.mode == ConsistencyMode::sync
             ? (options_.sync_required ? options_.sync_required : options_.num_workers)
             : 0;
}

std::uint64_t ShardEngine::read_bound() const noexcept {
  if (!clocks_ || options_.mode == ConsistencyMode::asp) return kClockDone;
  return clocks_->bound(quorum());
}

std::uint64_t ShardEngine::observed_bound() const noexcept {
  return clocks_ ? clocks_->bound(quorum()) : kClockDone;
}

bool ShardEngine::pull_allowed(std::uint32_t worker, std::uint64_t clock) const noexcept {
  if (!clocks_ || options_.mode == ConsistencyMode::asp || worker == kNoWorker) return true;
  const std::uint64_t s = options_.mode == ConsistencyMode::ssp ? options_.staleness : 0;
  const std::uint64_t need = clock > s ? clock - s : 0;
  return need == 0 || read_bound() >= need;
}

void ShardEngine::park_pull(std::uint32_t worker, std::uint64_t clock, std::unique_ptr<Parked> op) {
  const std::uint64_t s = options_.mode == ConsistencyMode::ssp ? options_.staleness : 0;
  {
    std::lock_guard lock(mu_);
    if (!stopping_) {
      waiters_.push_back(Waiter{clock > s ? clock - s : 0, worker, false, 0,
                                std::chrono::steady_clock::now() + options_.wait_timeout, std::move(op)});
      ++stats_.parked;
    }
  }
  // Refused outside the lock, as the Parked contract says: its reply may take transport locks.
  if (op) return op->resume(Errc::peer_failure, "the server is shutting down");
  cv_.notify_all();
  release_ready();  // the bound may have moved between the caller's check and the park
}

Errc ShardEngine::check_pull_clock(std::uint32_t worker, std::uint64_t clock, std::string* why) const {
  if (!clocks_ || worker >= clocks_->workers()) return Errc::ok;
  const std::uint64_t announced = clocks_->clock(worker);
  if (clock <= announced) return Errc::ok;
  if (why)
    *why = "worker " + std::to_string(worker) + " pulled at clock " + std::to_string(clock) +
           " but has announced clock " + std::to_string(announced) + "; a pull carries the worker's current clock";
  return Errc::invalid_argument;
}

std::uint64_t ShardEngine::advance_clock(std::uint32_t worker, std::uint64_t clock) {
  clocks_->advance_to(worker, clock);
  clock_ops_.fetch_add(1, std::memory_order_relaxed);
  release_ready();
  return observed_bound();
}

void ShardEngine::worker_left(std::uint32_t worker, bool cleanly) {
  if (!clocks_ || worker >= clocks_->workers()) return;
  if (cleanly) {
    clocks_->finish(worker);
  } else if (options_.straggler == StragglerPolicy::evict) {
    evict(worker);
  } else {
    // Fail fast: anyone waiting on this worker gets told now rather than at the timeout.
    std::vector<Waiter> failed;
    {
      std::lock_guard lock(mu_);
      const std::uint64_t c = clocks_->clock(worker);
      for (auto it = waiters_.begin(); it != waiters_.end();) {
        const bool blocked = it->barrier ? barrier_gen_[worker] < it->generation : c < it->need;
        if (blocked) {
          failed.push_back(std::move(*it));
          it = waiters_.erase(it);
        } else {
          ++it;
        }
      }
    }
    const std::string why = "worker " + std::to_string(worker) + " disconnected at clock " +
                            std::to_string(clocks_->clock(worker)) +
                            " and holds the bound; restart the job or run with --straggler-policy evict";
    {
      std::lock_guard lock(mu_);
      if (failure_.empty()) {
        failure_ = why;
        failure_worker_ = worker;
      }
    }
    for (auto& w : failed) w.op->resume(Errc::peer_failure, why);
    return;
  }
  release_ready();
}

class ShardEngine::EnterBarrier final : public Parked {
 public:
  EnterBarrier(ShardEngine& engine, std::uint32_t worker, std::uint64_t generation, std::unique_ptr<Parked> reply)
      : engine_(engine), worker_(worker), generation_(generation), reply_(std::move(reply)) {}
  void resume(Errc status, const std::string& why) override {
    if (status == Errc::ok)
      engine_.enter_barrier(worker_, generation_, std::move(reply_));
    else
      reply_->resume(status, why);
  }

 private:
  ShardEngine& engine_;
  std::uint32_t worker_;
  std::uint64_t generation_;
  std::unique_ptr<Parked> reply_;
};

Errc ShardEngine::check_replicable(std::uint64_t value, const char* what, std::string* why) const {
  if (!replicator_ || value < UINT32_MAX || value == kClockDone) return Errc::ok;
  if (why)
    *why = std::string("a ") + what + " of " + std::to_string(value) +
           " is past 2^32 - 2, the largest a replicated server can ship to its replicas";
  return Errc::invalid_argument;
}

void ShardEngine::barrier(std::uint32_t worker, std::uint64_t generation, std::unique_ptr<Parked> op) {
  if (std::string why; check_replicable(generation, "barrier generation", &why) != Errc::ok)
    return op->resume(Errc::invalid_argument, why);
  {
    // What a full transfer starting now sends: the replica must not miss an arrival it was not
    // yet connected to receive as a shipment.
    std::lock_guard lock(mu_);
    barrier_seen_[worker] = std::max(barrier_seen_[worker], generation);
  }
  if (replicator_)
    replicator_->ship_barrier(worker, generation,
                              std::make_unique<EnterBarrier>(*this, worker, generation, std::move(op)));
  else
    enter_barrier(worker, generation, std::move(op));
}

void ShardEngine::restore_barrier(std::uint32_t worker, std::uint64_t generation) {
  std::lock_guard lock(mu_);
  if (worker >= barrier_gen_.size()) return;
  barrier_gen_[worker] = std::max(barrier_gen_[worker], generation);
  barrier_seen_[worker] = std::max(barrier_seen_[worker], generation);
}

void ShardEngine::restore_eviction(std::uint32_t worker) {
  if (clocks_ && worker < clocks_->workers()) clocks_->evict(worker);
}

void ShardEngine::enter_barrier(std::uint32_t worker, std::uint64_t generation, std::unique_ptr<Parked> op) {
  {
    std::lock_guard lock(mu_);
    if (!stopping_) {
      barrier_gen_[worker] = std::max(barrier_gen_[worker], generation);
      waiters_.push_back(
          Waiter{0, worker, true, generation, std::chrono::steady_clock::now() + options_.wait_timeout, std::move(op)});
    }
  }
  // Entered from the replicator's thread, it may come after shutdown() took the waiters.
  if (op) return op->resume(Errc::peer_failure, "the server is shutting down");
  cv_.notify_all();
  release_ready();
}

std::uint64_t ShardEngine::barrier_arrivals(std::uint64_t generation) const {
  std::uint64_t missing = 0;
  for (std::uint32_t w = 0; w < clocks_->workers(); ++w)
    if (!clocks_->evicted(w) && clocks_->clock(w) != kClockDone && barrier_gen_[w] < generation) ++missing;
  return missing;
}

void ShardEngine::release_ready() {
  std::vector<Waiter> ready;
  {
    std::lock_guard lock(mu_);
    if (waiters_.empty()) return;
    const std::uint64_t bound = read_bound();
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      const bool ok = it->barrier ? barrier_arrivals(it->generation) == 0 : bound >= it->need;
      if (ok) {
        ready.push_back(std::move(*it));
        it = waiters_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& w : ready) w.op->resume(Errc::ok, {});
}

std::string ShardEngine::describe_laggard(std::uint64_t need) const {
  std::ostringstream os;
  bool first = true;
  for (std::uint32_t w = 0; w < clocks_->workers(); ++w) {
    const std::uint64_t c = clocks_->clock(w);
    if (clocks_->evicted(w) || c == kClockDone || c >= need) continue;
    os << (first ? "" : "; ") << "worker " << w << " is at clock " << c << " (needed " << need << ", last progress "
       << (steady_now_ns() - clocks_->last_progress_ns(w)) / 1'000'000 << " ms ago)";
    first = false;
  }
  return os.str();
}

void ShardEngine::evict(std::uint32_t worker) {
  if (!clocks_->evict(worker)) return;  // the watchdog and a departure may both try
  {
    std::lock_guard lock(mu_);
    ++stats_.evictions;
  }
  // Not waited for: one the replicas miss when this server dies is made again there, after the
  // wait timeout.
  if (replicator_) replicator_->ship_eviction(worker);
}

void ShardEngine::watchdog() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    auto next = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (const auto& w : waiters_) next = std::min(next, w.deadline);
    cv_.wait_until(lock, next);
    if (stopping_) break;
    const auto now = std::chrono::steady_clock::now();
    std::vector<Waiter> expired;
    std::vector<std::uint32_t> stragglers;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      if (it->deadline > now) {
        ++it;
        continue;
      }
      if (options_.straggler == StragglerPolicy::evict) {
        // Evict whoever has made no progress for a whole timeout and holds this waiter back.
        const std::int64_t stale_before = steady_now_ns() - std::chrono::nanoseconds(options_.wait_timeout).count();
        for (std::uint32_t w = 0; w < clocks_->workers(); ++w) {
          const std::uint64_t c = clocks_->clock(w);
          const bool blocks = it->barrier ? barrier_gen_[w] < it->generation : c < it->need;
          if (blocks && c != kClockDone && !clocks_->evicted(w) && clocks_->last_progress_ns(w) <= stale_before &&
              std::find(stragglers.begin(), stragglers.end(), w) == stragglers.end())
            stragglers.push_back(w);
        }
        it->deadline = now + options_.wait_timeout;
        ++it;
        continue;
      }
      expired.push_back(std::move(*it));
      it = waiters_.erase(it);
    }
    if (!expired.empty() || !stragglers.empty()) {
      std::vector<std::pair<Waiter, std::string>> fail;
      for (auto& w : expired) {
        ++stats_.timeouts;
        if (failure_.empty() && !w.barrier) failure_ = describe_laggard(w.need) + " (timed out)";
        std::string who = w.barrier ? "barrier " + std::to_string(w.generation) + " still waits for other workers"
                                    : describe_laggard(w.need);
        fail.emplace_back(std::move(w), "waited " + std::to_string(options_.wait_timeout.count()) + " ms: " + who +
                                            "; it may have died or stalled (raise --wait-timeout-ms or run with "
                                            "--straggler-policy evict)");
      }
      lock.unlock();
      for (auto& [w, why] : fail) w.op->resume(Errc::timeout, why);
      for (std::uint32_t w : stragglers) evict(w);
      if (!stragglers.empty()) release_ready();
      lock.lock();
    }
  }
}

void ShardEngine::worker_joined(std::uint32_t worker) {
  std::lock_guard lock(mu_);
  if (!failure_.empty() && failure_worker_ == worker) {
    failure_.clear();
    failure_worker_ = kNoWorker;
  }
}

std::string ShardEngine::failure() const {
  std::lock_guard lock(mu_);
  return failure_;
}

EngineStats ShardEngine::stats() const {
  std::lock_guard lock(mu_);
  EngineStats s = stats_;
  s.pushes = pushes_.load();
  s.pulls = pulls_.load();
  s.clocks = clock_ops_.load();
  if (sync_) s.sync = sync_->stats();
  return s;
}

ShardEngine::Replica* ShardEngine::replica(std::uint32_t origin, std::string* why) const {
  for (const auto& r : replicas_)
    if (r->origin == origin) return r.get();
  if (why)
    *why = "server " + std::to_string(options_.server_id) + " keeps no replica of server " + std::to_string(origin) +
           " (check --peers and --replicas: every server must be started with the same ones)";
  return nullptr;
}

std::unique_ptr<Store> ShardEngine::new_replica_store() const {
  auto store = Store::create(std::make_unique<HeapMemory>(Store::required_bytes(options_.store)), options_.store);
  store->keep_push_marks(store_->push_marks());
  return store;
}

SyncOptions sync_options(const EngineOptions& options) {
  return {.num_workers = options.num_workers,
          .required = options.sync_required,
          .replicated = !options.replica_of.empty() || options.mark_pushes};
}

Errc ShardEngine::sealed(std::uint32_t origin, std::string* why) const {
  if (why)
    *why = "server " + std::to_string(options_.server_id) + " takes no more of server " + std::to_string(origin) +
           "'s frames: it is taking server " + std::to_string(origin) + "'s keys over (failover)";
  return Errc::permission;
}

Errc ShardEngine::refill_sealed_replica(std::uint32_t origin, const std::function<Errc(std::string*)>& fill,
                                        std::string* why) {
  Replica* r = replica(origin, why);
  if (!r) return Errc::invalid_argument;
  refilling = r;
  Errc e = Errc::ok;
  try {
    e = fill(why);
  } catch (...) {
    refilling = nullptr;
    throw;
  }
  refilling = nullptr;
  return e;
}

Errc ShardEngine::seal_replica(std::uint32_t origin, bool seal, std::string* why) {
  Replica* r = replica(origin, why);
  if (!r) return Errc::invalid_argument;
  std::unique_lock frames(r->seal_mu);
  r->sealed = seal;
  return Errc::ok;
}

bool ShardEngine::replica_synced(std::uint32_t origin, std::uint32_t* incarnation) const {
  const Replica* r = replica(origin, nullptr);
  if (!r) return false;
  if (incarnation) *incarnation = r->table_epoch.load(std::memory_order_acquire);
  return r->mark.load(std::memory_order_acquire) == static_cast<std::uint32_t>(ReplicaMark::synced);
}

std::uint64_t ShardEngine::replica_transfer(std::uint32_t origin) const {
  const Replica* r = replica(origin, nullptr);
  if (!r) return 0;
  std::lock_guard lock(r->tables_mu);
  return r->table_connection;
}

std::uint32_t ShardEngine::record_length_of(std::uint32_t floats) const noexcept {
  // record_floats() is linear in the length: head + fixed + length x per-value.
  const std::uint64_t fixed = record_head_ + (sync_ ? sync_->state_fixed_floats() : 0);
  const std::uint64_t per = 1 + spv_ + (sync_ ? sync_->state_floats_per_value() : 0);
  if (floats <= fixed || (floats - fixed) % per != 0) return 0;
  return static_cast<std::uint32_t>((floats - fixed) / per);
}

Errc ShardEngine::put_records(Store& store, SyncAccumulator* sync, std::span<const KeyEntry> keys, const float* records,
                              std::string* why) {
  // Every record's length, and its pending steps, are checked before any is written.
  const std::uint32_t h = record_head_;
  const float* at = records;
  for (const KeyEntry& k : keys) {
    const std::uint32_t length = record_length_of(k.length);
    if (length == 0) {
      if (why)
        *why = "key " + std::to_string(k.key) + ": a record of " + std::to_string(k.length) +
               " floats is not the record of any length here (are the servers' --rule, --mode and --workers the "
               "same?)";
      return Errc::protocol;
    }
    if (sync) {
      std::string bad;
      if (sync->check_state(length, at + h + std::uint64_t{length} * (1 + spv_), &bad) != Errc::ok) {
        if (why) *why = "key " + std::to_string(k.key) + ": " + bad;
        return Errc::protocol;
      }
    }
    at += k.length;
  }
  thread_local std::vector<std::uint64_t> marks;
  marks.resize(store.push_marks());
  for (const KeyEntry& k : keys) {
    std::uint64_t head[3];  // epoch, seq, update count
    std::memcpy(head, records, sizeof head);
    if (!marks.empty()) std::memcpy(marks.data(), records + kRecordHeaderFloats, marks.size() * sizeof marks[0]);
    const std::uint32_t length = record_length_of(k.length);
    const std::span<const float> value(records + h, length);
    const std::span<const float> state(records + h + length, std::size_t{length} * spv_);
    auto put = [&] {
      bool taken = false;
      const Errc e = store.put_if_newer(k.key, value, state, head[2], head[0], head[1],
                                        marks.empty() ? nullptr : marks.data(), &taken);
      if (taken && sync) sync->import_state(k.key, length, state.data() + state.size());
      return e;
    };
    // The store's write and the pending steps' are one under the key's sync stripe, as add()'s are.
    const Errc e = sync ? sync->with_key(k.key, put) : put();
    if (e != Errc::ok) {
      if (why) *why = key_error(e, k.key, length, store);
      return e;
    }
    records += k.length;
  }
  return Errc::ok;
}

Errc ShardEngine::apply_replica(std::uint32_t origin, std::span<const KeyEntry> keys, const float* records,
                                std::string* why) {
  Replica* r = replica(origin, why);
  if (!r) return Errc::invalid_argument;
  std::shared_lock frame(r->seal_mu);
  if (r->sealed && refilling != r) return sealed(origin, why);
  return put_records(*r->store, r->sync.get(), keys, records, why);
}

Errc ShardEngine::take_replicate(std::uint32_t origin, std::uint32_t mark, std::span<const KeyEntry> keys,
                                 const float* records, std::string* why, std::uint64_t connection,
                                 std::uint32_t epoch_seconds) {
  if (!keys.empty()) return apply_replica(origin, keys, records, why);
  if (mark == static_cast<std::uint32_t>(ReplicaMark::syncing) ||
      mark == static_cast<std::uint32_t>(ReplicaMark::synced))
    return mark_replica(origin, static_cast<ReplicaMark>(mark), why, connection, epoch_seconds);
  *why = "replicate without keys marks a transfer's start or end, not " + std::to_string(mark);
  return Errc::protocol;
}

Errc ShardEngine::mark_replica(std::uint32_t origin, ReplicaMark mark, std::string* why, std::uint64_t connection,
                               std::uint32_t epoch_seconds) {
  Replica* r = replica(origin, why);
  if (!r) return Errc::invalid_argument;
  // A syncing mark restarts the copy, its store included (below): no frame, and no read of the
  // store, runs meanwhile.
  std::shared_lock frame(r->seal_mu, std::defer_lock);
  std::unique_lock restart(r->seal_mu, std::defer_lock);
  if (mark == ReplicaMark::syncing)
    restart.lock();
  else
    frame.lock();
  if (r->sealed && refilling != r) return sealed(origin, why);
  // As a table frame's: a page read (replica_table_rows) sees the copy before or after the mark.
  std::lock_guard applying(r->table_apply_mu);
  std::lock_guard lock(r->tables_mu);
  // A mark that comes late on a connection the origin has since replaced (its transfer there
  // timed out) says nothing of the transfer under way: a connection's tag grows with every
  // connection this server's listener accepts (its high half), so the older one is known.
  if (connection != 0 && r->table_connection != 0) {
    if (mark == ReplicaMark::syncing && (connection >> 32) < (r->table_connection >> 32)) return Errc::ok;
    if (mark == ReplicaMark::synced && connection != r->table_connection) return Errc::ok;
  }
  if (mark == ReplicaMark::syncing) {
    r->mark.store(static_cast<std::uint32_t>(mark), std::memory_order_release);
    // A transfer sends the origin's clocks as they are now: those of an earlier incarnation (an
    // origin restarted from a checkpoint rather than its replicas) must not outlive it here.
    for (auto& words : r->words)
      for (std::uint32_t w = 0; w < options_.num_workers; ++w) words[w].store(0, std::memory_order_relaxed);
    // Its tables too: the transfer sends each again, and only this connection's frames count.
    r->table_connection = connection;
    for (std::uint32_t id = 0; id < kMaxTables; ++id) drop_copy(*r, id);
    r->table_position.store(0, std::memory_order_release);
    r->table_epoch.store(epoch_seconds, std::memory_order_release);
    r->tables_broken = false;
    // And its keys: the transfer sends every key the origin holds, and a key only an earlier
    // incarnation wrote must not outlive it here (a rejoin would take it back).
    r->store = new_replica_store();
    if (r->sync) r->sync = std::make_unique<SyncAccumulator>(*r->store, sync_options(options_));
  }
  if (mark == ReplicaMark::synced && r->tables_broken) return Errc::ok;  // it stays syncing
  r->mark.store(static_cast<std::uint32_t>(mark), std::memory_order_release);
  return Errc::ok;
}

Errc ShardEngine::apply_replica_word(WorkerWord word, std::uint32_t origin, std::uint32_t worker, std::uint64_t value,
                                     std::string* why) {
  Replica* r = replica(origin, why);
  if (!r) return Errc::invalid_argument;
  std::shared_lock frame(r->seal_mu);
  if (r->sealed && refilling != r) return sealed(origin, why);
  if (worker >= options_.num_workers) {
    if (why)
      *why = "a word of worker " + std::to_string(worker) + ", but this server runs with --workers " +
             std::to_string(options_.num_workers);
    return Errc::invalid_argument;
  }
  std::atomic<std::uint64_t>& w = r->words[static_cast<std::size_t>(word)][worker];
  std::uint64_t now = w.load(std::memory_order_relaxed);
  while (now < value && !w.compare_exchange_weak(now, value, std::memory_order_relaxed)) {
  }
  return Errc::ok;
}

Errc ShardEngine::replica_words(WorkerWord word, std::uint32_t origin, std::vector<std::uint64_t>* values,
                                std::string* why) const {
  values->assign(clocks_ ? options_.num_workers : 0, 0);
  if (origin != options_.server_id) {
    const Replica* r = replica(origin, why);
    if (!r) return Errc::invalid_argument;
    for (std::uint32_t w = 0; w < values->size(); ++w)
      (*values)[w] = r->words[static_cast<std::size_t>(word)][w].load(std::memory_order_relaxed);
    return Errc::ok;
  }
  std::lock_guard lock(mu_);  // for barrier_seen_
  for (std::uint32_t w = 0; w < values->size(); ++w)
    (*values)[w] = word == WorkerWord::clock     ? clocks_->clock(w)
                   : word == WorkerWord::barrier ? barrier_seen_[w]  // asked for: a transfer must not miss one
                                                 : std::uint64_t{clocks_->evicted(w)};
  return Errc::ok;
}

Errc ShardEngine::restore_records(std::span<const KeyEntry> keys, const float* records, std::string* why) {
  return put_records(*store_, sync_.get(), keys, records, why);
}

Errc ShardEngine::read_records(std::uint32_t origin, std::span<const KeyEntry> keys, float* out, std::string* why) {
  Store* store = store_.get();
  SyncAccumulator* sync = sync_.get();
  std::shared_lock<std::shared_mutex> reading;  // a replica's store, which a syncing mark replaces
  if (origin != options_.server_id) {
    Replica* r = replica(origin, why);
    if (!r) return Errc::invalid_argument;
    reading = std::shared_lock(r->seal_mu);
    store = r->store.get();
    sync = r->sync.get();
  }
  // Checked first, so a bad key answers nothing.
  thread_local std::vector<SlotHeader*> slots;
  slots.assign(keys.size(), nullptr);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    SlotHeader* slot = store->find(keys[i].key);
    const std::uint32_t length = slot ? store->length_of(*slot) : 0;
    if (!slot || record_floats(length) != keys[i].length) {
      if (why)
        *why = "key " + std::to_string(keys[i].key) + (slot ? " has another length" : " is not held") +
               " in the replica of server " + std::to_string(origin);
      return slot ? Errc::length_mismatch : Errc::not_found;
    }
    slots[i] = slot;
  }
  const bool own = store == store_.get();
  thread_local std::vector<std::uint64_t> marks;
  marks.resize(store->push_marks());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::uint32_t h = record_head_;
    const std::uint32_t length = store->length_of(*slots[i]);
    std::uint64_t head[3] = {epoch_, 0, 0}, origin[2] = {0, 0};  // epoch, seq, update count
    auto snapshot = [&] {
      store->snapshot_slot(*slots[i], out + h, out + h + length, &head[2], &head[1], origin,
                           marks.empty() ? nullptr : marks.data());
      if (sync) sync->export_state(keys[i].key, length, out + h + std::uint64_t{length} * (1 + spv_));
    };
    // The value and the pending steps of one moment: add() changes both under the key's stripe.
    if (sync)
      sync->with_key(keys[i].key, snapshot);
    else
      snapshot();
    if (!marks.empty()) std::memcpy(out + kRecordHeaderFloats, marks.data(), marks.size() * sizeof marks[0]);
    if (!own) {
      head[0] = origin[0];
      head[1] = origin[1];
    }
    std::memcpy(out, head, sizeof head);
    out += keys[i].length;
  }
  return Errc::ok;
}

Errc ShardEngine::replica_index(std::uint32_t origin, std::vector<std::pair<Key, std::uint32_t>>* keys, bool* synced,
                                std::vector<std::uint64_t>* words, std::string* why) {
  if (Errc e = replica_keys(origin, keys, synced, why); e != Errc::ok) return e;
  words->clear();
  std::vector<std::uint64_t> one;
  for (std::size_t k = 0; k < kWorkerWords; ++k) {
    if (Errc e = replica_words(static_cast<WorkerWord>(k), origin, &one, why); e != Errc::ok) return e;
    words->insert(words->end(), one.begin(), one.end());
  }
  return Errc::ok;
}

Errc ShardEngine::replica_keys(std::uint32_t origin, std::vector<std::pair<Key, std::uint32_t>>* keys, bool* synced,
                               std::string* why) {
  Store* store = store_.get();
  *synced = true;
  std::shared_lock<std::shared_mutex> reading;  // a replica's store, which a syncing mark replaces
  if (origin != options_.server_id) {
    Replica* r = replica(origin, why);
    if (!r) return Errc::invalid_argument;
    reading = std::shared_lock(r->seal_mu);
    store = r->store.get();
    *synced = r->mark.load(std::memory_order_acquire) == static_cast<std::uint32_t>(ReplicaMark::synced);
  }
  keys->clear();
  store->for_each_slot([&](const Store::SlotEntry& e) { keys->emplace_back(e.key, e.length); });
  return Errc::ok;
}

std::string ShardEngine::stats_json(std::uint64_t external_pushes, const JsonObject& extra) const {
  EngineStats s = stats();
  s.pushes += external_pushes;
  JsonObject j;
  j.add("server_id", options_.server_id)
      .add("keys", store_->key_count())
      .add("value_bytes", store_->value_bytes_used())
      .add("pushes", s.pushes)
      .add("pushes_already_applied", duplicate_pushes_.load(std::memory_order_relaxed))
      .add("pulls", s.pulls)
      .add("clocks", s.clocks)
      .add("parked", s.parked)
      .add("timeouts", s.timeouts)
      .add("evictions", s.evictions)
      .add("sync_applied_steps", s.sync.applied_steps)
      .add("sync_dropped_late", s.sync.dropped_late)
      .add("sync_duplicates", s.sync.duplicates)
      .add("mode", to_string(options_.mode));
  if (clocks_) {
    std::vector<std::int64_t> by_worker(clocks_->workers());
    std::uint64_t evicted = 0;
    for (std::uint32_t w = 0; w < clocks_->workers(); ++w) {
      const std::uint64_t c = clocks_->clock(w);
      by_worker[w] = c == kClockDone ? -1 : static_cast<std::int64_t>(c);  // -1: finished
      evicted += clocks_->evicted(w);
    }
    // Evicted workers no longer hold any bound here, whoever evicted them (this server, or the
    // one whose keys it took back).
    j.add("clocks_by_worker", std::span<const std::int64_t>(by_worker)).add("workers_evicted", evicted);
  }
  for (const auto& r : replicas_) {
    const std::string at = "replica_of_" + std::to_string(r->origin);
    const std::uint32_t mark = r->mark.load(std::memory_order_acquire);
    std::uint64_t keys = 0;
    {
      std::shared_lock reading(r->seal_mu);
      keys = r->store->key_count();
    }
    j.add(at + "_keys", keys)
        .add(at + "_state", mark == static_cast<std::uint32_t>(ReplicaMark::synced)    ? "synced"
                            : mark == static_cast<std::uint32_t>(ReplicaMark::syncing) ? "syncing"
                                                                                       : "empty");
    std::lock_guard lock(r->tables_mu);
    for (std::uint32_t id = 0; id < kMaxTables; ++id)
      if (r->tables[id]) j.add(at + "_table_" + std::to_string(id) + "_rows", r->tables[id]->stats().rows);
  }
  for (std::uint32_t id = 0; id < kMaxTables; ++id) {
    const EmbeddingTable* t = tables_[id].load(std::memory_order_acquire);
    if (!t) continue;
    const TableStats ts = t->stats();
    const std::string at = "table_" + std::to_string(id);
    j.add(at + "_dim", t->dim())
        .add(at + "_rows", ts.rows)
        .add(at + "_max_rows", t->spec().max_rows)
        .add(at + "_created", ts.created)
        .add(at + "_evicted", ts.evicted)
        .add(at + "_not_admitted", ts.not_admitted)
        .add(at + "_bytes", ts.bytes);
  }
  if (replicator_) j.merge(replicator_->stats());
  if (membership_) j.merge(membership_->stats());
  return j.merge(extra).str();
}

bool ShardEngine::tables_refused(std::string* why) const {
  // Their rows would be lost with this server: refused rather than acknowledged unreplicated.
  if (!replicator_ || options_.replicate_tables) return false;
  *why =
      "this server replicates, and its transport does not ship table rows to the replicas; run it without "
      "--replicas to use tables";
  return true;
}

std::uint64_t ShardEngine::table_cost(const TableSpec& spec, std::uint64_t* max_rows) const noexcept {
  // A replicated server also keeps the copies of its predecessors' tables, which every server of
  // the job creates alike: a table takes its rows at the cap once per replica.
  const std::uint64_t copies = !options_.replicate_tables ? 1
                               : options_.table_copies    ? options_.table_copies
                                                          : options_.replica_of.size() + 1;
  // A table kept in storage logs its row writes: one undo record per index shard, as wide as a row
  // with its state (100 MiB for 1024-float Adam rows).
  const std::uint64_t fixed =
      EmbeddingTable::fixed_bytes(spec) + (table_storage_ ? EmbeddingTable::undo_bytes_for(spec) : 0);
  const std::uint64_t per_row = EmbeddingTable::row_bytes_bound(spec);
  const std::uint64_t left =
      (options_.table_memory_bytes - std::min(options_.table_memory_bytes, table_bytes_promised_)) / copies;
  // Storage backs a segment whole (its file is fallocated) from its first row, so such a table
  // is charged whole segments: a cap of one 4096-float Adam row holds 3 GiB of /dev/shm.
  const std::uint64_t segment = table_storage_ ? EmbeddingTable::kSegmentRows : 1;
  if (*max_rows == 0)
    *max_rows =
        left > fixed ? std::min<std::uint64_t>((left - fixed) / per_row / segment * segment, UINT32_MAX - 1) : 0;
  const std::uint64_t backed = (*max_rows + segment - 1) / segment * segment;
  return (fixed + backed * per_row) * copies;
}

Errc ShardEngine::make_table(std::uint32_t id, const TableSpec& spec, std::string* why, std::uint64_t max_rows,
                             std::unique_ptr<TableStorage> storage) {
  TableSpec effective = spec;
  if (max_rows != 0) effective.max_rows = max_rows;
  const std::uint64_t needs = table_cost(spec, &effective.max_rows);
  const std::uint64_t left = options_.table_memory_bytes - std::min(options_.table_memory_bytes, table_bytes_promised_);
  if (effective.max_rows == 0 || needs > left) {
    *why = "table " + std::to_string(id) + " would take " + std::to_string(needs >> 20) + " MiB at its cap of " +
           std::to_string(effective.max_rows) + " rows" +
           (options_.replicate_tables ? " (with the copies of the predecessors' tables this server keeps)" : "") +
           "; the server's table memory (--table-memory-mb) has " + std::to_string(left >> 20) + " MiB left";
    return Errc::capacity;
  }
  try {
    // Indexed for the cap the workers declared, not for the one this server's memory sets.
    if (!storage && table_storage_) storage = table_storage_(id, spec, effective.max_rows);
    table_owner_.push_back(std::make_unique<EmbeddingTable>(effective, spec.max_rows, std::move(storage)));
  } catch (const std::exception& e) {
    *why = std::string("table ") + std::to_string(id) + ": " + e.what();
    return Errc::capacity;
  }
  if (options_.track_table_changes) table_owner_.back()->track_changes();
  if (options_.replicate_tables) table_owner_.back()->list_removals();
  table_bytes_promised_ += needs;
  table_requested_[id] = spec;
  {
    std::lock_guard marks(table_marks_mu_);
    table_marks_[id].assign(table_marks_per_table_, 0);
  }
  tables_[id].store(table_owner_.back().get(), std::memory_order_release);
  return Errc::ok;
}

Errc ShardEngine::create_table(std::uint32_t id, const TableSpec& spec, std::string* why, bool* created) {
  if (created) *created = false;
  if (tables_refused(why)) return Errc::unsupported;
  if (id >= kMaxTables) {
    *why = "table id " + std::to_string(id) + " is past the " + std::to_string(kMaxTables) + " tables a server holds";
    return Errc::invalid_argument;
  }
  if (std::string problem = check_table_spec(spec); !problem.empty()) {
    *why = problem;
    return Errc::invalid_argument;
  }
  std::lock_guard lock(tables_mu_);
  if (tables_[id].load(std::memory_order_relaxed)) {
    if (spec == table_requested_[id]) return Errc::ok;
    *why = "table " + std::to_string(id) + " exists with another spec (" +
           spec_differences(table_requested_[id], spec) + "); every creator must give the same one";
    return Errc::invalid_argument;
  }
  const Errc e = make_table(id, spec, why);
  if (created) *created = e == Errc::ok;
  return e;
}

EmbeddingTable* ShardEngine::table_at(std::uint32_t id, TableSpec* requested) {
  EmbeddingTable* t = id < kMaxTables ? tables_[id].load(std::memory_order_acquire) : nullptr;
  if (t && requested) {
    std::lock_guard lock(tables_mu_);
    *requested = table_requested_[id];
  }
  return t;
}

EmbeddingTable* ShardEngine::table_rows(std::uint32_t id, std::span<const KeyEntry> entries, std::vector<Key>& keys,
                                        std::string* why) const {
  EmbeddingTable* t = id < kMaxTables ? tables_[id].load(std::memory_order_acquire) : nullptr;
  if (!t) {
    *why = "no table " + std::to_string(id) + " on server " + std::to_string(options_.server_id) +
           ": create it first (Client::create_table)";
    return nullptr;
  }
  keys.resize(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (entries[i].length != t->dim()) {
      *why = "row " + std::to_string(entries[i].key) + " of table " + std::to_string(id) + " has " +
             std::to_string(entries[i].length) + " floats; the table's rows have " + std::to_string(t->dim());
      return nullptr;
    }
    keys[i] = entries[i].key;
  }
  return t;
}

Errc ShardEngine::table_pull(std::uint32_t id, std::span<const KeyEntry> ids, float* out, std::string* why) {
  if (tables_refused(why)) return Errc::unsupported;
  thread_local std::vector<Key> keys;
  EmbeddingTable* t = table_rows(id, ids, keys, why);
  if (!t) return Errc::invalid_argument;
  t->pull(keys, out);
  pulls_.fetch_add(ids.size(), std::memory_order_relaxed);
  return Errc::ok;
}

Errc ShardEngine::table_push(std::uint32_t id, std::uint64_t clock, std::span<const KeyEntry> ids, const float* grads,
                             std::string* why, PushId push, bool* duplicate) {
  if (duplicate) *duplicate = false;
  if (tables_refused(why)) return Errc::unsupported;
  thread_local std::vector<Key> keys;
  EmbeddingTable* t = table_rows(id, ids, keys, why);
  if (!t) return Errc::invalid_argument;
  const bool marked = push.identified() && table_marks_per_table_ > 0;
  if (marked) {
    if (push.worker >= table_marks_per_table_) {
      *why = "an identified table push from worker " + std::to_string(push.worker) + ", past the " +
             std::to_string(table_marks_per_table_) + " workers (--workers) this server marks pushes of";
      return Errc::invalid_argument;
    }
    // The check, the rows and the mark are one step: without a replicator ordering identified
    // pushes (a failover's takeover engine with no replica left), a push sent again must not
    // slip in between the check and the mark of its first copy.
    std::lock_guard lock(table_marks_mu_);
    if (push.already_in(table_marks_[id][push.worker])) {
      if (duplicate) *duplicate = true;
      duplicate_pushes_.fetch_add(ids.size(), std::memory_order_relaxed);
      return Errc::ok;
    }
    t->push(keys, grads, clock);
    table_marks_[id][push.worker] = push.mark();
  } else {
    t->push(keys, grads, clock);
  }
  pushes_.fetch_add(ids.size(), std::memory_order_relaxed);
  return Errc::ok;
}

std::vector<std::uint64_t> ShardEngine::table_marks(std::uint32_t id) const {
  if (id >= kMaxTables) return {};
  std::lock_guard lock(table_marks_mu_);
  return table_marks_[id];
}

std::uint64_t ShardEngine::table_mark(std::uint32_t id, std::uint32_t worker) const {
  if (id >= kMaxTables) return 0;
  std::lock_guard lock(table_marks_mu_);
  return worker < table_marks_[id].size() ? table_marks_[id][worker] : 0;
}

Errc ShardEngine::restore_table_marks(std::uint32_t id, std::span<const std::uint64_t> marks, std::string* why) {
  if (id >= kMaxTables || !tables_[id].load(std::memory_order_acquire)) {
    *why = "push marks for table " + std::to_string(id) + ", which this server does not hold";
    return Errc::invalid_argument;
  }
  if (marks.empty()) return Errc::ok;
  if (marks.size() != table_marks_per_table_) {
    *why = "table " + std::to_string(id) + " comes back with " + std::to_string(marks.size()) +
           " push marks; this server marks the pushes of " + std::to_string(table_marks_per_table_) + " workers";
    return Errc::invalid_argument;
  }
  std::lock_guard lock(table_marks_mu_);
  table_marks_[id].assign(marks.begin(), marks.end());
  return Errc::ok;
}

std::uint64_t ShardEngine::table_record_floats(std::uint32_t id) const noexcept {
  const EmbeddingTable* t = id < kMaxTables ? tables_[id].load(std::memory_order_acquire) : nullptr;
  return t ? t->dim() + t->state_floats_per_row() : 0;
}

Errc ShardEngine::check_table_marks(std::uint32_t origin, std::uint32_t id, std::uint64_t count,
                                    std::string* why) const {
  if (count == 0 || count == table_marks_per_table_) return Errc::ok;
  *why = "server " + std::to_string(origin) + "'s table " + std::to_string(id) + " comes with " +
         std::to_string(count) + " push marks; this server marks the pushes of " +
         std::to_string(table_marks_per_table_) + " workers (servers of a ring share --workers)";
  return Errc::protocol;
}

Errc ShardEngine::apply_replica_table(std::uint32_t origin, std::uint64_t connection, std::uint32_t position,
                                      std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows,
                                      std::span<const std::uint64_t> marks, std::string* why) {
  Replica* r = replica(origin, why);
  if (!r) return Errc::invalid_argument;
  std::shared_lock frame(r->seal_mu);
  if (r->sealed && refilling != r) return sealed(origin, why);
  if (Errc e = check_table_marks(origin, id, marks.size(), why); e != Errc::ok) return e;
  if (id >= kMaxTables) {
    *why = "table id " + std::to_string(id) + " is past the " + std::to_string(kMaxTables) + " tables a server holds";
    return Errc::invalid_argument;
  }
  if (std::string problem = check_table_spec(requested); !problem.empty()) {
    *why = "server " + std::to_string(origin) + "'s table " + std::to_string(id) + ": " + problem;
    return Errc::invalid_argument;
  }
  if (max_rows == 0 || max_rows >= UINT32_MAX || (requested.max_rows != 0 && max_rows != requested.max_rows)) {
    *why = "server " + std::to_string(origin) + "'s table " + std::to_string(id) + " cannot have a cap of " +
           std::to_string(max_rows) + " rows";
    return Errc::invalid_argument;
  }
  // The copy takes what its origin ships and never evicts on its own: between one shipment's
  // removals and its rows, a push on another thread may make a row and evict one whose removal
  // comes in the next shipment, so a copy may briefly hold rows past the cap. Its index starts as
  // its origin's did.
  TableSpec copy = requested;
  copy.max_rows = std::min<std::uint64_t>(2 * max_rows + kCopySlack, UINT32_MAX - 1);
  copy.eviction = RowEviction::none;
  copy.admit_after = 1;
  const std::uint64_t charge = EmbeddingTable::fixed_bytes(copy) + max_rows * EmbeddingTable::row_bytes_bound(copy);
  std::lock_guard applying(r->table_apply_mu);
  std::lock_guard lock(r->tables_mu);
  if (connection != r->table_connection) return Errc::ok;  // a connection given up on
  drop_copy(*r, id);
  auto broken = [&](const std::string& what) {
    // The copy is gone: no rejoin may take this replica for whole until a transfer restarts it.
    r->tables_broken = true;
    r->mark.store(static_cast<std::uint32_t>(ReplicaMark::syncing), std::memory_order_release);
    *why = "the copy of server " + std::to_string(origin) + "'s table " + std::to_string(id) + ": " + what;
    return Errc::capacity;
  };
  std::uint64_t charged = copies_charged_.load(std::memory_order_relaxed);
  while (charged + charge <= options_.table_memory_bytes &&
         !copies_charged_.compare_exchange_weak(charged, charged + charge, std::memory_order_relaxed)) {
  }
  if (charged + charge > options_.table_memory_bytes) {
    return broken("it would take " + std::to_string(charge >> 20) + " MiB at its cap of " + std::to_string(max_rows) +
                  " rows, and the copies of other servers' tables this server keeps already take " +
                  std::to_string(charged >> 20) + " MiB of its table memory (--table-memory-mb, " +
                  std::to_string(options_.table_memory_bytes >> 20) + " MiB; every server of a ring needs the same)");
  }
  r->table_charge[id] = charge;
  try {
    r->tables[id] = std::make_shared<EmbeddingTable>(copy, requested.max_rows);
  } catch (const std::exception& e) {
    drop_copy(*r, id);
    return broken(e.what());
  }
  r->table_requested[id] = requested;
  r->table_cap[id] = max_rows;
  r->table_marks[id].assign(table_marks_per_table_, 0);
  std::copy(marks.begin(), marks.end(), r->table_marks[id].begin());
  r->table_position.store(position, std::memory_order_release);
  return Errc::ok;
}

void ShardEngine::drop_copy(Replica& r, std::uint32_t id) noexcept {
  r.tables[id].reset();
  copies_charged_.fetch_sub(r.table_charge[id], std::memory_order_relaxed);
  r.table_charge[id] = 0;
}

Errc ShardEngine::apply_replica_rows(std::uint32_t origin, std::uint64_t connection, std::uint32_t position,
                                     std::uint32_t id, std::span<const KeyEntry> rows, const float* records,
                                     std::string* why, const RowsMark* marked) {
  Replica* r = replica(origin, why);
  if (!r) return Errc::invalid_argument;
  std::shared_lock frame(r->seal_mu);
  if (r->sealed && refilling != r) return sealed(origin, why);
  std::lock_guard applying(r->table_apply_mu);
  if (marked && marked->worker >= table_marks_per_table_) {
    *why = "rows of server " + std::to_string(origin) + "'s table " + std::to_string(id) + " marked by worker " +
           std::to_string(marked->worker) + ", past the " + std::to_string(table_marks_per_table_) +
           " workers this server marks pushes of";
    return Errc::protocol;
  }
  std::shared_ptr<EmbeddingTable> t;
  bool current = false;
  if (id < kMaxTables) {
    std::lock_guard lock(r->tables_mu);
    t = r->tables[id];
    current = connection == r->table_connection;
  }
  if (!t) {
    // Shipments reach a replica from the moment it is connected, before its full transfer's mark
    // and copy: that transfer reads the rows again, after these.
    if ((!current || r->mark.load(std::memory_order_acquire) != static_cast<std::uint32_t>(ReplicaMark::synced)) &&
        id < kMaxTables)
      return Errc::ok;
    *why = "rows of server " + std::to_string(origin) + "'s table " + std::to_string(id) +
           ", of which this server holds no copy";
    return Errc::invalid_argument;
  }
  const std::uint32_t dim = t->dim();
  const std::uint64_t floats = dim + t->state_floats_per_row();
  for (const KeyEntry& k : rows)
    if (k.length != (records ? floats : 1)) {
      *why = "row " + std::to_string(k.key) + " of server " + std::to_string(origin) + "'s table " +
             std::to_string(id) + " comes with " + std::to_string(k.length) + " floats, not " +
             std::to_string(records ? floats : 1);
      return Errc::protocol;
    }
  if (!current) return Errc::ok;  // a connection given up on
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (!records) {
      t->remove_row(rows[i].key);
    } else if (const float* at = records + i * floats; !t->restore_row(rows[i].key, at, at + dim)) {
      // Its copy now misses a row: no rejoin may take it for whole until a transfer restarts it.
      {
        std::lock_guard lock(r->tables_mu);
        r->tables_broken = true;
      }
      r->mark.store(static_cast<std::uint32_t>(ReplicaMark::syncing), std::memory_order_release);
      *why = "the copy of server " + std::to_string(origin) + "'s table " + std::to_string(id) +
             " has no room for row " + std::to_string(rows[i].key) + ": it holds " + std::to_string(t->stats().rows) +
             " rows, at most twice its origin's cap and " + std::to_string(kCopySlack) +
             " more, or this server has no memory";
      return Errc::capacity;
    }
  }
  if (marked) {
    std::lock_guard lock(r->tables_mu);
    // Rows and mark arrive in one frame, applied under table_apply_mu: a page a rejoin reads
    // (replica_table_rows, under the same lock) holds both or neither.
    if (connection == r->table_connection && r->tables[id] == t) r->table_marks[id][marked->worker] = marked->mark;
  }
  r->table_position.store(position, std::memory_order_release);
  return Errc::ok;
}

Errc ShardEngine::replica_table_rows(std::uint32_t origin, std::uint32_t id, std::uint32_t cursor,
                                     std::uint32_t max_rows, std::uint64_t max_bytes, ReplicaTableRows* out,
                                     std::string* why) const {
  *out = ReplicaTableRows{};
  // This server's own table when asked for its own id, as read_records does for keys.
  std::shared_ptr<EmbeddingTable> t;
  std::unique_lock<std::mutex> applying;
  if (origin == options_.server_id) {
    EmbeddingTable* own = id < kMaxTables ? tables_[id].load(std::memory_order_acquire) : nullptr;
    out->synced = true;
    out->epoch = epoch_seconds();
    if (own) {
      t = std::shared_ptr<EmbeddingTable>(own, [](EmbeddingTable*) {});  // never removed while the engine lives
      std::lock_guard lock(tables_mu_);
      out->requested = table_requested_[id];
      out->max_rows = own->spec().max_rows;
    }
    if (own) out->marks = table_marks(id);
  } else {
    Replica* r = replica(origin, why);
    if (!r) return Errc::invalid_argument;
    // No frame applies while the page is read: its position, marks and rows are of one point.
    applying = std::unique_lock(r->table_apply_mu);
    out->position = r->table_position.load(std::memory_order_acquire);
    out->epoch = r->table_epoch.load(std::memory_order_acquire);
    out->synced = r->mark.load(std::memory_order_acquire) == static_cast<std::uint32_t>(ReplicaMark::synced);
    if (id < kMaxTables) {
      std::lock_guard lock(r->tables_mu);
      t = r->tables[id];
      out->requested = r->table_requested[id];
      out->max_rows = r->table_cap[id];
      if (t) out->marks = r->table_marks[id];
    }
  }
  if (!t) return Errc::ok;
  out->exists = true;
  const std::uint32_t dim = t->dim();
  out->record_floats = static_cast<std::uint32_t>(dim + t->state_floats_per_row());
  // A page never passes what the reply may carry, marks included.
  const std::uint64_t per_row = sizeof(Key) + std::uint64_t{out->record_floats} * sizeof(float);
  const std::uint64_t marks_bytes = out->marks.size() * sizeof(std::uint64_t);
  const auto rows = static_cast<std::uint32_t>(
      std::min<std::uint64_t>(max_rows, (max_bytes - std::min(max_bytes, marks_bytes)) / per_row));
  if (rows == 0) {
    *why = "a row of server " + std::to_string(origin) + "'s table " + std::to_string(id) +
           " does not fit the reply's limit";
    return Errc::capacity;
  }
  out->next = t->scan(cursor, rows, [&](Key key, const float* row, const float* state) {
    out->ids.push_back(key);
    out->records.insert(out->records.end(), row, row + dim);
    out->records.insert(out->records.end(), state, state + (out->record_floats - dim));
  });
  return Errc::ok;
}

Errc ShardEngine::remake_table(std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows,
                               std::unique_ptr<TableStorage> storage, std::string* why) {
  if (std::string problem = check_table_spec(requested); !problem.empty()) {
    *why = "table " + std::to_string(id) + ": " + problem;
    return Errc::invalid_argument;
  }
  if (max_rows == 0 || max_rows >= UINT32_MAX) {
    *why = "table " + std::to_string(id) + " comes back with a cap of " + std::to_string(max_rows) + " rows";
    return Errc::invalid_argument;
  }
  return make_table(id, requested, why, max_rows, std::move(storage));
}

Errc ShardEngine::adopt_table(std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows,
                              std::unique_ptr<TableStorage> storage, std::string* why) {
  if (id >= kMaxTables) {
    *why = "table id " + std::to_string(id) + " is past the " + std::to_string(kMaxTables) + " tables a server holds";
    return Errc::invalid_argument;
  }
  std::lock_guard lock(tables_mu_);
  if (tables_[id].load(std::memory_order_relaxed)) {
    *why = "table " + std::to_string(id) + " exists here already";
    return Errc::invalid_argument;
  }
  return remake_table(id, requested, max_rows, std::move(storage), why);
}

Errc ShardEngine::restore_table_rows(std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows,
                                     std::span<const Key> ids, const float* records, std::string* why) {
  if (id >= kMaxTables) {
    *why = "table id " + std::to_string(id) + " is past the " + std::to_string(kMaxTables) + " tables a server holds";
    return Errc::invalid_argument;
  }
  EmbeddingTable* t;
  {
    std::lock_guard lock(tables_mu_);
    if (!tables_[id].load(std::memory_order_relaxed)) {
      if (Errc e = remake_table(id, requested, max_rows, nullptr, why); e != Errc::ok) return e;
    } else if (!(table_requested_[id] == requested)) {
      *why = "table " + std::to_string(id) + " exists here with another spec than its replica's";
      return Errc::invalid_argument;
    }
    t = tables_[id].load(std::memory_order_relaxed);
  }
  const std::uint64_t floats = t->dim() + t->state_floats_per_row();
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (!t->restore_row(ids[i], records + i * floats, records + i * floats + t->dim())) {
      *why = "table " + std::to_string(id) + " has no room for row " + std::to_string(ids[i]);
      return Errc::capacity;
    }
  return Errc::ok;
}

}  // namespace pskv
