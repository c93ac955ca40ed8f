#include "pskv/server.h"

#include <thread>

#include "server/shard_engine.h"
#include "transport/shm/shm_server.h"
#include "transport/tcp/tcp_server.h"
#include "transport/uri.h"

namespace pskv {
namespace detail {

class ServerImpl {
 public:
  explicit ServerImpl(const ServerOptions& o) : uri_(parse_uri(o.uri)) {
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
    if (o.mode == ConsistencyMode::sync && o.sync_required > o.num_workers)
      throw Error(Errc::invalid_argument, "--sync-required " + std::to_string(o.sync_required) + " exceeds --workers " +
                                              std::to_string(o.num_workers));
    wire::Limits limits;
    limits.max_keys = o.max_keys_per_request;
    limits.max_payload_bytes = o.max_request_bytes;
    const std::uint32_t threads = o.io_threads ? o.io_threads : std::max(1u, std::thread::hardware_concurrency());
    if (uri_.scheme == "tcp") {
      engine_ = std::make_unique<ShardEngine>(e);
      tcp_ = std::make_unique<tcp::TcpServer>(
          *engine_, uri_, tcp::TcpServerOptions{.io_threads = threads, .max_connections = o.max_connections, .limits = limits});
      uri_.port = tcp_->port();
    } else if (uri_.scheme == "shm") {
      shm_ = std::make_unique<shm::ShmServer>(
          uri_.name, e,
          shm::ShmServerOptions{.threads = threads, .slots = o.shm_slots, .slot_data_bytes = o.shm_slot_bytes});
    } else {
      throw Error(Errc::unsupported, "the " + uri_.scheme + " transport is not available in this build");
    }
  }

  ~ServerImpl() { stop(); }

  void stop() {
    if (tcp_) tcp_->stop();
    if (shm_) shm_->stop();
    if (engine_) engine_->shutdown();
  }

  std::string uri() const { return uri_.str(); }
  std::string stats_json() const { return shm_ ? shm_->engine().stats_json() : engine_->stats_json(); }

 private:
  Uri uri_;
  std::unique_ptr<ShardEngine> engine_;
  std::unique_ptr<tcp::TcpServer> tcp_;
  std::unique_ptr<shm::ShmServer> shm_;
};

}  // namespace detail

Server::Server(const ServerOptions& options) : impl_(std::make_unique<detail::ServerImpl>(options)) {}
Server::~Server() = default;
std::string Server::uri() const { return impl_->uri(); }
std::string Server::stats_json() const { return impl_->stats_json(); }
void Server::stop() { impl_->stop(); }

}  // namespace pskv
