#include "transport/tcp/tcp_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>

#include "common/log.h"
#include "common/memory.h"
#include "common/sync.h"
#include "replication/failover_frames.h"
#include "replication/table_frames.h"

namespace pskv::tcp {

// A reply on its way out. It is first tried straight from where its payload lies (the store, the
// connection's reply buffer, a stack string); only what the socket did not take is kept, with
// its payload copied unless it lives in the store, which outlives every connection.
struct Reply {
  Reply() = default;
  Reply(const wire::FrameHeader& header, const void* payload = nullptr, std::uint64_t payload_bytes = 0)
      : header(header), payload(payload), payload_bytes(payload_bytes) {}

  wire::FrameHeader header{};
  const void* payload = nullptr;
  std::uint64_t payload_bytes = 0;
  std::vector<char> owned;                   // the payload once it had to be kept
  std::unique_ptr<HeapMemory> owned_values;  // a large payload built for this reply alone
  // Sent straight from the store's slots, then a u32: 0 if no slot's seqlock moved across the
  // send, 1 if a push got in and the client must ask again.
  bool from_store = false;
  std::vector<iovec> store_iov;
  std::vector<SlotHeader*> slots;
  std::vector<std::uint64_t> versions;
  std::uint32_t torn = 0;
  std::uint64_t sent = 0;  // of header, payload and trailer
  BudgetHold charged;      // budget this reply holds, given back with it
  std::int64_t deadline_ns = 0;

  std::uint64_t total() const noexcept { return sizeof header + payload_bytes + (from_store ? sizeof torn : 0); }
  // Moves the payload somewhere this reply owns, unless it is already owned or in the store.
  void keep_payload() {
    if (from_store || (owned_values && payload == owned_values->data()) || payload == owned.data() ||
        payload_bytes == 0)
      return;
    const char* p = static_cast<const char*>(payload);
    owned.assign(p, p + payload_bytes);
    payload = owned.data();
  }
  // One non-blocking write of what is left. Returns the bytes written, or -1 with errno.
  ssize_t write_some(int fd) {
    iovec iov[IOV_MAX];
    int count = 0;
    std::uint64_t skip = sent;
    auto add = [&](const void* base, std::uint64_t len) {
      if (skip >= len) {
        skip -= len;
        return;
      }
      if (count < IOV_MAX) iov[count++] = {static_cast<char*>(const_cast<void*>(base)) + skip, len - skip};
      skip = 0;
    };
    add(&header, sizeof header);
    const std::uint64_t body_end = sizeof header + payload_bytes;
    if (!from_store) {
      add(payload, payload_bytes);
      return send_some(fd, iov, count);
    }
    for (const iovec& v : store_iov) add(v.iov_base, v.iov_len);
    if (sent >= body_end) add(&torn, sizeof torn);
    ssize_t n;
    {
      const SeqlockReadScope racy_reads;  // validated by the versions once all values are out
      n = send_some(fd, iov, count, /*more=*/sent < body_end);
    }
    if (n > 0 && sent < body_end && sent + static_cast<std::uint64_t>(n) >= body_end) {
      // Every value is out: did a push get into any slot meanwhile?
      std::atomic_thread_fence(std::memory_order_acquire);
      for (std::size_t i = 0; i < slots.size(); ++i)
        if (slots[i]->seq.load(std::memory_order_relaxed) != versions[i]) torn = 1;
    }
    return n;
  }
  // Writes until all is out (true) or the socket is full (true, sent < total()); false if the
  // connection failed. `sent_now` gets the bytes this call wrote.
  bool write_out(int fd, std::uint64_t* sent_now) {
    const std::uint64_t before = sent;
    while (sent < total()) {
      const ssize_t n = write_some(fd);
      if (n < 0) {
        if (!nothing_waiting(n)) return false;
        break;
      }
      sent += static_cast<std::uint64_t>(n);
    }
    *sent_now = sent - before;
    return true;
  }
};

// What the owner of a frame larger than the receive buffer keeps between readable events.
struct LargeFrame {
  enum class Stage { none, keys, body, stream, discard };
  Stage stage = Stage::none;
  wire::FrameHeader h{};
  std::int64_t started_ns = 0;
  std::uint64_t progress = 0;  // bytes of the frame taken so far, whatever the stage
  std::uint64_t key_have = 0;  // bytes of the key table in peer.keys
  std::uint64_t have = 0;      // payload bytes in `payload` (body) or dropped (discard)
  BudgetHold charged;
  // Mapped at the declared size but never written ahead of the bytes: pages are backed as data
  // arrives, so a peer that declares much and sends little holds little memory; the buffer is
  // never grown and copied, and its pages go back to the system with it (a heap allocation
  // could stay resident in the allocator after the frame, outside the budget).
  std::unique_ptr<HeapMemory> payload;
  // stream: where the apply is, and whether the keys were all found.
  std::vector<SlotRef> slots;
  Errc found = Errc::ok;
  std::string why;
  std::size_t key = 0;
  std::uint64_t done_floats = 0, step = 0, applied = 0;
  // discard: the answer once the frame is drained.
  Errc refusal = Errc::ok;
  std::string refusal_why;
};

// One client connection. Thread-safety: the I/O thread that owns it (owned == true, taken and
// given back under mu) alone reads it and touches the fields below "owner only"; replies may be
// queued by any thread (a parked pull resumed elsewhere) under mu; the reaper reads the atomics.
class Peer : public std::enable_shared_from_this<Peer> {
 public:
  Peer(int fd, std::uint32_t generation, std::string address, std::string host)
      : fd(fd),
        generation(generation),
        address(std::move(address)),
        host(std::move(host)),
        accepted_ns(steady_now_ns()) {}

  std::uint64_t tag() const noexcept {
    return (std::uint64_t{generation} << 32) | static_cast<std::uint32_t>(fd.get());
  }
  std::string who() const {
    return worker == kNoWorker ? address : address + " (worker " + std::to_string(worker) + ")";
  }

  Fd fd;
  const std::uint32_t generation;
  const std::string address;  // host:port, for the log
  const std::string host;     // for the per-address cap
  const std::int64_t accepted_ns;

  std::mutex mu;
  // Under mu.
  bool closed = false;
  bool owned = false;
  bool backlog = false;    // buffered requests wait for the connection to be served again
  bool mid_frame = false;  // a large frame is half read: it is read on, paused or not
  std::uint32_t parked = 0;
  std::uint64_t queued_bytes = 0;
  std::deque<std::unique_ptr<Reply>> out;
  std::string expired;  // why the reaper shut the connection

  std::atomic<bool> handshaken{false};
  // Expired and shut down, waiting for its owner (or its hang-up event) to close it: no longer
  // counted against max_connections, never picked to make room again.
  std::atomic<bool> doomed{false};
  std::atomic<std::int64_t> in_deadline_ns{0}, out_deadline_ns{0};

  // Owner only.
  bool said_hello = false;
  bool authenticated = false;              // passed the token challenge (or the server has no token)
  std::uint32_t hello_worker = kNoWorker;  // admitted once authenticated
  bool server_peer = false;                // admitted with wire::kServerPeer: may replicate
  auth::Nonce client_nonce{}, server_nonce{};
  bool finished = false;  // the worker announced it is done (clock = kClockDone)
  std::uint32_t worker = kNoWorker;
  // Requests are read with one recv into `in` and parsed from there; only frames larger than
  // `in` are read past it (LargeFrame).
  static constexpr std::size_t kInBytes = 256 << 10;
  std::unique_ptr<float[]> in{new float[kInBytes / sizeof(float)]};  // float-aligned frames
  std::size_t in_begin = 0, in_end = 0;
  // Bytes read from the socket since this thread took the connection: past kTurnBytes it gives
  // the thread back, so a fast sender shares it with every other connection.
  std::uint64_t turn_bytes = 0;
  std::vector<wire::KeyEntry> keys;
  std::vector<float> reply;  // small pull replies (up to kInBytes)
  LargeFrame large;
  // The staging buffer of this connection's last large `replicate` frame, kept (and charged to
  // the budget) for the next: an origin ships every push's records over one connection, and a
  // fresh mapping per frame cost a page fault per 4 KiB, more than copying the records in.
  std::unique_ptr<HeapMemory> replica_body;
  BudgetHold replica_body_charged;
  char* in_bytes() { return reinterpret_cast<char*>(in.get()); }
  void compact() {
    if (in_begin == 0) return;
    std::memmove(in_bytes(), in_bytes() + in_begin, in_end - in_begin);
    in_end -= in_begin;
    in_begin = 0;
  }
};

static_assert(TcpServer::kPushPieceFloats * sizeof(float) <= Peer::kInBytes,
              "a push piece must fit the receive buffer");

namespace {

constexpr std::uint64_t kListenerTag = ~0ull, kWakeTag = ~0ull - 1;
// How often the reaper looks for connections past a deadline; deadlines are met to this.
constexpr std::int64_t kReapEveryNs = 100'000'000;
// Past this much queued reply data a connection is not read until its peer takes some.
constexpr std::uint64_t kPauseQueuedBytes = 4u << 20;
constexpr std::size_t kPauseQueuedReplies = 64;
// Large buffers a connection used for one frame are given back rather than kept for the next.
constexpr std::size_t kKeepBufferBytes = 1u << 20;

wire::FrameHeader reply_header(const wire::FrameHeader& req, std::uint64_t payload_bytes, std::uint64_t arg0 = 0,
                               std::uint32_t arg1 = 0) {
  wire::FrameHeader h = wire::make_header(static_cast<wire::Op>(req.op), req.request_id, 0, payload_bytes, arg0, arg1);
  h.flags = wire::kResponse;
  return h;
}

// A non-blocking receive's result as the frame readers use it: the bytes, 0 for nothing waiting
// (or interrupted), -1 for a connection closed or failed.
ssize_t received(ssize_t n) {
  if (n > 0) return n;
  if (n < 0 && (errno == EINTR || nothing_waiting(n))) return 0;
  return -1;
}

template <typename T>
void give_back_if_large(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > kKeepBufferBytes) std::vector<T>().swap(v);
}

}  // namespace

// A pull waiting for the consistency bound, or a barrier waiting for the other workers. A pull
// holds its own copy of the key table (charged to the memory budget until it is answered): the
// connection keeps serving other requests meanwhile.
class ParkedRequest final : public Parked {
 public:
  ParkedRequest(TcpServer& server, std::shared_ptr<Peer> peer, const wire::FrameHeader& req,
                std::vector<wire::KeyEntry> keys, BudgetHold charged)
      : server_(server), peer_(std::move(peer)), req_(req), keys_(std::move(keys)), charged_(std::move(charged)) {}
  // Runs on whichever thread moved the bound, with other waiters still to resume after it:
  // nothing that goes wrong answering this one may escape into that thread.
  void resume(Errc status, const std::string& why) noexcept override {
    {
      std::lock_guard lock(peer_->mu);
      --peer_->parked;
    }
    try {
      const auto op = static_cast<wire::Op>(req_.op);
      // Closed rather than refused when this server is going away (stopping) before it could
      // answer, or when only the replication of what was applied failed: a retrying client sends
      // the request again to the server's successor. A running server's peer_failure (a worker
      // died holding the bound) is the worker's answer and is sent as one.
      if (status != Errc::ok && (server_.stopping_.load() || wire::applied_before_replicated(req_)))
        server_.expire(*peer_, "its " + std::string(wire::op_name(req_.op)) + " could not be answered (" + why +
                                   "); closed so that its client sends it again");
      else if (status != Errc::ok)
        server_.send_error(*peer_, req_, status, why);
      else if (op == wire::Op::pull)
        server_.answer_pull(*peer_, req_, keys_, /*owner=*/false);
      else if (op == wire::Op::clock)
        server_.send_empty(*peer_, req_, server_.engine_.observed_bound());
      else
        server_.send_empty(*peer_, req_);
    } catch (const std::exception& e) {
      server_.expire(*peer_, std::string("answering its parked request failed: ") + e.what());
    }
    server_.poke(*peer_);
  }

 private:
  TcpServer& server_;
  std::shared_ptr<Peer> peer_;
  wire::FrameHeader req_;
  std::vector<wire::KeyEntry> keys_;
  BudgetHold charged_;
};

TcpServer::TcpServer(ShardEngine& engine, const Uri& uri, const TcpServerOptions& options)
    : engine_(engine), options_(options), budget_(options.memory_budget_bytes) {
  if (options_.io_threads == 0) options_.io_threads = 1;
  listen_fd_ = listen_tcp(uri.host, uri.port, 512);
  // accept_ready() drains the backlog until EAGAIN; a blocking listener would park the thread.
  fcntl(listen_fd_.get(), F_SETFL, fcntl(listen_fd_.get(), F_GETFL) | O_NONBLOCK);
  port_ = local_port(listen_fd_.get());
  raise_fd_limit();
  spare_fd_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  epoll_fd_ = Fd(epoll_create1(EPOLL_CLOEXEC));
  wake_fd_ = Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!epoll_fd_ || !wake_fd_) throw Error(Errc::io, std::string("epoll/eventfd: ") + std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.u64 = kListenerTag;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, listen_fd_.get(), &ev);
  epoll_event wake{};
  wake.events = EPOLLIN;  // level-triggered: wakes every thread at stop
  wake.data.u64 = kWakeTag;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &wake);
  next_reap_ns_.store(steady_now_ns() + kReapEveryNs);
  for (std::uint32_t i = 0; i < options_.io_threads; ++i) threads_.emplace_back([this] { io_loop(); });
}

TcpServer::~TcpServer() {
  stop_accepting();
  drain();
  close();
}

void TcpServer::stop_accepting() noexcept {
  // Threads may be inside accept_ready: the descriptor stays open (closed with the rest) and
  // the re-arm there fails harmlessly; connections arriving meanwhile wait in the backlog.
  accepting_.store(false);
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, listen_fd_.get(), nullptr);
}

void TcpServer::drain() noexcept {
  if (stopping_.exchange(true)) return;
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_.get(), &one, sizeof one);
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void TcpServer::close() noexcept {
  drain();
  std::vector<std::shared_ptr<Peer>> all;
  {
    std::lock_guard lock(peers_mu_);
    for (auto& [fd, peer] : peers_) all.push_back(peer);
  }
  for (auto& peer : all) close_peer(*peer, "the server is stopping");
  listen_fd_.reset();
}

std::chrono::nanoseconds TcpServer::frame_deadline(std::uint64_t bytes) const noexcept {
  return options_.frame_timeout + std::chrono::seconds(bytes / kFrameBytesPerSecond);
}

JsonObject TcpServer::stats_fields() const {
  std::size_t connections = 0;
  {
    std::lock_guard lock(peers_mu_);
    connections = peers_.size();
  }
  JsonObject j;
  j.add("tcp_connections", connections)
      .add("tcp_refused", refused_.load())
      .add("tcp_expired", expired_.load())
      .add("tcp_over_budget", over_budget_.load())
      .add("tcp_turns_yielded", turns_yielded_.load())
      .add("tcp_budget_used_bytes", budget_.used())
      .add("tcp_budget_bytes", budget_.limit());
  return j;
}

bool MemoryBudget::take(std::uint64_t bytes) noexcept {
  std::uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (used + bytes > limit_ || used + bytes < used) return false;
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return true;
}

void TcpServer::io_loop() {
  epoll_event ev{};
  while (!stopping_.load()) {
    const int n = epoll_wait(epoll_fd_.get(), &ev, 1, static_cast<int>(kReapEveryNs / 1'000'000));
    if (steady_now_ns() >= next_reap_ns_.load(std::memory_order_relaxed)) reap_expired();
    if (n <= 0) continue;
    if (ev.data.u64 == kWakeTag) return;
    if (ev.data.u64 == kListenerTag) {
      if (accepting_.load()) accept_ready();
      continue;
    }
    std::shared_ptr<Peer> peer;
    {
      std::lock_guard lock(peers_mu_);
      auto it = peers_.find(static_cast<int>(ev.data.u64 & 0xffffffffu));
      if (it == peers_.end() || it->second->tag() != ev.data.u64) continue;  // closed since
      peer = it->second;
    }
    {
      std::lock_guard lock(peer->mu);
      // An event for a connection another thread serves (a reply queued from elsewhere re-armed
      // it meanwhile): that thread re-arms it when done, so this one has nothing to do.
      if (peer->closed || peer->owned) continue;
      peer->owned = true;
      peer->backlog = false;
    }
    bool keep = true;
    std::string reason;
    if ((ev.events & EPOLLERR) && !(ev.events & EPOLLIN)) {
      keep = false;
      reason = "socket error";
    }
    if (keep) {
      std::lock_guard lock(peer->mu);
      if (!peer->out.empty() && !flush_locked(*peer)) {
        keep = false;
        reason = "it is gone while a reply was being sent";
      }
    }
    if (keep) {
      // Nothing a peer sends may end the process: a failure to get memory for its request
      // (budgets are checked first, but the system can still refuse) closes that connection.
      try {
        keep = serve(*peer);
        if (!keep) reason = "its connection ended";
      } catch (const std::exception& e) {
        keep = false;
        reason = std::string("serving it failed: ") + e.what();
        log::error("tcp.failed", "server " + std::to_string(engine_.options().server_id) + ": " + reason);
      }
    }
    if (keep && peer->turn_bytes >= kTurnBytes) turns_yielded_.fetch_add(1, std::memory_order_relaxed);
    if (keep)
      release(*peer);
    else
      close_peer(*peer, reason);
  }
}

void TcpServer::reap_expired() {
  const std::int64_t now = steady_now_ns();
  std::int64_t due = next_reap_ns_.load(std::memory_order_relaxed);
  if (now < due || !next_reap_ns_.compare_exchange_strong(due, now + kReapEveryNs)) return;
  const std::int64_t handshake_ns = std::chrono::nanoseconds(options_.handshake_timeout).count();
  std::vector<std::pair<std::shared_ptr<Peer>, std::string>> late;
  {
    std::lock_guard lock(peers_mu_);
    for (auto& [fd, peer] : peers_) {
      const std::int64_t in = peer->in_deadline_ns.load(std::memory_order_relaxed);
      const std::int64_t out = peer->out_deadline_ns.load(std::memory_order_relaxed);
      if (!peer->handshaken.load(std::memory_order_relaxed) && now - peer->accepted_ns > handshake_ns)
        late.emplace_back(peer, "did not finish hello" + std::string(options_.token ? " and the token challenge" : "") +
                                    " within " + std::to_string(options_.handshake_timeout.count()) +
                                    " ms (--handshake-timeout-ms)");
      else if (in && now > in && !reading_paused(*peer))
        late.emplace_back(peer, "did not send the rest of a frame in time (--frame-timeout-ms " +
                                    std::to_string(options_.frame_timeout.count()) + ", plus 1 s per 16 MiB)");
      else if (out && now > out)
        late.emplace_back(peer, "did not read its reply in time (--frame-timeout-ms " +
                                    std::to_string(options_.frame_timeout.count()) + ", plus 1 s per 16 MiB)");
    }
  }
  for (auto& [peer, why] : late) expire(*peer, why);
}

bool TcpServer::reading_paused(Peer& peer) {
  std::lock_guard lock(peer.mu);
  if (peer.mid_frame || (interest_locked(peer) & EPOLLIN)) return false;
  // The rest of the frame waits on the server, not the peer: its clock starts again once the
  // server reads again.
  peer.in_deadline_ns.store(steady_now_ns() + frame_deadline(Peer::kInBytes).count(), std::memory_order_relaxed);
  return true;
}

void TcpServer::expire(Peer& peer, const std::string& reason) {
  std::lock_guard lock(peer.mu);
  expire_locked(peer, reason);
}

void TcpServer::expire_locked(Peer& peer, const std::string& reason) {
  if (peer.closed || !peer.expired.empty()) return;
  peer.expired = reason;
  peer.doomed.store(true, std::memory_order_relaxed);
  expired_.fetch_add(1, std::memory_order_relaxed);
  // Its owner (or the next event: a shut socket reports EPOLLHUP whatever it is armed for)
  // closes it; closing the descriptor here could pull it from under a thread reading it.
  ::shutdown(peer.fd.get(), SHUT_RDWR);
}

void TcpServer::accept_ready() {
  for (;;) {
    sockaddr_storage from{};
    socklen_t from_len = sizeof from;
    const int fd =
        ::accept4(listen_fd_.get(), reinterpret_cast<sockaddr*>(&from), &from_len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
      if ((errno == EMFILE || errno == ENFILE) && shed_one_connection()) continue;
      if (!nothing_waiting(fd))
        log::error("tcp.accept", "server " + std::to_string(engine_.options().server_id) +
                                     ": accept failed: " + std::strerror(errno));
      break;
    }
    set_nodelay(fd);
    set_keepalive(fd, std::chrono::seconds(5));
    static std::atomic<std::uint32_t> generations{1};
    const auto* sa = reinterpret_cast<const sockaddr*>(&from);
    auto peer = std::make_shared<Peer>(fd, generations.fetch_add(1), address_text(sa), host_text(sa));
    std::string refusal;
    std::shared_ptr<Peer> evict;
    {
      std::lock_guard lock(peers_mu_);
      std::uint32_t& mine = per_address_[peer->host];
      if (mine >= options_.max_connections_per_address) {
        refusal =
            "already has " + std::to_string(mine) + " connections from its address (--max-connections-per-address)";
      } else if (peers_.size() >= options_.max_connections) {
        // Connections already expired are on their way out and do not count. Otherwise the
        // oldest connection still in its handshake makes room: a flood of sockets that never
        // say hello cannot lock out the workers that do.
        std::size_t doomed = 0;
        for (auto& [other_fd, other] : peers_) {
          if (other->doomed.load(std::memory_order_relaxed)) {
            ++doomed;
            continue;
          }
          if (!other->handshaken.load() && (!evict || other->accepted_ns < evict->accepted_ns)) evict = other;
        }
        if (peers_.size() - doomed < options_.max_connections) {
          evict.reset();
        } else if (!evict) {
          refusal = "found the server full: " + std::to_string(peers_.size()) +
                    " connections (--max-connections); try again later or raise the limit";
        }
      }
      if (refusal.empty()) {
        ++mine;
        peers_[fd] = peer;
      } else if (mine == 0) {
        per_address_.erase(peer->host);
      }
    }
    if (evict)
      expire(*evict, "made room for a new connection: the server was full and it had not finished its handshake");
    if (!refusal.empty()) {
      refused_.fetch_add(1);
      log::warn("tcp.refused", "server " + std::to_string(engine_.options().server_id) + " refused " + peer->address +
                                   ": it " + refusal);
      refuse_at_accept(fd, "the server refused this connection: it " + refusal);
      continue;  // ~Peer closes it
    }
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
    ev.data.u64 = peer->tag();
    if (epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev) != 0)
      close_peer(*peer, std::string("the server could not watch it: epoll_ctl: ") + std::strerror(errno));
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.u64 = kListenerTag;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, listen_fd_.get(), &ev);
}

void TcpServer::refuse_at_accept(int fd, const std::string& text) {
  Reply r(reply_header(wire::make_header(wire::Op::hello, 0, 0, 0), text.size()), text.data(), text.size());
  r.header.flags |= wire::kText;
  r.header.status = static_cast<std::uint16_t>(Errc::capacity);
  r.write_some(fd);  // best effort: the socket is new, its buffer empty
}

bool TcpServer::shed_one_connection() {
  // Out of descriptors, the pending connection would stay in the backlog and the listener would
  // report it again at once: both threads would spin. The spare descriptor, given up for a
  // moment, lets the server take that connection, tell it why, and close it (nginx and libev
  // do the same).
  std::lock_guard lock(spare_mu_);
  if (!spare_fd_) return false;
  spare_fd_.reset();
  const int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd >= 0) {
    refused_.fetch_add(1);
    log::warn("tcp.refused", "server " + std::to_string(engine_.options().server_id) +
                                 " refused a connection: the process is out of file descriptors (ulimit -n; "
                                 "lower --max-connections or raise the limit)");
    refuse_at_accept(fd, "the server refused this connection: it is out of file descriptors; try again later");
    ::close(fd);
  }
  spare_fd_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  return fd >= 0;
}

void TcpServer::raise_fd_limit() {
  // Each connection is a descriptor; the soft limit (often 1024) would run out before
  // --max-connections does, and handshake eviction would never start. Raise it to the hard
  // limit, as Redis and nginx do, and say so if that is still short.
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  if (lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
    getrlimit(RLIMIT_NOFILE, &lim);
  }
  constexpr rlim_t kOwnDescriptors = 64;  // listener, epoll, eventfd, segments, logs, checkpoints
  if (lim.rlim_cur != RLIM_INFINITY && lim.rlim_cur < options_.max_connections + kOwnDescriptors)
    log::warn("tcp.limit", "server " + std::to_string(engine_.options().server_id) + ": ulimit -n is " +
                               std::to_string(lim.rlim_cur) + ", below --max-connections " +
                               std::to_string(options_.max_connections) +
                               " plus the server's own descriptors; connections past it are refused");
}

std::uint32_t TcpServer::armed_locked(const Peer& peer) const {
  // A frame is never left half read for a pause: its sender may be blocked writing the rest.
  return interest_locked(peer) | (peer.mid_frame ? static_cast<std::uint32_t>(EPOLLIN | EPOLLRDHUP) : 0u) |
         EPOLLONESHOT;
}

std::uint32_t TcpServer::interest_locked(const Peer& peer) const {
  // Requests are read again once the peer has taken most of what is queued for it, and once
  // fewer than the cap of its pulls are parked (hang-ups are reported regardless).
  const bool replies_pending = !peer.out.empty();
  const bool reading =
      !(replies_pending && (peer.queued_bytes > kPauseQueuedBytes || peer.out.size() > kPauseQueuedReplies)) &&
      peer.parked < kMaxParkedPerConnection;
  std::uint32_t events = replies_pending ? static_cast<std::uint32_t>(EPOLLOUT) : 0u;
  if (reading) events |= EPOLLIN | EPOLLRDHUP;
  // EPOLLOUT fires at once on an idle socket: the wake-up requests left buffered need.
  if (reading && peer.backlog) events |= EPOLLOUT;
  return events;
}

void TcpServer::release(Peer& peer) {
  std::lock_guard lock(peer.mu);
  peer.owned = false;
  if (peer.closed) return;
  peer.mid_frame = peer.large.stage != LargeFrame::Stage::none;
  // A whole request left in `in` (by a pause, or by the end of this thread's turn) needs a
  // wake-up of its own: no new bytes may come to make the socket readable. The pause may
  // already be over (a parked pull answered meanwhile), so this is decided by what `in` holds.
  peer.backlog = !peer.mid_frame && whole_frame_buffered(peer);
  epoll_event ev{};
  ev.events = armed_locked(peer);
  ev.data.u64 = peer.tag();
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, peer.fd.get(), &ev);
}

void TcpServer::poke(Peer& peer) {
  std::lock_guard lock(peer.mu);
  if (peer.closed || peer.owned) return;  // the owner re-arms with the new state when done
  epoll_event ev{};
  ev.events = armed_locked(peer);
  ev.data.u64 = peer.tag();
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, peer.fd.get(), &ev);
}

void TcpServer::close_peer(Peer& peer, const std::string& reason) {
  std::shared_ptr<Peer> keep;
  {
    std::lock_guard lock(peers_mu_);
    auto it = peers_.find(peer.fd.get());
    if (it == peers_.end() || it->second.get() != &peer) return;
    keep = it->second;
    peers_.erase(it);
    auto a = per_address_.find(peer.host);
    if (a != per_address_.end() && --a->second == 0) per_address_.erase(a);
  }
  std::string why = reason;
  {
    std::lock_guard lock(peer.mu);
    if (peer.closed) return;
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, peer.fd.get(), nullptr);
    peer.closed = true;
    if (!peer.expired.empty()) why = peer.expired;
    peer.out.clear();
    peer.queued_bytes = 0;
    ::shutdown(peer.fd.get(), SHUT_RDWR);
    peer.fd.reset();
  }
  // A push applied in pieces and cut short: its room for the replicas goes back, and the keys it
  // touched are shipped anyway (with no reply), so the replicas hold what the pieces changed.
  if (peer.large.stage == LargeFrame::Stage::stream && engine_.replicator()) {
    const LargeFrame& f = peer.large;
    const std::size_t touched =
        f.found == Errc::ok ? std::min<std::size_t>(f.key + (f.done_floats > 0 ? 1 : 0), peer.keys.size()) : 0;
    const std::span<const wire::KeyEntry> keys(peer.keys);
    if (touched) engine_.replicator()->ship(keys.first(touched), nullptr);
    engine_.replicator()->release(keys.subspan(touched));
  }
  // The owner closes (or the server, once its threads are gone): the frame's buffers go with the
  // charge, not later with the last reference a parked request keeps to the connection.
  peer.large.charged.reset();
  peer.large.payload.reset();
  peer.large.stage = LargeFrame::Stage::none;
  std::vector<wire::KeyEntry>().swap(peer.keys);
  std::vector<float>().swap(peer.reply);
  const std::uint32_t worker = peer.worker;
  const bool clean = peer.finished;
  if (!peer.expired.empty() || (!clean && worker != kNoWorker) || !peer.handshaken.load())
    log::info("tcp.closed",
              "server " + std::to_string(engine_.options().server_id) + " closed " + peer.who() + ": " + why);
  if (worker != kNoWorker) engine_.worker_left(worker, clean);
}

bool TcpServer::whole_frame_buffered(const Peer& peer) {
  const std::size_t avail = peer.in_end - peer.in_begin;
  if (avail < sizeof(wire::FrameHeader)) return false;
  wire::FrameHeader h;
  std::memcpy(&h, reinterpret_cast<const char*>(peer.in.get()) + peer.in_begin, sizeof h);
  // Whatever the header says, serving it decides something (a bad header closes): only a
  // frame still arriving is not worth a wake-up.
  const std::uint64_t frame =
      sizeof h + std::uint64_t{h.num_keys} * sizeof(wire::KeyEntry) + std::uint64_t{h.payload_bytes};
  return frame <= avail || frame > Peer::kInBytes;
}

bool TcpServer::serve(Peer& peer) {
  constexpr int kReadsPerTurn = 16;  // then other connections get the thread
  peer.turn_bytes = 0;
  for (int reads = 0;;) {
    if (peer.large.stage != LargeFrame::Stage::none) {
      const Progress p = continue_large_frame(peer);
      if (p == Progress::close) return false;
      if (p == Progress::need_more) return true;
      continue;
    }
    bool progressed = false;
    if (!serve_buffered(peer, &progressed)) return false;
    if (peer.large.stage != LargeFrame::Stage::none) continue;
    {
      std::lock_guard lock(peer.mu);
      if (!(interest_locked(peer) & EPOLLIN)) return true;  // paused: the rest waits in `in`
    }
    // The pause may have ended while serve_buffered stopped for it: serve what is buffered first.
    if (whole_frame_buffered(peer)) continue;
    // Every complete frame is served; what `in` holds is part of the next one. If more is
    // waiting, level-triggered EPOLLIN hands the connection straight back.
    if (reads == kReadsPerTurn || peer.turn_bytes >= kTurnBytes) return true;
    peer.compact();
    const ssize_t n = ::recv(peer.fd.get(), peer.in_bytes() + peer.in_end, Peer::kInBytes - peer.in_end, MSG_DONTWAIT);
    if (n == 0) return false;
    if (n < 0) {
      if (errno == EINTR) continue;
      return nothing_waiting(n);
    }
    peer.in_end += static_cast<std::size_t>(n);
    peer.turn_bytes += static_cast<std::uint64_t>(n);
    ++reads;
  }
}

bool TcpServer::serve_buffered(Peer& peer, bool* progressed) {
  constexpr std::size_t kHeader = sizeof(wire::FrameHeader);
  while (peer.in_end - peer.in_begin >= kHeader) {
    {
      std::lock_guard lock(peer.mu);
      if (!(interest_locked(peer) & EPOLLIN)) return true;  // paused between frames
    }
    const auto* at = reinterpret_cast<const std::byte*>(peer.in_bytes() + peer.in_begin);
    const std::size_t avail = peer.in_end - peer.in_begin;
    wire::FrameHeader h;
    std::memcpy(&h, at, kHeader);
    // Before the handshake a peer may send a hello or its proof, and nothing larger: it cannot
    // make the server hold a frame for someone it does not know.
    if (!peer.handshaken.load(std::memory_order_relaxed) && !before_handshake(peer, h)) return false;
    wire::ParsedFrame f;
    Errc status = Errc::ok;
    std::string why;
    const wire::ParseResult r = wire::parse_request(at, avail, options_.limits, &f, &peer.keys, &status, &why);
    if (r == wire::ParseResult::bad) return bad_frame(peer, h, status, why);
    if (r == wire::ParseResult::need_more) {
      if (f.frame_bytes <= Peer::kInBytes) break;  // a small frame still arriving
      return begin_large_frame(peer, f.header);
    }
    // Every frame is a whole number of 4-byte words, so payloads in `in` stay float-aligned.
    peer.in_begin += f.frame_bytes;
    *progressed = true;
    if (!handle(peer, f.header, reinterpret_cast<const float*>(f.payload))) return false;
  }
  // What is left is the start of a frame: it has a deadline from now unless it already had one.
  if (peer.in_end == peer.in_begin) {
    peer.in_begin = peer.in_end = 0;
    peer.in_deadline_ns.store(0, std::memory_order_relaxed);
  } else if (*progressed || peer.in_deadline_ns.load(std::memory_order_relaxed) == 0) {
    // A frame completed since the deadline was set: the rest is a newer frame, timed from now.
    peer.in_deadline_ns.store(steady_now_ns() + frame_deadline(Peer::kInBytes).count(), std::memory_order_relaxed);
  }
  return true;
}

bool TcpServer::bad_frame(Peer& peer, const wire::FrameHeader& h, Errc status, const std::string& why) {
  log::warn("tcp.bad-frame", "server " + std::to_string(engine_.options().server_id) + ": " + peer.who() +
                                 " sent a bad " + std::string(wire::op_name(h.op)) + " frame: " + why);
  if (h.magic == wire::kMagic) send_error(peer, h, status, why);
  return false;
}

std::string TcpServer::over_budget(const Peer& peer, std::uint64_t bytes, const std::string& what) {
  over_budget_.fetch_add(1, std::memory_order_relaxed);
  log::warn("tcp.budget", "server " + std::to_string(engine_.options().server_id) + ": a " + std::to_string(bytes) +
                              "-byte " + what + " of " + peer.who() + " does not fit the memory budget; refused");
  return "the server's memory budget (--memory-budget-mb) is in use by other requests; retry later";
}

bool TcpServer::before_handshake(Peer& peer, const wire::FrameHeader& h) {
  const auto op = static_cast<wire::Op>(h.op);
  const bool fits = h.magic == wire::kMagic && h.num_keys == 0 &&
                    ((op == wire::Op::hello && (h.payload_bytes == 0 || h.payload_bytes == auth::kNonceBytes)) ||
                     (op == wire::Op::auth && h.payload_bytes == auth::kProofBytes));
  if (fits) return true;
  const std::string frame = "a " + std::to_string(std::uint64_t{h.num_keys}) + "-key, " +
                            std::to_string(h.payload_bytes) + "-byte frame; only hello and auth, of up to " +
                            std::to_string(auth::kNonceBytes) + " bytes, are read before the handshake is done";
  if (peer.said_hello)  // the token challenge is pending
    return refuse(peer, h, "sent " + std::string(wire::op_name(h.op)) + " before authenticating (" + frame + ")");
  refused_.fetch_add(1, std::memory_order_relaxed);
  const std::string what = "sent " + std::string(wire::op_name(h.op)) + " before hello (" + frame + ")";
  log::warn("tcp.refused",
            "server " + std::to_string(engine_.options().server_id) + " refused " + peer.address + ": it " + what);
  if (h.magic == wire::kMagic)
    send_error(peer, h, Errc::protocol, "the first request on a connection must be hello; this one " + what);
  return false;
}

bool TcpServer::begin_large_frame(Peer& peer, const wire::FrameHeader& h) {
  LargeFrame& f = peer.large;
  f.h = h;
  f.key_have = f.have = 0;
  f.refusal = Errc::ok;
  f.started_ns = steady_now_ns();
  f.progress = sizeof(wire::FrameHeader);
  peer.in_begin += sizeof(wire::FrameHeader);
  const std::uint64_t key_bytes = std::uint64_t{h.num_keys} * sizeof(wire::KeyEntry);
  const std::uint64_t frame_bytes = sizeof(wire::FrameHeader) + key_bytes + h.payload_bytes;
  peer.in_deadline_ns.store(steady_now_ns() + frame_deadline(frame_bytes).count(), std::memory_order_relaxed);
  if (!f.charged.take(budget_, key_bytes)) {
    f.stage = LargeFrame::Stage::discard;
    f.refusal = Errc::capacity;
    f.refusal_why = over_budget(peer, key_bytes, "key table of a " + std::string(wire::op_name(h.op)));
    return true;
  }
  peer.keys.resize(h.num_keys);
  f.stage = LargeFrame::Stage::keys;
  return true;
}

TcpServer::Progress TcpServer::continue_large_frame(Peer& peer) {
  LargeFrame& f = peer.large;
  const std::uint64_t key_bytes = std::uint64_t{f.h.num_keys} * sizeof(wire::KeyEntry);
  auto finish = [&] {
    f.charged.reset();
    f.stage = LargeFrame::Stage::none;
    if (f.payload && static_cast<wire::Op>(f.h.op) == wire::Op::replicate &&
        (!peer.replica_body || peer.replica_body->size() < f.payload->size())) {
      BudgetHold hold;
      if (hold.take(budget_, f.payload->size())) {
        peer.replica_body = std::move(f.payload);
        peer.replica_body_charged = std::move(hold);
      }
    }
    f.payload.reset();
    give_back_if_large(peer.keys);
    peer.in_deadline_ns.store(0, std::memory_order_relaxed);
    if (peer.in_begin == peer.in_end) peer.in_begin = peer.in_end = 0;
  };
  // Reads into [dst, dst + want): first what `in` holds, then from the socket. The result is the
  // bytes gained, 0 for nothing waiting, -1 for a closed or failed connection.
  auto take = [&](char* dst, std::uint64_t want) -> ssize_t {
    if (const std::size_t buffered = peer.in_end - peer.in_begin; buffered > 0) {
      const std::size_t n = std::min<std::uint64_t>(buffered, want);
      std::memcpy(dst, peer.in_bytes() + peer.in_begin, n);
      peer.in_begin += n;
      if (peer.in_begin == peer.in_end) peer.in_begin = peer.in_end = 0;
      return static_cast<ssize_t>(n);
    }
    return read_frame_bytes(peer, dst, want);
  };
  for (;;) {
    switch (f.stage) {
      case LargeFrame::Stage::none:
        return Progress::done;
      case LargeFrame::Stage::keys: {
        if (f.key_have < key_bytes) {
          const ssize_t n = take(reinterpret_cast<char*>(peer.keys.data()) + f.key_have, key_bytes - f.key_have);
          if (n < 0) return Progress::close;
          if (n == 0) return Progress::need_more;
          f.key_have += static_cast<std::uint64_t>(n);
          f.progress += static_cast<std::uint64_t>(n);
          continue;
        }
        std::string why;
        if (Errc e = wire::validate_keys(f.h, peer.keys, &why); e != Errc::ok) {
          finish();
          bad_frame(peer, f.h, e, why);
          return Progress::close;
        }
        // Refused for capacity: the key table is already read, only the payload is left to drop,
        // and then the refusal is answered with nothing applied.
        auto refuse_payload = [&](std::string why) {
          f.refusal = Errc::capacity;
          f.refusal_why = std::move(why);
          f.have = 0;
          f.stage = LargeFrame::Stage::discard;
          f.key_have = key_bytes;
        };
        const bool stream = streams(peer, f.h);
        std::string behind;
        if (stream && !reserve_for_replicas(peer, /*creating=*/false, &behind)) {
          refuse_payload(std::move(behind));
        } else if (stream) {
          // Every key is checked before any value is read: a bad one is answered after the
          // payload is drained, with nothing applied and the connection still good.
          f.found = engine_.find_slots(peer.keys, f.slots, &f.why);
          f.key = 0;
          f.done_floats = f.step = f.applied = 0;
          f.stage = LargeFrame::Stage::stream;
        } else if (!f.charged.take(budget_, f.h.payload_bytes)) {
          refuse_payload(over_budget(peer, f.h.payload_bytes, std::string(wire::op_name(f.h.op))));
        } else {
          f.have = 0;
          f.stage = LargeFrame::Stage::body;
        }
        continue;
      }
      case LargeFrame::Stage::body: {
        const std::uint64_t total = f.h.payload_bytes;
        if (f.have < total) {
          if (!f.payload && static_cast<wire::Op>(f.h.op) == wire::Op::replicate && peer.replica_body &&
              peer.replica_body->size() >= total) {
            f.payload = std::move(peer.replica_body);
            peer.replica_body_charged.reset();
          }
          if (!f.payload) f.payload = std::make_unique<HeapMemory>(total, "a request's payload", false);  // may throw
          const ssize_t n = take(reinterpret_cast<char*>(f.payload->data()) + f.have, total - f.have);
          if (n < 0) return Progress::close;
          if (n == 0) return Progress::need_more;
          f.have += static_cast<std::uint64_t>(n);
          f.progress += static_cast<std::uint64_t>(n);
          continue;
        }
        const bool ok = handle(peer, f.h, f.payload ? reinterpret_cast<const float*>(f.payload->data()) : nullptr);
        finish();
        return ok ? Progress::done : Progress::close;
      }
      case LargeFrame::Stage::discard: {
        const std::uint64_t left = key_bytes - f.key_have + f.h.payload_bytes - f.have;
        if (left > 0) {
          // Dropped through `in`: what follows the frame stays there for the next one.
          if (peer.in_end == peer.in_begin) {
            peer.in_begin = peer.in_end = 0;
            const ssize_t n = read_frame_bytes(peer, peer.in_bytes(), Peer::kInBytes);
            if (n < 0) return Progress::close;
            if (n == 0) return Progress::need_more;
            peer.in_end = static_cast<std::size_t>(n);
          }
          const std::uint64_t n = std::min<std::uint64_t>(peer.in_end - peer.in_begin, left);
          peer.in_begin += n;
          f.progress += n;
          const std::uint64_t from_keys = std::min(n, key_bytes - f.key_have);
          f.key_have += from_keys;
          f.have += n - from_keys;
          continue;
        }
        const bool ok = send_error(peer, f.h, f.refusal, f.refusal_why);
        finish();
        return ok ? Progress::done : Progress::close;
      }
      case LargeFrame::Stage::stream: {
        const Progress p = stream_push(peer);
        if (p == Progress::done) finish();
        return p;
      }
    }
  }
}

ssize_t TcpServer::read_frame_bytes(Peer& peer, char* dst, std::size_t bytes, bool wait) {
  // A thread that served its turn's worth gives the connection back as if nothing were
  // waiting; epoll hands it out again behind the other ready connections.
  if (peer.turn_bytes >= kTurnBytes) return 0;
  const int fd = peer.fd.get();
  ssize_t n = received(wait ? recv_spinning(fd, dst, bytes, kMidFrameSpin) : ::recv(fd, dst, bytes, MSG_DONTWAIT));
  if (wait && n == 0 && await_fast_sender(peer)) n = received(::recv(fd, dst, bytes, MSG_DONTWAIT));
  if (n > 0) peer.turn_bytes += static_cast<std::uint64_t>(n);
  return n;
}

bool TcpServer::await_fast_sender(Peer& peer) {
  // Handing the connection back to epoll costs a re-arm and a wake-up through the event loop
  // each time the sender falls behind, some 15% of a 1 MiB push. A sender that has kept up a
  // fast rate over this frame gets its thread to wait a moment in poll instead: a trickle can
  // never earn that, so no slow peer can hold a thread this way.
  const LargeFrame& f = peer.large;
  const std::int64_t elapsed_ns = std::max<std::int64_t>(steady_now_ns() - f.started_ns, 1);
  if (static_cast<double>(f.progress) * 1e9 / static_cast<double>(elapsed_ns) < double(kFastSenderBytesPerSecond))
    return false;
  pollfd p{peer.fd.get(), POLLIN, 0};
  return ::poll(&p, 1, kFastSenderPatienceMs) > 0;
}

bool TcpServer::streams(const Peer& peer, const wire::FrameHeader& h) const noexcept {
  // A checksum covers the whole frame, so nothing may be applied before all of it is in.
  return options_.push_in_pieces && static_cast<wire::Op>(h.op) == wire::Op::push && !(h.flags & wire::kChecksum) &&
         peer.authenticated && engine_.pushes_apply_in_pieces(wire::push_is_identified(h));
}

TcpServer::Progress TcpServer::stream_push(Peer& peer) {
  LargeFrame& f = peer.large;
  Store& store = engine_.store();
  char* in = peer.in_bytes();
  while (f.key < peer.keys.size()) {
    const std::uint64_t length = peer.keys[f.key].length;
    // A key of up to a piece is applied whole, as any key of a smaller frame is.
    const bool in_parts = length > kPushPieceFloats;
    const std::size_t least =
        (in_parts ? std::min<std::uint64_t>(length - f.done_floats, kPushLeastFloats) : length) * sizeof(float);
    if (peer.in_end - peer.in_begin < least) {
      if (peer.in_begin + least > Peer::kInBytes) peer.compact();
      // With floats in hand, take only what is already waiting: if nothing is, those are applied
      // while the rest travels, and a sender that stalls finds all it sent applied. Bytes past
      // this frame may come in too; they stay in `in` for the frames after it.
      const bool have_some = in_parts && peer.in_end - peer.in_begin >= sizeof(float);
      char* room = in + peer.in_end;
      const std::size_t room_bytes = Peer::kInBytes - peer.in_end;
      const ssize_t n = read_frame_bytes(peer, room, room_bytes, /*wait=*/!have_some);
      if (n < 0) return Progress::close;
      if (n > 0) {
        peer.in_end += static_cast<std::size_t>(n);
        continue;
      }
      if (!have_some) return Progress::need_more;  // epoll brings the connection back with more
    }
    const std::uint64_t in_floats = (peer.in_end - peer.in_begin) / sizeof(float);
    const std::size_t want =
        std::min<std::uint64_t>({length - f.done_floats, kPushPieceFloats, in_floats}) * sizeof(float);
    if (f.found == Errc::ok)
      store.apply_part(f.slots[f.key], f.done_floats, reinterpret_cast<const float*>(in + peer.in_begin),
                       want / sizeof(float), &f.step);
    peer.in_begin += want;
    f.progress += want;
    f.done_floats += want / sizeof(float);
    if (f.done_floats == length) {
      ++f.key;
      f.done_floats = f.step = 0;
      if (f.found == Errc::ok) ++f.applied;
    }
  }
  engine_.count_pushes(f.applied);
  if (f.found != Errc::ok && engine_.replicator()) engine_.replicator()->release(peer.keys);
  const bool ok = f.found != Errc::ok ? send_error(peer, f.h, f.found, f.why) : answer_applied(peer, f.h);
  return ok ? Progress::done : Progress::close;
}

bool TcpServer::handle(Peer& peer, const wire::FrameHeader& h, const float* payload) {
  std::string why;
  const auto op = static_cast<wire::Op>(h.op);
  if (!peer.said_hello && op != wire::Op::hello) {
    send_error(peer, h, Errc::protocol, "the first request on a connection must be hello");
    return false;
  }
  if (peer.said_hello && !peer.authenticated && op != wire::Op::auth)
    return refuse(peer, h, "sent " + std::string(wire::op_name(h.op)) + " before authenticating");
  if (wire::op_is_replication(op) && !peer.server_peer)
    return refuse(peer, h,
                  "sent " + std::string(wire::op_name(h.op)) +
                      ", which only another server of the ring may send (servers connect to each other as such)");
  if (h.flags & wire::kChecksum) {
    std::uint32_t crc = wire::crc32_update(0, peer.keys.data(), peer.keys.size() * sizeof(wire::KeyEntry));
    crc = wire::crc32_update(crc, payload, h.payload_bytes);
    if (crc != h.checksum)
      return send_error(peer, h, Errc::protocol, "checksum mismatch: the request was corrupted in transit");
  }

  Errc status = Errc::ok;
  switch (op) {
    case wire::Op::hello: {
      if (peer.said_hello) return refuse(peer, h, "said hello twice");
      if (h.arg1 != wire::kVersion) {
        send_error(peer, h, Errc::protocol,
                   "client speaks protocol " + std::to_string(h.arg1) + ", server " + std::to_string(wire::kVersion) +
                       ": use matching pskv builds");
        return false;
      }
      peer.said_hello = true;
      peer.hello_worker = static_cast<std::uint32_t>(h.arg0);
      const auth::Token* token = token_for(peer);
      if (!token) {
        peer.authenticated = true;
        return admit(peer, h);
      }
      if (h.payload_bytes != auth::kNonceBytes)
        return refuse(peer, h,
                      peer.hello_worker == wire::kServerPeer && options_.peer_token
                          ? "says it is a server but has no token (this server requires --peer-token-file on its peers)"
                          : "has no token (this server requires --auth-token-file on its clients too)");
      std::memcpy(peer.client_nonce.data(), payload, auth::kNonceBytes);
      peer.server_nonce = auth::random_nonce();
      const auth::Proof proof = token->server_proof(peer.client_nonce, peer.server_nonce);
      std::uint8_t challenge[auth::kNonceBytes + auth::kProofBytes];
      std::memcpy(challenge, peer.server_nonce.data(), auth::kNonceBytes);
      std::memcpy(challenge + auth::kNonceBytes, proof.data(), auth::kProofBytes);
      Reply r(reply_header(h, sizeof challenge), challenge, sizeof challenge);
      r.header.flags |= wire::kAuthChallenge;
      return send(peer, std::move(r));
    }
    case wire::Op::auth: {
      const auth::Token* token = token_for(peer);
      if (!token) return refuse(peer, h, "sent auth to a server without a token");
      if (peer.authenticated) return refuse(peer, h, "authenticated twice");
      auth::Proof got{};
      std::memcpy(got.data(), payload, auth::kProofBytes);
      if (!auth::proofs_equal(got, token->client_proof(peer.server_nonce, peer.client_nonce)))
        return refuse(peer, h, "failed the challenge: its token differs from this server's");
      peer.authenticated = true;
      return admit(peer, h);
    }
    case wire::Op::init:
      if (!reserve_for_replicas(peer, /*creating=*/true, &why)) return send_error(peer, h, Errc::capacity, why);
      status = engine_.init(peer.keys, payload, &why);
      if (status == Errc::ok) return answer_applied(peer, h);
      if (engine_.replicator()) engine_.replicator()->release(peer.keys);
      break;
    case wire::Op::push:
      if (!reserve_for_replicas(peer, /*creating=*/false, &why)) return send_error(peer, h, Errc::capacity, why);
      status = engine_.push(peer.worker, wire::push_clock(h), peer.keys, payload, &why, nullptr,
                            PushId{.session = wire::push_session(h), .seq = h.arg1});
      if (status == Errc::ok) return answer_applied(peer, h);
      if (engine_.replicator()) engine_.replicator()->release(peer.keys);
      break;
    case wire::Op::replicate:
      status = engine_.take_replicate(static_cast<std::uint32_t>(h.arg0), h.arg1, peer.keys, payload, &why, peer.tag(),
                                      static_cast<std::uint32_t>(h.arg0 >> 32));
      break;
    case wire::Op::replica_clock:
    case wire::Op::replica_barrier:
    case wire::Op::replica_evict: {
      if (h.num_keys != 0) {
        status = Errc::protocol;
        why = std::string(wire::op_name(h.op)) + " carries no keys";
        break;
      }
      const auto word = static_cast<WorkerWord>(h.op - static_cast<std::uint16_t>(wire::Op::replica_clock));
      status = engine_.apply_replica_word(word, wire::replica_clock_origin(h), wire::replica_clock_worker(h),
                                          wire::worker_word_value(h), &why);
      break;
    }
    case wire::Op::replica_pull:
      return answer_records(peer, h);
    case wire::Op::replica_table:
    case wire::Op::replica_rows:
    case wire::Op::replica_unrows:
    case wire::Op::replica_rows_marked:
      status = replication::apply_table_frame(engine_, h, peer.keys, payload, peer.tag(), &why);
      break;
    case wire::Op::replica_table_rows:
      return answer_table_rows(peer, h);
    case wire::Op::replica_index: {
      std::vector<std::pair<Key, std::uint32_t>> keys;
      std::vector<std::uint64_t> words;
      bool synced = false;
      if ((status = engine_.replica_index(static_cast<std::uint32_t>(h.arg0), &keys, &synced, &words, &why)) !=
          Errc::ok)
        break;
      const std::string bytes = wire::encode_replica_index(synced, keys, words);
      if (bytes.size() > options_.limits.max_payload_bytes) {
        status = Errc::capacity;
        why = "the replica index of " + std::to_string(bytes.size()) + " bytes exceeds --max-request-mb";
        break;
      }
      Reply r(reply_header(h, bytes.size()), bytes.data(), bytes.size());
      r.header.flags |= wire::kText;  // opaque bytes the requester asked for, read as a text payload
      return send(peer, std::move(r));
    }
    case wire::Op::pull: {
      if (engine_.pull_allowed(peer.worker, h.arg0)) return answer_pull(peer, h, peer.keys, /*owner=*/true);
      // Checked before it waits, so a parked pull holds only what it will be answered with.
      thread_local std::vector<SlotRef> slots;
      status = engine_.check_pull_clock(peer.worker, h.arg0, &why);
      if (status == Errc::ok) status = check_pull(peer, peer.keys, slots, nullptr, &why);
      if (status != Errc::ok) break;
      std::unique_ptr<Parked> parked = park(peer, h, peer.keys);
      if (!parked) {
        status = Errc::capacity;
        why = over_budget(peer, parked_bytes(peer.keys.size()), "parked pull");
        break;
      }
      engine_.park_pull(peer.worker, h.arg0, std::move(parked));
      return true;
    }
    case wire::Op::clock: {
      if (Errc e = engine_.check_worker(peer.worker, &why); e != Errc::ok) {
        status = e;
        break;
      }
      if (Errc e = engine_.check_replicable(h.arg0, "clock", &why); e != Errc::ok) {
        status = e;
        break;
      }
      if (h.arg0 == kClockDone) peer.finished = true;
      const std::uint64_t bound = engine_.advance_clock(peer.worker, h.arg0);
      // Answered once the replicas know it too: a restarted server then knows every clock it
      // acknowledged, and no worker waits on it for a clock the worker will not send again.
      if (Replicator* replicator = engine_.replicator()) {
        replicator->ship_clock(peer.worker, h.arg0, park(peer, h, {}, /*charge=*/false));
        return true;
      }
      return send_empty(peer, h, bound);
    }
    case wire::Op::barrier:
      if (Errc e = engine_.check_worker(peer.worker, &why); e != Errc::ok) {
        status = e;
        break;
      }
      if (std::unique_ptr<Parked> parked = park(peer, h, {})) {
        engine_.barrier(peer.worker, h.arg0, std::move(parked));
        return true;
      }
      status = Errc::capacity;
      why = over_budget(peer, parked_bytes(0), "barrier");
      break;
    case wire::Op::stats: {
      const std::string json = engine_.stats_json(0, stats_fields());
      Reply r(reply_header(h, json.size()), json.data(), json.size());
      r.header.flags |= wire::kText;  // a text payload
      return send(peer, std::move(r));
    }
    case wire::Op::lookup:
    case wire::Op::wait:
      status = Errc::unsupported;
      why = std::string(wire::op_name(h.op)) + " is an rdma:// operation; TCP clients pull values directly";
      break;
    case wire::Op::table_create:
    case wire::Op::table_pull:
    case wire::Op::table_push:
      return handle_table(peer, h, payload);
    case wire::Op::down_vote:
    case wire::Op::down_certified:
    case wire::Op::hand_back:
      status = replication::take_failover_frame(engine_, op, peer.keys, payload, h.payload_bytes, &why);
      break;
    case wire::Op::certificates: {
      std::string text;
      if ((status = replication::read_certificates(engine_, h.arg0, &text, &why)) != Errc::ok) break;
      Reply r(reply_header(h, text.size()), text.data(), text.size());
      r.header.flags |= wire::kText;
      return send(peer, std::move(r));
    }
  }
  if (status != Errc::ok) return send_error(peer, h, status, why);
  return send_empty(peer, h);
}

bool TcpServer::handle_table(Peer& peer, const wire::FrameHeader& h, const float* payload) {
  const auto op = static_cast<wire::Op>(h.op);
  if (op == wire::Op::table_pull) return answer_table_pull(peer, h);
  std::string why;
  bool parked = false;
  const replication::Park park_reply = [&] { return park(peer, h, {}, /*charge=*/false); };
  const Errc status =
      op == wire::Op::table_create
          ? replication::create_table(engine_, peer.keys, payload, park_reply, &why, &parked)
          : replication::push_table(engine_, h, peer.keys, payload, peer.worker, park_reply, &why, &parked);
  if (parked) return true;
  if (status != Errc::ok) return send_error(peer, h, status, why);
  return send_empty(peer, h);
}

bool TcpServer::answer_table_pull(Peer& peer, const wire::FrameHeader& h) {
  std::string why;
  std::uint64_t bytes = 0;
  if (Errc e = reply_size(peer, peer.keys, "rows", &bytes, &why); e != Errc::ok) return send_error(peer, h, e, why);
  Reply r(reply_header(h, bytes, engine_.observed_bound()));
  float* payload = nullptr;
  if (Errc e = reply_buffer(peer, r, bytes, /*owner=*/true, "table_pull reply", &payload, &why); e != Errc::ok)
    return send_error(peer, h, e, why);
  if (Errc e = engine_.table_pull(h.arg1, peer.keys, payload, &why); e != Errc::ok) return send_error(peer, h, e, why);
  return send_values(peer, h, std::move(r), payload, bytes);
}

bool TcpServer::answer_table_rows(Peer& peer, const wire::FrameHeader& h) {
  std::string why, bytes;
  if (Errc e = replication::read_table_page(engine_, h, peer.keys, options_.limits.max_payload_bytes, &bytes, &why);
      e != Errc::ok)
    return send_error(peer, h, e, why);
  Reply r(reply_header(h, bytes.size()), bytes.data(), bytes.size());
  r.header.flags |= wire::kText;  // opaque bytes the requester asked for, read as a text payload
  return send(peer, std::move(r));
}

bool TcpServer::reserve_for_replicas(Peer& peer, bool creating, std::string* why) {
  Replicator* replicator = engine_.replicator();
  if (!replicator || replicator->reserve(peer.keys, creating, why) == Errc::ok) return true;
  log::warn("tcp.replication-refused", "server " + std::to_string(engine_.options().server_id) +
                                           " refused a request of " + peer.address + ": " + *why);
  return false;
}

bool TcpServer::answer_applied(Peer& peer, const wire::FrameHeader& h) {
  Replicator* replicator = engine_.replicator();
  if (!replicator) return send_empty(peer, h);
  // The reply waits until every live replica holds these keys. It is parked whatever the budget
  // says: the push is applied and must reach the replicas, and a connection never has more than
  // kMaxParkedPerConnection parked (its reading pauses).
  replicator->ship(peer.keys, park(peer, h, {}, /*charge=*/false));
  return true;
}

bool TcpServer::answer_records(Peer& peer, const wire::FrameHeader& h) {
  std::uint64_t floats = 0;
  for (const wire::KeyEntry& k : peer.keys) floats += k.length;
  if (floats * sizeof(float) > options_.limits.max_payload_bytes)
    return send_error(peer, h, Errc::capacity,
                      "replica_pull asks for " + std::to_string(floats * sizeof(float)) +
                          " bytes, more than --max-request-mb; ask for fewer keys at a time");
  BudgetHold hold;
  if (!hold.take(budget_, floats * sizeof(float)))
    return send_error(peer, h, Errc::capacity, over_budget(peer, floats * sizeof(float), "replica_pull reply"));
  std::vector<float> out(floats);
  std::string why;
  if (Errc e = engine_.read_records(static_cast<std::uint32_t>(h.arg0), peer.keys, out.data(), &why); e != Errc::ok)
    return send_error(peer, h, e, why);
  return send(peer, Reply(reply_header(h, floats * sizeof(float)), out.data(), floats * sizeof(float)));
}

std::uint64_t TcpServer::parked_bytes(std::size_t keys) noexcept {
  return sizeof(ParkedRequest) + keys * sizeof(wire::KeyEntry);
}

std::unique_ptr<Parked> TcpServer::park(Peer& peer, const wire::FrameHeader& h, std::vector<wire::KeyEntry> keys,
                                        bool charge) {
  BudgetHold hold;
  if (charge && !hold.take(budget_, parked_bytes(keys.size()))) return nullptr;
  std::lock_guard lock(peer.mu);
  ++peer.parked;
  return std::make_unique<ParkedRequest>(*this, peer.shared_from_this(), h, std::move(keys), std::move(hold));
}

Errc TcpServer::check_pull(const Peer& peer, std::span<const wire::KeyEntry> keys, std::vector<SlotRef>& slots,
                           std::uint64_t* bytes, std::string* why) {
  // The reply is sized from the store's own records, once every key is found with the length
  // asked for, and never past the request limit: a short request cannot ask for a huge reply.
  if (Errc e = engine_.find_slots(keys, slots, why); e != Errc::ok) return e;
  // Each key's length is the store's own record: find_slots checked the request's against it.
  std::uint64_t size = 0;
  if (Errc e = reply_size(peer, keys, "keys", &size, why); e != Errc::ok) return e;
  if (bytes) *bytes = size;
  return Errc::ok;
}

Errc TcpServer::reply_size(const Peer& peer, std::span<const wire::KeyEntry> keys, const char* what,
                           std::uint64_t* bytes, std::string* why) {
  std::uint64_t floats = 0;
  for (const wire::KeyEntry& k : keys) floats += k.length;
  *bytes = floats * sizeof(float);
  if (*bytes <= options_.limits.max_payload_bytes) return Errc::ok;
  log::warn("tcp.limit", "server " + std::to_string(engine_.options().server_id) + ": " + peer.who() + " asked for a " +
                             std::to_string(*bytes) + "-byte pull reply, over --max-request-mb; refused");
  *why = "the reply would be " + std::to_string(*bytes) + " bytes, over the server's limit of " +
         std::to_string(options_.limits.max_payload_bytes) + " (--max-request-mb); pull fewer " + what + " at a time";
  return Errc::capacity;
}

bool TcpServer::send_values(Peer& peer, const wire::FrameHeader& h, Reply&& r, const float* payload,
                            std::uint64_t bytes) {
  r.payload = payload;
  r.payload_bytes = bytes;
  if (h.flags & wire::kChecksum) {
    r.header.flags |= wire::kChecksum;
    r.header.checksum = wire::crc32_update(0, r.payload, bytes);
  }
  return send(peer, std::move(r));
}

bool TcpServer::answer_pull(Peer& peer, const wire::FrameHeader& h, std::span<const wire::KeyEntry> keys, bool owner) {
  thread_local std::vector<SlotRef> slots;
  std::string why;
  std::uint64_t bytes = 0;
  if (Errc e = check_pull(peer, keys, slots, &bytes, &why); e != Errc::ok) return send_error(peer, h, e, why);
  engine_.count_pulls(keys.size());
  const std::uint64_t floats = bytes / sizeof(float);
  if ((h.flags & wire::kFromStore) && !(h.flags & wire::kChecksum) && bytes >= kFromStoreBytes)
    return send_from_store(peer, h, keys, slots, floats);
  Reply r(reply_header(h, bytes, engine_.observed_bound()));
  float* payload = nullptr;  // none for an empty reply
  if (Errc e = reply_buffer(peer, r, bytes, owner, "pull reply", &payload, &why); e != Errc::ok)
    return send_error(peer, h, e, why);
  float* out = payload;
  for (std::size_t i = 0; i < slots.size(); ++i) {
    Store::prefetch_ahead(slots, i);
    engine_.store().read_slot_or_lock(slots[i], out);
    out += keys[i].length;
  }
  return send_values(peer, h, std::move(r), payload, bytes);
}

Errc TcpServer::reply_buffer(Peer& peer, Reply& r, std::uint64_t bytes, bool owner, const char* what, float** out,
                             std::string* why) {
  *out = nullptr;
  if (bytes == 0) return Errc::ok;
  if (owner && bytes <= Peer::kInBytes) {
    // The connection's own buffer: only its owner answers from it.
    if (peer.reply.size() < bytes / sizeof(float)) peer.reply.resize(Peer::kInBytes / sizeof(float));
    *out = peer.reply.data();
    return Errc::ok;
  }
  if (!r.charged.take(budget_, bytes)) {
    *why = over_budget(peer, bytes, what);
    return Errc::capacity;
  }
  try {
    r.owned_values = std::make_unique<HeapMemory>(bytes, what, false);
  } catch (const std::exception& e) {
    *why = e.what();
    return Errc::capacity;
  }
  *out = reinterpret_cast<float*>(r.owned_values->data());
  return Errc::ok;
}

bool TcpServer::send_from_store(Peer& peer, const wire::FrameHeader& h, std::span<const wire::KeyEntry> keys,
                                std::span<const SlotRef> slots, std::uint64_t floats) {
  Reply r(reply_header(h, floats * sizeof(float), engine_.observed_bound()), nullptr, floats * sizeof(float));
  r.header.flags |= wire::kFromStore;
  r.from_store = true;
  r.slots.reserve(slots.size());
  r.versions.reserve(slots.size());
  r.store_iov.reserve(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    Store::prefetch_ahead(slots, i);
    r.slots.push_back(slots[i].slot);
    r.versions.push_back(stable_version(*slots[i].slot));
    r.store_iov.push_back({slots[i].slot->values(), std::size_t{keys[i].length} * sizeof(float)});
  }
  return send(peer, std::move(r));
}

bool TcpServer::send(Peer& peer, Reply&& reply) {
  std::lock_guard lock(peer.mu);
  std::uint64_t ignored = 0;
  // Straight out while nothing is queued ahead: the common case costs no copy and no queue.
  if (peer.closed || (peer.out.empty() && !reply.write_out(peer.fd.get(), &ignored))) return false;
  if (reply.sent == reply.total()) return true;
  // The peer is not taking it now: keep what is left, with a deadline for the peer to take it.
  reply.keep_payload();
  if (!reply.charged.take(budget_, reply.owned.size())) {
    // Half sent, it cannot be refused any more; a peer that leaves replies unread while the
    // budget is spent loses its connection, as Redis's output-buffer limit drops a client.
    expire_locked(peer, "left replies unread while the server's memory budget (--memory-budget-mb) was spent");
    return false;
  }
  reply.deadline_ns = steady_now_ns() + frame_deadline(reply.total() - reply.sent).count();
  peer.queued_bytes += reply.total() - reply.sent;
  if (peer.out.empty()) peer.out_deadline_ns.store(reply.deadline_ns, std::memory_order_relaxed);
  peer.out.push_back(std::make_unique<Reply>(std::move(reply)));
  return true;
}

bool TcpServer::flush_locked(Peer& peer) {
  while (!peer.out.empty()) {
    Reply& r = *peer.out.front();
    std::uint64_t sent_now = 0;
    const bool ok = r.write_out(peer.fd.get(), &sent_now);
    peer.queued_bytes -= sent_now;
    if (!ok) return false;
    if (r.sent < r.total()) return true;  // the socket is full: EPOLLOUT brings it back
    peer.out.pop_front();
    peer.out_deadline_ns.store(peer.out.empty() ? 0 : peer.out.front()->deadline_ns, std::memory_order_relaxed);
  }
  return true;
}

bool TcpServer::send_error(Peer& peer, const wire::FrameHeader& req, Errc status, const std::string& why) {
  Reply r(reply_header(req, why.size()), why.data(), why.size());
  r.header.flags |= wire::kText;
  r.header.status = static_cast<std::uint16_t>(status);
  return send(peer, std::move(r));
}

bool TcpServer::send_empty(Peer& peer, const wire::FrameHeader& req, std::uint64_t arg0, std::uint32_t arg1) {
  return send(peer, Reply(reply_header(req, 0, arg0, arg1)));
}

bool TcpServer::admit(Peer& peer, const wire::FrameHeader& h) {
  std::string why;
  peer.server_peer = peer.hello_worker == wire::kServerPeer;
  if (peer.server_peer && !engine_.takes_server_peers())
    return refuse(peer, h, "said hello as a server of a replicating ring, but this server does not replicate");
  const std::uint32_t worker = peer.server_peer ? kNoWorker : peer.hello_worker;
  if (worker != kNoWorker) {
    if (Errc e = engine_.check_worker(worker, &why); e != Errc::ok) {
      log::warn("tcp.refused",
                "server " + std::to_string(engine_.options().server_id) + " refused " + peer.address + ": " + why);
      send_error(peer, h, e, why);
      return false;
    }
  }
  peer.worker = worker;
  peer.handshaken.store(true, std::memory_order_relaxed);
  if (worker != kNoWorker) engine_.worker_joined(worker);
  return send_empty(peer, h, wire::hello_reply_arg0(engine_.options().server_id, engine_.epoch_seconds()),
                    engine_.options().num_workers);
}

const auth::Token* TcpServer::token_for(const Peer& peer) const noexcept {
  if (peer.hello_worker == wire::kServerPeer && options_.peer_token) return options_.peer_token.get();
  return options_.token.get();
}

bool TcpServer::refuse(Peer& peer, const wire::FrameHeader& h, const std::string& what) {
  refused_.fetch_add(1, std::memory_order_relaxed);
  send_error(peer, h, Errc::permission, auth::refuse(engine_.options().server_id, peer.address, what));
  return false;
}

}  // namespace pskv::tcp
