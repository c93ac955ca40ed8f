// Connections from one server to the other servers of its ring, kept between the failover's
// requests (votes, announcements, certificate lookups, hand-backs).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pskv/error.h"
#include "transport/auth.h"
#include "transport/transport.h"

namespace pskv {

// A connect costs an rdma_cm exchange or a TCP handshake plus the hello (100-300 ms over rdma in
// the Soft-RoCE VM, over a second on a loaded machine). A vote that connected afresh paid it at
// every failover, and lost when a connect took longer than the timeout: the server that asked
// then stopped, and so could the servers that replicated to it, one after the other.
// Thread-safety: every member from any thread. Requests to one server go one at a time.
class PeerLinks {
 public:
  // `uris`: every server's URI, by server id. `timeout` bounds a connect and an answer each.
  PeerLinks(std::vector<std::string> uris, std::shared_ptr<const auth::Token> token, std::chrono::milliseconds timeout);
  PeerLinks(const PeerLinks&) = delete;
  PeerLinks& operator=(const PeerLinks&) = delete;

  // Sends `q` to server `s` and waits for its answer: ok, or the failure with *why (a connect's
  // failure included: timeout, or peer_failure for a refused port). A kept connection found
  // broken (the server restarted, or the connection failed meanwhile) is replaced and `q` sent
  // once more, so only requests a server may take twice belong here.
  Errc ask(std::size_t s, transport::Request& q, std::string* why);
  // Connects to server `s` unless a sound connection is kept: true once one is. So that the
  // first vote, at the first failure, does not pay for the connects.
  bool warm(std::size_t s);
  // Drops every kept connection (at stop, before the server's transport goes); ask() and warm()
  // fail from then on.
  void close();

 private:
  struct Link {
    std::mutex mu;
    std::unique_ptr<transport::Connection> conn;  // under mu
  };
  std::vector<std::string> uris_;
  std::shared_ptr<const auth::Token> token_;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<Link>> links_;
  std::atomic<bool> closed_{false};
};

// A connection to another server of the ring, as a server: votes and the failover's other ops
// are taken only from servers. A refused rdma port fails at once, as a refused TCP port does.
std::unique_ptr<transport::Connection> connect_peer(const std::string& uri,
                                                    const std::shared_ptr<const auth::Token>& token,
                                                    std::chrono::milliseconds timeout);

// One request and its answer within `timeout`: ok, or the failure (timeout or the refusal). A
// request not answered in time is failed by closing its connection (conn is reset), so nothing
// refers to it once this returns.
Errc ask_once(std::unique_ptr<transport::Connection>& conn, transport::Request& q, std::chrono::milliseconds timeout,
              std::string* why);

}  // namespace pskv
