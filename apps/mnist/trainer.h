// The data-parallel MNIST job: local baseline, PS worker, PS server, the single-node launcher
// and the cluster (mpirun/srun) roles.
#pragma once

#include <string>
#include <vector>

#include "train_config.h"

namespace pskv::mnist {

// Trains in this process without a parameter server (the baseline), threads = c.threads.
TrainResult run_local(const TrainConfig& c);

// One data-parallel worker against `servers`. Worker 0 evaluates and reports progress.
TrainResult run_worker(const TrainConfig& c, int rank, const std::vector<std::string>& servers);

// One server shard; returns 0 when every worker finished or on SIGTERM/SIGINT, non-zero when
// the job failed (a worker died or stalled under the fail policy).
// Serves shard `server_id` of `uris` (every server's URI). `restart`: after a failure, from the
// checkpoint (--checkpoint-dir) and, with --replicas, from the replicas.
int run_server(const TrainConfig& c, int server_id, const std::vector<std::string>& uris, bool restart);

// Forks servers and workers on this node, supervises them (a dead server is restarted from
// its checkpoint when checkpoints are on) and returns the job's summary.
TrainResult launch(const TrainConfig& c);

// Rank and size from mpirun (OMPI_COMM_WORLD_*, PMI_*) or srun (SLURM_*); false if neither.
bool cluster_rank(int* rank, int* size);
// Server URIs for a cluster job: host of rank s from the hostfile (or c.host), port_base + s.
std::vector<std::string> cluster_servers(const TrainConfig& c);

}  // namespace pskv::mnist
