#include "transport/shm/shm_connection.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <ctime>
#include <sstream>
#include <vector>

#include "common/sync.h"

namespace pskv::shm {

using transport::KeySlice;
using transport::Request;

ShmConnection::ShmConnection(const Uri& uri, const transport::ConnectOptions& options)
    : options_(options), endpoint_(uri.str()) {
  segment_ = Segment::open(uri.name);
  header_ = &segment_->header();
  const auto deadline = std::chrono::steady_clock::now() + options.connect_timeout;
  while (header_->ready.load(std::memory_order_acquire) == 0) {
    if (std::chrono::steady_clock::now() > deadline)
      throw Error(Errc::timeout, "shm://" + uri.name + " exists but its server never finished starting");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  // Everything below comes from the geometry Segment::open checked and copied; the header's
  // words are not read again.
  const SegmentGeometry& g = segment_->geometry();
  store_ = Store::attach(segment_->store_memory());
  if (g.num_workers) clocks_ = std::make_unique<ClockTable>(segment_->clock_memory(), g.num_workers, false);
  if (options.worker_id != kNoWorker && options.worker_id >= g.num_workers)
    throw Error(Errc::invalid_argument, "worker id " + std::to_string(options.worker_id) + " is out of range: " +
                                            endpoint_ + " was started with --workers " + std::to_string(g.num_workers));
  const auto mode = g.mode;
  bounded_ = clocks_ && mode != ConsistencyMode::asp;
  staleness_ = mode == ConsistencyMode::ssp ? g.staleness : 0;
  quorum_ = mode == ConsistencyMode::sync ? (g.sync_required ? g.sync_required : g.num_workers) : 0;
  // Sync mode sums the workers' pushes on the server before applying them once.
  worker_push_ = g.worker_push && mode != ConsistencyMode::sync;
  info_.num_workers = g.num_workers;
  data_capacity_ = g.area_bytes;
  server_threads_ = g.server_threads;
  // A wait the server bounds (tcp) also ends at the client's io_timeout; so does this one, since
  // nothing but the segment says what the server's timeout is.
  wait_timeout_ = std::clamp(std::chrono::milliseconds(g.wait_timeout_ms), std::chrono::milliseconds(1),
                             std::max(options.io_timeout, std::chrono::milliseconds(1)));
  const auto cores = std::max(1u, std::thread::hardware_concurrency());
  max_spinners_ = cores > g.server_threads ? cores - g.server_threads : 1;
  if (cores <= g.server_threads) max_spin_micros_ = transport::Completion::kContendedSpinMicros;

  if (header_->accepting.load(std::memory_order_acquire) == 0)
    throw Error(Errc::peer_failure, endpoint_ + " is stopping and takes no new clients");
  const pid_t me = ::getpid();
  const std::uint64_t start = process_start_time(me);
  std::uint32_t still_owed = 0;
  for (std::uint32_t i = 0; i < g.clients && !area_; ++i) {
    std::int32_t expected = 0;
    ClientArea& s = segment_->area(i);
    // Claim through a sentinel: the server's watchdog must never see our pid with the previous
    // owner's start time (it would think we died and hand the area to someone else).
    if (s.owner_pid.compare_exchange_strong(expected, kClaimingArea)) {
      s.owner_start = start;
      s.worker_id = options.worker_id;
      s.waits_on_clock.store(0);
      s.undo.phase.store(UndoPhase::idle);
      s.owner_pid.store(me, std::memory_order_release);
      area_ = &s;
      area_index_ = i;
    } else if (expected == kLeavingArea) {
      ++still_owed;
    }
  }
  if (!area_)
    throw Error(Errc::capacity,
                endpoint_ + " has no free client area (" + std::to_string(g.clients) + " in use" +
                    (still_owed ? ", " + std::to_string(still_owed) +
                                      " of them left by a client the server still owes answers (a barrier still "
                                      "waiting), free once they are given, within the server's wait timeout"
                                : std::string()) +
                    "); restart the server with more --shm-clients");
  data_ = segment_->area_data(area_index_);
  next_seq_ = area_->done.load(std::memory_order_acquire);
  completed_.store(next_seq_);
  area_->client_polling.store(0);
  area_->head.store(next_seq_, std::memory_order_release);
  helper_ = std::thread([this] { helper_loop(); });
}

ShmConnection::~ShmConnection() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  area_->done_word.fetch_add(1);
  futex_wake_all(&area_->done_word);
  helper_.join();
  fail_everything(Errc::peer_failure, "the connection to " + endpoint_ + " was closed by the client");
  // Let the server finish whatever was published, then give the area back. Answers still owed
  // after 2 s (a barrier waits up to the server's wait timeout, and this worker's goodbye clock
  // behind it) are the server's to finish: the area is marked leaving, so that no new client
  // takes it and gets them, and the server's watchdog frees it once they are given.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (area_->done.load() < area_->head.load() && std::chrono::steady_clock::now() < deadline &&
         segment_->server_alive())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const bool owed = area_->done.load() < area_->head.load() && segment_->server_alive();
  area_->owner_pid.store(owed ? kLeavingArea : 0, std::memory_order_release);
}

bool ShmConnection::bound_allows(std::uint64_t clock, std::uint64_t* observed) const {
  *observed = clocks_ ? clocks_->bound(quorum_) : kClockDone;
  if (!bounded_ || options_.worker_id == kNoWorker) return true;
  const std::uint64_t need = clock > staleness_ ? clock - staleness_ : 0;
  return need == 0 || *observed >= need;
}

Errc ShmConnection::lookup(const Request& request, std::vector<SlotRef>& slots, std::string* why) const {
  const std::size_t n = request.keys.size();
  slots.resize(n);
  store_->find_batch(
      n, [&](std::size_t i) { return request.keys[i].key; }, slots.data());
  for (std::size_t i = 0; i < n; ++i) {
    const KeySlice& k = request.keys[i];
    if (!slots[i].slot) {
      *why = "key " + std::to_string(k.key) + " does not exist on " + endpoint_ + ": init it before pushing or pulling";
      return Errc::not_found;
    }
    // An index entry or slot header rewritten by another process could point this key at
    // another key's value of the same length: its slot must name it.
    if (const Key named = slots[i].slot->key; named != k.key) {
      *why = "key " + std::to_string(k.key) + "'s slot in " + endpoint_ + " names key " + std::to_string(named) +
             ": the segment was overwritten by another process";
      return Errc::protocol;
    }
    // Checked once here (inside the arena, the length asked for); the copy then uses k.length,
    // never the header's word again.
    if (const std::uint32_t has = slots[i].length; has != k.length) {
      *why = "key " + std::to_string(k.key) + " has " + std::to_string(has) + " floats, the request says " +
             std::to_string(k.length);
      return Errc::length_mismatch;
    }
  }
  return Errc::ok;
}

Errc ShmConnection::read_values(const Request& request, std::string* why) const {
  thread_local std::vector<SlotRef> slots;
  if (Errc e = lookup(request, slots, why); e != Errc::ok) return e;
  // Copying is the first touch of each slot's values: keep its misses in flight ahead of the copy.
  const std::size_t n = request.keys.size();
  std::chrono::steady_clock::time_point deadline{};  // set by the first copy that has to wait
  for (std::size_t i = 0; i < n; ++i) {
    Store::prefetch_ahead(slots, i);
    std::uint64_t version = 0;
    if (!read_slot_until(*slots[i].slot, request.keys[i].data, request.keys[i].length, options_.io_timeout, &deadline,
                         &version)) {
      *why = "key " + std::to_string(request.keys[i].key) + " stayed inside a write for the io timeout (" +
             std::to_string(options_.io_timeout.count()) +
             " ms): a worker stopped in the middle of its push to it, or the server died inside one";
      return Errc::timeout;
    }
  }
  return Errc::ok;
}

bool ShmConnection::push_directly(Request& request) {
  // A push applied into the segment of a dead server would be acknowledged and then lost, so
  // the server's liveness is checked here too (the helper only looks every 500 ms); at most
  // every 10 ms, since it reads /proc. The coarse clock (a tick's resolution) is enough for
  // that and costs 9 ns here against steady_clock's 40, on a push that takes 300.
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  const std::int64_t now_ns = std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
  if (now_ns - last_alive_check_ns_.load(std::memory_order_relaxed) > 10'000'000) {
    last_alive_check_ns_.store(now_ns, std::memory_order_relaxed);
    if (!segment_->server_alive()) fail_everything(Errc::peer_failure, server_gone());
  }
  {
    std::lock_guard lock(mu_);
    if (broken_ || direct_active_) return false;
    if (answers_waiting()) settle();
    // Program order: this client's earlier ring requests (an init of the key, a clock) first.
    if (completed_.load(std::memory_order_relaxed) != next_seq_) return false;
    direct_active_ = true;
  }
  auto finish = [&] {
    {
      std::lock_guard lock(mu_);
      direct_active_ = false;
    }
    space_.notify_all();
  };
  thread_local std::vector<SlotRef> slots;
  std::string why;
  // Every key is checked before any is applied, as the server does: a bad key changes nothing.
  if (Errc e = lookup(request, slots, &why); e != Errc::ok) {
    finish();
    request.completion->complete_part(e, why);
    return true;
  }
  std::size_t undo_room = 0;
  for (const SlotRef& s : slots) undo_room = std::max(undo_room, store_->undo_floats(*s.slot));
  if (undo_room * sizeof(float) > data_capacity_) {
    finish();
    return false;  // the ring path says whether the push itself fits
  }
  auto* undo = reinterpret_cast<float*>(data_);
  const std::uint32_t owner = area_owner_tag(area_index_);
  const auto patience = wait_timeout_;
  Errc status = Errc::ok;
  std::size_t applied = 0;
  for (; applied < slots.size(); ++applied) {
    Store::prefetch_ahead(slots, applied);
    // A holder that died is repaired by the server's watchdog within about 100 ms; meanwhile
    // make sure there still is a server to do it.
    constexpr auto kTick = std::chrono::milliseconds(100);
    std::chrono::milliseconds waited{0};
    while ((status = store_->apply_logged(*slots[applied].slot, request.keys[applied].data,
                                          request.keys[applied].length, 1.0f, owner, area_->undo, undo,
                                          data_capacity_ / sizeof(float), kTick, &header_->closing)) == Errc::timeout) {
      waited += kTick;
      if (!segment_->server_alive()) status = Errc::peer_failure;
      if (status == Errc::peer_failure || waited >= patience) break;
    }
    if (status != Errc::ok) break;
  }
  if (status != Errc::ok) {
    const Key key = request.keys[applied].key;
    const std::string lock = "key " + std::to_string(key) + "'s stripe lock";
    const std::string held = " held by " + describe_owner(store_->stripe_holder(key)) + "; " + std::to_string(applied) +
                             " of " + std::to_string(slots.size()) + " keys of this push were applied";
    const bool stopping = status == Errc::peer_failure && header_->closing.load() != 0;
    why = stopping
              ? "the pskv server of " + endpoint_ + " is stopping and takes no more pushes; " +
                    std::to_string(applied) + " of " + std::to_string(slots.size()) + " keys of this push were applied"
          : status == Errc::peer_failure ? server_gone() + " (" + lock + " is" + held + ")"
          : status == Errc::length_mismatch
              ? "key " + std::to_string(key) + "'s slot header in " + endpoint_ +
                    " no longer matches its length (overwritten?); " + std::to_string(applied) + " of " +
                    std::to_string(slots.size()) + " keys of this push were applied"
              : "waited " + std::to_string(patience.count()) + " ms for " + lock + "," + held;
  }
  // A successor adopting the segment of a dead server rolls back, after its patience, a push a
  // stalled client is still inside; such a push must not be acknowledged when the client resumes.
  // The adopter sets `closing` before it waits, so a push that ends after that says so.
  if (status == Errc::ok && header_->closing.load(std::memory_order_seq_cst) != 0) {
    status = Errc::peer_failure;
    why = "the pskv server of " + endpoint_ +
          " stopped (or died) while this push was applied; it may have landed "
          "but is not acknowledged";
  }
  area_->worker_pushes.store(area_->worker_pushes.load(std::memory_order_relaxed) + applied, std::memory_order_relaxed);
  finish();
  request.completion->complete_part(status, why);
  return true;
}

std::string ShmConnection::server_gone() const {
  return "the pskv server of " + endpoint_ + " (pid " + std::to_string(segment_->geometry().server_pid) +
         ") is gone; did it die?";
}

std::string ShmConnection::describe_owner(std::uint32_t owner) const {
  if (owner == 0) return "nobody now";
  const std::uint32_t area = owner_tag_area(owner);
  if (owner == SharedMutex::kAnonymousOwner || area >= segment_->geometry().clients) return "the server";
  return "the client in area " + std::to_string(area) + ", pid " +
         std::to_string(segment_->area(area).owner_pid.load());
}

void ShmConnection::submit(Request& request) {
  if (request.op != wire::Op::pull) {
    if (request.op == wire::Op::push && worker_push_ && push_directly(request)) return;
    enqueue(request);
    return;
  }
  std::uint64_t observed = 0;
  {
    std::unique_lock lock(mu_);
    if (broken_) {
      lock.unlock();
      request.completion->complete_part(Errc::peer_failure, broken_why_);
      return;
    }
    // Program order: a pull must see this client's own earlier pushes, so it waits behind them.
    const bool own_pending = area_->done.load(std::memory_order_acquire) < next_seq_;
    if (own_pending || !bound_allows(request.arg0, &observed)) {
      const auto now = std::chrono::steady_clock::now();
      parked_.push_back({&request, next_seq_, request.arg0, now + wait_timeout_, now + options_.io_timeout});
      area_->waits_on_clock.store(1);
      lock.unlock();
      area_->done_word.fetch_add(1);  // let the helper re-evaluate now
      futex_wake_all(&area_->done_word);
      return;
    }
  }
  std::string why;
  const Errc e = read_values(request, &why);
  request.completion->note_bound(observed);
  request.completion->complete_part(e, why);
}

void ShmConnection::enqueue(Request& request) {
  const bool values = wire::op_carries_values(request.op);
  std::uint64_t payload = 0;
  for (const KeySlice& k : request.keys) payload += std::uint64_t{k.length} * sizeof(float);
  if (!values) payload = 0;
  const std::uint64_t key_bytes = request.keys.size() * sizeof(wire::KeyEntry);
  // A table_pull's rows come back after its key table.
  std::uint64_t reply = 0;
  if (request.op == wire::Op::table_pull)
    for (const KeySlice& k : request.keys) reply += std::uint64_t{k.length} * sizeof(float);
  // Room for the answer's text too (stats JSON, error messages).
  const std::uint64_t need =
      align_up(std::max<std::uint64_t>(key_bytes + payload + reply, request.op == wire::Op::stats ? 65536 : 512), 64);
  if (need > data_capacity_) {
    request.completion->complete_part(
        Errc::capacity, "a " + std::string(wire::op_name(static_cast<std::uint16_t>(request.op))) + " of " +
                            std::to_string(need >> 20) + " MiB does not fit the " +
                            std::to_string(data_capacity_ >> 20) + " MiB client area of " + endpoint_ +
                            ": raise the server's --shm-area-mb or lower --chunk-floats");
    return;
  }
  std::unique_lock lock(mu_);
  std::uint64_t start = 0;
  for (;;) {
    if (broken_) {
      lock.unlock();
      request.completion->complete_part(Errc::peer_failure, broken_why_);
      return;
    }
    // Nothing in flight: start again at the area's front, which the last request left in cache.
    // Walking the whole 32 MiB ring instead made every push copy into cold memory.
    if (completed_.load(std::memory_order_relaxed) == next_seq_ && data_head_ % data_capacity_ != 0)
      data_head_ = data_tail_ = data_head_ + data_capacity_ - data_head_ % data_capacity_;
    // Contiguous placement: skip the area's tail if the request does not fit before the wrap.
    start = data_head_;
    if (start % data_capacity_ + need > data_capacity_) start += data_capacity_ - start % data_capacity_;
    const bool ring_room = next_seq_ - completed_.load(std::memory_order_relaxed) < kRingEntries;
    const bool data_room = start + need - data_tail_ <= data_capacity_;
    if (ring_room && data_room && !direct_active_) break;
    space_.wait_for(lock, std::chrono::milliseconds(100));
  }
  const std::uint64_t seq = next_seq_ + 1;
  const std::uint64_t offset = start % data_capacity_;
  std::byte* area = data_ + offset;
  auto* entries = reinterpret_cast<wire::KeyEntry*>(area);
  for (std::size_t i = 0; i < request.keys.size(); ++i) entries[i] = {request.keys[i].key, request.keys[i].length, 0};
  if (values) {
    std::byte* out = area + key_bytes;
    for (const KeySlice& k : request.keys) {
      std::memcpy(out, k.data, std::size_t{k.length} * sizeof(float));
      out += std::size_t{k.length} * sizeof(float);
    }
  }
  RingEntry& e = area_->ring[seq % kRingEntries];
  e.seq = seq;
  e.op = static_cast<std::uint16_t>(request.op);
  e.table =
      wire::op_is_table(request.op) ? static_cast<std::uint16_t>(std::min<std::uint32_t>(request.arg1, 0xFFFF)) : 0;
  e.num_keys = static_cast<std::uint32_t>(request.keys.size());
  e.arg0 = request.arg0;
  e.data_offset = offset;
  e.payload_bytes = payload;
  e.data_bytes = need;
  e.status = 0;
  e.text_len = 0;
  pending_[seq % kRingEntries] = &request;
  data_end_[seq % kRingEntries] = start + need;
  data_offset_[seq % kRingEntries] = offset;
  data_head_ = start + need;
  // The server's silence is timed from here when it owed nothing before this request.
  if (area_->done.load(std::memory_order_acquire) >= next_seq_)
    ring_busy_since_ns_.store(steady_now_ns(), std::memory_order_relaxed);
  next_seq_ = seq;
  area_->head.store(seq, std::memory_order_release);
  lock.unlock();
  const std::uint32_t t = area_index_ % server_threads_;
  header_->doorbell[t].fetch_add(1, std::memory_order_seq_cst);
  if (header_->server_sleeping[t].load(std::memory_order_seq_cst)) futex_wake(&header_->doorbell[t], 1);
}

bool ShmConnection::run_parked(std::chrono::steady_clock::time_point now) {
  // Called with mu_ held. Runs the parked pulls that may go, in order; fails expired ones.
  const std::uint64_t done = area_->done.load(std::memory_order_acquire);
  bool waiting_on_clock = false;
  for (auto it = parked_.begin(); it != parked_.end();) {
    std::uint64_t observed = 0;
    const bool ready = done >= it->after_seq && bound_allows(it->clock, &observed);
    if (ready) {
      std::string why;
      const Errc e = read_values(*it->request, &why);
      it->request->completion->note_bound(observed);
      it->request->completion->complete_part(e, why);
      it = parked_.erase(it);
      continue;
    }
    // The server's policy decides: under "evict" the stalled worker is removed from the bound
    // (and we wait on), under "fail" the read fails here with the laggard's name.
    if (now > it->deadline && done >= it->after_seq) {
      std::uint32_t slowest = 0;
      const std::uint64_t need = it->clock > staleness_ ? it->clock - staleness_ : 0;
      const std::uint64_t b = clocks_->bound(quorum_, &slowest);
      // The progress stamp is the segment's word: clamped, a stamp in the future only buys one
      // more timeout, and give_up ends the wait regardless.
      const std::int64_t timeout_ms = wait_timeout_.count();
      const std::int64_t idle_ms =
          std::clamp<std::int64_t>((steady_now_ns() - clocks_->last_progress_ns(slowest)) / 1'000'000, 0, timeout_ms);
      if (idle_ms >= timeout_ms || now >= it->give_up) {
        std::ostringstream why;
        why << "waited "
            << std::chrono::duration_cast<std::chrono::milliseconds>(now - (it->give_up - options_.io_timeout)).count()
            << " ms: worker " << slowest << " is at clock " << b << " (needed " << need << ", last progress " << idle_ms
            << " ms ago); it may have died or stalled (raise --wait-timeout-ms or the client's io timeout, "
            << "or run the server with --straggler-policy evict)";
        it->request->completion->complete_part(Errc::timeout, why.str());
        it = parked_.erase(it);
        continue;
      }
      it->deadline = std::min(now + std::chrono::milliseconds(timeout_ms - idle_ms), it->give_up);
    }
    waiting_on_clock |= done >= it->after_seq;
    ++it;
  }
  area_->waits_on_clock.store(waiting_on_clock ? 1 : 0);
  return !parked_.empty();
}

bool ShmConnection::complete_answered() {
  // The server's word is not trusted past what was published.
  const std::uint64_t done = std::min(area_->done.load(std::memory_order_acquire), next_seq_);
  std::uint64_t seq = completed_.load(std::memory_order_relaxed);
  if (seq >= done) return false;
  // Completing under mu_ means no entry's space is handed out again before its answer was read.
  while (seq < done) {
    ++seq;
    Request* request = pending_[seq % kRingEntries];
    pending_[seq % kRingEntries] = nullptr;
    const RingEntry& e = area_->ring[seq % kRingEntries];
    const auto status = static_cast<Errc>(e.status);
    // The answer sits in this client's own area; its words are still bounded by the area, so
    // that a scribbled entry costs this request its text, not this process.
    const std::uint64_t at = e.data_offset, room = std::min<std::uint64_t>(e.text_len, e.data_bytes);
    const std::string_view text = at <= data_capacity_ && room <= data_capacity_ - at
                                      ? std::string_view(reinterpret_cast<const char*>(data_ + at), room)
                                      : std::string_view("the answer's text lies outside this client's area");
    if (request->op == wire::Op::clock) request->completion->note_bound(e.reply_arg0);
    if (status == Errc::ok && request->text_out) request->text_out->assign(text);
    if (status == Errc::ok && request->op == wire::Op::table_pull) {
      // Where this client put the rows' room itself (its own record, not the entry's words).
      const std::byte* rows = data_ + data_offset_[seq % kRingEntries] + request->keys.size() * sizeof(wire::KeyEntry);
      for (const KeySlice& k : request->keys) {
        seqlock_copy(k.data, rows, std::size_t{k.length} * sizeof(float));  // the area is shared memory
        rows += std::size_t{k.length} * sizeof(float);
      }
    }
    request->completion->complete_part(status, status == Errc::ok ? std::string_view{} : text);
  }
  completed_.store(done, std::memory_order_relaxed);
  data_tail_ = data_end_[done % kRingEntries];
  space_.notify_all();
  return true;
}

bool ShmConnection::answers_waiting() const noexcept {
  return area_->done.load(std::memory_order_acquire) > completed_.load(std::memory_order_relaxed);
}

void ShmConnection::settle() {
  if (!complete_answered()) return;
  // A pull parked behind this client's own push can go now. Left to the helper, it waited for
  // the helper's 50 ms tick: the server does not wake the helper while a waiter polls.
  if (!parked_.empty()) run_parked(std::chrono::steady_clock::now());
  wake_sleeping_waiters();
}

void ShmConnection::poll() noexcept {
  if (!answers_waiting()) return;
  std::unique_lock lock(mu_, std::try_to_lock);
  if (lock.owns_lock() && !broken_) settle();
}

bool ShmConnection::begin_polling() noexcept {
  // Two client processes spinning on a 2-core machine leave the server no core: it then runs
  // only when a spin gives up, and 64-byte pushes from 2 clients fell to 64 K/s (1 client:
  // 1 M/s). So spinners are counted over every client of this server.
  if (header_->spinners.fetch_add(1, std::memory_order_relaxed) >= max_spinners_) {
    header_->spinners.fetch_sub(1, std::memory_order_relaxed);
    return false;
  }
  area_->client_polling.fetch_add(1, std::memory_order_seq_cst);
  return true;
}

void ShmConnection::end_polling() noexcept {
  area_->client_polling.fetch_sub(1, std::memory_order_seq_cst);
  header_->spinners.fetch_sub(1, std::memory_order_relaxed);
  // Pairs with the fence in ShmServer::publish: either the server saw no poller and woke the
  // helper, or this load sees its answer. Usually the spin already took everything: no lock.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!answers_waiting()) return;
  std::lock_guard lock(mu_);
  if (!broken_) settle();
}

bool ShmConnection::sleep_for_answers(const transport::Completion& c, std::chrono::steady_clock::time_point until,
                                      std::chrono::steady_clock::time_point /*deadline*/) noexcept {
  // Pairs with the fences in ShmServer::publish and wake_sleeping_waiters: either the server or
  // the completer sees this sleeper and bumps waiter_word, or the loads after our fence see the
  // answer or the completion, and we do not sleep.
  area_->waiters_sleeping.fetch_add(1, std::memory_order_seq_cst);
  const std::uint32_t word = area_->waiter_word.load(std::memory_order_acquire);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (!c.done() && !answers_waiting()) {
    const auto left = until - std::chrono::steady_clock::now();
    if (left > std::chrono::nanoseconds::zero()) futex_wait(&area_->waiter_word, word, left);
  }
  area_->waiters_sleeping.fetch_sub(1, std::memory_order_seq_cst);
  if (!answers_waiting()) return true;
  // The helper was not woken for this answer: do its part.
  std::lock_guard lock(mu_);
  if (!broken_) settle();
  return true;
}

void ShmConnection::wake_sleeping_waiters() noexcept {
  // Orders the completions just made before the load, against the sleeper's fence.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  wake_waiter_word(*area_);
}

bool ShmConnection::server_owes_answer_locked(std::uint64_t done) const {
  // A barrier waits in the server for the other workers, as long as the server's own wait
  // timeout: the server bounds it, so its silence then says nothing about the server.
  for (std::uint64_t seq = done + 1; seq <= next_seq_ && seq - done <= kRingEntries; ++seq)
    if (const Request* r = pending_[seq % kRingEntries]; r && r->op == wire::Op::barrier) return false;
  return next_seq_ > done;
}

void ShmConnection::helper_loop() {
  auto last_alive_check = std::chrono::steady_clock::now();
  std::uint64_t last_done = area_->done.load(std::memory_order_acquire);
  std::int64_t last_progress_ns = steady_now_ns();  // when `done` last moved, or nothing was owed
  for (;;) {
    const std::uint32_t word = area_->done_word.load(std::memory_order_acquire);
    bool progressed, parked_left, owed;
    std::uint64_t done;
    {
      std::unique_lock lock(mu_);
      if (stopping_) return;
      progressed = complete_answered();
      parked_left = run_parked(std::chrono::steady_clock::now());
      done = area_->done.load(std::memory_order_acquire);
      owed = server_owes_answer_locked(done);
    }
    wake_sleeping_waiters();
    const auto now = std::chrono::steady_clock::now();
    if (now - last_alive_check > std::chrono::milliseconds(500)) {
      last_alive_check = now;
      if (!segment_->server_alive()) {
        fail_everything(Errc::peer_failure, server_gone());
        return;
      }
    }
    // A server that lives but answers nothing (stopped, or stuck) fails the requests in its ring
    // after the io timeout without an answer, as a silent tcp connection does. Its answers are
    // its `done` word moving, whoever on this side takes them (waiters mostly do).
    const std::int64_t now_ns = steady_now_ns();
    if (done != last_done || !owed) {
      last_done = done;
      last_progress_ns = now_ns;
    } else if (now_ns - std::max(last_progress_ns, ring_busy_since_ns_.load(std::memory_order_relaxed)) >
               std::chrono::nanoseconds(options_.io_timeout).count()) {
      fail_everything(Errc::timeout, endpoint_ + " (pid " + std::to_string(segment_->geometry().server_pid) +
                                         ") answered nothing for " + std::to_string(options_.io_timeout.count()) +
                                         " ms though it lives: stopped or hung");
      return;
    }
    if (progressed) continue;
    // Sleep until the server answers or a clock moves; tick to notice deadlines and server death.
    area_->client_sleeping.store(1);
    futex_wait(&area_->done_word, word, parked_left ? std::chrono::milliseconds(50) : std::chrono::milliseconds(500));
    area_->client_sleeping.store(0);
  }
}

void ShmConnection::fail_everything(Errc status, const std::string& why) {
  std::vector<Request*> victims;
  {
    std::lock_guard lock(mu_);
    if (!broken_) {
      broken_ = true;
      broken_why_ = why;
    }
    for (std::uint64_t seq = completed_.load() + 1; seq <= next_seq_; ++seq)
      if (Request* r = pending_[seq % kRingEntries]) {
        victims.push_back(r);
        pending_[seq % kRingEntries] = nullptr;
      }
    completed_.store(next_seq_);
    for (auto& p : parked_) victims.push_back(p.request);
    parked_.clear();
  }
  space_.notify_all();
  for (Request* r : victims) r->completion->complete_part(status, why);
  wake_sleeping_waiters();
}

}  // namespace pskv::shm
