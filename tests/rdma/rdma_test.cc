// The RDMA backend end to end, on a real (Soft-RoCE) device: pskv-server processes serving
// rdma://$RXE_IP:0, clients in forked processes, values through real RDMA READs and WRITEs.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netdb.h>
#include <rdma/rdma_cma.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "rdma_support.h"
#include "support/replica_tables.h"
#include "support/stats.h"
#include "support/token_file.h"
#include "support/workloads.h"
#include "transport/rdma/rdma_protocol.h"
#include "transport/tcp/socket.h"
#include "transport/transport.h"
#include "transport/uri.h"

namespace pskv {
namespace {

using testing::expect_nothing_lost;
using testing::fork_worker;
using testing::rdma_client;
using testing::rdma_ip;
using testing::ServerProcess;
using testing::start_rdma_server;
using testing::wait_pid;

template <class T>
T* shared_array(std::size_t n) {
  void* p = mmap(nullptr, sizeof(T) * n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return new (p) T[n]();
}

std::vector<float> pattern(std::size_t n, float base) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = base + float(i % 1009);
  return v;
}

TEST(Rdma, PushAndPullValuesFromOneFloatTo16MiB) {
  PSKV_REQUIRE_RDMA();
  auto server = start_rdma_server({"--arena-mb", "80"});
  ClientOptions o = rdma_client({server.uri});
  o.chunk_floats = 0;  // one server, whole values: a 16 MiB value is one READ and one WRITE chain
  Client c(o);
  // 1 float; 300 floats (more than one 1024-byte MTU); 64 KiB; 1 MiB; 16 MiB.
  const std::vector<std::size_t> sizes{1, 300, 16384, 262144, 4u << 20};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    SCOPED_TRACE("value of " + std::to_string(sizes[i]) + " floats");
    const Key key = 100 + i;
    const auto init = pattern(sizes[i], float(i));
    c.wait(c.init(key, init));
    // Unregistered destination: bounced through staging (small) or registered for this pull.
    std::vector<float> out(sizes[i], -1.0f);
    c.wait(c.pull(key, out));
    ASSERT_EQ(out, init);
    // Registered buffers: straight from and into the caller's memory.
    std::vector<float> grad(sizes[i], 2.0f), out2(sizes[i], -1.0f);
    c.register_buffer(grad.data(), grad.size() * sizeof(float));
    c.register_buffer(out2.data(), out2.size() * sizeof(float));
    c.wait(c.push(key, grad));
    c.wait(c.pull(key, out2));
    for (std::size_t j = 0; j < sizes[i]; ++j) ASSERT_EQ(out2[j], init[j] + 2.0f) << j;
  }
}

TEST(Rdma, ManyKeysInOneRequestAndReadYourWrites) {
  PSKV_REQUIRE_RDMA();
  auto server = start_rdma_server();
  Client c(rdma_client({server.uri}));
  // More keys than one LOOKUP (about 1000) and one READ round (64) take.
  constexpr std::size_t kKeys = 2500;
  std::vector<Key> keys(kKeys);
  std::iota(keys.begin(), keys.end(), 5000);
  std::vector<std::vector<float>> values(kKeys), grads(kKeys), outs(kKeys);
  std::vector<std::span<const float>> in, g;
  std::vector<std::span<float>> out;
  for (std::size_t i = 0; i < kKeys; ++i) {
    values[i].assign(1 + i % 37, float(i));
    grads[i].assign(values[i].size(), 1.0f);
    outs[i].assign(values[i].size(), -1.0f);
    in.emplace_back(values[i]);
    g.emplace_back(grads[i]);
    out.emplace_back(outs[i]);
  }
  c.wait(c.init(keys, in));
  // Issued back to back without waiting: the pull must still see the push before it.
  const Ticket push = c.push(keys, g);
  const Ticket pull = c.pull(keys, out);
  c.wait(push);
  c.wait(pull);
  for (std::size_t i = 0; i < kKeys; ++i)
    for (float x : outs[i]) ASSERT_EQ(x, float(i) + 1.0f) << "key " << keys[i];
}

TEST(Rdma, NothingLostWithFourClientProcesses) {
  PSKV_REQUIRE_RDMA();
  std::vector<ServerProcess> servers;
  servers.push_back(start_rdma_server());
  servers.push_back(start_rdma_server({"--server-id", "1"}));
  expect_nothing_lost(rdma_client({servers[0].uri, servers[1].uri}), {.clients = 4,
                                                                      .pushes = 200,
                                                                      .keys = 8,
                                                                      .length = 100,
                                                                      .batch = 16,
                                                                      .pull_between_batches = true,
                                                                      .register_every_other = true,
                                                                      .worker_limit = std::chrono::seconds(300)});
}

// Writers assign all-equal vectors while readers pull the same keys with real RDMA READs: a
// value mixing two writes would show two different elements. One key is read into registered
// memory (zero copy), one is small and bounced through staging.
TEST(Rdma, ConcurrentPullsDuringPushesAreNeverTorn) {
  PSKV_REQUIRE_RDMA();
  auto server = start_rdma_server({"--rule", "assign"});
  ClientOptions o = rdma_client({server.uri});
  o.chunk_floats = 0;
  constexpr std::size_t kBig = 1u << 16, kSmall = 3000;  // 256 KiB (256 MTUs) and 12 KB
  {
    Client admin(o);
    admin.wait(admin.init(Key(1), std::vector<float>(kBig, 0.0f)));
    admin.wait(admin.init(Key(2), std::vector<float>(kSmall, 0.0f)));
  }
  auto* stop = shared_array<std::atomic<int>>(1);
  auto* reads = shared_array<std::atomic<long>>(2);  // [0] reads, [1] distinct values seen changing
  auto* torn = shared_array<std::atomic<long>>(1);
  std::vector<pid_t> writers, readers;
  for (int w = 0; w < 2; ++w)
    writers.push_back(fork_worker([&, w] {
      Client c(o);
      std::vector<float> big(kBig), small(kSmall);
      c.register_buffer(big.data(), big.size() * sizeof(float));
      for (int i = 1; !stop->load(); ++i) {
        std::fill(big.begin(), big.end(), float(i * 2 + w));
        std::fill(small.begin(), small.end(), float(i * 2 + w));
        const Ticket a = c.push(Key(1), big);
        const Ticket b = c.push(Key(2), small);
        c.wait(a);
        c.wait(b);
        // Leave readers gaps too: under emulation a READ takes as long as several writes.
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      return 0;
    }));
  for (int r = 0; r < 2; ++r)
    readers.push_back(fork_worker([&] {
      Client c(o);
      std::vector<float> big(kBig), small(kSmall);
      c.register_buffer(big.data(), big.size() * sizeof(float));
      float last = -1;
      for (int i = 0; i < 60; ++i) {
        const Ticket a = c.pull(Key(1), big);
        const Ticket b = c.pull(Key(2), small);
        c.wait(a);
        c.wait(b);
        for (const auto* v : {&big, &small})
          if (std::any_of(v->begin(), v->end(), [&](float x) { return x != (*v)[0]; })) torn->fetch_add(1);
        if (big[0] != last) reads[1].fetch_add(1);
        last = big[0];
        reads[0].fetch_add(1);
      }
      return 0;
    }));
  for (pid_t p : readers) EXPECT_EQ(wait_pid(p, std::chrono::seconds(300)), 0);
  stop->store(1);
  for (pid_t p : writers) EXPECT_EQ(wait_pid(p, std::chrono::seconds(60)), 0);
  EXPECT_EQ(torn->load(), 0) << "a pull returned a value mixing two writes";
  EXPECT_EQ(reads[0].load(), 120);
  EXPECT_GT(reads[1].load(), 10) << "the writers hardly ran while the readers read: the test proved little";
  munmap(stop, sizeof(std::atomic<int>));
  munmap(reads, 2 * sizeof(std::atomic<long>));
  munmap(torn, sizeof(std::atomic<long>));
}

TEST(Rdma, UnknownKeyWrongLengthAndOversizedPushAreClearErrors) {
  PSKV_REQUIRE_RDMA();
  auto server = start_rdma_server({"--rdma-recv-mb", "1"});
  ClientOptions o = rdma_client({server.uri});
  o.chunk_floats = 0;
  Client c(o);
  std::vector<float> v(8, 1.0f), w(5);
  c.wait(c.init(Key(1), v));
  auto expect_error = [&](Ticket t, Errc code, const std::string& text) {
    try {
      c.wait(t);
      ADD_FAILURE() << "expected " << errc_name(code);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect_error(c.pull(Key(999), v), Errc::not_found, "init it");
  expect_error(c.pull(Key(1), w), Errc::length_mismatch, "has 8 floats");
  expect_error(c.push(Key(1), w), Errc::length_mismatch, "has 8 floats");
  std::vector<float> huge(1u << 19);  // 2 MiB: more than the 1 MiB receive region
  expect_error(c.push(Key(1), huge), Errc::capacity, "--rdma-recv-mb");
  c.wait(c.pull(Key(1), v));  // the connection still works
  EXPECT_EQ(v[0], 1.0f);
  const std::string stats = c.server_stats(0);
  EXPECT_NE(stats.find("\"keys\":1"), std::string::npos) << stats;
}

TEST(Rdma, ServerKilledFailsRequestsClearly) {
  PSKV_REQUIRE_RDMA();
  auto server = start_rdma_server();
  ClientOptions o = rdma_client({server.uri});
  o.io_timeout = std::chrono::seconds(5);
  Client c(o);
  std::vector<float> v(1000, 0.0f);
  c.wait(c.init(Key(1), v));
  c.wait(c.pull(Key(1), v));
  server.process.signal(SIGKILL);
  server.process.wait();
  for (int i = 0; i < 2; ++i) {
    try {
      c.wait(i == 0 ? c.pull(Key(1), v) : c.push(Key(1), v));
      ADD_FAILURE() << "request " << i << " to a dead server succeeded";
    } catch (const Error& e) {
      EXPECT_TRUE(e.code() == Errc::peer_failure || e.code() == Errc::timeout) << e.what();
      EXPECT_NE(std::string(e.what()).find(server.uri), std::string::npos) << "names the server: " << e.what();
    }
  }
}

TEST(Rdma, NoListenerAndWrongAddressAreClearErrors) {
  PSKV_REQUIRE_RDMA();
  ClientOptions o;
  o.connect_timeout = std::chrono::seconds(2);
  o.servers = {"rdma://" + rdma_ip() + ":1"};
  try {
    Client c(o);
    ADD_FAILURE() << "connected to nothing";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::peer_failure) << e.what();
    EXPECT_NE(std::string(e.what()).find("is pskv-server running"), std::string::npos) << e.what();
  }
  auto server = start_rdma_server();
  o.servers = {server.uri + "?dev=mlx5_9"};
  try {
    Client c(o);
    ADD_FAILURE() << "connected although the device does not match";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find("dev=mlx5_9"), std::string::npos) << e.what();
  }
}

// A client of another protocol version is refused with the reason in the REJ private data,
// and the server goes on serving others.
TEST(Rdma, VersionMismatchIsRefusedWithAClearMessage) {
  PSKV_REQUIRE_RDMA();
  auto server = start_rdma_server();
  const Uri u = parse_uri(server.uri);
  rdma_event_channel* ch = rdma_create_event_channel();
  ASSERT_NE(ch, nullptr);
  rdma_cm_id* id = nullptr;
  ASSERT_EQ(rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP), 0);
  addrinfo* ai = nullptr;
  ASSERT_EQ(getaddrinfo(u.host.c_str(), std::to_string(u.port).c_str(), nullptr, &ai), 0);
  auto next = [&](rdma_cm_event_type want) {
    rdma_cm_event* ev = nullptr;
    EXPECT_EQ(rdma_get_cm_event(ch, &ev), 0);
    EXPECT_EQ(ev->event, want) << rdma_event_str(ev->event);
    return ev;
  };
  ASSERT_EQ(rdma_resolve_addr(id, nullptr, ai->ai_addr, 5000), 0);
  freeaddrinfo(ai);
  rdma_ack_cm_event(next(RDMA_CM_EVENT_ADDR_RESOLVED));
  ASSERT_EQ(rdma_resolve_route(id, 5000), 0);
  rdma_ack_cm_event(next(RDMA_CM_EVENT_ROUTE_RESOLVED));
  rdma::ConnectRequest req{rdma::kCmMagic, wire::kVersion, rdma::kRdmaVersion + 1, kNoWorker, 8, 0, {}};
  rdma_conn_param p{};
  p.private_data = &req;
  p.private_data_len = sizeof req;
  p.qp_num = 1;  // no queue pair: the server must refuse before it needs one
  ASSERT_EQ(rdma_connect(id, &p), 0);
  rdma_cm_event* ev = next(RDMA_CM_EVENT_REJECTED);
  rdma::RejectInfo r{};
  ASSERT_GE(ev->param.conn.private_data_len, sizeof r);
  std::memcpy(&r, ev->param.conn.private_data, sizeof r);
  rdma_ack_cm_event(ev);
  rdma_destroy_id(id);
  rdma_destroy_event_channel(ch);
  EXPECT_EQ(r.magic, rdma::kCmMagic);
  EXPECT_EQ(r.status, std::uint16_t(Errc::protocol));
  const std::string text(r.text, r.length);
  EXPECT_NE(text.find("use matching pskv builds"), std::string::npos) << text;

  Client c(rdma_client({server.uri}));
  std::vector<float> v(4, 1.0f);
  c.wait(c.init(Key(1), v));
}

// Just enough of a client to misbehave: a queue pair connected with valid connection data,
// then frames no pskv client would send.
class RawPeer {
 public:
  // claims_token: asks as a client holding a token would (with an all-zero nonce).
  // takes_replies false: posts no receive buffer, so no reply of the server's can land.
  explicit RawPeer(const std::string& uri, bool claims_token = false, std::uint32_t worker = kNoWorker,
                   bool takes_replies = true) {
    const Uri u = parse_uri(uri);
    ch_ = rdma_create_event_channel();
    if (!ch_ || rdma_create_id(ch_, &id_, nullptr, RDMA_PS_TCP) != 0) throw std::runtime_error("rdma_cm");
    addrinfo* ai = nullptr;
    if (getaddrinfo(u.host.c_str(), std::to_string(u.port).c_str(), nullptr, &ai) != 0)
      throw std::runtime_error("addr");
    const int rc = rdma_resolve_addr(id_, nullptr, ai->ai_addr, 5000);
    freeaddrinfo(ai);
    if (rc != 0) throw std::runtime_error("resolve");
    expect_event(RDMA_CM_EVENT_ADDR_RESOLVED);
    pd_ = ibv_alloc_pd(id_->verbs);
    cq_ = ibv_create_cq(id_->verbs, 64, nullptr, nullptr, 0);
    ibv_qp_init_attr qa{};
    qa.send_cq = qa.recv_cq = cq_;
    qa.qp_type = IBV_QPT_RC;
    qa.cap = {16, 16, 1, 1, 0};
    if (!pd_ || !cq_ || rdma_create_qp(id_, pd_, &qa) != 0) throw std::runtime_error("qp");
    buf_.resize(kBuf * 16);
    mr_ = ibv_reg_mr(pd_, buf_.data(), buf_.size(), IBV_ACCESS_LOCAL_WRITE);
    if (takes_replies)
      for (std::uint32_t i = 8; i < 16; ++i) post_recv(i);
    if (rdma_resolve_route(id_, 5000) != 0) throw std::runtime_error("route");
    expect_event(RDMA_CM_EVENT_ROUTE_RESOLVED);
    rdma::ConnectRequest req{
        rdma::kCmMagic, wire::kVersion, rdma::kRdmaVersion, worker, kDepth, claims_token ? rdma::kHasToken : 0u, {}};
    rdma_conn_param p{};
    p.private_data = &req;
    p.private_data_len = sizeof req;
    p.initiator_depth = p.responder_resources = 1;
    p.retry_count = 7;
    p.rnr_retry_count = 7;
    if (rdma_connect(id_, &p) != 0) throw std::runtime_error("connect");
    rdma_cm_event* ev = expect_event(RDMA_CM_EVENT_ESTABLISHED, false);
    std::memcpy(&info_, ev->param.conn.private_data, sizeof info_);
    rdma_ack_cm_event(ev);
    fcntl(ch_->fd, F_SETFL, fcntl(ch_->fd, F_GETFL) | O_NONBLOCK);
  }
  ~RawPeer() {
    rdma_disconnect(id_);
    rdma_destroy_qp(id_);
    ibv_dereg_mr(mr_);
    ibv_destroy_cq(cq_);
    ibv_dealloc_pd(pd_);
    rdma_destroy_id(id_);
    rdma_destroy_event_channel(ch_);
  }
  const rdma::AcceptInfo& info() const { return info_; }
  static constexpr std::uint32_t kDepth = 8;  // the credits it asks for

  void send(const void* data, std::size_t n) { post(IBV_WR_SEND, data, n, 0, 0); }
  void write_imm(const void* data, std::size_t n, std::uint64_t offset, std::uint32_t imm) {
    post(IBV_WR_RDMA_WRITE_WITH_IMM, data, n, offset, imm);
  }
  // The next reply's status and text; {-1, ""} if none came (or the connection broke).
  std::pair<int, std::string> reply() {
    ibv_wc wc{};
    if (!next_completion(IBV_WC_RECV, &wc)) return {-1, ""};
    wire::FrameHeader h;
    const std::byte* p = buf_.data() + wr_index(wc) * kBuf;
    std::memcpy(&h, p, sizeof h);
    return {h.status, std::string(reinterpret_cast<const char*>(p + sizeof h), h.payload_bytes)};
  }
  // True once the server disconnects this peer.
  bool disconnected() {
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(ch_, &ev) != 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      return false;
    }
    const bool gone = ev->event == RDMA_CM_EVENT_DISCONNECTED;
    rdma_ack_cm_event(ev);
    return gone;
  }
  // True if the server disconnects this peer within 10 s.
  bool closed_by_server() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline)
      if (disconnected()) return true;
    return false;
  }

 private:
  static constexpr std::size_t kBuf = 4096;
  static std::uint32_t wr_index(const ibv_wc& wc) { return static_cast<std::uint32_t>(wc.wr_id); }
  rdma_cm_event* expect_event(rdma_cm_event_type want, bool ack = true) {
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(ch_, &ev) != 0 || ev->event != want) throw std::runtime_error("unexpected rdma_cm event");
    if (ack) rdma_ack_cm_event(ev);
    return ack ? nullptr : ev;
  }
  void post_recv(std::uint32_t i) {
    ibv_sge sge{reinterpret_cast<std::uint64_t>(buf_.data() + i * kBuf), kBuf, mr_->lkey};
    ibv_recv_wr wr{}, *bad = nullptr;
    wr.wr_id = i;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_post_recv(id_->qp, &wr, &bad);
  }
  void post(ibv_wr_opcode op, const void* data, std::size_t n, std::uint64_t offset, std::uint32_t imm) {
    std::memcpy(buf_.data(), data, n);
    ibv_sge sge{reinterpret_cast<std::uint64_t>(buf_.data()), static_cast<std::uint32_t>(n), mr_->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = op;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(imm);
    wr.wr.rdma.remote_addr = info_.grant.region_addr + offset;
    wr.wr.rdma.rkey = info_.grant.region_rkey;
    if (ibv_post_send(id_->qp, &wr, &bad) != 0) throw std::runtime_error("post");
    ibv_wc wc{};
    next_completion(op == IBV_WR_SEND ? IBV_WC_SEND : IBV_WC_RDMA_WRITE, &wc);
  }
  bool next_completion(ibv_wc_opcode want, ibv_wc* out) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      ibv_wc wc{};
      if (ibv_poll_cq(cq_, 1, &wc) == 1) {
        if (wc.status != IBV_WC_SUCCESS) return false;
        if (wc.opcode == want) {
          *out = wc;
          return true;
        }
        continue;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }
  rdma_event_channel* ch_ = nullptr;
  rdma_cm_id* id_ = nullptr;
  ibv_pd* pd_ = nullptr;
  ibv_cq* cq_ = nullptr;
  ibv_mr* mr_ = nullptr;
  std::vector<std::byte> buf_;
  rdma::AcceptInfo info_{};
};

// A stats text longer than one reply SEND (kControlBytes) comes in pages, each cut from the text
// as it was when the first was asked for, also while other threads read it on the same
// connection; a page asked for without a first one is refused.
TEST(Rdma, StatsLongerThanOneReplyComeWholeInPages) {
  PSKV_REQUIRE_RDMA();
  constexpr int kWorkers = 20000;  // their clocks alone make about 40 KB of text: three pages
  auto server = start_rdma_server({"--workers", std::to_string(kWorkers)});
  Client c(rdma_client({server.uri}));
  auto check = [&](const std::string& stats) {
    EXPECT_GT(stats.size(), 2 * rdma::kControlBytes);
    ASSERT_FALSE(stats.empty());
    EXPECT_EQ(stats.front(), '{');
    EXPECT_EQ(stats.back(), '}');
    const auto at = stats.find("\"clocks_by_worker\":[");
    ASSERT_NE(at, std::string::npos) << stats.substr(0, 200);
    const auto end = stats.find(']', at);
    ASSERT_NE(end, std::string::npos);
    EXPECT_EQ(std::count(stats.begin() + at, stats.begin() + end, ','), kWorkers - 1);
    EXPECT_EQ(testing::stats_field(stats, "server_id"), 0) << stats.substr(0, 200);
  };
  check(c.server_stats(0));
  std::vector<std::string> got(3);
  {
    std::vector<std::thread> readers;
    for (auto& g : got)
      readers.emplace_back([&] {
        for (int i = 0; i < 5; ++i) g = c.server_stats(0);
      });
    for (auto& r : readers) r.join();
  }
  for (const auto& g : got) check(g);
  RawPeer p(server.uri);
  const wire::FrameHeader h = wire::make_header(wire::Op::stats, 1, 0, 0, 100, 0);
  p.send(&h, sizeof h);
  const auto [status, text] = p.reply();
  EXPECT_EQ(status, static_cast<int>(Errc::capacity)) << text;
  EXPECT_NE(text.find("no first page"), std::string::npos) << text;
  check(c.server_stats(0));
}

// Each kind of malformed message gets an error (when there is a frame to answer) and closes
// that one connection; a well-behaved client is served throughout.
TEST(Rdma, MalformedMessagesCloseOnlyTheirConnection) {
  PSKV_REQUIRE_RDMA();
  auto server = start_rdma_server({"--rdma-recv-mb", "2"});
  Client healthy(rdma_client({server.uri}));
  std::vector<float> v(8, 1.0f);
  healthy.wait(healthy.init(Key(1), v));
  std::vector<float> scratch(8);
  auto still_serving = [&] {
    healthy.wait(healthy.push(Key(1), v));
    healthy.wait(healthy.pull(Key(1), scratch));
  };
  {
    SCOPED_TRACE("bad magic");
    RawPeer p(server.uri);
    wire::FrameHeader h = wire::make_header(wire::Op::stats, 1, 0, 0);
    h.magic = 0x12345678;
    p.send(&h, sizeof h);
    EXPECT_TRUE(p.closed_by_server());
    still_serving();
  }
  {
    SCOPED_TRACE("declared key table longer than the message");
    RawPeer p(server.uri);
    const wire::FrameHeader h = wire::make_header(wire::Op::lookup, 2, 3, 0);
    p.send(&h, sizeof h);
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::protocol)) << text;
    EXPECT_NE(text.find("the message has 0"), std::string::npos) << text;
    EXPECT_TRUE(p.closed_by_server());
    still_serving();
  }
  {
    SCOPED_TRACE("push values in a SEND");
    RawPeer p(server.uri);
    struct {
      wire::FrameHeader h;
      wire::KeyEntry k;
      float x;
    } m{wire::make_header(wire::Op::push, 3, 1, 4), {1, 1, 0}, 1.0f};
    p.send(&m, sizeof m.h + sizeof m.k + sizeof m.x);  // without the struct's tail padding
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::protocol)) << text;
    EXPECT_NE(text.find("RDMA WRITE"), std::string::npos) << text;
    still_serving();
  }
  {
    SCOPED_TRACE("immediate pointing outside the receive region");
    RawPeer p(server.uri);
    const wire::FrameHeader h = wire::make_header(wire::Op::push, 4, 0, 0);
    p.write_imm(&h, sizeof h, 0, 0xffffffffu);
    EXPECT_TRUE(p.closed_by_server());
    still_serving();
  }
  {
    SCOPED_TRACE("push declaring more than the receive region holds");
    RawPeer p(server.uri);
    struct {
      wire::FrameHeader h;
      wire::KeyEntry k;
    } m{wire::make_header(wire::Op::push, 5, 1, 64u << 20), {1, 16u << 20, 0}};
    const std::uint64_t at = p.info().grant.region_bytes - 128;
    p.write_imm(&m, sizeof m, at, static_cast<std::uint32_t>(at / 64));
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::protocol)) << text;
    EXPECT_NE(text.find("past the end of the receive region"), std::string::npos) << text;
    EXPECT_TRUE(p.closed_by_server());
    still_serving();
  }
  TableSpec rows;
  rows.dim = 4;
  healthy.create_table(0, rows);
  {
    SCOPED_TRACE("table_pull asking for more rows than the room it left");
    RawPeer p(server.uri);
    struct {
      wire::FrameHeader h;
      wire::KeyEntry k[2];
      rdma::RowsTarget t;
    } m{wire::make_header(wire::Op::table_pull, 6, 2, 0), {{1, 4, 0}, {2, 4, 0}}, {}};
    const std::uint64_t at = p.info().grant.region_bytes - 128;  // 48 bytes left after the key table
    m.k[1].length = 1u << 20;
    m.t.room = 48;  // the truth about the room, but 4 MiB of rows asked for
    p.write_imm(&m, sizeof m, at, static_cast<std::uint32_t>(at / 64));
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::protocol)) << text;
    EXPECT_NE(text.find("too small"), std::string::npos) << text;
    EXPECT_TRUE(p.closed_by_server());
    still_serving();
  }
  {
    SCOPED_TRACE("table_pull claiming more room than the receive region has left");
    RawPeer p(server.uri);
    struct {
      wire::FrameHeader h;
      wire::KeyEntry k;
      rdma::RowsTarget t;
    } m{wire::make_header(wire::Op::table_pull, 8, 1, 0), {1, 4, 0}, {0, 0, 1u << 20}};
    const std::uint64_t at = p.info().grant.region_bytes - 128;
    p.write_imm(&m, sizeof m, at, static_cast<std::uint32_t>(at / 64));
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::protocol)) << text;
    EXPECT_NE(text.find("a room of 1048576 bytes"), std::string::npos) << text;
    EXPECT_NE(text.find("pass the end of the receive region"), std::string::npos) << text;
    EXPECT_TRUE(p.closed_by_server());
    still_serving();
  }
  {
    SCOPED_TRACE("table_pull naming memory the peer never registered");
    RawPeer p(server.uri);
    struct {
      wire::FrameHeader h;
      wire::KeyEntry k;
      rdma::RowsTarget t;
    } m{wire::make_header(wire::Op::table_pull, 7, 1, 0, 0, 0), {1, 4, 0}, {0x1000, 0xdead, 16}};
    p.write_imm(&m, sizeof m, 0, 0);
    EXPECT_EQ(p.reply().first, -1) << "answered although its rows could not be written";
    EXPECT_TRUE(p.closed_by_server());
    still_serving();
  }
  std::vector<float> out(8);
  healthy.wait(healthy.pull(Key(1), out));
  EXPECT_EQ(out[0], 9.0f);
  std::vector<float> row(4);
  const Key id = 1;
  healthy.wait(healthy.pull_rows(0, {&id, 1}, row));
}

// A client never has more requests out than its credits, but nothing else stopped a peer from
// parking waits without end (tcp caps them): each held the engine's memory until the wait
// timeout. A wait past the credits, or at a clock the worker never announced, is refused.
TEST(Rdma, APeerParksNoMoreWaitsThanItsCredits) {
  PSKV_REQUIRE_RDMA();
  auto server = start_rdma_server({"--workers", "2", "--mode", "bsp", "--wait-timeout-ms", "20000"});
  RawPeer p(server.uri, false, /*worker=*/0);
  std::uint64_t id = 1;
  const auto frame = [&](wire::Op op, std::uint64_t arg0) {
    const wire::FrameHeader h = wire::make_header(op, id++, 0, 0, arg0);
    p.send(&h, sizeof h);
  };
  frame(wire::Op::clock, 1);
  EXPECT_EQ(p.reply().first, int(Errc::ok));
  frame(wire::Op::wait, 5);  // clock 5 was never announced
  auto [status, text] = p.reply();
  EXPECT_EQ(status, int(Errc::invalid_argument)) << text;
  EXPECT_NE(text.find("has announced clock 1"), std::string::npos) << text;
  // Worker 1 is at clock 0: every wait at clock 1 parks, up to the credits.
  for (std::uint32_t i = 0; i < RawPeer::kDepth; ++i) frame(wire::Op::wait, 1);
  frame(wire::Op::wait, 1);
  std::tie(status, text) = p.reply();
  EXPECT_EQ(status, int(Errc::capacity)) << text;
  EXPECT_NE(text.find("credits"), std::string::npos) << text;
  frame(wire::Op::barrier, 1);  // a barrier parks the same way, so it is counted the same way
  std::tie(status, text) = p.reply();
  EXPECT_EQ(status, int(Errc::capacity)) << text;
  EXPECT_NE(text.find("barrier would be request 9"), std::string::npos) << text;
  Client healthy(rdma_client({server.uri}));
  std::vector<float> v(8, 1.0f);
  healthy.wait(healthy.init(Key(1), v));
}

// A peer that takes no replies (posts no receive buffers) leaves every reply SEND
// unacknowledged. Its replies wait in its connection, not in the completion thread: a healthy
// client of the same thread is served meanwhile, and the peer is closed once none of its replies
// could leave for --frame-timeout-ms. The server used to spin its one thread a second per reply.
TEST(Rdma, APeerThatTakesNoRepliesHoldsNoThread) {
  PSKV_REQUIRE_RDMA();
  const std::string log = "/tmp/pskv-rdma-deaf-" + std::to_string(::getpid()) + ".log";
  auto server =
      ServerProcess::start(testing::rdma_server_args({"--io-threads", "1", "--frame-timeout-ms", "6000"}), log);
  Client healthy(rdma_client({server.uri}));
  std::vector<float> v(256, 1.0f), out(256);
  healthy.wait(healthy.init(Key(1), v));
  RawPeer deaf(server.uri, false, kNoWorker, /*takes_replies=*/false);
  // Its 2 x 8 reply buffers fill, and more replies queue behind them.
  const struct {
    wire::FrameHeader h;
    wire::KeyEntry k;
  } ask{wire::make_header(wire::Op::lookup, 1, 1, 0), {1, 256, 0}};
  for (int i = 0; i < 2 * int(RawPeer::kDepth) + 4; ++i) deaf.send(&ask, sizeof ask);
  for (int i = 0; i < 300; ++i) {
    healthy.wait(healthy.push(Key(1), v));
    healthy.wait(healthy.pull(Key(1), out));
  }
  EXPECT_EQ(out[0], 301.0f);
  const auto calm_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  bool gone_early = false;
  while (!gone_early && std::chrono::steady_clock::now() < calm_until) gone_early = deaf.disconnected();
  EXPECT_FALSE(gone_early) << "the peer was closed before --frame-timeout-ms, so its replies had held the thread";
  EXPECT_TRUE(deaf.closed_by_server());
  healthy.wait(healthy.pull(Key(1), out));
  std::ifstream in(log);
  const std::string logged((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(logged.find("took none of its"), std::string::npos) << logged;
  std::remove(log.c_str());
}

// What a client's connect was refused with ("" if it connected).
std::string refusal(const ClientOptions& o, Errc want) {
  try {
    Client c(o);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), want) << e.what();
    return e.what();
  }
  return "";
}

// Every connection pins its receive region and buffers for its life. Opening connections used to
// pin without bound (1,024 of 35 MiB each at the defaults: 35 GiB, past this machine's memory);
// now clients together stay within 7/8 of --rdma-pin-mb, and one that would pass it is refused,
// saying so. Its memory is given back when a connection closes.
TEST(Rdma, ConnectionsPinNoMoreThanTheirBudget) {
  PSKV_REQUIRE_RDMA();
  {
    // Forked before this process registers any memory of its own (see ibv_fork_init's warning).
    const std::string log = "/tmp/pskv-rdma-budget-" + std::to_string(::getpid()) + ".log";
    EXPECT_THROW(ServerProcess::start(testing::rdma_server_args({"--rdma-pin-mb", "20"}), log), std::runtime_error);
    EXPECT_NE(testing::read_file(log).find("no client could connect"), std::string::npos) << testing::read_file(log);
    std::remove(log.c_str());
  }
  // A RawPeer asks for 8 credits: 24 MiB of region and 384 KiB of buffers; a Client 64, so 27 MiB.
  // Clients may pin 84 of 96 MiB: three RawPeers, not a Client more; two and a Client.
  auto server = start_rdma_server({"--rdma-pin-mb", "96"});
  std::vector<std::unique_ptr<RawPeer>> peers;
  for (int i = 0; i < 3; ++i) peers.push_back(std::make_unique<RawPeer>(server.uri));
  const std::string why = refusal(rdma_client({server.uri}), Errc::capacity);
  EXPECT_NE(why.find("--rdma-pin-mb"), std::string::npos) << why;
  peers.pop_back();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::unique_ptr<Client> c;
  while (!c && std::chrono::steady_clock::now() < deadline) {
    try {
      c = std::make_unique<Client>(rdma_client({server.uri}));
    } catch (const Error&) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the close is still under way
    }
  }
  ASSERT_TRUE(c) << "the closed connection's memory was not given back";
  std::vector<float> v(64, 1.0f);
  c->wait(c->init(Key(1), v));
  EXPECT_NE(c->server_stats(0).find("\"rdma_pinned_bytes\""), std::string::npos) << c->server_stats(0);
  EXPECT_NE(refusal(rdma_client({server.uri}), Errc::capacity).find("pin"), std::string::npos);
}

// Connections from one address stop at --max-connections-per-address, as on tcp; and with a token,
// a connection that has not proven it within --handshake-timeout-ms is closed (it used to hold its
// connection slot and pinned memory for good).
TEST(Rdma, OnePeerHoldsBoundedConnectionsAndUnprovenOnesAreClosed) {
  PSKV_REQUIRE_RDMA();
  {
    auto server = start_rdma_server({"--max-connections-per-address", "2"});
    RawPeer a(server.uri), b(server.uri);
    const std::string why = refusal(rdma_client({server.uri}), Errc::capacity);
    EXPECT_NE(why.find("--max-connections-per-address"), std::string::npos) << why;
  }
  const testing::TokenFile token("correct horse battery staple 42\n");
  const std::string log = "/tmp/pskv-rdma-handshake-" + std::to_string(::getpid()) + ".log";
  auto server = ServerProcess::start(
      testing::rdma_server_args({"--auth-token-file", token.path, "--handshake-timeout-ms", "1000"}), log);
  RawPeer silent(server.uri, /*claims_token=*/true);
  EXPECT_TRUE(silent.closed_by_server());
  ClientOptions good = rdma_client({server.uri});
  good.auth_token_file = token.path;
  Client healthy(good);
  std::vector<float> v(64, 1.0f);
  healthy.wait(healthy.init(Key(1), v));
  std::ifstream in(log);
  const std::string logged((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(logged.find("did not prove its token within 1000 ms"), std::string::npos) << logged;
  std::remove(log.c_str());
}

// With --auth-token-file, only a client proving the token gets remote keys or any answer; the
// others are refused with a clear error, logged, and the server keeps serving.
TEST(Rdma, AuthTokenGatesEveryConnection) {
  PSKV_REQUIRE_RDMA();
  const testing::TokenFile token("correct horse battery staple 42\n"), other("another secret, also long enough\n");
  const std::string log = "/tmp/pskv-rdma-auth-" + std::to_string(::getpid()) + ".log";
  auto server = ServerProcess::start({"--uri", "rdma://" + rdma_ip() + ":0", "--io-threads", "2", "--arena-mb", "48",
                                      "--max-keys", "4096", "--rdma-recv-mb", "24", "--auth-token-file", token.path},
                                     log);
  ClientOptions good = rdma_client({server.uri});
  good.auth_token_file = token.path;
  Client healthy(good);
  std::vector<float> v(1000, 1.0f), out(1000);
  healthy.wait(healthy.init(Key(1), v));
  healthy.wait(healthy.push(Key(1), v));
  healthy.wait(healthy.pull(Key(1), out));
  EXPECT_EQ(out[999], 2.0f);

  ClientOptions none = good;
  none.auth_token_file.clear();
  testing::expect_permission_error(none, "requires a token");
  ClientOptions wrong = good;
  wrong.auth_token_file = other.path;
  testing::expect_permission_error(wrong, "failed to prove it holds the token");

  {
    SCOPED_TRACE("asks before authenticating");
    RawPeer p(server.uri, true);
    EXPECT_TRUE(p.info().flags & rdma::kAuthRequired);
    EXPECT_EQ(p.info().grant.store_rkey, 0u);  // no remote key before the proof
    EXPECT_EQ(p.info().grant.store_addr, 0u);
    EXPECT_EQ(p.info().grant.region_rkey, 0u);
    struct {
      wire::FrameHeader h;
      wire::KeyEntry k;
    } m{wire::make_header(wire::Op::lookup, 1, 1, 0), {1, 1000, 0}};
    p.send(&m, sizeof m);
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::permission)) << text;
    EXPECT_TRUE(p.closed_by_server());
  }
  {
    SCOPED_TRACE("forged proof");
    RawPeer p(server.uri, true);
    struct {
      wire::FrameHeader h;
      std::uint8_t proof[wire::kAuthProofBytes];
    } m{wire::make_header(wire::Op::auth, 2, 0, wire::kAuthProofBytes), {9}};
    p.send(&m, sizeof m);
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::permission)) << text;
    EXPECT_TRUE(p.closed_by_server());
  }
  healthy.wait(healthy.pull(Key(1), out));
  EXPECT_EQ(out[0], 2.0f);
  std::ifstream in(log);
  const std::string logged((std::istreambuf_iterator<char>(in)), {});
  EXPECT_NE(logged.find("refused unauthenticated peer"), std::string::npos) << logged;
  EXPECT_NE(logged.find("it has no token"), std::string::npos) << logged;
  EXPECT_NE(logged.find("sent lookup before authenticating"), std::string::npos) << logged;
  EXPECT_NE(logged.find("failed the challenge"), std::string::npos) << logged;
  std::remove(log.c_str());
}

// Event-driven completions: an idle server with a connected idle client burns no CPU. Busy
// polling, when asked for, still serves correctly.
TEST(Rdma, IdleProcessesSleepAndBusyPollingWorks) {
  PSKV_REQUIRE_RDMA();
  auto server = start_rdma_server();
  {
    Client c(rdma_client({server.uri}));
    std::vector<float> v(16, 1.0f);
    c.wait(c.init(Key(1), v));
    c.wait(c.pull(Key(1), v));
    // Asleep on completion channels, not polling: sampled through /proc while nothing happens
    // (this thread, which samples, excepted).
    constexpr int kSamples = 400;
    const int server_asleep = testing::samples_all_threads_asleep(server.process.pid(), kSamples);
    const int me_asleep = testing::samples_all_threads_asleep(getpid(), kSamples, static_cast<pid_t>(::gettid()));
    EXPECT_GE(server_asleep, kSamples * 9 / 10)
        << "the idle server had a thread running in " << kSamples - server_asleep << " of " << kSamples << " looks";
    EXPECT_GE(me_asleep, kSamples * 9 / 10)
        << "the idle client had a thread running in " << kSamples - me_asleep << " of " << kSamples << " looks";
  }
  auto busy = start_rdma_server({"--rdma-busy-poll"});
  Client c(rdma_client({busy.uri + "?poll=busy"}));
  std::vector<float> v(300, 1.0f), out(300);
  c.wait(c.init(Key(7), v));
  for (int i = 0; i < 20; ++i) c.wait(c.push(Key(7), v));
  c.wait(c.pull(Key(7), out));
  EXPECT_EQ(out[299], 21.0f);
}

// rdma:// servers with --replicas 2 replicate to each other over verbs (their --uri in --peers),
// or over tcp (--peer-uri). A server SIGKILLed under load and restarted with --rejoin holds every
// push it acknowledged.
// Reconnecting worker: each key ends between the acknowledged pushes and those plus the ones
// that failed (without replicas the restarted server would start empty). Retrying worker
// (retry_timeout): it sees no error, and each key ends at exactly its acknowledged pushes: the
// marks in the restored records make a push sent again land once.
enum class Ring { verbs, tcp };

// Three rdma:// servers with --replicas 2, replicating over verbs (their --uri in --peers) or
// over tcp (--peer-uri), each started with `extra` arguments too.
struct RdmaRing {
  static constexpr int kServers = 3;
  RdmaRing(Ring ring, std::vector<std::string> extra) : ring(ring), extra(std::move(extra)) {
    for (int s = 0; s < kServers; ++s) {
      uris.push_back("rdma://" + rdma_ip() + ":" + std::to_string(tcp::free_loopback_port()));
      peer_uris.push_back("tcp://" + rdma_ip() + ":" + std::to_string(tcp::free_loopback_port()));
    }
    for (const auto& u : ring_uris()) peers += (peers.empty() ? "" : ",") + u;
    for (int s = 0; s < kServers; ++s) servers.push_back(start(s, false));
  }
  ServerProcess start(int s, bool rejoin) {
    std::vector<std::string> args{"--uri", uris[std::size_t(s)], "--peers",        peers, "--replicas",
                                  "2",     "--server-id",        std::to_string(s)};
    args.insert(args.end(), extra.begin(), extra.end());
    if (ring == Ring::tcp) args.insert(args.end(), {"--peer-uri", peer_uris[std::size_t(s)]});
    if (rejoin) args.push_back("--rejoin");
    return start_rdma_server(args);
  }
  // SIGKILLs server s and, a moment later, starts it again with --rejoin.
  void kill_and_rejoin(int s) {
    servers[std::size_t(s)].process.signal(SIGKILL);
    servers[std::size_t(s)].process.wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    servers[std::size_t(s)] = start(s, true);
  }
  // The addresses the servers replicate over (what a replica's copies are read from).
  const std::vector<std::string>& ring_uris() const { return ring == Ring::verbs ? uris : peer_uris; }
  Ring ring;
  std::vector<std::string> extra, uris, peer_uris;
  std::string peers;
  std::vector<ServerProcess> servers;
};

// What a worker saw while server 1 of a ring was killed and rejoined under it.
struct KillTally {
  std::uint64_t acked = 0, errors = 0;
  std::atomic<std::uint64_t> failed{0};  // read by the killer while the worker runs
  std::string last_error;
};

// A worker thread (worker 0 of `o`, retrying with `retrying`) runs `round` until stopped: it
// counts in *acked each push as it is acknowledged, and in *in_flight those that may or may not
// land if it throws. A client that fails is dropped and made again (with `setup`). Meanwhile server 1
// is SIGKILLed and restarted with --rejoin. A retrying worker must see no error, and the
// restarted server take its pushes; a reconnecting one must see a kill fail a push. A kill that
// falls between two of its rounds fails none (the next round finds the connection gone before
// it sends), so server 1 is killed again, once the ring is synced, up to three times.
void push_through_a_kill(KillTally& t, RdmaRing& servers, const ClientOptions& o, bool retrying,
                         const std::function<void(Client&)>& setup,
                         const std::function<void(Client&, std::uint64_t*, std::uint64_t*)>& round) {
  ClientOptions mine = o;
  mine.worker_id = 0;
  if (retrying) mine.retry_timeout = std::chrono::seconds(30);
  std::atomic<bool> stop{false};
  std::thread worker([&] {
    std::unique_ptr<Client> c;
    while (!stop.load()) {
      std::uint64_t in_flight = 0;
      try {
        if (!c) {
          c = std::make_unique<Client>(mine);
          setup(*c);
        }
        round(*c, &in_flight, &t.acked);
      } catch (const Error& e) {
        ++t.errors;
        t.failed += in_flight;
        t.last_error = e.what();
        c.reset();
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  for (int kill = 0; kill < (retrying ? 1 : 3) && t.failed.load() == 0; ++kill) {
    if (kill > 0) {
      try {  // (a throw here would leave the worker thread joinable)
        Client admin(o);
        testing::wait_replicas_synced(admin, 2);
      } catch (const Error& e) {
        ADD_FAILURE() << "the ring did not sync again after kill " << kill << ": " << e.what();
        break;
      }
    }
    servers.kill_and_rejoin(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(800));
  }
  stop.store(true);
  worker.join();
  EXPECT_GT(t.acked, 0u) << t.last_error;
  if (retrying) {
    EXPECT_EQ(t.errors, 0u) << "the retrying worker saw: " << t.last_error;
    // The same client went on through the restart: the restarted server took its pushes.
    Client check(o);
    EXPECT_GT(testing::stats_field(check.server_stats(1), "pushes"), 0) << check.server_stats(1);
  } else {
    EXPECT_GE(t.failed.load(), 1u) << "no kill failed a push: none landed under load";
  }
}

void replicated_kill(bool retrying, Ring ring) {
  RdmaRing servers(ring, {"--rule", "add", "--workers", "1"});
  constexpr Key kKeys = 12;
  constexpr std::size_t kLen = 256;
  ClientOptions o = rdma_client(servers.uris);
  o.io_timeout = std::chrono::seconds(5);
  {
    Client admin(o);
    const std::vector<float> zeros(kLen, 0.0f);
    for (Key k = 0; k < kKeys; ++k) admin.wait(admin.init(k, zeros));
    testing::wait_replicas_synced(admin, 2);
  }
  std::vector<Key> keys(kKeys);
  std::iota(keys.begin(), keys.end(), Key(0));
  const std::vector<float> ones(kLen, 1.0f);
  const std::vector<std::span<const float>> values(kKeys, ones);
  KillTally t;
  push_through_a_kill(
      t, servers, o, retrying, [](Client&) {},
      [&](Client& c, std::uint64_t* in_flight, std::uint64_t* acked) {
        // Two in flight: a retrying client sends a sequence again, in order.
        const Ticket a = c.push(keys, values);
        ++*in_flight;
        const Ticket b = c.push(keys, values);
        ++*in_flight;
        c.wait(a);
        --*in_flight;
        ++*acked;
        c.wait(b);
        --*in_flight;
        ++*acked;
      });
  Client check(o);
  testing::expect_pushes_between(check, kKeys, kLen, t.acked, t.failed.load(),
                                 retrying ? "retrying" : std::to_string(t.failed.load()) + " failed");
}

// rdma:// servers replicate embedding tables too, over verbs or over a tcp ring. A worker pushes
// rounds of rows (testing::RowTables: +1 to 300 rows, random rows of a capped Adam table), two
// pushes in flight; server 1 is SIGKILLed and restarted with --rejoin. Every counted row ends
// between the acknowledged rounds and those plus the failed ones (a retrying worker: no error,
// and exactly the acknowledged ones), and every copy equals its origin (rows, optimizer state,
// push marks), read as a rejoin reads it, over the ring's own transport.
void replicated_table_kill(bool retrying, Ring ring) {
  RdmaRing servers(ring, {"--workers", "1", "--table-memory-mb", "256"});
  const testing::RowTables tables;
  ClientOptions o = rdma_client(servers.uris);
  o.io_timeout = std::chrono::seconds(5);
  {
    Client admin(o);
    tables.create(admin);
    testing::wait_replicas_synced(admin, 2);
  }
  std::mt19937 rng(5);
  KillTally t;
  push_through_a_kill(
      t, servers, o, retrying, [&](Client& c) { tables.create(c); },
      [&](Client& c, std::uint64_t* in_flight, std::uint64_t* acked) {
        bool sent = false;  // the counted push may land once it is on its way
        try {
          tables.push_round(c, rng, &sent);
        } catch (...) {
          *in_flight = sent ? 1 : 0;
          throw;
        }
        ++*acked;
      });
  Client check(o);
  tables.expect_counted(check, t.acked, t.failed.load(),
                        retrying ? "retrying" : std::to_string(t.failed.load()) + " failed");
  testing::wait_replicas_synced(check, 2);
  testing::expect_table_copies_equal(servers.ring_uris(), 2, 0);
  testing::expect_table_copies_equal(servers.ring_uris(), 2, 1);
}

TEST(Rdma, ReplicatedTablesLoseNoAcknowledgedRow) {
  PSKV_REQUIRE_RDMA();
  replicated_table_kill(false, Ring::verbs);
}

TEST(Rdma, AWorkerThatRetriesPushesEachRowOnce) {
  PSKV_REQUIRE_RDMA();
  replicated_table_kill(true, Ring::verbs);
}

TEST(Rdma, AWorkerThatRetriesOverATcpRingPushesEachRowOnce) {
  PSKV_REQUIRE_RDMA();
  replicated_table_kill(true, Ring::tcp);
}

TEST(Rdma, ReplicatedServersLoseNoAcknowledgedPush) {
  PSKV_REQUIRE_RDMA();
  replicated_kill(false, Ring::verbs);
}

TEST(Rdma, AWorkerThatRetriesSeesNoErrorAndEveryPushLandsOnce) {
  PSKV_REQUIRE_RDMA();
  replicated_kill(true, Ring::verbs);
}

TEST(Rdma, ServersReplicatingOverTcpLoseNoAcknowledgedPush) {
  PSKV_REQUIRE_RDMA();
  replicated_kill(false, Ring::tcp);
}

TEST(Rdma, AWorkerThatRetriesOverATcpRingSeesNoError) {
  PSKV_REQUIRE_RDMA();
  replicated_kill(true, Ring::tcp);
}

// Over verbs as over tcp, only another server of a replicating ring may send the replication
// ops, and a server that does not replicate takes no server at all.
TEST(Rdma, OnlyServersMaySendTheReplicationOps) {
  PSKV_REQUIRE_RDMA();
  const std::string uri0 = "rdma://" + rdma_ip() + ":" + std::to_string(tcp::free_loopback_port());
  const std::string uri1 = "rdma://" + rdma_ip() + ":" + std::to_string(tcp::free_loopback_port());
  auto start = [&](int s) {
    return start_rdma_server({"--uri", s == 0 ? uri0 : uri1, "--peers", uri0 + "," + uri1, "--replicas", "2",
                              "--server-id", std::to_string(s), "--workers", "1"});
  };
  ServerProcess s0 = start(0), s1 = start(1);
  auto ask = [](const std::string& uri, std::uint32_t as, wire::Op op) {
    transport::ConnectOptions co;
    co.worker_id = as;
    co.connect_timeout = std::chrono::seconds(20);
    auto conn = transport::connect(parse_uri(uri), co);
    transport::Completion done;
    done.reset(1);
    transport::Request q;
    q.op = op;
    q.arg0 = 0;  // origin 0
    std::string text;
    q.text_out = &text;
    q.completion = &done;
    conn->submit(q);
    EXPECT_TRUE(done.wait(std::chrono::steady_clock::now() + std::chrono::seconds(20)));
    return std::make_pair(done.status(), std::string(done.message()));
  };
  // A client (anonymous or a worker) cannot submit them at all; a server peer can.
  for (std::uint32_t as : {kNoWorker, 0u}) {
    const auto [code, why] = ask(uri1, as, wire::Op::replica_index);
    EXPECT_EQ(code, Errc::unsupported) << why;
  }
  const auto [ok, why_ok] = ask(uri1, wire::kServerPeer, wire::Op::replica_index);
  EXPECT_EQ(ok, Errc::ok) << why_ok;
  // Table frames are written into the region as pushes are, and checked as table frames, never
  // applied as a push: a replica_table without its one key is refused by name.
  const auto [shape, why_shape] = ask(uri1, wire::kServerPeer, wire::Op::replica_table);
  EXPECT_EQ(shape, Errc::protocol) << why_shape;
  EXPECT_NE(why_shape.find("replica_table carries one key"), std::string::npos) << why_shape;
  // Sent raw by a peer that did not connect as a server: refused by the server, which closes it.
  {
    RawPeer p(uri1);
    const wire::FrameHeader h = wire::make_header(wire::Op::replica_clock, 1, 0, 0, 0, 5);
    p.send(&h, sizeof h);
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::permission)) << text;
    EXPECT_NE(text.find("only another server"), std::string::npos) << text;
    EXPECT_TRUE(p.closed_by_server());
  }
  {
    RawPeer p(uri1);
    const wire::FrameHeader h = wire::make_header(wire::Op::replicate, 2, 0, 0, 0, wire::kReplicaSynced);
    p.write_imm(&h, sizeof h, 0, 0);  // a client marking server 0's replica synced
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::permission)) << text;
    EXPECT_NE(text.find("only another server"), std::string::npos) << text;
    EXPECT_TRUE(p.closed_by_server());
  }
  // The failover frames travel as the replication frames do: a client's down_vote is refused as
  // any of them, a server's is refused by name by a ring run without --failover-ms, and anyone
  // may ask for certificates, which such a ring does not keep.
  {
    RawPeer p(uri1);
    const wire::FrameHeader h = wire::make_header(wire::Op::down_vote, 3, 0, 0);
    p.write_imm(&h, sizeof h, 0, 0);
    auto [status, text] = p.reply();
    EXPECT_EQ(status, int(Errc::permission)) << text;
    EXPECT_TRUE(p.closed_by_server());
  }
  const auto [vote, why_vote] = ask(uri1, wire::kServerPeer, wire::Op::down_vote);
  EXPECT_EQ(vote, Errc::unsupported) << why_vote;
  EXPECT_NE(why_vote.find("without --failover-ms"), std::string::npos) << why_vote;
  for (std::uint32_t as : {kNoWorker, 0u}) {
    const auto [certificates, why_certificates] = ask(uri1, as, wire::Op::certificates);
    EXPECT_EQ(certificates, Errc::unsupported) << why_certificates;
    EXPECT_NE(why_certificates.find("without --failover-ms"), std::string::npos) << why_certificates;
  }
  // A server that does not replicate refuses a server's connection outright.
  auto lone = start_rdma_server({});
  try {
    ask(lone.uri, wire::kServerPeer, wire::Op::stats);
    ADD_FAILURE() << "a server that does not replicate took a server peer";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::permission) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not replicate"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pskv
