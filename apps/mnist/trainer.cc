#include "trainer.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>

#include "model.h"
#include "progress.h"
#include "pskv/client.h"
#include "pskv/error.h"
#include "pskv/server.h"
#include "transport/tcp/socket.h"

namespace pskv::mnist {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Data {
  Dataset train, test;
};

Data load(const TrainConfig& c, int rank, int workers, bool need_test) {
  Data d;
  Dataset all = load_dataset(c.data_dir, Split::train, c.dataset);
  if (c.train_limit && c.train_limit < all.n) all = head(all, c.train_limit);
  d.train =
      workers > 1 ? shard(all, static_cast<std::size_t>(rank), static_cast<std::size_t>(workers)) : std::move(all);
  if (need_test) {
    d.test = load_dataset(c.data_dir, Split::test, c.dataset);
    if (c.test_limit && c.test_limit < d.test.n) d.test = head(d.test, c.test_limit);
  }
  return d;
}

double accuracy(Model& m, const Dataset& test) {
  return test.n ? double(m.count_correct(test.images.data(), test.labels.data(), test.n)) / double(test.n) : 0.0;
}

// Batches of a shard in a fresh order every epoch.
class Batcher {
 public:
  Batcher(const Dataset& d, std::size_t batch, std::uint64_t seed) : d_(d), batch_(batch), rng_(seed) {
    order_.resize(d.n);
    std::iota(order_.begin(), order_.end(), 0u);
    images_.resize(batch * d.rows * d.cols);
    labels_.resize(batch);
  }
  std::size_t steps() const { return d_.n / batch_; }
  void shuffle() { std::shuffle(order_.begin(), order_.end(), rng_); }
  void fill(std::size_t step) {
    gather(d_, std::span<const std::uint32_t>(order_.data() + step * batch_, batch_), images_.data(), labels_.data());
  }
  const float* images() const { return images_.data(); }
  const std::uint8_t* labels() const { return labels_.data(); }

 private:
  const Dataset& d_;
  std::size_t batch_;
  std::mt19937_64 rng_;
  std::vector<std::uint32_t> order_;
  std::vector<float> images_;
  std::vector<std::uint8_t> labels_;
};

void straggle(const TrainConfig& c, int rank, Clock::time_point compute_start) {
  if (rank != c.straggler_worker || c.straggler_factor <= 1.0) return;
  const auto compute = Clock::now() - compute_start;
  std::this_thread::sleep_for(
      std::chrono::duration_cast<std::chrono::microseconds>(compute * (c.straggler_factor - 1.0)));
}

}  // namespace

std::string result_json(const TrainConfig& c, const TrainResult& r, const std::string& mode_name) {
  char buf[768];
  std::snprintf(buf, sizeof buf,
                "{\"mode\":\"%s\",\"staleness\":%u,\"transport\":\"%s\",\"workers\":%d,\"servers\":%d,\"model\":\"%s\","
                "\"dataset\":\"%s\",\"epochs\":%d,\"batch\":%d,\"lr\":%g,\"threads\":%d,\"test_accuracy\":%.4f,"
                "\"samples_per_s\":%.1f,\"max_staleness\":%llu,\"wall_s\":%.2f,\"time_to_target_s\":%.2f,"
                "\"target_accuracy\":%.4f,\"server_restarts\":%d}",
                mode_name.c_str(), c.staleness, c.local ? "none" : c.transport.c_str(), c.local ? 1 : c.workers,
                c.local ? 0 : c.servers, c.model.c_str(), std::string(to_string(c.dataset)).c_str(), c.epochs, c.batch,
                double(c.lr), c.threads, r.test_accuracy, r.samples_per_s,
                static_cast<unsigned long long>(r.max_staleness), r.wall_s, r.time_to_target_s, c.target_accuracy,
                r.reconnects);
  return buf;
}

TrainResult run_local(const TrainConfig& c) {
  Data d = load(c, 0, 1, true);
  auto model = make_model(c.model, c.threads);
  model->init(c.seed);
  Batcher batches(d.train, static_cast<std::size_t>(c.batch), c.seed);
  Progress progress(c.quiet, c.csv);
  TrainResult r;
  const std::size_t steps = batches.steps();
  const std::size_t eval_every = std::max<std::size_t>(1, steps / std::max(1, c.evals_per_epoch));
  const auto start = Clock::now();
  double eval_s = 0;
  for (int epoch = 0; epoch < c.epochs; ++epoch) {
    batches.shuffle();
    for (std::size_t s = 0; s < steps; ++s) {
      batches.fill(s);
      const float loss = sgd_step(*model, batches.images(), batches.labels(), static_cast<std::size_t>(c.batch), c.lr);
      r.samples += static_cast<std::uint64_t>(c.batch);
      const double sps = double(r.samples) / std::max(1e-9, since(start) - eval_s);
      progress.step(epoch, c.epochs, s, steps, loss, sps, 0);
      if ((s + 1) % eval_every == 0 || s + 1 == steps) {
        const auto e0 = Clock::now();
        const double acc = accuracy(*model, d.test);
        eval_s += since(e0);
        progress.eval(epoch, s + 1, r.samples, loss, acc, sps, 0);
        if (c.target_accuracy > 0 && r.time_to_target_s < 0 && acc >= c.target_accuracy)
          r.time_to_target_s = since(start);
        r.test_accuracy = acc;
      }
    }
  }
  progress.finish();
  r.wall_s = since(start);
  r.samples_per_s = double(r.samples) / std::max(1e-9, r.wall_s - eval_s);
  return r;
}

TrainResult run_worker(const TrainConfig& c, int rank, const std::vector<std::string>& servers) {
  const bool chief = rank == 0;
  Data d = load(c, rank, c.workers, chief);
  auto model = make_model(c.model, c.threads);
  model->init(c.seed + static_cast<std::uint64_t>(rank));
  const std::vector<ParamBlock> blocks = model->params();
  std::vector<Key> keys(blocks.size());
  std::iota(keys.begin(), keys.end(), Key{0});
  std::vector<std::span<float>> values;
  std::vector<std::span<const float>> grads, initial;
  for (const auto& b : blocks) {
    values.emplace_back(b.value, b.size);
    grads.emplace_back(b.grad, b.size);
    initial.emplace_back(b.value, b.size);
  }
  Batcher batches(d.train, static_cast<std::size_t>(c.batch), c.seed * 7919 + static_cast<std::uint64_t>(rank));
  Progress progress(c.quiet || !chief, chief ? c.csv : std::string());
  TrainResult r;
  const std::size_t steps = batches.steps();
  const std::size_t eval_every = std::max<std::size_t>(1, steps / std::max(1, c.evals_per_epoch));

  ClientOptions o;
  o.servers = servers;
  o.worker_id = static_cast<std::uint32_t>(rank);
  o.chunk_floats = c.chunk_floats;
  o.auth_token_file = c.auth_token_file;
  o.io_timeout = std::chrono::milliseconds(c.wait_timeout_ms + 10000);
  // With replicas a killed server comes back holding every push and clock it acknowledged, and
  // the client sends it what it had not answered, each push applied once: the worker never sees
  // the failure (redoing the step, as below, would apply that step's gradients twice).
  if (c.replicas > 1) o.retry_timeout = std::chrono::seconds(60);
  std::unique_ptr<Client> client;
  // Connects (servers may still be starting, or restarting from a checkpoint) and makes sure
  // every key exists; the first initialiser wins, so restored or earlier values are kept.
  auto connect = [&](std::uint64_t clock) {
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    for (;;) {
      try {
        if (client) client->disconnect();  // not "finished": this worker is coming back
        client.reset();
        o.initial_clock = clock;
        client = std::make_unique<Client>(o);
        for (const auto& b : blocks) client->register_buffer(b.value, b.size * sizeof(float));
        for (const auto& b : blocks) client->register_buffer(b.grad, b.size * sizeof(float));
        client->wait(client->init(keys, initial));
        return;
      } catch (const Error& e) {
        if (Clock::now() > deadline) throw;
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
    }
  };
  connect(0);
  client->barrier();

  const auto start = Clock::now();
  double eval_s = 0;
  std::uint64_t step_clock = 0;
  for (int epoch = 0; epoch < c.epochs; ++epoch) {
    batches.shuffle();
    for (std::size_t s = 0; s < steps;) {
      try {
        batches.fill(s);
        client->wait(client->pull(keys, values));  // straight into the model's weights
        const auto compute_start = Clock::now();
        const float loss =
            model->forward_backward(batches.images(), batches.labels(), static_cast<std::size_t>(c.batch));
        straggle(c, rank, compute_start);
        // Straight from the model's gradients. The clock is ordered behind the push on every
        // backend, so one round trip covers both; the push ticket is done by the time clock()
        // returns, and must be, since the next forward_backward overwrites these buffers.
        const Ticket pushed = client->push(keys, grads);
        client->clock();
        client->wait(pushed);
        ++step_clock;
        r.samples += static_cast<std::uint64_t>(c.batch);
        r.max_staleness = std::max(r.max_staleness, client->staleness().max);
        const double sps = double(r.samples) * c.workers / std::max(1e-9, since(start) - eval_s);
        if (chief) {
          progress.step(epoch, c.epochs, s, steps, loss, sps, r.max_staleness);
          if ((s + 1) % eval_every == 0 || s + 1 == steps) {
            const auto e0 = Clock::now();
            const double acc = accuracy(*model, d.test);
            eval_s += since(e0);
            progress.eval(epoch, s + 1, r.samples * static_cast<std::uint64_t>(c.workers), loss, acc, sps,
                          r.max_staleness);
            if (c.target_accuracy > 0 && r.time_to_target_s < 0 && acc >= c.target_accuracy)
              r.time_to_target_s = since(start);
          }
        }
        ++s;
      } catch (const Error& e) {
        // A server restarting from its checkpoint shows up as a lost connection: reconnect and
        // redo this step. Anything else, or no checkpoints to come back from, ends the worker.
        const bool recoverable =
            (e.code() == Errc::peer_failure || e.code() == Errc::timeout) && !c.checkpoint_dir.empty();
        if (!recoverable || r.reconnects >= 20) throw;
        std::fprintf(stderr, "worker %d: %s; reconnecting\n", rank, e.what());
        ++r.reconnects;
        connect(step_clock);
      }
    }
  }
  r.wall_s = since(start);
  r.samples_per_s = double(r.samples) / std::max(1e-9, r.wall_s - eval_s);
  // Everyone's last pushes are in once all reached the barrier; the chief then scores the model.
  client->barrier();
  if (chief) {
    client->wait(client->pull(keys, values));
    r.test_accuracy = accuracy(*model, d.test);
    progress.finish();
  }
  r.max_staleness = std::max(r.max_staleness, client->staleness().max);
  return r;
}

namespace {
// Where the servers of a job keep their failover votes: beside its checkpoints, or in /tmp.
std::string failover_dir(const TrainConfig& c) {
  return c.checkpoint_dir.empty() ? "/tmp/" + c.job + "-failover" : c.checkpoint_dir + "/failover";
}

ServerOptions server_options(const TrainConfig& c, int server_id, const std::vector<std::string>& uris, bool restore) {
  ServerOptions so;
  const std::string& uri = uris[static_cast<std::size_t>(server_id)];
  // shm: one client area per worker and a few for tools, each with room for a layer's push; a
  // server restarted after a kill adopts its predecessor's segment and loses nothing.
  so.uri =
      uri.rfind("shm://", 0) == 0 ? uri + "?clients=" + std::to_string(c.workers + 4) + "&area_mb=16&adopt=1" : uri;
  so.server_id = static_cast<std::uint32_t>(server_id);
  so.num_workers = static_cast<std::uint32_t>(c.workers);
  so.mode = c.mode;
  so.staleness = c.mode == ConsistencyMode::ssp ? c.staleness : 0;
  so.sync_required = c.mode == ConsistencyMode::sync ? static_cast<std::uint32_t>(c.workers) - c.backup_workers : 0;
  so.wait_timeout = std::chrono::milliseconds(c.wait_timeout_ms);
  so.straggler = c.evict_stragglers ? StragglerPolicy::evict : StragglerPolicy::fail;
  so.rule.rule = *parse_update_rule(c.rule);
  so.rule.lr = c.lr;
  so.rule.momentum = c.momentum;
  so.arena_bytes = 64ull << 20;
  so.max_keys = 4096;
  so.io_threads = 1;
  so.checkpoint_dir = c.checkpoint_dir;
  so.auth_token_file = c.auth_token_file;
  so.checkpoint_interval = std::chrono::seconds(c.checkpoint_dir.empty() ? 0 : c.checkpoint_every_s);
  if (restore) so.restore_dir = c.checkpoint_dir;
  if (c.replicas > 1) {
    so.replicas = static_cast<std::uint32_t>(c.replicas);
    so.peers = uris;
    so.rejoin = restore;
  }
  if (c.failover_ms > 0) {
    so.failover_timeout = std::chrono::milliseconds(c.failover_ms);
    so.failover_dir = failover_dir(c);
  }
  return so;
}
}  // namespace

int run_server(const TrainConfig& c, int server_id, const std::vector<std::string>& uris, bool restore) {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGTERM);
  sigaddset(&stop, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  Server server(server_options(c, server_id, uris, restore));
  if (!c.quiet) std::fprintf(stderr, "server %d serving %s\n", server_id, server.uri().c_str());
  const timespec tick{0, 200'000'000};
  std::chrono::steady_clock::time_point failed_at{};
  for (;;) {
    if (sigtimedwait(&stop, nullptr, &tick) > 0) return 0;
    if (server.workers_finished()) return 0;
    if (const std::string why = server.deposed(); !why.empty()) {
      std::fprintf(stderr, "server %d stops: certified down: %s\n", server_id, why.c_str());
      return 3;
    }
    // A failed job must not leave servers behind (srun without kill-on-bad-exit would hang).
    // Linger a few seconds so the surviving workers get their own, more specific errors.
    const std::string failure = server.failure();
    if (!failure.empty()) {
      if (failed_at == std::chrono::steady_clock::time_point{}) failed_at = std::chrono::steady_clock::now();
      if (std::chrono::steady_clock::now() - failed_at > std::chrono::seconds(5)) {
        std::fprintf(stderr, "server %d stops: the job failed: %s\n", server_id, failure.c_str());
        return 3;
      }
    }
  }
}

namespace {

pid_t fork_child(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // a dying launcher takes its job with it
    if (getppid() != parent) _exit(1);
    int rc = 1;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pskv-mnist[%d]: %s\n", getpid(), e.what());
    }
    std::fflush(nullptr);
    _exit(rc);
  }
  return pid;
}

}  // namespace

TrainResult launch(const TrainConfig& config) {
  std::vector<std::string> uris;
  TrainConfig c = config;
  if (c.job.empty()) c.job = "mnist-" + std::to_string(getpid());
  const std::string job = c.job;
  // Votes belong to one ring: a new launch starts with none (an old one would refuse its servers).
  if (std::error_code ignored; c.failover_ms > 0) std::filesystem::remove_all(failover_dir(c), ignored);
  for (int s = 0; s < c.servers; ++s) {
    if (c.transport == "shm")
      uris.push_back("shm://" + job + "-" + std::to_string(s));
    else
      uris.push_back(c.transport + "://" + c.host + ":" +
                     std::to_string(c.port_base ? c.port_base + s : tcp::free_loopback_port()));
  }
  std::vector<pid_t> servers(static_cast<std::size_t>(c.servers));
  auto start_server = [&](int s, bool restore) {
    servers[static_cast<std::size_t>(s)] = fork_child([&, s] { return run_server(c, s, uris, restore); });
  };
  for (int s = 0; s < c.servers; ++s) start_server(s, c.restore);
  if (!c.quiet)
    std::printf("pskv-mnist: %d servers, %d workers over %s, mode %s%s, model %s, %d epochs\n", c.servers, c.workers,
                c.transport.c_str(), std::string(to_string(c.mode)).c_str(),
                c.mode == ConsistencyMode::ssp ? (" s=" + std::to_string(c.staleness)).c_str() : "", c.model.c_str(),
                c.epochs);
  for (int s = 0; s < c.servers; ++s)
    if (!c.quiet)
      std::printf("  server %d: pid %d at %s\n", s, servers[static_cast<std::size_t>(s)],
                  uris[static_cast<std::size_t>(s)].c_str());
  std::fflush(stdout);

  // Each worker reports its result as one line on a pipe.
  std::vector<pid_t> workers;
  std::vector<int> result_fds;
  for (int w = 0; w < c.workers; ++w) {
    int fds[2];
    if (pipe(fds) != 0) throw Error(Errc::io, "pipe failed");
    workers.push_back(fork_child([&, w, fds] {
      ::close(fds[0]);
      const TrainResult r = run_worker(c, w, uris);
      char line[256];
      const int n =
          std::snprintf(line, sizeof line, "%.6f %.3f %llu %llu %.3f %.3f %d\n", r.test_accuracy, r.samples_per_s,
                        static_cast<unsigned long long>(r.samples), static_cast<unsigned long long>(r.max_staleness),
                        r.wall_s, r.time_to_target_s, r.reconnects);
      if (::write(fds[1], line, static_cast<std::size_t>(n)) != n) return 1;
      return 0;
    }));
    ::close(fds[1]);
    result_fds.push_back(fds[0]);
  }

  // Supervise: a worker failing ends the job; a server dying is restarted from its checkpoint
  // when there is one, otherwise the job ends with the workers' errors.
  TrainResult job_result;
  int restarts = 0;
  std::size_t workers_left = workers.size();
  int failures = 0;
  while (workers_left > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, 0);
    if (pid < 0) break;
    auto w = std::find(workers.begin(), workers.end(), pid);
    if (w != workers.end()) {
      --workers_left;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        ++failures;
        std::fprintf(stderr, "pskv-mnist: worker %ld failed (%s %d)\n", long(w - workers.begin()),
                     WIFEXITED(status) ? "exit" : "signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      }
      continue;
    }
    auto s = std::find(servers.begin(), servers.end(), pid);
    if (s == servers.end()) continue;
    const int id = static_cast<int>(s - servers.begin());
    // Only a server that was killed is restarted; one that stopped on its own (the job failed)
    // is not.
    const bool adopts = uris[static_cast<std::size_t>(id)].rfind("shm://", 0) == 0;
    if (c.failover_ms > 0 && workers_left > 0) {
      // Its successor serves its keys (it may have been certified down and stopped): no restart.
      std::fprintf(stderr, "pskv-mnist: server %d ended (%s %d); its successor serves its keys (failover)\n", id,
                   WIFEXITED(status) ? "exit" : "signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      *s = -1;
    } else if ((adopts || c.replicas > 1 || !c.checkpoint_dir.empty()) && workers_left > 0 && WIFSIGNALED(status)) {
      std::fprintf(stderr, "pskv-mnist: server %d died (%s %d); restarting it from %s\n", id,
                   WIFEXITED(status) ? "exit" : "signal", WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
                   adopts           ? "its shared-memory segment"
                   : c.replicas > 1 ? "its replicas"
                                    : c.checkpoint_dir.c_str());
      ++restarts;
      start_server(id, true);
    } else if (workers_left > 0) {
      std::fprintf(stderr, "pskv-mnist: server %d ended (%s %d)%s\n", id, WIFEXITED(status) ? "exit" : "signal",
                   WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status),
                   c.checkpoint_dir.empty() && WIFSIGNALED(status) ? "; no --checkpoint-dir to restart it from" : "");
      *s = -1;
    }
  }
  for (pid_t pid : servers)
    if (pid > 0) ::kill(pid, SIGTERM);
  for (pid_t pid : servers)
    if (pid > 0) ::waitpid(pid, nullptr, 0);

  double sps = 0;
  for (std::size_t w = 0; w < result_fds.size(); ++w) {
    char buf[256] = {};
    const ssize_t n = ::read(result_fds[w], buf, sizeof buf - 1);
    ::close(result_fds[w]);
    if (n <= 0) continue;
    TrainResult r;
    unsigned long long samples = 0, stale = 0;
    std::sscanf(buf, "%lf %lf %llu %llu %lf %lf %d", &r.test_accuracy, &r.samples_per_s, &samples, &stale, &r.wall_s,
                &r.time_to_target_s, &r.reconnects);
    sps += r.samples_per_s;
    job_result.samples += samples;
    job_result.max_staleness = std::max<std::uint64_t>(job_result.max_staleness, stale);
    job_result.wall_s = std::max(job_result.wall_s, r.wall_s);
    if (w == 0) {
      job_result.test_accuracy = r.test_accuracy;
      job_result.time_to_target_s = r.time_to_target_s;
    }
  }
  job_result.samples_per_s = sps;
  job_result.reconnects = restarts;
  if (failures > 0)
    throw Error(Errc::peer_failure, std::to_string(failures) + " worker(s) failed; see the messages above");
  std::error_code ignored;
  if (c.failover_ms > 0 && c.checkpoint_dir.empty()) std::filesystem::remove_all(failover_dir(c), ignored);
  return job_result;
}

bool cluster_rank(int* rank, int* size) {
  const std::pair<const char*, const char*> vars[] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}, {"PMI_RANK", "PMI_SIZE"}, {"SLURM_PROCID", "SLURM_NTASKS"}};
  for (auto [r, s] : vars) {
    // sbatch sets SLURM_PROCID=0 and SLURM_NTASKS for the batch script itself: only a task that
    // srun started (SLURM_STEP_ID) is one of the job's ranks.
    if (std::string_view(r) == "SLURM_PROCID" && !std::getenv("SLURM_STEP_ID")) continue;
    const char* rv = std::getenv(r);
    const char* sv = std::getenv(s);
    if (rv && sv) {
      *rank = std::atoi(rv);
      *size = std::atoi(sv);
      return true;
    }
  }
  return false;
}

std::vector<std::string> cluster_servers(const TrainConfig& c) {
  std::vector<std::string> hosts;
  if (!c.hostfile.empty()) {
    std::ifstream in(c.hostfile);
    if (!in) throw Error(Errc::not_found, "cannot read the hostfile " + c.hostfile);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream words(line);
      std::string host;
      if (words >> host && host[0] != '#') hosts.push_back(host);
    }
    if (hosts.size() < static_cast<std::size_t>(c.servers))
      throw Error(Errc::invalid_argument, "the hostfile " + c.hostfile + " lists " + std::to_string(hosts.size()) +
                                              " hosts but --servers is " + std::to_string(c.servers) +
                                              "; list one line per rank, servers first");
  }
  if (c.port_base == 0 && c.transport != "shm")
    throw Error(Errc::invalid_argument, "cluster runs need --port-base (servers listen on port-base + rank)");
  std::vector<std::string> uris;
  for (int s = 0; s < c.servers; ++s) {
    const std::string host = hosts.empty() ? c.host : hosts[static_cast<std::size_t>(s)];
    if (c.transport == "shm")
      uris.push_back("shm://" + (c.job.empty() ? std::string("mnist-job") : c.job) + "-" + std::to_string(s));
    else
      uris.push_back(c.transport + "://" + host + ":" + std::to_string(c.port_base + s));
  }
  return uris;
}

}  // namespace pskv::mnist
