// A value split over several servers (ClientOptions::chunk_floats) is atomic per chunk, not per
// key: a pull returns each chunk whole from one push, but neighbouring chunks may come from two
// different pushes, since each server applies its chunk on its own. This is the documented
// contract (docs/RELIABILITY.md, "Chunked values"); checked here on every backend, with the
// chunk boundaries computed by place(), the same function the client splits by.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "client/placement.h"
#include "pskv/client.h"
#include "pskv/server.h"
#include "support/process.h"

namespace pskv {
namespace {

constexpr int kServers = 2;
// Two chunks of 20,000 floats (80 KB): under tcp's default push=pieces a key is applied whole up
// to 256 KiB, so each chunk is atomic on its server; larger chunks are atomic per 256 KiB piece.
constexpr std::uint32_t kLength = 40000;
constexpr std::uint64_t kChunkFloats = 4096;

class ChunkedValue : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    for (int i = 0; i < kServers; ++i) {
      const std::string id = std::to_string(i);
      if (GetParam() == "fake") {
        ServerOptions o;
        o.uri = "fake://chunks-" + std::to_string(::getpid()) + "-" + id;
        o.server_id = i;
        o.rule.rule = UpdateRule::assign;
        in_process_.push_back(std::make_unique<Server>(o));
        uris_.push_back(in_process_.back()->uri());
        continue;
      }
      const std::string uri =
          GetParam() == "tcp" ? "tcp://127.0.0.1:0" : "shm://chunks-" + std::to_string(::getpid()) + "-" + id;
      processes_.push_back(
          testing::ServerProcess::start({"--uri", uri, "--server-id", id, "--io-threads", "2", "--rule", "assign"}));
      uris_.push_back(processes_.back().uri);
    }
  }
  ClientOptions options() const {
    ClientOptions o;
    o.servers = uris_;
    o.chunk_floats = kChunkFloats;
    o.io_timeout = std::chrono::seconds(30);
    return o;
  }
  // The parts a pull of `key` is assembled from, as the client cuts it.
  std::vector<Part> parts(Key key) const {
    PlacementOptions p;
    p.servers = kServers;
    p.chunk_floats = kChunkFloats;
    std::vector<Part> out;
    place(p, key, kLength, out);
    return out;
  }

  std::vector<testing::ServerProcess> processes_;
  std::vector<std::unique_ptr<Server>> in_process_;
  std::vector<std::string> uris_;
};

// Two writers assign whole values, every float of a push the same number and every push a new
// one, while a reader pulls: each chunk of every read is one push's number throughout.
TEST_P(ChunkedValue, EachChunkIsAtomicOnItsOwnServer) {
  const Key key = 7;
  const std::vector<Part> chunks = parts(key);
  ASSERT_EQ(chunks.size(), std::size_t{kServers});
  ASSERT_NE(chunks[0].server, chunks[1].server);
  {
    Client admin(options());
    admin.wait(admin.init(key, std::vector<float>(kLength, 0.0f)));
  }
  std::atomic<int> writing{2};
  std::vector<std::thread> writers;
  for (int w = 0; w < 2; ++w)
    writers.emplace_back([&, w] {
      Client c(options());
      std::vector<float> v(kLength);
      for (int i = 1; i <= 400; ++i) {
        std::fill(v.begin(), v.end(), float(i * 2 + w));
        c.wait(c.push(key, v));
      }
      writing.fetch_sub(1);
    });
  Client reader(options());
  std::vector<float> out(kLength);
  int reads = 0, mixed = 0, torn = 0;
  while (writing.load() > 0 || reads < 20) {
    reader.wait(reader.pull(key, out));
    ++reads;
    for (const Part& p : chunks)
      for (std::uint32_t i = 1; i < p.length; ++i)
        if (out[p.offset + i] != out[p.offset]) {
          ++torn;
          ADD_FAILURE() << "chunk at " << p.offset << " (server " << p.server << ") torn at float " << p.offset + i
                        << ": " << out[p.offset] << " then " << out[p.offset + i];
          break;
        }
    mixed += out[chunks[0].offset] != out[chunks[1].offset];
    if (torn > 3) break;
  }
  for (auto& t : writers) t.join();
  // The documented looseness, reported, not required: whether a read lands between two servers'
  // applies of the same push is up to the scheduler.
  std::printf("%d reads, %d combined chunks of two different pushes\n", reads, mixed);
  reader.wait(reader.pull(key, out));
  for (const Part& p : chunks) EXPECT_EQ(out[p.offset], out[p.offset + p.length - 1]);
}

// Once every push has been answered, every chunk holds the last push that reached its server,
// and with one writer that is the same push everywhere: the value is whole again.
TEST_P(ChunkedValue, AfterThePushesAreAnsweredTheValueIsWhole) {
  const Key key = 9;
  Client c(options());
  c.wait(c.init(key, std::vector<float>(kLength, 0.0f)));
  std::vector<float> v(kLength), out(kLength);
  for (int i = 1; i <= 50; ++i) {
    for (std::uint32_t f = 0; f < kLength; ++f) v[f] = float(i) + float(f) * 1e-3f;
    c.wait(c.push(key, v));
    c.wait(c.pull(key, out));
    ASSERT_EQ(out, v) << "after push " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ChunkedValue, ::testing::Values("tcp", "shm", "fake"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace pskv
