// Workloads that every backend's integration tests run the same way.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

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

// After pushes of +1 to keys [0, keys) of `length` floats: every key is whole (all its floats
// equal) and lies between `acked`, the acknowledged pushes, and acked + `failed`, those that failed
// and may have landed: nothing acknowledged lost, nothing applied twice. `context` names the trial.
void expect_pushes_between(Client& c, Key keys, std::size_t length, std::uint64_t acked, std::uint64_t failed,
                           const std::string& context);

// With --replicas R: waits until each server of `c` reports its R-1 replicas (the next servers of
// the ring) synced; a failure through GoogleTest after `limit`.
void wait_replicas_synced(Client& c, std::uint32_t replicas, std::chrono::seconds limit = std::chrono::seconds(30));

// What a pusher that outlives its servers' failures reports (in a SharedArray).
struct PushTally {
  std::atomic<std::uint64_t> acknowledged{0};
  std::atomic<std::uint64_t> failed{0};  // sent, then failed: it may or may not have landed
};

// Run in a forked child: pushes +1 to every one of `keys` (`length` floats each) in one push, one
// at a time, until `stop` is set. A push or connect that fails drops the client and connects
// again, as a worker whose server died and came back does. Returns 0, or 1 if no server took it
// back within `reconnect_within` (said on stderr).
// Keys [0, count), each created as `length` zeros through a client of `options`.
std::vector<Key> make_zero_keys(const ClientOptions& options, Key count, std::size_t length);

int push_through_failures(const ClientOptions& options, std::span<const Key> keys, std::uint32_t length,
                          PushTally& tally, const std::atomic<int>& stop, std::chrono::seconds reconnect_within);

}  // namespace pskv::testing
