// pskv-mnist: data-parallel MNIST training through pskv servers.
//   --launch          servers and workers forked on this node
//   --local           the same model in one process, no parameter server (the baseline)
//   under mpirun/srun the rank picks the role: ranks [0, servers) serve, the rest train
#include <CLI/CLI.hpp>
#include <cstdio>

#include "pskv/error.h"
#include "trainer.h"

using namespace pskv;
using namespace pskv::mnist;

int main(int argc, char** argv) {
  TrainConfig c;
  CLI::App app{
      "pskv-mnist: data-parallel MNIST training with BSP, SSP or ASP through pskv servers.\n"
      "Flags override PSKV_* environment variables, which override the defaults shown."};
  app.get_formatter()->column_width(44);
  // A flag given twice takes the last value, so wrappers can pass defaults that users override.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::string dataset = "mnist", mode = "ssp", straggler;
  app.add_flag("--launch", c.launch, "Fork --servers servers and --workers workers on this node");
  app.add_flag("--local", c.local, "Train in this process without a parameter server (baseline)");
  app.add_flag("--compare-local", c.compare_local,
               "With --launch: also run --local with workers*threads threads and "
               "report the samples/s ratio");
  app.add_option("--data", c.data_dir, "Data directory (scripts/fetch-data.sh fills data/mnist and data/fashion)")
      ->envname("PSKV_DATA")
      ->capture_default_str();
  app.add_option("--dataset", dataset, "mnist or fashion")
      ->envname("PSKV_DATASET")
      ->capture_default_str()
      ->check(CLI::IsMember({"mnist", "fashion"}));
  app.add_option("--model", c.model, "mlp or cnn")
      ->envname("PSKV_MODEL")
      ->capture_default_str()
      ->check(CLI::IsMember({"mlp", "cnn"}));
  app.add_option("--epochs", c.epochs, "Passes over each worker's shard")
      ->envname("PSKV_EPOCHS")
      ->capture_default_str();
  app.add_option("--batch", c.batch, "Samples per step per worker")->envname("PSKV_BATCH")->capture_default_str();
  app.add_option("--lr", c.lr, "Learning rate (applied by the servers)")->envname("PSKV_LR")->capture_default_str();
  app.add_option("--threads", c.threads, "Compute threads per worker")->envname("PSKV_THREADS")->capture_default_str();
  app.add_option("--seed", c.seed, "Random seed")->envname("PSKV_SEED")->capture_default_str();
  app.add_option("--train-limit", c.train_limit, "Use only the first N training samples (0: all)")
      ->envname("PSKV_TRAIN_LIMIT")
      ->capture_default_str();
  app.add_option("--test-limit", c.test_limit, "Evaluate on the first N test samples (0: all)")
      ->envname("PSKV_TEST_LIMIT")
      ->capture_default_str();
  app.add_option("--evals-per-epoch", c.evals_per_epoch, "Test-set evaluations per epoch")
      ->envname("PSKV_EVALS_PER_EPOCH")
      ->capture_default_str();
  app.add_option("--transport", c.transport, "shm, tcp or rdma")
      ->envname("PSKV_TRANSPORT")
      ->capture_default_str()
      ->check(CLI::IsMember({"shm", "tcp", "rdma"}));
  app.add_option("--servers", c.servers, "Server shards")->envname("PSKV_SERVERS_COUNT")->capture_default_str();
  app.add_option("--workers", c.workers, "Workers")->envname("PSKV_WORKERS")->capture_default_str();
  app.add_option("--mode", mode, "bsp, ssp, asp or sync")
      ->envname("PSKV_MODE")
      ->capture_default_str()
      ->check(CLI::IsMember({"bsp", "ssp", "asp", "sync"}));
  app.add_option("--staleness", c.staleness, "SSP bound s")->envname("PSKV_STALENESS")->capture_default_str();
  app.add_option("--backup-workers", c.backup_workers, "sync: apply each step from the first workers - b gradients")
      ->envname("PSKV_BACKUP_WORKERS")
      ->capture_default_str();
  app.add_option("--rule", c.rule, "Server update rule: sgd, momentum, adam, adagrad")
      ->envname("PSKV_RULE")
      ->capture_default_str()
      ->check(CLI::IsMember({"sgd", "momentum", "adam", "adagrad"}));
  app.add_option("--momentum", c.momentum, "Momentum coefficient")->envname("PSKV_MOMENTUM")->capture_default_str();
  app.add_option("--chunk-floats", c.chunk_floats, "Split tensors longer than this over all servers")
      ->envname("PSKV_CHUNK_FLOATS")
      ->capture_default_str();
  app.add_option("--wait-timeout-ms", c.wait_timeout_ms, "How long a bounded read waits for a stalled worker")
      ->envname("PSKV_WAIT_TIMEOUT_MS")
      ->capture_default_str();
  app.add_flag("--evict-stragglers", c.evict_stragglers, "Evict a worker stalled past the timeout instead of failing");
  app.add_option("--host", c.host, "Address servers bind and workers dial (tcp/rdma)")
      ->envname("PSKV_HOST")
      ->capture_default_str();
  app.add_option("--port-base", c.port_base, "Server s listens on port-base + s (0 with --launch: free ports)")
      ->envname("PSKV_PORT_BASE")
      ->capture_default_str();
  app.add_option("--hostfile", c.hostfile, "Cluster runs: one host per rank, servers first")->envname("PSKV_HOSTFILE");
  app.add_option("--job", c.job, "Name prefix for shm segments")->envname("PSKV_JOB");
  app.add_option("--checkpoint-dir", c.checkpoint_dir, "Servers checkpoint here; a dead server is restarted from it")
      ->envname("PSKV_CHECKPOINT_DIR");
  app.add_option("--checkpoint-every-s", c.checkpoint_every_s, "Seconds between checkpoints")
      ->envname("PSKV_CHECKPOINT_EVERY_S")
      ->capture_default_str();
  app.add_flag("--restore", c.restore, "Servers start from the checkpoints in --checkpoint-dir");
  app.add_option("--replicas", c.replicas,
                 "tcp: servers holding each key (pskv-server --replicas); a killed server is restarted and takes "
                 "its keys back from its replicas")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  app.add_option("--failover-ms", c.failover_ms,
                 "tcp with --replicas and 3+ --servers: a killed server's keys are served by its successor after this "
                 "long, and it is not restarted (pskv-server --failover-ms; 0: off)")
      ->capture_default_str();
  app.add_option("--auth-token-file", c.auth_token_file,
                 "tcp/rdma: shared secret (chmod 600) servers demand and workers prove (HMAC-SHA256)")
      ->envname("PSKV_AUTH_TOKEN_FILE");
  app.add_option("--csv", c.csv, "Write accuracy against time to this CSV file")->envname("PSKV_CSV");
  app.add_flag("--json", c.json, "End with a one-line JSON summary");
  app.add_option("--straggler", straggler, "W:FACTOR makes worker W take FACTOR times as long per step");
  app.add_option("--target-accuracy", c.target_accuracy, "Report the time to reach this test accuracy (0..1)")
      ->capture_default_str();
  app.add_flag("--quiet", c.quiet, "Only the summary");
  CLI11_PARSE(app, argc, argv);

  c.dataset = parse_dataset_kind(dataset);
  c.mode = *parse_consistency_mode(mode);
  if (c.dataset == DatasetKind::fashion && c.data_dir == "data/mnist") c.data_dir = "data/fashion";
  if (!straggler.empty()) {
    const auto colon = straggler.find(':');
    if (colon == std::string::npos) {
      std::fprintf(stderr, "pskv-mnist: --straggler wants W:FACTOR, e.g. 1:3\n");
      return 2;
    }
    c.straggler_worker = std::stoi(straggler.substr(0, colon));
    c.straggler_factor = std::stod(straggler.substr(colon + 1));
  }
  if (c.mode == ConsistencyMode::bsp) c.staleness = 0;
  if (c.replicas > 1 && (c.transport != "tcp" || c.replicas > c.servers)) {
    std::fprintf(stderr, "pskv-mnist: --replicas %d needs --transport tcp and at least as many --servers\n",
                 c.replicas);
    return 2;
  }
  if (c.failover_ms > 0 && (c.replicas < 2 || c.servers < 3)) {
    std::fprintf(stderr, "pskv-mnist: --failover-ms needs --replicas 2 or more and at least 3 --servers\n");
    return 2;
  }
  if (c.checkpoint_dir.empty() && c.restore) {
    std::fprintf(stderr, "pskv-mnist: --restore needs --checkpoint-dir\n");
    return 2;
  }

  try {
    int rank = 0, size = 0;
    if (c.local) {
      c.mode = ConsistencyMode::asp;
      const TrainResult r = run_local(c);
      std::printf("final test accuracy %.2f%% (%.0f samples/s, %.1f s)\n", r.test_accuracy * 100, r.samples_per_s,
                  r.wall_s);
      if (c.json) std::printf("%s\n", result_json(c, r, "local").c_str());
      return 0;
    }
    if (c.launch) {
      const TrainResult r = launch(c);
      std::printf("final test accuracy %.2f%% (%.0f samples/s over %d workers, max staleness %llu, %.1f s)\n",
                  r.test_accuracy * 100, r.samples_per_s, c.workers, static_cast<unsigned long long>(r.max_staleness),
                  r.wall_s);
      if (c.json) std::printf("%s\n", result_json(c, r, std::string(to_string(c.mode))).c_str());
      if (c.compare_local) {
        TrainConfig l = c;
        l.local = true;
        l.threads = c.threads * c.workers;
        l.quiet = true;
        l.csv.clear();
        const TrainResult base = run_local(l);
        std::printf("local baseline with %d threads: %.0f samples/s, accuracy %.2f%%; PS/local samples/s ratio %.3f\n",
                    l.threads, base.samples_per_s, base.test_accuracy * 100, r.samples_per_s / base.samples_per_s);
        if (c.json) std::printf("%s\n", result_json(l, base, "local").c_str());
      }
      return 0;
    }
    if (cluster_rank(&rank, &size)) {
      if (size != c.servers + c.workers) {
        std::fprintf(stderr, "pskv-mnist: %d ranks but --servers %d + --workers %d = %d\n", size, c.servers, c.workers,
                     c.servers + c.workers);
        return 2;
      }
      const auto uris = cluster_servers(c);
      if (rank < c.servers) {
        std::fprintf(stderr, "pskv-mnist: rank %d serves %s\n", rank, uris[static_cast<std::size_t>(rank)].c_str());
        return run_server(c, rank, uris, c.restore);
      }
      const int worker = rank - c.servers;
      if (worker != 0) c.quiet = true;
      const TrainResult r = run_worker(c, worker, uris);
      if (worker == 0) {
        std::printf("final test accuracy %.2f%% (worker 0: %.0f samples/s, max staleness %llu)\n",
                    r.test_accuracy * 100, r.samples_per_s, static_cast<unsigned long long>(r.max_staleness));
        if (c.json) std::printf("%s\n", result_json(c, r, std::string(to_string(c.mode))).c_str());
      }
      return 0;
    }
    std::fprintf(stderr, "pskv-mnist: say --launch (this node), --local (no PS), or run under mpirun/srun\n");
    return 2;
  } catch (const Error& e) {
    std::fprintf(stderr, "pskv-mnist: %s\n", e.what());
    return 1;
  }
}
