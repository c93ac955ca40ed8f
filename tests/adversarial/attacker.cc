// pskv-attack: a raw-socket attacker for pskv-server's tcp:// endpoint (issue 21).
//
//   pskv-attack --uri tcp://127.0.0.1:PORT --attack KIND --connections N --seconds S
//               [--source-address 127.0.0.2] [--auth-token-file F] [--key K --key-floats L] ...
//
// Each KIND (see kKinds below and tests/adversarial/README.md) throws one class of hostile or
// broken peer behaviour at the server for S seconds over N connections, then prints one JSON line
// summarising what the server did (replies, refusals, closes, what it let through) and exits 0.
// Exit 2: bad usage. Every loop is bounded in iterations and by the deadline, so the program
// always stops by itself; --hold-ms keeps the attack's sockets open a while after the summary so
// a harness can sample the server while the attack is still in force.
//
// It only ever talks to 127.0.0.0/8: both the target and the source address are checked.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "pskv/types.h"
#include "transport/auth.h"
#include "transport/tcp/socket.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv::attack {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct Options {
  std::string uri;
  std::string attack;
  int connections = 4;
  double seconds = 4;
  std::string source = "127.0.0.2";
  std::string token_file;
  std::uint64_t key = 0xBA17;  // a real key of key_floats floats (the bait)
  std::uint32_t key_floats = 1u << 20;
  std::uint32_t repeat = 16384;                   // repeated-key-pull: occurrences of the key in one pull
  std::uint32_t pull_entries = 4;                 // huge-pull-lengths: entries of 2^32-1 floats
  std::uint64_t frame_mb = 200;                   // unauth-large / budget-flood: frame size
  std::uint32_t max_keys_per_request = 1u << 20;  // the server's limits, to step just over them
  std::uint64_t max_request_mb = 256;
  int hold_ms = 0;
  std::uint64_t count = 0;  // connect-flood: stop after this many connections in all (0: at --seconds)
  std::uint64_t seed = 1;
};

// What the server did, counted over all connections. Thread-safety: every member is atomic or
// guarded by `mu`; lanes update it concurrently, main reads it after joining them.
struct Stats {
  std::atomic<std::uint64_t> connections{0};  // TCP connections established
  std::atomic<std::uint64_t> connect_failures{0};
  std::atomic<std::uint64_t> handshakes{0};  // hello (and auth) completed
  std::atomic<std::uint64_t> handshake_failures{0};
  std::atomic<std::uint64_t> frames_sent{0};  // attack frames (or fragments) written
  std::atomic<std::uint64_t> bytes_sent{0};
  std::atomic<std::uint64_t> replies_ok{0};              // status 0 to an attack frame
  std::atomic<std::uint64_t> replies_error{0};           // an error frame
  std::atomic<std::uint64_t> refused_capacity{0};        // an error frame with status capacity
  std::atomic<std::uint64_t> closed_by_server{0};        // EOF or RST seen
  std::atomic<std::uint64_t> silent{0};                  // neither a reply nor a close within the wait
  std::atomic<std::uint64_t> accepted{0};                // an ok the server must never give for this attack
  std::atomic<std::uint64_t> expected_ok{0};             // legitimate frames mixed in, served correctly
  std::atomic<std::uint64_t> expected_bad{0};            // legitimate frames mixed in, not served correctly
  std::atomic<std::uint64_t> still_open_at_end{0};       // attack connections the server never closed
  std::atomic<std::uint64_t> longest_open_ms{0};         // of connections the server should have closed
  std::atomic<std::uint64_t> max_bytes_before_close{0};  // unauth-large: most bytes one frame got in
  std::atomic<std::uint64_t> full_frames{0};             // unauth-large: frames the server read to the end
  std::atomic<std::uint64_t> cuts{0};                    // truncation: cut frames sent, over all lanes
  std::mutex mu;
  std::map<std::string, std::set<std::string>> outcomes;  // case -> what happened (bad-header-fields...)

  void note_max(std::atomic<std::uint64_t>& a, std::uint64_t v) {
    std::uint64_t cur = a.load();
    while (v > cur && !a.compare_exchange_weak(cur, v)) {
    }
  }
  // What setting up the attack cost (a bait key, a captured handshake) is not attack traffic.
  void forget_setup() {
    connections = 0;
    handshakes = 0;
    handshake_failures = 0;
    bytes_sent = 0;
  }
  void outcome(const std::string& what, const std::string& result) {
    std::lock_guard lock(mu);
    outcomes[what].insert(result);
  }
};

Options g;
Stats g_stats;
Clock::time_point g_end;
std::shared_ptr<const auth::Token> g_token;
sockaddr_in g_target{}, g_source{};

bool time_left() {
  return Clock::now() < g_end;
}
int ms_left() {
  return static_cast<int>(
      std::max<std::int64_t>(0, std::chrono::duration_cast<milliseconds>(g_end - Clock::now()).count()));
}

// Sockets parked at the deadline, so the attack stays in force until the summary is out and
// --hold-ms has passed. Thread-safety: guarded by g_parked_mu.
std::mutex g_parked_mu;
std::vector<tcp::Fd> g_parked;

// One attacking TCP connection from the source address. Blocking, with send and receive
// timeouts so that no call waits unboundedly. Thread-safety: one lane owns it.
class Conn {
 public:
  static std::optional<Conn> open(int rcvbuf = 0) {
    tcp::Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) {
      g_stats.connect_failures++;
      return std::nullopt;
    }
    const int one = 1;
    // Let connect() pick the port for the 4-tuple, so a connect flood does not run out of
    // ports that bind() would have to reserve for every destination.
    ::setsockopt(fd.get(), IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
    if (rcvbuf > 0) ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&g_source), sizeof g_source) != 0) {
      g_stats.connect_failures++;
      return std::nullopt;
    }
    // A full accept queue makes connect() retry SYNs for minutes: bound it.
    tcp::set_io_timeouts(fd.get(), milliseconds(2000), milliseconds(2000));
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&g_target), sizeof g_target) != 0) {
      g_stats.connect_failures++;
      // Refused (the server is gone or full) or out of ports: retrying at once would only
      // measure how fast this machine fails connects.
      std::this_thread::sleep_for(milliseconds(10));
      return std::nullopt;
    }
    ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    g_stats.connections++;
    return Conn(std::move(fd));
  }

  int fd() const { return fd_.get(); }
  milliseconds age() const { return std::chrono::duration_cast<milliseconds>(Clock::now() - born_); }
  void send_timeout(milliseconds t) { tcp::set_io_timeouts(fd_.get(), milliseconds(2000), t); }

  // Whole buffer, or false (closed, reset, or the send timeout passed with the peer not reading).
  bool send_all(const void* data, std::size_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      const ssize_t n = ::send(fd_.get(), p, bytes, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        if (errno == EPIPE || errno == ECONNRESET) peer_closed_ = true;
        return false;
      }
      p += n;
      bytes -= static_cast<std::size_t>(n);
      g_stats.bytes_sent += static_cast<std::uint64_t>(n);
    }
    return true;
  }
  bool send_frame(const std::vector<std::byte>& f) {
    g_stats.frames_sent++;
    return send_all(f.data(), f.size());
  }

  enum class Got { reply, closed, silent };
  struct Reply {
    Got got = Got::silent;
    wire::FrameHeader h{};
    std::vector<char> payload;  // kept whole up to 64 KiB; larger payloads are drained and dropped
    std::string text() const { return (h.flags & wire::kText) ? std::string(payload.begin(), payload.end()) : ""; }
    // What came back, as the outcomes record it.
    const char* kind() const {
      return got == Got::closed ? "close" : got == Got::silent ? "silent" : h.status == 0 ? "ok" : "error";
    }
  };
  // The next reply frame within `wait` (then up to 10 s for its payload). A payload over
  // 256 MiB is not drained: no attack asks for one legitimately, and the caller drops the
  // connection.
  Reply read_reply(milliseconds wait) {
    Reply r;
    if (!read_exact(&r.h, sizeof r.h, wait)) {
      r.got = peer_closed_ ? Got::closed : Got::silent;
      return r;
    }
    r.got = Got::reply;
    std::uint64_t body = r.h.payload_bytes + ((r.h.flags & wire::kFromStore) ? sizeof(std::uint32_t) : 0);
    if (body > (256ull << 20)) return r;
    const std::size_t keep = body <= (64u << 10) ? body : 0;
    r.payload.resize(keep);
    if (keep && !read_exact(r.payload.data(), keep, milliseconds(10000)))
      r.got = peer_closed_ ? Got::closed : Got::silent;
    if (!keep) {
      std::vector<char> sink(1u << 20);
      while (body > 0 && r.got == Got::reply) {
        const std::size_t n = std::min<std::uint64_t>(body, sink.size());
        if (!read_exact(sink.data(), n, milliseconds(10000))) r.got = peer_closed_ ? Got::closed : Got::silent;
        body -= n;
      }
    }
    return r;
  }
  // Counts a reply to an attack frame in the stats and returns it.
  Reply judge(Reply r, bool ok_is_wrong) {
    if (r.got == Got::closed) {
      g_stats.closed_by_server++;
    } else if (r.got == Got::silent) {
      g_stats.silent++;
    } else if (r.h.status == 0) {
      g_stats.replies_ok++;
      if (ok_is_wrong) g_stats.accepted++;
    } else {
      g_stats.replies_error++;
      if (r.h.status == static_cast<std::uint16_t>(Errc::capacity)) g_stats.refused_capacity++;
    }
    return r;
  }
  // Whether the server closes the connection within `wait`, discarding what it sends first.
  bool closes_within(milliseconds wait) {
    const auto until = Clock::now() + wait;
    char sink[4096];
    for (;;) {
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now()).count();
      if (left <= 0) return false;
      pollfd p{fd_.get(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
      const ssize_t n = ::recv(fd_.get(), sink, sizeof sink, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        peer_closed_ = true;
        return true;
      }
    }
  }
  // Without reading anything: did the server close (FIN or RST)? Waits up to `wait`.
  bool hung_up(milliseconds wait) {
    pollfd p{fd_.get(), POLLRDHUP, 0};
    if (::poll(&p, 1, static_cast<int>(wait.count())) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
      peer_closed_ = true;
      return true;
    }
    return false;
  }
  bool peer_closed() const { return peer_closed_; }
  void reset_on_close() {
    const linger l{1, 0};
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_LINGER, &l, sizeof l);
  }
  // At the deadline a lane hands its socket over instead of closing it (see g_parked).
  void park() {
    if (peer_closed_) return;
    g_stats.still_open_at_end++;
    std::lock_guard lock(g_parked_mu);
    g_parked.push_back(std::move(fd_));
  }

 private:
  explicit Conn(tcp::Fd fd) : fd_(std::move(fd)), born_(Clock::now()) {}
  bool read_exact(void* data, std::size_t bytes, milliseconds wait) {
    const auto until = Clock::now() + wait;
    char* p = static_cast<char*>(data);
    while (bytes > 0) {
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now()).count();
      if (left <= 0) return false;
      pollfd pf{fd_.get(), POLLIN, 0};
      if (::poll(&pf, 1, static_cast<int>(left)) <= 0) continue;
      const ssize_t n = ::recv(fd_.get(), p, bytes, MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
        peer_closed_ = true;
        return false;
      }
      if (n > 0) {
        p += n;
        bytes -= static_cast<std::size_t>(n);
      }
    }
    return true;
  }

  tcp::Fd fd_;
  Clock::time_point born_;
  bool peer_closed_ = false;
};

// --- frames ----------------------------------------------------------------------------------

std::vector<std::byte> frame(const wire::FrameHeader& h, std::span<const wire::KeyEntry> keys = {},
                             const void* payload = nullptr, std::size_t payload_bytes = 0) {
  std::vector<std::byte> f(sizeof h + keys.size_bytes() + payload_bytes);
  std::memcpy(f.data(), &h, sizeof h);
  if (!keys.empty()) std::memcpy(f.data() + sizeof h, keys.data(), keys.size_bytes());
  if (payload_bytes) std::memcpy(f.data() + sizeof h + keys.size_bytes(), payload, payload_bytes);
  return f;
}

std::vector<std::byte> hello_frame(const auth::Nonce* nonce, std::uint64_t worker = kNoWorker) {
  const std::size_t n = nonce ? nonce->size() : 0;
  return frame(wire::make_header(wire::Op::hello, 1, 0, n, worker, wire::kVersion), {}, nonce ? nonce->data() : nullptr,
               n);
}

std::vector<std::byte> auth_frame(const std::uint8_t* proof) {
  return frame(wire::make_header(wire::Op::auth, 2, 0, auth::kProofBytes), {}, proof, auth::kProofBytes);
}

std::vector<std::byte> pull_frame(std::uint64_t id, std::span<const wire::KeyEntry> keys, std::uint16_t flags = 0) {
  wire::FrameHeader h = wire::make_header(wire::Op::pull, id, static_cast<std::uint32_t>(keys.size()), 0);
  h.flags = flags;
  if (flags & wire::kChecksum) h.checksum = wire::crc32_update(0, keys.data(), keys.size_bytes());
  return frame(h, keys);
}

// A legitimate handshake, recorded for replayed-proof.
struct Capture {
  std::vector<std::byte> hello;
  std::vector<char> challenge;  // server nonce | server proof
  auth::Proof client_proof{};
};

// hello, and auth when the server challenges and we hold the token. False if not admitted.
bool handshake(Conn& c, Capture* capture = nullptr, std::uint64_t worker = kNoWorker) {
  const auth::Nonce nonce = auth::random_nonce();
  const auto hello = hello_frame(g_token ? &nonce : nullptr, worker);
  bool ok = false;
  if (c.send_all(hello.data(), hello.size())) {
    const auto r = c.read_reply(milliseconds(3000));
    if (r.got == Conn::Got::reply && r.h.status == 0) {
      if (!(r.h.flags & wire::kAuthChallenge)) {
        ok = true;
      } else if (g_token && r.payload.size() == auth::kNonceBytes + auth::kProofBytes) {
        try {
          const auto* ch = reinterpret_cast<const std::uint8_t*>(r.payload.data());
          const auto proof = auth::answer(g_token.get(), nonce, ch, ch + auth::kNonceBytes, g.uri);
          const auto a = auth_frame(proof->data());
          if (c.send_all(a.data(), a.size())) {
            const auto ar = c.read_reply(milliseconds(3000));
            ok = ar.got == Conn::Got::reply && ar.h.status == 0;
          }
          if (capture) {
            capture->hello = hello;
            capture->challenge = r.payload;
            capture->client_proof = *proof;
          }
        } catch (const std::exception&) {
          ok = false;
        }
      }
    }
  }
  (ok ? g_stats.handshakes : g_stats.handshake_failures)++;
  return ok;
}

// Runs `lane(i)` on n threads and waits for them.
template <class F>
void run_lanes(int n, F lane) {
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { lane(i); });
  for (auto& t : threads) t.join();
}

void note_open(const Conn& c) {
  g_stats.note_max(g_stats.longest_open_ms, static_cast<std::uint64_t>(c.age().count()));
}

// Waits, without reading, until the server closes `c` or `wait` passes or the attack ends.
// True if the server closed it.
bool hold(Conn& c, milliseconds wait) {
  const auto until = std::min(Clock::now() + wait, g_end);
  while (Clock::now() < until) {
    const auto step =
        std::min<std::int64_t>(200, std::chrono::duration_cast<milliseconds>(until - Clock::now()).count());
    if (c.hung_up(milliseconds(std::max<std::int64_t>(step, 1)))) {
      g_stats.closed_by_server++;
      note_open(c);
      return true;
    }
  }
  return false;
}

// --- attacks ---------------------------------------------------------------------------------

constexpr int kMaxRounds = 100000;  // per lane: every loop ends by count as well as by time

// A pull whose key table declares entries of 2^32-1 floats. At least two entries: an implied
// reply of 32 GiB or more cannot even be reserved on the test machines, so a server that sizes
// its reply from the table fails at once (bad_alloc) instead of zero-filling memory others use.
void huge_pull_lengths(int lane) {
  const std::uint32_t entries = std::max<std::uint32_t>(2, g.pull_entries);
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c || !handshake(*c)) continue;
    for (int i = 0; i < kMaxRounds && time_left(); ++i) {
      std::vector<wire::KeyEntry> keys;
      // Alternately keys that do not exist and the real key, every entry 2^32-1 floats long.
      for (std::uint32_t e = 0; e < entries; ++e)
        keys.push_back({(i + lane) % 2 ? g.key : 0xDEAD0000ull + e, 0xFFFFFFFFu, 0});
      if (!c->send_frame(pull_frame(10 + i, keys))) break;
      if (c->judge(c->read_reply(milliseconds(3000)), /*ok_is_wrong=*/true).got != Conn::Got::reply) break;
    }
    if (!time_left()) c->park();
  }
}

// One real key listed `repeat` times, so the implied reply (repeat x the key) is far over any
// limit; every fourth frame lists it 4 times instead, a legitimate pull of duplicates whose reply
// must hold each occurrence.
void repeated_key_pull(int lane) {
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c || !handshake(*c)) continue;
    for (int i = 0; i < kMaxRounds && time_left(); ++i) {
      const bool small = i % 4 == 3;
      const std::vector<wire::KeyEntry> keys(small ? 4 : g.repeat, wire::KeyEntry{g.key, g.key_floats, 0});
      const std::uint16_t flags = (i + lane) % 3 == 1 ? wire::kFromStore : (i + lane) % 3 == 2 ? wire::kChecksum : 0;
      if (!c->send_frame(pull_frame(10 + i, keys, flags))) break;
      const auto r = c->judge(c->read_reply(milliseconds(10000)), /*ok_is_wrong=*/!small);
      if (small && r.got == Conn::Got::reply)
        (r.h.status == 0 && r.h.payload_bytes == 4ull * g.key_floats * sizeof(float) ? g_stats.expected_ok
                                                                                     : g_stats.expected_bad)++;
      if (r.got != Conn::Got::reply || (r.h.status == 0 && !small)) break;
    }
    if (!time_left()) c->park();
  }
}

// A frame announcing more than 256 KiB, then one byte every 1-2 s; or (odd lanes, after hello)
// half a header and silence.
void slowloris(int lane, bool after_hello) {
  std::mt19937_64 rng(g.seed + lane);
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c) continue;
    if (after_hello && !handshake(*c)) continue;
    const wire::KeyEntry key{g.key, 1u << 18, 0};  // a 1 MiB push
    const auto f =
        frame(wire::make_header(wire::Op::push, 7, 1, std::uint64_t{key.length} * sizeof(float)), std::span(&key, 1));
    const bool half_header = after_hello && lane % 2 == 1;
    const std::size_t first = half_header ? sizeof(wire::FrameHeader) / 2 : sizeof(wire::FrameHeader);
    g_stats.frames_sent++;
    if (!c->send_all(f.data(), first)) {
      g_stats.closed_by_server++;
      continue;
    }
    bool closed = false;
    for (std::size_t at = first; !closed && time_left() && at < f.size(); ++at) {
      closed = hold(*c, milliseconds(1000 + rng() % 1000));
      if (!closed && !half_header && time_left() && !c->send_all(f.data() + at, 1)) {
        g_stats.closed_by_server++;
        note_open(*c);
        closed = true;
      }
    }
    if (!closed) {
      note_open(*c);
      c->park();
    }
  }
}

// Half a hello header, then silence.
void slowloris_small(int) {
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c) continue;
    const auto f = hello_frame(nullptr);
    g_stats.frames_sent++;
    if (!c->send_all(f.data(), f.size() / 2)) continue;
    if (!hold(*c, milliseconds(ms_left()))) {
      note_open(*c);
      c->park();
    }
  }
}

// Pipelines pulls of the real key (every other lane asks for replies straight from the store)
// and never reads a byte: the server's replies pile up towards this peer.
void non_reader(int lane) {
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open(/*rcvbuf=*/64 << 10);
    if (!c || !handshake(*c)) continue;
    c->send_timeout(milliseconds(500));
    const wire::KeyEntry key{g.key, g.key_floats, 0};
    bool open = true;
    for (int i = 0; open && i < 4096 && time_left(); ++i) {
      if (!c->send_frame(pull_frame(100 + i, std::span(&key, 1), lane % 2 ? wire::kFromStore : 0))) {
        // Either the server stopped reading (its buffers and ours are full) or it closed.
        open = !c->peer_closed() && !c->hung_up(milliseconds(0));
        break;
      }
    }
    if (!open) {
      g_stats.closed_by_server++;
      note_open(*c);
      continue;
    }
    if (!hold(*c, milliseconds(ms_left()))) {
      note_open(*c);
      c->park();
    }
  }
}

// Drains whatever the server sends on `c` until `stop` or the connection ends, counting error
// replies (a lane that pipelines requests reads on another thread).
void drain_replies(Conn& c, const std::atomic<bool>& stop) {
  while (!stop.load() && time_left()) {
    const auto r = c.read_reply(milliseconds(100));
    if (r.got == Conn::Got::closed) {
      g_stats.closed_by_server++;
      return;
    }
    if (r.got == Conn::Got::reply) c.judge(r, /*ok_is_wrong=*/false);
  }
}

// Pushes of --frame-mb to a key that does not exist, back to back at loopback rate, replies
// read on a second thread: every byte is legal to read and drop, and the sender never pauses.
// With one such peer per I/O thread, a server that serves a connection until it runs dry
// would serve nobody else.
void fast_streamer(int) {
  const std::uint64_t floats = (g.frame_mb << 20) / sizeof(float) - 8;
  const std::vector<char> zeros(1u << 20);
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c || !handshake(*c)) continue;
    c->send_timeout(milliseconds(2000));
    std::atomic<bool> stop{false};
    std::thread reader([&] { drain_replies(*c, stop); });
    const wire::KeyEntry key{0xDEAD5000ull, static_cast<std::uint32_t>(floats), 0};
    for (std::uint64_t id = 1; id < kMaxRounds && time_left(); ++id) {
      const wire::FrameHeader h = wire::make_header(wire::Op::push, id, 1, floats * sizeof(float));
      g_stats.frames_sent++;
      bool ok = c->send_all(&h, sizeof h) && c->send_all(&key, sizeof key);
      for (std::uint64_t left = floats * sizeof(float); ok && left > 0;) {
        const std::size_t n = std::min<std::uint64_t>(left, zeros.size());
        ok = c->send_all(zeros.data(), n);
        left -= n;
      }
      if (!ok) break;
    }
    stop = true;
    reader.join();
    if (!time_left()) c->park();
  }
}

// A worker (id 1 of a bsp/ssp server whose worker 0 never comes) that parks pulls: each lists
// its own 1-float key --repeat times, so it implies a small reply but makes the server keep a
// large key table while it waits; every other pull claims a clock far beyond the one announced.
// Parked pulls must draw on the memory budget, and the impossible ones be refused at once.
void parked_flood(int lane) {
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c || !handshake(*c, nullptr, /*worker=*/1)) continue;
    const Key own = 0xF1000000ull + static_cast<Key>(lane);
    const float zero = 0.0f;
    const wire::KeyEntry one{own, 1, 0};
    const auto init =
        frame(wire::make_header(wire::Op::init, 2, 1, sizeof zero), std::span(&one, 1), &zero, sizeof zero);
    const auto clock = frame(wire::make_header(wire::Op::clock, 3, 0, 0, /*clock=*/5));
    if (!c->send_frame(init) || c->read_reply(milliseconds(3000)).got != Conn::Got::reply) continue;
    if (!c->send_frame(clock) || c->read_reply(milliseconds(3000)).got != Conn::Got::reply) continue;
    c->send_timeout(milliseconds(500));
    std::atomic<bool> stop{false};
    std::thread reader([&] { drain_replies(*c, stop); });
    const std::vector<wire::KeyEntry> table(g.repeat, one);
    for (std::uint64_t id = 10; id < 10 + 1024 && time_left(); ++id) {
      wire::FrameHeader h =
          wire::make_header(wire::Op::pull, id, static_cast<std::uint32_t>(table.size()), 0, id % 2 ? 5 : (1ull << 60));
      g_stats.frames_sent++;
      if (!c->send_all(&h, sizeof h) || !c->send_all(table.data(), table.size() * sizeof(wire::KeyEntry))) break;
    }
    hold(*c, milliseconds(ms_left()));
    stop = true;
    reader.join();
    if (!time_left()) c->park();
  }
}

// Many connections that never send a byte; reopened when the server drops them.
void idle_flood(int lane, int lanes) {
  const int mine = g.connections / lanes + (lane < g.connections % lanes ? 1 : 0);
  std::vector<Conn> conns;
  int opened = 0;
  auto top_up = [&](int at_most) {
    for (int i = 0; i < at_most && static_cast<int>(conns.size()) < mine && opened < kMaxRounds && time_left(); ++i) {
      ++opened;
      if (auto c = Conn::open())
        conns.push_back(std::move(*c));
      else
        break;  // refused or out of ports: try again on the next pass
    }
  };
  top_up(mine);
  while (time_left()) {
    std::vector<pollfd> fds;
    for (auto& c : conns) fds.push_back({c.fd(), POLLIN, 0});
    ::poll(fds.data(), fds.size(), std::min(200, ms_left()));
    std::vector<Conn> keep;
    for (std::size_t i = 0; i < conns.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) {
        keep.push_back(std::move(conns[i]));
        continue;
      }
      // The server's only word to an idle peer is a refusal; read it, then the close.
      const auto r = conns[i].read_reply(milliseconds(500));
      if (r.got == Conn::Got::reply) conns[i].judge(r, /*ok_is_wrong=*/true);
      g_stats.closed_by_server++;
      note_open(conns[i]);
    }
    // Reopen what the server dropped, at a pace: this is an idle flood, not a connect flood
    // (connect-flood), and a churn of thousands a second would make the test a race between
    // the healthy client's handshake and the server's eviction of connections without one.
    const bool dropped = conns.size() != keep.size();
    conns = std::move(keep);
    if (dropped) {
      std::this_thread::sleep_for(milliseconds(50));
      top_up(4);
    }
  }
  for (auto& c : conns) {
    note_open(c);
    c.park();
  }
}

// Frames of --frame-mb before authenticating: a push before hello, and (when the server
// challenges) a push after hello but before auth. Streams zeros until the server stops it.
void unauth_large(int lane) {
  static const std::vector<char> zeros(1u << 20);
  const std::uint64_t bytes = g.frame_mb << 20;
  const wire::KeyEntry key{g.key, static_cast<std::uint32_t>(bytes / sizeof(float)), 0};
  bool challenged = true;  // until the server shows it admits a hello without a token
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c) continue;
    c->send_timeout(milliseconds(1000));
    if ((round + lane) % 2 == 1 && challenged) {
      const auth::Nonce nonce = auth::random_nonce();
      const auto hello = hello_frame(&nonce);
      if (!c->send_all(hello.data(), hello.size())) continue;
      const auto r = c->read_reply(milliseconds(3000));
      if (r.got != Conn::Got::reply || r.h.status != 0) continue;
      if (!(r.h.flags & wire::kAuthChallenge)) {
        challenged = false;  // no token on this server: the push would be a legitimate one
        continue;
      }
    }
    const auto head = frame(wire::make_header(wire::Op::push, 9, 1, bytes), std::span(&key, 1));
    g_stats.frames_sent++;
    std::uint64_t sent = 0;
    bool whole = c->send_all(head.data(), head.size());
    while (whole && sent < bytes && time_left()) {
      const std::size_t n = std::min<std::uint64_t>(zeros.size(), bytes - sent);
      whole = c->send_all(zeros.data(), n);
      if (whole) sent += n;
    }
    g_stats.note_max(g_stats.max_bytes_before_close, sent);
    if (whole && sent == bytes) {
      g_stats.full_frames++;
      c->judge(c->read_reply(milliseconds(5000)), /*ok_is_wrong=*/true);
    } else if (c->peer_closed() || c->closes_within(milliseconds(std::min(2000, ms_left())))) {
      g_stats.closed_by_server++;
    }
    note_open(*c);
    if (!time_left() && !c->peer_closed()) c->park();
  }
}

// Replays a captured legitimate handshake's proof on new connections, in four ways; every one
// must be refused.
void replayed_proof(int lane, const Capture& cap) {
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c) continue;
    const int how = (round + lane) % 4;
    const char* name = how == 0   ? "same-nonce-old-proof"
                       : how == 1 ? "reflected-old-server-proof"
                       : how == 2 ? "proof-without-hello"
                                  : "reflected-own-server-proof";
    Conn::Reply r;
    if (how == 2) {
      c->send_frame(auth_frame(cap.client_proof.data()));
      r = c->read_reply(milliseconds(3000));
    } else {
      const auth::Nonce fresh = auth::random_nonce();
      const auto hello = how == 0 ? cap.hello : hello_frame(&fresh);
      if (!c->send_all(hello.data(), hello.size())) continue;
      const auto ch = c->read_reply(milliseconds(3000));
      if (ch.got != Conn::Got::reply || !(ch.h.flags & wire::kAuthChallenge) ||
          ch.payload.size() != auth::kNonceBytes + auth::kProofBytes) {
        c->judge(ch, /*ok_is_wrong=*/true);  // a server that does not challenge accepts anyone
        continue;
      }
      const auto* old_server_proof = reinterpret_cast<const std::uint8_t*>(cap.challenge.data()) + auth::kNonceBytes;
      const auto* own_server_proof = reinterpret_cast<const std::uint8_t*>(ch.payload.data()) + auth::kNonceBytes;
      const std::uint8_t* proof = how == 0 ? cap.client_proof.data() : how == 1 ? old_server_proof : own_server_proof;
      c->send_frame(auth_frame(proof));
      r = c->read_reply(milliseconds(3000));
    }
    c->judge(r, /*ok_is_wrong=*/true);
    g_stats.outcome(name, r.kind());
  }
}

// Random bytes before hello, random bytes after hello, and (mostly) frames with a valid magic
// and version whose other fields are random. Key lengths stay at most 2^16 floats: oversized
// tables are huge-pull-lengths' business, and a random 2^32-1 would make a server without the
// fix zero-fill gigabytes on a machine others share. Ops are never init (random keys would fill
// the arena, which is not what this attack measures).
void random_bytes(int lane) {
  std::mt19937_64 rng(g.seed * 7919 + lane);
  // Payloads are slices of one random pool: generating 16 MiB per frame would make this a
  // benchmark of the random generator.
  static const std::vector<std::byte> pool = [] {
    std::mt19937_64 r(g.seed);
    std::vector<std::byte> p((16u << 20) + 8);
    for (std::size_t i = 0; i + 8 <= p.size(); i += 8) {
      const std::uint64_t x = r();
      std::memcpy(p.data() + i, &x, 8);
    }
    return p;
  }();
  auto rand_bytes = [&](std::vector<std::byte>& v, std::size_t n) {
    const std::size_t at = n >= pool.size() ? 0 : rng() % (pool.size() - n);
    v.assign(pool.begin() + static_cast<std::ptrdiff_t>(at), pool.begin() + static_cast<std::ptrdiff_t>(at + n));
  };
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c) continue;
    const int how = round % 4;
    std::vector<std::byte> junk;
    // Junk is answered by a close (or, short of a header, by the deadlines): a brief look,
    // then on to the next connection.
    if (how <= 1 && (how == 0 || handshake(*c))) {
      rand_bytes(junk, 1 + rng() % 4096);
      c->send_frame(junk);
      if (c->closes_within(milliseconds(300))) g_stats.closed_by_server++;
      continue;
    }
    if (how > 1 && !handshake(*c)) continue;
    for (int i = 0; i < 64 && time_left(); ++i) {
      wire::FrameHeader h{};
      rand_bytes(junk, sizeof h);
      std::memcpy(&h, junk.data(), sizeof h);
      h.magic = wire::kMagic;
      h.version = wire::kVersion;
      if (rng() % 8) h.op = static_cast<std::uint16_t>(1 + rng() % 10);
      if (h.op == static_cast<std::uint16_t>(wire::Op::init)) h.op = static_cast<std::uint16_t>(wire::Op::push);
      if (rng() % 8) h.flags &= static_cast<std::uint16_t>(~wire::kResponse);
      // Mostly well-formed key tables, so that frames get past the header checks and the
      // connection lives on to the next one; one field in a few is off.
      h.num_keys = static_cast<std::uint32_t>(rng() % 9);
      std::vector<wire::KeyEntry> keys(h.num_keys);
      std::uint64_t floats = 0;
      for (auto& k : keys) {
        k.key = rng() % 2 ? g.key : (rng() | (1ull << 63));
        k.length = k.key == g.key && rng() % 2 ? g.key_floats : static_cast<std::uint32_t>(1 + rng() % 65536);
        if (rng() % 32 == 0) k.length = 0;
        k.reserved = static_cast<std::uint32_t>(rng());
        floats += k.length;
      }
      if (floats * sizeof(float) > (16u << 20)) continue;  // stay a parser test, not a bandwidth one
      h.payload_bytes = rng() % 8 ? floats * sizeof(float) : rng() % 4096;
      rand_bytes(junk, h.payload_bytes);
      const auto f = frame(h, keys, junk.data(), junk.size());
      if (!c->send_frame(f)) break;
      if (c->judge(c->read_reply(milliseconds(1500)), false).got != Conn::Got::reply) break;
    }
    if (!time_left()) c->park();
  }
}

// One malformed field per frame. `header_level`: the header alone is wrong, so the server must
// answer with an error and close (protocol.md: a bad header closes the connection, after an
// error reply when the magic was right); otherwise any error, the connection kept or not.
struct BadCase {
  const char* name;
  bool hello_first;
  bool magic_right;
  bool header_level;
  std::vector<std::byte> bytes;
};

std::vector<BadCase> bad_cases() {
  std::vector<BadCase> v;
  const wire::KeyEntry key{g.key, 4, 0}, real{g.key, g.key_floats, 0}, zero{g.key, 0, 0};
  const float four[5] = {};
  auto pull = [&](auto&& edit) {
    wire::FrameHeader h = wire::make_header(wire::Op::pull, 3, 1, 0);
    edit(h);
    return frame(h, std::span(&real, 1));
  };
  {
    wire::FrameHeader h = wire::make_header(wire::Op::hello, 1, 0, 0, kNoWorker, wire::kVersion);
    h.magic = 0x12345678;
    v.push_back({"magic-before-hello", false, false, true, frame(h)});
  }
  v.push_back({"magic", true, false, true, pull([](auto& h) { h.magic = 0x4b565350; })});
  v.push_back({"version", true, true, true, pull([](auto& h) { h.version = wire::kVersion + 1; })});
  v.push_back({"op-zero", true, true, true, pull([](auto& h) { h.op = 0; })});
  v.push_back({"op-unknown", true, true, true, pull([](auto& h) { h.op = 11; })});
  v.push_back({"op-ffff", true, true, true, pull([](auto& h) { h.op = 0xFFFF; })});
  v.push_back({"flags-response", true, true, true, pull([](auto& h) { h.flags = wire::kResponse; })});
  v.push_back({"flags-all", true, true, true, pull([](auto& h) { h.flags = 0xFFFF; })});
  // Over-limit counts and sizes: the header alone is sent, the server must not wait for more.
  {
    wire::FrameHeader h = wire::make_header(wire::Op::pull, 3, g.max_keys_per_request + 1, 0);
    v.push_back({"num-keys-over-limit", true, true, true, frame(h)});
    h.num_keys = 0xFFFFFFFF;
    v.push_back({"num-keys-max", true, true, true, frame(h)});
    wire::FrameHeader p = wire::make_header(wire::Op::push, 3, 1, (g.max_request_mb << 20) + 4);
    v.push_back({"payload-over-limit", true, true, true, frame(p)});
    p.payload_bytes = 1ull << 63;
    v.push_back({"payload-2^63", true, true, true, frame(p)});
  }
  v.push_back({"payload-not-whole-floats", true, true, true,
               frame(wire::make_header(wire::Op::push, 3, 1, 6), std::span(&key, 1), four, 6)});
  v.push_back({"pull-with-payload", true, true, true,
               frame(wire::make_header(wire::Op::pull, 3, 1, 16), std::span(&real, 1), four, 16)});
  {
    wire::FrameHeader h = wire::make_header(wire::Op::hello, 1, 0, 64, kNoWorker, wire::kVersion);
    const std::byte filler[64] = {};
    v.push_back({"hello-with-64-byte-payload", false, true, true, frame(h, {}, filler, 64)});
  }
  v.push_back({"payload-mismatch", true, true, false,
               frame(wire::make_header(wire::Op::push, 3, 1, 20), std::span(&key, 1), four, 20)});
  v.push_back(
      {"zero-length-key", true, true, false, frame(wire::make_header(wire::Op::push, 3, 1, 0), std::span(&zero, 1))});
  {
    wire::FrameHeader h = wire::make_header(wire::Op::pull, 3, 1, 0);
    h.flags = wire::kChecksum;
    h.checksum = wire::crc32_update(0, &real, sizeof real) ^ 0x5a5a5a5a;
    v.push_back({"checksum-wrong", true, true, false, frame(h, std::span(&real, 1))});
  }
  return v;
}

void bad_header_fields(int lane, int lanes) {
  const auto cases = bad_cases();
  // At least one full pass whatever the deadline (each case is bounded by its waits), then
  // more passes while time is left.
  for (int pass = 0; pass < 50 && (pass == 0 || time_left()); ++pass) {
    for (std::size_t i = static_cast<std::size_t>(lane); i < cases.size(); i += static_cast<std::size_t>(lanes)) {
      const BadCase& bc = cases[i];
      auto c = Conn::open();
      if (!c) continue;
      if (bc.hello_first && !handshake(*c)) continue;
      c->send_frame(bc.bytes);
      const auto r = c->judge(c->read_reply(milliseconds(3000)), /*ok_is_wrong=*/true);
      std::string what = r.kind();
      if (r.got == Conn::Got::reply) {
        const bool closed = c->closes_within(milliseconds(1500));
        if (closed) g_stats.closed_by_server++;
        what += closed ? "+close" : "+open";
      }
      g_stats.outcome(bc.name, what);
    }
  }
}

// A valid frame cut at every byte, then closed (even cuts) or half-closed with the server left
// to notice (odd cuts: the server must close its side). Frames: hello (with a nonce on a token
// server), then after a handshake a push to --key and a pull of it. The push carries 1e6 per
// float: a server that applied any part of a truncated small push shows it in the key's value.
void truncation(int lane, int lanes) {
  const wire::KeyEntry key{g.key, g.key_floats, 0};
  const std::vector<float> big(g.key_floats, 1e6f);
  const auth::Nonce nonce = auth::random_nonce();
  struct Cut {
    bool hello_first;
    std::vector<std::byte> f;
  };
  std::vector<Cut> frames{{false, hello_frame(g_token ? &nonce : nullptr)},
                          {true, frame(wire::make_header(wire::Op::push, 5, 1, big.size() * sizeof(float)),
                                       std::span(&key, 1), big.data(), big.size() * sizeof(float))},
                          {true, pull_frame(6, std::span(&key, 1))}};
  if (frames[1].f.size() > (1u << 20)) frames.erase(frames.begin() + 1);  // the cut loop is per byte
  for (int pass = 0; pass < 20 && (pass == 0 || time_left()); ++pass) {
    for (const Cut& cut : frames) {
      for (std::size_t at = static_cast<std::size_t>(lane); at < cut.f.size(); at += static_cast<std::size_t>(lanes)) {
        auto c = Conn::open();
        if (!c) continue;
        if (cut.hello_first && !handshake(*c)) continue;
        if (at > 0) c->send_frame({cut.f.begin(), cut.f.begin() + static_cast<std::ptrdiff_t>(at)});
        ++g_stats.cuts;
        if (at % 2 == 0) continue;  // closed here
        ::shutdown(c->fd(), SHUT_WR);
        if (c->closes_within(milliseconds(3000)))
          g_stats.closed_by_server++;
        else
          g_stats.silent++;
      }
    }
  }
}

// A second hello on an admitted connection, in several forms; then a pull of the real key shows
// whether the connection still serves. Each outcome is recorded.
void second_hello(int lane) {
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c || !handshake(*c)) continue;
    const int how = (round + lane) % 5;
    const auth::Nonce nonce = auth::random_nonce();
    std::vector<std::byte> f;
    const char* name = "";
    switch (how) {
      case 0:
        name = "same";
        f = hello_frame(g_token ? &nonce : nullptr);
        break;
      case 1:
        name = "worker-0";
        f = hello_frame(g_token ? &nonce : nullptr, 0);
        break;
      case 2:
        name = "worker-huge";
        f = hello_frame(g_token ? &nonce : nullptr, 0xFFFFFFF0u);
        break;
      case 3:
        name = "with-nonce";
        f = hello_frame(&nonce);
        break;
      default: {
        name = "version-2";
        wire::FrameHeader h = wire::make_header(wire::Op::hello, 1, 0, 0, kNoWorker, 2);
        f = frame(h);
      }
    }
    c->send_frame(f);
    const auto r = c->judge(c->read_reply(milliseconds(3000)), false);
    std::string what = r.kind();
    if (r.got == Conn::Got::reply) {
      const wire::KeyEntry key{g.key, 1, 0};  // a wrong length: a small error reply, or a close
      c->send_frame(pull_frame(50, std::span(&key, 1)));
      const auto p = c->read_reply(milliseconds(3000));
      what += p.got == Conn::Got::reply ? "+serves" : p.got == Conn::Got::closed ? "+closed" : "+silent";
    }
    g_stats.outcome(name, what);
  }
}

// Connections opened and dropped as fast as possible: closed at once (FIN), reset (RST), or
// after a handshake.
void connect_flood(int lane) {
  for (int round = 0; round < 20000 && time_left() && (g.count == 0 || g_stats.connections < g.count); ++round) {
    auto c = Conn::open();
    if (!c) {
      std::this_thread::sleep_for(milliseconds(1));  // out of ports or backlog: do not spin
      continue;
    }
    switch ((round + lane) % 3) {
      case 0:
        break;
      case 1:
        c->reset_on_close();
        break;
      default:
        handshake(*c);
        c->reset_on_close();
    }
  }
}

// Checksummed pushes of --frame-mb of zeros to the real key listed as often as fits (a valid
// frame: duplicates are allowed and zeros change nothing under `add`). A checksum covers the
// whole frame, so the server must hold all of it before applying any: N such connections ask
// for N frames' worth of buffer at once.
void budget_flood(int) {
  const std::uint64_t per_key = std::uint64_t{g.key_floats} * sizeof(float);
  const std::uint32_t count = static_cast<std::uint32_t>(std::max<std::uint64_t>(1, (g.frame_mb << 20) / per_key));
  const std::vector<wire::KeyEntry> keys(count, wire::KeyEntry{g.key, g.key_floats, 0});
  static const std::vector<char> zeros(per_key);
  std::uint32_t crc = wire::crc32_update(0, keys.data(), keys.size() * sizeof(wire::KeyEntry));
  for (std::uint32_t i = 0; i < count; ++i) crc = wire::crc32_update(crc, zeros.data(), zeros.size());
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c || !handshake(*c)) continue;
    c->send_timeout(milliseconds(5000));
    for (int i = 0; i < kMaxRounds && time_left(); ++i) {
      wire::FrameHeader h = wire::make_header(wire::Op::push, 20 + i, count, per_key * count);
      h.flags = wire::kChecksum;
      h.checksum = crc;
      const auto head = frame(h, keys);
      bool sent = c->send_frame(head);
      for (std::uint32_t k = 0; sent && k < count; ++k) sent = c->send_all(zeros.data(), zeros.size());
      if (!sent) {
        (c->peer_closed() ? g_stats.closed_by_server : g_stats.silent)++;
        break;
      }
      if (c->judge(c->read_reply(milliseconds(10000)), false).got != Conn::Got::reply) break;
    }
    if (!time_left()) c->park();
  }
}

// Embedding-table ops from a peer that tries what a client of this build never sends: a table
// id past the limit, a spec with no dimension or a cap past the server's table memory, pulls
// whose rows claim 2^32-1 floats, pushes of the wrong dimension or to an unknown table (each must
// be refused, the connection served on), mixed with valid pushes of ever-new ids into a capped
// table (accepted: the cap, not the peer, bounds the rows they create).
void table_abuse(int lane) {
  TableSpec spec;
  spec.dim = 16;
  spec.max_rows = 20000;
  spec.eviction = RowEviction::lru;
  std::vector<float> good(wire::kTableSpecFloats), no_dim(wire::kTableSpecFloats), huge(wire::kTableSpecFloats);
  wire::encode_table_spec(spec, good.data());
  TableSpec bad = spec;
  wire::encode_table_spec(bad, no_dim.data());
  std::uint32_t zero = 0;
  std::memcpy(no_dim.data(), &zero, sizeof zero);  // dim 0
  bad.dim = 4096;
  bad.max_rows = (std::uint64_t{1} << 32) - 2;
  wire::encode_table_spec(bad, huge.data());
  std::mt19937_64 rng(g.seed + lane);
  auto create = [](std::uint64_t id, Key table, const std::vector<float>& words) {
    const wire::KeyEntry key{table, wire::kTableSpecFloats, 0};
    return frame(wire::make_header(wire::Op::table_create, id, 1, words.size() * sizeof(float)), std::span(&key, 1),
                 words.data(), words.size() * sizeof(float));
  };
  for (int round = 0; round < kMaxRounds && time_left(); ++round) {
    auto c = Conn::open();
    if (!c || !handshake(*c)) continue;
    if (!c->send_frame(create(5, 1, good)) || c->read_reply(milliseconds(3000)).got != Conn::Got::reply) continue;
    std::vector<wire::KeyEntry> rows(1000);
    std::vector<float> grads(rows.size() * 16, 0.01f);
    for (int i = 0; i < kMaxRounds && time_left(); ++i) {
      std::vector<std::byte> f;
      bool ok_is_wrong = true;
      switch (i % 7) {
        case 0:
          f = create(10 + i, 64 + rng() % 1000, good);
          break;
        case 1:
          f = create(10 + i, 2, no_dim);
          break;
        case 2:
          f = create(10 + i, 3, huge);
          break;
        case 3:
          for (auto& r : rows) r = {rng(), 0xFFFFFFFFu, 0};
          f = frame(wire::make_header(wire::Op::table_pull, 10 + i, static_cast<std::uint32_t>(rows.size()), 0, 0, 1),
                    rows);
          break;
        case 4:
          for (auto& r : rows) r = {rng(), 8, 0};  // half the table's dimension
          f = frame(wire::make_header(wire::Op::table_push, 10 + i, static_cast<std::uint32_t>(rows.size()),
                                      rows.size() * 8 * sizeof(float), 0, 1),
                    rows, grads.data(), rows.size() * 8 * sizeof(float));
          break;
        case 5:
          for (auto& r : rows) r = {rng(), 16, 0};
          f = frame(wire::make_header(wire::Op::table_push, 10 + i, static_cast<std::uint32_t>(rows.size()),
                                      grads.size() * sizeof(float), 0, 40),  // no table 40
                    rows, grads.data(), grads.size() * sizeof(float));
          break;
        default:
          for (auto& r : rows) r = {rng(), 16, 0};
          f = frame(wire::make_header(wire::Op::table_push, 10 + i, static_cast<std::uint32_t>(rows.size()),
                                      grads.size() * sizeof(float), 0, 1),
                    rows, grads.data(), grads.size() * sizeof(float));
          ok_is_wrong = false;
      }
      if (!c->send_frame(f)) break;
      const auto r = c->judge(c->read_reply(milliseconds(5000)), ok_is_wrong);
      if (r.got != Conn::Got::reply) break;
      if (!ok_is_wrong) (r.h.status == 0 ? g_stats.expected_ok : g_stats.expected_bad)++;
    }
    if (!time_left()) c->park();
  }
}

void print_summary();

// replayed-proof captures one real handshake first; without one it cannot run.
void run_replayed_proof(int n) {
  Capture cap;
  auto c = Conn::open();
  if (!c || !handshake(*c, &cap) || cap.hello.empty()) {
    std::fprintf(stderr, "pskv-attack: could not capture a handshake (wrong token, or the server has none)\n");
    print_summary();
    std::exit(3);
  }
  g_stats.forget_setup();
  run_lanes(n, [&cap](int i) { replayed_proof(i, cap); });
}

struct Kind {
  const char* name;
  void (*run)(int connections);
};
// Every --attack there is, and how it runs: the one list the option check and main() read.
const Kind kKinds[] = {
    {"huge-pull-lengths", [](int n) { run_lanes(n, huge_pull_lengths); }},
    {"repeated-key-pull", [](int n) { run_lanes(n, repeated_key_pull); }},
    {"slowloris-large", [](int n) { run_lanes(n, [](int i) { slowloris(i, false); }); }},
    {"slowloris-small", [](int n) { run_lanes(n, slowloris_small); }},
    {"slowloris-after-hello", [](int n) { run_lanes(n, [](int i) { slowloris(i, true); }); }},
    {"non-reader", [](int n) { run_lanes(n, non_reader); }},
    {"fast-streamer", [](int n) { run_lanes(n, fast_streamer); }},
    {"parked-flood", [](int n) { run_lanes(n, parked_flood); }},
    {"idle-flood",
     [](int n) {
       const int lanes = std::min(n, 8);
       run_lanes(lanes, [lanes](int i) { idle_flood(i, lanes); });
     }},
    {"unauth-large", [](int n) { run_lanes(n, unauth_large); }},
    {"replayed-proof", run_replayed_proof},
    {"random-bytes", [](int n) { run_lanes(n, random_bytes); }},
    {"bad-header-fields",
     [](int n) {
       const int m = std::min(n, 16);
       run_lanes(m, [m](int i) { bad_header_fields(i, m); });
     }},
    {"truncation", [](int n) { run_lanes(n, [n](int i) { truncation(i, n); }); }},
    {"second-hello", [](int n) { run_lanes(n, second_hello); }},
    {"connect-flood", [](int n) { run_lanes(n, connect_flood); }},
    {"budget-flood", [](int n) { run_lanes(n, budget_flood); }},
    {"table-abuse", [](int n) { run_lanes(n, table_abuse); }},
};

bool loopback(const std::string& host, sockaddr_in* out) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) return false;
  if ((ntohl(a.sin_addr.s_addr) >> 24) != 127) return false;
  *out = a;
  return true;
}

void print_summary() {
  std::string s = "{\"attack\":\"" + g.attack + "\",\"connections_requested\":" + std::to_string(g.connections) +
                  ",\"seconds\":" + std::to_string(g.seconds) + ",\"seed\":" + std::to_string(g.seed);
  auto num = [&](const char* name, const std::atomic<std::uint64_t>& v) {
    s += ",\"" + std::string(name) + "\":" + std::to_string(v.load());
  };
  num("connections", g_stats.connections);
  num("connect_failures", g_stats.connect_failures);
  num("handshakes", g_stats.handshakes);
  num("handshake_failures", g_stats.handshake_failures);
  num("frames_sent", g_stats.frames_sent);
  num("bytes_sent", g_stats.bytes_sent);
  num("replies_ok", g_stats.replies_ok);
  num("replies_error", g_stats.replies_error);
  num("refused_capacity", g_stats.refused_capacity);
  num("closed_by_server", g_stats.closed_by_server);
  num("silent", g_stats.silent);
  num("accepted", g_stats.accepted);
  num("expected_ok", g_stats.expected_ok);
  num("expected_bad", g_stats.expected_bad);
  num("still_open_at_end", g_stats.still_open_at_end);
  num("longest_open_ms", g_stats.longest_open_ms);
  num("max_bytes_before_close", g_stats.max_bytes_before_close);
  num("full_frames", g_stats.full_frames);
  num("cuts", g_stats.cuts);
  s += ",\"outcomes\":{";
  bool first = true;
  for (const auto& [what, results] : g_stats.outcomes) {
    s += std::string(first ? "" : ",") + "\"" + what + "\":\"";
    bool f2 = true;
    for (const auto& r : results) {
      s += (f2 ? "" : "|") + r;
      f2 = false;
    }
    s += "\"";
    first = false;
  }
  s += "}}";
  std::printf("%s\n", s.c_str());
  std::fflush(stdout);
}

}  // namespace
}  // namespace pskv::attack

int main(int argc, char** argv) {
  using namespace pskv::attack;
  CLI::App app{
      "pskv-attack: throws one class of hostile or broken peer behaviour at a pskv-server tcp:// endpoint\n"
      "on 127.0.0.0/8 and prints a JSON summary of what the server did."};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--uri", g.uri, "Target: tcp://127.x.y.z:PORT")->required();
  app.add_option("--attack", g.attack, "What to throw")->required()->check(CLI::IsMember([] {
    std::vector<std::string> names;
    for (const Kind& k : kKinds) names.push_back(k.name);
    return names;
  }()));
  app.add_option("--connections", g.connections, "Connections (or lanes) at once")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--seconds", g.seconds, "How long to attack")->capture_default_str()->check(CLI::Range(0.1, 600.0));
  app.add_option("--source-address", g.source, "Local address to attack from (127.0.0.0/8)")->capture_default_str();
  app.add_option("--auth-token-file", g.token_file,
                 "Token, to get past authentication (replayed-proof captures a real handshake with it)");
  app.add_option("--key", g.key, "A real key on the server (created here if missing)")->capture_default_str();
  app.add_option("--key-floats", g.key_floats, "Its length in floats")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 26));
  app.add_option("--repeat", g.repeat, "repeated-key-pull: occurrences of the key in one pull")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--pull-entries", g.pull_entries, "huge-pull-lengths: entries of 2^32-1 floats (at least 2)")
      ->capture_default_str()
      ->check(CLI::Range(2u, 1024u));
  app.add_option("--frame-mb", g.frame_mb, "unauth-large, budget-flood: frame size in MiB")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  app.add_option("--max-keys-per-request", g.max_keys_per_request,
                 "The server's limit (bad-header-fields steps over it)")
      ->capture_default_str();
  app.add_option("--max-request-mb", g.max_request_mb, "The server's limit (bad-header-fields steps over it)")
      ->capture_default_str();
  app.add_option("--hold-ms", g.hold_ms, "Keep the attack's sockets open this long after the summary")
      ->capture_default_str()
      ->check(CLI::Range(0, 60000));
  app.add_option("--count", g.count, "connect-flood: stop after this many connections in all (0: run for --seconds)")
      ->capture_default_str();
  app.add_option("--seed", g.seed, "Randomness (random-bytes, slowloris intervals)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  pskv::Uri uri;
  try {
    uri = pskv::parse_uri(g.uri);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pskv-attack: %s\n", e.what());
    return 2;
  }
  if (uri.scheme != "tcp" || !loopback(uri.host, &g_target) || !loopback(g.source, &g_source)) {
    std::fprintf(stderr, "pskv-attack: only tcp:// targets and sources on 127.0.0.0/8 (numeric), got %s from %s\n",
                 g.uri.c_str(), g.source.c_str());
    return 2;
  }
  g_target.sin_port = htons(uri.port);
  if (!g.token_file.empty()) {
    try {
      g_token = pskv::auth::Token::load_file(g.token_file);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pskv-attack: %s\n", e.what());
      return 2;
    }
  }
  if (g.attack == "replayed-proof" && !g_token) {
    std::fprintf(stderr, "pskv-attack: replayed-proof needs --auth-token-file to capture a real handshake\n");
    return 2;
  }
  g_end = Clock::now() + std::chrono::milliseconds(static_cast<std::int64_t>(g.seconds * 1000));

  // The bait key, created unless it exists (the first initialiser wins, so an existing one is
  // left as it is): the test harness makes it itself, scripts/attack-bench.sh relies on this.
  if (g.attack != "truncation") {
    if (auto c = Conn::open(); c && handshake(*c)) {
      const std::vector<float> zeros(g.key_floats, 0.0f);
      const pskv::wire::KeyEntry key{g.key, g.key_floats, 0};
      const auto f = frame(pskv::wire::make_header(pskv::wire::Op::init, 3, 1, zeros.size() * sizeof(float)),
                           std::span(&key, 1), zeros.data(), zeros.size() * sizeof(float));
      if (c->send_all(f.data(), f.size())) c->read_reply(milliseconds(5000));
    }
    g_stats.forget_setup();
  }

  for (const Kind& k : kKinds)
    if (g.attack == k.name) k.run(g.connections);

  print_summary();
  if (g.hold_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(g.hold_ms));
  return 0;
}
