#include "server/replicator.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <utility>

#include "common/log.h"
#include "table/embedding_table.h"
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
constexpr auto kLongestConnect = std::chrono::milliseconds(4000);  // a keeper's connect, backed off
// How long a takeover waits for a replica it never reached, in io timeouts (certified_down).
constexpr int kTakeoverPatience = 10;

// `cancel`: see transport::ConnectOptions::cancel.
std::shared_ptr<transport::Connection> connect_to(const ReplicaPeer& peer, const ReplicatorOptions& o,
                                                  std::chrono::milliseconds connect_timeout,
                                                  const std::atomic<bool>* cancel = nullptr) {
  transport::ConnectOptions c;
  c.cancel = cancel;
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
    : engine_(engine), options_(options), table_position_(options.table_position) {
  for (const ReplicaPeer& p : options_.replicas) {
    auto r = std::make_unique<Replica>();
    r->peer = p;
    replicas_.push_back(std::move(r));
  }
}

void TcpReplicator::start() {
  if (acker_.joinable() || stopped_) return;
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
  return reserve_bytes(record_bytes(keys), why);
}

Errc TcpReplicator::reserve_bytes(std::uint64_t bytes, std::string* why) {
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
  release_bytes(record_bytes(keys));
}

void TcpReplicator::release_bytes(std::uint64_t bytes) {
  reserved_bytes_.fetch_sub(bytes, std::memory_order_relaxed);
}

void TcpReplicator::table_spec_shipment(std::uint32_t table, Shipment* s) {
  TableSpec requested;
  const EmbeddingTable* t = engine_.table_at(table, &requested);
  const std::vector<std::uint64_t> marks = engine_.table_marks(table);
  // The spec, the cap here (u64), then the push marks (u64 each).
  const auto floats = static_cast<std::uint32_t>(wire::kTableSpecFloats + 2 + 2 * marks.size());
  s->op = wire::Op::replica_table;
  s->arg1 = table;  // arg0 when it is queued
  if (s->capacity < floats) {
    s->records.reset(new float[floats]);
    s->capacity = floats;
  }
  wire::encode_table_spec(requested, s->records.get());
  const std::uint64_t cap = t->spec().max_rows;
  std::memcpy(s->records.get() + wire::kTableSpecFloats, &cap, sizeof cap);
  if (!marks.empty())
    std::memcpy(s->records.get() + wire::kTableSpecFloats + 2, marks.data(), marks.size() * sizeof(std::uint64_t));
  s->record_floats = floats;
  s->keys.assign(1, KeyEntry{table, floats, 0});
  s->slices.assign(1, transport::KeySlice{table, floats, s->records.get()});
}

void TcpReplicator::rows_shipment(std::uint32_t table, std::span<const Key> removed, std::span<const KeyEntry> ids,
                                  Shipment* s, std::vector<std::pair<std::size_t, std::size_t>>* ranges,
                                  const ShardEngine::RowsMark* marked) {
  const EmbeddingTable* t = engine_.table_at(table);
  const std::uint32_t dim = t->dim();
  const std::uint64_t floats = dim + t->state_floats_per_row();
  s->arg1 = table;  // arg0 when it is queued (dispatch_in_order)
  s->keys.clear();
  s->slices.clear();
  if (!removed.empty()) {
    // Nothing to read: the ids alone say those rows are gone.
    s->op = wire::Op::replica_unrows;
    s->record_floats = 0;
    for (const Key id : removed) {
      s->keys.push_back({id, 1, 0});
      s->slices.push_back({id, 1, nullptr});
    }
    *ranges = cut(s->keys, options_.max_request_bytes / 2);
    return;
  }
  missing_.clear();
  s->op = marked ? wire::Op::replica_rows_marked : wire::Op::replica_rows;
  const std::uint64_t need = ids.size() * floats + (marked ? 2 : 0);
  if (s->capacity < need) {
    s->records.reset(new float[need]);
    s->capacity = need;
  }
  float* at = s->records.get();
  if (marked) {
    std::memcpy(at, &marked->mark, sizeof marked->mark);
    s->keys.push_back({marked->worker, 2, 0});
    s->slices.push_back({marked->worker, 2, at});
    at += 2;
  }
  for (const KeyEntry& k : ids) {
    // An id with no row here: not admitted, no room, or evicted since the removals were taken.
    if (!t->read_record(k.key, at, at + dim)) {
      missing_.push_back(k.key);
      continue;
    }
    s->keys.push_back({k.key, static_cast<std::uint32_t>(floats), 0});
    s->slices.push_back({k.key, static_cast<std::uint32_t>(floats), at});
    at += floats;
  }
  s->record_floats = static_cast<std::uint64_t>(at - s->records.get());
  *ranges = cut(s->keys, options_.max_request_bytes / 2);
}

Errc TcpReplicator::create_table(std::uint32_t id, const TableSpec& spec, std::string* why,
                                 const std::function<std::unique_ptr<Parked>()>& park, bool* parked) {
  *parked = false;
  std::lock_guard lock(table_order_mu_);
  bool created = false;
  const Errc e = engine_.create_table(id, spec, why, &created);
  if (e != Errc::ok) return e;
  auto s = take_shipment();
  s->reply = park();
  *parked = true;
  if (stopping_.load()) {
    s->reply->resume(Errc::peer_failure, "the server is stopping");
    give_back(std::move(s));
    return Errc::ok;
  }
  if (created) {
    table_spec_shipment(id, s.get());
    dispatch_in_order(std::move(s), {{0, 1}});
    return Errc::ok;
  }
  // Made already, by another create whose spec may still be on its way to the replicas (the
  // workers of a job create their tables at once). Answered behind it, as the acker answers in
  // queue order: answered at once, its worker pushed rows that a takeover built from a replica
  // without the table refused. Not shipped again: a replica's copy would lose its rows.
  queue_for_acker(std::move(s));
  return Errc::ok;
}

void TcpReplicator::queue_for_acker(std::unique_ptr<Shipment> s) {
  {
    std::lock_guard lock(queue_mu_);
    queue_.push_back(std::move(s));
  }
  queue_cv_.notify_one();
}

void TcpReplicator::dispatch_in_order(std::unique_ptr<Shipment> s,
                                      const std::vector<std::pair<std::size_t, std::size_t>>& ranges) {
  s->arg0 = wire::replica_table_arg0(options_.server_id, ++table_position_);
  dispatch(std::move(s), ranges);
}

std::unique_ptr<TcpReplicator::Shipment> TcpReplicator::read_pushed_rows(
    std::uint32_t table, std::span<const KeyEntry> ids, std::uint64_t reserved, const ShardEngine::RowsMark* marked,
    std::unique_ptr<TcpReplicator::Shipment>* gone, std::vector<std::pair<std::size_t, std::size_t>>* ranges,
    std::vector<std::pair<std::size_t, std::size_t>>* gone_ranges) {
  std::unique_ptr<Shipment> s;
  try {
    s = take_shipment();
  } catch (...) {
    release_bytes(reserved);
    throw;
  }
  s->reserved = reserved;
  try {
    ship_removals(table);
    rows_shipment(table, {}, ids, s.get(), ranges, marked);
    // A row pushed here and evicted since by another push is not in the frame; its removal
    // goes before it, not with the next shipment, so no copy keeps the row as it was before.
    if (!missing_.empty()) {
      *gone = take_shipment();
      rows_shipment(table, missing_, {}, gone->get(), gone_ranges);
    }
  } catch (...) {
    give_back(std::move(s));  // and with it the reserved room
    throw;
  }
  return s;
}

void TcpReplicator::ship_rows(std::uint32_t table, std::span<const KeyEntry> ids, std::uint64_t reserved,
                              std::unique_ptr<Parked> reply) {
  if (stopping_.load()) {
    release_bytes(reserved);
    if (reply) reply->resume(Errc::peer_failure, "the server is stopping");
    return;
  }
  std::vector<std::pair<std::size_t, std::size_t>> ranges, gone_ranges;
  std::unique_ptr<Shipment> s, gone;
  std::lock_guard lock(table_order_mu_);
  try {
    s = read_pushed_rows(table, ids, reserved, nullptr, &gone, &ranges, &gone_ranges);
  } catch (const std::exception& e) {
    if (reply) reply->resume(Errc::capacity, std::string("applied here, but not replicated: ") + e.what());
    return;
  }
  s->reply = std::move(reply);
  if (gone) dispatch_in_order(std::move(gone), gone_ranges);
  if (s->keys.empty()) {
    if (s->reply) answer_held(*s->reply);  // nothing of it is held anywhere
    give_back(std::move(s));
    return;
  }
  dispatch_in_order(std::move(s), ranges);
}

void TcpReplicator::ship_removals(std::uint32_t table) {
  // The rows the table lost since the last shipment go first: a row read after may have taken
  // the place of one of them, and a copy should not hold both for longer than it must.
  engine_.table_at(table)->take_removals(&removed_);
  if (removed_.empty()) return;
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  auto gone = take_shipment();
  rows_shipment(table, removed_, {}, gone.get(), &ranges);
  dispatch_in_order(std::move(gone), ranges);
}

Errc TcpReplicator::push_rows_in_order(std::uint32_t table, std::uint32_t worker, std::span<const KeyEntry> ids,
                                       std::uint64_t reserved, const std::function<Errc()>& apply,
                                       const std::function<std::unique_ptr<Parked>()>& park, std::string* why,
                                       bool* parked) {
  *parked = false;
  // Rows and mark must reach a replica in one frame, whatever cut() would make of them. Its keys
  // are as many as the push's own frame had (the mark in place of the identity), which this
  // server took, and the servers of a ring share their limits; its records may be larger.
  const std::uint64_t frame_bytes =
      (ids.size() + 1) * sizeof(KeyEntry) + (ids.size() * engine_.table_record_floats(table) + 2) * sizeof(float);
  if (frame_bytes > options_.max_request_bytes / 2) {
    *why = "a retrying client's table push of " + std::to_string(ids.size()) + " rows ships " +
           std::to_string(frame_bytes >> 20) + " MiB of records to the replicas in one frame, past half of " +
           std::to_string(options_.max_request_bytes >> 20) + " MiB (--max-request-mb): push fewer rows at once";
    return Errc::capacity;
  }
  std::lock_guard lock(table_order_mu_);
  if (Errc e = apply(); e != Errc::ok) return e;
  const ShardEngine::RowsMark marked{worker, engine_.table_mark(table, worker)};
  std::vector<std::pair<std::size_t, std::size_t>> ranges, gone_ranges;
  std::unique_ptr<Shipment> s, gone;
  std::string failed;
  try {
    s = read_pushed_rows(table, ids, reserved, &marked, &gone, &ranges, &gone_ranges);
  } catch (const std::exception& e) {
    // Applied, not shipped: the answer is a failure, and the connection closes on it
    // (wire::applied_before_replicated), so the client sends the push again and finds it marked.
    failed = std::string("applied here, but not replicated: ") + e.what();
  }
  auto reply = park();
  *parked = true;
  if (!s || stopping_.load()) {
    reply->resume(s ? Errc::peer_failure : Errc::capacity, s ? "the server is stopping" : failed);
    if (s) give_back(std::move(s));  // and with it the reserved room
    return Errc::ok;
  }
  s->reply = std::move(reply);
  if (gone) dispatch_in_order(std::move(gone), gone_ranges);
  ranges.assign(1, {0, s->keys.size()});
  dispatch_in_order(std::move(s), ranges);
  return Errc::ok;
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
  // A deposed origin ships nothing more: its replicas now take the keys' new holder's frames.
  for (auto& r : deposed_.load() ? std::span<std::unique_ptr<Replica>>() : std::span(replicas_)) {
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
    if (s->reply) answer_held(*s->reply);
    give_back(std::move(s));
    return;
  }
  queue_for_acker(std::move(s));
}

void TcpReplicator::depose() noexcept {
  deposed_.store(true);
}

void TcpReplicator::answer_held(Parked& reply) const {
  if (deposed_.load())
    reply.resume(Errc::peer_failure, "this server was certified down: another server holds its keys now");
  else
    reply.resume(Errc::ok, {});
}

void TcpReplicator::drop(Replica& r, const transport::Connection* conn, const std::string& why) {
  if (options_.may_drop) {
    // A replica this server reached may hold a synced copy of its keys, and could serve them if
    // its own successor took it for dead too: dropped only once a majority certified it down.
    std::uint32_t incarnation = 0;
    bool reached = false;
    {
      std::lock_guard lock(r.mu);
      const int state = r.state.load();
      if (state == static_cast<int>(State::down) || (conn && r.conn.get() != conn)) return;
      reached = state != static_cast<int>(State::pending) && r.conn;
      if (reached) incarnation = r.conn->info().incarnation;
    }
    if (reached && !options_.may_drop(r.peer.id, incarnation, why)) deposed_.store(true);
  }
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
      answer_held(*s->reply);
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
    // The syncing mark names this incarnation: a rejoin prefers its copies to a stale one's.
    s.arg0 = options_.server_id | (arg1 == wire::kReplicaSyncing ? std::uint64_t{engine_.epoch_seconds()} << 32 : 0);
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
  if (!transfer_tables(r, conn)) return false;
  // Then the clocks, barrier generations and evictions, which a rejoining origin takes back with
  // its keys.
  for (std::size_t k = 0; k < kWorkerWords; ++k)
    if (!send_worker_words(r, conn, wire::kWorkerWordOps[k], words[k])) return false;
  if (stopping_.load() || !mark(wire::kReplicaSynced)) return false;
  r.transfers.fetch_add(1, std::memory_order_relaxed);
  return true;
}

bool TcpReplicator::send_in_order(Replica& r, const std::shared_ptr<transport::Connection>& conn, Shipment& s,
                                  const std::vector<std::pair<std::size_t, std::size_t>>& ranges) {
  Leg& leg = s.legs.emplace_back();
  leg.replica = &r;
  leg.conn = conn;
  prepare(s, leg, ranges);
  r.unanswered_bytes.fetch_add(leg.wire_bytes);
  {
    // Under out_mu, as the sender looks at the flag: a leg queued after it stopped would wait forever.
    std::lock_guard lock(r.out_mu);
    if (senders_stop_.load()) {
      r.unanswered_bytes.fetch_sub(leg.wire_bytes);
      return false;
    }
    r.outbox.push_back(&leg);
  }
  r.out_cv.notify_one();
  return true;
}

bool TcpReplicator::transfer_tables(Replica& r, const std::shared_ptr<transport::Connection>& conn) {
  // Rows per request: small enough that reading them under the order lock holds up the pushes'
  // shipments for well under a millisecond.
  constexpr std::uint32_t kRowsPerRequest = 2048;
  std::deque<Shipment> sent;
  bool ok = true;
  // Waits for the oldest legs (all of them with `all`, or once one failed: every leg queued must
  // be answered or failed before its shipment goes, since the sender and the connection hold it).
  auto settle = [&](bool all) {
    while (!sent.empty() && (all || !ok || sent.size() > 4)) {
      Leg& leg = sent.front().legs.front();
      wait_done(leg.done, leg.conn.get());
      while (!leg.sent.load(std::memory_order_acquire)) std::this_thread::yield();
      r.unanswered_bytes.fetch_sub(leg.wire_bytes);
      if (leg.done.status() != Errc::ok && ok) {
        drop(r, conn.get(), leg.done.message());
        ok = false;
      }
      sent.pop_front();
    }
    return ok;
  };
  for (std::uint32_t id = 0; id < kMaxTables && ok; ++id) {
    EmbeddingTable* t = engine_.table_at(id);
    if (!t) continue;
    const std::uint32_t dim = t->dim();
    const std::uint64_t floats = dim + t->state_floats_per_row();
    // First the copy restarts empty, then the rows, each batch read and queued under the order
    // lock, behind every shipment queued before it.
    std::uint32_t cursor = 0;
    for (bool spec = true; ok; spec = false) {
      if (stopping_.load()) {
        ok = false;
        break;
      }
      Shipment& s = sent.emplace_back();
      std::vector<std::pair<std::size_t, std::size_t>> ranges;
      {
        std::lock_guard lock(table_order_mu_);
        if (spec) {
          table_spec_shipment(id, &s);
          s.arg0 = wire::replica_table_arg0(options_.server_id, ++table_position_);
          ranges = {{0, 1}};
        } else {
          s.op = wire::Op::replica_rows;
          s.arg0 = wire::replica_table_arg0(options_.server_id, ++table_position_);
          s.arg1 = id;
          s.records.reset(new float[std::uint64_t{kRowsPerRequest} * floats]);
          s.capacity = std::uint64_t{kRowsPerRequest} * floats;
          float* at = s.records.get();
          cursor = t->scan(cursor, kRowsPerRequest, [&](Key key, const float* row, const float* state) {
            std::memcpy(at, row, dim * sizeof(float));
            if (floats > dim) std::memcpy(at + dim, state, (floats - dim) * sizeof(float));  // none for SGD
            s.keys.push_back({key, static_cast<std::uint32_t>(floats), 0});
            s.slices.push_back({key, static_cast<std::uint32_t>(floats), at});
            at += floats;
          });
          s.record_floats = static_cast<std::uint64_t>(at - s.records.get());
          ranges = cut(s.keys, options_.max_request_bytes / 2);
        }
        if (s.keys.empty() || !send_in_order(r, conn, s, ranges)) {
          const bool stopped = !s.keys.empty();
          sent.pop_back();
          if (stopped) ok = false;
        }
      }
      settle(false);
      if (!spec && cursor == 0) break;
    }
  }
  return settle(true);
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
  bool said_unreachable = false, said_waiting = false;
  // Doubled after each connect that timed out (a loaded machine's rdma_cm can take longer than
  // a second), so that a live replica is reached in the end.
  std::chrono::milliseconds connect_timeout{1000};
  const auto started = std::chrono::steady_clock::now();
  auto last_look = started;
  while (!stopping_.load()) {
    if (deposed_.load()) {  // no transfer from a deposed origin: it would restart its copies
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    if (r.state.load(std::memory_order_acquire) == static_cast<int>(State::pending) &&
        std::chrono::steady_clock::now() - started > options_.io_timeout) {
      int pending = static_cast<int>(State::pending);
      const std::string who = "server " + std::to_string(options_.server_id) + ": replica server " +
                              std::to_string(r.peer.id) + " (" + r.peer.uri + ") unreachable for ";
      const auto patience = kTakeoverPatience * options_.io_timeout;
      // A takeover's replica not certified down: waited for, but not for good (nobody may ever
      // certify one cut off from this server alone, or that never synced to be watched).
      const bool uncertified = options_.certified_down && !options_.certified_down(r.peer.id);
      if (uncertified && std::chrono::steady_clock::now() - started < patience) {
        if (!std::exchange(said_waiting, true))
          log::warn("replication", who + std::to_string(options_.io_timeout.count()) +
                                       " ms; acknowledging nothing until it is synced or certified down, for up to " +
                                       std::to_string(patience.count()) + " ms");
      } else if (r.state.compare_exchange_strong(pending, static_cast<int>(State::down))) {
        if (uncertified)
          log::error("replication", who + std::to_string(patience.count()) +
                                        " ms and not certified down; acknowledging without it: these keys have one "
                                        "copy until it is synced");
        else
          log::warn("replication", who + std::to_string(options_.io_timeout.count()) +
                                       " ms since this server started; acknowledging without it until it is synced");
      }
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
      // stop() joins this thread: a peer that does not answer must not hold it for the timeouts.
      conn = connect_to(r.peer, options_, connect_timeout, &stopping_);
    } catch (const Error& e) {
      if (stopping_.load()) break;
      if (e.code() == Errc::timeout) connect_timeout = std::min(connect_timeout * 2, kLongestConnect);
      if (!said_unreachable && r.state.load() == static_cast<int>(State::down))
        log::warn("replication", "server " + std::to_string(options_.server_id) + ": replica server " +
                                     std::to_string(r.peer.id) + " unreachable (" + e.what() + "); retrying");
      said_unreachable = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      continue;
    }
    said_unreachable = false;
    connect_timeout = std::chrono::milliseconds(1000);
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

std::uint32_t TcpReplicator::table_position() {
  std::lock_guard lock(table_order_mu_);
  return table_position_;
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
// A request whose answer is opaque bytes (a text payload): a replica's index, a page of a table.
// Throws Error with the replica's refusal.
std::string ask_for_bytes(transport::Connection& conn, wire::Op op, std::uint64_t arg0, std::uint32_t arg1,
                          std::span<const transport::KeySlice> keys) {
  std::string bytes;
  transport::Completion done;
  done.reset(1);
  transport::Request q;
  q.op = op;
  q.arg0 = arg0;
  q.arg1 = arg1;
  q.keys = keys;
  q.completion = &done;
  q.text_out = &bytes;
  conn.submit(q);
  wait_done(done, &conn);
  if (done.status() != Errc::ok) throw Error(done.status(), done.message());
  return bytes;
}

// Takes every record of `peer`'s replica of this server into the engine's store (newest wins).
// Throws Error when the replica cannot be read or is not synced.
void take_replica(ShardEngine& engine, const ReplicaPeer& peer, const ReplicatorOptions& options,
                  RejoinReport* report) {
  auto conn = connect_to(peer, options, std::chrono::milliseconds(1000));
  const std::string index = ask_for_bytes(*conn, wire::Op::replica_index, options.server_id, 0, {});
  transport::Completion done;
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
// One replica_table_rows request: up to max_rows rows of `peer`'s copy of table `id` from `cursor`.
ReplicaTableRows read_table_rows(transport::Connection& conn, const ReplicatorOptions& options, std::uint32_t id,
                                 std::uint32_t cursor, std::uint32_t max_rows) {
  const transport::KeySlice ask{cursor, max_rows, nullptr};
  const std::string bytes = ask_for_bytes(conn, wire::Op::replica_table_rows, options.server_id, id, {&ask, 1});
  wire::ReplicaRowsHeader head{};
  if (bytes.size() < sizeof head) throw Error(Errc::protocol, "a short replica_table_rows reply");
  std::memcpy(&head, bytes.data(), sizeof head);
  ReplicaTableRows out;
  out.exists = head.exists != 0;
  out.synced = head.synced != 0;
  out.position = head.position;
  out.next = head.next;
  out.max_rows = head.max_rows;
  out.record_floats = head.record_floats;
  out.epoch = head.epoch;
  if (!out.exists) return out;
  std::string why;
  if (wire::decode_table_spec(head.spec, &out.requested, &why) != Errc::ok)
    throw Error(Errc::protocol, "table " + std::to_string(id) + ": " + why);
  const std::uint64_t marks_end = sizeof head + std::uint64_t{head.marks} * sizeof(std::uint64_t);
  const std::uint64_t need = marks_end + std::uint64_t{head.rows} * (sizeof(Key) + head.record_floats * sizeof(float));
  if (head.rows > max_rows || head.record_floats == 0 || bytes.size() != need)
    throw Error(Errc::protocol, "a replica_table_rows reply whose size does not match its row and mark counts");
  out.marks.resize(head.marks);
  if (head.marks) std::memcpy(out.marks.data(), bytes.data() + sizeof head, head.marks * sizeof(std::uint64_t));
  if (head.rows == 0) return out;
  out.ids.resize(head.rows);
  out.records.resize(std::uint64_t{head.rows} * head.record_floats);
  std::memcpy(out.ids.data(), bytes.data() + marks_end, head.rows * sizeof(Key));
  std::memcpy(out.records.data(), bytes.data() + marks_end + head.rows * sizeof(Key),
              out.records.size() * sizeof(float));
  return out;
}

// Takes every table back from the replica furthest along this server's table stream, of its
// latest incarnation: a copy an earlier incarnation transferred (its replica unreachable since)
// loses to a later one's, whatever its position.
void take_tables(ShardEngine& engine, const ReplicatorOptions& options, RejoinReport* report) {
  constexpr std::uint32_t kRows = 1u << 14;
  // Every replica the keys came from is asked: a failed probe could hide the one furthest along,
  // so it fails the round (rejoin_from_replicas tries again) rather than settle for another.
  const ReplicaPeer* best = nullptr;
  std::uint32_t best_position = 0, best_epoch = 0, latest_epoch = 0, latest_from = 0;
  for (const ReplicaPeer& peer : options.replicas) {
    if (std::find(report->from.begin(), report->from.end(), peer.id) == report->from.end()) continue;
    ReplicaTableRows probe;
    try {
      auto c = connect_to(peer, options, std::chrono::milliseconds(1000));
      probe = read_table_rows(*c, options, 0, 0, 1);
    } catch (const Error& e) {
      throw Error(e.code(), "server " + std::to_string(peer.id) + " did not say how far its tables are: " + e.what());
    }
    // Positions in serial-number order: replicas of one incarnation are never 2^31 frames apart.
    const bool later = !best || probe.epoch > best_epoch ||
                       (probe.epoch == best_epoch && static_cast<std::int32_t>(probe.position - best_position) > 0);
    if (probe.synced && later) {
      best = &peer;
      best_position = probe.position;
      best_epoch = probe.epoch;
    }
    if (probe.epoch > latest_epoch) {
      latest_epoch = probe.epoch;
      latest_from = peer.id;
    }
  }
  if (!best) throw Error(Errc::peer_failure, "no replica the keys came from holds synced tables");
  // A later incarnation reached a replica that is not synced yet: the synced copies are older
  // than what that incarnation may have acknowledged, and taking them would hide it.
  if (best_epoch < latest_epoch)
    throw Error(Errc::peer_failure, "server " + std::to_string(latest_from) +
                                        " holds tables of a later incarnation of this server that it has not finished "
                                        "receiving, and the synced copies are older; start without --rejoin to "
                                        "discard them");
  if (best_epoch > engine.epoch_seconds())
    log::warn("replication", "server " + std::to_string(options.server_id) + ": the tables of server " +
                                 std::to_string(best->id) + " come from an incarnation that started " +
                                 std::to_string(best_epoch - engine.epoch_seconds()) +
                                 " s after this one did: has this host's clock stepped back?");
  auto conn = connect_to(*best, options, std::chrono::milliseconds(1000));
  std::string why;
  for (std::uint32_t id = 0; id < kMaxTables; ++id) {
    std::uint32_t cursor = 0;
    bool any = false;
    do {
      const ReplicaTableRows got = read_table_rows(*conn, options, id, cursor, kRows);
      // Each page is read whole between two frames, and every page (an absent table's too) must
      // be of the point the probe saw: a frame or mark between them (one the dead incarnation
      // left in the replica's socket) would pair page 0's marks with later rows, or empty the copy.
      if (!got.synced || got.epoch != best_epoch || got.position != best_position)
        throw Error(Errc::peer_failure, "server " + std::to_string(best->id) + "'s copy of table " +
                                            std::to_string(id) + " moved while it was read; reading it again");
      if (!got.exists) break;
      if (got.record_floats != got.requested.dim + EmbeddingTable::state_floats_for(got.requested))
        throw Error(Errc::protocol, "table " + std::to_string(id) + "'s rows come with " +
                                        std::to_string(got.record_floats) + " floats, not its spec's");
      if (Errc e = engine.restore_table_rows(id, got.requested, got.max_rows, got.ids, got.records.data(), &why);
          e != Errc::ok)
        throw Error(e, why);
      // The marks of the copy as this page was read: the replica's origin is gone, so the copy
      // no longer moves, and any page's marks are those of every row.
      if (cursor == 0)
        if (Errc e = engine.restore_table_marks(id, got.marks, &why); e != Errc::ok) throw Error(e, why);
      any = true;
      report->table_rows += static_cast<std::uint32_t>(got.ids.size());
      cursor = got.next;
    } while (cursor != 0);
    report->tables += any ? 1 : 0;
  }
  report->tables_from = best->id;
  report->table_position = best_position;
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
    // Only copies of this server's latest incarnation count: a replica an earlier one transferred
    // to, and the later one never reached, would bring back keys (and clocks, merged by max) that
    // only the earlier one wrote. Each replica says whose transfer its copy comes from.
    std::vector<std::uint32_t> epochs(options.replicas.size(), 0);
    std::uint32_t latest = 0;
    for (std::size_t i = 0; i < options.replicas.size(); ++i) {
      try {
        auto c = connect_to(options.replicas[i], options, std::chrono::milliseconds(1000));
        const ReplicaTableRows probe = read_table_rows(*c, options, 0, 0, 1);
        epochs[i] = probe.epoch;
        if (probe.synced) latest = std::max(latest, probe.epoch);
      } catch (const Error&) {
        // Unreachable now: take_replica below says so.
      }
    }
    for (std::size_t i = 0; i < options.replicas.size(); ++i) {
      const ReplicaPeer& peer = options.replicas[i];
      if (epochs[i] < latest) {
        tried += (tried.empty() ? "" : "; ") +
                 ("server " + std::to_string(peer.id) + ": its copy is of an earlier incarnation of this server");
        continue;
      }
      try {
        take_replica(engine, peer, options, &report);
        report.from.push_back(peer.id);
      } catch (const Error& e) {
        tried +=
            (tried.empty() ? "" : "; ") + ("server " + std::to_string(peer.id) + " (" + peer.uri + "): " + e.what());
      }
    }
    // Only servers that ship tables' rows keep copies of them (tcp://).
    if (!report.from.empty() && engine.options().replicate_tables) {
      try {
        take_tables(engine, options, &report);
      } catch (const Error& e) {
        // Tried again with the keys: both are taken idempotently (newest records, rows overwritten).
        tried += (tried.empty() ? "" : "; ") + std::string("the tables: ") + e.what();
        report.from.clear();
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
