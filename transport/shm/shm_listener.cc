#include "transport/shm/shm_listener.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <thread>

#include "engine/shard_engine.h"
#include "transport/shm/adoption.h"
#include "transport/shm/segment.h"
#include "transport/shm/shm_server.h"
#include "transport/shm/sync_file.h"
#include "transport/shm/table_files.h"

namespace pskv::shm {
namespace {

// Thread-safety: as transport::Listener.
class ShmListener final : public transport::Listener {
 public:
  ShmListener(const Uri& uri, const transport::ListenOptions& options) : name_(uri.name) {
    UriParams p(uri);
    clients_ = static_cast<std::uint32_t>(p.number("clients", 64, 1, 4096));
    area_bytes_ = p.number("area_mb", 32, 1, 4096) << 20;
    worker_push_ = p.choice("push", "worker", {"worker", "server"}) == "worker";
    adopt_ = p.number("adopt", 0, 0, 1) == 1;
    p.finish();
    // Clients share this machine, and the server's threads poll before they sleep: one per core
    // left the clients' spinning waiters none, and two 64-byte pushers on 2 cores fell from
    // ~900 K to ~25 K operations/s. Half the cores leaves the other half to the clients.
    const std::uint32_t cores = std::max(1u, std::thread::hardware_concurrency());
    threads_ = std::min(options.io_threads ? options.io_threads : std::max(1u, cores / 2), kMaxServerThreads);
  }
  ~ShmListener() override { close(); }

  transport::EngineMemory engine_memory(const EngineOptions& engine) override {
    SegmentConfig c;
    c.num_workers = engine.num_workers;
    c.clients = clients_;
    c.server_threads = threads_;
    c.area_bytes = area_bytes_;
    c.worker_push = worker_push_;
    c.store_bytes = Store::required_bytes(engine.store);
    c.state_per_value = state_floats_per_value(engine.store.rule.rule);
    // A segment meant to be adopted pays for it: pushes the server applies are logged first
    // (docs/BENCHMARKS.md has the cost); pushes clients apply themselves are logged anyway.
    c.server_undo = adopt_;
    c.mode = engine.mode;
    c.staleness = engine.staleness;
    c.sync_required = engine.sync_required;
    c.wait_timeout_ms = static_cast<std::uint32_t>(engine.wait_timeout.count());
    // Before create(), which reclaims a dead server's name: the old mapping outlives it.
    if (adopt_) predecessor_ = Predecessor::take(name_, std::chrono::milliseconds(c.wait_timeout_ms));
    segment_ = Segment::create(name_, c);
    // This server holds the name now: the table files of any other server of it are left overs,
    // but for those of the predecessor it adopts.
    remove_left_tables(name_, predecessor_ ? predecessor_->tables_directory() : std::string());
    transport::EngineMemory memory;
    memory.store = segment_->store_memory();
    memory.clocks = engine.num_workers ? segment_->clock_memory() : nullptr;
    if (adopt_) {
      // Tables keep their rows in files, so that a successor can adopt them too.
      tables_ = shm::tables_directory(name_, segment_->header().job_nonce);
      memory.tables = [root = tables_](std::uint32_t id, const TableSpec& requested, std::uint64_t max_rows) {
        return std::make_unique<TableFiles>(root, id, requested, max_rows);
      };
      // So do sync mode's pending steps: a push is acknowledged once it is summed.
      if (engine.mode == ConsistencyMode::sync)
        memory.sync = sync_ = SyncStateFile::create(tables_, engine.store, sync_options(engine), threads_);
    }
    return memory;
  }

  void start(ShardEngine& engine) override {
    if (predecessor_) adopted_ = predecessor_->copy_into(engine, tables_).fields();
    server_ = std::make_unique<ShmServer>(
        *segment_, engine, ShmServerOptions{.threads = threads_, .extra_stats = adopted_, .sync = sync_.get()});
    if (predecessor_) {
      // Only now: a successor that dies before its segment is ready leaves the original whole
      // for the next (Predecessor::take).
      predecessor_->served();
      predecessor_.reset();
    }
  }

  std::string uri() const override { return "shm://" + name_; }
  void stop_accepting() noexcept override {
    if (server_) server_->stop_accepting();
  }
  void drain() noexcept override {
    if (server_) server_->drain();
  }
  void close() noexcept override {
    if (server_) {
      server_->close();  // removes the segment's name too
      server_.reset();
    } else if (segment_) {
      segment_->remove();  // laid out but never served (a restore failed)
    }
    segment_.reset();
    if (!tables_.empty()) {
      // Stopped: nothing to adopt (the files of tables still mapped go once they are unmapped).
      std::error_code ec;
      std::filesystem::remove_all(tables_, ec);
    }
  }
  transport::ListenerStats stats() const override {
    return server_ ? transport::ListenerStats{server_->worker_pushes(), server_->stats_fields()}
                   : transport::ListenerStats{};
  }

 private:
  std::string name_;
  std::uint32_t clients_ = 64, threads_ = 1;
  std::uint64_t area_bytes_ = 32ull << 20;
  bool worker_push_ = true;
  bool adopt_ = false;
  std::string tables_;                        // with adopt_: where this server's tables keep their rows
  std::shared_ptr<SyncStateFile> sync_;       // with adopt_ in sync mode: its pending steps
  std::unique_ptr<Predecessor> predecessor_;  // between engine_memory() and start()
  JsonObject adopted_;                        // what was taken over, for stats
  // The server before the segment it serves goes away (members are destroyed in reverse).
  std::unique_ptr<Segment> segment_;
  std::unique_ptr<ShmServer> server_;
};

}  // namespace

std::unique_ptr<transport::Listener> make_listener(const Uri& uri, const transport::ListenOptions& options) {
  return std::make_unique<ShmListener>(uri, options);
}

}  // namespace pskv::shm
