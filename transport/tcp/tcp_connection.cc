#include "transport/tcp/tcp_connection.h"

#include <poll.h>
#include <sys/socket.h>

#include <cstring>
#include <thread>

#include "common/sync.h"

namespace pskv::tcp {

using transport::KeySlice;
using transport::Request;

namespace {
// Blocking reads return this often, so readers notice a silent server and waiters' deadlines.
constexpr std::chrono::milliseconds kReceiveTick{1000};
// How long answers may sit unread before the reader thread reads them, and how often it looks.
constexpr std::chrono::milliseconds kReaderGrace{2};
constexpr std::int64_t kGraceNs = std::chrono::nanoseconds(kReaderGrace).count();
// Nothing outstanding and nothing read for this long, the reader thread sleeps until a submit.
constexpr std::int64_t kReaderIdleNs = 100'000'000;
}  // namespace

TcpConnection::TcpConnection(const Uri& uri, const transport::ConnectOptions& options)
    : options_(options), endpoint_(uri.str()) {
  if (options_.max_in_flight == 0) options_.max_in_flight = 1;
  fd_ = connect_tcp(uri.host, uri.port, options.connect_timeout, options.cancel);
  set_io_timeouts(fd_.get(), options.io_timeout, options.io_timeout);
  handshake();
  in_flight_.resize(options_.max_in_flight);
  for (std::uint32_t i = options_.max_in_flight; i-- > 0;) free_.push_back(i);
  // Blocking reads return every second, so a server that goes quiet with requests outstanding
  // is declared gone after io_timeout, and readers look up from the socket now and then.
  set_io_timeouts(fd_.get(), kReceiveTick, options_.io_timeout);
  reader_ = std::thread([this] { reader_loop(); });
}

TcpConnection::~TcpConnection() {
  stopping_.store(true);
  ::shutdown(fd_.get(), SHUT_RDWR);
  wake_reader();
  if (reader_.joinable()) reader_.join();
  fail_all(Errc::peer_failure, "the connection to " + endpoint_ + " was closed by the client");
}

void TcpConnection::handshake() {
  const auth::Nonce client_nonce = options_.token ? auth::random_nonce() : auth::Nonce{};
  wire::FrameHeader h = wire::make_header(wire::Op::hello, 0, 0, options_.token ? auth::kNonceBytes : 0,
                                          options_.worker_id, wire::kVersion);
  iovec iov[2] = {{&h, sizeof h}, {const_cast<std::uint8_t*>(client_nonce.data()), auth::kNonceBytes}};
  if (writev_full(fd_.get(), iov, options_.token ? 2 : 1) != IoResult::ok)
    throw Error(Errc::peer_failure, "cannot send the hello to " + endpoint_);
  wire::FrameHeader r = read_handshake_reply("hello");
  std::uint8_t challenge[auth::kNonceBytes + auth::kProofBytes];
  const bool challenged = r.flags & wire::kAuthChallenge;
  if (challenged &&
      (r.payload_bytes != sizeof challenge || read_full(fd_.get(), challenge, sizeof challenge) != IoResult::ok))
    throw Error(Errc::protocol, endpoint_ + " sent a malformed authentication challenge");
  if (const auto proof = auth::answer(options_.token.get(), client_nonce, challenged ? challenge : nullptr,
                                      challenge + auth::kNonceBytes, endpoint_)) {
    wire::FrameHeader a = wire::make_header(wire::Op::auth, 0, 0, auth::kProofBytes);
    iovec aiov[2] = {{&a, sizeof a}, {const_cast<std::uint8_t*>(proof->data()), auth::kProofBytes}};
    if (writev_full(fd_.get(), aiov, 2) != IoResult::ok)
      throw Error(Errc::peer_failure, "cannot send the authentication proof to " + endpoint_);
    r = read_handshake_reply("auth");
  }
  if (r.payload_bytes != 0) throw Error(Errc::protocol, endpoint_ + " sent an unexpected payload in its hello reply");
  info_.server_id = static_cast<std::uint32_t>(r.arg0);
  info_.incarnation = static_cast<std::uint32_t>(r.arg0 >> 32);
  info_.num_workers = r.arg1;
}

wire::FrameHeader TcpConnection::read_handshake_reply(const char* step) {
  wire::FrameHeader r{};
  // A blocking read would wait out the io timeout whatever the canceller says.
  if (options_.cancel && poll_or_cancel(fd_.get(), POLLIN, options_.io_timeout, options_.cancel) < 0)
    throw Error(Errc::peer_failure,
                std::string("waiting for the ") + step + " reply from " + endpoint_ + " was cancelled");
  const IoResult res = read_full(fd_.get(), &r, sizeof r);
  if (res != IoResult::ok)
    throw Error(res == IoResult::timeout ? Errc::timeout : Errc::peer_failure,
                std::string("no ") + step + " reply from " + endpoint_ + " (" + io_result_text(res) +
                    "); is it a pskv server?");
  std::string why;
  if (Errc e = wire::validate_header(r, options_.limits, true, &why); e != Errc::ok)
    throw Error(e, std::string(step) + " reply from " + endpoint_ + ": " + why);
  if (r.status != 0) {
    std::string text(std::min<std::uint64_t>(r.payload_bytes, 4096), '\0');
    read_full(fd_.get(), text.data(), text.size());
    throw Error(static_cast<Errc>(r.status), endpoint_ + " refused the connection: " + text);
  }
  return r;
}

std::uint32_t TcpConnection::acquire_in_flight(Request* request, std::uint64_t* id) {
  std::unique_lock lock(in_flight_mu_);
  // A full window is freed by answers; this thread waits for a free entry, not on them, so the reader
  // thread must read them now rather than once they have sat unread for kReaderGrace.
  if (free_.empty()) rely_on_transport();
  in_flight_free_.wait(lock, [&] { return !free_.empty() || broken_ || send_broken_; });
  if (broken_ || send_broken_) return UINT32_MAX;
  const std::uint32_t i = free_.back();
  free_.pop_back();
  in_flight_[i].id = next_generation_++ * options_.max_in_flight + i;
  in_flight_[i].request = request;
  in_flight_[i].sending = true;
  in_flight_[i].asked_copy = false;
  *id = in_flight_[i].id;
  // The server's silence is timed from the moment something is outstanding.
  if (outstanding_.fetch_add(1) == 0) quiet_since_ns_.store(steady_now_ns(), std::memory_order_relaxed);
  return i;
}

void TcpConnection::release_in_flight(std::uint32_t index) {
  // The server answers a request once it has read all of it (or, refusing it early, closes the
  // connection, which fails the sender's writev), so its sender is past its buffers, if not yet
  // back from writev: wait for that rather than leave the completion to it, since a waiter
  // sleeping in this connection's socket would not hear of a completion made elsewhere.
  for (;;) {
    {
      std::lock_guard lock(in_flight_mu_);
      InFlight& e = in_flight_[index];
      if (!e.sending) {
        e.request = nullptr;
        e.receiving = false;
        free_.push_back(index);
        outstanding_.fetch_sub(1);
        break;
      }
    }
    std::this_thread::yield();
  }
  in_flight_free_.notify_one();
}

void TcpConnection::sent(std::uint32_t index) {
  Request* request = nullptr;
  Errc status = Errc::ok;
  std::string why;
  {
    std::lock_guard lock(in_flight_mu_);
    InFlight& e = in_flight_[index];
    e.sending = false;
    if (!e.deferred) return;
    request = e.request;
    status = e.deferred_status;
    why.swap(e.deferred_why);
    e.deferred = false;
    e.request = nullptr;
    free_.push_back(index);
    outstanding_.fetch_sub(1);
  }
  in_flight_free_.notify_one();
  request->completion->complete_part(status, why);
}

void TcpConnection::submit(Request& request) {
  std::uint64_t id = 0;
  const std::uint32_t index = acquire_in_flight(&request, &id);
  if (index == UINT32_MAX) {
    request.completion->complete_part(Errc::peer_failure, broken_why_);
    return;
  }
  // Pairs with reader_loop: either it sees this request outstanding, or we see it asleep.
  if (reader_sleeps_long_.load()) wake_reader();
  // Without checksums, large pull replies may come straight from the server's store.
  const wire::Op op = request.op;
  const bool from_store = op == wire::Op::pull && !options_.checksum;
  const IoResult res = send_request(id, request, from_store ? std::uint16_t{wire::kFromStore} : std::uint16_t{0});
  if (res != IoResult::ok) {
    const std::string why = "sending " + std::string(wire::op_name(static_cast<std::uint16_t>(op))) + " to " +
                            endpoint_ + " failed: " + io_result_text(res);
    if (res == IoResult::timeout) {
      // Half a frame went out: the stream is unusable both ways.
      ::shutdown(fd_.get(), SHUT_RDWR);
      fail_all(Errc::timeout, why);
      sent(index);
      return;
    }
    // The server closed while we were sending, typically after answering this very request
    // with an error (say, a request over its size limit). Stop sending but keep reading: the
    // readers deliver the replies already in the socket, then fail the rest at end of stream.
    {
      std::lock_guard lock(in_flight_mu_);
      send_broken_ = true;
      if (broken_why_.empty()) broken_why_ = why;
    }
    ::shutdown(fd_.get(), SHUT_WR);
  }
  sent(index);
}

IoResult TcpConnection::send_request(std::uint64_t id, const Request& request, std::uint16_t flags) {
  // The key table belongs to the sending thread, not to the request's entry: the reply can arrive
  // and the entry pass to another sender before this thread has even returned from writev.
  thread_local std::vector<wire::KeyEntry> entries;  // capacity persists across requests
  entries.clear();
  std::uint64_t payload = 0;
  for (const KeySlice& k : request.keys) {
    entries.push_back({k.key, k.length, 0});
    payload += std::uint64_t{k.length} * sizeof(float);
  }
  const bool values = wire::op_carries_values(request.op);
  wire::FrameHeader h = wire::make_header(request.op, id, static_cast<std::uint32_t>(request.keys.size()),
                                          values ? payload : 0, request.arg0, request.arg1);
  h.flags = flags;
  if (options_.checksum) {
    h.flags |= wire::kChecksum;
    std::uint32_t crc = wire::crc32_update(0, entries.data(), entries.size() * sizeof(wire::KeyEntry));
    if (values)
      for (const KeySlice& k : request.keys) crc = wire::crc32_update(crc, k.data, k.length * sizeof(float));
    h.checksum = crc;
  }
  std::lock_guard lock(send_mu_);
  iov_.clear();
  iov_.push_back({&h, sizeof h});
  if (!entries.empty())
    iov_.push_back({const_cast<wire::KeyEntry*>(entries.data()), entries.size() * sizeof(wire::KeyEntry)});
  if (values)
    for (const KeySlice& k : request.keys) iov_.push_back({k.data, std::size_t{k.length} * sizeof(float)});
  return writev_full(fd_.get(), iov_.data(), static_cast<int>(iov_.size()));
}

void TcpConnection::fail_all(Errc status, const std::string& why) {
  std::vector<Request*> victims;
  {
    std::lock_guard lock(in_flight_mu_);
    if (!broken_) {
      broken_ = true;
      if (!send_broken_) broken_why_ = why;
    }
    for (std::uint32_t i = 0; i < in_flight_.size(); ++i) {
      InFlight& e = in_flight_[i];
      if (!e.request || e.deferred || e.receiving) continue;  // a reader completes the one it reads
      if (e.sending) {
        e.deferred = true;
        e.deferred_status = status;
        e.deferred_why = why;
        continue;
      }
      victims.push_back(e.request);
      e.request = nullptr;
      free_.push_back(i);
      outstanding_.fetch_sub(1);
    }
  }
  in_flight_free_.notify_all();
  for (Request* r : victims) r->completion->complete_part(status, why);
  notify_followers();
}

void TcpConnection::release_read_side() noexcept {
  reading_.store(false);
  // Pairs with sleep_for_answers: a follower that found the read side taken is counted before
  // it looks again, so either it sees the side free or we see it waiting.
  notify_followers();
}

void TcpConnection::notify_followers() noexcept {
  if (followers_.load() == 0) return;
  turn_.fetch_add(1);
  futex_wake_all(&turn_);
}

void TcpConnection::wake_reader() noexcept {
  reader_word_.fetch_add(1);
  futex_wake(&reader_word_, 1);
}

void TcpConnection::poll() noexcept {
  if (outstanding_.load(std::memory_order_relaxed) == 0 || !take_read_side()) return;
  read_frames(ReadUntil::nothing_waits, nullptr, {});
  release_read_side();
}

bool TcpConnection::sleep_for_answers(const transport::Completion& c, std::chrono::steady_clock::time_point until,
                                      std::chrono::steady_clock::time_point deadline) noexcept {
  if (take_read_side() || follow(c, until)) {
    read_frames(ReadUntil::done, &c, until, deadline);
    release_read_side();
  }
  return true;
}

bool TcpConnection::follow(const transport::Completion& c, std::chrono::steady_clock::time_point until) noexcept {
  followers_.fetch_add(1);
  const std::uint32_t turn = turn_.load();
  const bool took = take_read_side();
  const auto left = until - std::chrono::steady_clock::now();
  if (!took && !c.done() && left > std::chrono::nanoseconds::zero()) futex_wait(&turn_, turn, left);
  followers_.fetch_sub(1);
  return took;
}

void TcpConnection::rely_on_transport() noexcept {
  if (reader_on_duty_.load() || summoned_.load()) return;
  summoned_.store(true);
  wake_reader();
}

void TcpConnection::reader_loop() {
  // Reads what no waiter reads: answers to requests nobody waits for yet (left in the socket,
  // large ones would stall the server's sends), once nothing was read for kReaderGrace; and
  // answers for waiters on several connections (summoned_). While the connection is in use it
  // looks every kReaderGrace; once nothing is outstanding and nothing was read for
  // kReaderIdleNs, it sleeps until a submit wakes it.
  while (!stopping_.load()) {
    const std::uint32_t word = reader_word_.load();
    const bool summoned = summoned_.load();
    // quiet_since_ns_ moves with every frame read and every submit that found nothing outstanding.
    const std::int64_t quiet_ns = steady_now_ns() - quiet_since_ns_.load(std::memory_order_relaxed);
    const bool unattended = outstanding_.load() > 0 && quiet_ns >= kGraceNs;
    if ((summoned || unattended) && followers_.load() == 0 && take_read_side()) {
      reader_on_duty_.store(true);
      summoned_.store(false);
      // Summoned, it stays while the summoning waiters may send more; otherwise it leaves once
      // the answers nobody waited for are read.
      read_frames(summoned ? ReadUntil::quiet : ReadUntil::idle, nullptr, {});
      reader_on_duty_.store(false);
      release_read_side();
      continue;
    }
    if (outstanding_.load() > 0 || quiet_ns < kReaderIdleNs) {
      futex_wait(&reader_word_, word, kReaderGrace);
      continue;
    }
    reader_sleeps_long_.store(true);
    if (outstanding_.load() == 0 && !summoned_.load() && !stopping_.load())
      futex_wait(&reader_word_, word, kReceiveTick);
    reader_sleeps_long_.store(false);
  }
}

void TcpConnection::read_frames(ReadUntil until, const transport::Completion* mine,
                                std::chrono::steady_clock::time_point until_at,
                                std::chrono::steady_clock::time_point deadline) {
  const bool reader = until == ReadUntil::idle || until == ReadUntil::quiet;
  for (;;) {
    if (until == ReadUntil::done && mine->done()) return;
    if (reader && (followers_.load() > 0 || stopping_.load())) return;
    if (until == ReadUntil::idle && outstanding_.load() == 0) return;
    // A waiter whose own deadline comes before the receive tick waits for bytes only until then:
    // a blocking read would keep it up to a whole tick past it (wait_for(10 ms) took 1 s). Only
    // then: a poll before every read would cost each answer a system call.
    if (until == ReadUntil::done && header_fill_ == 0 && deadline - std::chrono::steady_clock::now() < kReceiveTick) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      pollfd p{fd_.get(), POLLIN, 0};
      const int ready = left.count() <= 0 ? 0 : ::poll(&p, 1, static_cast<int>(left.count()));
      if (ready == 0 && (!still_alive() || std::chrono::steady_clock::now() >= deadline)) return;
      if (ready <= 0) continue;  // EINTR, or woken a hair early
    }
    switch (read_header(until != ReadUntil::nothing_waits)) {
      case HeaderRead::complete: {
        std::string why;
        Errc failure = Errc::peer_failure;
        if (!receive_one(header_, &why, &failure)) {
          fail_all(failure, why);
          return;
        }
        quiet_since_ns_.store(steady_now_ns(), std::memory_order_relaxed);
        notify_followers();
        break;
      }
      case HeaderRead::none:
        if (until == ReadUntil::nothing_waits || !still_alive()) return;
        if (until == ReadUntil::done && std::chrono::steady_clock::now() >= until_at) return;
        if (until == ReadUntil::quiet && outstanding_.load() == 0) return;  // a whole tick without a request
        break;
      case HeaderRead::broken:
        fail_all(Errc::peer_failure, stopping_.load() ? "the connection to " + endpoint_ + " was closed by the client"
                                                      : "lost the connection to " + endpoint_ + " (" + read_error_ +
                                                            "); did the server die?");
        return;
    }
  }
}

TcpConnection::HeaderRead TcpConnection::read_header(bool block) {
  auto* const bytes = reinterpret_cast<char*>(&header_);
  while (header_fill_ < sizeof header_) {
    // MSG_WAITALL: one call per header while blocking; the receive tick can still cut it short.
    const ssize_t n =
        ::recv(fd_.get(), bytes + header_fill_, sizeof header_ - header_fill_, block ? MSG_WAITALL : MSG_DONTWAIT);
    if (n > 0) {
      header_fill_ += static_cast<std::size_t>(n);
      continue;
    }
    if (nothing_waiting(n) || (n < 0 && errno == EINTR)) return HeaderRead::none;
    read_error_ = n == 0 ? "closed by the server" : std::strerror(errno);
    return HeaderRead::broken;
  }
  header_fill_ = 0;
  return HeaderRead::complete;
}

bool TcpConnection::still_alive() {
  const std::int64_t now = steady_now_ns();
  if (outstanding_.load() == 0) {
    quiet_since_ns_.store(now, std::memory_order_relaxed);
    return true;
  }
  if (now - quiet_since_ns_.load(std::memory_order_relaxed) <= std::chrono::nanoseconds(options_.io_timeout).count())
    return true;
  fail_all(Errc::timeout, endpoint_ + " sent nothing for " + std::to_string(options_.io_timeout.count()) +
                              " ms with requests outstanding; the server is hung or unreachable");
  return false;
}

bool TcpConnection::receive_one(const wire::FrameHeader& h, std::string* why, Errc* failure) {
  // A reply that breaks the protocol is the server's fault and stands (protocol); a read cut
  // short is the connection's (peer_failure), or the server's slowness (timeout): a retrying
  // client tries those again.
  *failure = Errc::protocol;
  IoResult res;
  if (Errc e = wire::validate_header(h, options_.limits, true, why); e != Errc::ok) {
    *why = "bad reply from " + endpoint_ + ": " + *why;
    return false;
  }
  const std::uint32_t index = static_cast<std::uint32_t>(h.request_id % options_.max_in_flight);
  Request* request;
  bool asked_copy = false;
  {
    std::lock_guard lock(in_flight_mu_);
    InFlight& e = in_flight_[index];
    request = e.id == h.request_id && !e.deferred && !e.receiving ? e.request : nullptr;
    if (request) e.receiving = true;
    asked_copy = e.asked_copy;
  }
  // Until release_in_flight, this thread owns the request's completion: a failure of the
  // connection meanwhile (a sender's writev timing out) leaves it alone. On any other way out
  // it is given back, outstanding, for the failure that follows (or for the torn pull's retry).
  struct Receiving {
    TcpConnection* connection;
    std::uint32_t index;
    bool released = false;
    ~Receiving() {
      if (released) return;
      std::lock_guard lock(connection->in_flight_mu_);
      connection->in_flight_[index].receiving = false;
    }
  } receiving{this, index};
  if (!request) {
    receiving.released = true;
    *failure = Errc::peer_failure;  // as before: it may answer one this client gave up on
    *why = endpoint_ + " answered request " + std::to_string(h.request_id) + " that is not outstanding";
    return false;
  }
  // A reply is the request's op and carries no key table: anything else is not the answer to it.
  if (h.num_keys != 0 || h.op != static_cast<std::uint16_t>(request->op)) {
    *why = endpoint_ + " answered a " + std::string(wire::op_name(static_cast<std::uint16_t>(request->op))) +
           " with a " + std::string(wire::op_name(h.op)) + " reply" +
           (h.num_keys != 0 ? " carrying a key table of " + std::to_string(h.num_keys) : std::string());
    return false;
  }
  Errc status = static_cast<Errc>(h.status);
  std::string message;
  // The rest of the frame must come within the io timeout plus a second per 16 MiB, as a
  // server gives its clients: a server trickling it would otherwise hold this connection's
  // reading (and every request waiting on it) for good, each byte inside SO_RCVTIMEO.
  const auto frame_began =
      h.payload_bytes > 0 ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  const auto deadline_for = [&](std::uint64_t bytes) {
    return frame_began + options_.io_timeout +
           std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::duration<double>(static_cast<double>(bytes) / double(16ull << 20)));
  };
  if (h.flags & wire::kText) {
    // Grown as the bytes come, not to the declared length up front (up to the payload limit),
    // and each piece due by the rate above: a declared 1 GiB trickled is cut within a second
    // or two, not after the minute its length would allow.
    constexpr std::size_t kTextPiece = 1u << 20;
    for (std::uint64_t got = 0; got < h.payload_bytes;) {
      const std::size_t piece = static_cast<std::size_t>(std::min<std::uint64_t>(kTextPiece, h.payload_bytes - got));
      message.resize(static_cast<std::size_t>(got) + piece);
      if (const IoResult r = read_full(fd_.get(), message.data() + got, piece, {}, deadline_for(got + piece));
          r != IoResult::ok) {
        *failure = r == IoResult::timeout ? Errc::timeout : Errc::peer_failure;
        *why = "lost the connection to " + endpoint_ + " while reading a text reply (or it came slower than " +
               std::to_string(options_.io_timeout.count()) + " ms allow)";
        return false;
      }
      got += piece;
    }
    if (status == Errc::ok) {
      if (request->text_out)
        request->text_out->swap(message);
      else
        status = Errc::protocol;
    }
  } else if (status == Errc::ok && h.payload_bytes == 0 && !request->keys.empty() &&
             wire::op_returns_values(request->op)) {
    *why = endpoint_ + " answered a " + std::string(wire::op_name(h.op)) + " of " +
           std::to_string(request->keys.size()) + " keys with no values";
    return false;
  } else if (h.payload_bytes > 0) {
    if (!wire::op_returns_values(request->op)) {
      *why = endpoint_ + " sent a payload with a " + std::string(wire::op_name(h.op)) + " reply";
      return false;
    }
    std::uint64_t expected = 0;
    recv_iov_.clear();
    for (const KeySlice& k : request->keys) {
      expected += std::uint64_t{k.length} * sizeof(float);
      recv_iov_.push_back({k.data, std::size_t{k.length} * sizeof(float)});
    }
    if (options_.checksum && !(h.flags & wire::kChecksum)) {
      *why = endpoint_ + " sent values without the checksum this client asks for";
      return false;
    }
    if (expected != h.payload_bytes) {
      *why = endpoint_ + " replied with " + std::to_string(h.payload_bytes) + " bytes, expected " +
             std::to_string(expected);
      return false;
    }
    // A reply sent straight from the store ends with a word saying whether a push tore it. Only
    // a pull that asked for that may get one: the answer to a pull asked again after a torn one
    // is a copy, so a server cannot keep one pull going round for good.
    std::uint32_t torn = 1;
    if (h.flags & wire::kFromStore) {
      if (request->op != wire::Op::pull || options_.checksum || asked_copy) {
        *why = endpoint_ + " sent values straight from its store for a request that asked for a copy";
        return false;
      }
      recv_iov_.push_back({&torn, sizeof torn});
    }
    res = readv_full(fd_.get(), recv_iov_.data(), static_cast<int>(recv_iov_.size()), kMidFrameSpin,
                     deadline_for(h.payload_bytes));
    if (res != IoResult::ok) {
      *failure = res == IoResult::timeout ? Errc::timeout : Errc::peer_failure;
      *why = "lost the connection to " + endpoint_ + " while reading values (" + io_result_text(res) + ")";
      return false;
    }
    if (h.flags & wire::kFromStore) {
      if (torn != 0) {
        // A push landed on a key while the server was sending it: ask again for a copy, which
        // the server takes under the seqlock. The request stays outstanding meanwhile.
        {
          std::lock_guard lock(in_flight_mu_);
          in_flight_[index].asked_copy = true;
        }
        if (send_request(h.request_id, *request, 0) != IoResult::ok) {
          *failure = Errc::peer_failure;
          *why = "lost the connection to " + endpoint_ + " while asking again for values torn by a push";
          return false;
        }
        return true;
      }
    }
    if (h.flags & wire::kChecksum) {
      std::uint32_t crc = 0;
      for (const KeySlice& k : request->keys) crc = wire::crc32_update(crc, k.data, k.length * sizeof(float));
      if (crc != h.checksum) {
        status = Errc::protocol;
        message = "checksum mismatch on values from " + endpoint_ + ": data was corrupted in transit";
      }
    }
  }
  if (h.op == static_cast<std::uint16_t>(wire::Op::pull) || h.op == static_cast<std::uint16_t>(wire::Op::clock))
    request->completion->note_bound(h.arg0);
  if (status != Errc::ok && message.empty()) message = std::string(errc_name(status));
  receiving.released = true;
  release_in_flight(index);
  request->completion->complete_part(status, status == Errc::ok ? std::string_view{} : std::string_view(message));
  return true;
}

}  // namespace pskv::tcp
