// Server side of the TCP backend. epoll with EPOLLONESHOT hands each readable connection to one
// of a few I/O threads at a time, so a connection's requests are handled in order (a worker's
// pushes are applied before its clock moves) while different connections run in parallel, and
// idle servers sleep in epoll_wait. Pulls that must wait for the consistency bound are parked in
// the engine and answered later by whichever thread moves the bound, so no I/O thread ever
// blocks on another worker.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "server/shard_engine.h"
#include "transport/auth.h"
#include "transport/tcp/socket.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv::tcp {

struct TcpServerOptions {
  std::uint32_t io_threads = 2;
  std::uint32_t max_connections = 1024;
  // A frame whose rest does not arrive within this time is abandoned and its connection closed.
  std::chrono::milliseconds frame_timeout{5000};
  wire::Limits limits{};
  // A push frame larger than a connection's receive buffer is applied as it arrives: each key of
  // up to kPushPieceFloats once all of it is in, a longer one in pieces of whatever has come in
  // (at most kPushPieceFloats, and while more keeps coming, at least kPushLeastFloats or the
  // key's rest). The value is never staged whole and is applied while still in cache, but
  // such a key is atomic per piece only, and a frame cut short leaves the pieces before the cut
  // applied. false: staged whole, then applied atomically per key (as checksummed and sync-mode
  // pushes always are).
  bool push_in_pieces = true;
  // When set, every connection must pass the HMAC challenge before anything else is served.
  std::shared_ptr<const auth::Token> token;
};

class Peer;

// Thread-safety: construct, then stop() or destroy from one thread; everything else is internal.
class TcpServer {
 public:
  TcpServer(ShardEngine& engine, const Uri& uri, const TcpServerOptions& options);
  ~TcpServer();
  TcpServer(const TcpServer&) = delete;
  TcpServer& operator=(const TcpServer&) = delete;

  std::uint16_t port() const noexcept { return port_; }
  void stop();
  std::uint64_t connections_refused() const noexcept { return refused_.load(); }
  // The largest piece a push is applied in (a whole receive buffer, 256 KiB): smaller pieces
  // cost more receive calls, larger ones fall out of L2 before they are applied.
  static constexpr std::size_t kPushPieceFloats = 64u << 10;
  // The smallest piece (16 KiB) applied while more of the key is waiting to be read. A piece is
  // applied as soon as this much is in, not once a whole kPushPieceFloats is: the server keeps up
  // with the sender, so waiting for full pieces left a 256 KiB apply (8 us) between a push's last
  // byte and its reply, a tenth of a 1 MiB push's time with one in flight.
  static constexpr std::size_t kPushLeastFloats = 4u << 10;

 private:
  void io_loop();
  void accept_ready();
  // Each returns false when the connection must be closed.
  bool serve_readable(Peer& peer);
  bool handle(Peer& peer, const wire::FrameHeader& h, const float* payload);
  // Whether this large frame is a push to apply as it arrives, and doing so. The frame's key
  // table is in peer.keys and [begin, end) of the peer's receive buffer holds the payload's start.
  bool streams(const Peer& peer, const wire::FrameHeader& h) const noexcept;
  bool stream_push(Peer& peer, const wire::FrameHeader& h, std::size_t begin, std::size_t end);
  // Answers a hello (or a passed challenge): registers the worker and says who this server is.
  bool admit(Peer& peer, const wire::FrameHeader& h);
  // A large pull sent straight from the store's slots, validated by their seqlocks afterwards.
  bool send_from_store(Peer& peer, const wire::FrameHeader& h, std::uint64_t floats);
  // Below this a pull reply is copied: the copy is cheap and the extra trailer write is not.
  static constexpr std::uint64_t kFromStoreBytes = 64u << 10;
  // Logs and refuses a peer that did not authenticate; always false (close the connection).
  bool refuse(Peer& peer, const wire::FrameHeader& h, const std::string& what);
  void close_peer(Peer& peer);
  void rearm(Peer& peer);

  ShardEngine& engine_;
  TcpServerOptions options_;
  Fd listen_fd_;
  Fd epoll_fd_;
  Fd wake_fd_;
  std::uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<std::uint64_t> refused_{0};
  std::mutex peers_mu_;
  std::unordered_map<int, std::shared_ptr<Peer>> peers_;
  std::vector<std::thread> threads_;
};

}  // namespace pskv::tcp
