// pskv-server: serves one shard on a URI until SIGINT/SIGTERM.
// Every flag can also come from a PSKV_* environment variable; the flag wins.
#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "common/json.h"
#include "pskv/error.h"
#include "pskv/server.h"

int main(int argc, char** argv) {
  pskv::ServerOptions o;
  CLI::App app{
      "pskv-server: one shard of the pskv parameter server.\n"
      "Flags override PSKV_* environment variables, which override the defaults shown."};
  app.get_formatter()->column_width(40);
  // A flag given twice takes the last value, so wrappers can pass defaults that users override.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  std::string mode = "asp", rule = "add", straggler = "fail";
  std::uint64_t arena_mb = o.arena_bytes >> 20, max_request_mb = o.max_request_bytes >> 20;
  std::int64_t wait_ms = o.wait_timeout.count();
  app.add_option("--uri", o.uri, "Endpoint: tcp://HOST:PORT (port 0 picks one), shm://NAME, rdma://HOST:PORT")
      ->envname("PSKV_URI")
      ->capture_default_str();
  app.add_option("--server-id", o.server_id, "This shard's index among the servers")
      ->envname("PSKV_SERVER_ID")
      ->capture_default_str();
  app.add_option("--workers", o.num_workers, "Workers that clock against this server (0: anonymous ASP only)")
      ->envname("PSKV_WORKERS")
      ->capture_default_str();
  app.add_option("--mode", mode, "Consistency: asp, bsp, ssp or sync")
      ->envname("PSKV_MODE")
      ->capture_default_str()
      ->check(CLI::IsMember({"asp", "bsp", "ssp", "sync"}));
  app.add_option("--staleness", o.staleness, "SSP bound s: a worker at clock c reads once min(clocks) >= c - s")
      ->envname("PSKV_STALENESS")
      ->capture_default_str();
  app.add_option("--sync-required", o.sync_required, "Sync mode: apply a step once K of N gradients arrived (0 = N)")
      ->envname("PSKV_SYNC_REQUIRED")
      ->capture_default_str();
  app.add_option("--wait-timeout-ms", wait_ms, "How long a bounded read or barrier waits for a stalled worker")
      ->envname("PSKV_WAIT_TIMEOUT_MS")
      ->capture_default_str();
  app.add_option("--straggler-policy", straggler, "fail: waiting reads get an error; evict: drop the stalled worker")
      ->envname("PSKV_STRAGGLER_POLICY")
      ->capture_default_str()
      ->check(CLI::IsMember({"fail", "evict"}));
  app.add_option("--rule", rule, "Update rule: assign, add, sgd, momentum, adam, adagrad")
      ->envname("PSKV_RULE")
      ->capture_default_str()
      ->check(CLI::IsMember({"assign", "add", "sgd", "momentum", "adam", "adagrad"}));
  app.add_option("--lr", o.rule.lr, "Learning rate")->envname("PSKV_LR")->capture_default_str();
  app.add_option("--momentum", o.rule.momentum, "Momentum coefficient")
      ->envname("PSKV_MOMENTUM")
      ->capture_default_str();
  app.add_option("--beta1", o.rule.beta1, "Adam beta1")->envname("PSKV_BETA1")->capture_default_str();
  app.add_option("--beta2", o.rule.beta2, "Adam beta2")->envname("PSKV_BETA2")->capture_default_str();
  app.add_option("--eps", o.rule.eps, "Adam/Adagrad epsilon")->envname("PSKV_EPS")->capture_default_str();
  app.add_option("--weight-decay", o.rule.weight_decay, "L2 weight decay")
      ->envname("PSKV_WEIGHT_DECAY")
      ->capture_default_str();
  app.add_option("--arena-mb", arena_mb, "Value arena size in MiB (optimizer state is sized to match)")
      ->envname("PSKV_ARENA_MB")
      ->capture_default_str();
  app.add_option("--max-keys", o.max_keys, "Key index capacity")->envname("PSKV_MAX_KEYS")->capture_default_str();
  app.add_option("--stripes", o.stripes, "Lock stripes (power of two)")->envname("PSKV_STRIPES")->capture_default_str();
  app.add_option("--io-threads", o.io_threads,
                 "Request threads (0: one per core; shm: one per two cores, leaving the rest to its local clients)")
      ->envname("PSKV_IO_THREADS")
      ->capture_default_str();
  app.add_option("--max-connections", o.max_connections, "Connections beyond this are refused with an error")
      ->envname("PSKV_MAX_CONNECTIONS")
      ->capture_default_str();
  app.add_option("--max-request-mb", max_request_mb, "Largest request payload accepted, MiB")
      ->envname("PSKV_MAX_REQUEST_MB")
      ->capture_default_str();
  app.add_option("--max-keys-per-request", o.max_keys_per_request, "Largest key table accepted")
      ->envname("PSKV_MAX_KEYS_PER_REQUEST")
      ->capture_default_str();
  std::int64_t frame_ms = o.frame_timeout.count(), handshake_ms = o.handshake_timeout.count();
  std::uint64_t budget_mb = o.memory_budget_bytes >> 20, pin_mb = o.rdma_pinned_bytes >> 20;
  std::uint64_t table_mb = o.table_memory_bytes >> 20;
  app.add_option("--max-connections-per-address", o.max_connections_per_address,
                 "tcp, rdma: connections from one IP address beyond this are refused")
      ->envname("PSKV_MAX_CONNECTIONS_PER_ADDRESS")
      ->capture_default_str();
  app.add_option("--handshake-timeout-ms", handshake_ms,
                 "tcp, rdma: a connection that has not finished hello (and the token challenge) by then is closed")
      ->envname("PSKV_HANDSHAKE_TIMEOUT_MS")
      ->capture_default_str();
  app.add_option("--frame-timeout-ms", frame_ms,
                 "tcp: a request or reply not transferred whole within this (plus 1 s per 16 MiB) closes its "
                 "connection; rdma: so do replies none of which could leave for this long; a worker silent "
                 "between requests is never closed for it")
      ->envname("PSKV_FRAME_TIMEOUT_MS")
      ->capture_default_str();
  app.add_option("--memory-budget-mb", budget_mb,
                 "tcp: frame buffers and copied replies of all connections together, MiB; a request that would need "
                 "more is refused with 'capacity'")
      ->envname("PSKV_MEMORY_BUDGET_MB")
      ->capture_default_str();
  app.add_option("--rdma-pin-mb", pin_mb,
                 "rdma: the memory all connections pin together, MiB (each its --rdma-recv-mb region and 48 KiB per "
                 "credit); clients may take 7/8, the rest is kept for the ring's servers; a connect past it is "
                 "refused (0: half the machine's memory)")
      ->envname("PSKV_RDMA_PIN_MB")
      ->capture_default_str();
  app.add_option("--table-memory-mb", table_mb,
                 "embedding tables: what all tables' rows may take at their caps, MiB; a table created without "
                 "max_rows gets what is left")
      ->envname("PSKV_TABLE_MEMORY_MB")
      ->capture_default_str();
  // Backend settings are URI parameters (docs/protocol.md, "Server URIs"); these flags (and their
  // PSKV_* variables) are a shorter way to write them and are appended to --uri.
  struct BackendFlag {
    const char* scheme;
    const char* param;
    std::string value;
    CLI::Option* option = nullptr;
  };
  std::vector<BackendFlag> backend = {{"shm", "clients", {}}, {"shm", "area_mb", {}}, {"shm", "push", {}},
                                      {"tcp", "push", {}},    {"rdma", "dev", {}},    {"rdma", "port", {}},
                                      {"rdma", "gid", {}},    {"rdma", "depth", {}},  {"rdma", "recv_mb", {}}};
  backend[0].option = app.add_option("--shm-clients,--shm-slots", backend[0].value,
                                     "shm: client areas, clients connected at once (64); URI clients=")
                          ->envname("PSKV_SHM_CLIENTS");
  backend[1].option =
      app.add_option("--shm-area-mb,--shm-slot-mb", backend[1].value,
                     "shm: each client's staging area for pushes, MiB (32; bounds one push); URI area_mb=")
          ->envname("PSKV_SHM_AREA_MB");
  backend[2].option =
      app.add_option("--shm-push", backend[2].value,
                     "shm: who applies a push: worker (the client, under the stripe lock, rolled back by "
                     "the server if it dies mid-way; the default) or server (a server thread, from the "
                     "client's area); URI push=")
          ->envname("PSKV_SHM_PUSH")
          ->check(CLI::IsMember({"worker", "server"}));
  backend[3].option = app.add_option("--tcp-push", backend[3].value,
                                     "tcp: how a push larger than 256 KiB is applied: pieces (as it arrives, so a key "
                                     "longer than 256 KiB is atomic per 256 KiB piece; the default) or whole (staged "
                                     "first, then applied atomically per key); URI push=")
                          ->envname("PSKV_TCP_PUSH")
                          ->check(CLI::IsMember({"pieces", "whole"}));
  std::int64_t checkpoint_s = 0;
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "Write this shard's checkpoint here (periodically and at exit)")
      ->envname("PSKV_CHECKPOINT_DIR");
  app.add_option("--checkpoint-every-s", checkpoint_s, "Seconds between checkpoints (0: only at exit)")
      ->envname("PSKV_CHECKPOINT_EVERY_S")
      ->capture_default_str();
  app.add_option("--restore", o.restore_dir, "Load this shard from a checkpoint directory before serving")
      ->envname("PSKV_RESTORE");
  app.add_option("--auth-token-file", o.auth_token_file,
                 "tcp/rdma: shared secret (a chmod 600 file); every client must pass an HMAC-SHA256 challenge with it")
      ->envname("PSKV_AUTH_TOKEN_FILE");
  app.add_option(
         "--peer-token-file", o.peer_token_file,
         "tcp or rdma with --replicas: the secret the servers prove to each other (a chmod 600 file), so that no "
         "client holding --auth-token-file can send the replication ops; default: --auth-token-file")
      ->envname("PSKV_PEER_TOKEN_FILE");
  app.add_option("--peer-uri", o.peer_uri,
                 "rdma:// with --replicas: replicate over tcp instead of verbs; the tcp://HOST:PORT where this "
                 "server's peers replicate to it (--peers then lists every server's --peer-uri)")
      ->envname("PSKV_PEER_URI");
  app.add_option(
         "--replicas", o.replicas,
         "tcp/rdma: servers holding each key (this one and the next R-1 of --peers); a push is acknowledged once "
         "every live one applied it")
      ->envname("PSKV_REPLICAS")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  app.add_option("--peers", o.peers, "Every server's URI in server-id order, this one's included (with --replicas)")
      ->delimiter(',')
      ->envname("PSKV_PEERS");
  std::int64_t failover_ms = 0;
  app.add_option("--failover-ms", failover_ms,
                 "tcp or rdma, with --replicas and 3+ servers: a server silent this long is certified down by a "
                 "majority and the next server of its chain serves its keys (0: off; a dead server's clients wait for "
                 "its restart)")
      ->envname("PSKV_FAILOVER_MS")
      ->capture_default_str();
  app.add_option("--failover-dir", o.failover_dir,
                 "With --failover-ms: where this server keeps its votes (it must never vote twice, even restarted)")
      ->envname("PSKV_FAILOVER_DIR");
  app.add_flag("--rejoin", o.rejoin,
               "Restarting after a failure: take this server's keys back from a synced replica before serving "
               "(with --failover-ms, from the server that took them over, which gives them back)")
      ->envname("PSKV_REJOIN");
  backend[4].option =
      app.add_option("--rdma-device", backend[4].value,
                     "rdma: expected device (the URI's address picks it; a mismatch is an error); URI dev=")
          ->envname("PSKV_RDMA_DEVICE");
  backend[5].option = app.add_option("--rdma-ib-port", backend[5].value, "rdma: expected device port; URI port=")
                          ->envname("PSKV_RDMA_IB_PORT");
  backend[6].option =
      app.add_option("--rdma-gid", backend[6].value, "rdma: expected GID index; URI gid=")->envname("PSKV_RDMA_GID");
  backend[7].option =
      app.add_option("--rdma-queue-depth", backend[7].value, "rdma: requests in flight per client (64); URI depth=")
          ->envname("PSKV_RDMA_QUEUE_DEPTH");
  backend[8].option =
      app.add_option("--rdma-recv-mb", backend[8].value,
                     "rdma: per-client receive region for pushes, MiB (32; bounds one push); URI recv_mb=")
          ->envname("PSKV_RDMA_RECV_MB");
  bool shm_adopt = false;
  app.add_flag("--shm-adopt", shm_adopt,
               "shm: take over the segment a dead server left under this name (every key, optimizer state and "
               "clock), and log the pushes this server applies so that its own successor can; URI adopt=1")
      ->envname("PSKV_SHM_ADOPT");
  bool rdma_busy_poll = false;
  app.add_flag("--rdma-busy-poll", rdma_busy_poll,
               "rdma: spin on completion queues (lower latency, burns cores); URI poll=busy")
      ->envname("PSKV_RDMA_BUSY_POLL");
  CLI11_PARSE(app, argc, argv);
  if (rdma_busy_poll) backend.push_back({"rdma", "poll", "busy"});
  if (shm_adopt) backend.push_back({"shm", "adopt", "1", app.get_option("--shm-adopt")});
  const std::string scheme = o.uri.substr(0, o.uri.find("://"));
  for (const BackendFlag& f : backend) {
    if (f.value.empty()) continue;
    if (scheme != f.scheme) {
      std::fprintf(stderr, "pskv-server: %s applies to %s:// servers, not %s\n",
                   f.option ? f.option->get_name().c_str() : "--rdma-busy-poll", f.scheme, o.uri.c_str());
      return 2;
    }
    o.uri += (o.uri.find('?') == std::string::npos ? "?" : "&") + std::string(f.param) + "=" + f.value;
  }
  o.checkpoint_interval = std::chrono::seconds(checkpoint_s);

  o.mode = *pskv::parse_consistency_mode(mode);
  o.rule.rule = *pskv::parse_update_rule(rule);
  o.straggler = straggler == "evict" ? pskv::StragglerPolicy::evict : pskv::StragglerPolicy::fail;
  o.arena_bytes = arena_mb << 20;
  o.max_request_bytes = max_request_mb << 20;
  o.wait_timeout = std::chrono::milliseconds(wait_ms);
  o.frame_timeout = std::chrono::milliseconds(frame_ms);
  o.handshake_timeout = std::chrono::milliseconds(handshake_ms);
  o.memory_budget_bytes = budget_mb << 20;
  o.rdma_pinned_bytes = pin_mb << 20;
  o.table_memory_bytes = table_mb << 20;
  o.failover_timeout = std::chrono::milliseconds(failover_ms);

  // Block the stop signals before any thread starts, then wait for them here.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  try {
    pskv::Server server(o);
    std::printf("pskv-server listening on %s (mode %s, rule %s, workers %u)\n", server.uri().c_str(), mode.c_str(),
                rule.c_str(), o.num_workers);
    std::fflush(stdout);
    int sig = 0;
    // Woken now and then to see whether a majority certified this server down (failover).
    const timespec look{0, 200 * 1000 * 1000};
    while ((sig = sigtimedwait(&stop_signals, nullptr, &look)) < 0) {
      if (const std::string why = server.deposed(); !why.empty()) {
        std::fprintf(stderr, "pskv-server: certified down, stopped: %s\n", why.c_str());
        return 3;
      }
    }
    // Arrays cut at 64 numbers (a clock per worker): server_stats has the whole text.
    std::fprintf(stderr, "pskv-server: stopping on signal %d; stats %s\n", sig,
                 pskv::abridge_arrays(server.stats_json(), 64).c_str());
  } catch (const pskv::Error& e) {
    std::fprintf(stderr, "pskv-server: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // the system refused memory, say: a message, not an abort
    std::fprintf(stderr, "pskv-server: %s\n", e.what());
    return 1;
  }
  return 0;
}
