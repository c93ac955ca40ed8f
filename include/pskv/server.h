// A pskv server shard. Construct it to start serving on its URI; destroy it (or stop()) to stop.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pskv/types.h"
#include "pskv/update_rule.h"

namespace pskv {

struct ServerOptions {
  // tcp://host:port (port 0 picks one), shm://name, rdma://host:port, fake://name (in-process,
  // for tests), each with its backend's own ?key=value settings (docs/protocol.md, "Server
  // URIs"): e.g. shm://job?clients=64&area_mb=32&push=worker, tcp://0.0.0.0:9700?push=pieces.
  std::string uri = "tcp://127.0.0.1:9700";
  std::uint32_t server_id = 0;
  // Workers that clock against this server; 0 allows only anonymous ASP clients.
  std::uint32_t num_workers = 0;
  ConsistencyMode mode = ConsistencyMode::asp;
  std::uint32_t staleness = 0;      // ssp
  std::uint32_t sync_required = 0;  // sync: apply once K of N gradients arrived (0 = N)
  std::chrono::milliseconds wait_timeout{10000};
  StragglerPolicy straggler = StragglerPolicy::fail;
  UpdateRuleConfig rule{};
  std::uint64_t arena_bytes = 256ull << 20;
  std::uint64_t max_keys = 1u << 20;
  std::uint32_t stripes = 1024;
  std::uint32_t io_threads = 0;  // 0: one per core
  std::uint32_t max_connections = 1024;
  // Bounds one request's payload and one reply's (a pull asking for more is refused).
  std::uint64_t max_request_bytes = 256ull << 20;
  std::uint32_t max_keys_per_request = 1u << 20;
  // What one peer may hold, where the backend has peers to bound (tcp today; docs/ARCHITECTURE.md,
  // "Hostile peers"): connections from one IP address; time to finish hello (and the token
  // challenge); time to move one frame, either way, beyond which its connection is closed (plus
  // 1 s per 16 MiB of the frame); and the bytes all connections' frame buffers, copied replies and
  // parked requests may take together.
  std::uint32_t max_connections_per_address = 256;
  std::chrono::milliseconds handshake_timeout{5000};
  std::chrono::milliseconds frame_timeout{5000};
  std::uint64_t memory_budget_bytes = 1ull << 30;
  // rdma: what all connections of the process pin together (each its receive region and
  // buffers, for its life); 0: half the machine's memory. A connect past it is refused.
  std::uint64_t rdma_pinned_bytes = 0;
  // Embedding tables (Client::create_table): what all tables' rows may take at their caps. A table
  // whose cap would pass it is refused; one created without max_rows gets what is left. With
  // replicas (tcp), it also holds the copies of the predecessors' tables: a table costs its cap
  // once per replica, and one without max_rows gets 1/replicas of what is left.
  std::uint64_t table_memory_bytes = 4ull << 30;
  // Checkpoints: the shard is written to checkpoint_dir every checkpoint_interval (0: only at
  // stop) and at stop; restore_dir loads this server's shard from there before serving.
  std::string checkpoint_dir;
  std::chrono::milliseconds checkpoint_interval{0};
  std::string restore_dir;
  // tcp/rdma: a file holding a shared secret (mode 0600). Every connection must then pass an
  // HMAC-SHA256 challenge before it is served; refused peers are logged. shm:// ignores it.
  std::string auth_token_file;
  // tcp and rdma with replicas: the secret the servers of the ring prove to each other, so that no client
  // holding auth_token_file can send the replication ops. Empty: auth_token_file.
  std::string peer_token_file;
  // Replication (tcp and rdma): every server's keys are also kept by the next replicas - 1 servers of
  // `peers` (every server's URI, in server-id order, the same list on every server and in the
  // clients' ClientOptions::servers). An init or push is acknowledged once every live replica
  // holds it. `rejoin`: this server restarts after a failure and takes its keys back from a
  // synced replica before serving (docs/ARCHITECTURE.md, "Replication").
  std::uint32_t replicas = 1;
  std::vector<std::string> peers;
  // Empty: the ring runs on `uri` (rdma:// servers replicate over verbs). Set on an rdma://
  // server, it takes its peers' replication traffic on this tcp:// address instead (its own
  // listener, on the same store), and `peers` then lists every server's peer_uri. Not used with
  // a tcp:// `uri`, which carries both.
  std::string peer_uri;
  bool rejoin = false;
  // Failover (tcp, replicas >= 2, at least 3 peers; docs/ARCHITECTURE.md, "Failover"): a server
  // silent for failover_timeout (0: off) is certified down by a majority of the servers, and the
  // next server of its chain serves its keys from its replica, at a new port of its host that
  // clients with retry_timeout find by themselves. A server certified down stops (deposed()).
  // failover_dir keeps this server's votes across restarts (it must never vote twice).
  std::chrono::milliseconds failover_timeout{0};
  std::string failover_dir;
};

namespace detail {
class ServerImpl;
}

// Thread-safety: all members may be called from any thread.
class Server {
 public:
  explicit Server(const ServerOptions& options);  // throws Error when it cannot serve
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // The URI clients should use (with the real port when 0 was asked for).
  std::string uri() const;
  std::string stats_json() const;
  // True once every worker has finished (its client closed cleanly) or was evicted.
  bool workers_finished() const;
  // Non-empty once the job cannot go on under --straggler-policy fail: which worker died or
  // stalled. A launcher should stop the job (the workers get their own errors).
  std::string failure() const;
  // Non-empty once a majority certified this server down (failover): why. It has stopped
  // serving; another server holds its keys.
  std::string deposed() const;
  void stop();

 private:
  std::unique_ptr<detail::ServerImpl> impl_;
};

}  // namespace pskv
