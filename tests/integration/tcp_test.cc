// The TCP path end to end: real pskv-server processes on loopback, clients in forked processes.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <numeric>
#include <thread>

#include "pskv/client.h"
#include "support/errors.h"
#include "support/process.h"
#include "support/pushes.h"
#include "support/raw_peer.h"
#include "support/stats.h"
#include "support/stop.h"
#include "support/token_file.h"
#include "support/workloads.h"
#include "transport/tcp/socket.h"
#include "transport/tcp/tcp_server.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv {
namespace {

using testing::expect_nothing_lost;
using testing::expect_permission_error;
using testing::fork_worker;
using testing::RawPeer;
using testing::read_file;
using testing::ServerProcess;
using testing::TokenFile;
using testing::wait_pid;

std::vector<ServerProcess> start_servers(int n, std::vector<std::string> extra = {}, const std::string& log = {}) {
  std::vector<ServerProcess> servers;
  for (int i = 0; i < n; ++i) {
    std::vector<std::string> args{"--uri", "tcp://127.0.0.1:0", "--server-id", std::to_string(i), "--io-threads", "2"};
    args.insert(args.end(), extra.begin(), extra.end());
    servers.push_back(ServerProcess::start(args, log));
  }
  return servers;
}

ClientOptions options_for(const std::vector<ServerProcess>& servers) {
  ClientOptions o;
  for (const auto& s : servers) o.servers.push_back(s.uri);
  o.io_timeout = std::chrono::seconds(20);
  return o;
}

TEST(TcpIntegration, PushPullWithTwoServersAndFourClients) {
  auto servers = start_servers(2);
  ClientOptions o = options_for(servers);
  constexpr int kKeys = 64, kClients = 4, kRounds = 50;
  {
    Client admin(o);
    std::vector<Key> keys(kKeys);
    std::iota(keys.begin(), keys.end(), 1000);
    std::vector<std::vector<float>> init(kKeys);
    std::vector<std::span<const float>> spans;
    for (int i = 0; i < kKeys; ++i) {
      init[i].assign(1 + i * 17, float(i));
      spans.emplace_back(init[i]);
    }
    admin.wait(admin.init(keys, spans));
  }
  std::vector<pid_t> pids;
  for (int c = 0; c < kClients; ++c)
    pids.push_back(fork_worker([&, c] {
      Client client(o);
      std::vector<float> delta, out;
      for (int r = 0; r < kRounds; ++r) {
        const Key k = 1000 + (r * 7 + c) % kKeys;
        const std::size_t len = 1 + (k - 1000) * 17;
        delta.assign(len, float(c + 1));
        out.resize(len);
        client.wait(client.push(k, delta));
        client.wait(client.pull(k, out));
        for (float x : out)
          if (x != out[0]) return 3;  // every element got the same deltas
      }
      return 0;
    }));
  for (pid_t p : pids) EXPECT_EQ(wait_pid(p), 0);

  // Every push landed exactly once: value = initial + sum of the deltas aimed at that key.
  Client check(o);
  std::vector<double> expect(kKeys);
  for (int i = 0; i < kKeys; ++i) expect[i] = i;
  for (int c = 0; c < kClients; ++c)
    for (int r = 0; r < kRounds; ++r) expect[(r * 7 + c) % kKeys] += c + 1;
  for (int i = 0; i < kKeys; ++i) {
    std::vector<float> out(1 + i * 17);
    check.wait(check.pull(Key(1000 + i), out));
    for (float x : out) ASSERT_EQ(x, float(expect[i])) << "key " << 1000 + i;
  }
}

// Large pulls are sent straight from the store and validated after the send; one that a push
// overlapped must be detected and asked again, never handed over torn. Two keys, so both the
// single-slot and the multi-slot reply are exercised. `check` judges each pulled 4 MiB value.
void pull_during_pushes(const std::string& tcp_push, const std::function<void(const std::vector<float>&)>& check) {
  auto servers = start_servers(1, {"--tcp-push", tcp_push});
  ClientOptions o = options_for(servers);
  o.chunk_floats = 0;  // whole values: the server sends one slot of 4 MiB
  constexpr std::size_t kFloats = 1u << 20;
  {
    Client admin(o);
    std::vector<float> zeros(kFloats, 0.0f), small(1u << 15, 0.0f);
    admin.wait(admin.init(Key(1), zeros));
    admin.wait(admin.init(Key(2), small));
  }
  const pid_t pusher = fork_worker([&] {
    Client c(o);
    std::vector<float> ones(kFloats, 1.0f), small(1u << 15, 1.0f);
    for (int i = 0; i < 400; ++i) {
      c.wait(c.push(Key(1), ones));
      c.wait(c.push(Key(2), small));
    }
    return 0;
  });
  Client c(o);
  std::vector<float> big(kFloats), small(1u << 15);
  int moving = 0;
  float last = -1;
  for (int reads = 0; reads < 20000; ++reads) {
    std::vector<Key> keys{Key(1), Key(2)};
    std::vector<std::span<float>> outs{big, small};
    c.wait(c.pull(std::span<const Key>(keys), std::span<const std::span<float>>(outs)));
    check(big);
    if (::testing::Test::HasFatalFailure()) return;
    ASSERT_TRUE(testing::one_push(small)) << "torn read of the small key";
    if (big[0] != last) ++moving;
    last = big[0];
    if (big.back() >= 400) break;  // the pusher is done
  }
  EXPECT_GT(moving, 1) << "the pulls never overlapped the pushes";
  EXPECT_EQ(wait_pid(pusher), 0);
}

// Staged whole, a 4 MiB push is applied at once: no pull may mix two pushes.
TEST(TcpIntegration, LargePullsDuringWholePushesAreNeverTorn) {
  pull_during_pushes("whole",
                     [](const std::vector<float>& big) { ASSERT_TRUE(testing::one_push(big)) << "torn read"; });
}

// Applied in pieces as it arrives (the default), a 4 MiB push may be seen half applied, but
// piece by piece, in order, each piece whole: what a pull sees is the newer push's floats up to
// some point and the older push's after it. Pieces are as large as what has arrived, so the
// point may be any float.
TEST(TcpIntegration, LargePullsDuringPushesInPiecesSeeTheNewerPushAsAPrefix) {
  pull_during_pushes("pieces", [](const std::vector<float>& big) { ASSERT_TRUE(testing::newer_push_then_older(big)); });
}

// One push frame of keys below, at and above the piece size, pipelined with small requests
// behind it on the same connection, so the bytes after a frame applied in pieces are parsed
// as the next frames.
TEST(TcpIntegration, MixedKeysInALargePushAllLand) {
  for (const char* mode : {"pieces", "whole"}) {
    SCOPED_TRACE(mode);
    auto servers = start_servers(1, {"--tcp-push", mode});
    ClientOptions o = options_for(servers);
    o.chunk_floats = 0;
    Client c(o);
    const std::vector<std::size_t> lengths{1, 70001, 3, 200000, 65536, 17, 131072};
    std::vector<Key> keys;
    std::vector<std::vector<float>> values, grads;
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      keys.push_back(Key(100 + i));
      values.emplace_back(lengths[i]);
      for (std::size_t j = 0; j < lengths[i]; ++j) values[i][j] = float(j % 251);
      grads.emplace_back(lengths[i], float(i + 1));
    }
    std::vector<std::span<const float>> value_spans(values.begin(), values.end()),
        grad_spans(grads.begin(), grads.end());
    c.wait(c.init(std::span<const Key>(keys), std::span<const std::span<const float>>(value_spans)));
    std::vector<float> one(8, 1.0f), small(8);
    c.wait(c.init(Key(7), std::vector<float>(8, 0.0f)));
    std::vector<Ticket> pending;
    for (int round = 0; round < 3; ++round) {
      pending.push_back(c.push(std::span<const Key>(keys), std::span<const std::span<const float>>(grad_spans)));
      pending.push_back(c.push(Key(7), one));
      pending.push_back(c.pull(Key(7), small));
    }
    for (Ticket t : pending) c.wait(t);
    EXPECT_EQ(small[0], 3.0f);
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      std::vector<float> out(lengths[i]);
      c.wait(c.pull(keys[i], out));
      for (std::size_t j = 0; j < lengths[i]; ++j)
        ASSERT_EQ(out[j], float(j % 251) + 3.0f * float(i + 1)) << "key " << keys[i] << " float " << j;
    }
  }
}

// Answers nobody waits for yet are still read as they come. Left in the socket, 32 MiB of pull
// replies would block the server's only I/O thread on this client until its send timeout (5 s),
// which then drops the connection and fails these pulls; the other client would wait meanwhile.
TEST(TcpIntegration, AnswersNobodyWaitsForDoNotStallTheServer) {
  auto servers = start_servers(1, {"--io-threads", "1"});
  ClientOptions o = options_for(servers);
  Client idle_reader(o), other(o);
  constexpr std::size_t kFloats = 1u << 20, kPulls = 8;
  std::vector<float> value(kFloats);
  std::iota(value.begin(), value.end(), 0.0f);
  idle_reader.wait(idle_reader.init(Key(1), value));
  std::vector<std::vector<float>> out(kPulls, std::vector<float>(kFloats, -1.0f));
  std::vector<Ticket> pulls;
  for (auto& o : out) pulls.push_back(idle_reader.pull(Key(1), o));
  std::vector<float> small(4, 0.0f);
  other.wait(other.init(Key(2), small));
  other.wait(other.pull(Key(2), small));
  for (std::size_t i = 0; i < kPulls; ++i) {
    idle_reader.wait(pulls[i]);
    ASSERT_EQ(out[i], value) << "pull " << i;
  }
}

TEST(TcpIntegration, NothingLostWith32ConcurrentClients) {
  auto servers = start_servers(2);
  expect_nothing_lost(options_for(servers), {.clients = 32, .pushes = 300, .keys = 8, .length = 100, .batch = 16});
}

TEST(TcpIntegration, TenMillionFloatKeySpreadsEvenlyOverFourServers) {
  auto servers = start_servers(4, {"--arena-mb", "64"});
  ClientOptions o = options_for(servers);
  Client client(o);
  constexpr std::size_t n = 10'000'000;
  std::vector<float> value(n);
  for (std::size_t i = 0; i < n; ++i) value[i] = float(i % 1000);
  client.wait(client.init(Key(5), value));
  std::vector<float> grad(n, 1.0f);
  client.wait(client.push(Key(5), grad));
  std::vector<float> out(n);
  client.wait(client.pull(Key(5), out));
  for (std::size_t i = 0; i < n; i += 997) ASSERT_EQ(out[i], float(i % 1000) + 1.0f) << i;
  ASSERT_EQ(out[n - 1], float((n - 1) % 1000) + 1.0f);
  for (std::size_t s = 0; s < 4; ++s) {
    const std::string stats = client.server_stats(s);
    const double bytes = testing::stats_field(stats, "value_bytes");
    ASSERT_GE(bytes, 0) << stats;
    EXPECT_NEAR(bytes, n * 4.0 / 4, n * 4.0 * 0.01) << "server " << s << ": " << stats;
  }
}

// --- bad input -------------------------------------------------------------------------------

class TcpBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    servers_ = start_servers(1, {"--max-request-mb", "64"});
    o_ = options_for(servers_);
    healthy_ = std::make_unique<Client>(o_);
    std::vector<float> v(8, 1.0f);
    healthy_->wait(healthy_->init(Key(1), v));
  }
  // The server still serves a well-behaved client after the abuse.
  void expect_still_serving() {
    std::vector<float> g(8, 1.0f), out(8);
    healthy_->wait(healthy_->push(Key(1), g));
    healthy_->wait(healthy_->pull(Key(1), out));
    EXPECT_GT(out[0], 1.0f);
    Client fresh(o_);
    fresh.wait(fresh.pull(Key(1), out));
  }
  std::vector<ServerProcess> servers_;
  ClientOptions o_;
  std::unique_ptr<Client> healthy_;
};

TEST_F(TcpBadInput, WrongMagicClosesThatConnectionOnly) {
  RawPeer p(servers_[0].uri);
  wire::FrameHeader h = wire::make_header(wire::Op::hello, 1, 0, 0, kNoWorker, wire::kVersion);
  h.magic = 0x12345678;
  p.send(&h, sizeof h);
  EXPECT_TRUE(p.closed_by_server());
  expect_still_serving();
}

TEST_F(TcpBadInput, HugeDeclaredLengthIsRefusedBeforeAllocation) {
  const long before = testing::peak_rss_kib(servers_[0].process.pid());
  {
    RawPeer p(servers_[0].uri);
    p.hello();
    std::vector<wire::KeyEntry> keys{{1, 1u << 30, 0}};
    wire::FrameHeader h = wire::make_header(wire::Op::push, 2, 1, (1ull << 32));
    p.send(&h, sizeof h);
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::capacity)) << text;
    EXPECT_NE(text.find("--max-request-mb"), std::string::npos) << text;
  }
  {
    // Within the limit (48 MiB declared) but never sent: the server must not reserve it all.
    RawPeer p(servers_[0].uri);
    p.hello();
    std::vector<wire::KeyEntry> keys{{1, 12u << 20, 0}};
    wire::FrameHeader h = wire::make_header(wire::Op::push, 2, 1, 48ull << 20);
    p.send(&h, sizeof h);
    p.send(keys.data(), sizeof(wire::KeyEntry));
    float some[256] = {};
    p.send(some, sizeof some);
  }  // closed mid-frame
  expect_still_serving();
  const long after = testing::peak_rss_kib(servers_[0].process.pid());
  EXPECT_LT(after - before, 24 * 1024) << "peak RSS grew by " << (after - before) << " KiB";
}

TEST_F(TcpBadInput, TruncatedFrameIsDropped) {
  RawPeer p(servers_[0].uri);
  p.hello();
  wire::FrameHeader h = wire::make_header(wire::Op::push, 2, 1, 32);
  p.send(&h, sizeof h / 2);
  ::shutdown(p.fd(), SHUT_WR);
  EXPECT_TRUE(p.closed_by_server());
  expect_still_serving();
}

TEST_F(TcpBadInput, UnknownOpGetsAnErrorAndAClose) {
  RawPeer p(servers_[0].uri);
  p.hello();
  wire::FrameHeader h = wire::make_header(wire::Op::pull, 3, 0, 0);
  h.op = 77;
  p.send(&h, sizeof h);
  auto [status, text] = p.reply();
  EXPECT_EQ(status, int(Errc::protocol));
  EXPECT_NE(text.find("unknown op"), std::string::npos) << text;
  EXPECT_TRUE(p.closed_by_server());
  expect_still_serving();
}

TEST_F(TcpBadInput, UnknownKeyAndWrongLengthGetErrorsAndTheConnectionLives) {
  Client c(o_);
  std::vector<float> v(8), w(5);
  try {
    c.wait(c.pull(Key(999), v));
    ADD_FAILURE() << "pull of an unknown key succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::not_found);
    EXPECT_NE(std::string(e.what()).find("init it"), std::string::npos) << e.what();
  }
  try {
    c.wait(c.push(Key(1), w));
    ADD_FAILURE() << "push of a wrong length succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::length_mismatch);
    EXPECT_NE(std::string(e.what()).find("has 8 floats"), std::string::npos) << e.what();
  }
  c.wait(c.pull(Key(1), v));  // the same connection still works
  expect_still_serving();
}

// A large push (applied in pieces as it arrives) to a key that does not take it: every key is
// checked before any value is read, the payload is drained, nothing is applied and the same
// connection goes on.
TEST_F(TcpBadInput, LargePushToAWrongKeyIsDrainedAndTheConnectionLives) {
  ClientOptions o = o_;
  o.chunk_floats = 0;
  Client c(o);
  std::vector<float> big(300000, 5.0f), out(8);
  c.wait(c.init(Key(2), std::vector<float>(8, 0.0f)));
  for (const Key key : {Key(1), Key(999)}) {
    try {
      // Two keys: the first is fine, so only checking all of them first keeps it unapplied.
      std::vector<Key> keys{Key(2), key};
      std::vector<float> eight(8, 5.0f);
      std::vector<std::span<const float>> grads{eight, big};
      c.wait(c.push(std::span<const Key>(keys), std::span<const std::span<const float>>(grads)));
      ADD_FAILURE() << "a push of 300000 floats to key " << key << " succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), key == Key(1) ? Errc::length_mismatch : Errc::not_found) << e.what();
    }
    c.wait(c.pull(Key(2), out));  // the same connection, past the drained payload
    EXPECT_EQ(out[0], 0.0f) << "a key of a refused push was applied";
  }
  expect_still_serving();
}

// An init is all or nothing too: a refused key once left the keys before it created (and, with
// replicas, on the origin only).
TEST_F(TcpBadInput, ARefusedInitCreatesNoneOfItsKeys) {
  Client c(o_);
  c.wait(c.init(Key(40), std::vector<float>(8, 0.0f)));
  std::vector<float> four(4, 1.0f), nine(9, 1.0f);
  const auto refused = [&](std::vector<Key> keys, std::vector<std::span<const float>> values, Errc code) {
    try {
      c.wait(c.init(std::span<const Key>(keys), std::span<const std::span<const float>>(values)));
      ADD_FAILURE() << "the init was taken";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find("no key of this init was created"), std::string::npos) << e.what();
    }
  };
  refused({Key(41), Key(40)}, {four, nine}, Errc::length_mismatch);  // 40 has 8 floats
  refused({Key(42), Key(43), Key(42)}, {four, four, nine}, Errc::invalid_argument);
  for (const Key key : {Key(41), Key(42), Key(43)}) {
    try {
      c.wait(c.pull(key, four));
      ADD_FAILURE() << "key " << key << " of a refused init was created";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::not_found) << e.what();
    }
  }
  expect_still_serving();
}

// A pull reply is sized from the store's records after every key is checked: a 112-byte request
// declaring four keys of 2^32-1 floats cannot make the server allocate (it once died of
// bad_alloc), and one real key listed until the reply would pass the request limit is refused.
TEST_F(TcpBadInput, APullCannotDeclareAHugeReply) {
  const long before = testing::peak_rss_kib(servers_[0].process.pid());
  RawPeer p(servers_[0].uri);
  p.hello();
  auto pull = [&](std::uint64_t id, std::vector<wire::KeyEntry> keys) {
    p.request(wire::Op::pull, id, keys);
    return p.reply();
  };
  {
    auto [status, text] = pull(2, std::vector<wire::KeyEntry>(4, wire::KeyEntry{77, 0xffffffffu, 0}));
    EXPECT_EQ(status, int(Errc::not_found)) << text;
  }
  {
    auto [status, text] = pull(3, std::vector<wire::KeyEntry>(4, wire::KeyEntry{1, 0xffffffffu, 0}));
    EXPECT_EQ(status, int(Errc::length_mismatch)) << text;
  }
  {
    // A 4 MiB key listed 32 times: a 128 MiB reply, over this server's 64 MiB limit.
    Client c(o_);
    c.wait(c.init(Key(3), std::vector<float>(1u << 20, 1.0f)));
    auto [status, text] = pull(4, std::vector<wire::KeyEntry>(32, wire::KeyEntry{3, 1u << 20, 0}));
    EXPECT_EQ(status, int(Errc::capacity)) << text;
    EXPECT_NE(text.find("--max-request-mb"), std::string::npos) << text;
  }
  EXPECT_EQ(pull(5, {wire::KeyEntry{1, 8, 0}}).first, 0) << "the refusals keep the connection";
  const long after = testing::peak_rss_kib(servers_[0].process.pid());
  EXPECT_LT(after - before, 64 * 1024) << "peak RSS grew by " << (after - before) << " KiB";
  expect_still_serving();
}

// protocol.md: every occurrence of a repeated key is processed in order.
TEST_F(TcpBadInput, ARepeatedKeyIsAppliedAndReturnedOncePerOccurrence) {
  RawPeer p(servers_[0].uri);
  p.hello();
  std::vector<wire::KeyEntry> keys(3, wire::KeyEntry{1, 8, 0});
  std::vector<float> grads(24, 2.0f);
  wire::FrameHeader h = wire::make_header(wire::Op::push, 2, 3, grads.size() * sizeof(float));
  p.send(&h, sizeof h);
  p.send(keys.data(), keys.size() * sizeof keys[0]);
  p.send(grads.data(), grads.size() * sizeof(float));
  EXPECT_EQ(p.reply().first, 0);
  p.request(wire::Op::pull, 3, std::span(keys).first(2));
  wire::FrameHeader r{};
  ASSERT_EQ(tcp::read_full(p.fd(), &r, sizeof r), tcp::IoResult::ok);
  ASSERT_EQ(r.status, 0);
  ASSERT_EQ(r.num_keys, 0u) << "replies carry no key table";
  ASSERT_EQ(r.payload_bytes, 16 * sizeof(float));
  std::vector<float> out(16);
  ASSERT_EQ(tcp::read_full(p.fd(), out.data(), r.payload_bytes), tcp::IoResult::ok);
  for (float v : out) EXPECT_EQ(v, 1.0f + 3 * 2.0f);  // rule add: three gradients of 2
}

TEST_F(TcpBadInput, ASecondHelloIsRefusedAndCloses) {
  RawPeer p(servers_[0].uri);
  p.hello();
  wire::FrameHeader h = wire::make_header(wire::Op::hello, 2, 0, 0, 0, wire::kVersion);
  p.send(&h, sizeof h);
  auto [status, text] = p.reply();
  EXPECT_EQ(status, int(Errc::permission)) << text;
  EXPECT_TRUE(p.closed_by_server());
  expect_still_serving();
}

// Before hello only a hello-sized frame is read: a peer cannot make the server hold a frame of
// its choosing before it has said who it is.
TEST_F(TcpBadInput, NothingLargerThanAHelloIsReadBeforeIt) {
  RawPeer p(servers_[0].uri);
  wire::FrameHeader h = wire::make_header(wire::Op::push, 1, 1, 32ull << 20);
  p.send(&h, sizeof h);
  auto [status, text] = p.reply();
  EXPECT_EQ(status, int(Errc::protocol)) << text;
  EXPECT_NE(text.find("hello"), std::string::npos) << text;
  EXPECT_TRUE(p.closed_by_server());
  expect_still_serving();
}

// A worker may be silent for long between requests: only a frame in progress has a deadline.
TEST(TcpLimits, AnIdleClientOutlivesTheFrameAndHandshakeTimeouts) {
  auto servers = start_servers(1, {"--frame-timeout-ms", "200", "--handshake-timeout-ms", "200"});
  Client c(options_for(servers));
  std::vector<float> v(8, 1.0f), out(8);
  c.wait(c.init(Key(1), v));
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  c.wait(c.pull(Key(1), out));
  EXPECT_EQ(out[0], 1.0f);
}

// Half a frame, or no hello at all, is closed at its deadline, and logged with the reason.
TEST(TcpLimits, HalfAFrameAndAMissingHelloAreClosedAtTheirDeadlines) {
  const std::string log = "/tmp/pskv-limits-" + std::to_string(::getpid());
  auto servers = start_servers(1, {"--frame-timeout-ms", "300", "--handshake-timeout-ms", "300"}, log);
  RawPeer silent(servers[0].uri);
  RawPeer half(servers[0].uri);
  half.hello();
  wire::FrameHeader h = wire::make_header(wire::Op::pull, 2, 1, 0);
  half.send(&h, 20);
  EXPECT_TRUE(silent.closed_by_server_within(std::chrono::seconds(5)));
  EXPECT_TRUE(half.closed_by_server_within(std::chrono::seconds(5)));
  // The socket is shut before the line is written: wait for the line, within a bound.
  std::string text;
  for (int i = 0; i < 100; ++i) {
    text = read_file(log);
    if (text.find("did not finish hello") != std::string::npos &&
        text.find("did not send the rest of a frame") != std::string::npos)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_NE(text.find("did not finish hello"), std::string::npos) << text;
  EXPECT_NE(text.find("did not send the rest of a frame"), std::string::npos) << text;
  ::unlink(log.c_str());
}

// More pulls parked than a connection may hold (256): past the cap the server stops reading
// that connection, and once the bound moves every pull is answered, the ones left buffered in
// its receive buffer while it was paused included.
TEST(TcpLimits, PullsParkedPastTheCapAreAllAnsweredOnceTheBoundMoves) {
  auto servers = start_servers(1, {"--workers", "2", "--mode", "bsp"});
  ClientOptions o = options_for(servers);
  o.max_in_flight = 1024;
  ClientOptions o0 = o, o1 = o;
  o0.worker_id = 0;
  o1.worker_id = 1;
  Client w0(o0), w1(o1);
  std::vector<float> v(4, 3.0f);
  w0.wait(w0.init(Key(5), v));
  w0.clock();  // worker 0 at clock 1, worker 1 at 0: worker 0's pulls wait
  constexpr int kPulls = 700;
  std::vector<std::vector<float>> out(kPulls, std::vector<float>(4));
  std::vector<Ticket> tickets;
  for (int i = 0; i < kPulls; ++i) tickets.push_back(w0.pull(Key(5), out[i]));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // let them park, up to the cap
  for (Ticket t : tickets) EXPECT_FALSE(w0.done(t));
  w1.clock();
  for (int i = 0; i < kPulls; ++i) {
    w0.wait(tickets[i]);
    EXPECT_EQ(out[i], v) << "pull " << i;
  }
}

// A worker's pull at a clock it has not announced could only wait out the timeout: refused at
// once, and the connection stays usable.
TEST(TcpLimits, APullBeyondTheWorkersOwnClockIsRefused) {
  auto servers = start_servers(1, {"--workers", "2", "--mode", "bsp"});
  RawPeer w(servers[0].uri);
  w.hello(0);
  const float zero = 0.0f;
  const wire::KeyEntry key{9, 1, 0};
  wire::FrameHeader init = wire::make_header(wire::Op::init, 2, 1, sizeof zero);
  w.send(&init, sizeof init);
  w.send(&key, sizeof key);
  w.send(&zero, sizeof zero);
  EXPECT_EQ(w.reply().first, 0);
  w.request(wire::Op::pull, 3, std::span(&key, 1), /*clock=*/1ull << 60);
  const auto [status, text] = w.reply();
  EXPECT_EQ(status, static_cast<int>(Errc::invalid_argument)) << text;
  EXPECT_NE(text.find("has announced clock 0"), std::string::npos) << text;
  w.request(wire::Op::pull, 4, std::span(&key, 1), /*clock=*/0);
  EXPECT_EQ(w.reply().first, 0);
}

// When the table is full, each new connection evicts one connection still in its handshake;
// those already evicted are not picked again, so the table comes back to the limit.
TEST(TcpLimits, EvictionKeepsTheTableAtItsLimit) {
  const std::string log = "/tmp/pskv-evict-" + std::to_string(::getpid());
  auto servers = start_servers(1, {"--max-connections", "16", "--handshake-timeout-ms", "60000"}, log);
  std::vector<std::unique_ptr<RawPeer>> silent;
  for (int i = 0; i < 64; ++i) silent.push_back(std::make_unique<RawPeer>(servers[0].uri));
  Client c(options_for(servers));  // gets in, evicting a silent one
  double connections = 1e9;
  for (int i = 0; i < 100 && connections > 16; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    connections = testing::stats_field(c.server_stats(0), "tcp_connections");
  }
  EXPECT_LE(connections, 16) << "connections stayed over --max-connections 16";
  ::unlink(log.c_str());
}

// Out of file descriptors (the server's limit lowered under it): a new connection is told why
// and closed rather than left in the backlog (which made both I/O threads spin on the
// listener), and once descriptors free up, clients get in again.
TEST(TcpLimits, OutOfDescriptorsIsRefusedClearlyAndServedAgainOnceTheyFree) {
  const std::string log = "/tmp/pskv-nofile-" + std::to_string(::getpid());
  auto servers = start_servers(1, {"--handshake-timeout-ms", "500"}, log);
  const pid_t pid = servers[0].process.pid();
  int open_fds = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd"))
    ++open_fds;
  const rlimit low{static_cast<rlim_t>(open_fds + 4), static_cast<rlim_t>(open_fds + 4)};
  ASSERT_EQ(::prlimit(pid, RLIMIT_NOFILE, &low, nullptr), 0) << std::strerror(errno);
  std::vector<std::unique_ptr<RawPeer>> silent;
  for (int i = 0; i < 12; ++i) silent.push_back(std::make_unique<RawPeer>(servers[0].uri));
  ClientOptions o = options_for(servers);
  o.connect_timeout = std::chrono::seconds(2);
  try {
    Client refused(o);
    ADD_FAILURE() << "a client connected to a server out of descriptors";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of file descriptors"), std::string::npos) << e.what();
  }
  silent.clear();  // and the server drops what it had accepted at the handshake deadline
  bool served = false;
  std::string last;
  for (int i = 0; i < 50 && !served; ++i) {
    try {
      Client c(o);
      std::vector<float> v(4, 1.0f);
      c.wait(c.init(Key(1), v));
      served = true;
    } catch (const Error& e) {
      last = e.what();
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  EXPECT_TRUE(served) << last;
  EXPECT_NE(read_file(log).find("out of file descriptors"), std::string::npos) << read_file(log);
  ::unlink(log.c_str());
}

// A push applied in pieces holds no lock while it waits for its next bytes: a client stalled in
// the middle of one holds up nobody using the same key. The pieces that arrived stay applied
// (documented); the rest never comes, and the frame timeout closes that connection.
TEST(TcpIntegration, AStalledPushInPiecesHoldsUpNobody) {
  auto servers = start_servers(1);
  ClientOptions o = options_for(servers);
  o.chunk_floats = 0;
  constexpr std::size_t kPiece = tcp::TcpServer::kPushPieceFloats, kFloats = 4 * kPiece;
  Client c(o);
  c.wait(c.init(Key(9), std::vector<float>(kFloats, 0.0f)));
  std::vector<float> out(kFloats);
  // Pieces are applied as they come, on another connection's thread: poll for one (bounded).
  auto wait_for = [&](std::size_t at, float value) {
    for (int i = 0; i < 500 && out[at] != value; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      c.wait(c.pull(Key(9), out));
    }
    return out[at] == value;
  };

  RawPeer stalled(servers[0].uri);
  stalled.hello();
  const wire::KeyEntry key{9, kFloats, 0};
  wire::FrameHeader h = wire::make_header(wire::Op::push, 2, 1, kFloats * sizeof(float));
  stalled.send(&h, sizeof h);
  stalled.send(&key, sizeof key);
  const std::vector<float> ones(2 * kPiece, 1.0f);
  stalled.send(ones.data(), ones.size() * sizeof(float));  // half the value, then nothing
  ASSERT_TRUE(wait_for(2 * kPiece - 1, 1.0f)) << "the pieces that arrived were not applied";

  c.wait(c.push(Key(9), std::vector<float>(kFloats, 1.0f)));
  c.wait(c.pull(Key(9), out));
  for (std::size_t i = 0; i < kFloats; ++i) ASSERT_EQ(out[i], i < 2 * kPiece ? 2.0f : 1.0f) << "float " << i;
  // The stalled push was still being served all that time: its third piece is applied when it
  // comes. (Had it held the key's lock, the push above would have waited for the frame timeout,
  // which abandons the frame.)
  stalled.send(ones.data(), kPiece * sizeof(float));
  ASSERT_TRUE(wait_for(3 * kPiece - 1, 2.0f)) << "the stalled push was abandoned before its third piece came";
  EXPECT_EQ(out.back(), 1.0f) << "a piece that never came was applied";
  EXPECT_TRUE(stalled.closed_by_server()) << "the stalled frame was never abandoned";
}

// A push frame applied as it arrives still applies each key of up to a piece whole: one pusher
// sends a long key and a piece-sized one in one frame, and pulls of the piece-sized key never
// see two pushes in it.
TEST(TcpIntegration, KeysUpToAPieceInALargePushAreAppliedWhole) {
  constexpr std::size_t kLong = 300000, kPiece = tcp::TcpServer::kPushPieceFloats;
  auto servers = start_servers(1);
  ClientOptions o = options_for(servers);
  o.chunk_floats = 0;
  {
    Client admin(o);
    admin.wait(admin.init(Key(1), std::vector<float>(kLong, 0.0f)));
    admin.wait(admin.init(Key(2), std::vector<float>(kPiece, 0.0f)));
  }
  constexpr int kPushes = 300;
  const pid_t pusher = fork_worker([&] {
    Client c(o);
    const std::vector<float> ones_long(kLong, 1.0f), ones_piece(kPiece, 1.0f);
    const std::vector<Key> keys{Key(1), Key(2)};
    const std::vector<std::span<const float>> values{ones_long, ones_piece};
    for (int i = 0; i < kPushes; ++i)
      c.wait(c.push(std::span<const Key>(keys), std::span<const std::span<const float>>(values)));
    return 0;
  });
  Client c(o);
  std::vector<float> piece(kPiece);
  int moving = 0;
  float last = -1;
  for (int reads = 0; reads < 20000 && last < kPushes; ++reads) {  // bounded: the pusher may die
    c.wait(c.pull(Key(2), piece));
    ASSERT_TRUE(testing::one_push(piece)) << "a key of one piece was applied in parts";
    moving += piece[0] != last;
    last = piece[0];
  }
  EXPECT_EQ(last, float(kPushes)) << "the pushes never all landed";
  EXPECT_GT(moving, 2) << "the pulls never overlapped the pushes";
  EXPECT_EQ(wait_pid(pusher), 0);
}

// A large push whose key table arrives split at an odd byte: the payload that follows must
// still be read to a float-aligned place (UBSan builds abort on a misaligned float), be applied
// whole and correct, and leave the connection parsing the frames after it.
TEST(TcpIntegration, ALargePushWhoseKeyTableArrivesSplitLandsAligned) {
  constexpr std::uint32_t kFloats = 100000;  // 400 KB: applied as it arrives
  auto servers = start_servers(1);
  ClientOptions o = options_for(servers);
  o.chunk_floats = 0;
  Client c(o);
  c.wait(c.init(Key(5), std::vector<float>(kFloats, 0.0f)));
  c.wait(c.init(Key(6), std::vector<float>(3, 0.0f)));

  RawPeer raw(servers[0].uri);
  raw.hello();
  const wire::KeyEntry key{5, kFloats, 0};
  wire::FrameHeader h = wire::make_header(wire::Op::push, 2, 1, kFloats * sizeof(float));
  raw.send(&h, sizeof h);
  raw.send(&key, 7);  // the server reads the header and 7 bytes of the table, then waits
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  raw.send(reinterpret_cast<const char*>(&key) + 7, sizeof key - 7);
  std::vector<float> grad(kFloats);
  std::iota(grad.begin(), grad.end(), 1.0f);
  raw.send(grad.data(), grad.size() * sizeof(float));
  const wire::KeyEntry small_key{6, 3, 0};
  const float small[3] = {1.0f, 2.0f, 3.0f};
  wire::FrameHeader sh = wire::make_header(wire::Op::push, 3, 1, sizeof small);
  raw.send(&sh, sizeof sh);
  raw.send(&small_key, sizeof small_key);
  raw.send(small, sizeof small);
  EXPECT_EQ(raw.reply().first, 0) << "the large push";
  EXPECT_EQ(raw.reply().first, 0) << "the small push after it";

  std::vector<float> out(kFloats), out_small(3);
  c.wait(c.pull(Key(5), out));
  c.wait(c.pull(Key(6), out_small));
  for (std::uint32_t i = 0; i < kFloats; ++i) ASSERT_EQ(out[i], grad[i]) << "float " << i;
  EXPECT_EQ(out_small, std::vector<float>(small, small + 3));
}

// Pipelined small frames that fill the server's 256 KiB receive buffer to the last byte, ending
// in the first 40 bytes of a header: the server must keep reading that frame, not take the full
// buffer's zero-byte read for the client hanging up. The burst is queued while the server is
// stopped, so one read takes a whole buffer of it.
TEST(TcpIntegration, FramesFillingTheReceiveBufferToTheLastByteAreAllServed) {
  constexpr std::uint32_t kFloats = 962;  // frames of 3,912 bytes: 67 fill 262,104, then 40 of a header
  constexpr std::size_t kFrame = sizeof(wire::FrameHeader) + sizeof(wire::KeyEntry) + kFloats * sizeof(float);
  static_assert((256u << 10) % kFrame == 40 && 40 < sizeof(wire::FrameHeader));
  constexpr int kFrames = 80;
  auto servers = start_servers(1);
  ClientOptions o = options_for(servers);
  Client c(o);
  c.wait(c.init(Key(3), std::vector<float>(kFloats, 0.0f)));
  c.wait(c.init(Key(4), std::vector<float>(1u << 20, 0.0f)));

  RawPeer raw(servers[0].uri);
  raw.hello();
  // Large pushes first, so the connection's receive window has grown past the burst.
  const std::vector<float> big(1u << 20, 0.0f);
  const wire::KeyEntry big_key{4, 1u << 20, 0};
  for (int i = 0; i < 4; ++i) {
    wire::FrameHeader h = wire::make_header(wire::Op::push, 100 + i, 1, big.size() * sizeof(float));
    raw.send(&h, sizeof h);
    raw.send(&big_key, sizeof big_key);
    raw.send(big.data(), big.size() * sizeof(float));
    ASSERT_EQ(raw.reply().first, 0);
  }
  std::vector<char> burst;
  const wire::KeyEntry key{3, kFloats, 0};
  const std::vector<float> ones(kFloats, 1.0f);
  for (int i = 0; i < kFrames; ++i) {
    const wire::FrameHeader h = wire::make_header(wire::Op::push, 200 + i, 1, kFloats * sizeof(float));
    const auto* hp = reinterpret_cast<const char*>(&h);
    const auto* kp = reinterpret_cast<const char*>(&key);
    const auto* vp = reinterpret_cast<const char*>(ones.data());
    burst.insert(burst.end(), hp, hp + sizeof h);
    burst.insert(burst.end(), kp, kp + sizeof key);
    burst.insert(burst.end(), vp, vp + kFloats * sizeof(float));
  }
  ASSERT_EQ(burst.size(), kFrames * kFrame);
  ASSERT_TRUE(testing::stop_process(servers[0].process.pid()));
  std::thread sender([&] { raw.send(burst.data(), burst.size()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  kill(servers[0].process.pid(), SIGCONT);
  sender.join();
  for (int i = 0; i < kFrames; ++i) ASSERT_EQ(raw.reply().first, 0) << "frame " << i << " of the burst";
  std::vector<float> out(kFloats);
  c.wait(c.pull(Key(3), out));
  EXPECT_EQ(out, std::vector<float>(kFloats, float(kFrames)));
}

class TcpAuth : public ::testing::Test {
 protected:
  void SetUp() override {
    log_ = "/tmp/pskv-auth-log-" + std::to_string(::getpid());
    servers_.push_back(ServerProcess::start(
        {"--uri", "tcp://127.0.0.1:0", "--workers", "1", "--mode", "asp", "--auth-token-file", token_.path}, log_));
    o_ = options_for(servers_);
    o_.auth_token_file = token_.path;
  }
  void TearDown() override { std::filesystem::remove(log_); }
  // A peer that says hello with a nonce, as a client holding some token would.
  std::pair<RawPeer, wire::FrameHeader> challenged_peer() {
    RawPeer p(servers_[0].uri);
    std::uint8_t nonce[wire::kAuthNonceBytes] = {7};
    wire::FrameHeader h = wire::make_header(wire::Op::hello, 1, 0, sizeof nonce, kNoWorker, wire::kVersion);
    p.send(&h, sizeof h);
    p.send(nonce, sizeof nonce);
    wire::FrameHeader r{};
    EXPECT_EQ(tcp::read_full(p.fd(), &r, sizeof r), tcp::IoResult::ok);
    std::uint8_t challenge[wire::kAuthNonceBytes + wire::kAuthProofBytes];
    EXPECT_EQ(r.payload_bytes, sizeof challenge);
    EXPECT_EQ(tcp::read_full(p.fd(), challenge, sizeof challenge), tcp::IoResult::ok);
    return {std::move(p), r};
  }
  TokenFile token_{"correct horse battery staple 42"};
  std::string log_;
  std::vector<ServerProcess> servers_;
  ClientOptions o_;
};

TEST_F(TcpAuth, ClientWithTheTokenIsServed) {
  Client c(o_);
  std::vector<float> v(64, 1.0f), out(64);
  c.wait(c.init(Key(5), v));
  c.wait(c.push(Key(5), v));
  c.wait(c.pull(Key(5), out));
  EXPECT_EQ(out[63], 2.0f);
}

TEST_F(TcpAuth, ClientWithoutOrWithAnotherTokenIsRefused) {
  ClientOptions none = o_;
  none.auth_token_file.clear();
  expect_permission_error(none, "requires a token");
  // A worker without the token must not have joined: the server still counts nobody.
  TokenFile other("another secret, also long enough");
  ClientOptions wrong = o_;
  wrong.auth_token_file = other.path;
  expect_permission_error(wrong, "failed to prove it holds the token");
  EXPECT_NE(read_file(log_).find("refused unauthenticated peer 127.0.0.1:"), std::string::npos) << read_file(log_);
  Client good(o_);  // still serving
}

TEST_F(TcpAuth, UnauthenticatedPeersAreServedNothingAndLogged) {
  {
    ClientOptions admin = o_;
    Client c(admin);
    std::vector<float> v(4, 3.0f);
    c.wait(c.init(Key(9), v));
  }
  {  // skips the challenge and asks for a value
    auto [p, r] = challenged_peer();
    EXPECT_TRUE(r.flags & wire::kAuthChallenge);
    wire::KeyEntry k{9, 4, 0};
    wire::FrameHeader h = wire::make_header(wire::Op::pull, 2, 1, 0);
    p.send(&h, sizeof h);
    p.send(&k, sizeof k);
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::permission)) << text;
    EXPECT_TRUE(p.closed_by_server());
  }
  {  // answers the challenge with a forged proof
    auto [p, r] = challenged_peer();
    std::uint8_t forged[wire::kAuthProofBytes] = {1, 2, 3};
    wire::FrameHeader h = wire::make_header(wire::Op::auth, 3, 0, sizeof forged);
    p.send(&h, sizeof h);
    p.send(forged, sizeof forged);
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::permission)) << text;
    EXPECT_TRUE(p.closed_by_server());
  }
  {  // an old-style hello without a nonce
    RawPeer p(servers_[0].uri);
    wire::FrameHeader h = wire::make_header(wire::Op::hello, 1, 0, 0, kNoWorker, wire::kVersion);
    p.send(&h, sizeof h);
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::permission)) << text;
    EXPECT_NE(text.find("--auth-token-file"), std::string::npos) << text;
    EXPECT_TRUE(p.closed_by_server());
  }
  const std::string log = read_file(log_);
  EXPECT_NE(log.find("sent pull before authenticating"), std::string::npos) << log;
  EXPECT_NE(log.find("failed the challenge"), std::string::npos) << log;
  EXPECT_NE(log.find("has no token"), std::string::npos) << log;
  Client c(o_);
  std::vector<float> out(4);
  c.wait(c.pull(Key(9), out));
  EXPECT_EQ(out[0], 3.0f);
}

TEST(TcpAuthSetup, ClientWithATokenRefusesAServerThatCannotProveIt) {
  auto servers = start_servers(1);
  TokenFile token("correct horse battery staple 42");
  ClientOptions o = options_for(servers);
  o.auth_token_file = token.path;
  expect_permission_error(o, "did not ask for authentication");
}

TEST(TcpAuthSetup, ServerRefusesATokenFileOthersCanRead) {
  TokenFile token("correct horse battery staple 42", 0644);
  const std::string log = "/tmp/pskv-auth-setup-" + std::to_string(::getpid());
  testing::Process server(PSKV_SERVER_BIN, {"--uri", "tcp://127.0.0.1:0", "--auth-token-file", token.path}, log);
  EXPECT_NE(server.wait(std::chrono::seconds(20)), 0);
  EXPECT_NE(read_file(log).find("chmod 600"), std::string::npos) << read_file(log);
  std::filesystem::remove(log);
}

TEST(TcpFailure, ServerDeathFailsOutstandingRequestsPromptly) {
  auto servers = start_servers(1);
  ClientOptions o = options_for(servers);
  o.io_timeout = std::chrono::seconds(5);
  Client c(o);
  std::vector<float> v(4, 0.0f);
  c.wait(c.init(Key(1), v));
  servers[0].process.signal(SIGKILL);
  servers[0].process.wait();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THROW(c.wait(c.pull(Key(1), v)), Error);
  EXPECT_THROW(c.wait(c.push(Key(1), v)), Error) << "later requests fail at once too";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(7));
}

// A server that stops answering (SIGSTOP, after the client created key 1) is declared gone after
// the client's io_timeout, whoever reads the connection.
class TcpHungServer : public ::testing::Test {
 protected:
  void SetUp() override {
    servers_ = start_servers(1);
    ClientOptions o = options_for(servers_);
    o.io_timeout = std::chrono::seconds(2);
    client_ = std::make_unique<Client>(o);
    client_->wait(client_->init(Key(1), value_));
    // Stopped for sure: a request sent before the signal lands would still be answered.
    ASSERT_TRUE(testing::stop_process(servers_[0].process.pid()));
  }
  void TearDown() override { servers_[0].process.signal(SIGKILL); }
  static void expect_timeout(Client& c, Ticket t) {
    try {
      c.wait(t);
      ADD_FAILURE() << "a stopped server answered";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::timeout) << e.what();
      EXPECT_NE(std::string(e.what()).find("hung or unreachable"), std::string::npos) << e.what();
    }
  }
  std::vector<ServerProcess> servers_;
  std::unique_ptr<Client> client_;
  std::vector<float> value_ = std::vector<float>(4, 0.0f);
};

// The waiting thread reads its own reply, so it is the one that must give up.
TEST_F(TcpHungServer, TimesOutTheThreadWaitingOnIt) {
  const Ticket unwaited = client_->push(Key(1), value_);
  expect_timeout(*client_, client_->pull(Key(1), value_));
  EXPECT_TRUE(client_->done(unwaited)) << "the other outstanding request fails with the connection";
  EXPECT_THROW(client_->wait(unwaited), Error);
}

// Nobody waits: only the connection's reader thread watches the socket (done() only picks up
// answers that already landed).
TEST_F(TcpHungServer, TimesOutRequestsNobodyWaitsFor) {
  const Ticket t = client_->push(Key(1), value_);
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!client_->done(t) && std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  ASSERT_TRUE(client_->done(t)) << "an unanswered request nobody waits for was never failed";
  expect_timeout(*client_, t);
}

TEST(TcpFailure, UnreachableServerIsAClearError) {
  ClientOptions o;
  o.servers = {"tcp://127.0.0.1:1"};
  o.connect_timeout = std::chrono::seconds(2);
  testing::expect_error([&] { Client c(o); }, Errc::peer_failure, {"is pskv-server running"});
}

}  // namespace
}  // namespace pskv

namespace pskv {
namespace {

TEST(TcpCheckpoint, ServerRestartsFromItsCheckpoint) {
  const std::string dir = "/tmp/pskv-restart-" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  std::vector<float> v(1000);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = float(i);
  {
    auto server = ServerProcess::start(
        {"--uri", "tcp://127.0.0.1:0", "--rule", "momentum", "--lr", "0.5", "--checkpoint-dir", dir});
    ClientOptions o;
    o.servers = {server.uri};
    Client c(o);
    c.wait(c.init(Key(3), v));
    std::vector<float> g(1000, 1.0f);
    c.wait(c.push(Key(3), g));
    c.wait(c.pull(Key(3), v));
    server.process.signal(SIGTERM);  // writes the final checkpoint
    ASSERT_EQ(server.process.wait(), 0);
  }
  auto server =
      ServerProcess::start({"--uri", "tcp://127.0.0.1:0", "--rule", "momentum", "--lr", "0.5", "--restore", dir});
  ClientOptions o;
  o.servers = {server.uri};
  Client c(o);
  std::vector<float> out(1000);
  c.wait(c.pull(Key(3), out));
  EXPECT_EQ(out, v);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pskv
