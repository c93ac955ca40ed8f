#include "transport/tcp/tcp_listener.h"

#include <algorithm>
#include <thread>

#include "engine/shard_engine.h"
#include "transport/tcp/tcp_server.h"

namespace pskv::tcp {
namespace {

// Thread-safety: as transport::Listener.
class TcpListener final : public transport::Listener {
 public:
  TcpListener(const Uri& uri, const transport::ListenOptions& o) : uri_(uri) {
    UriParams p(uri);
    const bool pieces = p.choice("push", "pieces", {"pieces", "whole"}) == "pieces";
    p.finish();
    uri_.params.clear();
    const std::uint32_t cores = std::max(1u, std::thread::hardware_concurrency());
    options_ = TcpServerOptions{.io_threads = o.io_threads ? o.io_threads : cores,
                                .max_connections = o.max_connections,
                                .max_connections_per_address = o.max_connections_per_address,
                                .frame_timeout = o.frame_timeout,
                                .handshake_timeout = o.handshake_timeout,
                                .memory_budget_bytes = o.memory_budget_bytes,
                                .limits = o.limits,
                                .push_in_pieces = pieces,
                                .token = o.token,
                                .peer_token = o.peer_token};
  }
  ~TcpListener() override { close(); }

  transport::EngineMemory engine_memory(const EngineOptions&) override { return {}; }
  void start(ShardEngine& engine) override {
    server_ = std::make_unique<TcpServer>(engine, uri_, options_);
    uri_.port = server_->port();
  }
  std::string uri() const override { return uri_.str(); }
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
  TcpServerOptions options_;
  std::unique_ptr<TcpServer> server_;
};

}  // namespace

std::unique_ptr<transport::Listener> make_listener(const Uri& uri, const transport::ListenOptions& options) {
  return std::make_unique<TcpListener>(uri, options);
}

}  // namespace pskv::tcp
