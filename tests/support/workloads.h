// Workloads that every backend's integration tests run the same way.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "pskv/client.h"
#include "support/stats.h"

namespace pskv::testing {

struct NothingLostOptions {
  int clients = 16;
  int pushes = 500;  // per client, each +1 on one of `keys` keys
  int keys = 4;
  std::uint32_t length = 64;          // floats per key
  std::size_t batch = 32;             // pushes in flight before a client waits for them
  bool pull_between_batches = false;  // also read a key after each batch and check it is untorn
  bool register_every_other = false;  // every other client registers its push buffer (rdma)
  std::chrono::seconds worker_limit{120};
};

// Forked clients push +1 concurrently, pipelined. Afterwards every element of every key is equal
// and the sum over keys is exactly clients x pushes: nothing was lost or applied twice.
// Reports failures through GoogleTest.
void expect_nothing_lost(const ClientOptions& options, const NothingLostOptions& w);

}  // namespace pskv::testing
