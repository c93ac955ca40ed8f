// Server side of the RDMA backend. The store region and the clock table are registered once for
// remote READ, so pulls never involve this CPU; each client gets a receive region it WRITEs its
// pushes into, receive buffers for its control SENDs, and its own pair of completion queues.
//
// Threads: one rdma_cm thread accepts, refuses and notices disconnects; a few completion threads
// each own a share of the connections (their CQs share that thread's completion channel) and
// handle a connection's messages strictly in queue-pair order, so a worker's pushes are applied
// before its clock moves. Replies to parked operations (WAIT, barrier), which the engine resumes
// on whatever thread moves the bound, are handed to the owning thread, so only one thread ever
// posts to a queue pair. Idle threads sleep in poll() (or spin with busy polling).
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/shard_engine.h"
#include "transport/auth.h"
#include "transport/rdma/verbs.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv::rdma {

struct RdmaServerOptions {
  std::uint32_t threads = 1;  // completion threads
  std::uint32_t max_connections = 1024;
  std::uint32_t queue_depth = 64;            // receive buffers per client: its messages in flight
  std::uint64_t region_bytes = 32ull << 20;  // per-client receive region: bounds one push
  // Checked against the device rdma_cm routes the URI's address to (URI dev=/port=/gid= too).
  std::string device;
  int ib_port = -1;
  int gid_index = -1;
  bool busy_poll = false;
  // A connection none of whose replies could leave for this long (its client posts no receive
  // buffers, or stopped) is closed: --frame-timeout-ms, as a tcp peer that reads nothing.
  std::chrono::milliseconds reply_timeout{5000};
  // What one peer may hold (tcp's ListenOptions, read for rdma): connections from one IP
  // address; time from accept to a proven token (with a token); and the memory all connections
  // pin together (their receive regions, receive and reply buffers; 0: half the machine's), which
  // a connection that would pass it is refused. Clients may take 7/8 of it: the rest is kept for
  // the other servers of a replicating ring. `pinned` counts it (null: this server's own count).
  std::uint32_t max_connections_per_address = 256;
  std::chrono::milliseconds handshake_timeout{5000};
  std::uint64_t pinned_budget_bytes = 0;
  std::shared_ptr<std::atomic<std::uint64_t>> pinned;
  wire::Limits limits{};
  // When set, a connection gets its remote keys only after passing the HMAC challenge.
  std::shared_ptr<const auth::Token> token;
  // The token another server of a replicating ring proves instead (null: `token`).
  std::shared_ptr<const auth::Token> peer_token;
};

class ServerConn;
class IoThread;

// Thread-safety: construct, stop and destroy from one thread; everything else is internal.
class RdmaServer {
 public:
  // Serves `engine` (its store region is registered for remote reads) and `clocks`, the pinned
  // memory its clock table lives in (empty without workers); both outlive this.
  RdmaServer(const Uri& uri, ShardEngine& engine, const PinnedBuffer& clocks, const RdmaServerOptions& options);
  ~RdmaServer();
  RdmaServer(const RdmaServer&) = delete;
  RdmaServer& operator=(const RdmaServer&) = delete;

  std::uint16_t port() const noexcept { return port_; }
  // What server_stats adds for this backend: the memory its connections pin, and the budget
  // (any thread).
  JsonObject stats_fields() const;
  // The stop, in the order transport::Listener runs it: connect requests are refused ("the
  // server is stopping"); then the connection manager and completion threads are joined, so no
  // request is applied any more (parked ones wait for the engine's shutdown); then every
  // connection's verbs objects, the registrations and the device are released.
  void stop_accepting() noexcept;
  void drain() noexcept;
  void close() noexcept;

 private:
  friend class IoThread;
  void cm_loop();
  void on_connect_request(rdma_cm_event* ev);
  void refuse(rdma_cm_id* id, Errc status, const std::string& why);
  // What a connection of `depth` credits pins, and what all connections may pin before a
  // client's (or another server's) connect is refused. options_.pinned counts it: charged by the
  // rdma_cm thread before a connection's buffers exist, given back by whichever thread releases
  // them (ServerConn::release), shared with the process's other rdma listeners.
  std::uint64_t pins_of(std::uint32_t depth) const noexcept;
  std::uint64_t pin_limit(bool server_peer) const noexcept;
  // From a completion thread: the connection's verbs objects are gone; destroy its cm id.
  void retire(const std::shared_ptr<ServerConn>& conn);

  RdmaServerOptions options_;
  std::string endpoint_;
  ShardEngine* engine_;
  const PinnedBuffer* clock_memory_;  // registrations below point into it; it outlives them
  rdma_event_channel* events_ = nullptr;
  rdma_cm_id* listen_id_ = nullptr;
  ibv_context* ctx_ = nullptr;  // our own (see open_own_context)
  std::string device_name_;
  ibv_pd* pd_ = nullptr;
  ibv_device_attr device_{};
  MemoryRegion store_mr_;
  MemoryRegion clock_mr_;
  std::uint16_t port_ = 0;
  int wake_fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> accepting_{true};
  bool drained_ = false, closed_ = false;

  std::vector<std::unique_ptr<IoThread>> io_;
  std::uint32_t next_io_ = 0;
  std::uint64_t accepted_ = 0;  // connections accepted so far (the rdma_cm thread's): their tags
  std::unordered_map<rdma_cm_id*, std::shared_ptr<ServerConn>> conns_;  // the cm thread's
  std::mutex retire_mu_;
  std::vector<std::shared_ptr<ServerConn>> retired_;
  std::thread cm_thread_;
};

}  // namespace pskv::rdma
