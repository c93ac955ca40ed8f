// The one stop sequence (transport::Listener): stop accepting, drain, final checkpoint, close. Its
// promise, checked on every backend that runs here: the final checkpoint holds every push a
// client was told succeeded. A pusher keeps pushing +1 to one key while the server stops; the
// key was created first and 2,000 others after it, so a checkpoint copies it early and then
// spends a while on the rest, during which a server that stopped its transport only after the
// checkpoint went on acknowledging pushes the checkpoint had already passed.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <thread>
#include <vector>

#include "pskv/client.h"
#include "pskv/server.h"

namespace pskv {
namespace {

class StopSequence : public ::testing::TestWithParam<std::string> {
 protected:
  std::string uri(int round) const {
    const std::string name = "stop-" + std::to_string(::getpid()) + "-" + std::to_string(round);
    if (GetParam() == "tcp") return "tcp://127.0.0.1:0";
    if (GetParam() == "fake") return "fake://" + name;
    return "shm://" + name + (GetParam() == "shm_ring" ? "?push=server" : "");
  }
  std::filesystem::path dir_ = std::filesystem::temp_directory_path() / ("pskv-stop-" + std::to_string(::getpid()));
  void TearDown() override { std::filesystem::remove_all(dir_); }
};

TEST_P(StopSequence, TheFinalCheckpointHoldsEveryAcknowledgedPush) {
  constexpr Key kPushed = 1;
  constexpr std::size_t kFloats = 64;
  for (int round = 0; round < 3; ++round) {
    std::filesystem::remove_all(dir_);
    ServerOptions so;
    so.uri = uri(round);
    so.arena_bytes = 64 << 20;
    so.checkpoint_dir = dir_.string();
    auto server = std::make_unique<Server>(so);
    ClientOptions o;
    o.servers = {server->uri()};
    o.io_timeout = std::chrono::seconds(5);
    std::uint64_t acked = 0;
    {
      Client c(o);
      c.wait(c.init(kPushed, std::vector<float>(kFloats, 0.0f)));
      std::vector<Key> fillers(2000);
      std::vector<std::vector<float>> values(fillers.size(), std::vector<float>(1024, 1.0f));
      std::vector<std::span<const float>> spans(values.begin(), values.end());
      for (std::size_t i = 0; i < fillers.size(); ++i) fillers[i] = 1000 + i;
      c.wait(c.init(fillers, spans));
      std::atomic<bool> started{false};
      std::thread pusher([&] {
        const std::vector<float> one(kFloats, 1.0f);
        try {
          for (;;) {
            c.wait(c.push(kPushed, one));
            ++acked;
            started = true;
          }
        } catch (const Error&) {  // the server stopped under it: the end of this pusher
        }
      });
      while (!started) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      server->stop();
      pusher.join();
      c.disconnect();
    }
    server.reset();
    ServerOptions again = so;
    again.uri = uri(round + 100);
    again.checkpoint_dir.clear();
    again.restore_dir = dir_.string();
    Server restored(again);
    ClientOptions ro;
    ro.servers = {restored.uri()};
    Client c(ro);
    std::vector<float> out(kFloats);
    c.wait(c.pull(kPushed, out));
    // Every acknowledged push is in it; at most the one in flight when the server stopped was
    // applied without its acknowledgement reaching the client.
    EXPECT_GE(out[0], static_cast<float>(acked)) << "round " << round << ": acknowledged pushes missing";
    EXPECT_LE(out[0], static_cast<float>(acked + 1)) << "round " << round;
    EXPECT_GT(acked, 0u);
  }
}

// In sync mode a push is acknowledged once it is summed into its step, which may wait for other
// workers past the stop: the final checkpoint keeps the step pending, and the restored server
// completes it with the next worker's push (before, it started the key at step 0 with nothing
// summed, and the step waited for a worker that had already pushed).
TEST_P(StopSequence, InSyncModeTheFinalCheckpointHoldsThePendingSteps) {
  constexpr Key kKey = 1;
  std::filesystem::remove_all(dir_);
  ServerOptions so;
  so.uri = uri(0);
  so.arena_bytes = 64 << 20;
  so.checkpoint_dir = dir_.string();
  so.num_workers = 2;
  so.mode = ConsistencyMode::sync;
  so.rule.rule = UpdateRule::sgd;
  so.rule.lr = 0.5f;
  auto worker = [](const std::string& server, std::uint32_t id) {
    ClientOptions o;
    o.servers = {server};
    o.worker_id = id;
    o.io_timeout = std::chrono::seconds(5);
    return o;
  };
  {
    Server server(so);
    Client c(worker(server.uri(), 0));
    c.wait(c.init(kKey, std::vector<float>(8, 0.0f)));
    c.wait(c.push(kKey, std::vector<float>(8, 1.0f)));  // step 0: summed, waits for worker 1
    c.disconnect();
    server.stop();
  }
  ServerOptions again = so;
  again.uri = uri(100);
  again.checkpoint_dir.clear();
  again.restore_dir = dir_.string();
  Server restored(again);
  Client c(worker(restored.uri(), 1));
  c.wait(c.push(kKey, std::vector<float>(8, 3.0f)));
  ClientOptions ro;
  ro.servers = {restored.uri()};
  Client reader(ro);
  std::vector<float> out(8);
  reader.wait(reader.pull(kKey, out));
  // One step: lr x K x mean = 0.5 x (1 + 3).
  for (float x : out) EXPECT_EQ(x, -2.0f) << "the step worker 0 pushed into before the stop was lost";
  const std::string stats = reader.server_stats(0);
  EXPECT_NE(stats.find("\"sync_applied_steps\":1"), std::string::npos) << stats;
}

INSTANTIATE_TEST_SUITE_P(Backends, StopSequence, ::testing::Values("tcp", "shm", "shm_ring", "fake"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace pskv
