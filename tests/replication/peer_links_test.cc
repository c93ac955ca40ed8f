// PeerLinks (src/server/peer_links.h): the failover's connections to the other servers are kept
// between requests, replaced when their server restarted, and a server that is gone is a clear
// failure, never a wait.
#include "server/peer_links.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "pskv/client.h"
#include "pskv/server.h"
#include "support/workloads.h"
#include "transport/tcp/socket.h"
#include "transport/wire.h"

namespace pskv {
namespace {

using namespace std::chrono_literals;

// Server `id` of a ring of two that replicate to each other: the failover's ops are taken only
// from a server of a replicating ring.
std::unique_ptr<Server> serve(const std::vector<std::string>& ring, std::uint32_t id, bool rejoin = false) {
  ServerOptions so;
  so.uri = ring[id];
  so.server_id = id;
  so.peers = ring;
  so.replicas = 2;
  so.rejoin = rejoin;
  so.arena_bytes = 1 << 20;
  return std::make_unique<Server>(so);
}

// Until each server's replica of the other is synced: only then may server 1 restart with rejoin.
void wait_synced(const std::vector<std::string>& ring) {
  ClientOptions o;
  o.servers = ring;
  Client c(o);
  testing::wait_replicas_synced(c, 2);
}

// Asks server 1 of `links` for its stats: the status, and the stats or the failure in *text.
Errc stats(PeerLinks& links, std::string* text) {
  std::string answer, why;
  transport::Request q;
  q.op = wire::Op::stats;
  q.text_out = &answer;
  const Errc status = links.ask(1, q, &why);
  *text = status == Errc::ok ? answer : why;
  return status;
}

TEST(PeerLinks, AServerThatRestartedIsReachedAgainAndOneThatIsGoneFailsAtOnce) {
  std::vector<std::string> ring;
  for (int s = 0; s < 2; ++s) ring.push_back("tcp://127.0.0.1:" + std::to_string(tcp::free_loopback_port()));
  auto first = serve(ring, 0);
  auto server = serve(ring, 1);
  PeerLinks links(ring, nullptr, 2000ms);
  std::string text;
  ASSERT_EQ(stats(links, &text), Errc::ok) << text;
  EXPECT_NE(text.find("\"server_id\":1"), std::string::npos) << text;
  ASSERT_EQ(stats(links, &text), Errc::ok) << text;

  // The kept connection broke with its server; the restarted one is asked over a new one.
  wait_synced(ring);
  server.reset();
  server = serve(ring, 1, true);
  ASSERT_EQ(stats(links, &text), Errc::ok) << "after a restart: " << text;

  wait_synced(ring);
  server.reset();
  // A refused port is told at once: peer_failure, where waiting out the timeout would say timeout.
  EXPECT_EQ(stats(links, &text), Errc::peer_failure) << text;
  EXPECT_NE(text.find(ring[1].substr(std::string("tcp://").size())), std::string::npos)
      << "the failure names the server: " << text;

  EXPECT_FALSE(links.warm(1)) << "connected to a server that is gone";
  server = serve(ring, 1, true);
  EXPECT_TRUE(links.warm(1)) << "not connected to the server once it is back";
  EXPECT_EQ(stats(links, &text), Errc::ok) << "once it is back: " << text;
  links.close();
  EXPECT_EQ(stats(links, &text), Errc::peer_failure) << "after close(), nothing is asked: " << text;
  EXPECT_FALSE(links.warm(1)) << "after close(), nothing is connected";
}

}  // namespace
}  // namespace pskv
