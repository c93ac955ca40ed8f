#include "server/peer_links.h"

#include <utility>

#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv {

std::unique_ptr<transport::Connection> connect_peer(const std::string& uri,
                                                    const std::shared_ptr<const auth::Token>& token,
                                                    std::chrono::milliseconds timeout) {
  transport::ConnectOptions c;
  c.worker_id = wire::kServerPeer;
  c.connect_timeout = timeout;
  c.wait_for_listener = false;  // a caller looking for a dead server's successor must not wait on it
  c.io_timeout = timeout;
  c.token = token;
  return transport::connect(parse_uri(uri), c);
}

Errc ask_once(std::unique_ptr<transport::Connection>& conn, transport::Request& q, std::chrono::milliseconds timeout,
              std::string* why) {
  transport::Completion done;
  done.reset(1);
  q.completion = &done;
  conn->submit(q);
  if (!done.wait(std::chrono::steady_clock::now() + timeout, conn->poller())) {
    conn.reset();
    *why = "no answer within " + std::to_string(timeout.count()) + " ms";
    return Errc::timeout;
  }
  *why = done.message();
  return done.status();
}

PeerLinks::PeerLinks(std::vector<std::string> uris, std::shared_ptr<const auth::Token> token,
                     std::chrono::milliseconds timeout)
    : uris_(std::move(uris)), token_(std::move(token)), timeout_(timeout) {
  links_.reserve(uris_.size());
  for (std::size_t s = 0; s < uris_.size(); ++s) links_.push_back(std::make_unique<Link>());
}

Errc PeerLinks::ask(std::size_t s, transport::Request& q, std::string* why) {
  Link& link = *links_.at(s);
  std::lock_guard lock(link.mu);
  if (closed_.load()) {
    *why = "this server is stopping";
    return Errc::peer_failure;
  }
  // At most twice: a kept connection that fails is dropped, so the second pass connects afresh.
  for (;;) {
    const bool kept = link.conn && !link.conn->broken();
    try {
      if (!kept) link.conn = connect_peer(uris_[s], token_, timeout_);
      const Errc answer = ask_once(link.conn, q, timeout_, why);
      if (answer == Errc::ok || answer == Errc::timeout) return answer;
      // Failed on a connection that broke: the server's refusal or its death, which a fresh
      // connection tells apart. A refusal on a sound connection is the answer.
      if (!link.conn->broken()) return answer;
      link.conn.reset();
      if (!kept) return answer;
    } catch (const Error& e) {
      link.conn.reset();
      *why = e.what();
      if (!kept) return e.code();
    }
  }
}

bool PeerLinks::warm(std::size_t s) {
  Link& link = *links_.at(s);
  std::lock_guard lock(link.mu);
  if (closed_.load()) return false;
  if (link.conn && !link.conn->broken()) return true;
  try {
    link.conn = connect_peer(uris_[s], token_, timeout_);
    return true;
  } catch (const Error&) {
    link.conn.reset();
    return false;  // not started yet, or down: asked again later, or connected at its next use
  }
}

void PeerLinks::close() {
  closed_.store(true);
  for (auto& link : links_) {
    std::lock_guard lock(link->mu);
    link->conn.reset();
  }
}

}  // namespace pskv
