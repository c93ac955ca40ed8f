// pskv-bench: end-to-end push/pull bandwidth and latency per transport, next to the machine's
// own limits measured in the same run (single-stream loopback TCP, 64-byte TCP ping-pong,
// single-thread memcpy), so every figure is read as a ratio on a noisy machine.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "common/json.h"
#include "common/sync.h"
#include "pskv/client.h"
#include "pskv/error.h"
#include "pskv/server.h"
#include "pskv/table.h"
#include "pskv/update_rule.h"
#include "store/update_kernels.h"
#include "table/embedding_table.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_server.h"

// Counts heap allocations in this (client) process, so the report can state allocations per
// operation on the hot path. Servers run in forked children and are not counted here.
static std::atomic<std::uint64_t> g_allocations{0};
// GCC 12 cannot tell that these replace the global operators and warns about malloc/free
// pairing with new/delete (-Wmismatched-new-delete); the pairing is exactly what is intended.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
#pragma GCC diagnostic pop

namespace {

using Clock = std::chrono::steady_clock;
using pskv::tcp::IoResult;
using pskv::tcp::read_full;

// TCP values from this size up are judged by bandwidth; smaller ones by round-trip latency.
constexpr std::size_t kBandwidthBytes = 64u << 10;

// Client settings every workload shares (--chunk-floats, --auth-token-file).
pskv::ClientOptions g_client_defaults;
// steps and rows workloads: the workers' ClientOptions::retry_timeout (--retry-timeout-ms).
std::chrono::milliseconds g_worker_retry{0};

pskv::ClientOptions client_options(const std::vector<std::string>& servers) {
  pskv::ClientOptions o = g_client_defaults;
  o.servers = servers;
  return o;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const auto k = static_cast<std::size_t>(p * double(v.size() - 1));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

// A child that dies with us: benchmarks must never leave servers behind.
template <class F>
pid_t spawn(F&& body) {
  std::fflush(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(0);
    body();
    _exit(0);
  }
  return pid;
}

// --- machine baselines -----------------------------------------------------------------------

int listen_any(std::uint16_t* port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  listen(fd, 4);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

int connect_port(std::uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(port);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw std::runtime_error("baseline connect failed");
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

// What any server must do with a pushed value besides receiving it: apply it to the stored one.
// pskv's own streaming kernel with the servers' default rule (add), so a push bound is as fast
// as pskv's apply and no faster.
void apply_pushed(float* value, const float* grad, std::size_t floats) {
  static const pskv::UpdateRuleConfig add{};
  pskv::apply_update(add, value, nullptr, grad, floats, 1, 1.0f);
}

// What the client tells the request/response peer before its first request.
struct RpcShape {
  std::uint64_t message_bytes = 0;  // the value: a push's payload, or a pull's reply
  std::uint64_t piece_bytes = 0;    // a push is applied in pieces of at most this size
  std::uint64_t pull = 0;           // 1: requests are 8 bytes and the peer replies with a value
  std::uint64_t depth = 1;          // requests in flight, each on its own value and buffer
  bool valid() const {
    return message_bytes >= sizeof(float) && message_bytes % sizeof(float) == 0 && message_bytes <= (1ull << 30) &&
           piece_bytes >= sizeof(float) && piece_bytes <= message_bytes && depth >= 1 && depth <= 64;
  }
};

bool write_all(int fd, const void* data, std::size_t bytes) {
  iovec iov{const_cast<void*>(data), bytes};
  return pskv::tcp::writev_full(fd, &iov, 1) == IoResult::ok;
}

// The request/response peer: a parameter server with nothing but TCP and the apply. It answers
// each pull with a value sent out of a value-sized buffer, and applies each push to a
// value-sized buffer: staged whole (piece_bytes = the message, as pskv-server with --tcp-push
// whole), or as it arrives, whatever each read brought, at most piece_bytes at a time (as with
// --tcp-push pieces, except that the server gathers 16 KiB while more keeps coming). Then it
// acks it with 8 bytes.
void serve_rpc(int fd, const RpcShape& s) {
  const std::size_t floats = s.message_bytes / sizeof(float), piece = s.piece_bytes / sizeof(float);
  std::vector<std::vector<float>> values(s.depth, std::vector<float>(floats, 1.0f));
  std::vector<float> grad(s.pull ? 0 : piece);
  for (std::uint64_t i = 0;; ++i) {
    std::vector<float>& value = values[i % s.depth];
    if (s.pull) {
      std::uint64_t request = 0;
      if (read_full(fd, &request, sizeof request) != IoResult::ok || !write_all(fd, value.data(), s.message_bytes))
        return;
      continue;
    }
    if (piece == floats) {
      if (read_full(fd, grad.data(), s.message_bytes) != IoResult::ok) return;
      apply_pushed(value.data(), grad.data(), floats);
    } else {
      auto* const bytes = reinterpret_cast<char*>(grad.data());
      for (std::size_t at = 0, have = 0; at < floats;) {  // have: bytes of a float begun
        const ssize_t n = ::read(fd, bytes + have, std::min(piece, floats - at) * sizeof(float) - have);
        if (n <= 0) {
          if (n < 0 && errno == EINTR) continue;
          return;
        }
        have += static_cast<std::size_t>(n);
        const std::size_t whole = have / sizeof(float);
        apply_pushed(value.data() + at, grad.data(), whole);
        at += whole;
        have -= whole * sizeof(float);
        std::memmove(bytes, bytes + whole * sizeof(float), have);
      }
    }
    if (!write_all(fd, &i, sizeof i)) return;
  }
}

// The raw peers: a sink that drains a stream, an echo for ping-pong, and the request/response
// peer above.
struct RawPeers {
  std::uint16_t sink_port = 0, echo_port = 0, rpc_port = 0;
  std::vector<pid_t> pids;
  void start() {
    int sink = listen_any(&sink_port);
    int echo = listen_any(&echo_port);
    int rpc = listen_any(&rpc_port);
    pids.push_back(spawn([&] {
      for (;;) {
        int c = accept(rpc, nullptr, nullptr);
        if (c < 0) _exit(0);
        int one = 1;
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        RpcShape shape;
        if (read_full(c, &shape, sizeof shape) == IoResult::ok && shape.valid()) serve_rpc(c, shape);
        close(c);
      }
    }));
    pids.push_back(spawn([&] {
      for (;;) {
        int c = accept(sink, nullptr, nullptr);
        if (c < 0) _exit(0);
        std::vector<char> buf(1 << 20);
        while (read(c, buf.data(), buf.size()) > 0) {
        }
        close(c);
      }
    }));
    pids.push_back(spawn([&] {
      for (;;) {
        int c = accept(echo, nullptr, nullptr);
        if (c < 0) _exit(0);
        int one = 1;
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        char buf[64];
        while (read_full(c, buf, sizeof buf) == IoResult::ok && write(c, buf, sizeof buf) == ssize_t(sizeof buf)) {
        }
        close(c);
      }
    }));
    close(sink);
    close(echo);
    close(rpc);
  }
};

// A single stream of 1 MiB writes out of one buffer, which therefore never leaves the cache.
double tcp_stream_bandwidth(std::uint16_t port, double seconds) {
  int fd = connect_port(port);
  std::vector<char> buf(1 << 20, 1);
  std::uint64_t bytes = 0;
  const auto t0 = Clock::now();
  while (seconds_since(t0) < seconds) {
    const ssize_t n = write(fd, buf.data(), buf.size());
    if (n <= 0) break;
    bytes += static_cast<std::uint64_t>(n);
  }
  const double bw = double(bytes) / seconds_since(t0);
  close(fd);
  return bw;
}

// Values moved per second by raw requests and responses on one connection, `depth` in flight,
// each push sent out of (and each pull read into) its own value-sized buffer: what a parameter
// server could reach at best with this machine's TCP, at this size and depth. Unlike the stream,
// it pays a round trip per request at depth 1, and from 16 MiB its buffers leave the cache.
double tcp_rpc_bandwidth(std::uint16_t port, double seconds, const RpcShape& s) {
  int fd = connect_port(port);
  std::vector<std::vector<char>> bufs(s.depth, std::vector<char>(s.message_bytes, 1));
  std::uint64_t issued = 0, done = 0;
  const auto issue = [&] {
    const bool ok =
        s.pull ? write_all(fd, &issued, sizeof issued) : write_all(fd, bufs[issued % s.depth].data(), s.message_bytes);
    ++issued;
    return ok;
  };
  const auto complete = [&] {
    std::uint64_t ack = 0;
    const bool ok = s.pull ? read_full(fd, bufs[done % s.depth].data(), s.message_bytes) == IoResult::ok
                           : read_full(fd, &ack, sizeof ack) == IoResult::ok;
    done += ok;
    return ok;
  };
  bool ok = write_all(fd, &s, sizeof s);
  const auto t0 = Clock::now();
  while (ok && issued < s.depth) ok = issue();
  while (ok && seconds_since(t0) < seconds) ok = complete() && issue();
  const double bw = ok ? double(done * s.message_bytes) / seconds_since(t0) : 0;
  close(fd);
  return bw;
}

double tcp_pingpong_p50_us(std::uint16_t port, int rounds) {
  int fd = connect_port(port);
  char buf[64] = {};
  std::vector<double> lat;
  lat.reserve(rounds);
  for (int i = 0; i < rounds; ++i) {
    const auto t0 = Clock::now();
    if (write(fd, buf, sizeof buf) != ssize_t(sizeof buf) || read_full(fd, buf, sizeof buf) != IoResult::ok) break;
    lat.push_back(seconds_since(t0) * 1e6);
  }
  close(fd);
  return percentile(lat, 0.5);
}

// The shm push floor: one value-sized copy (a worker's undo copy, or its copy into the slot)
// and the apply, with pskv's own kernels (both spread over the cores from 1 MiB), one after the
// other on the calling thread, no hand-off.
double copy_apply_bandwidth(std::size_t bytes, double seconds) {
  const std::size_t floats = std::max<std::size_t>(1, bytes / sizeof(float));
  std::vector<float> grad(floats, 1e-3f), slot(floats), value(floats, 1.0f);
  std::uint64_t moved = 0;
  const auto t0 = Clock::now();
  while (seconds_since(t0) < seconds) {
    pskv::copy_floats(slot.data(), grad.data(), floats);
    apply_pushed(value.data(), slot.data(), floats);
    moved += floats * sizeof(float);
    asm volatile("" ::"r"(value.data()) : "memory");
  }
  return double(moved) / seconds_since(t0);
}

double memcpy_bandwidth(std::size_t bytes, double seconds) {
  std::vector<char> a(bytes, 1), b(bytes);
  std::uint64_t moved = 0;
  const auto t0 = Clock::now();
  while (seconds_since(t0) < seconds) {
    std::memcpy(b.data(), a.data(), bytes);
    moved += bytes;
    asm volatile("" ::"r"(b.data()) : "memory");
  }
  return double(moved) / seconds_since(t0);
}

// --- pskv measurements ----------------------------------------------------------------------

struct Point {
  std::string op;
  std::size_t value_bytes;
  int clients;
  double bytes_per_s, p50_us, p99_us;
  std::uint64_t ops;
  double allocs_per_op = 0;
  // With a baseline window before each round: each round's bandwidth over the window's.
  std::vector<double> round_ratios;
  std::vector<double> round_baselines;
};

// Opens the rounds of a measurement to its client threads, one at a time; between rounds they
// sleep, so a baseline measured meanwhile has the cores to itself.
class RoundGate {
 public:
  void open(int round) {
    std::lock_guard lock(mu_);
    open_ = round;
    cv_.notify_all();
  }
  void wait_open(int round) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return open_ >= round; });
  }
  void finish() {
    std::lock_guard lock(mu_);
    ++finished_;
    cv_.notify_all();
  }
  void wait_finished(int count) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return finished_ >= count; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int open_ = -1, finished_ = 0;
};

// `rounds` windows of seconds / rounds each. With `baseline_window`, it is called before every
// round, so each round's bandwidth can be set against a baseline taken moments before: on a
// shared host the machine's limits drift within seconds, and a ratio to a baseline from the
// start of the run would measure that drift as much as pskv.
Point measure(const std::vector<std::string>& servers, const std::string& op, std::size_t value_bytes, int clients,
              double seconds, std::uint64_t max_ops, int depth, int rounds = 1,
              const std::function<double()>& baseline_window = {}) {
  const std::size_t floats = std::max<std::size_t>(1, value_bytes / sizeof(float));
  const double round_seconds = seconds / rounds;
  const std::uint64_t round_max_ops = std::max<std::uint64_t>(1, max_ops / static_cast<std::uint64_t>(rounds));
  std::vector<std::vector<double>> lat(clients);
  // done[round][client]
  std::vector<std::vector<std::uint64_t>> done(rounds, std::vector<std::uint64_t>(clients, 0));
  std::atomic<int> ready{0};
  RoundGate gate;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(clients);
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      int rounds_done = 0;
      try {
        pskv::ClientOptions o = client_options(servers);
        pskv::Client client(o);
        // One key and buffer per operation in flight; the oldest is waited for before its key
        // is used again, so with depth 1 this is one operation at a time.
        std::vector<pskv::Key> keys(depth);
        std::vector<std::vector<float>> bufs(depth, std::vector<float>(floats, 0.0f));
        for (int d = 0; d < depth; ++d) {
          keys[d] =
              (std::uint64_t{value_bytes} << 16) | (static_cast<std::uint64_t>(c) << 8) | static_cast<std::uint64_t>(d);
          client.register_buffer(bufs[d].data(), bufs[d].size() * sizeof(float));
          client.wait(client.init(keys[d], bufs[d]));
        }
        lat[c].reserve(std::min<std::uint64_t>(max_ops, 1 << 22));
        // A ring of the operations in flight (no allocation per operation, unlike a deque).
        std::vector<std::pair<pskv::Ticket, Clock::time_point>> ring(depth);
        ready.fetch_add(1);
        for (int r = 0; r < rounds; ++r) {
          gate.wait_open(r);
          std::uint64_t& n = done[r][c];
          std::uint64_t issued = 0;
          const auto start = Clock::now();
          while (n < round_max_ops && (n < 3 || seconds_since(start) < round_seconds)) {
            for (; issued < n + static_cast<std::uint64_t>(depth); ++issued) {
              const auto d = static_cast<std::size_t>(issued % static_cast<std::uint64_t>(depth));
              ring[d].second = Clock::now();  // before issuing: a push sends its values inside push()
              ring[d].first =
                  op == "push" ? client.push(keys[d], bufs[d]) : client.pull(keys[d], std::span<float>(bufs[d]));
            }
            const auto& oldest = ring[static_cast<std::size_t>(n % static_cast<std::uint64_t>(depth))];
            client.wait(oldest.first);
            if (lat[c].size() < lat[c].capacity()) lat[c].push_back(seconds_since(oldest.second) * 1e6);
            ++n;
          }
          for (; n < issued; ++n)
            client.wait(ring[static_cast<std::size_t>(n % static_cast<std::uint64_t>(depth))].first);
          gate.finish();
          ++rounds_done;
        }
      } catch (const std::exception& e) {
        errors[c] = e.what();
        ready.fetch_add(1);
        for (; rounds_done < rounds; ++rounds_done) gate.finish();
      }
    });
  while (ready.load() < clients) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  Point p{op, value_bytes, clients, 0, 0, 0, 0, 0, {}, {}};
  double wall = 0;
  std::uint64_t allocs = 0;
  const double value_size = double(floats * sizeof(float));
  for (int r = 0; r < rounds; ++r) {
    const double base = baseline_window ? baseline_window() : 0;
    const auto t0 = Clock::now();
    const std::uint64_t allocs0 = g_allocations.load();
    gate.open(r);
    gate.wait_finished((r + 1) * clients);
    const double round_wall = seconds_since(t0);
    // Latency vectors were reserved up front; what remains is the client library's own.
    allocs += g_allocations.load() - allocs0;
    wall += round_wall;
    std::uint64_t round_ops = 0;
    for (int c = 0; c < clients; ++c) round_ops += done[r][c];
    p.ops += round_ops;
    if (base > 0) {
      p.round_baselines.push_back(base);
      p.round_ratios.push_back(double(round_ops) * value_size / round_wall / base);
    }
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (!e.empty()) throw std::runtime_error(e);
  std::vector<double> all;
  for (int c = 0; c < clients; ++c) all.insert(all.end(), lat[c].begin(), lat[c].end());
  p.bytes_per_s = double(p.ops) * value_size / wall;
  p.allocs_per_op = double(allocs) / double(std::max<std::uint64_t>(p.ops, 1));
  p.p50_us = percentile(all, 0.5);
  p.p99_us = percentile(all, 0.99);
  return p;
}

// Training-shaped loop: each worker pulls every key, pushes a gradient for every key, clocks.
// Worker 0 optionally sleeps per step (a straggler) so the modes differ.
struct StepsResult {
  double steps_per_s;
  std::uint64_t max_staleness;
  double p50_step_us;
  double max_step_us;  // the longest step of any worker: a server's failure shows here
  std::array<std::uint64_t, pskv::StalenessStats::kBuckets> histogram{};
};

// `at_step(step)` runs on worker 0's thread before each of its steps (a fault to inject).
StepsResult measure_steps(const std::vector<std::string>& servers, int workers, std::size_t value_bytes, int steps,
                          int straggler_us, const std::function<void(int)>& at_step = {}) {
  const std::size_t floats = std::max<std::size_t>(1, value_bytes / sizeof(float));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(workers);
  std::vector<std::vector<double>> step_us(workers);
  std::vector<pskv::StalenessStats> stale(workers);
  {
    pskv::ClientOptions o = client_options(servers);
    pskv::Client admin(o);
    std::vector<float> zeros(floats, 0.0f);
    for (int w = 0; w < workers; ++w) admin.wait(admin.init(pskv::Key(1u << 30) + w, zeros));
  }
  const auto t0 = Clock::now();
  for (int w = 0; w < workers; ++w)
    threads.emplace_back([&, w] {
      try {
        pskv::ClientOptions o = client_options(servers);
        o.worker_id = static_cast<std::uint32_t>(w);
        o.retry_timeout = g_worker_retry;
        pskv::Client client(o);
        std::vector<pskv::Key> keys;
        std::vector<std::vector<float>> bufs(workers, std::vector<float>(floats));
        std::vector<std::span<float>> outs;
        for (int k = 0; k < workers; ++k) {
          keys.push_back(pskv::Key(1u << 30) + k);
          outs.emplace_back(bufs[k]);
        }
        std::vector<std::vector<float>> grads(workers, std::vector<float>(floats, 1e-3f));
        std::vector<std::span<const float>> grad_spans(grads.begin(), grads.end());
        for (int step = 0; step < steps; ++step) {
          if (w == 0 && at_step) at_step(step);
          const auto s0 = Clock::now();
          client.wait(client.pull(keys, outs));
          if (w == 0 && straggler_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(straggler_us));
          client.wait(client.push(keys, grad_spans));  // a gradient for the whole model
          client.clock();
          step_us[w].push_back(seconds_since(s0) * 1e6);
        }
        stale[w] = client.staleness();
      } catch (const std::exception& e) {
        errors[w] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  const double wall = seconds_since(t0);
  for (const auto& e : errors)
    if (!e.empty()) throw std::runtime_error(e);
  StepsResult r{double(workers) * steps / wall, 0, 0, 0, {}};
  std::vector<double> all;
  for (int w = 0; w < workers; ++w) {
    r.max_staleness = std::max(r.max_staleness, stale[w].max);
    for (std::size_t b = 0; b < r.histogram.size(); ++b) r.histogram[b] += stale[w].histogram[b];
    all.insert(all.end(), step_us[w].begin(), step_us[w].end());
  }
  r.max_step_us = all.empty() ? 0 : *std::max_element(all.begin(), all.end());
  r.p50_step_us = percentile(all, 0.5);
  return r;
}

// Embedding-style traffic: a table of `keys` x `floats` and batches of `batch_keys` keys drawn
// uniformly or by a Zipf law (hot keys), as sparse models pull and push.
class KeyDraw {
 public:
  KeyDraw(std::uint64_t keys, const std::string& dist, double s) : keys_(keys), zipf_(dist == "zipf"), s_(s) {
    if (!zipf_) return;
    // Past 2^24 keys the exact table (8 bytes a key) takes more time to search, a cache miss per
    // step, than the operation being measured: the continuous power law x^-s on [1, keys + 1),
    // drawn by its inverse CDF and floored, stands in for it.
    if (keys > (1u << 24)) return;
    cdf_.resize(keys);
    double sum = 0;
    for (std::uint64_t k = 0; k < keys; ++k) cdf_[k] = (sum += 1.0 / std::pow(double(k + 1), s));
    for (auto& x : cdf_) x /= sum;
  }
  template <class Rng>
  std::uint64_t operator()(Rng& rng) const {
    if (!zipf_) return rng() % keys_;
    const double u = std::uniform_real_distribution<double>(0, 1)(rng);
    std::uint64_t rank;
    if (cdf_.empty()) {
      const double n = static_cast<double>(keys_) + 1, a = 1 - s_;
      const double x = std::abs(a) < 1e-9 ? std::exp(u * std::log(n)) : std::pow(1 - u * (1 - std::pow(n, a)), 1 / a);
      rank = std::min<std::uint64_t>(static_cast<std::uint64_t>(x) - 1, keys_ - 1);
    } else {
      rank = static_cast<std::uint64_t>(std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin());
    }
    return pskv_mix(rank) % keys_;  // hot keys scattered over the table, not clustered at 0
  }
  static std::uint64_t pskv_mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
  }

 private:
  std::uint64_t keys_;
  bool zipf_;
  double s_;
  std::vector<double> cdf_;  // exact Zipf up to 2^24 keys; empty: the continuous law above
};

// How many batches of ids a client of the sparse and rows workloads draws before the clock
// starts, and cycles through: 2^20 ids. With 64 batches (until 2026-11-28) the two clients'
// 128K ids and what their lookups touch fitted in this VM's 32 MiB L3, so a table of 100M rows
// was measured as a table of 128K; 2^20 ids per client touch half a GB of index and rows.
std::size_t drawn_batches(std::size_t batch_keys) {
  return std::max<std::size_t>(64, ((std::size_t{1} << 20) + batch_keys - 1) / batch_keys);
}

// Client `c`'s ids for the sparse and rows workloads, drawn before the clock starts and cycled:
// a Zipf draw over 10^8 keys costs more than the operation measured, and the generator is not
// what is measured.
std::vector<std::uint64_t> draw_ids(const KeyDraw& draw, int c, std::size_t batch_keys) {
  std::mt19937_64 rng(1000 + c);
  std::vector<std::uint64_t> drawn(drawn_batches(batch_keys) * batch_keys);
  for (auto& k : drawn) k = draw(rng);
  return drawn;
}

// The memory's own limit for a row per id (--transport table's baseline): `clients` threads read
// rows of `floats` floats at random from an array of `rows` (on huge pages where the kernel
// gives them), each batch of ids drawn as the workload draws them and prefetched 16 ids ahead,
// one cache miss per row and no index. Rows per second.
double random_rows_per_s(const KeyDraw& draw, std::uint64_t rows, std::size_t floats, std::size_t batch_keys,
                         int clients, double seconds) {
  const std::size_t row_bytes = floats * sizeof(float), bytes = rows * row_bytes;
  void* mem = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED)
    throw std::runtime_error("random_rows_per_s: no memory for " + std::to_string(bytes) + " bytes");
  ::madvise(mem, bytes, MADV_HUGEPAGE);
  auto* table = static_cast<float*>(mem);
  for (std::size_t at = 0; at < bytes; at += 4096) static_cast<char*>(mem)[at] = 1;
  std::vector<std::uint64_t> done(clients, 0);
  std::vector<std::thread> threads;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      constexpr std::size_t kAhead = 16;
      const std::vector<std::uint64_t> drawn = draw_ids(draw, c, batch_keys);
      const std::size_t batches = drawn.size() / batch_keys;
      std::vector<float> out(batch_keys * floats);
      ready.fetch_add(1);
      while (!go.load()) std::this_thread::yield();
      const auto start = Clock::now();
      while (seconds_since(start) < seconds) {
        const std::uint64_t* ids = drawn.data() + (done[c] / batch_keys % batches) * batch_keys;
        for (std::size_t i = 0; i < batch_keys; ++i) {
          if (i + kAhead < batch_keys) __builtin_prefetch(table + ids[i + kAhead] * floats);
          std::memcpy(out.data() + i * floats, table + ids[i] * floats, row_bytes);
        }
        asm volatile("" ::"r"(out.data()) : "memory");
        done[c] += batch_keys;
      }
    });
  while (ready.load() < clients) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto t0 = Clock::now();
  go = true;
  for (auto& t : threads) t.join();
  const double wall = seconds_since(t0);
  ::munmap(mem, bytes);
  double total = 0;
  for (auto d : done) total += double(d);
  return total / wall;
}

struct SparsePoint {
  double keys_per_s, bytes_per_s, p50_us, p99_us;
  std::uint64_t batches;
};

void init_sparse_table(const std::vector<std::string>& servers, std::uint64_t keys, std::size_t floats) {
  pskv::ClientOptions o = client_options(servers);
  pskv::Client admin(o);
  constexpr std::uint64_t kBatch = 8192;
  std::vector<float> values(kBatch * floats, 0.0f);
  std::vector<pskv::Key> ks;
  std::vector<std::span<const float>> spans;
  std::vector<pskv::Ticket> tickets;
  for (std::uint64_t base = 0; base < keys; base += kBatch) {
    ks.clear();
    spans.clear();
    for (std::uint64_t k = base; k < std::min(keys, base + kBatch); ++k) {
      ks.push_back(k);
      spans.emplace_back(values.data() + (k - base) * floats, floats);
    }
    admin.wait(admin.init(ks, spans));
  }
}

// The rows workload's table (Client::create_table): rows of `dim` floats, plain SGD, room for all.
pskv::TableSpec rows_spec(std::size_t dim, std::uint64_t rows) {
  pskv::TableSpec spec;
  spec.dim = static_cast<std::uint32_t>(dim);
  spec.rule.rule = pskv::UpdateRule::sgd;
  spec.max_rows = rows;
  return spec;
}

// A rows workload client: worker `c`, retrying (its row pushes identified) with --retry-timeout-ms.
pskv::ClientOptions rows_client(const std::vector<std::string>& servers, int c) {
  pskv::ClientOptions o = client_options(servers);
  if (g_worker_retry.count() > 0) {
    o.worker_id = static_cast<std::uint32_t>(c);
    o.retry_timeout = g_worker_retry;
  }
  return o;
}

// One number of a server's stats JSON (flat, as JsonObject writes it); 0 when absent.
double stat_of(const std::string& json, const std::string& name) {
  const auto at = json.find("\"" + name + "\":");
  return at == std::string::npos ? 0 : std::strtod(json.c_str() + at + name.size() + 3, nullptr);
}

struct InsertPoint {
  double inserts_per_s, bytes_per_row;
  double p50_us, p99_us, max_us;  // per batch: a push that grows the table waits for its growth
};

// Creates every row of the rows workload's table once, ids [0, rows) in batches, `clients`
// threads each taking every clients-th batch; then reads what a row costs from the servers.
// `local` (--transport table): the threads push into that table of this process instead.
InsertPoint insert_rows(const std::vector<std::string>& servers, std::uint64_t rows, std::size_t dim,
                        std::size_t batch_keys, int clients, pskv::EmbeddingTable* local) {
  std::vector<std::string> errors(clients);
  std::vector<std::vector<double>> lat(clients);
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      try {
        std::optional<pskv::Client> client;
        if (!local) {
          client.emplace(rows_client(servers, c));
          client->create_table(0, rows_spec(dim, rows));
        }
        std::vector<float> grads(batch_keys * dim, 0.0f);
        std::vector<pskv::Key> ids;
        lat[c].reserve(rows / batch_keys / clients + 1);
        for (std::uint64_t base = std::uint64_t(c) * batch_keys; base < rows;
             base += std::uint64_t(clients) * batch_keys) {
          ids.clear();
          for (std::uint64_t id = base; id < std::min(rows, base + batch_keys); ++id) ids.push_back(id);
          const auto s = Clock::now();
          if (local)
            local->push(ids, grads.data(), 0);
          else
            client->wait(client->push_rows(0, ids, std::span<const float>(grads.data(), ids.size() * dim)));
          lat[c].push_back(seconds_since(s) * 1e6);
        }
      } catch (const std::exception& e) {
        errors[c] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  const double wall = seconds_since(t0);
  for (const auto& e : errors)
    if (!e.empty()) throw std::runtime_error(e);
  double bytes = 0, alive = 0;
  if (local) {
    const pskv::TableStats stats = local->stats();
    bytes = double(stats.bytes);
    alive = double(stats.rows);
  } else {
    pskv::Client admin(client_options(servers));
    for (std::size_t s = 0; s < servers.size(); ++s) {
      const std::string json = admin.server_stats(s);
      bytes += stat_of(json, "table_0_bytes");
      alive += stat_of(json, "table_0_rows");
    }
  }
  if (alive != double(rows))
    throw std::runtime_error("the servers hold " + std::to_string(alive) + " rows after inserting " +
                             std::to_string(rows));
  std::vector<double> all;
  for (const auto& l : lat) all.insert(all.end(), l.begin(), l.end());
  const double max_us = all.empty() ? 0 : *std::max_element(all.begin(), all.end());
  return {double(rows) / wall, bytes / alive, percentile(all, 0.5), percentile(all, 0.99), max_us};
}

// `depth` batches in flight per client (a local table's are called one at a time); a batch's
// latency runs from its issue to its completion.
SparsePoint measure_sparse(const std::vector<std::string>& servers, const std::string& op, const KeyDraw& draw,
                           std::size_t floats, std::size_t batch_keys, int clients, double seconds, int depth,
                           std::uint64_t table_rows = 0, pskv::EmbeddingTable* local = nullptr) {
  std::vector<std::vector<double>> lat(clients);
  std::vector<std::uint64_t> done(clients, 0);
  std::vector<std::string> errors(clients);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      try {
        const std::size_t slots = local ? 1 : static_cast<std::size_t>(depth);
        struct Slot {
          std::vector<float> buf;
          std::vector<pskv::Key> keys;
          std::vector<std::span<float>> outs;
          std::vector<std::span<const float>> ins;
          pskv::Ticket ticket{};
          Clock::time_point issued;
        };
        // Before the client: if a wait throws with other batches in flight, the client (which
        // ends them) goes before their buffers do.
        std::vector<Slot> ring(slots);
        std::optional<pskv::Client> client;
        if (!local) client.emplace(table_rows ? rows_client(servers, c) : client_options(servers));
        if (table_rows && client) client->create_table(0, rows_spec(floats, table_rows));
        for (Slot& sl : ring) {
          sl.buf.assign(batch_keys * floats, 1e-3f);
          sl.keys.resize(batch_keys);
          if (client) client->register_buffer(sl.buf.data(), sl.buf.size() * sizeof(float));
          for (std::size_t i = 0; i < batch_keys; ++i) {
            sl.outs.emplace_back(sl.buf.data() + i * floats, floats);
            sl.ins.emplace_back(sl.buf.data() + i * floats, floats);
          }
        }
        const std::vector<pskv::Key> drawn = draw_ids(draw, c, batch_keys);
        const std::size_t batches = drawn.size() / batch_keys;
        std::uint64_t issued = 0;
        auto issue = [&] {
          Slot& sl = ring[issued % slots];
          std::copy_n(drawn.begin() + (issued % batches) * batch_keys, batch_keys, sl.keys.begin());
          ++issued;
          sl.issued = Clock::now();
          if (local && op == "push")
            local->push(sl.keys, sl.buf.data(), 0);
          else if (local)
            local->pull(sl.keys, sl.buf.data());
          else if (table_rows)
            sl.ticket = op == "push" ? client->push_rows(0, sl.keys, sl.buf) : client->pull_rows(0, sl.keys, sl.buf);
          else
            sl.ticket = op == "push" ? client->push(sl.keys, sl.ins) : client->pull(sl.keys, sl.outs);
        };
        auto complete_oldest = [&] {
          Slot& sl = ring[done[c] % slots];
          if (client) client->wait(sl.ticket);
          lat[c].push_back(seconds_since(sl.issued) * 1e6);
          ++done[c];
        };
        ready.fetch_add(1);
        while (!go.load()) std::this_thread::yield();
        const auto start = Clock::now();
        while (issued < slots) issue();
        for (;;) {
          complete_oldest();
          if (done[c] >= 3 && seconds_since(start) >= seconds) break;
          issue();
        }
        while (done[c] < issued) complete_oldest();
      } catch (const std::exception& e) {
        errors[c] = e.what();
        ready.fetch_add(1);
      }
    });
  while (ready.load() < clients) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const auto t0 = Clock::now();
  go = true;
  for (auto& t : threads) t.join();
  const double wall = seconds_since(t0);
  for (const auto& e : errors)
    if (!e.empty()) throw std::runtime_error(e);
  std::vector<double> all;
  std::uint64_t batches = 0;
  for (int c = 0; c < clients; ++c) {
    all.insert(all.end(), lat[c].begin(), lat[c].end());
    batches += done[c];
  }
  const double keys_per_s = double(batches) * double(batch_keys) / wall;
  return {keys_per_s, keys_per_s * double(floats * sizeof(float)), percentile(all, 0.5), percentile(all, 0.99),
          batches};
}

std::vector<std::size_t> parse_sizes(const std::string& text) {
  std::vector<std::size_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    std::size_t mult = 1;
    if (!item.empty() && (item.back() == 'K' || item.back() == 'k'))
      mult = 1 << 10, item.pop_back();
    else if (!item.empty() && (item.back() == 'M' || item.back() == 'm'))
      mult = 1 << 20, item.pop_back();
    out.push_back(std::stoull(item) * mult);
  }
  return out;
}

// One result line of --json output.
void print_json(const pskv::JsonObject& j) {
  std::printf("%s\n", j.str().c_str());
}

std::string human(double bytes) {
  char buf[32];
  if (bytes >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  else if (bytes >= 1e6)
    std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.1f kB", bytes / 1e3);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "pskv-bench: push/pull bandwidth and latency per transport, as ratios to the machine's own limits "
      "measured in the same run."};
  std::string transport = "tcp", sizes_text = "64,1K,4K,64K,1M,4M,16M", clients_text = "1,2", ops_text = "push,pull";
  std::vector<std::string> targets;
  int servers = 1;
  double seconds = 0.5;
  std::uint64_t max_ops = 200000;
  bool json = false;
  app.add_option("--transport", transport,
                 "tcp, shm or rdma; or table (rows workload only): no server and no transport, the clients' "
                 "threads call one embedding table of this process, what a server's lookups cost alone")
      ->capture_default_str()
      ->check(CLI::IsMember({"tcp", "shm", "rdma", "table"}));
  std::string shm_push = "worker";
  app.add_option("--shm-push", shm_push, "shm servers it starts: who applies a push (worker or server, as pskv-server)")
      ->capture_default_str()
      ->check(CLI::IsMember({"worker", "server"}));
  bool shm_adopt = false;
  app.add_flag("--shm-adopt", shm_adopt,
               "shm servers it starts: made to be adopted (adopt=1, as pskv-server --shm-adopt): pushes they apply "
               "and table rows are logged first, and tables keep their rows in /dev/shm files");
  std::string tcp_push = "pieces";
  app.add_option("--tcp-push", tcp_push,
                 "tcp servers it starts: how a large push is applied (pieces or whole, as pskv-server)")
      ->capture_default_str()
      ->check(CLI::IsMember({"pieces", "whole"}));
  unsigned server_threads = 0;
  app.add_option("--server-threads", server_threads,
                 "servers it starts: request threads (0: their default, as pskv-server --io-threads; an shm server "
                 "takes one per two cores, and serves table rows on those)")
      ->capture_default_str();
  app.add_option("--sizes", sizes_text, "Value sizes in bytes (K/M suffixes)")->capture_default_str();
  app.add_option("--clients", clients_text, "Client counts to sweep")->capture_default_str();
  app.add_option("--ops", ops_text, "Operations to measure: push, pull")->capture_default_str();
  app.add_option("--servers", servers, "Servers to start (ignored with --server)")->capture_default_str();
  std::uint32_t replicas = 1;
  app.add_option("--replicas", replicas,
                 "tcp servers it starts: each key held by this many of them (as pskv-server --replicas)")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  app.add_option("--server", targets, "Target existing servers instead of starting them (repeat per server)");
  app.add_option("--auth-token-file", g_client_defaults.auth_token_file,
                 "Token file for --server targets that demand authentication")
      ->envname("PSKV_AUTH_TOKEN_FILE");
  int depth = 1;
  app.add_option("--depth", depth,
                 "dense, sparse and rows workloads: operations each client keeps in flight (1: one at a time; "
                 "--transport table calls its table one batch at a time)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--chunk-floats", g_client_defaults.chunk_floats,
                 "Split values longer than this over all servers (0: never split)")
      ->capture_default_str();
  app.add_option("--seconds", seconds, "Measuring time per point")->capture_default_str();
  app.add_option("--max-ops", max_ops, "Cap on operations per client per point")->capture_default_str();
  int rounds = 5;
  app.add_option("--rounds", rounds,
                 "dense workload, bandwidth points: split each point into this many rounds, each just after a "
                 "window of its baseline, and report the median of the rounds' ratios")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));
  app.add_flag("--json", json, "One JSON object per line instead of a table");
  std::string workload = "dense", mode = "asp";
  int workers = 4, steps = 300, straggler_us = 0;
  std::uint32_t staleness = 0, sync_required = 0;
  app.add_option("--workload", workload,
                 "dense: push/pull sweep; steps: pull-push-clock training loop per mode; sparse: batches of keys of "
                 "an initialised table; rows: batches of rows of an embedding table (Client::pull_rows/push_rows), "
                 "after inserting all of them")
      ->capture_default_str()
      ->check(CLI::IsMember({"dense", "steps", "sparse", "rows"}));
  std::uint64_t table_keys = 1000000;
  std::size_t key_floats = 16, batch_keys = 1000;
  std::string dist = "uniform";
  double zipf_s = 0.99;
  app.add_option("--table-keys", table_keys, "sparse and rows workloads: keys (rows) in the table")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--key-floats", key_floats, "sparse and rows workloads: floats per key (row)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-keys", batch_keys, "sparse and rows workloads: keys (rows) per push/pull")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--dist", dist, "sparse and rows workloads: uniform or zipf")
      ->capture_default_str()
      ->check(CLI::IsMember({"uniform", "zipf"}));
  app.add_option("--zipf-s", zipf_s, "sparse and rows workloads: Zipf exponent")->capture_default_str();
  app.add_option("--mode", mode, "steps workload: asp, bsp, ssp or sync")
      ->capture_default_str()
      ->check(CLI::IsMember({"asp", "bsp", "ssp", "sync"}));
  app.add_option("--staleness", staleness, "steps workload, ssp: the bound s")->capture_default_str();
  app.add_option("--sync-required", sync_required, "steps workload, sync: K of N (0 = N)")->capture_default_str();
  app.add_option("--workers", workers, "steps workload: workers (threads, each with its own client)")
      ->capture_default_str();
  app.add_option("--steps", steps, "steps workload: steps per worker")->capture_default_str();
  std::int64_t retry_ms = 0;
  app.add_option("--retry-timeout-ms", retry_ms,
                 "steps and rows workloads: the workers retry a failed server for this long "
                 "(ClientOptions::retry_timeout; their pushes are identified: a replicated server applies dense ones "
                 "whole, and table pushes one at a time)")
      ->capture_default_str();
  app.add_option("--straggler-us", straggler_us, "steps workload: worker 0 sleeps this long per step")
      ->capture_default_str();
  int kill_at_step = -1;
  app.add_option("--kill-at-step", kill_at_step,
                 "steps workload with --replicas and --retry-timeout-ms: when worker 0 reaches this step, SIGKILL "
                 "server 1 and restart it with --rejoin (from a process forked beforehand); reports the longest "
                 "step (max_step_us) and how long the restart took (restart_ms)");
  int failover_ms = 0;
  app.add_option("--failover-ms", failover_ms,
                 "with --replicas and 3+ --servers: the servers fail over (pskv-server --failover-ms); with "
                 "--kill-at-step, server 1 is then not restarted: its successor serves its keys")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  g_worker_retry = std::chrono::milliseconds(retry_ms);

  const auto sizes = parse_sizes(sizes_text);
  std::vector<int> client_counts;
  for (auto n : parse_sizes(clients_text)) client_counts.push_back(static_cast<int>(n));
  std::vector<std::string> ops;
  {
    std::stringstream ss(ops_text);
    std::string op;
    while (std::getline(ss, op, ',')) ops.push_back(op);
  }

  // Every child is forked before this process starts a thread.
  RawPeers peers;
  peers.start();
  std::vector<pid_t> server_pids;
  pid_t spare = -1;                     // --kill-at-step: server 1's successor
  int spare_go = -1, spare_ready = -1;  // its pipes: start serving, and serving
  if (replicas > 1 && (transport != "tcp" || replicas > static_cast<std::uint32_t>(servers) || !targets.empty())) {
    std::fprintf(stderr, "pskv-bench: --replicas needs --transport tcp, servers it starts, and --servers >= it\n");
    return 2;
  }
  if (failover_ms > 0 && (replicas < 2 || servers < 3)) {
    std::fprintf(stderr, "pskv-bench: --failover-ms needs --replicas 2 or more and --servers 3 or more\n");
    return 2;
  }
  // The servers' votes, removed at the end.
  char votes_dir[] = "/tmp/pskv-bench-votes-XXXXXX";
  if (failover_ms > 0 && !::mkdtemp(votes_dir)) return 1;
  if (kill_at_step >= 0 && (workload != "steps" || replicas < 2 || retry_ms <= 0 || kill_at_step >= steps)) {
    std::fprintf(stderr,
                 "pskv-bench: --kill-at-step needs --workload steps, --replicas 2 or more, --retry-timeout-ms and a "
                 "step below --steps\n");
    return 2;
  }
  // Replicas connect to each other, so every server's address is fixed before any starts.
  std::vector<std::string> ring;
  if (replicas > 1)
    for (int s = 0; s < servers; ++s)
      ring.push_back("tcp://127.0.0.1:" + std::to_string(pskv::tcp::free_loopback_port()));
  if (transport == "table" && (workload != "rows" || !targets.empty())) {
    std::fprintf(stderr, "pskv-bench: --transport table is for --workload rows, without --server\n");
    return 2;
  }
  // --transport table: the rows workload's table, in this process (made once the memory's limit
  // is measured, so that the two never hold their memory at once).
  std::unique_ptr<pskv::EmbeddingTable> local_table;
  std::map<int, double> random_rows;  // its baseline by client count
  if (targets.empty() && transport != "table") {
    const std::size_t biggest = *std::max_element(sizes.begin(), sizes.end());
    const int max_clients = *std::max_element(client_counts.begin(), client_counts.end());
    std::uint64_t arena_mb = (sizes.size() * max_clients * (biggest + 4096) * 2 >> 20) / servers + 64;
    if (workload == "rows") arena_mb = 64;
    if (workload == "sparse") arena_mb = (table_keys * (64 + ((key_floats * 4 + 63) / 64) * 64) >> 20) / servers + 64;
    const auto options_for = [&](int s) {
      pskv::ServerOptions so;
      so.uri = transport == "shm" ? "shm://bench-" + std::to_string(getppid()) + "-" + std::to_string(s) +
                                        "?push=" + shm_push + (shm_adopt ? "&adopt=1" : "")
               : transport == "tcp" ? "tcp://127.0.0.1:0?push=" + tcp_push
                                    : transport + "://127.0.0.1:0";
      so.server_id = static_cast<std::uint32_t>(s);
      if (server_threads > 0) so.io_threads = server_threads;
      if (replicas > 1) {
        so.uri = ring[static_cast<std::size_t>(s)] + "?push=" + tcp_push;
        so.replicas = replicas;
        so.peers = ring;
        if (failover_ms > 0) {
          so.failover_timeout = std::chrono::milliseconds(failover_ms);
          so.failover_dir = votes_dir;
        }
      }
      if (workload == "steps") {
        so.num_workers = static_cast<std::uint32_t>(workers);
        so.mode = *pskv::parse_consistency_mode(mode);
        so.staleness = staleness;
        so.sync_required = sync_required;
      }
      so.arena_bytes = arena_mb << 20;
      so.max_request_bytes = std::max<std::uint64_t>(so.max_request_bytes, biggest * 2);
      if (workload == "sparse") so.max_keys = table_keys / static_cast<std::uint64_t>(servers) * 5 / 4 + 1024;
      // Every server is given room for the whole table (a cap is per server): 32 bytes a row beside
      // its floats covers its key, links and index (ShardEngine's row_bytes_bound), once per
      // replica (a server also keeps its predecessors' copies).
      if (workload == "rows") so.table_memory_bytes = (table_keys * (32 + key_floats * 4) + (64u << 20)) * replicas;
      if (workload == "rows" && retry_ms > 0) so.num_workers = static_cast<std::uint32_t>(max_clients);
      return so;
    };
    // SIGTERM must run the destructors (a shm server removes its segment), so a server waits for it.
    // It writes `serving(server)` to `ready_fd` once it serves.
    const auto serve_until_sigterm = [](const pskv::ServerOptions& so, int ready_fd, auto serving) {
      sigset_t stop;
      sigemptyset(&stop);
      sigaddset(&stop, SIGTERM);
      pthread_sigmask(SIG_BLOCK, &stop, nullptr);
      try {
        pskv::Server server(so);
        const std::string line = serving(server) + "\n";
        if (write(ready_fd, line.data(), line.size()) < 0) _exit(1);
        close(ready_fd);
        int sig = 0;
        sigwait(&stop, &sig);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "pskv-bench server: %s\n", e.what());
        _exit(1);
      }
    };
    for (int s = 0; s < servers; ++s) {
      int pipefd[2];
      if (pipe(pipefd) != 0) return 1;
      server_pids.push_back(spawn([&] {
        close(pipefd[0]);
        serve_until_sigterm(options_for(s), pipefd[1], [](const pskv::Server& server) { return server.uri(); });
      }));
      close(pipefd[1]);
      char buf[256] = {};
      std::size_t got = 0;
      while (got < sizeof buf - 1) {
        const ssize_t n = read(pipefd[0], buf + got, sizeof buf - 1 - got);
        if (n <= 0) break;
        got += static_cast<std::size_t>(n);
        if (std::memchr(buf, '\n', got)) break;
      }
      close(pipefd[0]);
      std::string uri(buf, got);
      if (uri.empty() || uri.back() != '\n') {
        std::fprintf(stderr, "pskv-bench: server %d failed to start\n", s);
        return 1;
      }
      uri.pop_back();
      targets.push_back(uri);
    }
    if (kill_at_step >= 0 && failover_ms == 0) {
      // Server 1's successor, forked now (a process with threads must not fork and go on): it
      // waits on `go` for the instant server 1 was killed (steady clock ns, the same in every
      // process), serves server 1's address with --rejoin, and writes how long that took (ms).
      int go[2], ready[2];
      if (pipe(go) != 0 || pipe(ready) != 0) return 1;
      spare = spawn([&] {
        close(go[1]);
        close(ready[0]);
        std::int64_t killed_ns = 0;
        if (read(go[0], &killed_ns, sizeof killed_ns) != sizeof killed_ns) _exit(0);  // not needed: the run is over
        pskv::ServerOptions so = options_for(1);
        so.rejoin = true;
        serve_until_sigterm(so, ready[1], [killed_ns](const pskv::Server&) {
          return std::to_string(double(pskv::steady_now_ns() - killed_ns) / 1e6);
        });
      });
      close(go[0]);
      close(ready[1]);
      spare_go = go[1];
      spare_ready = ready[0];
    }
  }

  // Each baseline is the best of three short windows: a neighbour's burst on this shared host
  // would otherwise lower a baseline and flatter every ratio measured against it.
  auto best_of_3 = [](auto&& measure, auto better) {
    double best = measure();
    for (int i = 0; i < 2; ++i) best = better(best, measure());
    return best;
  };
  const auto max = [](double a, double b) { return std::max(a, b); };
  const auto min = [](double a, double b) { return std::min(a, b); };
  // --transport table is read against random_rows only: the transports' limits would cost its
  // run 5 s for nothing.
  const bool transport_limits = transport != "table";
  const double stream_bw =
      transport_limits ? best_of_3([&] { return tcp_stream_bandwidth(peers.sink_port, 0.4); }, max) : 0;
  const double pingpong_us =
      transport_limits ? best_of_3([&] { return tcp_pingpong_p50_us(peers.echo_port, 7000); }, min) : 0;
  const double memcpy_bw = transport_limits ? best_of_3([] { return memcpy_bandwidth(16 << 20, 0.2); }, max) : 0;
  // memcpy at each value size, since cache residency changes the limit by 3x across the sweep.
  std::vector<double> memcpy_at;
  for (std::size_t size : sizes)
    if (transport_limits)
      memcpy_at.push_back(best_of_3([&] { return memcpy_bandwidth(std::max<std::size_t>(size, 64), 0.1); }, max));
  // The bound of each op at each size: what this machine could do at best, so a ratio can be read
  // against that and not only against the raw path. Over tcp it is raw requests and responses at
  // the run's depth, with the apply every push needs; over shm, a push's is one copy and the apply
  // (shm pulls are already measured against memcpy at their size).
  struct Bound {
    const char* op = nullptr;    // push or pull
    const char* name = nullptr;  // the baseline's JSON name
    std::string what;            // for the text report
    std::vector<double> at;      // per size; 0: none
  };
  // Servers this run did not start are taken to apply in pieces, pskv-server's default.
  const bool push_in_pieces = tcp_push == "pieces";
  const std::string in_flight = std::to_string(depth) + " in flight";
  Bound push_bound{"push", transport == "shm" ? "memcpy_apply" : "tcp_rpc_apply",
                   transport == "shm" ? "copy into a slot, then apply"
                                      : "raw TCP requests, " + in_flight + ", applied " +
                                            (push_in_pieces ? "as they arrive, up to 256 KiB at a time" : "whole"),
                   std::vector<double>(sizes.size(), 0.0)};
  Bound pull_bound{"pull", "tcp_rpc", "raw TCP requests, " + in_flight + ", replies from and into value-sized buffers",
                   std::vector<double>(sizes.size(), 0.0)};
  const auto measures = [&](const char* op) {
    return workload == "dense" && std::find(ops.begin(), ops.end(), op) != ops.end();
  };
  for (std::size_t si = 0; si < sizes.size(); ++si) {
    const std::size_t size = sizes[si];
    if (measures("push") && transport == "shm")
      push_bound.at[si] = best_of_3([&] { return copy_apply_bandwidth(size, 0.1); }, max);
    if (transport == "shm" || size < kBandwidthBytes) continue;
    RpcShape shape{.message_bytes = size,
                   .piece_bytes = push_in_pieces ? std::min<std::uint64_t>(
                                                       size, pskv::tcp::TcpServer::kPushPieceFloats * sizeof(float))
                                                 : size,
                   .pull = 0,
                   .depth = static_cast<std::uint64_t>(depth)};
    if (measures("push"))
      push_bound.at[si] = best_of_3([&] { return tcp_rpc_bandwidth(peers.rpc_port, 0.4, shape); }, max);
    shape.pull = 1;
    if (measures("pull"))
      pull_bound.at[si] = best_of_3([&] { return tcp_rpc_bandwidth(peers.rpc_port, 0.4, shape); }, max);
  }
  const Bound* bounds[] = {&push_bound, &pull_bound};
  if (transport_limits && json) {
    print_json(pskv::JsonObject().add("baseline", "tcp_stream").add("bytes_per_s", stream_bw, 0));
    print_json(pskv::JsonObject().add("baseline", "tcp_pingpong_64B").add("p50_us", pingpong_us, 2));
    print_json(pskv::JsonObject().add("baseline", "memcpy").add("bytes_per_s", memcpy_bw, 0));
    for (std::size_t si = 0; si < sizes.size(); ++si)
      print_json(pskv::JsonObject()
                     .add("baseline", "memcpy")
                     .add("value_bytes", sizes[si])
                     .add("bytes_per_s", memcpy_at[si], 0));
    for (const Bound* b : bounds)
      for (std::size_t si = 0; si < sizes.size(); ++si)
        if (b->at[si] > 0)
          print_json(pskv::JsonObject()
                         .add("baseline", b->name)
                         .add("value_bytes", sizes[si])
                         .add("bytes_per_s", b->at[si], 0));
  } else if (transport_limits) {
    std::printf("baselines: loopback TCP stream %s/s, 64 B TCP ping-pong p50 %.1f us, memcpy 16 MiB %s/s\n",
                human(stream_bw).c_str(), pingpong_us, human(memcpy_bw).c_str());
    for (std::size_t si = 0; si < sizes.size(); ++si)
      std::printf("  memcpy %zu B: %s/s\n", sizes[si], human(memcpy_at[si]).c_str());
    for (const Bound* b : bounds)
      for (std::size_t si = 0; si < sizes.size(); ++si)
        if (b->at[si] > 0)
          std::printf("  %s bound (%s) %zu B: %s/s\n", b->op, b->what.c_str(), sizes[si], human(b->at[si]).c_str());
    std::printf("%-5s %-5s %10s %7s %12s %9s %9s  %s\n", "tport", "op", "value", "clients", "bandwidth", "p50 us",
                "p99 us", "ratio to baseline");
  }

  int rc = 0;
  if (workload == "steps") {
    try {
      const std::size_t size = sizes.front();
      std::function<void(int)> at_step;
      if (kill_at_step >= 0)
        at_step = [&](int step) {
          if (step != kill_at_step) return;
          const std::int64_t killed_ns = pskv::steady_now_ns();
          kill(server_pids[1], SIGKILL);
          waitpid(server_pids[1], nullptr, 0);
          server_pids[1] = std::exchange(spare, -1);
          if (failover_ms > 0) return;  // server 2 takes its keys over; nothing restarts
          if (write(spare_go, &killed_ns, sizeof killed_ns) != sizeof killed_ns)
            throw std::runtime_error("the spare server is gone");
        };
      const StepsResult r = measure_steps(targets, workers, size, steps, straggler_us, at_step);
      // The successor has long been serving once the steps are done (-1: it never did).
      double restart_ms = -1;
      char line[64] = {};
      pollfd ready{spare_ready, POLLIN, 0};
      if (kill_at_step >= 0 && ::poll(&ready, 1, 10000) > 0 && read(spare_ready, line, sizeof line - 1) > 0)
        restart_ms = std::atof(line);
      std::string hist;
      for (std::size_t b = 0; b < r.histogram.size(); ++b) hist += (b ? "," : "") + std::to_string(r.histogram[b]);
      if (json) {
        const std::vector<std::uint64_t> histogram(r.histogram.begin(), r.histogram.end());
        print_json(pskv::JsonObject()
                       .add("transport", transport)
                       .add("workload", "steps")
                       .add("mode", mode)
                       .add("staleness", staleness)
                       .add("sync_required", sync_required)
                       .add("workers", workers)
                       .add("servers", targets.size())
                       .add("replicas", replicas)
                       .add("value_bytes", size)
                       .add("straggler_us", straggler_us)
                       .add("retry_timeout_ms", retry_ms)
                       .add("steps_per_s", r.steps_per_s, 1)
                       .add("p50_step_us", r.p50_step_us, 1)
                       .add("max_step_us", r.max_step_us, 1)
                       .add("killed_at_step", kill_at_step)
                       .add("restart_ms", restart_ms, 1)
                       .add("failover_ms", failover_ms)
                       .add("max_staleness", r.max_staleness)
                       .add("staleness_histogram", std::span<const std::uint64_t>(histogram)));
      } else {
        const std::string killed =
            kill_at_step < 0  ? ""
            : failover_ms > 0 ? ", server 1 killed at step " + std::to_string(kill_at_step) + " and its keys taken over"
                              : ", server 1 killed at step " + std::to_string(kill_at_step) + " and back in " +
                                    std::to_string(restart_ms) + " ms";
        std::printf(
            "%s %s s=%u workers=%d value=%zu B straggler=%d us: %.0f steps/s, p50 step %.0f us, longest %.0f us, "
            "max staleness %llu, histogram [%s]%s\n",
            transport.c_str(), mode.c_str(), staleness, workers, size, straggler_us, r.steps_per_s, r.p50_step_us,
            r.max_step_us, static_cast<unsigned long long>(r.max_staleness), hist.c_str(), killed.c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pskv-bench: %s\n", e.what());
      rc = 1;
    }
    ops.clear();
  }
  if (workload == "rows") {
    try {
      const int inserters = *std::max_element(client_counts.begin(), client_counts.end());
      if (transport == "table") {
        const KeyDraw draw(table_keys, dist, zipf_s);
        for (int clients : client_counts)
          random_rows[clients] = random_rows_per_s(draw, table_keys, key_floats, batch_keys, clients, seconds);
        local_table = std::make_unique<pskv::EmbeddingTable>(rows_spec(key_floats, table_keys));
      }
      const InsertPoint ins = insert_rows(targets, table_keys, key_floats, batch_keys, inserters, local_table.get());
      if (json)
        print_json(pskv::JsonObject()
                       .add("transport", transport)
                       .add("workload", "rows")
                       .add("op", "insert")
                       .add("row_bytes", key_floats * 4)
                       .add("batch_keys", batch_keys)
                       .add("table_rows", table_keys)
                       .add("clients", inserters)
                       .add("servers", targets.size())
                       .add("replicas", replicas)
                       .add("retry_timeout_ms", retry_ms)
                       .add("inserts_per_s", ins.inserts_per_s, 0)
                       .add("bytes_per_row", ins.bytes_per_row, 1)
                       .add("p50_us", ins.p50_us, 1)
                       .add("p99_us", ins.p99_us, 1)
                       .add("max_us", ins.max_us, 1));
      else
        std::printf("%-5s rows insert %" PRIu64
                    " rows x %zu B, %d clients: %.2f M rows/s, %.1f bytes per row, batch p50 %.0f / p99 %.0f / max "
                    "%.0f us\n",
                    transport.c_str(), table_keys, key_floats * 4, inserters, ins.inserts_per_s / 1e6,
                    ins.bytes_per_row, ins.p50_us, ins.p99_us, ins.max_us);
      std::fflush(stdout);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pskv-bench: %s\n", e.what());
      rc = 1;
      ops.clear();
    }
  }
  // Batches of keys (sparse: of an initialised table) or of rows (rows: of the embedding table
  // inserted above), drawn uniformly or by a Zipf law.
  if (workload == "sparse" || workload == "rows") {
    const bool rows = workload == "rows";
    try {
      if (!rows) init_sparse_table(targets, table_keys, key_floats);
      const KeyDraw draw(table_keys, dist, zipf_s);
      const double base = transport == "shm" ? memcpy_bw : stream_bw;
      for (const auto& op : ops)
        for (int clients : client_counts) {
          const SparsePoint p = measure_sparse(targets, op, draw, key_floats, batch_keys, clients, seconds, depth,
                                               rows ? table_keys : 0, local_table.get());
          if (json) {
            pskv::JsonObject j;
            j.add("transport", transport)
                .add("workload", workload)
                .add("dist", dist)
                .add("op", op)
                .add(rows ? "row_bytes" : "value_bytes", key_floats * 4)
                .add("batch_keys", batch_keys)
                .add("depth", local_table ? 1 : depth)
                .add(rows ? "table_rows" : "table_keys", table_keys)
                .add("clients", clients)
                .add("servers", targets.size());
            j.add("replicas", replicas);
            if (rows) j.add("retry_timeout_ms", retry_ms);
            print_json(j.add("ops", p.batches)
                           .add(rows ? "rows_per_s" : "keys_per_s", p.keys_per_s, 0)
                           .add("bytes_per_s", p.bytes_per_s, 0)
                           .add("p50_us", p.p50_us, 2)
                           .add("p99_us", p.p99_us, 2)
                           .add("baseline", local_table          ? "random_rows"
                                            : transport == "shm" ? "memcpy"
                                                                 : "tcp_stream")
                           .add("baseline_value", local_table ? random_rows[clients] : base, 0)
                           .add("ratio", local_table ? p.keys_per_s / random_rows[clients] : p.bytes_per_s / base, 4));
          } else {
            const char* unit = rows ? "rows" : "keys";
            std::printf("%-5s %s %-7s %-5s %zu %s x %zu B, %d clients: %.2f M %s/s, batch p50 %.0f us p99 %.0f us\n",
                        transport.c_str(), workload.c_str(), dist.c_str(), op.c_str(), batch_keys, unit, key_floats * 4,
                        clients, p.keys_per_s / 1e6, unit, p.p50_us, p.p99_us);
            if (local_table)
              std::printf("      (the memory's limit: random rows read at %.2f M rows/s)\n",
                          random_rows[clients] / 1e6);
          }
          std::fflush(stdout);
        }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pskv-bench: %s\n", e.what());
      rc = 1;
    }
    ops.clear();
  }
  try {
    for (const auto& op : ops)
      for (std::size_t si = 0; si < sizes.size(); ++si)
        for (int clients : client_counts) {
          const std::size_t size = sizes[si];
          // Large values are judged by bandwidth, small ones by round-trip latency.
          const bool by_bandwidth = size >= kBandwidthBytes || transport == "shm";
          const double window = std::max(0.05, seconds / rounds);
          const std::function<double()> baseline_window = [&]() -> double {
            return transport == "shm" ? memcpy_bandwidth(std::max<std::size_t>(size, 64), window)
                                      : tcp_stream_bandwidth(peers.sink_port, window);
          };
          Point p = by_bandwidth ? measure(targets, op, size, clients, seconds, max_ops, depth, rounds, baseline_window)
                                 : measure(targets, op, size, clients, seconds, max_ops, depth);
          const char* baseline = by_bandwidth ? (transport == "shm" ? "memcpy" : "tcp_stream") : "tcp_pingpong_64B";
          const double base = by_bandwidth ? percentile(p.round_baselines, 0.5) : pingpong_us;
          const double ratio = by_bandwidth ? percentile(p.round_ratios, 0.5) : p.p50_us / base;
          pskv::JsonObject j;
          j.add("transport", transport)
              .add("workload", "dense")
              .add("op", op)
              .add("value_bytes", size)
              .add("clients", clients)
              .add("servers", targets.size())
              .add("replicas", replicas)
              .add("depth", depth)
              .add("chunk_floats", g_client_defaults.chunk_floats)
              .add("ops", p.ops)
              .add("bytes_per_s", p.bytes_per_s, 0)
              .add("p50_us", p.p50_us, 2)
              .add("p99_us", p.p99_us, 2)
              .add("baseline", baseline)
              .add("baseline_value", base, 2)
              .add("ratio", ratio, 4)
              .add("allocs_per_op", p.allocs_per_op, 3);
          char rounds_text[64] = "";
          if (by_bandwidth) {
            const auto [lo, hi] = std::minmax_element(p.round_ratios.begin(), p.round_ratios.end());
            j.add("rounds", p.round_ratios.size()).add("ratio_min", *lo, 4).add("ratio_max", *hi, 4);
            std::snprintf(rounds_text, sizeof rounds_text, " (rounds %.2f-%.2fx)", *lo, *hi);
          }
          const Bound& b = op == "push" ? push_bound : pull_bound;
          const double bound = b.at[si];
          char bound_text[64] = "";
          if (bound > 0) {
            j.add("bound", b.name).add("bound_value", bound, 0).add("ratio_to_bound", p.bytes_per_s / bound, 4);
            std::snprintf(bound_text, sizeof bound_text, "  [%.2fx of %s bound]", p.bytes_per_s / bound, b.op);
          }
          if (json)
            print_json(j);
          else
            std::printf("%-5s %-5s %10zu %7d %10s/s %9.1f %9.1f  %.2fx %s%s%s%s  (%.2f allocs/op)\n", transport.c_str(),
                        op.c_str(), size, clients, human(p.bytes_per_s).c_str(), p.p50_us, p.p99_us, ratio, baseline,
                        by_bandwidth ? " bandwidth" : " p50 latency", rounds_text, bound_text, p.allocs_per_op);
          std::fflush(stdout);
        }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pskv-bench: %s\n", e.what());
    rc = 1;
  }
  if (spare_go >= 0) close(spare_go);  // an unused spare exits
  if (spare_ready >= 0) close(spare_ready);
  if (spare > 0) waitpid(spare, nullptr, 0);
  for (pid_t pid : server_pids)
    if (pid > 0) kill(pid, SIGTERM);
  for (pid_t pid : peers.pids) kill(pid, SIGKILL);
  for (pid_t pid : server_pids)
    if (pid > 0) waitpid(pid, nullptr, 0);
  std::error_code ignored;
  if (failover_ms > 0) std::filesystem::remove_all(votes_dir, ignored);
  for (pid_t pid : peers.pids) waitpid(pid, nullptr, 0);
  return rc;
}
