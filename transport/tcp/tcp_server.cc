#include "transport/tcp/tcp_server.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <iostream>

namespace pskv::tcp {

// One client connection. The owning I/O thread (EPOLLONESHOT) reads and handles requests;
// replies may also be sent by a thread resuming a parked pull, so sends take send_mu.
class Peer : public std::enable_shared_from_this<Peer> {
 public:
  Peer(int fd, std::string address) : fd(fd), address(std::move(address)) {}

  // Sends a reply unless the connection is already closed. Thread-safe.
  bool send(wire::FrameHeader& h, const void* payload, std::size_t bytes) {
    std::lock_guard lock(send_mu);
    if (closed) return false;
    iovec iov[2] = {{&h, sizeof h}, {const_cast<void*>(payload), bytes}};
    return writev_full(fd.get(), iov, bytes ? 2 : 1) == IoResult::ok;
  }
  // Sends `iov` (a reply header, then each slot's values straight out of the store) and then a
  // u32: 0 if no slot's seqlock moved across the send, 1 if a push got in and the client must
  // ask again. Saves the copy into a reply buffer; the kernel's copy is the only one.
  bool send_from_store(std::vector<iovec>& iov, std::span<SlotHeader* const> slots) {
    thread_local std::vector<std::uint64_t> versions;
    std::lock_guard lock(send_mu);
    if (closed) return false;
    versions.clear();
    for (const SlotHeader* s : slots) versions.push_back(Store::stable_version(*s));
    IoResult sent;
    {
      const SeqlockReadScope racy_reads;  // validated by the versions below
      sent = writev_full(fd.get(), iov.data(), static_cast<int>(iov.size()), /*more=*/true);
    }
    if (sent != IoResult::ok) return false;
    std::atomic_thread_fence(std::memory_order_acquire);
    std::uint32_t torn = 0;
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (slots[i]->seq.load(std::memory_order_relaxed) != versions[i]) torn = 1;
    iovec t{&torn, sizeof torn};
    return writev_full(fd.get(), &t, 1) == IoResult::ok;
  }
  bool send_error(const wire::FrameHeader& req, Errc status, const std::string& why) {
    wire::FrameHeader h = wire::make_header(static_cast<wire::Op>(req.op), req.request_id, 0, why.size());
    h.flags = wire::kResponse | wire::kErrorText;
    h.status = static_cast<std::uint16_t>(status);
    return send(h, why.data(), why.size());
  }
  void close() {
    std::lock_guard lock(send_mu);
    if (closed) return;
    closed = true;
    ::shutdown(fd.get(), SHUT_RDWR);
    fd.reset();
  }

  Fd fd;
  const std::string address;  // host:port, for the log
  // Ownership passes between I/O threads through epoll (rearm, then another thread's wait);
  // this release/acquire pair states that handoff in the memory model (and to TSan).
  std::atomic<std::uint32_t> handoff{0};
  std::mutex send_mu;
  bool closed = false;
  bool said_hello = false;
  bool authenticated = false;  // passed the token challenge (or the server has no token)
  std::uint32_t hello_worker = kNoWorker;  // admitted once authenticated
  auth::Nonce client_nonce{}, server_nonce{};
  bool finished = false;  // the worker announced it is done (clock = kClockDone)
  std::uint32_t worker = kNoWorker;
  // Owned by the I/O thread that holds the connection. Requests are read with one recv into
  // `in` and parsed from there; only frames larger than `in` are read straight into `payload`.
  static constexpr std::size_t kInBytes = 256 << 10;
  std::unique_ptr<float[]> in{new float[kInBytes / sizeof(float)]};  // float-aligned frames
  std::size_t in_begin = 0, in_end = 0;
  std::vector<wire::KeyEntry> keys;
  std::vector<float> payload;
  std::vector<float> reply;
  char* in_bytes() { return reinterpret_cast<char*>(in.get()); }
};

static_assert(TcpServer::kPushPieceFloats * sizeof(float) <= Peer::kInBytes, "a push piece must fit the receive buffer");

namespace {

wire::FrameHeader reply_header(const wire::FrameHeader& req, std::uint64_t payload_bytes, std::uint64_t arg0 = 0,
                               std::uint32_t arg1 = 0) {
  wire::FrameHeader h =
      wire::make_header(static_cast<wire::Op>(req.op), req.request_id, 0, payload_bytes, arg0, arg1);
  h.flags = wire::kResponse;
  return h;
}

// A pull waiting for the consistency bound. Holds its own copy of the key table: the connection
// keeps serving other requests meanwhile.
class ParkedPull final : public Parked {
 public:
  ParkedPull(std::shared_ptr<Peer> peer, ShardEngine& engine, const wire::FrameHeader& req,
             std::vector<wire::KeyEntry> keys)
      : peer_(std::move(peer)), engine_(engine), req_(req), keys_(std::move(keys)) {}
  void resume(Errc status, const std::string& why) override {
    if (status != Errc::ok) {
      peer_->send_error(req_, status, why);
      return;
    }
    std::uint64_t floats = 0;
    for (const auto& k : keys_) floats += k.length;
    std::vector<float> values(floats);
    std::string err;
    if (Errc e = engine_.pull(keys_, values.data(), &err); e != Errc::ok) {
      peer_->send_error(req_, e, err);
      return;
    }
    wire::FrameHeader h = reply_header(req_, floats * sizeof(float), engine_.observed_bound());
    if (req_.flags & wire::kChecksum) {
      h.flags |= wire::kChecksum;
      h.checksum = wire::crc32_update(0, values.data(), values.size() * sizeof(float));
    }
    peer_->send(h, values.data(), values.size() * sizeof(float));
  }

 private:
  std::shared_ptr<Peer> peer_;
  ShardEngine& engine_;
  wire::FrameHeader req_;
  std::vector<wire::KeyEntry> keys_;
};

class ParkedAck final : public Parked {
 public:
  ParkedAck(std::shared_ptr<Peer> peer, const wire::FrameHeader& req) : peer_(std::move(peer)), req_(req) {}
  void resume(Errc status, const std::string& why) override {
    if (status != Errc::ok) {
      peer_->send_error(req_, status, why);
      return;
    }
    wire::FrameHeader h = reply_header(req_, 0);
    peer_->send(h, nullptr, 0);
  }

 private:
  std::shared_ptr<Peer> peer_;
  wire::FrameHeader req_;
};

// Reads `bytes` into `buf`, growing it only as data actually arrives, so a peer that declares a
// large frame and sends little cannot make the server allocate the declared size.
// `have_bytes` are already in place at the front of `buf`.
IoResult read_growing(int fd, std::vector<float>& buf, std::uint64_t bytes, std::size_t have_bytes) {
  constexpr std::size_t kStep = 4u << 20;
  if (buf.size() * sizeof(float) < std::min<std::uint64_t>(bytes, have_bytes + kStep))
    buf.resize(std::min<std::uint64_t>(bytes, have_bytes + kStep) / sizeof(float) + 1);
  std::size_t have = have_bytes;
  while (have < bytes) {
    if (buf.size() * sizeof(float) <= have) buf.resize(std::min<std::uint64_t>(bytes, have * 2) / sizeof(float) + 1);
    const std::size_t n = std::min<std::uint64_t>(bytes, buf.size() * sizeof(float)) - have;
    if (IoResult r = read_full(fd, reinterpret_cast<char*>(buf.data()) + have, n, kMidFrameSpin); r != IoResult::ok)
      return r;
    have += n;
  }
  return IoResult::ok;
}

}  // namespace

TcpServer::TcpServer(ShardEngine& engine, const Uri& uri, const TcpServerOptions& options)
    : engine_(engine), options_(options) {
  if (options_.io_threads == 0) options_.io_threads = 1;
  listen_fd_ = listen_tcp(uri.host, uri.port, 512);
  // accept_ready() drains the backlog until EAGAIN; a blocking listener would park the thread.
  fcntl(listen_fd_.get(), F_SETFL, fcntl(listen_fd_.get(), F_GETFL) | O_NONBLOCK);
  port_ = local_port(listen_fd_.get());
  epoll_fd_ = Fd(epoll_create1(EPOLL_CLOEXEC));
  wake_fd_ = Fd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!epoll_fd_ || !wake_fd_) throw Error(Errc::io, std::string("epoll/eventfd: ") + std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.ptr = nullptr;  // the listener
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, listen_fd_.get(), &ev);
  epoll_event wake{};
  wake.events = EPOLLIN;  // level-triggered: wakes every thread at stop
  wake.data.ptr = &wake_fd_;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, wake_fd_.get(), &wake);
  for (std::uint32_t i = 0; i < options_.io_threads; ++i) threads_.emplace_back([this] { io_loop(); });
}

TcpServer::~TcpServer() { stop(); }

void TcpServer::stop() {
  if (stopping_.exchange(true)) return;
  const std::uint64_t one = 1;
  [[maybe_unused]] auto n = ::write(wake_fd_.get(), &one, sizeof one);
  for (auto& t : threads_) t.join();
  std::lock_guard lock(peers_mu_);
  for (auto& [fd, peer] : peers_) peer->close();
  peers_.clear();
}

void TcpServer::io_loop() {
  epoll_event ev{};
  while (!stopping_.load()) {
    const int n = epoll_wait(epoll_fd_.get(), &ev, 1, -1);
    if (n <= 0) continue;
    if (ev.data.ptr == &wake_fd_) return;
    if (ev.data.ptr == nullptr) {
      accept_ready();
      continue;
    }
    auto* peer = static_cast<Peer*>(ev.data.ptr);
    peer->handoff.load(std::memory_order_acquire);
    if (ev.events & (EPOLLHUP | EPOLLERR) && !(ev.events & EPOLLIN)) {
      close_peer(*peer);
      continue;
    }
    // Serve every complete request that one recv brought in, then hand the connection back to
    // epoll (a oneshot rearm fires at once if more bytes are already waiting).
    const bool keep = serve_readable(*peer);
    if (keep)
      rearm(*peer);
    else
      close_peer(*peer);
  }
}

void TcpServer::rearm(Peer& peer) {
  // Once rearmed, another thread may take the peer and even close it; holding send_mu across
  // the epoll_ctl orders our last use of the fd before any close (which takes send_mu too).
  std::lock_guard lock(peer.send_mu);
  if (peer.closed) return;
  peer.handoff.fetch_add(1, std::memory_order_release);
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
  ev.data.ptr = &peer;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, peer.fd.get(), &ev);
}

void TcpServer::accept_ready() {
  for (;;) {
    sockaddr_storage from{};
    socklen_t from_len = sizeof from;
    const int fd = ::accept4(listen_fd_.get(), reinterpret_cast<sockaddr*>(&from), &from_len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) break;
    // Replies and frame bodies use blocking I/O bounded by the socket timeouts.
    const int flags = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    set_nodelay(fd);
    set_keepalive(fd, std::chrono::seconds(5));
    set_io_timeouts(fd, options_.frame_timeout, options_.frame_timeout);
    auto peer = std::make_shared<Peer>(fd, address_text(reinterpret_cast<const sockaddr*>(&from)));
    {
      std::lock_guard lock(peers_mu_);
      if (peers_.size() >= options_.max_connections) {
        refused_.fetch_add(1);
        wire::FrameHeader req = wire::make_header(wire::Op::hello, 0, 0, 0);
        peer->send_error(req, Errc::capacity,
                         "the server already has " + std::to_string(peers_.size()) +
                             " connections (--max-connections); try again later or raise the limit");
        peer->close();
        continue;
      }
      peers_[fd] = peer;
    }
    peer->handoff.fetch_add(1, std::memory_order_release);
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
    ev.data.ptr = peer.get();
    epoll_ctl(epoll_fd_.get(), EPOLL_CTL_ADD, fd, &ev);
  }
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLONESHOT;
  ev.data.ptr = nullptr;
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_MOD, listen_fd_.get(), &ev);
}

void TcpServer::close_peer(Peer& peer) {
  std::shared_ptr<Peer> keep;
  {
    std::lock_guard lock(peers_mu_);
    auto it = peers_.find(peer.fd.get());
    if (it == peers_.end()) return;
    keep = it->second;
    peers_.erase(it);
  }
  epoll_ctl(epoll_fd_.get(), EPOLL_CTL_DEL, peer.fd.get(), nullptr);
  const std::uint32_t worker = peer.worker;
  const bool cleanly = peer.finished;
  peer.close();
  if (worker != kNoWorker) engine_.worker_left(worker, cleanly);
}

bool TcpServer::serve_readable(Peer& peer) {
  const int fd = peer.fd.get();
  const ssize_t n = ::recv(fd, peer.in_bytes() + peer.in_end, Peer::kInBytes - peer.in_end, MSG_DONTWAIT);
  if (n == 0) return false;
  if (n < 0) return nothing_waiting(n) || errno == EINTR;
  peer.in_end += static_cast<std::size_t>(n);
  constexpr std::size_t kHeader = sizeof(wire::FrameHeader);
  while (peer.in_end - peer.in_begin >= kHeader) {
    const auto* at = reinterpret_cast<const std::byte*>(peer.in_bytes() + peer.in_begin);
    const std::size_t avail = peer.in_end - peer.in_begin;
    wire::ParsedFrame f;
    Errc status = Errc::ok;
    std::string why;
    const wire::ParseResult r = wire::parse_request(at, avail, options_.limits, &f, &peer.keys, &status, &why);
    const wire::FrameHeader& h = f.header;
    if (r == wire::ParseResult::bad) {
      // The stream cannot be trusted past a bad frame: answer if we can, then close.
      if (h.magic == wire::kMagic) peer.send_error(h, status, why);
      return false;
    }
    const float* payload = nullptr;
    if (r == wire::ParseResult::complete) {
      // Every frame is a whole number of 4-byte words, so payloads in `in` stay float-aligned.
      payload = reinterpret_cast<const float*>(f.payload);
      peer.in_begin += f.frame_bytes;
    } else if (f.frame_bytes <= Peer::kInBytes) {
      break;  // a small frame still arriving: epoll says when the rest is here
    } else {
      // A large frame: take what is buffered, then read the rest straight into place, bounded
      // by the frame timeout and growing buffers only as bytes arrive.
      const std::size_t key_bytes = std::size_t{h.num_keys} * sizeof(wire::KeyEntry);
      peer.keys.resize(h.num_keys);
      std::size_t have = avail - kHeader;
      const std::size_t key_have = std::min(have, key_bytes);
      if (key_have) std::memcpy(peer.keys.data(), at + kHeader, key_have);
      if (key_have < key_bytes &&
          read_full(fd, reinterpret_cast<char*>(peer.keys.data()) + key_have, key_bytes - key_have) != IoResult::ok)
        return false;
      if (Errc e = wire::validate_keys(h, peer.keys, &why); e != Errc::ok) {
        peer.send_error(h, e, why);
        return false;
      }
      have -= key_have;
      if (streams(peer, h)) {
        // A key table read past `in` leaves none of the payload there: it starts afresh at the
        // (float-aligned) start of `in`, not after the table's first bytes at any offset.
        const std::size_t payload_at = key_have < key_bytes ? 0 : peer.in_begin + kHeader + key_have;
        if (!stream_push(peer, h, payload_at, payload_at + have)) return false;
        continue;
      }
      const std::size_t prefix_floats = have / sizeof(float);
      if (peer.payload.size() < prefix_floats) peer.payload.resize(prefix_floats);
      if (have) std::memcpy(peer.payload.data(), at + kHeader + key_have, have);
      peer.in_begin = peer.in_end = 0;
      if (read_growing(fd, peer.payload, h.payload_bytes, have) != IoResult::ok) return false;
      payload = peer.payload.data();
    }
    if (!handle(peer, h, payload)) return false;
  }
  // What is left is the start of a frame: move it to the front, so the rest fits behind it (a
  // full buffer would leave the next recv no room, and its 0 would read as the peer closing).
  if (peer.in_begin > 0) {
    std::memmove(peer.in_bytes(), peer.in_bytes() + peer.in_begin, peer.in_end - peer.in_begin);
    peer.in_end -= peer.in_begin;
    peer.in_begin = 0;
  }
  return true;
}

bool TcpServer::streams(const Peer& peer, const wire::FrameHeader& h) const noexcept {
  // A checksum covers the whole frame, so nothing may be applied before all of it is in.
  return options_.push_in_pieces && static_cast<wire::Op>(h.op) == wire::Op::push && !(h.flags & wire::kChecksum) &&
         peer.authenticated && engine_.pushes_apply_in_pieces();
}

bool TcpServer::stream_push(Peer& peer, const wire::FrameHeader& h, std::size_t begin, std::size_t end) {
  thread_local std::vector<SlotHeader*> slots;
  std::string why;
  // Every key is checked before any value is read: a bad one is answered after the payload is
  // drained, with nothing applied and the connection still good.
  const Errc found = engine_.push_slots(peer.keys, slots, &why);
  Store& store = engine_.store();
  char* in = peer.in_bytes();
  std::size_t key = 0;
  std::uint64_t done_floats = 0;  // of keys[key]
  std::uint64_t step = 0;
  std::uint64_t applied = 0;
  bool ok = true;
  while (key < peer.keys.size()) {
    const std::uint64_t length = peer.keys[key].length;
    // A key of up to a piece is applied whole, as any key of a smaller frame is.
    const bool in_parts = length > kPushPieceFloats;
    const std::size_t least =
        (in_parts ? std::min<std::uint64_t>(length - done_floats, kPushLeastFloats) : length) * sizeof(float);
    if (end - begin < least) {
      if (begin + least > Peer::kInBytes) {
        std::memmove(in, in + begin, end - begin);
        end -= begin;
        begin = 0;
      }
      // Bytes past this frame may come in too; they stay in `in` for the frames after it.
      while (ok && end - begin < least) {
        // With floats in hand, take only what is already waiting: if nothing is, those are
        // applied while the rest travels, and a sender that stalls finds all it sent applied.
        const bool have_some = in_parts && end - begin >= sizeof(float);
        const ssize_t n = have_some ? ::recv(peer.fd.get(), in + end, Peer::kInBytes - end, MSG_DONTWAIT)
                                    : recv_some(peer.fd.get(), in + end, Peer::kInBytes - end, kMidFrameSpin);
        if (n > 0)
          end += static_cast<std::size_t>(n);
        else if (n < 0 && errno == EINTR)
          continue;
        else if (have_some && nothing_waiting(n))
          break;
        else
          ok = false;  // closed mid-frame, or the frame timeout passed
      }
      if (!ok) break;
    }
    const std::uint64_t in_floats = (end - begin) / sizeof(float);
    const std::size_t want = std::min<std::uint64_t>({length - done_floats, kPushPieceFloats, in_floats}) * sizeof(float);
    if (found == Errc::ok)
      store.apply_part(*slots[key], done_floats, reinterpret_cast<const float*>(in + begin), want / sizeof(float),
                       &step);
    begin += want;
    done_floats += want / sizeof(float);
    if (done_floats == length) {
      ++key;
      done_floats = step = 0;
      if (found == Errc::ok) ++applied;
    }
  }
  engine_.count_pushes(applied);
  if (!ok) return false;
  peer.in_begin = begin;
  peer.in_end = end;
  if (found != Errc::ok) return peer.send_error(h, found, why);
  wire::FrameHeader r = reply_header(h, 0);
  return peer.send(r, nullptr, 0);
}

bool TcpServer::handle(Peer& peer, const wire::FrameHeader& h, const float* payload) {
  std::string why;
  const auto op = static_cast<wire::Op>(h.op);
  if (!peer.said_hello && op != wire::Op::hello) {
    peer.send_error(h, Errc::protocol, "the first request on a connection must be hello");
    return false;
  }
  if (peer.said_hello && !peer.authenticated && op != wire::Op::auth)
    return refuse(peer, h, "sent " + std::string(wire::op_name(h.op)) + " before authenticating");
  if (h.flags & wire::kChecksum) {
    std::uint32_t crc = wire::crc32_update(0, peer.keys.data(), peer.keys.size() * sizeof(wire::KeyEntry));
    crc = wire::crc32_update(crc, payload, h.payload_bytes);
    if (crc != h.checksum) return peer.send_error(h, Errc::protocol, "checksum mismatch: the request was corrupted in transit");
  }

  Errc status = Errc::ok;
  switch (op) {
    case wire::Op::hello: {
      if (h.arg1 != wire::kVersion) {
        peer.send_error(h, Errc::protocol, "client speaks protocol " + std::to_string(h.arg1) + ", server " +
                                               std::to_string(wire::kVersion) + ": use matching pskv builds");
        return false;
      }
      peer.said_hello = true;
      peer.hello_worker = static_cast<std::uint32_t>(h.arg0);
      if (!options_.token) {
        peer.authenticated = true;
        return admit(peer, h);
      }
      if (h.payload_bytes != auth::kNonceBytes)
        return refuse(peer, h, "has no token (this server requires --auth-token-file on its clients too)");
      std::memcpy(peer.client_nonce.data(), payload, auth::kNonceBytes);
      peer.server_nonce = auth::random_nonce();
      const auth::Proof proof = options_.token->server_proof(peer.client_nonce, peer.server_nonce);
      std::uint8_t challenge[auth::kNonceBytes + auth::kProofBytes];
      std::memcpy(challenge, peer.server_nonce.data(), auth::kNonceBytes);
      std::memcpy(challenge + auth::kNonceBytes, proof.data(), auth::kProofBytes);
      wire::FrameHeader r = reply_header(h, sizeof challenge);
      r.flags |= wire::kAuthChallenge;
      return peer.send(r, challenge, sizeof challenge);
    }
    case wire::Op::auth: {
      if (!options_.token) {
        status = Errc::unsupported;
        why = "authentication is not enabled on this server";
        break;
      }
      if (peer.authenticated) return refuse(peer, h, "authenticated twice");
      auth::Proof got{};
      std::memcpy(got.data(), payload, auth::kProofBytes);
      if (!auth::proofs_equal(got, options_.token->client_proof(peer.server_nonce, peer.client_nonce)))
        return refuse(peer, h, "failed the challenge: its token differs from this server's");
      peer.authenticated = true;
      return admit(peer, h);
    }
    case wire::Op::init:
      status = engine_.init(peer.keys, payload, &why);
      break;
    case wire::Op::push:
      status = engine_.push(peer.worker, h.arg0, peer.keys, payload, &why);
      break;
    case wire::Op::pull: {
      if (!engine_.pull_allowed(peer.worker, h.arg0)) {
        engine_.park_pull(peer.worker, h.arg0,
                          std::make_unique<ParkedPull>(peer.shared_from_this(), engine_, h, peer.keys));
        return true;
      }
      std::uint64_t floats = 0;
      for (const auto& k : peer.keys) floats += k.length;
      if ((h.flags & wire::kFromStore) && !(h.flags & wire::kChecksum) && floats * sizeof(float) >= kFromStoreBytes)
        return send_from_store(peer, h, floats);
      if (peer.reply.size() < floats) peer.reply.resize(floats);
      status = engine_.pull(peer.keys, peer.reply.data(), &why);
      if (status != Errc::ok) break;
      wire::FrameHeader r = reply_header(h, floats * sizeof(float), engine_.observed_bound());
      if (h.flags & wire::kChecksum) {
        r.flags |= wire::kChecksum;
        r.checksum = wire::crc32_update(0, peer.reply.data(), floats * sizeof(float));
      }
      return peer.send(r, peer.reply.data(), floats * sizeof(float));
    }
    case wire::Op::clock: {
      if (Errc e = engine_.check_worker(peer.worker, &why); e != Errc::ok) {
        status = e;
        break;
      }
      if (h.arg0 == kClockDone) peer.finished = true;
      const std::uint64_t bound = engine_.advance_clock(peer.worker, h.arg0);
      wire::FrameHeader r = reply_header(h, 0, bound);
      return peer.send(r, nullptr, 0);
    }
    case wire::Op::barrier:
      if (Errc e = engine_.check_worker(peer.worker, &why); e != Errc::ok) {
        status = e;
        break;
      }
      engine_.barrier(peer.worker, h.arg0, std::make_unique<ParkedAck>(peer.shared_from_this(), h));
      return true;
    case wire::Op::stats: {
      const std::string json = engine_.stats_json();
      wire::FrameHeader r = reply_header(h, json.size());
      r.flags |= wire::kErrorText;  // a text payload
      return peer.send(r, json.data(), json.size());
    }
    case wire::Op::lookup:
    case wire::Op::wait:
      status = Errc::unsupported;
      why = std::string(wire::op_name(h.op)) + " is an rdma:// operation; TCP clients pull values directly";
      break;
  }
  if (status != Errc::ok) return peer.send_error(h, status, why);
  wire::FrameHeader r = reply_header(h, 0);
  return peer.send(r, nullptr, 0);
}

bool TcpServer::send_from_store(Peer& peer, const wire::FrameHeader& h, std::uint64_t floats) {
  thread_local std::vector<SlotHeader*> slots;
  thread_local std::vector<iovec> iov;
  std::string why;
  if (Errc e = engine_.pull_slots(peer.keys, slots, &why); e != Errc::ok) return peer.send_error(h, e, why);
  wire::FrameHeader r = reply_header(h, floats * sizeof(float), engine_.observed_bound());
  r.flags |= wire::kFromStore;
  iov.clear();
  iov.push_back({&r, sizeof r});
  for (SlotHeader* s : slots) iov.push_back({s->values(), std::size_t{s->length} * sizeof(float)});
  return peer.send_from_store(iov, slots);
}

bool TcpServer::admit(Peer& peer, const wire::FrameHeader& h) {
  std::string why;
  const std::uint32_t worker = peer.hello_worker;
  if (worker != kNoWorker) {
    if (Errc e = engine_.check_worker(worker, &why); e != Errc::ok) {
      peer.send_error(h, e, why);
      return false;
    }
  }
  peer.worker = worker;
  if (worker != kNoWorker) engine_.worker_joined(worker);
  wire::FrameHeader r = reply_header(h, 0, engine_.options().server_id, engine_.options().num_workers);
  return peer.send(r, nullptr, 0);
}

bool TcpServer::refuse(Peer& peer, const wire::FrameHeader& h, const std::string& what) {
  peer.send_error(h, Errc::permission, auth::refuse(engine_.options().server_id, peer.address, what));
  return false;
}

}  // namespace pskv::tcp
