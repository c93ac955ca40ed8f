// Everything pskv-mnist can be told, in one typed struct (flags > PSKV_* env > these defaults).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "idx.h"
#include "pskv/types.h"

namespace pskv::mnist {

struct TrainConfig {
  // Data and model.
  std::string data_dir = "data/mnist";
  DatasetKind dataset = DatasetKind::mnist;
  std::string model = "mlp";
  int epochs = 2;
  int batch = 32;
  float lr = 0.1f;
  int threads = 1;  // compute threads per worker
  std::uint64_t seed = 1;
  std::size_t train_limit = 0;  // 0: the whole training set
  std::size_t test_limit = 0;   // 0: the whole test set
  int evals_per_epoch = 4;

  // Parameter server.
  std::string transport = "shm";
  int servers = 2;
  int workers = 2;
  ConsistencyMode mode = ConsistencyMode::ssp;
  std::uint32_t staleness = 2;
  std::uint32_t backup_workers = 0;  // sync mode: apply each step from the first N - b gradients
  std::string rule = "sgd";
  float momentum = 0.9f;
  std::uint64_t chunk_floats = 1u << 16;
  int wait_timeout_ms = 60000;  // generous: a loaded machine can starve a healthy worker for seconds
  bool evict_stragglers = false;

  // Where things run.
  bool local = false;
  bool launch = false;
  bool compare_local = false;
  std::string host = "127.0.0.1";
  int port_base = 0;  // tcp/rdma servers listen on port_base + s (0: free ports when launching)
  std::string hostfile;
  std::string job = "";  // shm segment prefix (default: mnist-<pid>)

  // Checkpoints.
  std::string checkpoint_dir;
  std::string auth_token_file;
  int checkpoint_every_s = 10;
  bool restore = false;
  int replicas = 1;  // tcp: servers holding each key; a killed server rejoins from its replicas
  // With replicas and 3+ servers: a killed server's keys move to its successor after this long
  // instead of waiting for its restart (0: off); the votes go to a directory of the job's.
  int failover_ms = 0;

  // Output.
  std::string csv;
  bool json = false;
  int straggler_worker = -1;
  double straggler_factor = 1.0;
  double target_accuracy = 0.0;  // report when it was first reached
  bool quiet = false;
};

// What a training run reports (one per worker, aggregated by the launcher).
struct TrainResult {
  double test_accuracy = 0;
  double samples_per_s = 0;
  std::uint64_t samples = 0;
  std::uint64_t max_staleness = 0;
  double wall_s = 0;
  double time_to_target_s = -1;
  int reconnects = 0;
};

std::string result_json(const TrainConfig& c, const TrainResult& r, const std::string& mode_name);

}  // namespace pskv::mnist
