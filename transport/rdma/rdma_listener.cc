#include "transport/rdma/rdma_listener.h"

#include <algorithm>
#include <thread>

#include "engine/shard_engine.h"
#include "layout/clock_table.h"
#include "transport/rdma/rdma_protocol.h"
#include "transport/rdma/rdma_server.h"

namespace pskv::rdma {
namespace {

// Thread-safety: as transport::Listener.
class RdmaListener final : public transport::Listener {
 public:
  RdmaListener(const Uri& uri, const transport::ListenOptions& o) : uri_(uri) {
    UriParams p(uri);
    // -1: any (rdma_cm's choice stands).
    options_.device = p.text("dev", "");
    options_.ib_port = static_cast<int>(p.number("port", 0, 1, 255)) - (uri.params.count("port") ? 0 : 1);
    options_.gid_index = static_cast<int>(p.number("gid", 0, 0, 65535)) - (uri.params.count("gid") ? 0 : 1);
    options_.queue_depth = static_cast<std::uint32_t>(p.number("depth", 64, 1, 4096));
    options_.region_bytes = p.number("recv_mb", 32, 1, kMaxRegionMb) << 20;
    options_.busy_poll = p.choice("poll", "event", {"busy", "event"}) == "busy";
    p.finish();
    uri_.params.clear();  // the device choice is the server's; clients name their own
    options_.threads = o.io_threads ? o.io_threads : std::max(1u, std::thread::hardware_concurrency());
    options_.max_connections = o.max_connections;
    options_.limits = o.limits;
    options_.reply_timeout = o.frame_timeout;
    options_.max_connections_per_address = o.max_connections_per_address;
    options_.handshake_timeout = o.handshake_timeout;
    options_.pinned_budget_bytes = o.pinned_budget_bytes;
    options_.pinned = o.pinned;
    options_.token = o.token;
    options_.peer_token = o.peer_token;
  }
  ~RdmaListener() override { close(); }

  transport::EngineMemory engine_memory(const EngineOptions& engine) override {
    // The clock table is read remotely: in memory of its own, pinned and registered once.
    if (engine.num_workers > 0) clocks_ = PinnedBuffer(align_up(ClockTable::bytes_for(engine.num_workers), 4096));
    transport::EngineMemory memory;
    memory.clocks = engine.num_workers ? clocks_.data() : nullptr;
    return memory;
  }
  void start(ShardEngine& engine) override {
    server_ = std::make_unique<RdmaServer>(uri_, engine, clocks_, options_);
    uri_.port = server_->port();
  }
  std::string uri() const override { return uri_.str(); }
  std::uint64_t largest_request() const noexcept override { return options_.region_bytes; }
  void stop_accepting() noexcept override {
    if (server_) server_->stop_accepting();
  }
  void drain() noexcept override {
    if (server_) server_->drain();
  }
  void close() noexcept override {
    if (server_) server_->close();
  }
  transport::ListenerStats stats() const override {
    return server_ ? transport::ListenerStats{0, server_->stats_fields()} : transport::ListenerStats{};
  }

 private:
  Uri uri_;
  RdmaServerOptions options_;
  // Destroyed after the server, whose registrations point into it.
  PinnedBuffer clocks_;
  std::unique_ptr<RdmaServer> server_;
};

}  // namespace

std::unique_ptr<transport::Listener> make_listener(const Uri& uri, const transport::ListenOptions& options) {
  return std::make_unique<RdmaListener>(uri, options);
}

}  // namespace pskv::rdma
