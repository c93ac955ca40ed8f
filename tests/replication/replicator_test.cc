// The origin side of replication (src/server/replicator.h) on its own, with a replica that is
// not there: how long an acknowledgement waits for a replica the origin never reached.
#include "server/replicator.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>

#include "engine/shard_engine.h"
#include "transport/tcp/socket.h"

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

// Replica server 1 at a port nothing listens on: every connect to it is refused.
ReplicatorOptions unreached_replica() {
  ReplicatorOptions r;
  r.server_id = 0;
  r.replicas = {{1, "tcp://127.0.0.1:" + std::to_string(tcp::free_loopback_port())}};
  r.io_timeout = 300ms;
  return r;
}

// At a start, the servers of a job come up one by one: a replica not reached within the io
// timeout is given up, and a clock is acknowledged without it.
TEST(Replicator, AtAStartAnUnreachedReplicaIsGivenUpAfterTheIoTimeout) {
  ShardEngine engine(origin_options());
  TcpReplicator replicator(engine, unreached_replica());
  std::promise<Errc> done;
  std::future<Errc> acked = done.get_future();
  replicator.ship_clock(0, 1, std::make_unique<Reply>(done));
  ASSERT_EQ(acked.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(acked.get(), Errc::ok);
  replicator.stop();
}

// A takeover's replicator (certified_down set) holds the only copy of keys whose other copy was
// just lost: nothing is acknowledged while its replica is neither reached nor certified down,
// however long that takes, and it is acknowledged once the replica is certified down.
TEST(Replicator, ATakeoverAcknowledgesNothingUntilAnUnreachedReplicaIsCertifiedDown) {
  ShardEngine engine(origin_options());
  ReplicatorOptions o = unreached_replica();
  std::atomic<bool> down{false};
  std::atomic<int> asked{0};
  o.certified_down = [&](std::uint32_t replica) {
    EXPECT_EQ(replica, 1u);
    asked.fetch_add(1);
    return down.load();
  };
  TcpReplicator replicator(engine, o);
  std::promise<Errc> done;
  std::future<Errc> acked = done.get_future();
  replicator.ship_clock(0, 1, std::make_unique<Reply>(done));
  // Five io timeouts, and the replica's keeper asked about it meanwhile.
  EXPECT_EQ(acked.wait_for(1500ms), std::future_status::timeout) << "acknowledged without the replica";
  EXPECT_GT(asked.load(), 0);
  down.store(true);
  ASSERT_EQ(acked.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(acked.get(), Errc::ok);
  replicator.stop();
}

}  // namespace
}  // namespace pskv
