#include "transport/shm/shm_server.h"

#include <chrono>
#include <cstring>

#include "common/log.h"
#include "common/sync.h"
#include "transport/shm/sync_file.h"
#include "transport/wire.h"

namespace pskv::shm {

// A barrier parked in the engine: answering it unblocks its area.
class AreaParked final : public Parked {
 public:
  AreaParked(ShmServer& server, std::uint32_t area, std::uint64_t seq) : server_(server), area_(area), seq_(seq) {}
  void resume(Errc status, const std::string& why) override {
    RingEntry& e = server_.segment_->area(area_).ring[seq_ % kRingEntries];
    server_.answer(area_, e, status, why);
    server_.publish(area_, seq_);
    server_.blocked_[area_].store(false, std::memory_order_release);
    server_.wake_thread(area_);
  }

 private:
  ShmServer& server_;
  std::uint32_t area_;
  std::uint64_t seq_;
};

ShmServer::ShmServer(Segment& segment, ShardEngine& engine, const ShmServerOptions& options)
    : options_(options), segment_(&segment), geo_(segment.geometry()), engine_(&engine) {
  options_.threads = geo_.server_threads;
  // Clients take stripe locks too: a writer here waits for one a bounded time, so a client that
  // hangs holding it costs that key an error, not a server thread (and every area it serves).
  engine_->store().set_lock_patience(lock_patience());
  blocked_ = std::make_unique<std::atomic<bool>[]>(geo_.clients);
  ignored_ = std::make_unique<std::atomic<std::int32_t>[]>(geo_.clients);
  auto& h = segment_->header();
  h.accepting.store(1, std::memory_order_release);
  h.ready.store(1, std::memory_order_release);
  for (std::uint32_t t = 0; t < options_.threads; ++t) threads_.emplace_back([this, t] { serve(t); });
  watchdog_ = std::thread([this] { watchdog(); });
}

ShmServer::~ShmServer() {
  stop_accepting();
  drain();
  close();
}

std::chrono::nanoseconds ShmServer::lock_patience() const noexcept {
  return std::min<std::chrono::nanoseconds>(std::chrono::milliseconds(geo_.wait_timeout_ms), std::chrono::seconds(1));
}

void ShmServer::stop_accepting() noexcept {
  segment_->header().accepting.store(0, std::memory_order_release);
}

void ShmServer::drain() noexcept {
  if (drained_) return;
  drained_ = true;
  auto& h = segment_->header();
  // Pairs with Store::apply_logged: a client announces its update (undo phase, seq_cst) before it
  // reads `closing` (seq_cst), so either it sees the word and applies nothing, or the loop below
  // sees it in progress and waits for it to finish.
  h.closing.store(1, std::memory_order_seq_cst);
  const auto give_up = std::chrono::steady_clock::now() + lock_patience() + std::chrono::seconds(1);
  for (std::uint32_t i = 0; i < geo_.clients; ++i) {
    ClientArea& s = segment_->area(i);
    // A client that died inside its push never had it acknowledged: the watchdog rolls it back.
    while (s.undo.phase.load(std::memory_order_seq_cst) != UndoPhase::idle && s.owner_pid.load() > 0 &&
           process_alive(s.owner_pid.load(), s.owner_start)) {
      if (std::chrono::steady_clock::now() > give_up) {
        log::warn("shm.drain", "server " + std::to_string(engine_->options().server_id) + ": " + who(i) +
                                   " is still inside a push it applies itself; stopping without waiting for it "
                                   "(the final checkpoint may miss that push)");
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  stopping_.store(true);
  for (std::uint32_t t = 0; t < options_.threads; ++t) {
    h.doorbell[t].fetch_add(1);
    futex_wake_all(&h.doorbell[t]);
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void ShmServer::close() noexcept {
  if (closed_) return;
  closed_ = true;
  drain();
  watchdog_stop_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  auto& h = segment_->header();
  // Wake every client so that it notices the server is gone, then drop the name.
  for (std::uint32_t i = 0; i < geo_.clients; ++i) {
    segment_->area(i).done_word.fetch_add(1);
    futex_wake_all(&segment_->area(i).done_word);
  }
  std::atomic_ref<std::int32_t>(h.server_pid).store(0, std::memory_order_release);
  segment_->remove();
}

std::uint64_t ShmServer::worker_pushes() const noexcept {
  std::uint64_t pushes = 0;
  for (std::uint32_t i = 0; i < geo_.clients; ++i)
    pushes += segment_->area(i).worker_pushes.load(std::memory_order_relaxed);
  return pushes;
}

JsonObject ShmServer::stats_fields() const {
  JsonObject j;
  j.add("worker_pushes", worker_pushes()).add("recovered_pushes", segment_->header().recovered_pushes.load());
  j.merge(options_.extra_stats);
  return j;
}

void ShmServer::wake_thread(std::uint32_t i) {
  auto& h = segment_->header();
  const std::uint32_t t = i % options_.threads;
  h.doorbell[t].fetch_add(1);
  futex_wake_all(&h.doorbell[t]);
}

void ShmServer::publish(std::uint32_t i, std::uint64_t seq) {
  ClientArea& s = segment_->area(i);
  s.done.store(seq, std::memory_order_release);
  s.done_word.fetch_add(1, std::memory_order_release);
  // Pairs with ShmConnection::end_polling: a waiter that is polling picks the answer up itself,
  // and one that stops polling re-reads `done` after its fence, so skipping the wake loses nothing.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  // A waiter asleep on waiter_word completes the answer itself (ShmConnection::sleep_for_answers),
  // so the helper is woken only if nobody waits that way or it has pulls parked on the clock.
  const bool waiter = wake_waiter_word(s);
  if (s.client_sleeping.load() && s.client_polling.load() == 0 && (!waiter || s.waits_on_clock.load()))
    futex_wake_all(&s.done_word);
}

void ShmServer::wake_clock_waiters() {
  for (std::uint32_t i = 0; i < geo_.clients; ++i) {
    ClientArea& s = segment_->area(i);
    if (s.owner_pid.load(std::memory_order_relaxed) && s.waits_on_clock.load(std::memory_order_relaxed)) {
      s.done_word.fetch_add(1, std::memory_order_release);
      futex_wake_all(&s.done_word);
    }
  }
}

void ShmServer::answer(std::uint32_t i, RingEntry& e, Errc status, const std::string& text) {
  e.status = static_cast<std::uint32_t>(status);
  // The entry's offsets come from the client: write the text only inside its own data area, as
  // the server laid it out.
  const std::uint64_t area = geo_.area_bytes, offset = e.data_offset, room = e.data_bytes;
  const std::size_t n = offset <= area && room <= area - offset ? std::min<std::size_t>(text.size(), room) : 0;
  if (n) std::memcpy(segment_->area_data(i) + offset, text.data(), n);
  e.text_len = static_cast<std::uint32_t>(n);
}

bool ShmServer::process(std::uint32_t i, RingEntry& e, std::uint64_t seq) {
  ClientArea& client = segment_->area(i);
  e.reply_arg0 = 0;
  thread_local std::vector<wire::KeyEntry> keys;
  const float* payload = nullptr;
  std::string why;
  wire::Op op = wire::Op::hello;
  // The client can rewrite its entry under us: its words are read once, checked, and then only
  // the checked copies (payload, data_bytes) are used.
  std::uint64_t data_bytes = 0;
  const std::uint32_t table = e.table;
  Errc status = decode_entry(e, segment_->area_data(i), geo_.area_bytes, &keys, &payload, &op, &why, &data_bytes);
  if (status != Errc::ok)
    log::warn("shm.bad-entry", who(i) + ": ring entry " + std::to_string(seq) + " refused: " + why);
  const std::uint32_t worker = client.worker_id;
  const std::uint64_t arg0 = e.arg0;
  // Nothing a client sends may end the process or this thread: a failure to get memory while
  // serving it (the system can refuse past every budget) is that request's error.
  if (status == Errc::ok) {
    try {
      switch (op) {
        case wire::Op::init:
          status = engine_->init(keys, payload, &why);
          break;
        case wire::Op::push: {
          const std::uint32_t t = i % options_.threads;
          const UndoLog undo{server_thread_owner_tag(t),
                             &segment_->header().server_undo[t],
                             segment_->server_undo_buffer(t),
                             geo_.server_undo_bytes / sizeof(float),
                             lock_patience(),
                             options_.sync ? options_.sync->mark(t) : nullptr};
          status = engine_->push(worker, arg0, keys, payload, &why, geo_.server_undo_bytes ? &undo : nullptr);
          break;
        }
        case wire::Op::clock:
          status = engine_->check_worker(worker, &why);
          if (status == Errc::ok) {
            e.reply_arg0 = engine_->advance_clock(worker, arg0);
            wake_clock_waiters();
          }
          break;
        case wire::Op::barrier:
          status = engine_->check_worker(worker, &why);
          if (status == Errc::ok) {
            auto parked = std::make_unique<AreaParked>(*this, i, seq);
            blocked_[i].store(true, std::memory_order_release);
            try {
              engine_->barrier(worker, arg0, std::move(parked));
            } catch (...) {
              // Thrown before the arrival was stored (shm servers replicate nothing), so nothing
              // will resume it: the area is served again, and the catch below answers the entry.
              blocked_[i].store(false, std::memory_order_release);
              throw;
            }
            return false;
          }
          break;
        case wire::Op::stats:
          why = engine_->stats_json(worker_pushes(), stats_fields());
          break;
        case wire::Op::table_create: {
          TableSpec spec;
          std::uint32_t id = 0;
          if ((status = wire::decode_table_create(keys, payload, &id, &spec, &why)) == Errc::ok)
            status = engine_->create_table(id, spec, &why);
          break;
        }
        case wire::Op::table_push: {
          // A retrying client's identity matters only to replicated (tcp) servers.
          std::span<const wire::KeyEntry> rows = keys;
          wire::take_table_push_identity(&rows);
          status = engine_->table_push(table, arg0, rows, payload, &why);
          break;
        }
        case wire::Op::table_pull: {
          // The rows go into the entry's own data, after its key table (where `payload` points):
          // sized by the client, checked here against the bounds decode_entry checked.
          std::uint64_t floats = 0;
          for (const wire::KeyEntry& k : keys) floats += k.length;
          const std::uint64_t key_bytes = keys.size() * sizeof(wire::KeyEntry);
          if (floats > (data_bytes - key_bytes) / sizeof(float)) {  // decode_entry: key_bytes <= data_bytes
            status = Errc::protocol;
            why = "table_pull's entry leaves no room for its rows";
            break;
          }
          status = engine_->table_pull(table, keys, const_cast<float*>(payload), &why);
          break;
        }
        default:
          status = Errc::protocol;
          why =
              "op " + std::string(wire::op_name(static_cast<std::uint16_t>(op))) + " is not carried over shared memory";
      }
    } catch (const Error& x) {
      status = x.code();
      why = x.what();
    } catch (const std::exception& x) {
      status = Errc::capacity;
      why = std::string("serving it failed: ") + x.what();
    }
  }
  if (status != Errc::ok && op != wire::Op::stats)
    log::info("shm.refused", who(i) + ": " + std::string(wire::op_name(static_cast<std::uint16_t>(op))) + " refused (" +
                                 std::string(errc_name(status)) + "): " + why);
  answer(i, e, status, why);
  return true;
}

std::string ShmServer::who(std::uint32_t i) {
  return "client area " + std::to_string(i) + " (pid " +
         std::to_string(segment_->area(i).owner_pid.load(std::memory_order_relaxed)) + ")";
}

bool ShmServer::drain(std::uint32_t i) {
  ClientArea& s = segment_->area(i);
  bool progressed = false;
  // At most one ring's worth per visit, so a client that keeps its ring full (or forges `head`)
  // shares the thread with the other areas instead of holding it.
  for (std::uint32_t n = 0; n < kRingEntries && !blocked_[i].load(std::memory_order_acquire); ++n) {
    const std::uint64_t done = s.done.load(std::memory_order_relaxed);
    const std::uint64_t head = s.head.load(std::memory_order_acquire);
    if (done >= head) break;
    if (head - done > kRingEntries) {
      // A client never publishes more than its ring holds: this one's words are garbage. Its
      // requests are not read again until the area changes hands (the watchdog frees it).
      const std::int32_t pid = s.owner_pid.load(std::memory_order_relaxed);
      ignored_[i].store(pid == 0 ? kClaimingArea : pid, std::memory_order_relaxed);
      log::warn("shm.bad-ring", who(i) + ": published request " + std::to_string(head) + " with " +
                                    std::to_string(done) + " answered, more than its ring's " +
                                    std::to_string(kRingEntries) +
                                    " entries; its ring is ignored until the area is released");
      break;
    }
    const std::uint64_t seq = done + 1;
    RingEntry& e = s.ring[seq % kRingEntries];
    progressed = true;
    if (!process(i, e, seq)) break;  // parked; its resume() publishes
    publish(i, seq);
  }
  return progressed;
}

void ShmServer::serve(std::uint32_t t) {
  auto& h = segment_->header();
  const std::uint32_t areas = geo_.clients;
  auto served = [&](std::uint32_t i) {
    const std::int32_t pid = segment_->area(i).owner_pid.load(std::memory_order_relaxed);
    return pid != 0 && pid != ignored_[i].load(std::memory_order_relaxed);
  };
  while (!stopping_.load(std::memory_order_relaxed)) {
    bool progressed = false;
    for (std::uint32_t i = t; i < areas; i += options_.threads)
      if (served(i)) progressed |= drain(i);
    if (progressed) continue;
    // Idle: spin briefly for the next request, then sleep on the doorbell. A client bumps the
    // doorbell after publishing, so a bump between our read and the wait cancels the sleep.
    const std::uint32_t word = h.doorbell[t].load(std::memory_order_acquire);
    bool any = false;
    for (int spin = 0; spin < 200 && !any; ++spin) {
      cpu_relax();
      for (std::uint32_t i = t; i < areas && !any; i += options_.threads) {
        ClientArea& s = segment_->area(i);
        any = served(i) && !blocked_[i].load(std::memory_order_relaxed) &&
              s.done.load(std::memory_order_relaxed) < s.head.load(std::memory_order_acquire);
      }
    }
    if (any) continue;
    h.server_sleeping[t].store(1);
    futex_wait(&h.doorbell[t], word, std::chrono::milliseconds(500));
    h.server_sleeping[t].store(0);
  }
}

void ShmServer::release_dead_owner(std::uint32_t i, pid_t pid) {
  ClientArea& s = segment_->area(i);
  auto& h = segment_->header();
  // A push it was applying itself is rolled back and its stripe lock released first: server
  // threads and other clients may be waiting on that lock. Then any other lock still tagged with
  // it: a corrupt or hostile client may have left more.
  const std::uint32_t tag = area_owner_tag(i);
  const Store::Recovery r = engine_->store().recover(
      s.undo, tag, reinterpret_cast<const float*>(segment_->area_data(i)), geo_.area_bytes / sizeof(float));
  const std::uint32_t stray = engine_->store().release_locks_of(tag);
  if (r == Store::Recovery::rolled_back) h.recovered_pushes.fetch_add(1);
  if (r != Store::Recovery::nothing || stray)
    log::warn("shm.recover", "client area " + std::to_string(i) + " (pid " + std::to_string(pid) + ") died " +
                                 (r == Store::Recovery::rolled_back ? "inside a push: rolled it back"
                                  : r == Store::Recovery::released  ? "holding a stripe lock: released it"
                                                                    : "") +
                                 (stray ? (r != Store::Recovery::nothing ? "; " : "") + std::string("released ") +
                                              std::to_string(stray) + " more stripe locks it had left tagged"
                                        : ""));
  wake_thread(i);  // what it published is applied next
}

void ShmServer::watchdog() {
  auto& h = segment_->header();
  std::uint32_t last_change = engine_->clocks() ? engine_->clocks()->change_count() : 0;
  while (!watchdog_stop_.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    for (std::uint32_t i = 0; i < geo_.clients; ++i) {
      ClientArea& s = segment_->area(i);
      const pid_t pid = s.owner_pid.load(std::memory_order_acquire);
      const bool ignored = pid == ignored_[i].load(std::memory_order_relaxed);
      // A client that left while answers were still owed to it (ShmConnection's destructor):
      // nothing of it to recover, only the answers to give before the area is free.
      const bool leaving = pid == kLeavingArea;
      if (!leaving && (pid == 0 || (pid == kClaimingArea && !ignored) || process_alive(pid, s.owner_start))) continue;
      if (!leaving) release_dead_owner(i, pid);
      // Whatever it published is applied first (it was fully written before head moved), and a
      // parked barrier still answers into the area; then the area is freed for the next client.
      // A ring that was being ignored is not waited for.
      if (blocked_[i].load() || (!ignored && s.done.load() < s.head.load())) continue;
      ignored_[i].store(0, std::memory_order_relaxed);
      if (!leaving) {
        // A client killed while it spun never said so: return its share of the spinner count
        // (a share no larger than its threads could hold; the word is the client's to scribble).
        const std::uint32_t share = s.client_polling.exchange(0);
        if (share <= 1024) h.spinners.fetch_sub(share);
        const std::uint32_t worker = s.worker_id;
        if (worker != kNoWorker && engine_->clocks() && worker < engine_->clocks()->workers())
          engine_->worker_left(worker, engine_->clocks()->clock(worker) == kClockDone);
      }
      s.owner_pid.store(0);
    }
    // Evictions and clock moves made outside a ring request must reach parked pulls too.
    if (engine_->clocks()) {
      const std::uint32_t change = engine_->clocks()->change_count();
      if (change != last_change) {
        last_change = change;
        wake_clock_waiters();
      }
    }
  }
}

}  // namespace pskv::shm
