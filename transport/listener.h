// The server side of the transport seam, mirroring connect(): listen() gives the front end that
// serves one ShardEngine over one URI, with the same life cycle for every backend.
//
//   auto listener = transport::listen(uri, options);         // checks the URI and its parameters
//   EngineMemory memory = listener->engine_memory(engine_options);
//   ShardEngine engine(engine_options, std::move(memory.store), memory.clocks);
//   ... restore a checkpoint into `engine` ...
//   listener->start(engine);                                 // clients are served from here
//   ...
//   listener->stop_accepting();                              // no new client gets in
//   listener->drain();                                       // no request is being applied after this
//   ... final checkpoint, engine.shutdown() (parked requests get their error) ...
//   listener->close();                                       // connections closed, resources freed
//
// The engine owns the store; a backend only supplies memory for it (shm: the segment, whose
// readers are the clients; rdma: pinned memory for the clock table it registers) and serves it.
// Backend-specific settings come as URI parameters (docs/protocol.md, "Server URIs"), checked
// by listen(); unknown ones are refused.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/json.h"
#include "common/memory.h"
#include "transport/auth.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv {
struct EngineOptions;
class ShardEngine;
class SyncSpace;
class TableStorage;
struct TableSpec;
}  // namespace pskv

namespace pskv::transport {

// What any backend bounds for its peers (docs/protocol.md, "Connection limits"); a backend
// applies those that mean something for it.
struct ListenOptions {
  std::uint32_t server_id = 0;
  std::uint32_t io_threads = 0;  // 0: the backend's default
  std::uint32_t max_connections = 1024;
  std::uint32_t max_connections_per_address = 256;
  std::chrono::milliseconds handshake_timeout{5000};
  std::chrono::milliseconds frame_timeout{5000};
  std::uint64_t memory_budget_bytes = 1ull << 30;
  // rdma: the memory its connections may pin, counted in `pinned` (shared by every rdma listener
  // of the process: a takeover's too). 0: half the machine's memory.
  std::uint64_t pinned_budget_bytes = 0;
  std::shared_ptr<std::atomic<std::uint64_t>> pinned;
  wire::Limits limits{};
  // When set, every connection must pass the HMAC challenge first (shm:// ignores it: its
  // segment is protected by its file mode).
  std::shared_ptr<const auth::Token> token;
  // tcp: the token another server of the ring proves (replication); null: `token`.
  std::shared_ptr<const auth::Token> peer_token;
};

// Where the engine keeps its store, its clock table and its tables' rows. Null: the engine's own
// heap. `tables` (ShardEngine's TableStorageMaker) makes the storage of each table it creates.
struct EngineMemory {
  std::unique_ptr<MemoryResource> store;
  void* clocks = nullptr;
  std::shared_ptr<SyncSpace> sync;  // sync mode's pending steps (null: the process's memory)
  std::function<std::unique_ptr<TableStorage>(std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows)>
      tables;
};

// What a backend adds to the engine's stats: keys applied without the engine (shm clients apply
// their own pushes) and fields of its own.
struct ListenerStats {
  std::uint64_t external_pushes = 0;
  JsonObject fields;
};

// Thread-safety: the life-cycle calls come from one thread, in the order above (stop_accepting,
// drain and close each at most once, and close also when start was never reached); uri() and
// stats() from any thread once started.
class Listener {
 public:
  virtual ~Listener() = default;
  // Memory the engine must be built on (called once, before start).
  virtual EngineMemory engine_memory(const EngineOptions& engine) = 0;
  // Starts serving `engine`, which must outlive close().
  virtual void start(ShardEngine& engine) = 0;
  // The URI clients connect to (a port 0 asked for is resolved; server-only parameters dropped).
  virtual std::string uri() const = 0;
  virtual void stop_accepting() noexcept = 0;
  virtual void drain() noexcept = 0;
  virtual void close() noexcept = 0;
  virtual ListenerStats stats() const = 0;
  // The largest request frame a peer can send this backend whatever the limits say (rdma: one
  // client's receive region); unbounded where only ListenOptions::limits bound it.
  virtual std::uint64_t largest_request() const noexcept { return UINT64_MAX; }
};

// By scheme (transport/factory/listen.cc). Throws Error naming what is wrong with the URI.
std::unique_ptr<Listener> listen(const Uri& uri, const ListenOptions& options);

}  // namespace pskv::transport
