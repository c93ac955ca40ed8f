// Adversarial tests of pskv-server's tcp:// endpoint (ctest label `adversarial`, issue 21).
//
// Each test starts a pskv-server, a healthy pskv::Client on 127.0.0.1 that pushes +1 to its own
// key and pulls it back in a loop, then runs pskv-attack (from 127.0.0.2) for a few seconds.
// Asserted for every attack (TcpAttack::attack):
//   - the server process is alive afterwards;
//   - every value the healthy client pulled, and the final one, is exactly the number of its
//     pushes, and none of its operations failed (its io_timeout, 10 s, bounds a stall);
//   - it completed operations in the second half of the attack, once the attack was in force;
//   - a new client on 127.0.0.1 connects and is served in the middle of the attack;
//   - the server's peak RSS (VmHWM) grew by at most --memory-budget-mb plus kAllowanceKib over
//     its peak before the attack;
//   - the attacker ran (it connected and printed its summary).
// Then each test checks what the server did to the attacker (refused, closed, never accepted),
// from the attacker's JSON summary and the server's stderr. Latency is never asserted: timings
// under attack are benchmark figures (README.md).
//
// The server runs with short deadlines (--frame-timeout-ms 1000 --handshake-timeout-ms 1000) so
// the label stays short, and with a 64 MiB memory budget and request limit so the RSS bound is
// tight.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "pskv/client.h"
#include "support/process.h"
#include "support/stats.h"
#include "support/token_file.h"

#ifndef PSKV_ATTACK_BIN
#error "PSKV_ATTACK_BIN must name the pskv-attack binary"
#endif

namespace pskv {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using testing::Process;
using testing::read_file;
using testing::ServerProcess;
using testing::stats_field;  // the attacker's summary is flat JSON too
using testing::TokenFile;

constexpr std::uint64_t kBudgetMb = 64;
// What a server may add to its peak RSS beyond the memory budget during an attack: thread
// stacks, allocator slack and per-connection bookkeeping that the budget (frame buffers and
// queued replies) does not cover.
constexpr long kAllowanceKib = 32 * 1024;
constexpr Key kHealthyKey = 1;
constexpr std::size_t kHealthyFloats = 64;
// A real 4 MiB key for the attacks that need one (pulls of it, duplicates of it).
constexpr Key kBait = 0xBA17;
constexpr std::uint32_t kBaitFloats = 1u << 20;
const char* const kAttackerAddress = "127.0.0.2";

std::string tail(const std::string& s, std::size_t n = 3000) {
  return s.size() <= n ? s : s.substr(s.size() - n);
}

// What the attacker recorded for one case ("error+close|close"); empty when missing.
std::string outcome(const std::string& json, const std::string& name) {
  const std::string at = "\"" + name + "\":\"";
  const auto p = json.find(at);
  if (p == std::string::npos) return {};
  const auto begin = p + at.size();
  return json.substr(begin, json.find('"', begin) - begin);
}

std::set<std::string> split(const std::string& s) {
  std::set<std::string> out;
  std::size_t begin = 0;
  while (begin <= s.size() && !s.empty()) {
    const auto bar = s.find('|', begin);
    out.insert(s.substr(begin, bar == std::string::npos ? std::string::npos : bar - begin));
    if (bar == std::string::npos) break;
    begin = bar + 1;
  }
  return out;
}

// A well-behaved client using the server throughout an attack: pushes +1 to its own key and
// pulls it back, checking that every float equals the number of its pushes so far. Nobody else
// writes the key, so any other value means a push was lost, doubled or torn, or someone else's
// (an attacker's truncated frame) got applied.
// Thread-safety: start() and stop() from the owning thread; ops(), pushes() and error() from any.
class HealthyClient {
 public:
  explicit HealthyClient(const ClientOptions& o) : client_(o) {
    client_.wait(client_.init(kHealthyKey, std::vector<float>(kHealthyFloats, 0.0f)));
  }
  ~HealthyClient() { stop(); }
  void start() {
    thread_ = std::thread([this] { loop(); });
  }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::uint64_t ops() const { return ops_.load(); }
  std::uint64_t pushes() const { return pushes_.load(); }
  std::string error() const {
    std::lock_guard lock(mu_);
    return error_;
  }
  Client& client() { return client_; }

 private:
  void loop() {
    const std::vector<float> one(kHealthyFloats, 1.0f);
    std::vector<float> out(kHealthyFloats);
    try {
      while (!stop_) {
        client_.wait(client_.push(kHealthyKey, one));
        const float expect = static_cast<float>(++pushes_);
        ++ops_;
        client_.wait(client_.pull(kHealthyKey, out));
        ++ops_;
        for (std::size_t i = 0; i < out.size(); ++i)
          if (out[i] != expect) {
            fail("after " + std::to_string(pushes_.load()) + " pushes of +1 float " + std::to_string(i) + " holds " +
                 std::to_string(out[i]));
            return;
          }
      }
    } catch (const std::exception& e) {
      fail(std::string("operation failed after ") + std::to_string(ops_.load()) + " ops: " + e.what());
    }
  }
  void fail(const std::string& why) {
    std::lock_guard lock(mu_);
    error_ = why;
  }

  Client client_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> ops_{0}, pushes_{0};
  mutable std::mutex mu_;
  std::string error_;
};

struct Attack {
  std::string kind;
  int connections;
  double seconds = 4;
  std::vector<std::string> args = {};  // beyond the common ones
  bool attacker_uses_token = false;
};

class TcpAttack : public ::testing::Test {
 protected:
  void TearDown() override {
    healthy_.reset();
    std::filesystem::remove(log_);
  }

  // Starts the server, the bait key and the healthy client, and records the server's peak RSS
  // once the client is running.
  // `flags`: beyond the common ones.
  void start(bool token = false, const std::vector<std::string>& flags = {}) {
    const bool threads_given = std::find(flags.begin(), flags.end(), "--io-threads") != flags.end();
    std::vector<std::string> args{"--uri", "tcp://127.0.0.1:0"};
    if (!threads_given) args.insert(args.end(), {"--io-threads", "2"});
    args.insert(args.end(), {"--frame-timeout-ms", "1000", "--handshake-timeout-ms", "1000", "--memory-budget-mb",
                             std::to_string(kBudgetMb), "--max-request-mb", std::to_string(kBudgetMb)});
    if (token) args.insert(args.end(), {"--auth-token-file", token_file_.path});
    args.insert(args.end(), flags.begin(), flags.end());
    try {
      server_ = ServerProcess::start(args, log_);
    } catch (const std::exception& e) {
      FAIL() << e.what() << "; its stderr:\n" << tail(read_file(log_));
    }
    o_.servers = {server_.uri};
    o_.io_timeout = std::chrono::seconds(10);
    o_.connect_timeout = std::chrono::seconds(5);
    if (token) o_.auth_token_file = token_file_.path;
    {
      Client admin(o_);
      admin.wait(admin.init(kBait, std::vector<float>(kBaitFloats, 0.0f)));
    }
    healthy_ = std::make_unique<HealthyClient>(o_);
    healthy_->start();
    const auto give_up = Clock::now() + std::chrono::seconds(10);
    while (healthy_->ops() < 20 && healthy_->error().empty() && Clock::now() < give_up)
      std::this_thread::sleep_for(milliseconds(5));
    ASSERT_GE(healthy_->ops(), 20u) << "the healthy client did not get going: " << healthy_->error();
    baseline_kib_ = testing::peak_rss_kib(server_.process.pid());
    ASSERT_GT(baseline_kib_, 0);
  }

  // Runs the attack while the healthy client works, checks everything every attack must leave
  // intact (see the file comment) and returns the attacker's summary.
  std::string attack(const Attack& a) {
    std::vector<std::string> args{"--uri",
                                  server_.uri,
                                  "--attack",
                                  a.kind,
                                  "--connections",
                                  std::to_string(a.connections),
                                  "--seconds",
                                  std::to_string(a.seconds),
                                  "--source-address",
                                  kAttackerAddress,
                                  "--key",
                                  std::to_string(kBait),
                                  "--key-floats",
                                  std::to_string(kBaitFloats),
                                  "--hold-ms",
                                  "10000"};
    if (a.attacker_uses_token) args.insert(args.end(), {"--auth-token-file", token_file_.path});
    args.insert(args.end(), a.args.begin(), a.args.end());
    const auto t0 = Clock::now();
    const std::uint64_t ops_start = healthy_->ops();
    Process attacker(PSKV_ATTACK_BIN, args);

    // Progress is counted from the middle of the attack, when its connections are in place,
    // to the moment it reports (it holds its sockets open until we stop it). An attack bounded
    // by count (truncation) can be over before its middle on a quiet host: then progress is
    // counted over the whole attack instead. The new client arrives in the middle too, on its
    // own thread: a stalled server must not delay the count.
    const auto mid = t0 + milliseconds(static_cast<long>(a.seconds * 500));
    std::string summary =
        attacker.read_line(std::chrono::duration_cast<milliseconds>(std::max(mid - Clock::now(), Clock::duration{1})));
    const bool over_early = !summary.empty();
    const std::uint64_t ops_mid = over_early ? ops_start : healthy_->ops();
    std::string probe_failure;
    std::thread probe([&] { probe_failure = probe_new_client(); });
    if (!over_early) summary = attacker.read_line(milliseconds(static_cast<long>(a.seconds * 1000) + 40000));
    const std::uint64_t ops_end = healthy_->ops();
    probe.join();
    attacker.signal(SIGTERM);
    const int rc = attacker.wait(std::chrono::seconds(20));
    EXPECT_EQ(probe_failure, "") << "a new client on 127.0.0.1 was refused or not served during " << a.kind;

    EXPECT_FALSE(summary.empty()) << "the attacker printed no summary (exit " << rc << ")";
    EXPECT_TRUE(rc == 0 || rc == 128 + SIGTERM) << "attacker exit " << rc << "; summary " << summary;
    EXPECT_GT(stats_field(summary, "connections"), 0) << "the attack never connected: " << summary;

    const bool alive = server_.process.running();
    EXPECT_TRUE(alive) << "the server died under " << a.kind << "; its stderr ends:\n" << tail(read_file(log_));
    EXPECT_GT(ops_end, ops_mid) << "the healthy client completed no operation in the second half of the " << a.kind
                                << " attack (stalled); " << summary;
    healthy_->stop();
    EXPECT_EQ(healthy_->error(), "") << "under " << a.kind;
    if (alive) {
      try {
        std::vector<float> out(kHealthyFloats);
        healthy_->client().wait(healthy_->client().pull(kHealthyKey, out));
        EXPECT_EQ(out, std::vector<float>(kHealthyFloats, static_cast<float>(healthy_->pushes())))
            << "the healthy key is not the sum of the healthy client's pushes";
      } catch (const std::exception& e) {
        ADD_FAILURE() << "the healthy client's final pull failed: " << e.what();
      }
      const long peak = testing::peak_rss_kib(server_.process.pid());
      EXPECT_LE(peak - baseline_kib_, static_cast<long>(kBudgetMb * 1024) + kAllowanceKib)
          << "server peak RSS went from " << baseline_kib_ << " KiB to " << peak << " KiB under " << a.kind
          << " (budget " << kBudgetMb << " MiB + " << kAllowanceKib / 1024 << " MiB allowance)";
    }
    std::printf("%s: healthy ops %llu (second half %llu), summary %s\n", a.kind.c_str(),
                static_cast<unsigned long long>(ops_end), static_cast<unsigned long long>(ops_end - ops_mid),
                summary.c_str());
    return summary;
  }

  // A client that arrives in the middle of the attack is let in and served. Returns what went
  // wrong, empty if nothing.
  std::string probe_new_client() {
    try {
      Client fresh(o_);
      std::vector<float> out(kHealthyFloats);
      fresh.wait(fresh.pull(kHealthyKey, out));
      return {};
    } catch (const std::exception& e) {
      return e.what();
    }
  }

  // The server logged the attack: a line that names the attacker's address and one of the
  // reasons the server gives for it (the design: every refusal, close and limit hit is logged
  // with the peer's address and the reason). Closes are logged just after the socket is shut,
  // so the line may trail the attacker's summary a little.
  void expect_logged(std::initializer_list<const char*> reasons) {
    const std::string address = std::string(kAttackerAddress) + ":";
    std::string log;
    for (int i = 0; i < 100; ++i) {
      log = read_file(log_);
      std::size_t begin = 0;
      while (begin < log.size()) {
        const std::size_t end = std::min(log.find('\n', begin), log.size());
        const std::string_view line(log.data() + begin, end - begin);
        if (line.find(address) != std::string_view::npos)
          for (const char* why : reasons)
            if (line.find(why) != std::string_view::npos) return;
        begin = end + 1;
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    std::string wanted;
    for (const char* why : reasons) wanted += std::string(wanted.empty() ? "" : " or ") + "'" + why + "'";
    ADD_FAILURE() << "no server log line names the attacker's address with " << wanted << "; stderr ends:\n"
                  << tail(log);
  }

  int server_fds() const {
    int n = 0;
    for ([[maybe_unused]] const auto& e :
         std::filesystem::directory_iterator("/proc/" + std::to_string(server_.process.pid()) + "/fd"))
      ++n;
    return n;
  }

  TokenFile token_file_{"adversarial tests' shared secret, 42 bytes"};
  std::string log_ = "/tmp/pskv-adversarial-" + std::to_string(::getpid()) + ".log";
  ServerProcess server_;
  ClientOptions o_;
  std::unique_ptr<HealthyClient> healthy_;
  long baseline_kib_ = 0;
};

// --- issue 21, item 1: tiny requests that imply huge replies ---------------------------------

// 112 bytes declaring four values of 2^32-1 floats (64 GiB of reply). Each is answered with an
// error from the server's own records and the connection stays usable.
TEST_F(TcpAttack, HugePullLengthsAreRefusedFromTheServersRecords) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"huge-pull-lengths", 4});
  EXPECT_EQ(stats_field(s, "accepted"), 0) << s;
  EXPECT_GT(stats_field(s, "replies_error"), 0) << s;
  EXPECT_EQ(stats_field(s, "closed_by_server"), 0) << "an unknown key or wrong length keeps the connection: " << s;
}

// One real 4 MiB key listed 16,384 times (64 GiB implied) is refused, never allocated; a pull
// listing it 4 times (mixed in) is served with every occurrence.
TEST_F(TcpAttack, RepeatedKeyPullIsRefusedAndDuplicatesWithinLimitsAreServed) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"repeated-key-pull", 2, 4, {"--repeat", "16384"}});
  EXPECT_EQ(stats_field(s, "accepted"), 0) << s;
  EXPECT_GT(stats_field(s, "replies_error"), 0) << s;
  EXPECT_GT(stats_field(s, "expected_ok"), 0) << "no pull of 4 duplicates was served: " << s;
  EXPECT_EQ(stats_field(s, "expected_bad"), 0) << "a pull of 4 duplicates was refused or answered short: " << s;
  expect_logged({"over --max-request-mb"});
}

// Embedding-table ops that no client of this build sends (a table id past 63, a spec without a
// dimension or past --table-memory-mb, rows claiming 2^32-1 floats, pushes of the wrong dimension
// or to no table) are each refused and the connection served on; valid pushes of ever-new ids
// fill the table only to its cap, so the server's memory stays inside its budgets.
TEST_F(TcpAttack, TableOpsBeyondTheirLimitsAreRefusedAndTablesStayWithinTheirCap) {
  ASSERT_NO_FATAL_FAILURE(start(false, {"--table-memory-mb", "16"}));
  const std::string s = attack({"table-abuse", 2});
  EXPECT_EQ(stats_field(s, "accepted"), 0) << s;
  EXPECT_GT(stats_field(s, "replies_error"), 0) << s;
  EXPECT_GT(stats_field(s, "expected_ok"), 0) << "no valid push of new rows was taken: " << s;
  EXPECT_EQ(stats_field(s, "expected_bad"), 0) << s;
  EXPECT_EQ(stats_field(s, "closed_by_server"), 0) << "a refused table op keeps the connection: " << s;
  Client admin(o_);
  const std::string stats = admin.server_stats(0);
  EXPECT_NE(stats.find("\"table_1_rows\":20000"), std::string::npos) << "the table filled to its cap: " << stats;
}

// --- item 2: slow senders ------------------------------------------------------------------

// A header announcing 1 MiB before hello, then a byte every 1-2 s: refused after its header
// (nothing larger than a hello before the handshake), or closed at the frame deadline.
TEST_F(TcpAttack, SlowLargeFrameBeforeHelloIsClosed) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"slowloris-large", 4, 5});
  EXPECT_GT(stats_field(s, "closed_by_server"), 0) << s;
  expect_logged({"before hello"});
}

TEST_F(TcpAttack, SlowLargeFrameBeforeHelloIsClosedOnATokenServer) {
  ASSERT_NO_FATAL_FAILURE(start(/*token=*/true));
  const std::string s = attack({"slowloris-large", 4, 5});
  EXPECT_GT(stats_field(s, "closed_by_server"), 0) << s;
  expect_logged({"before hello"});
}

// Half a header and silence: the handshake deadline closes it (issue item 4: nothing timed out
// a half-sent small frame).
TEST_F(TcpAttack, HalfAHeaderBeforeHelloIsClosedAtTheHandshakeDeadline) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"slowloris-small", 8, 5});
  EXPECT_GT(stats_field(s, "closed_by_server"), 0) << "no half-sent header was ever closed: " << s;
  expect_logged({"did not finish hello"});
}

// After hello: a large push trickled byte by byte, and half a header then silence. The frame
// deadline counts from a frame's first byte, whatever its size.
TEST_F(TcpAttack, SlowFramesAfterHelloAreClosedAtTheFrameDeadline) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"slowloris-after-hello", 4, 5});
  EXPECT_GT(stats_field(s, "closed_by_server"), 0) << s;
  expect_logged({"did not send the rest of a frame"});
}

// --- item 3: peers that never read --------------------------------------------------------

// 8 connections pipelining pulls of a 4 MiB key (half of them from the store) and reading
// nothing: each holds about one reply, is no longer read, and is closed at the frame deadline.
TEST_F(TcpAttack, PeersThatNeverReadHoldUpNobody) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"non-reader", 8});
  EXPECT_GT(stats_field(s, "frames_sent"), 0) << s;
  EXPECT_GT(stats_field(s, "closed_by_server"), 0) << "no non-reading peer was closed at the frame deadline: " << s;
  expect_logged({"did not read its reply"});
}

// --- item 4: idle connections and connection floods ----------------------------------------

// 150 idle connections against --max-connections 64 (the per-address cap above it): the table
// fills, yet a client with the token still gets in (the oldest connection without a handshake
// makes room), and the idle ones are closed at the handshake deadline.
TEST_F(TcpAttack, IdleFloodDoesNotLockOutClientsWithTheToken) {
  ASSERT_NO_FATAL_FAILURE(start(/*token=*/true, {"--max-connections", "64", "--max-connections-per-address", "1000"}));
  const std::string s = attack({"idle-flood", 150, 5});
  EXPECT_GT(stats_field(s, "closed_by_server"), 0) << s;
  expect_logged({"did not finish hello", "made room for a new connection"});
}

// 40 idle connections from one address with --max-connections-per-address 16: the rest are
// refused with `capacity`; other addresses are not affected.
TEST_F(TcpAttack, PerAddressCapRefusesTheFloodingAddressOnly) {
  ASSERT_NO_FATAL_FAILURE(start(/*token=*/false, std::vector<std::string>{"--max-connections-per-address", "16"}));
  const std::string s = attack({"idle-flood", 40});
  EXPECT_GT(stats_field(s, "refused_capacity"), 0) << "nothing from the flooding address was refused: " << s;
  expect_logged({"--max-connections-per-address"});
}

// Connections opened and dropped as fast as possible (FIN, RST, after hello): the server
// keeps no descriptor of any of them once they are gone.
TEST_F(TcpAttack, ConnectFloodLeavesNoDescriptorsBehind) {
  ASSERT_NO_FATAL_FAILURE(start());
  const int fds_before = server_fds();
  const std::string s = attack({"connect-flood", 4, 10, {"--count", "1000"}});
  EXPECT_GE(stats_field(s, "connections"), 1000) << s;
  // The server notices the last closes asynchronously: bounded wait.
  int fds_after = server_fds();
  for (int i = 0; i < 100 && fds_after > fds_before + 2; ++i) {
    std::this_thread::sleep_for(milliseconds(50));
    fds_after = server_fds();
  }
  EXPECT_LE(fds_after, fds_before + 2) << "descriptors before " << fds_before << ", after " << fds_after;
}

// Two peers streaming pushes to a missing key at loopback rate, one per I/O thread: legal bytes
// that are read and dropped as fast as they come. Each thread gives such a connection back after
// a turn's worth (kTurnBytes), so the healthy client is still served.
TEST_F(TcpAttack, FastStreamersShareTheThreadsWithEveryoneElse) {
  ASSERT_NO_FATAL_FAILURE(start(/*token=*/false, {"--io-threads", "1"}));
  const std::string s = attack({"fast-streamer", 2, 4, {"--frame-mb", "32"}});
  EXPECT_GT(stats_field(s, "replies_error"), 0) << "no streamed push was answered: " << s;
  EXPECT_EQ(stats_field(s, "closed_by_server"), 0) << "pushes to a missing key keep the connection: " << s;
  // How much the healthy client got done is a rate, which tests do not assert (on this VM: 64-260
  // operations in the attack's second half without the turn limit, 7,000-9,000 with it); that
  // the server handed the streaming connections back is the mechanism, and is asserted.
  const std::string stats = healthy_->client().server_stats(0);
  EXPECT_GT(testing::stats_field(stats, "tcp_turns_yielded"), 0) << stats;
}

// A worker parking pull after pull, each with a 16,384-entry key table (256 KiB kept while it
// waits) and every other one at a clock it never announced: the impossible ones are refused at
// once, and what the parked ones keep draws on the memory budget, so the flood ends in
// `capacity` refusals, not in memory.
TEST_F(TcpAttack, ParkedPullsDrawOnTheBudgetAndImpossibleClocksAreRefused) {
  ASSERT_NO_FATAL_FAILURE(start(/*token=*/false, {"--workers", "2", "--mode", "bsp", "--wait-timeout-ms", "60000"}));
  const std::string s = attack({"parked-flood", 4, 4, {"--repeat", "16384"}});
  EXPECT_GT(stats_field(s, "replies_error"), 0) << s;
  EXPECT_GT(stats_field(s, "refused_capacity"), 0) << "parked pulls never hit the memory budget: " << s;
  expect_logged({"parked pull"});
}

// --- item 5: large frames before authentication --------------------------------------------

// 48 MiB pushes from peers without the token, before hello and after hello (challenged): each
// refused after its header; no frame is read to its end and memory stays within the budget.
TEST_F(TcpAttack, LargeFramesBeforeAuthenticationAreRefusedAfterTheirHeader) {
  ASSERT_NO_FATAL_FAILURE(start(/*token=*/true));
  const std::string s = attack({"unauth-large", 4, 4, {"--frame-mb", "48"}});
  EXPECT_EQ(stats_field(s, "accepted"), 0) << s;
  EXPECT_EQ(stats_field(s, "full_frames"), 0)
      << "the server read a whole 48 MiB frame from an unauthenticated peer: " << s;
  expect_logged({"before hello", "before authenticating"});
}

TEST_F(TcpAttack, LargeFramesBeforeHelloAreRefusedAfterTheirHeader) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"unauth-large", 4, 4, {"--frame-mb", "48"}});
  EXPECT_EQ(stats_field(s, "full_frames"), 0) << "the server read a whole 48 MiB frame before hello: " << s;
  expect_logged({"before hello"});
}

// A captured proof replayed with the same nonce, the server's own proofs reflected, a proof
// without hello: every one refused.
TEST_F(TcpAttack, ReplayedAndReflectedProofsAreRefused) {
  ASSERT_NO_FATAL_FAILURE(start(/*token=*/true));
  const std::string s = attack({"replayed-proof", 4, 3, {}, true});
  EXPECT_EQ(stats_field(s, "accepted"), 0) << s;
  for (const char* how :
       {"same-nonce-old-proof", "reflected-old-server-proof", "proof-without-hello", "reflected-own-server-proof"}) {
    const auto seen = split(outcome(s, how));
    EXPECT_FALSE(seen.empty()) << how << " was never tried: " << s;
    EXPECT_FALSE(seen.count("ok") || seen.count("silent")) << how << ": " << outcome(s, how);
  }
  expect_logged({"refused unauthenticated peer"});
}

// --- item 8 and beyond: malformed input ----------------------------------------------------

TEST_F(TcpAttack, RandomBytesAndRandomHeadersAreSurvived) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"random-bytes", 4, 4, {"--seed", "21"}});
  EXPECT_GT(stats_field(s, "frames_sent"), 100) << s;
  expect_logged({"tcp.bad-frame", "tcp.refused"});
}

// Each header field malformed in turn. A bad header gets an error reply and a close when its
// magic was right, a close otherwise; before hello, a frame larger than a hello may be closed
// without a reply; bad key tables and a wrong checksum get an error. None is served, none is
// left hanging.
TEST_F(TcpAttack, EachMalformedHeaderFieldIsRefused) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"bad-header-fields", 8, 3});
  EXPECT_EQ(stats_field(s, "accepted"), 0) << s;
  EXPECT_EQ(stats_field(s, "silent"), 0) << s;
  const std::set<std::string> error_close{"error+close"}, close_any{"close", "error+close"},
      any_error{"error+close", "error+open"};
  const std::vector<std::pair<const char*, const std::set<std::string>*>> cases{
      {"magic-before-hello", &close_any},
      {"magic", &close_any},
      {"version", &error_close},
      {"op-zero", &error_close},
      {"op-unknown", &error_close},
      {"op-ffff", &error_close},
      {"flags-response", &error_close},
      {"flags-all", &error_close},
      {"num-keys-over-limit", &error_close},
      {"num-keys-max", &error_close},
      {"payload-over-limit", &error_close},
      {"payload-2^63", &error_close},
      {"payload-not-whole-floats", &error_close},
      {"pull-with-payload", &error_close},
      {"hello-with-64-byte-payload", &close_any},
      {"payload-mismatch", &any_error},
      {"zero-length-key", &any_error},
      {"checksum-wrong", &any_error}};
  for (const auto& [name, allowed] : cases) {
    const auto seen = split(outcome(s, name));
    EXPECT_FALSE(seen.empty()) << name << " was never tried: " << s;
    for (const auto& o : seen) EXPECT_TRUE(allowed->count(o)) << name << ": " << o;
  }
  expect_logged({"tcp.bad-frame"});
}

// Hello, a push to the healthy client's own key and a pull, each cut at every byte and closed or
// half-closed: nothing of a cut push is applied (the healthy values stay exact), and the server
// closes every half-closed connection.
TEST_F(TcpAttack, FramesCutAtEveryByteApplyNothingAndAreClosed) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack(
      {"truncation", 4, 3, {"--key", std::to_string(kHealthyKey), "--key-floats", std::to_string(kHealthyFloats)}});
  EXPECT_GE(stats_field(s, "cuts"), double(48 + (48 + 16 + 4 * kHealthyFloats) + (48 + 16)))
      << "not every cut was made: " << s;
  EXPECT_EQ(stats_field(s, "silent"), 0) << "a half-closed connection was left open: " << s;
}

// Every form of second hello was tried, and neither it nor the pull after it was left hanging.
void expect_second_hello_answered(const std::string& s) {
  EXPECT_EQ(stats_field(s, "silent"), 0) << s;
  for (const char* how : {"same", "worker-0", "worker-huge", "with-nonce", "version-2"}) {
    const auto seen = split(outcome(s, how));
    EXPECT_FALSE(seen.empty()) << how << " was never tried: " << s;
    for (const auto& o : seen) EXPECT_EQ(o.find("silent"), std::string::npos) << how << ": " << o;
  }
}

// A second hello on an admitted connection, in five forms; whatever the server answers, it
// answers (or closes), and goes on serving everyone.
TEST_F(TcpAttack, SecondHelloIsAnsweredOrClosed) {
  ASSERT_NO_FATAL_FAILURE(start());
  expect_second_hello_answered(attack({"second-hello", 2, 3}));
}

TEST_F(TcpAttack, SecondHelloIsAnsweredOrClosedOnATokenServer) {
  ASSERT_NO_FATAL_FAILURE(start(/*token=*/true));
  expect_second_hello_answered(attack({"second-hello", 2, 3, {}, true}));
}

// --- memory budget -------------------------------------------------------------------------

// 8 authenticated connections sending checksummed 48 MiB pushes at once (a checksummed frame
// must be held whole): what does not fit --memory-budget-mb is answered `capacity` after its
// payload was drained, and the connection stays open.
TEST_F(TcpAttack, MemoryBudgetBoundsBufferedFramesAndKeepsConnections) {
  ASSERT_NO_FATAL_FAILURE(start());
  const std::string s = attack({"budget-flood", 8, 4, {"--frame-mb", "48"}});
  EXPECT_GT(stats_field(s, "replies_ok") + stats_field(s, "refused_capacity"), 0) << s;
  EXPECT_EQ(stats_field(s, "closed_by_server"), 0) << "a push over the budget closed its connection: " << s;
  if (stats_field(s, "refused_capacity") > 0) expect_logged({"does not fit the memory budget"});
}

// --- what the deadlines must not do --------------------------------------------------------

// A worker that has finished its handshake may be silent for longer than every deadline and is
// still served afterwards: idleness alone never closes a connection.
TEST_F(TcpAttack, AnAuthenticatedIdleWorkerOutlivesTheDeadlines) {
  ASSERT_NO_FATAL_FAILURE(start(/*token=*/true));
  Client idle(o_);
  std::vector<float> out(kHealthyFloats);
  idle.wait(idle.pull(kHealthyKey, out));
  // The condition under test is the silence itself: longer than the handshake and the frame
  // deadline together (1 s each), with margin.
  std::this_thread::sleep_for(milliseconds(3500));
  try {
    idle.wait(idle.push(kBait, std::vector<float>(kBaitFloats, 0.0f)));
    idle.wait(idle.pull(kHealthyKey, out));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "an idle authenticated connection was dropped: " << e.what();
  }
  healthy_->stop();
  EXPECT_EQ(healthy_->error(), "");
  EXPECT_TRUE(server_.process.running());
}

}  // namespace
}  // namespace pskv
