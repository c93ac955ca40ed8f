// A client takes what a server sends as hostile too: a server that is buggy, of another build,
// or not pskv at all must not hold a client's requests for good nor make it allocate what it
// declares. Each test plays a server on a raw socket that answers the hello, then misbehaves.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "pskv/client.h"
#include "transport/tcp/socket.h"
#include "transport/wire.h"

namespace pskv {
namespace {

using namespace std::chrono_literals;

bool read_all(int fd, void* p, std::size_t n) {
  return tcp::read_full(fd, p, n) == tcp::IoResult::ok;
}
void write_all(int fd, const void* p, std::size_t n) {
  iovec iov{const_cast<void*>(p), n};
  tcp::writev_full(fd, &iov, 1);
}

// Listens on 127.0.0.1, takes one client, answers its hello, then hands every request (header
// and key table) to `answer` on its own thread until the client goes or the test ends.
class MisbehavingServer {
 public:
  using Answer = std::function<void(int fd, const wire::FrameHeader& request, const std::vector<wire::KeyEntry>& keys)>;
  explicit MisbehavingServer(Answer answer)
      : answer_(std::move(answer)),
        listen_fd_(tcp::listen_tcp("127.0.0.1", 0, 4)),
        uri_("tcp://127.0.0.1:" + std::to_string(tcp::local_port(listen_fd_.get()))),
        thread_([this] { serve(); }) {}
  ~MisbehavingServer() {
    stop_ = true;
    ::shutdown(listen_fd_.get(), SHUT_RDWR);
    if (const int fd = client_fd_.load(); fd >= 0) ::shutdown(fd, SHUT_RDWR);
    thread_.join();
  }
  const std::string& uri() const { return uri_; }
  bool stopping() const { return stop_; }
  int requests() const { return requests_; }

 private:
  void serve() {
    tcp::Fd client(::accept(listen_fd_.get(), nullptr, nullptr));
    const int fd = client.get();
    if (fd < 0) return;
    client_fd_ = fd;
    wire::FrameHeader h{};
    if (!read_all(fd, &h, sizeof h)) return;
    std::vector<std::byte> hello(h.payload_bytes);
    if (!read_all(fd, hello.data(), hello.size())) return;
    wire::FrameHeader r = wire::make_header(wire::Op::hello, h.request_id, 0, 0, 0, 0);
    r.flags = wire::kResponse;
    write_all(fd, &r, sizeof r);
    while (!stop_) {
      if (!read_all(fd, &h, sizeof h)) return;
      std::vector<wire::KeyEntry> keys(h.num_keys);
      if (!read_all(fd, keys.data(), keys.size() * sizeof(wire::KeyEntry))) return;
      std::uint64_t floats = 0;
      for (const auto& k : keys) floats += k.length;
      if (wire::op_carries_values(static_cast<wire::Op>(h.op))) {
        std::vector<float> values(floats);
        if (!read_all(fd, values.data(), values.size() * sizeof(float))) return;
      }
      ++requests_;
      answer_(fd, h, keys);
    }
  }

  Answer answer_;
  tcp::Fd listen_fd_;
  std::string uri_;
  std::atomic<int> client_fd_{-1};  // the thread's accepted socket, for the destructor to shut down
  std::atomic<bool> stop_{false};
  std::atomic<int> requests_{0};
  std::thread thread_;  // last: it starts once everything it reads is made
};

// This process's peak RSS (VmHWM). testing::peak_rss_kib does the same for any pid, but lives in
// the multi-process tests' support library, which a sanitizer build of the unit tests lacks.
long own_peak_rss_kib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stol(line.substr(6));
  return -1;
}

ClientOptions client_of(const MisbehavingServer& s) {
  ClientOptions o;
  o.servers = {s.uri()};
  o.io_timeout = 1000ms;
  return o;
}

// Every pull answered "from the store, torn": the client asks again for a copy, and a server
// that answers that from the store too is refused, instead of the pull going round for good.
TEST(TcpHostileServer, TornRepliesAnsweredFromTheStoreAgainFailThePull) {
  MisbehavingServer server([](int fd, const wire::FrameHeader& h, const std::vector<wire::KeyEntry>& keys) {
    std::uint64_t bytes = 0;
    for (const auto& k : keys) bytes += std::uint64_t{k.length} * sizeof(float);
    wire::FrameHeader r = wire::make_header(wire::Op::pull, h.request_id, 0, bytes, 0, 0);
    r.flags = wire::kResponse | wire::kFromStore;
    const std::vector<float> values(bytes / sizeof(float), 1.0f);
    const std::uint32_t torn = 1;
    write_all(fd, &r, sizeof r);
    write_all(fd, values.data(), bytes);
    write_all(fd, &torn, sizeof torn);
  });
  Client c(client_of(server));
  std::vector<float> out(1024);
  const auto began = std::chrono::steady_clock::now();
  EXPECT_THROW(c.wait(c.pull(Key(1), out)), Error);
  EXPECT_LT(std::chrono::steady_clock::now() - began, 10s);
  EXPECT_LE(server.requests(), 2) << "the pull was sent again after a second from-store answer";
}

// Values are taken only from the answer to the request: the same op, no key table (whose bytes
// were once copied into the caller's buffer as values), and with checksums asked for, a checksum.
TEST(TcpHostileServer, RepliesThatAreNotTheAnswerAreRefused) {
  struct Case {
    const char* what;
    wire::Op op;
    std::uint32_t num_keys;
    bool checksum;
  };
  for (const Case& k : {Case{"another op", wire::Op::push, 0, false}, Case{"a key table", wire::Op::pull, 1, false},
                        Case{"no checksum", wire::Op::pull, 0, true}}) {
    SCOPED_TRACE(k.what);
    MisbehavingServer server([&k](int fd, const wire::FrameHeader& h, const std::vector<wire::KeyEntry>& keys) {
      std::uint64_t bytes = 0;
      for (const auto& e : keys) bytes += std::uint64_t{e.length} * sizeof(float);
      const std::vector<wire::KeyEntry> table(k.num_keys, wire::KeyEntry{7, 1, 0});
      const std::uint64_t table_bytes = table.size() * sizeof(wire::KeyEntry);  // sent ahead of the values
      // The size the values take alone: only the key table's count is wrong (with the table's
      // bytes counted, the size check alone would refuse it).
      wire::FrameHeader r = wire::make_header(k.op, h.request_id, k.num_keys, bytes, 0, 0);
      r.flags = wire::kResponse;
      const std::vector<float> values(bytes / sizeof(float), 9.0f);
      write_all(fd, &r, sizeof r);
      write_all(fd, table.data(), table_bytes);
      write_all(fd, values.data(), bytes);
    });
    ClientOptions o = client_of(server);
    o.checksum = k.checksum;
    Client c(o);
    std::vector<float> out(4, 0.0f);
    EXPECT_THROW(c.wait(c.pull(Key(1), out)), Error);
    EXPECT_EQ(out, std::vector<float>(4, 0.0f));
  }
}

// An error text declared at 1 GiB and sent a byte every 200 ms: the client once zero-filled the
// whole declared length first and then waited for it for good (each byte came inside the 1 s
// receive timeout). It now grows the text as bytes come and gives up at its io timeout.
TEST(TcpHostileServer, AHugeTextTrickledIsNeitherAllocatedNorWaitedForForGood) {
  MisbehavingServer* self = nullptr;
  MisbehavingServer server([&self](int fd, const wire::FrameHeader& h, const std::vector<wire::KeyEntry>&) {
    wire::FrameHeader r = wire::make_header(static_cast<wire::Op>(h.op), h.request_id, 0, 1ull << 30, 0, 0);
    r.flags = wire::kResponse | wire::kText;
    r.status = static_cast<std::uint16_t>(Errc::not_found);
    write_all(fd, &r, sizeof r);
    for (int i = 0; i < 100 && !self->stopping(); ++i) {
      write_all(fd, "x", 1);
      std::this_thread::sleep_for(200ms);
    }
  });
  self = &server;
  Client c(client_of(server));
  std::vector<float> out(16);
  const long peak_before = own_peak_rss_kib();
  const auto began = std::chrono::steady_clock::now();
  try {
    c.wait(c.pull(Key(1), out));
    ADD_FAILURE() << "the pull succeeded";
  } catch (const Error& e) {
    EXPECT_NE(e.code(), Errc::not_found) << e.what();  // the text never came whole
  }
  // Cut at the io timeout (1 s) plus the first MiB's share, well before the 20 s of trickle.
  EXPECT_LT(std::chrono::steady_clock::now() - began, 10s);
  EXPECT_LT(own_peak_rss_kib() - peak_before, 256 * 1024) << "the declared length was allocated";
}

}  // namespace
}  // namespace pskv
