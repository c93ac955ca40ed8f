// ClientOptions::retry_timeout: a client whose server's connection fails reconnects and sends
// what was unanswered again instead of failing it, and gives up, with a clear error, only once
// the server has stayed away for the whole timeout. (That a retried push lands once is proved
// against replicated servers, in tests/replication/tcp_replication_test.cc.)
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include "pskv/client.h"
#include "pskv/server.h"
#include "support/errors.h"
#include "transport/tcp/socket.h"

namespace pskv {
namespace {

using namespace std::chrono_literals;

ServerOptions server_at(const std::string& uri) {
  ServerOptions so;
  so.uri = uri;
  so.num_workers = 1;
  so.arena_bytes = 4 << 20;
  so.io_threads = 1;
  return so;
}

std::string free_uri() {
  return "tcp://127.0.0.1:" + std::to_string(tcp::free_loopback_port());
}

// Two SSP workers: worker 0's goodbye shows in the stats as clock -1 beside worker 1's 0.
ServerOptions two_workers_at(const std::string& uri) {
  ServerOptions so = server_at(uri);
  so.num_workers = 2;
  so.mode = ConsistencyMode::ssp;
  return so;
}

// The goodbye is sent within its bound; the server may still be reading it, so this looks again.
void expect_worker_0_finished(const std::string& uri) {
  ClientOptions admin;
  admin.servers = {uri};
  Client a(admin);
  const auto give_up = std::chrono::steady_clock::now() + 10s;
  std::string stats;
  while ((stats = a.server_stats(0)).find("\"clocks_by_worker\":[-1,0]") == std::string::npos &&
         std::chrono::steady_clock::now() < give_up)
    std::this_thread::sleep_for(20ms);
  EXPECT_NE(stats.find("\"clocks_by_worker\":[-1,0]"), std::string::npos) << stats;
}

// Both are refused before anything is connected.
TEST(Retry, NeedsAWorkerIdAndTcpServers) {
  ClientOptions o;
  o.servers = {"tcp://127.0.0.1:1"};
  o.retry_timeout = 1s;
  testing::expect_error([&] { Client c(o); }, Errc::invalid_argument, {"worker_id"});
  o.servers = {"shm://retry-is-for-tcp"};
  o.worker_id = 0;
  testing::expect_error([&] { Client c(o); }, Errc::invalid_argument, {"tcp", "shm://retry-is-for-tcp"});
}

// The server goes away and another comes up at its address: the pull in flight then is answered
// by the new one, and the new one learns this worker's clock before anything else.
TEST(Retry, ARestartedServerAnswersWhatItsPredecessorLeftUnanswered) {
  const std::string uri = free_uri();
  std::optional<Server> server(std::in_place, server_at(uri));
  ClientOptions o;
  o.servers = {uri};
  o.worker_id = 0;
  o.retry_timeout = 20s;
  Client c(o);
  std::vector<float> value(8, 1.0f), out(8);
  c.wait(c.init(1, value));
  c.clock();
  c.clock();
  server.reset();
  const Ticket pull = c.pull(1, out);  // fails on the closed connection, and is sent again
  server.emplace(server_at(uri));
  {
    ClientOptions admin;
    admin.servers = {uri};
    Client a(admin);
    std::vector<float> restored(8, 5.0f);
    a.wait(a.init(1, restored));
  }
  c.wait(pull);
  EXPECT_EQ(out, std::vector<float>(8, 5.0f));
  EXPECT_NE(c.server_stats(0).find("\"clocks_by_worker\":[2]"), std::string::npos) << c.server_stats(0);
}

// A server that writes its final checkpoint when stopped and restarts from it, so that a request
// sent again after the restart finds its key whichever reaches the new server first.
class RestartableServer {
 public:
  explicit RestartableServer(const std::string& uri)
      : dir_(::testing::TempDir() + "pskv-retry-" + std::to_string(::getpid()) + "-" + std::to_string(++count_)),
        options_(server_at(uri)) {
    std::filesystem::create_directories(dir_);
    options_.checkpoint_dir = dir_;
    server_.emplace(options_);
  }
  ~RestartableServer() {
    server_.reset();
    std::filesystem::remove_all(dir_);
  }
  void stop() { server_.reset(); }
  void restart() {
    options_.restore_dir = dir_;
    server_.emplace(options_);
  }

 private:
  static inline int count_ = 0;
  std::string dir_;
  ServerOptions options_;
  std::optional<Server> server_;
};

ClientOptions retrying_worker(const std::string& uri, std::chrono::milliseconds retry_timeout) {
  ClientOptions o;
  o.servers = {uri};
  o.worker_id = 0;
  o.retry_timeout = retry_timeout;
  return o;
}

// One thread waits for a server that is away; the others' calls must not wait with it. The
// recovery used to run inside that wait holding the server's lock, so a push, a registration and
// a bounded wait from another thread all blocked until it gave up (the whole retry_timeout, after
// which the waiter and the wait_for failed), and wait_for ignored its own timeout. The server is
// restarted only once those calls have returned.
TEST(Retry, WhileOneThreadWaitsForAServerThatIsAwayOtherCallsGoOn) {
  const std::string uri = free_uri();
  RestartableServer server(uri);
  ClientOptions o = retrying_worker(uri, 20s);
  o.connect_timeout = 200ms;
  Client c(o);
  std::vector<float> value(8, 1.0f), out(8), registered(64);
  c.wait(c.init(1, value));
  server.stop();
  const Ticket pull = c.pull(1, out);
  std::string waiter_error;
  std::jthread waiter([&] {  // joined however the test ends
    try {
      c.wait(pull);
    } catch (const Error& e) {
      waiter_error = e.what();
    }
  });
  std::this_thread::sleep_for(200ms);  // the waiter has found the connection failed
  const Ticket push = c.push(1, value);
  c.register_buffer(registered.data(), registered.size() * sizeof(float));
  EXPECT_FALSE(c.wait_for(push, 100ms));
  EXPECT_FALSE(c.done(push));
  server.restart();
  waiter.join();
  EXPECT_EQ(waiter_error, "");
  c.wait(push);
  c.wait(c.pull(1, out));
  EXPECT_EQ(out, std::vector<float>(8, 2.0f));  // the push landed once (rule add)
  c.disconnect();                               // no goodbye to a server about to go
}

// A wait_for that returned at its timeout leaves the recovery running, for retry_timeout; the
// client destroyed then must still end within the goodbye's bound (2.3 s). With the hour-long
// retry_timeout here, an unbounded one hangs the test until ctest's timeout.
TEST(Retry, TheGoodbyeBoundsARecoveryBegunBeforeIt) {
  const std::string uri = free_uri();
  std::optional<Server> server(std::in_place, server_at(uri));
  std::vector<float> value(8, 1.0f);
  std::optional<Client> c(std::in_place, retrying_worker(uri, std::chrono::hours(1)));
  c->wait(c->init(1, value));
  server.reset();
  EXPECT_FALSE(c->wait_for(c->push(1, value), 100ms));  // the old code ran the whole hour here
  c.reset();
}

// A caller that only polls done() (torch's Work.is_completed() in a loop) never waits: done()
// used to leave a lost request for a wait to send again, and so stayed false for good.
TEST(Retry, PollingDoneAloneGetsALostRequestSentAgain) {
  const std::string uri = free_uri();
  RestartableServer server(uri);
  Client c(retrying_worker(uri, 20s));
  std::vector<float> value(8, 1.0f), out(8);
  c.wait(c.init(1, value));
  server.stop();
  const Ticket push = c.push(1, value);
  server.restart();
  const auto give_up = std::chrono::steady_clock::now() + 15s;
  while (!c.done(push) && std::chrono::steady_clock::now() < give_up) std::this_thread::sleep_for(5ms);
  ASSERT_TRUE(c.done(push));
  c.wait(push);
  c.wait(c.pull(1, out));
  EXPECT_EQ(out, std::vector<float>(8, 2.0f));
  c.disconnect();
}

TEST(Retry, GivesUpOnceTheServerStayedAwayForTheWholeTimeout) {
  const std::string uri = free_uri();
  std::optional<Server> server(std::in_place, server_at(uri));
  ClientOptions o;
  o.servers = {uri};
  o.worker_id = 0;
  o.retry_timeout = 300ms;
  o.connect_timeout = 200ms;
  Client c(o);
  std::vector<float> value(8, 1.0f);
  c.wait(c.init(1, value));
  server.reset();
  const auto start = std::chrono::steady_clock::now();
  testing::expect_error([&] { c.wait(c.push(1, value)); }, Errc::peer_failure, {"gave up on " + uri});
  // Not before the whole timeout: a lower bound, which a slow machine can only exceed.
  EXPECT_GE(std::chrono::steady_clock::now() - start, 300ms);
  // Given up on: later requests fail at once, with the same explanation.
  testing::expect_error([&] { c.wait(c.push(1, value)); }, Errc::peer_failure, {"gave up on " + uri});
}

// The server parks worker 0's read for worker 1's clock, past the client's io_timeout, so the
// connection is declared lost and the read sent again on a new one, where it parks again. The
// reconnections all succeed; retry_timeout still bounds the whole, and the error says why.
TEST(Retry, ARequestNeverAnsweredOnConnectionsTheServerAcceptsIsGivenUpAfterTheTimeout) {
  const std::string uri = free_uri();
  ServerOptions so = two_workers_at(uri);
  so.staleness = 0;
  so.wait_timeout = 60s;  // the server itself would answer only after the test's bound
  Server server(so);
  ClientOptions o;
  o.servers = {uri};
  o.worker_id = 1;
  Client silent(o);  // connected and never clocks: worker 0's reads wait for it
  o.worker_id = 0;
  o.initial_clock = 1;
  o.io_timeout = 300ms;
  o.retry_timeout = 1500ms;
  Client c(o);
  std::vector<float> out(8);
  c.wait(c.init(1, std::vector<float>(8, 0.0f)));
  const Ticket pull = c.pull(1, out);
  const auto start = std::chrono::steady_clock::now();
  bool returned = true;
  testing::expect_error([&] { returned = c.wait_for(pull, 20s); }, Errc::timeout, {"retry_timeout", "given up"});
  EXPECT_TRUE(returned);
  // Not before the first loss (io_timeout at the earliest) and a whole retry_timeout after it.
  EXPECT_GE(std::chrono::steady_clock::now() - start, 1800ms);
}

// Losses to restarts do not add up against retry_timeout (only a run of losses to silence
// does): a barrier parked on a server that restarts twice, further apart than retry_timeout, is
// sent again each time and passes once the other worker arrives.
TEST(Retry, RestartsDoNotAddUpAgainstTheTimeout) {
  const std::string uri = free_uri();
  ServerOptions so = server_at(uri);
  so.num_workers = 2;
  so.wait_timeout = 60s;
  std::optional<Server> server(std::in_place, so);
  ClientOptions o;
  o.servers = {uri};
  o.worker_id = 0;
  o.retry_timeout = 1s;
  Client c(o);
  const Ticket barrier = c.barrier_async();  // waits for worker 1
  for (int restart = 0; restart < 2; ++restart) {
    EXPECT_FALSE(c.wait_for(barrier, 1200ms));  // sent again to the new server, parked again
    server.reset();
    server.emplace(so);
  }
  o.worker_id = 1;
  Client other(o);
  const Ticket arrived = other.barrier_async();
  EXPECT_NO_THROW(EXPECT_TRUE(c.wait_for(barrier, 20s)));
  EXPECT_NO_THROW(other.wait(arrived));
}

// A worker whose server restarted since it last used the server says goodbye to the new one:
// without it, the restarted server (which takes the worker's clock from its replicas, but not
// that it finished) would keep the other workers' bounded reads waiting for it.
TEST(Retry, AFinishingWorkerTellsARestartedServerItFinished) {
  const std::string uri = free_uri();
  const ServerOptions so = two_workers_at(uri);
  std::optional<Server> server(std::in_place, so);
  {
    ClientOptions o;
    o.servers = {uri};
    o.worker_id = 0;
    o.retry_timeout = 20s;
    Client c(o);
    c.clock();
    c.clock();
    server.reset();
    server.emplace(so);
  }  // the goodbye finds its connection broken, and reconnects
  expect_worker_0_finished(uri);
}

// One server gone for good does not use up the goodbye's bound for the others: server 0 never
// comes back (its recovery takes the whole 2 s) and server 1, recovered after it, restarted.
TEST(Retry, AGoodbyeStillReachesARestartedServerAfterOneGoneForGood) {
  const std::string gone = free_uri(), back = free_uri();
  const ServerOptions so = two_workers_at(back);
  std::optional<Server> first(std::in_place, two_workers_at(gone)), second(std::in_place, so);
  {
    ClientOptions o;
    o.servers = {gone, back};
    o.worker_id = 0;
    o.retry_timeout = 20s;
    Client c(o);
    c.clock();
    first.reset();
    second.reset();
    second.emplace(so);
  }
  expect_worker_0_finished(back);
}

}  // namespace
}  // namespace pskv
