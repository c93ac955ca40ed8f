#include "pskv/server.h"

#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "common/log.h"
#include "server/checkpoint.h"

#include "server/shard_engine.h"
#include "transport/shm/shm_server.h"
#include "transport/tcp/tcp_server.h"
#include "transport/uri.h"
#if PSKV_WITH_RDMA
#include "transport/rdma/rdma_server.h"
#endif

namespace pskv {
namespace detail {
namespace {
// A ServerOptions field that names one of two behaviours; true for `first`.
bool choose(const char* field, const std::string& value, const char* first, const char* second) {
  if (value != first && value != second)
    throw Error(Errc::invalid_argument, std::string(field) + " must be \"" + first + "\" or \"" + second + "\", got \"" +
                                            value + "\"");
  return value == first;
}

[[noreturn]] void reject(const std::string& why) { throw Error(Errc::invalid_argument, why); }

bool finite_at_least(float v, float low) { return std::isfinite(v) && v >= low; }

// Options that would make the server wait forever, compute NaNs or silently ignore what was
// asked are refused before anything starts, naming the flag.
void validate(const ServerOptions& o) {
  using std::to_string;
  if (o.wait_timeout.count() <= 0)
    reject("--wait-timeout-ms must be positive (got " + to_string(o.wait_timeout.count()) +
           "): it bounds how long a read waits for a stalled worker");
  if (o.handshake_timeout.count() <= 0) reject("--handshake-timeout-ms must be positive");
  if (o.frame_timeout.count() <= 0) reject("--frame-timeout-ms must be positive");
  if (o.checkpoint_interval.count() < 0) reject("--checkpoint-every-s must not be negative");
  if (o.staleness != 0 && o.mode != ConsistencyMode::ssp)
    reject("--staleness " + to_string(o.staleness) + " applies to --mode ssp only, not " +
           std::string(to_string(o.mode)));
  if (o.sync_required != 0 && o.mode != ConsistencyMode::sync)
    reject("--sync-required applies to --mode sync only, not " + std::string(to_string(o.mode)));
  if (o.mode == ConsistencyMode::sync && o.sync_required > o.num_workers)
    reject("--sync-required " + to_string(o.sync_required) + " exceeds --workers " + to_string(o.num_workers));
  if (o.mode != ConsistencyMode::asp && o.num_workers == 0)
    reject("--mode " + std::string(to_string(o.mode)) + " needs --workers: the clocks it bounds reads by");
  const UpdateRuleConfig& r = o.rule;
  if (!finite_at_least(r.lr, 0)) reject("--lr must be a finite number >= 0, got " + to_string(r.lr));
  if (!finite_at_least(r.momentum, 0) || r.momentum >= 1)
    reject("--momentum must be in [0, 1), got " + to_string(r.momentum));
  if (!finite_at_least(r.beta1, 0) || r.beta1 >= 1) reject("--beta1 must be in [0, 1), got " + to_string(r.beta1));
  if (!finite_at_least(r.beta2, 0) || r.beta2 >= 1) reject("--beta2 must be in [0, 1), got " + to_string(r.beta2));
  if (!std::isfinite(r.eps) || r.eps <= 0) reject("--eps must be a finite number > 0, got " + to_string(r.eps));
  if (!finite_at_least(r.weight_decay, 0))
    reject("--weight-decay must be a finite number >= 0, got " + to_string(r.weight_decay));
  if (o.max_connections == 0) reject("--max-connections must be positive");
  if (o.max_connections_per_address == 0) reject("--max-connections-per-address must be positive");
  if (o.max_request_bytes == 0) reject("--max-request-mb must be positive");
  if (o.max_keys_per_request == 0) reject("--max-keys-per-request must be positive");
  if (o.memory_budget_bytes < o.max_request_bytes)
    reject("--memory-budget-mb (" + to_string(o.memory_budget_bytes >> 20) + ") must be at least --max-request-mb (" +
           to_string(o.max_request_bytes >> 20) + "), or a largest request could never be served");
}
}  // namespace

class ServerImpl {
 public:
  explicit ServerImpl(const ServerOptions& o) : uri_(parse_uri(o.uri)), options_(o) {
    validate(o);
    ShardEngine* engine = nullptr;
    EngineOptions e;
    e.store.arena_bytes = o.arena_bytes;
    e.store.max_keys = o.max_keys;
    e.store.stripes = o.stripes;
    e.store.rule = o.rule;
    e.num_workers = o.num_workers;
    e.mode = o.mode;
    e.staleness = o.staleness;
    e.sync_required = o.sync_required;
    e.wait_timeout = o.wait_timeout;
    e.straggler = o.straggler;
    e.server_id = o.server_id;
    wire::Limits limits;
    limits.max_keys = o.max_keys_per_request;
    limits.max_payload_bytes = o.max_request_bytes;
    const std::shared_ptr<const auth::Token> token =
        o.auth_token_file.empty() ? nullptr : auth::Token::load_file(o.auth_token_file);
    const std::uint32_t cores = std::max(1u, std::thread::hardware_concurrency());
    const std::uint32_t threads = o.io_threads ? o.io_threads : cores;
    // shm clients always share this machine, and its server threads poll before they sleep: one
    // per core left the clients' spinning waiters none, and two 64-byte pushers on 2 cores fell
    // from ~900 K to ~25 K operations/s. Half the cores leaves the other half to the clients.
    const std::uint32_t shm_threads = o.io_threads ? o.io_threads : std::max(1u, cores / 2);
    auto prepare = [&](ShardEngine& engine) {
      if (o.restore_dir.empty()) return;
      const std::string path = checkpoint_path(o.restore_dir, o.server_id);
      const CheckpointInfo info = read_checkpoint(engine.store(), path);
      log::info("checkpoint", "server " + std::to_string(o.server_id) + " restored " + std::to_string(info.keys) +
                                  " keys from " + path);
    };
    if (uri_.scheme == "tcp") {
      const bool push_in_pieces = choose("tcp_push", o.tcp_push, "pieces", "whole");
      engine_ = std::make_unique<ShardEngine>(e);
      prepare(*engine_);
      tcp_ = std::make_unique<tcp::TcpServer>(*engine_, uri_,
                                              tcp::TcpServerOptions{.io_threads = threads,
                                                                    .max_connections = o.max_connections,
                                                                    .max_connections_per_address =
                                                                        o.max_connections_per_address,
                                                                    .frame_timeout = o.frame_timeout,
                                                                    .handshake_timeout = o.handshake_timeout,
                                                                    .memory_budget_bytes = o.memory_budget_bytes,
                                                                    .limits = limits,
                                                                    .push_in_pieces = push_in_pieces,
                                                                    .token = token});
      uri_.port = tcp_->port();
      engine = engine_.get();
    } else if (uri_.scheme == "shm") {
      const bool worker_push = choose("shm_push", o.shm_push, "worker", "server");
      shm_ = std::make_unique<shm::ShmServer>(
          uri_.name, e,
          shm::ShmServerOptions{.threads = shm_threads,
                                .slots = o.shm_slots,
                                .slot_data_bytes = o.shm_slot_bytes,
                                .worker_push = worker_push},
          prepare);
      engine = &shm_->engine();
#if PSKV_WITH_RDMA
    } else if (uri_.scheme == "rdma") {
      rdma_ = std::make_unique<rdma::RdmaServer>(uri_, e,
                                                 rdma::RdmaServerOptions{.threads = threads,
                                                                         .max_connections = o.max_connections,
                                                                         .queue_depth = o.rdma_queue_depth,
                                                                         .region_bytes = o.rdma_recv_bytes,
                                                                         .device = o.rdma_device,
                                                                         .ib_port = o.rdma_ib_port,
                                                                         .gid_index = o.rdma_gid_index,
                                                                         .busy_poll = o.rdma_busy_poll,
                                                                         .limits = limits,
                                                                         .token = token},
                                                 prepare);
      uri_.port = rdma_->port();
      uri_.params.clear();  // the device choice is the server's; clients name their own
      engine = &rdma_->engine();
#endif
    } else {
      throw Error(Errc::unsupported, "the " + uri_.scheme + " transport is not available in this build");
    }
    engine_view_ = engine;
    if (!o.checkpoint_dir.empty() && o.checkpoint_interval.count() > 0)
      checkpointer_ = std::thread([this] { checkpoint_loop(); });
  }

  void checkpoint() {
    std::lock_guard lock(checkpoint_mu_);
    write_checkpoint(engine_view_->store(), options_.checkpoint_dir, options_.server_id);
  }

  void checkpoint_loop() {
    std::unique_lock lock(stop_mu_);
    while (!stop_cv_.wait_for(lock, options_.checkpoint_interval, [&] { return stopping_; })) {
      lock.unlock();
      try {
        checkpoint();
      } catch (const Error& e) {
        log::error("checkpoint", "server " + std::to_string(options_.server_id) + ": checkpoint failed: " + e.what());
      }
      lock.lock();
    }
  }

  ~ServerImpl() { stop(); }

  void stop() {
    {
      std::lock_guard lock(stop_mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    stop_cv_.notify_all();
    if (checkpointer_.joinable()) checkpointer_.join();
    if (tcp_) tcp_->stop();
    // The final checkpoint sees every acknowledged push: the transports are drained first.
    if (!options_.checkpoint_dir.empty()) {
      try {
        checkpoint();
      } catch (const Error& e) {
        log::error("checkpoint",
                   "server " + std::to_string(options_.server_id) + ": final checkpoint failed: " + e.what());
      }
    }
    if (shm_) shm_->stop();
#if PSKV_WITH_RDMA
    if (rdma_) rdma_->stop();
#endif
    if (engine_) engine_->shutdown();
  }

  std::string uri() const { return uri_.str(); }
  std::string stats_json() const { return shm_ ? shm_->stats_json() : engine_view_->stats_json(); }
  std::string failure() const { return engine_view_->failure(); }
  bool workers_finished() const {
    ClockTable* clocks = engine_view_->clocks();
    if (!clocks) return false;
    for (std::uint32_t w = 0; w < clocks->workers(); ++w)
      if (!clocks->evicted(w) && clocks->clock(w) != kClockDone) return false;
    return true;
  }

 private:
  Uri uri_;
  ServerOptions options_;
  ShardEngine* engine_view_ = nullptr;
  std::mutex checkpoint_mu_, stop_mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;
  std::thread checkpointer_;
  std::unique_ptr<ShardEngine> engine_;
  std::unique_ptr<tcp::TcpServer> tcp_;
  std::unique_ptr<shm::ShmServer> shm_;
#if PSKV_WITH_RDMA
  std::unique_ptr<rdma::RdmaServer> rdma_;
#endif
};

}  // namespace detail

Server::Server(const ServerOptions& options) : impl_(std::make_unique<detail::ServerImpl>(options)) {}
Server::~Server() = default;
std::string Server::uri() const { return impl_->uri(); }
std::string Server::stats_json() const { return impl_->stats_json(); }
bool Server::workers_finished() const { return impl_->workers_finished(); }
std::string Server::failure() const { return impl_->failure(); }
void Server::stop() { impl_->stop(); }

}  // namespace pskv
