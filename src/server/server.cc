#include "pskv/server.h"

#include <sys/stat.h>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "common/log.h"
#include "engine/shard_engine.h"
#include "server/checkpoint.h"
#include "server/failover.h"
#include "server/replicator.h"
#include "server/table_checkpoint.h"
#include "transport/listener.h"
#include "transport/uri.h"

namespace pskv {
namespace detail {
namespace {
[[noreturn]] void reject(const std::string& why) {
  throw Error(Errc::invalid_argument, why);
}

bool finite_at_least(float v, float low) {
  return std::isfinite(v) && v >= low;
}

// Options that would make the server wait forever, compute NaNs or silently ignore what was
// asked are refused before anything starts, naming the flag.
void validate(const ServerOptions& o) {
  using std::to_string;
  if (o.wait_timeout.count() <= 0)
    reject("--wait-timeout-ms must be positive (got " + to_string(o.wait_timeout.count()) +
           "): it bounds how long a read waits for a stalled worker");
  if (o.handshake_timeout.count() <= 0) reject("--handshake-timeout-ms must be positive");
  if (o.frame_timeout.count() <= 0) reject("--frame-timeout-ms must be positive");
  if (o.checkpoint_interval.count() < 0) reject("--checkpoint-every-s must not be negative");
  if (o.staleness != 0 && o.mode != ConsistencyMode::ssp)
    reject("--staleness " + to_string(o.staleness) + " applies to --mode ssp only, not " +
           std::string(to_string(o.mode)));
  if (o.sync_required != 0 && o.mode != ConsistencyMode::sync)
    reject("--sync-required applies to --mode sync only, not " + std::string(to_string(o.mode)));
  if (o.mode == ConsistencyMode::sync && o.sync_required > o.num_workers)
    reject("--sync-required " + to_string(o.sync_required) + " exceeds --workers " + to_string(o.num_workers));
  if (o.num_workers > kMaxWorkers)
    reject("--workers " + to_string(o.num_workers) + " is more than the " + to_string(kMaxWorkers) +
           " a server clocks");
  if (o.mode != ConsistencyMode::asp && o.num_workers == 0)
    reject("--mode " + std::string(to_string(o.mode)) + " needs --workers: the clocks it bounds reads by");
  const UpdateRuleConfig& r = o.rule;
  if (!finite_at_least(r.lr, 0)) reject("--lr must be a finite number >= 0, got " + to_string(r.lr));
  if (!finite_at_least(r.momentum, 0) || r.momentum >= 1)
    reject("--momentum must be in [0, 1), got " + to_string(r.momentum));
  if (!finite_at_least(r.beta1, 0) || r.beta1 >= 1) reject("--beta1 must be in [0, 1), got " + to_string(r.beta1));
  if (!finite_at_least(r.beta2, 0) || r.beta2 >= 1) reject("--beta2 must be in [0, 1), got " + to_string(r.beta2));
  if (!std::isfinite(r.eps) || r.eps <= 0) reject("--eps must be a finite number > 0, got " + to_string(r.eps));
  if (!finite_at_least(r.weight_decay, 0))
    reject("--weight-decay must be a finite number >= 0, got " + to_string(r.weight_decay));
  if (o.max_connections == 0) reject("--max-connections must be positive");
  if (o.max_connections_per_address == 0) reject("--max-connections-per-address must be positive");
  if (o.max_request_bytes == 0) reject("--max-request-mb must be positive");
  if (o.max_keys_per_request == 0) reject("--max-keys-per-request must be positive");
  if (o.replicas == 0) reject("--replicas must be at least 1");
  if (!o.peer_token_file.empty() && o.replicas < 2 && !o.rejoin)
    reject("--peer-token-file is the secret of replicating servers: it needs --replicas 2 or more");
  if (o.replicas > 1 || o.rejoin) {
    if (o.peers.size() < o.replicas)
      reject("--replicas " + to_string(o.replicas) + " needs --peers listing every server (at least " +
             to_string(o.replicas) + "), got " + to_string(o.peers.size()));
    if (o.server_id >= o.peers.size())
      reject("--server-id " + to_string(o.server_id) + " is not an index into --peers (" + to_string(o.peers.size()) +
             " servers)");
    const bool tcp = o.uri.rfind("tcp://", 0) == 0, rdma = o.uri.rfind("rdma://", 0) == 0;
    if (!tcp && !rdma)
      reject(
          "--replicas runs over tcp:// and rdma:// (shm:// servers adopt their predecessor's segment with "
          "shm://NAME?adopt=1 instead)");
    // The ring runs on the servers' --uri (tcp, or rdma verbs), or, for rdma:// servers with
    // --peer-uri, on tcp between them.
    const bool over_peer_uri = rdma && !o.peer_uri.empty();
    if (over_peer_uri && o.peer_uri.rfind("tcp://", 0) != 0)
      reject("--peer-uri is a tcp://HOST:PORT where the peers of an rdma:// server replicate to it over tcp, got " +
             o.peer_uri);
    const std::string ring = rdma && !over_peer_uri ? "rdma://" : "tcp://";
    for (const std::string& p : o.peers)
      if (p.rfind(ring, 0) != 0)
        reject("--peers lists " + p + ", but this ring replicates over " + ring + " (--peers lists each server's " +
               (over_peer_uri ? "--peer-uri" : "--uri") + ")");
    if (tcp && !o.peer_uri.empty())
      reject("--peer-uri is for rdma:// servers; a tcp:// server takes its peers on --uri");
    if (o.rejoin && o.replicas < 2) reject("--rejoin takes the keys back from replicas: it needs --replicas 2 or more");
  } else if (!o.peer_uri.empty()) {
    reject("--peer-uri is where replicating servers reach this one: it needs --replicas 2 or more");
  }
  if (o.failover_timeout.count() < 0) reject("--failover-ms must not be negative");
  if (o.failover_timeout.count() > 0) {
    if (o.replicas < 2) reject("--failover-ms moves a dead server's keys to a replica: it needs --replicas 2 or more");
    if (o.peers.size() < 3)
      reject(
          "--failover-ms needs at least 3 servers in --peers: a server is certified down by a majority, and "
          "with 2 that is both");
    if (o.uri.rfind("tcp://", 0) != 0 && o.uri.rfind("rdma://", 0) != 0)
      reject("--failover-ms runs on tcp:// and rdma:// servers");
    if (o.failover_dir.empty())
      reject("--failover-ms needs --failover-dir: where this server keeps its votes, so that it never votes twice");
  } else if (!o.failover_dir.empty()) {
    reject("--failover-dir keeps the votes of --failover-ms, which is not set");
  }
  if (o.memory_budget_bytes < o.max_request_bytes)
    reject("--memory-budget-mb (" + to_string(o.memory_budget_bytes >> 20) + ") must be at least --max-request-mb (" +
           to_string(o.max_request_bytes >> 20) + "), or a largest request could never be served");
}
}  // namespace

// Another server's keys served here after a failover: an engine built from this server's replica
// of them, its own listener, and its replicator to the rest of that server's chain.
struct Takeover {
  std::unique_ptr<transport::Listener> listener;
  std::unique_ptr<ShardEngine> engine;
  std::unique_ptr<TcpReplicator> replicator;
  bool started = false;
  bool quiesced = false;  // being handed back: its listener applies nothing more (closed by stop())
  bool refilled = false;  // ... and the server's replica of its keys is a copy of this engine

  // The stop sequence of ServerImpl::stop, for this engine.
  void stop() {
    if (!listener) return;
    if (started && !quiesced) {
      listener->stop_accepting();
      listener->drain();
    }
    if (replicator) replicator->stop();
    if (engine) engine->shutdown();
    listener->close();
    listener.reset();
  }
};

// Thread-safety: construct and stop() from one thread; the accessors from any thread (they take
// mu_, which stop() holds while it closes the listener).
class ServerImpl {
 public:
  explicit ServerImpl(const ServerOptions& o) : options_(o) {
    validate(o);
    EngineOptions e;
    e.store.arena_bytes = o.arena_bytes;
    e.store.max_keys = o.max_keys;
    e.store.stripes = o.stripes;
    e.store.rule = o.rule;
    e.num_workers = o.num_workers;
    e.mode = o.mode;
    e.staleness = o.staleness;
    e.sync_required = o.sync_required;
    e.wait_timeout = o.wait_timeout;
    e.straggler = o.straggler;
    e.server_id = o.server_id;
    e.table_memory_bytes = o.table_memory_bytes;
    e.track_table_changes = !o.checkpoint_dir.empty();
    // Rows are shipped by tcp:// and rdma:// servers alike (over the ring's own transport).
    e.replicate_tables = o.replicas > 1;
    // This server keeps the keys of the replicas - 1 servers before it on the ring; its own are
    // kept by the ones after it.
    ReplicatorOptions r;
    r.server_id = o.server_id;
    r.io_timeout = o.frame_timeout;
    r.max_request_bytes = o.max_request_bytes;
    r.max_in_flight_bytes = std::max(o.memory_budget_bytes / 2, o.max_request_bytes);
    const auto servers = static_cast<std::uint32_t>(o.peers.size());
    for (std::uint32_t j = 1; j < o.replicas; ++j) {
      e.replica_of.push_back((o.server_id + servers - j) % servers);
      const std::uint32_t next = (o.server_id + j) % servers;
      r.replicas.push_back({next, o.peers[next]});
    }
    transport::ListenOptions& l = listen_options_;
    l.server_id = o.server_id;
    l.io_threads = o.io_threads;
    l.max_connections = o.max_connections;
    l.max_connections_per_address = o.max_connections_per_address;
    l.handshake_timeout = o.handshake_timeout;
    l.frame_timeout = o.frame_timeout;
    l.memory_budget_bytes = o.memory_budget_bytes;
    l.pinned_budget_bytes = o.rdma_pinned_bytes;
    l.pinned = std::make_shared<std::atomic<std::uint64_t>>(0);
    l.limits.max_keys = o.max_keys_per_request;
    l.limits.max_payload_bytes = o.max_request_bytes;
    if (!o.auth_token_file.empty()) l.token = auth::Token::load_file(o.auth_token_file);
    if (!o.peer_token_file.empty()) l.peer_token = auth::Token::load_file(o.peer_token_file);
    r.token = l.peer_token ? l.peer_token : l.token;
    listener_ = transport::listen(parse_uri(o.uri), l);
    if (!o.peer_uri.empty()) peer_listener_ = transport::listen(parse_uri(o.peer_uri), l);
    // A ring on this server's own transport sends what this listener takes: over verbs, what fits
    // a receive region (every server of a ring takes the same --rdma-recv-mb).
    if (!peer_listener_) r.max_request_bytes = std::min(r.max_request_bytes, listener_->largest_request());
    const std::string votes_path = o.failover_dir + "/votes-" + std::to_string(o.server_id);
    if (o.failover_timeout.count() > 0) {
      ::mkdir(o.failover_dir.c_str(), 0700);  // Failover writes its votes there at once: an error shows
      // Incarnations order a server's starts: a restart within the second of the previous start
      // is still a later one.
      if (const std::uint32_t last = VoteBook(votes_path, static_cast<std::uint32_t>(o.peers.size())).last_start();
          last > 0)
        e.min_incarnation = last + 1;
      // And a restart taking its keys back comes after the takeover serving them started.
      if (o.rejoin)
        e.min_incarnation =
            std::max(e.min_incarnation, takeover_start_floor(o.server_id, o.peers, r.token, o.failover_timeout) + 1);
    }
    transport::EngineMemory memory = listener_->engine_memory(e);
    engine_ = std::make_unique<ShardEngine>(e, std::move(memory.store), memory.clocks, std::move(memory.tables),
                                            std::move(memory.sync));
    if (!o.restore_dir.empty()) {
      const std::string path = checkpoint_path(o.restore_dir, o.server_id);
      const CheckpointInfo info = read_checkpoint(engine_->store(), engine_->sync(), path, o.server_id);
      log::info("checkpoint", "server " + std::to_string(o.server_id) + " restored " + std::to_string(info.keys) +
                                  " keys from " + path);
      const TableCheckpointInfo tables = TableCheckpointer::restore(*engine_, o.restore_dir, o.server_id);
      if (tables.files > 0)
        log::info("checkpoint", "server " + std::to_string(o.server_id) + " restored " + std::to_string(tables.rows) +
                                    " table rows (and " + std::to_string(tables.removed) + " evictions) from " +
                                    std::to_string(tables.files) + " table files");
    }
    if (!o.checkpoint_dir.empty())
      table_checkpointer_ = std::make_unique<TableCheckpointer>(o.checkpoint_dir, o.server_id);
    if (o.failover_timeout.count() > 0) {
      FailoverOptions f;
      f.server_id = o.server_id;
      f.peers = o.peers;
      f.replicas = o.replicas;
      f.timeout = o.failover_timeout;
      f.votes_path = votes_path;
      f.token = r.token;
      f.incarnation = engine_->epoch_seconds();
      FailoverHooks hooks;
      hooks.serve = [this](std::uint32_t origin) { return serve_takeover(origin); };
      hooks.depose = [this](const std::string& why) { depose(why); };
      hooks.quiesce = [this](std::uint32_t origin, std::string* why) { return quiesce_takeover(origin, why); };
      hooks.release = [this](std::uint32_t origin) { release_takeover(origin); };
      failover_ = std::make_unique<Failover>(*engine_, f, hooks);
      engine_->set_membership(failover_.get());
      r.may_drop = [this](std::uint32_t replica, std::uint32_t incarnation, const std::string& why) {
        return failover_->may_drop(replica, incarnation, why);
      };
      // A restart (--rejoin, or votes left by an earlier run of this server in this ring) claims
      // its keys first: it must not serve keys a takeover already serves elsewhere, and once it
      // has claimed them no takeover of its earlier incarnation can win.
      // With --rejoin, keys taken over while it was down are handed back to it first.
      if (o.rejoin || failover_->restarted())
        failover_->claim_own_keys(std::chrono::milliseconds(o.wait_timeout) * 3, o.rejoin);
    }
    replicator_options_ = r;
    if (o.rejoin) {
      const RejoinReport got = rejoin_from_replicas(*engine_, r, std::chrono::milliseconds(o.wait_timeout) * 3);
      log::info(
          "replication",
          "server " + std::to_string(o.server_id) + " rejoined: " + std::to_string(got.keys) + " records (" +
              std::to_string(got.bytes >> 20) + " MiB) from " + std::to_string(got.from.size()) + " replicas in " +
              std::to_string(static_cast<long long>(got.milliseconds)) + " ms" +
              (got.tables == 0 ? std::string()
                               : ", and " + std::to_string(got.tables) + " tables (" + std::to_string(got.table_rows) +
                                     " rows) from server " + std::to_string(got.tables_from)));
      r.table_position = got.table_position;
    }
    if (!r.replicas.empty()) {
      replicator_ = std::make_unique<TcpReplicator>(*engine_, r);
      engine_->set_replicator(replicator_.get());
    }
    // The peers' listener first: if it cannot start (its port is taken, say), the client
    // listener's threads are not yet running on an engine that the unwinding destroys; and if
    // the client listener cannot, the peers' is stopped before the engine goes.
    if (peer_listener_) peer_listener_->start(*engine_);
    try {
      listener_->start(*engine_);
    } catch (...) {
      if (peer_listener_) {
        peer_listener_->stop_accepting();
        peer_listener_->drain();
        peer_listener_->close();
      }
      throw;
    }
    uri_ = listener_->uri();
    if (replicator_) replicator_->start();
    if (failover_) failover_->start();
    {
      // A deposition while this was being built (a replica's keeper can ask for a certificate
      // at once) was recorded; it takes effect now that every member is in place.
      std::lock_guard lock(stop_mu_);
      constructed_ = true;
    }
    if (!deposed().empty()) depose(deposed());
    if (!o.checkpoint_dir.empty() && o.checkpoint_interval.count() > 0)
      checkpointer_ = std::thread([this] { checkpoint_loop(); });
  }

  ~ServerImpl() {
    stop();
    std::lock_guard lock(deposer_mu_);
    if (deposer_.joinable()) deposer_.join();  // a deposition's stop, begun on another thread
  }

  // Failover: another server's keys, served from this server's replica of them at a new port of
  // this host (the certificate tells the clients where).
  std::string serve_takeover(std::uint32_t origin) {
    EngineOptions e = engine_->options();
    e.server_id = origin;
    e.replica_of.clear();
    // Its tables' copies on the rest of the chain are charged as the origin's were.
    e.table_copies = options_.replicas;
    e.mark_pushes = true;
    e.replicate_tables = true;
    e.track_table_changes = false;
    auto t = std::make_unique<Takeover>();
    Uri at = parse_uri(options_.uri);
    at.port = 0;
    transport::ListenOptions l = listen_options_;
    l.server_id = origin;
    t->listener = transport::listen(at, l);
    try {
      transport::EngineMemory memory = t->listener->engine_memory(e);
      t->engine = std::make_unique<ShardEngine>(e, std::move(memory.store), memory.clocks);
      adopt_replica(*engine_, origin, *t->engine);
      // The rest of the origin's chain keeps its keys, under its id and this engine's newer
      // epoch (so these records win over the origin's there). This server's own replica of them
      // stays sealed (a hung origin waking up must not have frames acknowledged there) until a
      // hand-back refills it from this engine.
      ReplicatorOptions r = replicator_options_;
      r.server_id = origin;
      r.replicas.clear();
      r.table_position = 0;
      const auto servers = static_cast<std::uint32_t>(options_.peers.size());
      for (std::uint32_t j = 1; j < options_.replicas; ++j) {
        const std::uint32_t next = (origin + j) % servers;
        // Not a server certified down: it would be waited for as unreached, for the io timeout.
        if (next != options_.server_id && !failover_->down(next)) r.replicas.push_back({next, options_.peers[next]});
      }
      r.certified_down = [this](std::uint32_t replica) { return failover_->certified_down(replica); };
      if (!r.replicas.empty()) {
        t->replicator = std::make_unique<TcpReplicator>(*t->engine, r);
        t->engine->set_replicator(t->replicator.get());
      }
      t->engine->set_membership(failover_.get());
      // Its replicas are reached while the listener registers its memory: nobody watches a
      // takeover's port, and its first acknowledgements wait for them to sync.
      if (t->replicator) t->replicator->start();
      t->listener->start(*t->engine);
      t->started = true;
    } catch (...) {
      t->stop();
      throw;
    }
    const std::string uri = t->listener->uri();
    std::unique_lock lock(takeovers_mu_);
    if (takeovers_deposed_) {
      lock.unlock();
      t->stop();
      throw Error(Errc::peer_failure, "this server was certified down while it built the takeover");
    }
    takeovers_[origin] = std::move(t);
    return uri;
  }

  // A hand-back of `origin`'s keys: nothing more is applied or shipped, and this server's (sealed)
  // replica of them is refilled from the takeover: the restarted origin rejoins from it. The
  // takeover's clients are cut off when it is let go (release_takeover), and find the keys'
  // next place through the certificates.
  bool quiesce_takeover(std::uint32_t origin, std::string* why) {
    Takeover* t = nullptr;
    {
      std::lock_guard lock(takeovers_mu_);
      // (Takeovers leave the map only in stop(), after the Failover thread that calls this, and
      // in release_takeover(), from that thread.)
      if (auto it = takeovers_.find(origin); it != takeovers_.end()) t = it->second.get();
    }
    if (!t) {
      *why = "it serves no takeover of server " + std::to_string(origin);
      return false;
    }
    if (!t->quiesced) {
      // The connections stay open until the takeover is let go (stop()): closing them now would
      // count their workers as gone (evicted, with --straggler-policy evict) in the state the
      // refill copies. They are answered nothing meanwhile.
      t->listener->stop_accepting();
      t->listener->drain();
      // Every shipment answered or its replica dropped: the rest of the chain is still.
      if (t->replicator) t->replicator->stop();
      t->quiesced = true;
    }
    // Once: nothing changes the quiesced engine, and only this refills the sealed replica.
    if (!t->refilled) {
      try {
        refill_replica(*t->engine, t->replicator ? t->replicator->table_position() : 0, *engine_);
      } catch (const std::exception& e) {
        *why = e.what();
        return false;
      }
      t->refilled = true;
    }
    return true;
  }

  void release_takeover(std::uint32_t origin) {
    std::unique_ptr<Takeover> t;
    {
      std::lock_guard lock(takeovers_mu_);
      if (auto it = takeovers_.find(origin); it != takeovers_.end()) {
        t = std::move(it->second);
        takeovers_.erase(it);
      }
    }
    if (t) t->stop();
    // The origin's new incarnation ships to it from now on (its transfer restarts the copy).
    std::string why;
    engine_->seal_replica(origin, false, &why);
  }

  // Certified down: this server may no longer acknowledge anything, so it stops serving (its
  // clients find the keys' new holder through the certificates).
  void depose(const std::string& why) {
    {
      std::lock_guard lock(stop_mu_);
      deposed_ = why;
      if (!constructed_) return;  // the constructor acts on it once it is done
    }
    // Nothing is acknowledged from this instant, before the stop below gets that far.
    if (replicator_) replicator_->depose();
    {
      std::lock_guard lock(takeovers_mu_);
      takeovers_deposed_ = true;
      for (auto& [origin, t] : takeovers_)
        if (t->replicator) t->replicator->depose();
    }
    std::lock_guard lock(deposer_mu_);
    if (!deposer_.joinable()) deposer_ = std::thread([this] { stop(); });
  }

  std::string deposed() const {
    std::lock_guard lock(stop_mu_);
    return deposed_;
  }

  // The tables are checkpointed even when the store's checkpoint is abandoned (a stripe held
  // past its patience): the two files are independent.
  void checkpoint() {
    std::lock_guard lock(checkpoint_mu_);
    std::exception_ptr store_failed;
    try {
      write_checkpoint(engine_->store(), engine_->sync(), options_.checkpoint_dir, options_.server_id);
    } catch (const Error&) {
      store_failed = std::current_exception();
    }
    table_checkpointer_->write(*engine_);
    if (store_failed) std::rethrow_exception(store_failed);
  }

  void checkpoint_loop() {
    std::unique_lock lock(stop_mu_);
    while (!stop_cv_.wait_for(lock, options_.checkpoint_interval, [&] { return stopping_; })) {
      lock.unlock();
      try {
        checkpoint();
      } catch (const Error& e) {
        log::error("checkpoint", "server " + std::to_string(options_.server_id) + ": checkpoint failed: " + e.what());
      }
      lock.lock();
    }
  }

  // The one stop sequence of every backend: stop accepting, drain (no request is applied after
  // it), the final checkpoint (so it holds every acknowledged push), the engine's shutdown
  // (parked requests get their error while the connections are still open), close.
  void stop() {
    {
      std::lock_guard lock(stop_mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    stop_cv_.notify_all();
    if (checkpointer_.joinable()) checkpointer_.join();
    listener_->stop_accepting();
    if (peer_listener_) peer_listener_->stop_accepting();
    listener_->drain();
    if (peer_listener_) peer_listener_->drain();
    // The watcher may be building a takeover: it is done once stopped, and the takeovers go next.
    if (failover_) failover_->stop();
    {
      std::map<std::uint32_t, std::unique_ptr<Takeover>> takeovers;
      {
        std::lock_guard lock(takeovers_mu_);
        takeovers.swap(takeovers_);
      }
      for (auto& [origin, t] : takeovers) t->stop();
    }
    // Replies waiting for the replicas are resumed while their connections are still open.
    if (replicator_) replicator_->stop();
    if (!options_.checkpoint_dir.empty()) {
      try {
        checkpoint();
      } catch (const Error& e) {
        log::error("checkpoint",
                   "server " + std::to_string(options_.server_id) + ": final checkpoint failed: " + e.what());
      }
    }
    engine_->shutdown();
    std::lock_guard lock(mu_);
    listener_->close();
    if (peer_listener_) peer_listener_->close();
    closed_ = true;
  }

  std::string uri() const { return uri_; }
  std::string stats_json() const {
    transport::ListenerStats extra;
    {
      std::lock_guard lock(mu_);
      if (!closed_) extra = listener_->stats();
    }
    return engine_->stats_json(extra.external_pushes, extra.fields);
  }
  std::string failure() const { return engine_->failure(); }
  bool workers_finished() const {
    ClockTable* clocks = engine_->clocks();
    if (!clocks) return false;
    for (std::uint32_t w = 0; w < clocks->workers(); ++w)
      if (!clocks->evicted(w) && clocks->clock(w) != kClockDone) return false;
    return true;
  }

 private:
  ServerOptions options_;
  std::string uri_;
  // The listener outlives the engine: it may own the engine's memory (the shm segment).
  std::unique_ptr<transport::Listener> listener_;
  std::unique_ptr<transport::Listener> peer_listener_;  // rdma:// with replicas: the peers' tcp://
  std::unique_ptr<ShardEngine> engine_;
  // Failover (--failover-ms): declared before the replicator, which calls it, so that it outlives
  // it; stop() stops it before the takeovers, whose engines it serves votes for.
  std::unique_ptr<Failover> failover_;
  std::unique_ptr<TcpReplicator> replicator_;  // stopped before the listener closes
  std::mutex checkpoint_mu_;
  mutable std::mutex stop_mu_;
  mutable std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false, closed_ = false;
  std::thread checkpointer_;
  std::unique_ptr<TableCheckpointer> table_checkpointer_;  // with --checkpoint-dir
  transport::ListenOptions listen_options_;
  ReplicatorOptions replicator_options_;
  std::mutex takeovers_mu_;
  bool takeovers_deposed_ = false;  // under takeovers_mu_: no takeover is kept from then on
  std::map<std::uint32_t, std::unique_ptr<Takeover>> takeovers_;
  std::string deposed_;       // under stop_mu_: why this server was certified down
  bool constructed_ = false;  // under stop_mu_: every member is in place
  std::mutex deposer_mu_;
  std::thread deposer_;
};

}  // namespace detail

Server::Server(const ServerOptions& options) : impl_(std::make_unique<detail::ServerImpl>(options)) {}
Server::~Server() = default;
std::string Server::uri() const {
  return impl_->uri();
}
std::string Server::stats_json() const {
  return impl_->stats_json();
}
bool Server::workers_finished() const {
  return impl_->workers_finished();
}
std::string Server::failure() const {
  return impl_->failure();
}
std::string Server::deposed() const {
  return impl_->deposed();
}
void Server::stop() {
  impl_->stop();
}

}  // namespace pskv
