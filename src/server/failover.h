// Failover (--failover-ms): when a server dies or hangs, the next server of its chain serves its
// keys from its replica, and a server that may no longer acknowledge learns it and stops.
// docs/ARCHITECTURE.md, "Failover", has the protocol and why two servers never both hold a shard.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "common/json.h"
#include "engine/shard_engine.h"
#include "server/peer_links.h"
#include "server/vote_book.h"
#include "transport/auth.h"
#include "transport/wire.h"

namespace pskv {

// Builds a second engine for another server's keys from this server's replica of them: records
// (values, optimizer state, update counts, push marks, sync steps), every worker's clock, barrier
// generation and eviction, and tables with their push marks. The replica must be synced and
// sealed (nothing may apply to it meanwhile). Throws Error naming what could not be copied.
void adopt_replica(ShardEngine& holder, std::uint32_t origin, ShardEngine& into);

// The reverse, for a hand-back: `holder`'s sealed replica of the keys `from` served (a takeover
// engine, quiesced) becomes a copy of `from` as it stands, tables at `table_position` of the
// takeover's table stream. Throws Error naming what could not be copied.
void refill_replica(ShardEngine& from, std::uint32_t table_position, ShardEngine& holder);

// The takeovers of `server`'s keys that the other servers (`peers`) know to have won.
std::vector<wire::Certificate> known_takeovers_of(std::uint32_t server, const std::vector<std::string>& peers,
                                                  const std::shared_ptr<const auth::Token>& token,
                                                  std::chrono::milliseconds timeout);
// The latest start (incarnation) of the engines serving those takeovers now, as their hello
// replies say; 0 if none answers. A restart taking its keys back must be a later incarnation
// than any of them, so that its records win over theirs wherever a late one lands, whatever
// the hosts' clocks say.
std::uint32_t takeover_start_floor(std::uint32_t server, const std::vector<std::string>& peers,
                                   const std::shared_ptr<const auth::Token>& token, std::chrono::milliseconds timeout);

struct FailoverOptions {
  std::uint32_t server_id = 0;
  std::vector<std::string> peers;  // every server's URI, in server-id order
  std::uint32_t replicas = 2;
  // A server silent this long (no answer to a look, or its connection refused) is suspected.
  std::chrono::milliseconds timeout{1000};
  std::string votes_path;  // the VoteBook's file
  std::shared_ptr<const auth::Token> token;
  std::uint32_t incarnation = 0;  // this server's start, in seconds (ShardEngine::epoch_seconds)
};

// What the server does when this decides: `serve` starts a takeover engine for `origin`'s keys
// (built with adopt_replica, once the certificate is won) and returns the URI it serves at;
// `depose` stops this server: it may no longer acknowledge anything. Each is called from a
// Failover thread (or, for depose, one a request or the replicator runs on), never under its
// locks.
// A hand-back: `quiesce` stops serving `origin`'s keys (its clients are cut off, and no request is
// applied to them any more) and returns true once this server's own replica of them holds
// everything acknowledged; false, with *why, while it does not (asked again later). `release`
// then lets the takeover go.
struct FailoverHooks {
  std::function<std::string(std::uint32_t origin)> serve;
  std::function<void(const std::string& why)> depose;
  std::function<bool(std::uint32_t origin, std::string* why)> quiesce;
  std::function<void(std::uint32_t origin)> release;
};

// Thread-safety: every member from any thread; stop() once, before the engine goes.
class Failover final : public Membership {
 public:
  // Throws Error when its votes cannot be kept.
  Failover(ShardEngine& engine, FailoverOptions options, FailoverHooks hooks);
  ~Failover() override;
  // Starts watching the predecessors, once the server around it is complete (not after stop()).
  void start();
  // This server ran before in this ring (its votes file was there): a restart, which must claim
  // its keys before it serves them, with or without --rejoin.
  bool restarted() const noexcept { return book_.existed(); }
  Failover(const Failover&) = delete;
  Failover& operator=(const Failover&) = delete;
  void stop() noexcept;

  Errc vote(std::uint32_t server, std::uint32_t incarnation, std::uint32_t holder, const std::string& uri,
            std::uint32_t requester, std::string* why) override;
  Errc certified(std::uint32_t server, std::uint32_t incarnation, std::uint32_t holder, const std::string& uri,
                 std::string* why) override;
  std::string certificates(std::uint32_t about) const override;
  Errc hand_back(std::uint32_t server, std::uint32_t incarnation, std::uint32_t holder, const std::string& uri,
                 std::uint32_t requester, std::string* why) override;

  // A replicator's silent replica `replica` (incarnation as its hello said) is dropped only once
  // it is certified down: true once it is. False when this server could not win that (it is
  // down itself, or cut off from a majority): it is then deposed, and must not acknowledge.
  bool may_drop(std::uint32_t replica, std::uint32_t incarnation, const std::string& why);
  // A restarted server claims its keys before serving them. If another server took them over, it
  // asks that server to give them back when `take_back` (it then rejoins from its replicas, the
  // holder's among them); without, or if no majority answers within `patience`, throws Error.
  void claim_own_keys(std::chrono::milliseconds patience, bool take_back);
  bool deposed() const noexcept { return deposed_.load(); }
  // Whether a takeover of `server` was granted or won here: it is down.
  bool down(std::uint32_t server) const { return book_.takeover_of(server).has_value(); }
  // Whether a takeover of `server` is known here to have won (a grant alone may yet lose).
  bool certified_down(std::uint32_t server) const { return book_.won_takeover_of(server); }
  // Whether this server was deposed, whose keys it serves besides its own, and how many
  // certificates it knows to have won.
  JsonObject stats() const override;

 private:
  // Asks every server (this one through its own book) for its vote on `c`; true once a majority
  // granted. *down: some voter says this server is down.
  // *superseded: some voter says the incarnation asked about was replaced by a later one's claim.
  // *may_yet_win: the servers that did not answer in time would make a majority with those that
  // granted.
  bool win(const wire::Certificate& c, bool* down, std::string* why, bool* superseded = nullptr,
           bool* may_yet_win = nullptr);
  // Tells every other server that `c` won (best effort: the certificates op finds it anyway on
  // the servers that were told).
  void announce(const wire::Certificate& c);
  // Sends `op` (down_vote or down_certified) about `c` to every other server at once; their
  // answers, by server id (this server's entry stays timeout).
  std::vector<std::pair<Errc, std::string>> tell_everyone(wire::Op op, const wire::Certificate& c) const;
  // The server that takes `server`'s keys: the first of the next replicas - 1 servers not taken
  // over; UINT32_MAX if none is left.
  std::uint32_t holder_for(std::uint32_t server) const;
  // `server`'s keys are served by a holder that a takeover named and that is not down itself.
  bool held_elsewhere(std::uint32_t server) const;
  // This server's replica of `origin` is still the one it held when the origin's latest
  // incarnation claimed its keys (under mu_: _locked).
  bool holds_stale_copy(std::uint32_t origin) const;
  bool holds_stale_copy_locked(std::uint32_t origin) const;
  // `origin`'s incarnation `incarnation` claimed its keys: this server's replica of them is
  // stale until that incarnation's transfer restarts it (recorded once per incarnation).
  void claimed(std::uint32_t origin, std::uint32_t incarnation);
  void watch();
  // Connects links_ to each other server, asking again every second those not up yet (the
  // servers of a job start one by one), until all are or the server stops.
  void warm_links();
  // Seals this server's replica of `origin`, wins the certificate for it (unless one was won for
  // `certified_incarnation`, when not 0: the replica must be of that incarnation), then serves
  // its keys and tells every server where.
  void take_over(std::uint32_t origin, std::uint32_t certified_incarnation);
  void queue_takeover(std::uint32_t origin, std::uint32_t incarnation);
  // Stops serving `origin`'s keys, then claims them for its `incarnation` (the hand-back), then
  // lets the takeover go; what cannot be done yet is tried again at the watcher's next look.
  void give_back(std::uint32_t origin, std::uint32_t incarnation);
  // Asks the server holding this one's keys (from the certificates of the others) to give them
  // back; the refusal or the failure in *why when it cannot be asked.
  bool ask_hand_back(std::string* why) const;
  void depose(const std::string& why);
  // Why `server` says this server was certified down; empty if it does not (or cannot be asked).
  std::string certified_down_at(std::size_t server) const;
  std::uint32_t majority() const noexcept { return static_cast<std::uint32_t>(options_.peers.size() / 2 + 1); }

  ShardEngine& engine_;
  FailoverOptions options_;
  FailoverHooks hooks_;
  VoteBook book_;
  mutable PeerLinks links_;  // to every other server, for votes, announcements and lookups
  std::atomic<bool> deposed_{false}, stopping_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Certificates won elsewhere naming this server the holder: origin and incarnation.
  std::deque<std::pair<std::uint32_t, std::uint32_t>> to_take_;
  // Hand-backs under way (origins in serving_), and the incarnation each goes to.
  std::map<std::uint32_t, std::uint32_t> handing_back_;
  bool give_back_now_ = false;       // the watcher should try them without waiting for its next look
  std::set<std::uint32_t> serving_;  // origins whose keys this server serves now
  // Origins whose latest incarnation claimed its keys (a restart, or a hand-back), and the
  // transfer this server's replica of them held then: an earlier incarnation's copy, or a
  // takeover's, not the new incarnation's, until its own transfer restarts the replica.
  struct StaleCopy {
    std::uint32_t incarnation;
    std::uint64_t transfer;
  };
  std::map<std::uint32_t, StaleCopy> stale_copy_;
  std::mutex win_mu_;  // one certificate asked for at a time
  std::thread watcher_;
  std::thread warmer_;  // connects links_ to every other server once, after start()
};

}  // namespace pskv
