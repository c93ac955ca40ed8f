#include "server/replicator.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "common/log.h"
#include "transport/uri.h"

namespace pskv {

namespace {
// A request to a replica carries at most this many keys and bytes of records, well inside the
// replica's own limits (the same flags as this server's).
constexpr std::size_t kRequestKeys = 1u << 16;
constexpr std::uint64_t kTransferBytes = 16ull << 20;  // per request of a full transfer or rejoin
// A frame an empty TCP connection takes without blocking the writer, even one to a peer that
// stopped reading or whose link is cut: see Replica::inline_sends.
constexpr std::uint64_t kInlineBytes = 32u << 10;
// How often a keeper asks a synced replica whether it is still there.
constexpr auto kLookEvery = std::chrono::milliseconds(500);

std::shared_ptr<transport::Connection> connect_to(const ReplicaPeer& peer, const ReplicatorOptions& o,
                                                  std::chrono::milliseconds connect_timeout) {
  transport::ConnectOptions c;
  c.worker_id = wire::kServerPeer;  // the replication ops are only taken from servers
  c.connect_timeout = connect_timeout;
  c.io_timeout = o.io_timeout;
  c.max_in_flight = 1024;  // a full window blocks the io thread shipping into it (docs: "Replication")
  c.limits.max_payload_bytes = o.max_request_bytes;
  c.token = o.token;
  return std::shared_ptr<transport::Connection>(transport::connect(parse_uri(peer.uri), c));
}

// Waits for `c` however long its connection takes: the connection's io timeout bounds it. The
// waiting thread reads the answer itself through the connection's poller (otherwise the tcp
// connection's own reader picks it up only after 2 ms).
void wait_done(transport::Completion& c, transport::Connection* conn) {
  transport::Poller* poller = conn ? conn->poller() : nullptr;
  while (!c.wait(std::chrono::steady_clock::now() + std::chrono::seconds(1), poller)) {
  }
}

// Cuts [0, n) into runs of at most kRequestKeys keys and `max_bytes` of records (a single larger
// key gets a run of its own).
std::vector<std::pair<std::size_t, std::size_t>> cut(std::span<const KeyEntry> keys, std::uint64_t max_bytes) {
  std::vector<std::pair<std::size_t, std::size_t>> runs;
  std::size_t begin = 0;
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const std::uint64_t b = std::uint64_t{keys[i].length} * sizeof(float) + sizeof(KeyEntry);
    if (i > begin && (i - begin == kRequestKeys || bytes + b > max_bytes)) {
      runs.emplace_back(begin, i);
      begin = i;
      bytes = 0;
    }
    bytes += b;
  }
  if (begin < keys.size()) runs.emplace_back(begin, keys.size());
  return runs;
}
}  // namespace

TcpReplicator::TcpReplicator(ShardEngine& engine, const ReplicatorOptions& options)
    : engine_(engine), options_(options) {
  for (const ReplicaPeer& p : options_.replicas) {
    auto r = std::make_unique<Replica>();
    r->peer = p;
    replicas_.push_back(std::move(r));
  }
  for (auto& r : replicas_) {
    r->keeper = std::thread([this, rp = r.get()] { keeper(*rp); });
    r->sender = std::thread([this, rp = r.get()] { sender(*rp); });
  }
  acker_ = std::thread([this] { acker(); });
}

TcpReplicator::~TcpReplicator() {
  stop();
}

std::vector<std::pair<std::size_t, std::size_t>> TcpReplicator::snapshot(std::span<const KeyEntry> keys, Shipment* s) {
  s->keys.resize(keys.size());
  std::uint64_t floats = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    s->keys[i] = {keys[i].key, static_cast<std::uint32_t>(engine_.record_floats(keys[i].length)), 0};
    floats += s->keys[i].length;
  }
  if (s->capacity < floats) {
    s->records.reset(new float[floats]);  // uninitialised: read_records writes every float
    s->capacity = floats;
  }
  s->record_floats = floats;
  std::string why;
  if (engine_.read_records(options_.server_id, s->keys, s->records.get(), &why) != Errc::ok)
    throw Error(Errc::protocol, "reading the records to replicate: " + why);
  s->slices.resize(keys.size());
  float* at = s->records.get();
  for (std::size_t i = 0; i < keys.size(); ++i) {
    s->slices[i] = {s->keys[i].key, s->keys[i].length, at};
    at += s->keys[i].length;
  }
  return cut(s->keys, options_.max_request_bytes / 2);
}

void TcpReplicator::prepare(Shipment& s, Leg& leg, const std::vector<std::pair<std::size_t, std::size_t>>& ranges) {
  leg.requests.resize(ranges.empty() ? 1 : ranges.size());
  leg.done.reset(static_cast<std::uint32_t>(leg.requests.size()));
  leg.sent.store(false, std::memory_order_relaxed);
  // The ranges cover all of s's keys (cut()), or none: a transfer's start or end mark.
  leg.wire_bytes = leg.requests.size() * sizeof(wire::FrameHeader);
  if (!ranges.empty()) leg.wire_bytes += s.keys.size() * sizeof(wire::KeyEntry) + s.record_floats * sizeof(float);
  for (std::size_t i = 0; i < leg.requests.size(); ++i) {
    transport::Request& q = leg.requests[i];
    q = transport::Request{};
    q.op = s.op;
    q.arg0 = s.arg0;
    q.arg1 = s.arg1;
    if (!ranges.empty())
      q.keys =
          std::span<const transport::KeySlice>(s.slices).subspan(ranges[i].first, ranges[i].second - ranges[i].first);
    q.completion = &leg.done;
  }
}

void TcpReplicator::send(Leg& leg) noexcept {
  // The leg stays alive until its sender says so (Leg::sent), or, on the keeper's own transfers,
  // until this returns.
  for (std::size_t i = 0; i < leg.requests.size(); ++i) {
    try {
      leg.conn->submit(leg.requests[i]);
    } catch (const std::exception& e) {
      for (std::size_t j = i; j < leg.requests.size(); ++j) leg.done.complete_part(Errc::peer_failure, e.what());
      return;
    }
  }
}

void TcpReplicator::let_inline_sends_go_first(Replica& r) {
  // The caller's bytes are counted already, so no inline send starts after this; one that
  // started before is a single small frame into an empty connection.
  while (r.inline_sends.load() != 0) std::this_thread::yield();
}

void TcpReplicator::send_and_wait(Replica& r, Leg& leg) {
  r.unanswered_bytes.fetch_add(leg.wire_bytes);
  let_inline_sends_go_first(r);
  send(leg);
  wait_done(leg.done, leg.conn.get());
  r.unanswered_bytes.fetch_sub(leg.wire_bytes);
}

void TcpReplicator::sender(Replica& r) {
  for (;;) {
    Leg* leg;
    {
      std::unique_lock lock(r.out_mu);
      r.out_cv.wait(lock, [&] { return !r.outbox.empty() || senders_stop_.load(); });
      if (r.outbox.empty()) return;
      leg = r.outbox.front();
      r.outbox.pop_front();
    }
    let_inline_sends_go_first(r);
    send(*leg);
    leg->sent.store(true, std::memory_order_release);  // the last access: the acker may free it now
  }
}

std::unique_ptr<TcpReplicator::Shipment> TcpReplicator::take_shipment() {
  {
    std::lock_guard lock(pool_mu_);
    if (!pool_.empty()) {
      auto s = std::move(pool_.back());
      pool_.pop_back();
      return s;
    }
  }
  return std::make_unique<Shipment>();
}

void TcpReplicator::give_back(std::unique_ptr<Shipment> s) {
  reserved_bytes_.fetch_sub(std::exchange(s->reserved, 0), std::memory_order_relaxed);
  constexpr std::size_t kPooled = 8;
  constexpr std::uint64_t kPooledFloats = 16ull << 20;  // 64 MiB: larger buffers go back to the system
  s->legs.clear();
  s->reply.reset();
  if (s->capacity > kPooledFloats) return;
  std::lock_guard lock(pool_mu_);
  if (pool_.size() < kPooled) pool_.push_back(std::move(s));
}

std::uint64_t TcpReplicator::record_bytes(std::span<const KeyEntry> keys) const noexcept {
  std::uint64_t bytes = 0;
  for (const KeyEntry& k : keys) bytes += engine_.record_floats(k.length) * sizeof(float);
  return bytes;
}

Errc TcpReplicator::reserve(std::span<const KeyEntry> keys, bool creating, std::string* why) {
  // A key whose record could not cross to a replica in one request is refused before it exists.
  if (creating)
    for (const KeyEntry& k : keys)
      if (engine_.record_floats(k.length) * sizeof(float) > options_.max_request_bytes / 2) {
        *why = "key " + std::to_string(k.key) + " of " + std::to_string(k.length) +
               " floats is too large to replicate with --max-request-mb " +
               std::to_string(options_.max_request_bytes >> 20) +
               " (its record, with optimizer state, must fit half of it); raise it or lower the client's "
               "chunk_floats";
        return Errc::capacity;
      }
  const std::uint64_t bytes = record_bytes(keys);
  std::uint64_t now = reserved_bytes_.load(std::memory_order_relaxed);
  do {
    // One request alone is always let through (it fits a request, checked at init).
    if (now != 0 && now + bytes > options_.max_in_flight_bytes) {
      *why =
          "the replicas are behind: the records in flight to them would pass half of --memory-budget-mb; nothing "
          "of this request was applied, send it again";
      return Errc::capacity;
    }
  } while (!reserved_bytes_.compare_exchange_weak(now, now + bytes, std::memory_order_relaxed));
  return Errc::ok;
}

void TcpReplicator::release(std::span<const KeyEntry> keys) {
  reserved_bytes_.fetch_sub(record_bytes(keys), std::memory_order_relaxed);
}

void TcpReplicator::ship(std::span<const KeyEntry> keys, std::unique_ptr<Parked> reply) {
  if (stopping_.load()) {
    // After stop() (a connection closed by the listener's close): nothing waits for acks any more.
    release(keys);
    if (reply) reply->resume(Errc::peer_failure, "the server is stopping");
    return;
  }
  auto s = take_shipment();
  s->reply = std::move(reply);
  s->op = wire::Op::replicate;
  s->arg0 = options_.server_id;
  s->arg1 = 0;
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  try {
    ranges = snapshot(keys, s.get());
    s->reserved = s->record_floats * sizeof(float);  // what reserve() took for these keys
  } catch (const Error& e) {
    s->reserved = record_bytes(keys);
    if (s->reply) s->reply->resume(Errc::protocol, std::string("applied here, but not replicated: ") + e.what());
    give_back(std::move(s));
    return;
  }
  dispatch(std::move(s), ranges);
}

void TcpReplicator::ship_clock(std::uint32_t worker, std::uint64_t clock, std::unique_ptr<Parked> reply) {
  ship_worker_word(wire::Op::replica_clock, worker, clock, std::move(reply));
}

void TcpReplicator::ship_barrier(std::uint32_t worker, std::uint64_t generation, std::unique_ptr<Parked> reply) {
  ship_worker_word(wire::Op::replica_barrier, worker, generation, std::move(reply));
}

void TcpReplicator::ship_eviction(std::uint32_t worker) {
  ship_worker_word(wire::Op::replica_evict, worker, 1, nullptr);
}

void TcpReplicator::ship_worker_word(wire::Op op, std::uint32_t worker, std::uint64_t value,
                                     std::unique_ptr<Parked> reply) {
  if (stopping_.load()) {
    if (reply) reply->resume(Errc::peer_failure, "the server is stopping");
    return;
  }
  auto s = take_shipment();
  s->reply = std::move(reply);
  s->op = op;
  s->arg0 = wire::replica_clock_arg0(options_.server_id, worker);
  s->arg1 = wire::worker_word_arg1(value);
  s->keys.clear();
  s->slices.clear();
  s->record_floats = 0;
  dispatch(std::move(s), {});
}

void TcpReplicator::dispatch(std::unique_ptr<Shipment> s,
                             const std::vector<std::pair<std::size_t, std::size_t>>& ranges) {
  const std::uint64_t bytes = s->record_floats * sizeof(float);
  for (auto& r : replicas_) {
    std::shared_ptr<transport::Connection> conn;
    int state;
    {
      std::lock_guard lock(r->mu);
      conn = r->conn;
      state = r->state.load(std::memory_order_acquire);
    }
    if (state == static_cast<int>(State::down)) continue;
    Leg& leg = s->legs.emplace_back();
    leg.replica = r.get();
    if (!conn) continue;  // pending: its full transfer will carry these keys
    leg.conn = std::move(conn);
    prepare(*s, leg, ranges);
    r->shipped_bytes.fetch_add(bytes, std::memory_order_relaxed);
    // Inline only into a connection with nothing unanswered, and never behind another thread's
    // frame: see Replica::inline_sends.
    r->inline_sends.fetch_add(1);
    const bool inline_send = r->unanswered_bytes.fetch_add(leg.wire_bytes) == 0 && leg.wire_bytes <= kInlineBytes;
    if (inline_send) send(leg);
    r->inline_sends.fetch_sub(1);
    if (inline_send) {
      leg.sent.store(true, std::memory_order_release);
      continue;
    }
    {
      std::lock_guard lock(r->out_mu);
      r->outbox.push_back(&leg);
    }
    r->out_cv.notify_one();
  }
  if (s->legs.empty()) {
    if (s->reply) s->reply->resume(Errc::ok, {});
    give_back(std::move(s));
    return;
  }
  {
    std::lock_guard lock(queue_mu_);
    queue_.push_back(std::move(s));
  }
  queue_cv_.notify_one();
}

void TcpReplicator::drop(Replica& r, const transport::Connection* conn, const std::string& why) {
  std::lock_guard lock(r.mu);
  // A late failure of a connection already replaced says nothing about the current one.
  if (r.state.load() == static_cast<int>(State::down) || (conn && r.conn.get() != conn)) return;
  r.state.store(static_cast<int>(State::down), std::memory_order_release);
  r.conn.reset();
  r.failures.fetch_add(1, std::memory_order_relaxed);
  log::warn("replication", "server " + std::to_string(options_.server_id) + ": replica server " +
                               std::to_string(r.peer.id) + " (" + r.peer.uri + ") dropped: " + why +
                               "; acknowledging without it until it is back and synced");
}

void TcpReplicator::acker() {
  for (;;) {
    std::unique_ptr<Shipment> s;
    {
      std::unique_lock lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return !queue_.empty() || stopping_.load(); });
      if (queue_.empty()) return;
      s = std::move(queue_.front());
      queue_.pop_front();
    }
    // Replicas answer in order, so waiting for the oldest shipment first costs nothing.
    for (Leg& leg : s->legs) {
      if (!leg.conn) {
        // A pending replica: until its first full transfer is complete, or it is declared down.
        // (Had it gone down and come back meanwhile, its new transfer carries these keys too.)
        int state;
        while ((state = leg.replica->state.load(std::memory_order_acquire)) != static_cast<int>(State::synced) &&
               state != static_cast<int>(State::down) && !stopping_.load())
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        continue;
      }
      wait_done(leg.done, leg.conn.get());
      while (!leg.sent.load(std::memory_order_acquire)) std::this_thread::yield();
      leg.replica->unanswered_bytes.fetch_sub(leg.wire_bytes);
      if (leg.done.status() != Errc::ok) drop(*leg.replica, leg.conn.get(), leg.done.message());
    }
    // Every live replica holds the keys; one that failed is no longer live. (A stop cut short
    // the wait for a pending one: not acknowledged.)
    bool cut_short = false;
    for (const Leg& leg : s->legs)
      cut_short |= !leg.conn && leg.replica->state.load() != static_cast<int>(State::synced) &&
                   leg.replica->state.load() != static_cast<int>(State::down);
    if (!s->reply) {
    } else if (cut_short) {
      s->reply->resume(Errc::peer_failure, "the server stopped before its replicas held this update");
    } else {
      s->reply->resume(Errc::ok, {});
    }
    give_back(std::move(s));
  }
}

bool TcpReplicator::keeper_send(Replica& r, const std::shared_ptr<transport::Connection>& conn, Leg& leg) {
  leg.replica = &r;
  leg.conn = conn;
  send_and_wait(r, leg);
  if (leg.done.status() == Errc::ok) return true;
  drop(r, conn.get(), leg.done.message());
  return false;
}

void TcpReplicator::headers_only(Leg& leg, std::size_t requests) {
  leg.requests.assign(requests, transport::Request{});
  leg.done.reset(static_cast<std::uint32_t>(requests));
  leg.wire_bytes = requests * sizeof(wire::FrameHeader);
  for (transport::Request& q : leg.requests) q.completion = &leg.done;
}

bool TcpReplicator::full_transfer(Replica& r, const std::shared_ptr<transport::Connection>& conn) {
  auto mark = [&](std::uint32_t arg1) {
    Shipment s;
    s.arg0 = options_.server_id;
    s.arg1 = arg1;
    Leg& leg = s.legs.emplace_back();
    prepare(s, leg, {});
    return keeper_send(r, conn, leg);
  };
  if (!mark(wire::kReplicaSyncing)) return false;
  // Every worker's clock here, read before the keys: a clock is entered after its step's pushes
  // are applied, so the snapshots below hold them, and the replica never knows a clock without
  // its step. (Those shipped meanwhile may overtake these: the replica keeps the highest.)
  std::string why;
  std::array<std::vector<std::uint64_t>, kWorkerWords> words;
  for (std::size_t k = 0; k < kWorkerWords; ++k)
    engine_.replica_words(static_cast<WorkerWord>(k), options_.server_id, &words[k], &why);
  std::vector<std::pair<Key, std::uint32_t>> keys;
  bool synced = false;
  engine_.replica_keys(options_.server_id, &keys, &synced, &why);
  std::vector<KeyEntry> entries;
  for (std::size_t begin = 0; begin < keys.size() && !stopping_.load();) {
    entries.clear();
    std::uint64_t bytes = 0;
    for (; begin < keys.size() && entries.size() < kRequestKeys; ++begin) {
      const std::uint64_t b = engine_.record_floats(keys[begin].second) * sizeof(float);
      if (!entries.empty() && bytes + b > kTransferBytes) break;
      entries.push_back({keys[begin].first, keys[begin].second, 0});
      bytes += b;
    }
    Shipment s;
    s.arg0 = options_.server_id;
    const auto ranges = snapshot(entries, &s);
    Leg& leg = s.legs.emplace_back();
    prepare(s, leg, ranges);
    if (!keeper_send(r, conn, leg)) return false;
  }
  // Then the clocks, barrier generations and evictions, which a rejoining origin takes back with
  // its keys.
  for (std::size_t k = 0; k < kWorkerWords; ++k)
    if (!send_worker_words(r, conn, wire::kWorkerWordOps[k], words[k])) return false;
  if (stopping_.load() || !mark(wire::kReplicaSynced)) return false;
  r.transfers.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool TcpReplicator::send_worker_words(Replica& r, const std::shared_ptr<transport::Connection>& conn, wire::Op op,
                                      const std::vector<std::uint64_t>& values) {
  if (values.empty()) return !stopping_.load();
  if (stopping_.load()) return false;
  Leg leg;
  headers_only(leg, values.size());
  for (std::uint32_t w = 0; w < values.size(); ++w) {
    leg.requests[w].op = op;
    leg.requests[w].arg0 = wire::replica_clock_arg0(options_.server_id, w);
    leg.requests[w].arg1 = wire::worker_word_arg1(values[w]);
  }
  return keeper_send(r, conn, leg);
}

bool TcpReplicator::still_there(Replica& r) {
  std::shared_ptr<transport::Connection> conn;
  {
    std::lock_guard lock(r.mu);
    conn = r.conn;
  }
  if (!conn) return true;  // dropped meanwhile: the keeper reconnects anyway
  Leg leg;
  headers_only(leg, 1);
  std::string stats;
  leg.requests[0].op = wire::Op::stats;
  leg.requests[0].text_out = &stats;
  return keeper_send(r, conn, leg);
}

void TcpReplicator::keeper(Replica& r) {
  bool said_unreachable = false;
  const auto started = std::chrono::steady_clock::now();
  auto last_look = started;
  while (!stopping_.load()) {
    if (r.state.load(std::memory_order_acquire) == static_cast<int>(State::pending) &&
        std::chrono::steady_clock::now() - started > options_.io_timeout) {
      int pending = static_cast<int>(State::pending);
      if (r.state.compare_exchange_strong(pending, static_cast<int>(State::down)))
        log::warn("replication", "server " + std::to_string(options_.server_id) + ": replica server " +
                                     std::to_string(r.peer.id) + " (" + r.peer.uri + ") unreachable for " +
                                     std::to_string(options_.io_timeout.count()) +
                                     " ms since this server started; acknowledging without it until it is synced");
    }
    const int now = r.state.load(std::memory_order_acquire);
    if (now != static_cast<int>(State::down) && now != static_cast<int>(State::pending)) {
      // Nothing reads an idle replica's connection, so without a look its death (and its
      // restart, empty of this server's keys) would go unnoticed until the next shipment.
      if (now == static_cast<int>(State::synced) && std::chrono::steady_clock::now() - last_look > kLookEvery) {
        last_look = std::chrono::steady_clock::now();
        if (!still_there(r)) continue;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    std::shared_ptr<transport::Connection> conn;
    try {
      conn = connect_to(r.peer, options_, std::chrono::milliseconds(1000));
    } catch (const Error& e) {
      if (!said_unreachable && r.state.load() == static_cast<int>(State::down))
        log::warn("replication", "server " + std::to_string(options_.server_id) + ": replica server " +
                                     std::to_string(r.peer.id) + " unreachable (" + e.what() + "); retrying");
      said_unreachable = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    said_unreachable = false;
    {
      // Live from here: shipments go to it while the transfer runs, so it misses nothing.
      std::lock_guard lock(r.mu);
      r.conn = conn;
      r.state.store(static_cast<int>(State::syncing), std::memory_order_release);
    }
    // A shipment that found it pending now waits for the transfer to be synced or fail (down).
    bool synced = false;
    try {
      synced = full_transfer(r, conn);
    } catch (const std::exception& e) {
      drop(r, conn.get(), std::string("full transfer failed: ") + e.what());
    }
    if (!synced) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));  // no tight loop on a replica that refuses
      continue;
    }
    int syncing = static_cast<int>(State::syncing);
    if (r.state.compare_exchange_strong(syncing, static_cast<int>(State::synced)))
      log::info("replication", "server " + std::to_string(options_.server_id) + ": replica server " +
                                   std::to_string(r.peer.id) + " synced");
  }
}

void TcpReplicator::stop() noexcept {
  if (stopped_) return;
  stopped_ = true;
  stopping_.store(true);
  queue_cv_.notify_all();
  if (acker_.joinable()) acker_.join();  // it finishes the queue first, the senders submitting for it
  senders_stop_.store(true);
  for (auto& r : replicas_) {
    {
      std::lock_guard lock(r->out_mu);  // a sender checks the flag under it: no lost wake-up
    }
    r->out_cv.notify_all();
    if (r->sender.joinable()) r->sender.join();
    if (r->keeper.joinable()) r->keeper.join();
  }
  std::lock_guard lock(queue_mu_);
  for (auto& s : queue_)
    if (s->reply) s->reply->resume(Errc::peer_failure, "the server is stopping");
  queue_.clear();
}

JsonObject TcpReplicator::stats() const {
  JsonObject j;
  j.add("replicas", replicas_.size() + 1)
      .add("replication_in_flight_bytes", reserved_bytes_.load(std::memory_order_relaxed));
  for (const auto& r : replicas_) {
    const std::string at = "replica_" + std::to_string(r->peer.id);
    const int state = r->state.load(std::memory_order_acquire);
    j.add(at + "_state", state == static_cast<int>(State::synced)    ? "synced"
                         : state == static_cast<int>(State::syncing) ? "syncing"
                         : state == static_cast<int>(State::pending) ? "pending"
                                                                     : "down")
        .add(at + "_shipped_bytes", r->shipped_bytes.load(std::memory_order_relaxed))
        .add(at + "_transfers", r->transfers.load(std::memory_order_relaxed))
        .add(at + "_failures", r->failures.load(std::memory_order_relaxed));
  }
  return j;
}

namespace {
// Takes every record of `peer`'s replica of this server into the engine's store (newest wins).
// Throws Error when the replica cannot be read or is not synced.
void take_replica(ShardEngine& engine, const ReplicaPeer& peer, const ReplicatorOptions& options,
                  RejoinReport* report) {
  auto conn = connect_to(peer, options, std::chrono::milliseconds(1000));
  std::string index;
  transport::Completion done;
  done.reset(1);
  transport::Request q;
  q.op = wire::Op::replica_index;
  q.arg0 = options.server_id;
  q.completion = &done;
  q.text_out = &index;
  conn->submit(q);
  wait_done(done, conn.get());
  if (done.status() != Errc::ok) throw Error(done.status(), done.message());
  wire::ReplicaIndexHeader head{};
  if (index.size() < sizeof head) throw Error(Errc::protocol, "a short replica index");
  std::memcpy(&head, index.data(), sizeof head);
  const std::uint32_t workers = engine.clocks() ? engine.clocks()->workers() : 0;
  if (head.workers != workers)
    throw Error(Errc::protocol, "its replica holds the clocks of " + std::to_string(head.workers) +
                                    " workers, this server runs with " + std::to_string(workers) +
                                    " (start every server with the same --workers)");
  // Each worker's clock, then each one's barrier generation, then whether it was evicted.
  const std::uint64_t clock_bytes = kWorkerWords * std::uint64_t{head.workers} * sizeof(std::uint64_t);
  if (index.size() - sizeof head < clock_bytes ||
      (index.size() - sizeof head - clock_bytes) % sizeof(wire::ReplicaIndexEntry) != 0 ||
      head.keys != (index.size() - sizeof head - clock_bytes) / sizeof(wire::ReplicaIndexEntry))
    throw Error(Errc::protocol, "a replica index whose size does not match its key and worker counts");
  if (!head.synced) throw Error(Errc::peer_failure, "its replica is not synced (it never received all keys)");
  std::vector<KeyEntry> keys(head.keys);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    wire::ReplicaIndexEntry e{};
    std::memcpy(&e, index.data() + sizeof head + i * sizeof e, sizeof e);
    const std::uint64_t floats = e.length ? engine.record_floats(static_cast<std::uint32_t>(e.length)) : 0;
    if (e.length == 0 || e.length > UINT32_MAX || floats * sizeof(float) > options.max_request_bytes)
      throw Error(Errc::protocol, "key " + std::to_string(e.key) + " has an impossible length");
    keys[i] = {e.key, static_cast<std::uint32_t>(floats), 0};
  }
  std::vector<float> records;
  std::vector<transport::KeySlice> slices;
  std::string why;
  for (const auto& [begin, end] : cut(keys, std::min(kTransferBytes, options.max_request_bytes / 2))) {
    std::uint64_t floats = 0;
    for (std::size_t i = begin; i < end; ++i) floats += keys[i].length;
    records.assign(floats, 0.0f);
    slices.clear();
    float* at = records.data();
    for (std::size_t i = begin; i < end; ++i) {
      slices.push_back({keys[i].key, keys[i].length, at});
      at += keys[i].length;
    }
    transport::Request pull;
    pull.op = wire::Op::replica_pull;
    pull.arg0 = options.server_id;
    pull.keys = slices;
    pull.completion = &done;
    done.reset(1);
    conn->submit(pull);
    wait_done(done, conn.get());
    if (done.status() != Errc::ok) throw Error(done.status(), done.message());
    const std::span<const KeyEntry> part(keys.data() + begin, end - begin);
    if (Errc e = engine.restore_records(part, records.data(), &why); e != Errc::ok) throw Error(e, why);
    report->keys += end - begin;
    report->bytes += floats * sizeof(float);
  }
  // Every clock this server acknowledged before it died (a clock is answered once its replicas
  // know it): a worker waiting here for another's clock would otherwise wait for a clock that
  // the other, having seen it answered, never sends again.
  // So is every barrier arrival it counted: a worker sending a barrier again here would otherwise
  // wait for workers that passed it.
  const char* clocks = index.data() + sizeof head + head.keys * sizeof(wire::ReplicaIndexEntry);
  for (std::uint32_t w = 0; w < head.workers; ++w) {
    std::uint64_t c = 0, generation = 0, evicted = 0;
    std::memcpy(&c, clocks + w * sizeof c, sizeof c);
    std::memcpy(&generation, clocks + (head.workers + w) * sizeof c, sizeof c);
    std::memcpy(&evicted, clocks + (2 * head.workers + w) * sizeof c, sizeof c);
    if (c > 0) engine.advance_clock(w, c);
    engine.restore_barrier(w, generation);
    if (evicted) engine.restore_eviction(w);
  }
}
}  // namespace

RejoinReport rejoin_from_replicas(ShardEngine& engine, const ReplicatorOptions& options,
                                  std::chrono::milliseconds patience) {
  const auto began = std::chrono::steady_clock::now();
  const auto give_up = began + patience;
  for (;;) {
    // Every reachable synced replica is read and the newest record of each key kept: a replica
    // this server dropped (a timeout) may still say synced while it missed what the others hold.
    RejoinReport report;
    std::string tried;
    for (const ReplicaPeer& peer : options.replicas) {
      try {
        take_replica(engine, peer, options, &report);
        report.from.push_back(peer.id);
      } catch (const Error& e) {
        tried +=
            (tried.empty() ? "" : "; ") + ("server " + std::to_string(peer.id) + " (" + peer.uri + "): " + e.what());
      }
    }
    if (!report.from.empty()) {
      report.milliseconds = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
      if (!tried.empty()) log::warn("replication", "--rejoin: not read: " + tried);
      return report;
    }
    if (std::chrono::steady_clock::now() > give_up)
      throw Error(Errc::peer_failure, "--rejoin: no replica of server " + std::to_string(options.server_id) +
                                          "'s keys is reachable and synced within " + std::to_string(patience.count()) +
                                          " ms (" + tried + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace pskv
