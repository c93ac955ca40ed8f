// The origin side of replication (src/server/replicator.h) on its own, with a replica that is
// not there: how long an acknowledgement waits for a replica the origin never reached.
#include "server/replicator.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>

#include "engine/shard_engine.h"

namespace pskv {
namespace {

using namespace std::chrono_literals;

// Hands the status an acknowledgement was resumed with to a future.
class Reply final : public Parked {
 public:
  explicit Reply(std::promise<Errc>& done) : done_(done) {}
  void resume(Errc status, const std::string&) override { done_.set_value(status); }

 private:
  std::promise<Errc>& done_;
};

EngineOptions origin_options() {
  EngineOptions o;
  o.server_id = 0;
  o.num_workers = 1;
  o.store.arena_bytes = 1 << 20;
  o.store.max_keys = 64;
  return o;
}

// A loopback port bound for as long as this lives, so that no other test can take it: with
// `listening` false every connect to it is refused; with it true connects are queued, never
// answered, and connected_within() tells whether one came.
class LoopbackPort {
 public:
  explicit LoopbackPort(bool listening = false) : fd_(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0 || (listening && ::listen(fd_, 8) != 0))
      throw std::runtime_error("cannot bind a loopback port");
    uri_ = "tcp://127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  ~LoopbackPort() { ::close(fd_); }
  LoopbackPort(const LoopbackPort&) = delete;
  LoopbackPort& operator=(const LoopbackPort&) = delete;
  const std::string& uri() const { return uri_; }
  bool connected_within(std::chrono::milliseconds wait) const {
    pollfd p{fd_, POLLIN, 0};
    return ::poll(&p, 1, static_cast<int>(wait.count())) == 1;
  }

 private:
  int fd_;
  std::string uri_;
};

// Server 0's replicator with one replica, server 1, at `replica`.
ReplicatorOptions origin_of_one(const LoopbackPort& replica, std::chrono::milliseconds io_timeout) {
  ReplicatorOptions o;
  o.server_id = 0;
  o.replicas = {{1, replica.uri()}};
  o.io_timeout = io_timeout;
  return o;
}

// An origin whose replica, server 1, is at a refused port, and one clock shipped to it:
// `acked` tells how it was answered. (The promise outlives the replicator, whose stop resumes
// what it still holds.)
struct OneClockShipped {
  // `certified_down`: ReplicatorOptions::certified_down (a takeover's engine), or none (a start).
  explicit OneClockShipped(std::function<bool(std::uint32_t)> certified_down = nullptr) {
    options.server_id = 0;
    options.replicas = {{1, port.uri()}};
    options.io_timeout = 300ms;
    options.certified_down = std::move(certified_down);
    replicator = std::make_unique<TcpReplicator>(engine, options);
    replicator->start();
    replicator->ship_clock(0, 1, std::make_unique<Reply>(done));
  }
  ~OneClockShipped() { replicator->stop(); }

  std::promise<Errc> done;
  std::future<Errc> acked = done.get_future();
  const LoopbackPort port;
  ShardEngine engine{origin_options()};
  ReplicatorOptions options;
  std::unique_ptr<TcpReplicator> replicator;
};

// At a start, the servers of a job come up one by one: a replica not reached within the io
// timeout is given up, and a clock is acknowledged without it.
TEST(Replicator, AtAStartAnUnreachedReplicaIsGivenUpAfterTheIoTimeout) {
  OneClockShipped origin;
  ASSERT_EQ(origin.acked.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(origin.acked.get(), Errc::ok);
}

// A takeover's replicator (certified_down set) holds the only copy of keys whose other copy was
// just lost: nothing is acknowledged while its replica is neither reached nor certified down,
// and it is acknowledged once the replica is certified down.
TEST(Replicator, ATakeoverAcknowledgesNothingUntilAnUnreachedReplicaIsCertifiedDown) {
  std::atomic<bool> down{false};
  std::atomic<int> asked{0};
  OneClockShipped origin([&](std::uint32_t replica) {
    EXPECT_EQ(replica, 1u);
    asked.fetch_add(1);
    return down.load();
  });
  // Five io timeouts, and the replica's keeper asked about it meanwhile.
  EXPECT_EQ(origin.acked.wait_for(1500ms), std::future_status::timeout) << "acknowledged without the replica";
  EXPECT_GT(asked.load(), 0);
  down.store(true);
  ASSERT_EQ(origin.acked.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(origin.acked.get(), Errc::ok);
}

// A replica nobody certifies (cut off from this server alone, say) is given up after ten io
// timeouts all the same: the keys must not stall for good.
TEST(Replicator, ATakeoverGivesUpAReplicaNobodyCertifiesAfterTenIoTimeouts) {
  const auto began = std::chrono::steady_clock::now();
  OneClockShipped origin([](std::uint32_t) { return false; });
  ASSERT_EQ(origin.acked.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(origin.acked.get(), Errc::ok);
  EXPECT_GE(std::chrono::steady_clock::now() - began, 10 * origin.options.io_timeout) << "given up early";
}

// A replica that syncs watches its origin and takes its keys over if the origin's port refuses
// connections; over rdma the port refuses them until the listener has registered its memory.
// So nothing reaches a replica before start(), which the server calls once it listens, and
// what is shipped meanwhile waits.
TEST(Replicator, NothingReachesAReplicaBeforeStart) {
  const LoopbackPort replica(/*listening=*/true);
  ShardEngine engine{origin_options()};
  const ReplicatorOptions options = origin_of_one(replica, 300ms);
  std::promise<Errc> done;
  std::future<Errc> acked = done.get_future();
  {
    TcpReplicator replicator(engine, options);
    replicator.ship_clock(0, 1, std::make_unique<Reply>(done));
    EXPECT_FALSE(replica.connected_within(600ms)) << "a replica was reached before start()";
    EXPECT_EQ(acked.wait_for(0s), std::future_status::timeout) << "acknowledged before start()";
    replicator.start();
    EXPECT_TRUE(replica.connected_within(30s)) << "start() did not reach the replica";
  }
  ASSERT_EQ(acked.wait_for(0s), std::future_status::ready) << "stop() left the clock unanswered";
}

// A replica whose port takes the connection but never answers the hello (a hung process):
// the keeper waits for its reply for the io timeout, but stop() (a server's stop, a takeover
// quiesced for a hand-back while its keys wait) must not wait that out.
TEST(Replicator, StopDoesNotWaitOutAConnectToAReplicaThatDoesNotAnswer) {
  const LoopbackPort replica(/*listening=*/true);
  ShardEngine engine{origin_options()};
  TcpReplicator replicator(engine, origin_of_one(replica, 60s));
  replicator.start();
  ASSERT_TRUE(replica.connected_within(30s)) << "start() did not reach the replica";
  std::this_thread::sleep_for(200ms);  // well inside the hello's wait
  const auto began = std::chrono::steady_clock::now();
  replicator.stop();
  const auto took = std::chrono::steady_clock::now() - began;
  EXPECT_LT(took, 10s) << "stop() waited " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                       << " ms for a connect to a replica that does not answer (its io timeout is 60 s)";
}

}  // namespace
}  // namespace pskv
