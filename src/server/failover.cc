#include "server/failover.h"

#include <algorithm>
#include <functional>
#include <span>
#include <utility>

#include "common/log.h"
#include "server/peer_links.h"
#include "table/embedding_table.h"
#include "transport/transport.h"
#include "transport/uri.h"

namespace pskv {
namespace {
constexpr std::uint64_t kAdoptBytes = 64ull << 20;  // records copied per step of adopt_replica
// How long may_drop asks a vote again, in failover timeouts, while voters only fail to answer.
constexpr int kVotePatience = 3;

// The certificates about server `about` that one request sent with `ask` (over a connection of
// its own, or a kept link) brings back; false if it cannot be asked or the answer does not parse.
bool read_certificates(const std::function<Errc(transport::Request&, std::string*)>& ask, std::uint32_t about,
                       std::vector<wire::Certificate>* won) {
  std::string text, why;
  transport::Request q;
  q.op = wire::Op::certificates;
  q.arg0 = wire::certificates_about(about);
  q.text_out = &text;
  return ask(q, &why) == Errc::ok && wire::decode_certificates(text, won, &why) == Errc::ok;
}

// The certificates the server at `uri` knows to have won; false if it cannot be asked.
bool certificates_at(const std::string& uri, std::uint32_t about, const std::shared_ptr<const auth::Token>& token,
                     std::chrono::milliseconds timeout, std::vector<wire::Certificate>* won) {
  try {
    auto conn = connect_peer(uri, token, timeout);
    return read_certificates([&](transport::Request& q, std::string* why) { return ask_once(conn, q, timeout, why); },
                             about, won);
  } catch (const Error&) {
    return false;  // down, or not a server of this ring any more
  }
}

// Where copy_state hands a server's state, piece by piece. Each returns ok or the failure (with
// *why).
struct StateSink {
  std::function<Errc(std::span<const KeyEntry> keys, const float* records, std::string* why)> records;
  // Every worker's words: all clocks, then barrier generations, then evictions.
  std::function<Errc(const std::vector<std::uint64_t>& words, std::string* why)> words;
  // A page of table `id` (`first`: the table's first page, with its spec and push marks).
  std::function<Errc(std::uint32_t id, const ReplicaTableRows& page, bool first, std::string* why)> table_page;
};

// Reads server `origin`'s state as `from` holds it (its replica of `origin`, or its own store when
// `origin` is its id): records in batches of up to kAdoptBytes, every worker's words, then each
// table's pages. Throws Error naming what failed, or if that copy is not whole (not synced).
void copy_state(ShardEngine& from, std::uint32_t origin, const StateSink& into) {
  std::string why;
  const auto check = [&](Errc e) {
    if (e != Errc::ok) throw Error(e, why);
  };
  std::vector<std::pair<Key, std::uint32_t>> index;
  std::vector<std::uint64_t> words;
  bool synced = false;
  check(from.replica_index(origin, &index, &synced, &words, &why));
  if (!synced) throw Error(Errc::peer_failure, "the replica of server " + std::to_string(origin) + " is not synced");
  std::vector<KeyEntry> keys;
  std::vector<float> records;
  for (std::size_t begin = 0; begin < index.size();) {
    keys.clear();
    std::uint64_t floats = 0;
    std::size_t end = begin;
    for (; end < index.size() && (end == begin || floats * sizeof(float) < kAdoptBytes); ++end) {
      const auto length = static_cast<std::uint32_t>(from.record_floats(index[end].second));
      keys.push_back({index[end].first, length, 0});
      floats += length;
    }
    records.resize(floats);
    check(from.read_records(origin, keys, records.data(), &why));
    check(into.records(keys, records.data(), &why));
    begin = end;
  }
  check(into.words(words, &why));
  for (std::uint32_t id = 0; id < kMaxTables; ++id) {
    std::uint32_t cursor = 0;
    do {
      ReplicaTableRows page;
      check(from.replica_table_rows(origin, id, cursor, 1u << 14, kAdoptBytes, &page, &why));
      if (!page.exists) break;
      check(into.table_page(id, page, cursor == 0, &why));
      cursor = page.next;
    } while (cursor != 0);
  }
}
}  // namespace

void adopt_replica(ShardEngine& holder, std::uint32_t origin, ShardEngine& into) {
  StateSink sink;
  sink.records = [&](std::span<const KeyEntry> keys, const float* records, std::string* why) {
    return into.restore_records(keys, records, why);
  };
  // Every clock, barrier arrival and eviction the origin acknowledged (as a rejoin takes them).
  sink.words = [&](const std::vector<std::uint64_t>& words, std::string*) {
    const std::size_t workers = words.size() / kWorkerWords;
    for (std::size_t w = 0; w < workers; ++w) {
      const auto worker = static_cast<std::uint32_t>(w);
      if (words[w] > 0) into.advance_clock(worker, words[w]);
      into.restore_barrier(worker, words[workers + w]);
      if (words[2 * workers + w]) into.restore_eviction(worker);
    }
    return Errc::ok;
  };
  sink.table_page = [&](std::uint32_t id, const ReplicaTableRows& page, bool first, std::string* why) {
    if (Errc e = into.restore_table_rows(id, page.requested, page.max_rows, page.ids, page.records.data(), why);
        e != Errc::ok)
      return e;
    return first ? into.restore_table_marks(id, page.marks, why) : Errc::ok;
  };
  copy_state(holder, origin, sink);
}

void refill_replica(ShardEngine& from, std::uint32_t table_position, ShardEngine& holder) {
  const std::uint32_t origin = from.options().server_id;
  StateSink sink;
  sink.records = [&](std::span<const KeyEntry> keys, const float* records, std::string* why) {
    return holder.apply_replica(origin, keys, records, why);
  };
  sink.words = [&](const std::vector<std::uint64_t>& words, std::string* why) {
    const std::size_t workers = words.size() / kWorkerWords;
    for (std::size_t k = 0; k < kWorkerWords; ++k)
      for (std::size_t w = 0; w < workers; ++w)
        if (Errc e = holder.apply_replica_word(static_cast<WorkerWord>(k), origin, static_cast<std::uint32_t>(w),
                                               words[k * workers + w], why);
            e != Errc::ok)
          return e;
    return Errc::ok;
  };
  // Connection 0: these table frames are this transfer's, and the next transfer on a real
  // connection (the restarted origin's) replaces it.
  std::vector<KeyEntry> rows;
  sink.table_page = [&](std::uint32_t id, const ReplicaTableRows& page, bool first, std::string* why) {
    if (first)
      if (Errc e =
              holder.apply_replica_table(origin, 0, table_position, id, page.requested, page.max_rows, page.marks, why);
          e != Errc::ok)
        return e;
    rows.clear();
    for (Key row : page.ids) rows.push_back({row, page.record_floats, 0});
    return holder.apply_replica_rows(origin, 0, table_position, id, rows, page.records.data(), why);
  };
  // (copy_state throws what it cannot copy; the marks' failures are thrown here.)
  std::string why;
  const Errc e = holder.refill_sealed_replica(
      origin,
      [&](std::string* failed) {
        if (Errc m = holder.mark_replica(origin, ReplicaMark::syncing, failed, 0, from.epoch_seconds()); m != Errc::ok)
          return m;
        copy_state(from, origin, sink);
        return holder.mark_replica(origin, ReplicaMark::synced, failed, 0);
      },
      &why);
  if (e != Errc::ok) throw Error(e, "refilling the replica of server " + std::to_string(origin) + ": " + why);
}

Failover::Failover(ShardEngine& engine, FailoverOptions options, FailoverHooks hooks)
    : engine_(engine),
      options_(std::move(options)),
      hooks_(std::move(hooks)),
      book_(options_.votes_path, static_cast<std::uint32_t>(options_.peers.size())),
      links_(options_.peers, options_.token, options_.timeout) {
  book_.record_start(options_.incarnation);  // (and so the votes can be kept: checked at start)
}

void Failover::start() {
  std::lock_guard lock(mu_);
  if (stopping_.load() || watcher_.joinable()) return;
  watcher_ = std::thread([this] { watch(); });
  warmer_ = std::thread([this] { warm_links(); });
}

Failover::~Failover() {
  stop();
}

void Failover::stop() noexcept {
  {
    std::lock_guard lock(mu_);
    if (stopping_.exchange(true)) return;
  }
  cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  if (warmer_.joinable()) warmer_.join();
  links_.close();
}

Errc Failover::vote(std::uint32_t server, std::uint32_t incarnation, std::uint32_t holder, const std::string& uri,
                    std::uint32_t requester, std::string* why) {
  const auto n = static_cast<std::uint32_t>(options_.peers.size());
  if (server >= n || holder >= n || requester >= n) {
    *why = "a down vote names a server past the " + std::to_string(n) + " of --peers";
    return Errc::invalid_argument;
  }
  return book_.vote({server, incarnation, holder, uri}, requester, why);
}

Errc Failover::certified(std::uint32_t server, std::uint32_t incarnation, std::uint32_t holder, const std::string& uri,
                         std::string* why) {
  const auto n = static_cast<std::uint32_t>(options_.peers.size());
  if (server >= n || holder >= n) {
    *why = "a certificate names a server past the " + std::to_string(n) + " of --peers";
    return Errc::invalid_argument;
  }
  if (Errc e = book_.certified({server, incarnation, holder, uri}, why); e != Errc::ok) return e;
  if (holder == server) {  // a restarted server's claim: nothing moves
    if (server == options_.server_id) return Errc::ok;
    bool handing_back = false;
    {
      std::lock_guard lock(mu_);
      // Its own claim won while this server gives its keys back: the watcher finishes at once
      // (and records the claim itself, before it unseals its replica).
      handing_back = handing_back_.count(server) > 0;
      give_back_now_ |= handing_back;
    }
    if (handing_back)
      cv_.notify_all();
    else
      claimed(server, incarnation);
    return Errc::ok;
  }
  if (server == options_.server_id) {
    // (An announcement about an earlier incarnation, arriving late, concerns nobody running.)
    if (incarnation >= options_.incarnation)
      depose("a majority certified it down; server " + std::to_string(holder) + " serves its keys");
  } else if (holder == options_.server_id) {
    queue_takeover(server, incarnation);
  }
  return Errc::ok;
}

void Failover::queue_takeover(std::uint32_t origin, std::uint32_t incarnation) {
  std::lock_guard lock(mu_);
  if (serving_.count(origin)) return;
  for (const auto& [queued, e] : to_take_)
    if (queued == origin) return;
  to_take_.emplace_back(origin, incarnation);
  cv_.notify_all();
}

std::string Failover::certificates(std::uint32_t about) const {
  // Claims too: a client that followed a takeover finds its way back after a hand-back.
  std::vector<wire::Certificate> won = book_.won();
  if (about != kAllServers)
    won.erase(std::remove_if(won.begin(), won.end(), [&](const wire::Certificate& c) { return c.server != about; }),
              won.end());
  return wire::encode_certificates(won);
}

Errc Failover::hand_back(std::uint32_t server, std::uint32_t incarnation, std::uint32_t holder, const std::string& uri,
                         std::uint32_t requester, std::string* why) {
  const auto n = static_cast<std::uint32_t>(options_.peers.size());
  if (server >= n || requester != server || holder != server || !uri.empty()) {
    *why = "a hand-back is asked for by the restarted server itself (one of the " + std::to_string(n) +
           " of --peers), for its own claim, which names no URI";
    return Errc::invalid_argument;
  }
  const std::string of = "server " + std::to_string(server);
  std::lock_guard lock(mu_);
  const auto under_way = handing_back_.find(server);
  const std::optional<wire::Certificate> took = book_.takeover_of(server);
  // A takeover this server won but could not serve (its engine could not be built) leaves the
  // keys in its sealed replica: given back all the same, with nothing to quiesce.
  const bool won_here = took && took->holder == options_.server_id && book_.won_takeover_of(server);
  if (!serving_.count(server) && !won_here && under_way == handing_back_.end()) {
    *why = "server " + std::to_string(options_.server_id) + " does not serve " + of + "'s keys";
    return Errc::not_found;
  }
  // A later restart of the server replaces a hand-back under way (whose own claim may have
  // replaced the takeover in this server's votes already); an earlier one does not.
  if (under_way != handing_back_.end() ? incarnation < under_way->second : !took || incarnation <= took->incarnation) {
    *why = of + "'s incarnation " + std::to_string(incarnation) + " is not later than the one its keys " +
           (under_way != handing_back_.end() ? "are being given back to" : "were taken over from");
    return Errc::invalid_argument;
  }
  handing_back_[server] = incarnation;
  give_back_now_ = true;
  cv_.notify_all();
  return Errc::ok;
}

void Failover::give_back(std::uint32_t origin, std::uint32_t incarnation) {
  const std::string who = "server " + std::to_string(options_.server_id);
  const std::string of = "server " + std::to_string(origin);
  if (deposed_.load()) return;
  bool serving = false;
  {
    std::lock_guard lock(mu_);
    serving = serving_.count(origin) > 0;
  }
  std::string why;
  if (serving && !hooks_.quiesce(origin, &why)) {
    log::warn("failover", who + " cannot give " + of + "'s keys back yet: " + why);
    return;
  }
  // Nothing is acknowledged for these keys from here, and this server's replica of them holds
  // everything that was: the restarted server rejoins from it once this claim wins. (If the
  // server's own claim won meanwhile, this is that very certificate: granted again.)
  const wire::Certificate c{origin, incarnation, origin, {}};
  bool down = false;
  std::string refused;
  if (!win(c, &down, &refused)) {
    log::warn("failover", who + " could not give " + of + "'s keys back yet (it tries again): " + refused);
    if (down) depose("a majority says it is down: " + refused);
    return;
  }
  {
    std::lock_guard lock(mu_);
    const auto it = handing_back_.find(origin);
    if (it == handing_back_.end() || it->second != incarnation) return;  // a later restart asked meanwhile
    handing_back_.erase(it);
    serving_.erase(origin);
  }
  // Before the replica is unsealed: the copy it holds is the takeover's, not the new incarnation's.
  claimed(origin, incarnation);
  // At once, before the announcement (which may wait on a slow server): the restarted server may
  // already have won its claim, and its transfer must find this replica open.
  hooks_.release(origin);
  announce(c);
  log::info("failover", who + " gave " + of + "'s keys back to its incarnation " + std::to_string(incarnation));
}

std::vector<wire::Certificate> known_takeovers_of(std::uint32_t server, const std::vector<std::string>& peers,
                                                  const std::shared_ptr<const auth::Token>& token,
                                                  std::chrono::milliseconds timeout) {
  std::vector<wire::Certificate> took, won;
  for (std::size_t s = 0; s < peers.size(); ++s) {
    if (s == server || !certificates_at(peers[s], server, token, timeout, &won))
      continue;  // (down too: the others answer)
    for (const wire::Certificate& c : won)
      if (c.server == server && c.holder != c.server && std::find(took.begin(), took.end(), c) == took.end())
        took.push_back(c);
  }
  return took;
}

std::uint32_t takeover_start_floor(std::uint32_t server, const std::vector<std::string>& peers,
                                   const std::shared_ptr<const auth::Token>& token, std::chrono::milliseconds timeout) {
  std::uint32_t latest = 0;
  for (const wire::Certificate& c : known_takeovers_of(server, peers, token, timeout)) {
    if (c.uri.empty()) continue;
    try {
      latest = std::max(latest, connect_peer(c.uri, token, timeout)->info().incarnation);
    } catch (const Error&) {
      // Not served there (any more): its engine is gone, and nothing of it can come late.
    }
  }
  return latest;
}

bool Failover::ask_hand_back(std::string* why) const {
  // The takeovers of this server's latest earlier incarnation, as the others know them: more
  // than one holder when the first died in its turn and a server missed the second's news.
  std::vector<wire::Certificate> took =
      known_takeovers_of(options_.server_id, options_.peers, options_.token, options_.timeout);
  std::erase_if(took, [&](const wire::Certificate& c) { return c.incarnation >= options_.incarnation; });
  if (took.empty()) {
    *why = "no server knows which one holds them";
    return false;
  }
  const std::uint32_t latest = std::max_element(took.begin(), took.end(), [](const auto& a, const auto& b) {
                                 return a.incarnation < b.incarnation;
                               })->incarnation;
  const std::vector<float> payload =
      wire::encode_down_vote({options_.server_id, options_.incarnation, options_.server_id, {}}, options_.server_id);
  why->clear();
  for (const wire::Certificate& c : took) {
    if (c.incarnation != latest) continue;
    std::string answer;
    const transport::KeySlice slice{0, static_cast<std::uint32_t>(payload.size()), const_cast<float*>(payload.data())};
    transport::Request q;
    q.op = wire::Op::hand_back;
    q.keys = {&slice, 1};
    if (links_.ask(c.holder, q, &answer) == Errc::ok) return true;
    if (!why->empty()) why->append("; ");
    why->append("server ").append(std::to_string(c.holder)).append(": ").append(answer);
  }
  return false;
}

std::uint32_t Failover::holder_for(std::uint32_t server) const {
  const auto n = static_cast<std::uint32_t>(options_.peers.size());
  for (std::uint32_t j = 1; j < options_.replicas; ++j) {
    const std::uint32_t next = (server + j) % n;
    if (!book_.takeover_of(next)) return next;
  }
  return UINT32_MAX;
}

std::vector<std::pair<Errc, std::string>> Failover::tell_everyone(wire::Op op, const wire::Certificate& c) const {
  const auto n = options_.peers.size();
  std::vector<std::pair<Errc, std::string>> answers(n, {Errc::timeout, {}});
  const std::vector<float> payload = wire::encode_down_vote(c, options_.server_id);
  // Every server at once: a hung one costs the timeout once, not once per server.
  std::vector<std::thread> askers;
  for (std::size_t s = 0; s < n; ++s) {
    if (s == options_.server_id) continue;
    askers.emplace_back([&, s] {
      const transport::KeySlice slice{0, static_cast<std::uint32_t>(payload.size()),
                                      const_cast<float*>(payload.data())};
      transport::Request q;
      q.op = op;
      q.keys = {&slice, 1};
      answers[s].first = links_.ask(s, q, &answers[s].second);
    });
  }
  for (auto& t : askers) t.join();
  return answers;
}

void Failover::claimed(std::uint32_t origin, std::uint32_t incarnation) {
  // This server's replica of `origin` is an earlier incarnation's copy, or a takeover's, until the
  // new incarnation's transfer restarts it: nothing to take the new one over from (a takeover's
  // incarnation, its start in seconds, may even equal the new incarnation's). A second
  // announcement of the same claim may come after that transfer began: not recorded again.
  std::lock_guard lock(mu_);
  const auto it = stale_copy_.find(origin);
  if (it == stale_copy_.end() || it->second.incarnation < incarnation)
    stale_copy_[origin] = {incarnation, engine_.replica_transfer(origin)};
}

bool Failover::holds_stale_copy(std::uint32_t origin) const {
  std::lock_guard lock(mu_);
  return holds_stale_copy_locked(origin);
}

bool Failover::holds_stale_copy_locked(std::uint32_t origin) const {
  const auto it = stale_copy_.find(origin);
  return it != stale_copy_.end() && it->second.transfer == engine_.replica_transfer(origin);
}

bool Failover::held_elsewhere(std::uint32_t server) const {
  const std::optional<wire::Certificate> c = book_.takeover_of(server);
  return c && book_.won_takeover_of(server) && !book_.takeover_of(c->holder);
}

bool Failover::win(const wire::Certificate& c, bool* down, std::string* why, bool* superseded, bool* may_yet_win) {
  std::lock_guard one(win_mu_);
  *down = false;
  if (superseded) *superseded = false;
  std::uint32_t unanswered = 0;
  std::string mine;
  const Errc own = book_.vote(c, options_.server_id, &mine);
  std::vector<std::pair<Errc, std::string>> answers = tell_everyone(wire::Op::down_vote, c);
  answers[options_.server_id] = {own, mine};
  std::uint32_t granted = 0;
  why->clear();
  for (std::size_t s = 0; s < answers.size(); ++s) {
    const auto& [answer, reason] = answers[s];
    if (answer == Errc::ok) {
      ++granted;
      continue;
    }
    *down |= answer == Errc::stale_resource;
    if (superseded) *superseded |= answer == Errc::not_found;
    if (!why->empty()) why->append("; ");
    why->append("server ").append(std::to_string(s)).append(": ").append(reason);
    unanswered += answer == Errc::timeout;  // (a refused port is a dead server: it never answers)
  }
  if (may_yet_win) *may_yet_win = granted + unanswered >= majority();
  return granted >= majority();
}

void Failover::announce(const wire::Certificate& c) {
  std::string why;
  book_.certified(c, &why);
  // A server not told now learns nothing it needs: a voter of the majority refuses the certified
  // server anyway, clients ask every server, and a deposed server asks too.
  tell_everyone(wire::Op::down_certified, c);
}

bool Failover::may_drop(std::uint32_t replica, std::uint32_t incarnation, const std::string& why) {
  if (deposed_.load()) return false;
  if (book_.won_takeover_of(replica)) return true;
  // Every server of the replica's chain is down already: its keys have nowhere to go (they are
  // lost with it). It is certified down all the same, naming this server, so that this one goes
  // on acknowledging its own keys rather than stop for want of a holder.
  std::uint32_t holder = holder_for(replica);
  if (holder == UINT32_MAX) holder = options_.server_id;
  const wire::Certificate c{replica, incarnation, holder, {}};
  bool down = false, superseded = false, may_yet_win = false, won = false;
  std::string refused;
  // Voters that did not answer in time (a loaded machine, or connects slower than the timeout)
  // are asked again for a while before this server gives up and stops: it acknowledges nothing
  // that needs this replica meanwhile, and stopping a healthy server takes its keys from every
  // worker and can stop the servers that replicate to it in turn.
  const auto give_up = std::chrono::steady_clock::now() + kVotePatience * options_.timeout;
  bool said = false;
  while (!(won = win(c, &down, &refused, &superseded, &may_yet_win)) && may_yet_win && !down && !superseded &&
         !stopping_.load() && std::chrono::steady_clock::now() < give_up) {
    if (!std::exchange(said, true))
      log::warn("failover", "server " + std::to_string(options_.server_id) +
                                ": no majority answered on replica server " + std::to_string(replica) + " yet (" +
                                refused + "); asking again for up to " +
                                std::to_string((kVotePatience * options_.timeout).count()) + " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (won) {
    log::warn("failover", "server " + std::to_string(options_.server_id) + ": replica server " +
                              std::to_string(replica) + " certified down (" + why + "); server " +
                              std::to_string(holder) + " takes its keys");
    announce(c);
    if (holder == options_.server_id) queue_takeover(replica, incarnation);
    return true;
  }
  // That incarnation of the replica is gone: it was restarted, and its successor claimed its keys
  // (it rejoins, and the keeper reconnects to it). Nothing is taken over.
  if (superseded && !down) return true;
  if (stopping_.load()) return false;  // this server stops anyway: nothing was decided about it
  depose("its replica server " + std::to_string(replica) + " went silent (" + why +
         ") and a majority would not certify it down: " + refused);
  return false;
}

void Failover::claim_own_keys(std::chrono::milliseconds patience, bool take_back) {
  const std::string who = "server " + std::to_string(options_.server_id);
  const auto give_up = std::chrono::steady_clock::now() + patience;
  const wire::Certificate c{options_.server_id, options_.incarnation, options_.server_id, {}};
  auto next_report = std::chrono::steady_clock::now();
  for (;;) {
    bool down = false;
    std::string refused, asked;
    if (win(c, &down, &refused)) {
      announce(c);
      return;
    }
    if (down && !take_back)
      throw Error(Errc::permission, who + "'s keys were taken over while it was down (" + refused +
                                        "); restart it with --rejoin to take them back from the server holding them");
    // The holder stops serving them, then claims them for this incarnation (a hand-back); this
    // claim wins once that one has.
    if (down && !ask_hand_back(&asked) && std::chrono::steady_clock::now() >= next_report) {
      log::warn("failover", who + " asked for its keys back: " + asked);
      next_report = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    }
    if (std::chrono::steady_clock::now() > give_up)
      throw Error(Errc::peer_failure,
                  down ? who + "'s keys were taken over while it was down, and not given back within " +
                             std::to_string(patience.count()) + " ms: " + (asked.empty() ? refused : asked)
                       : "no majority of the servers answered " + who + "'s claim of its keys within " +
                             std::to_string(patience.count()) + " ms: " + refused);
    std::this_thread::sleep_for(std::chrono::milliseconds(down ? 50 : 200));
  }
}

std::string Failover::certified_down_at(std::size_t server) const {
  // (Unreachable: asked again later, of another server.)
  std::vector<wire::Certificate> won;
  if (!read_certificates([&](transport::Request& q, std::string* why) { return links_.ask(server, q, why); },
                         options_.server_id, &won))
    return {};
  for (const wire::Certificate& c : won)
    if (c.server == options_.server_id && c.holder != options_.server_id && c.incarnation >= options_.incarnation)
      return "server " + std::to_string(server) + " knows it was certified down; server " + std::to_string(c.holder) +
             " serves its keys";
  return {};
}

void Failover::depose(const std::string& why) {
  if (deposed_.exchange(true)) return;
  log::error("failover",
             "server " + std::to_string(options_.server_id) + " stops: it may no longer acknowledge anything: " + why);
  hooks_.depose(why);
}

void Failover::take_over(std::uint32_t origin, std::uint32_t certified_incarnation) {
  const std::string who = "server " + std::to_string(options_.server_id);
  const std::string of = "server " + std::to_string(origin);
  const bool won = certified_incarnation != 0;
  std::uint32_t incarnation = 0;
  std::string why;
  if (!engine_.replica_synced(origin, &incarnation)) {
    log::error("failover", who + " cannot take over " + of + "'s keys: its replica of them is not synced");
    return;
  }
  // A copy older than the origin's last claim (its restart took its keys back, and its transfer
  // to this replica has not begun yet) is not the origin's state.
  if (book_.claimed_incarnation(origin) > incarnation || holds_stale_copy(origin)) return;
  // From here no frame of the origin is taken: whatever it acknowledged is in the replica now.
  engine_.seal_replica(origin, true, &why);
  if (!engine_.replica_synced(origin, &incarnation) || (won && incarnation != certified_incarnation)) {
    engine_.seal_replica(origin, false, &why);
    log::error("failover", who + " cannot take over " + of + "'s keys: its replica is not a synced copy of the " +
                               "incarnation certified down");
    return;
  }
  wire::Certificate c{origin, incarnation, options_.server_id, {}};
  // Won first, served after: a takeover that loses must not have replicated anything under the
  // origin's id (its records, newer than the origin's, would win at the origin's other replicas).
  if (!won) {
    bool down = false;
    std::string refused;
    if (!win(c, &down, &refused)) {
      engine_.seal_replica(origin, false, &why);
      log::warn("failover", who + " did not take " + of + "'s keys over: " + refused);
      if (down) depose("a majority says it is down: " + refused);
      return;
    }
  }
  if (deposed_.load()) return;  // certified down meanwhile: it serves nothing more
  try {
    c.uri = hooks_.serve(origin);
  } catch (const std::exception& e) {
    // Certified, and nobody else will serve them: the clients get their retry timeout's error.
    log::error("failover", who + " won " + of + "'s keys but cannot serve them: " + e.what());
    return;
  }
  {
    std::lock_guard lock(mu_);
    serving_.insert(origin);
  }
  announce(c);
  log::info("failover", who + " serves " + of + "'s keys at " + c.uri);
}

void Failover::watch() {
  struct Watched {
    std::uint32_t origin;
    std::unique_ptr<transport::Connection> conn;
    std::chrono::steady_clock::time_point last_answer;
  };
  std::vector<Watched> watched;
  for (std::uint32_t origin : engine_.options().replica_of)
    watched.push_back({origin, nullptr, std::chrono::steady_clock::now()});
  const auto look_every = std::max(options_.timeout / 4, std::chrono::milliseconds(20));
  auto next_self_look = std::chrono::steady_clock::now();
  std::size_t asked = options_.server_id;
  std::unique_lock lock(mu_);
  while (!stopping_.load()) {
    cv_.wait_for(lock, look_every, [&] { return stopping_.load() || !to_take_.empty() || give_back_now_; });
    if (stopping_.load()) break;
    // Hand-backs under way, tried again at every look until their claim wins: once quiesced,
    // nobody else serves those keys.
    give_back_now_ = false;
    const std::map<std::uint32_t, std::uint32_t> giving = handing_back_;
    for (const auto& [origin, incarnation] : giving) {
      if (deposed_.load()) break;
      lock.unlock();
      give_back(origin, incarnation);
      lock.lock();
    }
    // A server that was hung (or cut off) while it was certified down is told by nobody: the
    // winner's announcement could not reach it. It asks one other server a second.
    if (!deposed_.load() && std::chrono::steady_clock::now() >= next_self_look) {
      next_self_look = std::chrono::steady_clock::now() + std::chrono::seconds(1);
      asked = (asked + 1) % options_.peers.size();
      if (asked == options_.server_id) asked = (asked + 1) % options_.peers.size();
      lock.unlock();
      if (const std::string why = certified_down_at(asked); !why.empty()) depose(why);
      lock.lock();
      continue;
    }
    while (!to_take_.empty()) {
      const auto [origin, incarnation] = to_take_.front();
      to_take_.pop_front();
      if (serving_.count(origin)) continue;
      lock.unlock();
      take_over(origin, std::max(incarnation, 1u));
      lock.lock();
    }
    if (deposed_.load()) continue;
    for (Watched& w : watched) {
      // (A holder that died in its turn leaves the keys to the next server of the chain, which
      // finds the origin's port refused and takes them from its replica, which the holder's
      // takeover kept.)
      // An origin whose keys this replica does not hold whole (it has not started yet, say) could
      // not be taken over from here: not watched until it is synced.
      if (serving_.count(w.origin) || holder_for(w.origin) != options_.server_id || held_elsewhere(w.origin) ||
          !engine_.replica_synced(w.origin) || holds_stale_copy_locked(w.origin)) {
        w.last_answer = std::chrono::steady_clock::now();
        continue;
      }
      lock.unlock();
      // A look: the stats of the origin, over a connection kept between looks. An unanswered
      // look counts as silence; a connection refused twice, 20 ms apart, means the process is
      // gone (a hung one still completes the TCP handshake, and its hello times out instead).
      bool gone = false;
      for (int attempt = 0; attempt < 2 && !gone; ++attempt) {
        try {
          if (!w.conn) w.conn = connect_peer(options_.peers[w.origin], options_.token, options_.timeout);
          std::string stats, why;
          transport::Request q;
          q.op = wire::Op::stats;
          q.text_out = &stats;
          if (ask_once(w.conn, q, options_.timeout, &why) == Errc::ok) {
            w.last_answer = std::chrono::steady_clock::now();
            break;
          }
          w.conn.reset();
        } catch (const Error& e) {
          w.conn.reset();
          if (e.code() != Errc::peer_failure) break;
          if (attempt == 1)
            gone = true;
          else
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      }
      if ((gone || std::chrono::steady_clock::now() - w.last_answer > options_.timeout) && !stopping_.load()) {
        log::warn("failover", "server " + std::to_string(options_.server_id) + ": server " + std::to_string(w.origin) +
                                  (gone ? " refuses connections"
                                        : " silent for " + std::to_string(options_.timeout.count()) + " ms") +
                                  "; taking its keys over");
        take_over(w.origin, 0);
        w.last_answer = std::chrono::steady_clock::now();
      }
      lock.lock();
    }
  }
}

void Failover::warm_links() {
  std::vector<std::size_t> cold;
  for (std::size_t s = 0; s < options_.peers.size(); ++s)
    if (s != options_.server_id) cold.push_back(s);
  std::unique_lock lock(mu_);
  while (!stopping_.load() && !cold.empty()) {
    lock.unlock();
    std::erase_if(cold, [&](std::size_t s) { return stopping_.load() || links_.warm(s); });
    lock.lock();
    cv_.wait_for(lock, std::chrono::seconds(1), [&] { return stopping_.load(); });
  }
}

JsonObject Failover::stats() const {
  JsonObject j;
  std::string serving;
  {
    std::lock_guard lock(mu_);
    for (std::uint32_t s : serving_) {
      if (!serving.empty()) serving.push_back(',');
      serving.append(std::to_string(s));
    }
  }
  j.add("failover_deposed", deposed_.load()).add("failover_serving", serving);
  j.add("failover_certificates", book_.won().size());
  return j;
}

}  // namespace pskv
