// Client::wait_for: a bounded wait that leaves an unfinished ticket usable, so a caller can wait
// in slices (the Python binding does, to notice Ctrl-C) without losing the operation.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>

#include "pskv/client.h"
#include "pskv/server.h"

namespace pskv {
namespace {

using namespace std::chrono_literals;

class WaitFor : public ::testing::TestWithParam<std::string> {
 protected:
  ServerOptions bsp_server(std::chrono::milliseconds wait_timeout) const {
    ServerOptions so;
    so.uri = GetParam() == "tcp" ? "tcp://127.0.0.1:0" : "shm://waitfor-" + std::to_string(getpid());
    so.num_workers = 2;
    so.mode = ConsistencyMode::bsp;
    so.wait_timeout = wait_timeout;
    so.arena_bytes = 4 << 20;
    so.io_threads = 1;
    return so;
  }
  static ClientOptions worker(const Server& server, std::uint32_t id) {
    ClientOptions o;
    o.servers = {server.uri()};
    o.worker_id = id;
    return o;
  }
};

TEST_P(WaitFor, UnfinishedTicketStaysValidUntilItCompletes) {
  Server server(bsp_server(10s));
  Client w0(worker(server, 0)), w1(worker(server, 1));
  std::vector<float> init(16, 3.0f), out(16, 0.0f);
  w0.wait(w0.init(1, init));
  w0.clock();  // w0 at clock 1: under BSP its pull waits until w1 reaches 1 too
  const Ticket pull = w0.pull(1, out);
  EXPECT_FALSE(w0.wait_for(pull, 50ms));
  EXPECT_FALSE(w0.done(pull));
  EXPECT_FALSE(w0.wait_for(pull, 0ms));
  w1.clock();
  EXPECT_TRUE(w0.wait_for(pull, 10s));
  EXPECT_EQ(out[15], 3.0f);
  EXPECT_EQ(w0.staleness().reads, 1u);  // recorded once, like wait()
  // Spent: like a waited ticket, it cannot be waited again.
  EXPECT_THROW(w0.wait(pull), Error);
  EXPECT_THROW(w0.wait_for(pull, 1ms), Error);
}

TEST_P(WaitFor, CompletedWithAnErrorThrowsLikeWait) {
  Server server(bsp_server(200ms));
  Client w0(worker(server, 0)), w1(worker(server, 1));
  std::vector<float> init(16, 1.0f), out(16);
  w0.wait(w0.init(1, init));
  w0.clock();  // w1 never clocks: the server gives up on it after 200 ms
  const Ticket pull = w0.pull(1, out);
  bool completed = false;
  Errc code = Errc::ok;
  for (int slice = 0; slice < 200 && !completed; ++slice) {
    try {
      completed = w0.wait_for(pull, 50ms);
    } catch (const Error& e) {
      completed = true;
      code = e.code();
    }
  }
  ASSERT_TRUE(completed);
  EXPECT_NE(code, Errc::ok);
  EXPECT_THROW(w0.wait(pull), Error);  // spent by the throwing wait_for
}

INSTANTIATE_TEST_SUITE_P(Backends, WaitFor, ::testing::Values("tcp", "shm"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace pskv
