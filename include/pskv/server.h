// A pskv server shard. Construct it to start serving on its URI; destroy it (or stop()) to stop.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "pskv/types.h"
#include "pskv/update_rule.h"

namespace pskv {

struct ServerOptions {
  std::string uri = "tcp://127.0.0.1:9700";  // tcp://host:port (port 0 picks one), shm://name, rdma://host:port
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
  // tcp: what one peer may hold (docs/ARCHITECTURE.md, "Hostile peers"). Connections from one
  // IP address; time to finish hello (and the token challenge); time to move one frame, either
  // way, beyond which its connection is closed (plus 1 s per 16 MiB of the frame); and the bytes
  // all connections' frame buffers and copied replies may take together.
  std::uint32_t max_connections_per_address = 256;
  std::chrono::milliseconds handshake_timeout{5000};
  std::chrono::milliseconds frame_timeout{5000};
  std::uint64_t memory_budget_bytes = 1ull << 30;
  // Checkpoints: the shard is written to checkpoint_dir every checkpoint_interval (0: only at
  // stop) and at stop; restore_dir loads this server's shard from there before serving.
  std::string checkpoint_dir;
  std::chrono::milliseconds checkpoint_interval{0};
  std::string restore_dir;
  // tcp/rdma: a file holding a shared secret (mode 0600). Every connection must then pass an
  // HMAC-SHA256 challenge before it is served; refused peers are logged. shm:// ignores it.
  std::string auth_token_file;
  std::uint32_t shm_slots = 64;                 // shm: client slots (one per connected client)
  std::uint64_t shm_slot_bytes = 32ull << 20;   // shm: staging area per client for pushes
  // shm: who applies a push. "worker": the client itself, under the stripe lock with an undo
  // record the server rolls back if the client dies mid-way (no hand-off between cores);
  // "server": a server thread, from the client's slot.
  std::string shm_push = "worker";
  // tcp: how a push too large for a connection's receive buffer (256 KiB) is applied. "pieces":
  // as it arrives, each key or 256 KiB piece of a longer key as soon as it is in, so such a key
  // is atomic per piece; "whole": staged whole first, then applied atomically per key.
  std::string tcp_push = "pieces";
  // rdma: rdma_cm picks the device and port by the URI's IP address; these (like the URI's
  // ?dev=NAME&port=N&gid=INDEX) only check that choice, and fail naming it if it differs.
  std::string rdma_device;                      // e.g. mlx5_0, rxe0; empty: whichever owns the address
  int rdma_ib_port = -1;                        // -1: any
  int rdma_gid_index = -1;                      // -1: any
  std::uint32_t rdma_queue_depth = 64;          // rdma: requests in flight per client (receive buffers)
  std::uint64_t rdma_recv_bytes = 32ull << 20;  // rdma: per-client receive region; bounds one push
  bool rdma_busy_poll = false;                  // rdma: spin on completion queues instead of sleeping
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
  void stop();

 private:
  std::unique_ptr<detail::ServerImpl> impl_;
};

}  // namespace pskv
