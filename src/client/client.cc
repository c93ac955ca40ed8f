#include "pskv/client.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <optional>
#include <random>
#include <system_error>
#include <thread>

#include "client/placement.h"
#include "client/push_sequence.h"
#include "layout/clock_table.h"
#include "layout/hash.h"
#include "transport/transport.h"

namespace pskv {
namespace detail {

using transport::KeySlice;

constexpr std::span<const std::span<const float>> kNoValues{};

// Drives every connection that a waiting thread can poll (see transport::Poller).
class ConnectionsPoller final : public transport::Poller {
 public:
  // One call per connection, with its poller or nullptr.
  void add(transport::Poller* p) {
    ++connections_;
    if (!p) return;
    parts_.push_back(p);
    max_spin_us_ = std::min(max_spin_us_, p->max_spin_micros());  // fixed once a connection is made
  }
  void clear() noexcept {
    parts_.clear();
    connections_ = 0;
    max_spin_us_ = transport::Completion::kMaxSpinMicros;
  }
  transport::Poller* get() noexcept { return parts_.empty() ? nullptr : this; }
  void poll() noexcept override {
    for (auto* p : parts_) p->poll();
  }
  bool begin_polling() noexcept override {
    for (std::size_t i = 0; i < parts_.size(); ++i)
      if (!parts_[i]->begin_polling()) {
        while (i-- > 0) parts_[i]->end_polling();
        return false;
      }
    return true;
  }
  void end_polling() noexcept override {
    for (auto* p : parts_) p->end_polling();
  }
  // The lowest of its connections': a client of an shm server that holds every core and of a
  // tcp server also waits on tcp with the shorter limit (this poller is one per client).
  int max_spin_micros() const noexcept override { return max_spin_us_; }
  // One thread cannot sleep on several servers' sockets or words at once (nor on one while
  // another connection answers); with more, the waiter sleeps on its completion instead and
  // the transports' own threads read the answers.
  bool sleep_for_answers(const transport::Completion& c, std::chrono::steady_clock::time_point until,
                         std::chrono::steady_clock::time_point deadline) noexcept override {
    if (connections_ == 1 && parts_.size() == 1) return parts_[0]->sleep_for_answers(c, until, deadline);
    for (auto* p : parts_) p->rely_on_transport();
    return false;
  }

 private:
  std::vector<transport::Poller*> parts_;
  std::size_t connections_ = 0;
  int max_spin_us_ = transport::Completion::kMaxSpinMicros;  // the lowest of parts_'
};

// Thread-safety: the op table is guarded by ops_mu_; each Op is touched by one issuing thread,
// then by transport threads through its Completion, then by the waiting thread.
class ClientImpl {
  struct Op;
  struct Sent;
  struct Link;

 public:
  explicit ClientImpl(const ClientOptions& o) : options_(o) {
    if (o.servers.empty())
      throw Error(Errc::invalid_argument, "ClientOptions.servers is empty: name at least one server URI");
    placement_.servers = static_cast<std::uint32_t>(o.servers.size());
    placement_.partition = o.partition;
    placement_.range_keys = o.range_keys;
    placement_.chunk_floats = o.chunk_floats;
    retrying_ = o.retry_timeout.count() > 0;
    if (retrying_ && o.worker_id == kNoWorker)
      throw Error(Errc::invalid_argument,
                  "ClientOptions.retry_timeout needs worker_id: a server recognises a push sent again by its worker");
    transport::ConnectOptions& c = connect_options_;
    c.worker_id = o.worker_id;
    c.connect_timeout = o.connect_timeout;
    c.io_timeout = o.io_timeout;
    c.max_in_flight = o.max_in_flight;
    c.checksum = o.checksum;
    if (retrying_) {
      // shm servers are restarted by adopting their segment, where this client's pushes are its own.
      for (const auto& s : o.servers)
        if (const std::string scheme = parse_uri(s).scheme; scheme != "tcp" && scheme != "rdma")
          throw Error(Errc::invalid_argument,
                      "ClientOptions.retry_timeout is for tcp:// and rdma:// servers run with "
                      "--replicas; " +
                          s + " is " + scheme);
      pushes_.emplace();
    }
    if (!o.auth_token_file.empty()) c.token = auth::Token::load_file(o.auth_token_file);
    for (const auto& s : o.servers) {
      auto link = std::make_unique<Link>();
      link->uri = parse_uri(s);
      try {
        link->conn = transport::connect(link->uri, c);
      } catch (const Error&) {
        if (!retrying_) throw;
        // A retrying client may start while a failover (or a hand-back) moves a server's keys:
        // it follows the certificates, for its retry timeout, as a broken connection does.
        link->conn = connect_following(*link, links_.size(), std::chrono::steady_clock::now() + o.retry_timeout);
      }
      // A retrying client replaces connections, so no waiter may keep a pointer into one.
      if (!retrying_) poller_.add(link->conn->poller());
      links_.push_back(std::move(link));
    }
    if (o.initial_clock > 0 && o.worker_id != kNoWorker) {
      try {
        send_clock(o.initial_clock);
      } catch (...) {
        close_links();  // no destructor runs: a recovery that thread started is joined here
        throw;
      }
      clock_ = o.initial_clock;
    }
  }

  void disconnect() {
    finished_on_close_ = false;
    close_links();
  }

  // Destroying a connection completes its outstanding requests, which live in ops_.
  void close_links() noexcept {
    // Recoveries first: they submit to the links' connections and read their parts.
    stopping_.store(true);
    for (auto& l : links_)
      if (l->recoverer.joinable()) l->recoverer.join();
    poller_.clear();
    for (auto& l : links_) {
      std::lock_guard lock(l->mu);
      l->conn.reset();
    }
    links_.clear();
  }

  ~ClientImpl() {
    // Destroyed by an exception on its way out, the worker did not finish: it must not tell the
    // servers it did, or they would stop waiting for it instead of failing the job.
    if (std::uncaught_exceptions() > uncaught_at_start_) finished_on_close_ = false;
    if (options_.worker_id != kNoWorker && finished_on_close_ && !links_.empty()) say_goodbye();
    close_links();
  }

  void say_goodbye() noexcept {
    // Best effort and bounded: on a dead link this must not cost a whole I/O timeout. A retrying
    // client still reconnects, within the same bound, a server that restarted since this worker
    // last used it (or follows its keys' failover): the restarted server (or the holder) took
    // this worker's clock from the replicas but not that it finished, and the other workers'
    // bounded reads there would wait for it. If the wait gives up, destroying the connections
    // (before ops_, see the member order) fails the request, so nothing touches the op afterwards.
    try {
      closing_deadline_ = std::chrono::steady_clock::now() + kGoodbyeBudget;
      closing_.store(true);
      const Ticket t = issue(wire::Op::clock, {}, kNoValues, kClockDone);
      // A recovery begun late in the budget still has kGoodbyeFloor.
      wait_until(lookup(t), closing_deadline_ + kGoodbyeFloor);
    } catch (const Error&) {
    }
  }

  // `values` holds std::span<const float> (init, push) or std::span<float> (pull), one per key.
  template <class Span>
  Ticket issue(wire::Op kind, std::span<const Key> keys, std::span<Span> values, std::uint64_t arg0,
               int only_server = -1, std::string* text_out = nullptr) {
    if (keys.size() != values.size())
      throw Error(Errc::invalid_argument,
                  std::to_string(keys.size()) + " keys but " + std::to_string(values.size()) + " value buffers");
    const std::size_t servers = links_.size();
    if (servers == 0) throw Error(Errc::invalid_argument, "this client was disconnected; create a new one");
    const auto acquired = acquire();  // not a structured binding: clang 14 cannot capture those
    Op* const op = acquired.first;
    const Ticket ticket = acquired.second;
    for (auto& s : op->slices) s.clear();
    thread_local std::vector<Part> parts;
    for (std::size_t i = 0; i < keys.size(); ++i) {
      const std::size_t size = values[i].size();
      if (size == 0 || size > UINT32_MAX) {
        release(ticket);
        throw Error(Errc::invalid_argument, "key " + std::to_string(keys[i]) + " has " + std::to_string(size) +
                                                " floats; lengths must be in [1, 2^32)");
      }
      const auto length = static_cast<std::uint32_t>(size);
      // Transports only read from push sources; the one KeySlice type serves both directions.
      float* const data = const_cast<float*>(values[i].data());
      // Sparse batches are thousands of small keys: most never split, so skip the parts list.
      if (!splits(placement_, length)) {
        op->slices[home_server(placement_, keys[i])].push_back({keys[i], length, data});
        continue;
      }
      parts.clear();
      place(placement_, keys[i], length, parts);
      for (const Part& p : parts) op->slices[p.server].push_back({keys[i], p.length, data + p.offset});
    }
    return submit(op, ticket, kind, arg0, 0, only_server, text_out);
  }

  // Sends what `op`'s slices hold: clocks go to every server; stats and barriers to one; data
  // ops to the servers they touch.
  Ticket submit(Op* op, Ticket ticket, wire::Op kind, std::uint64_t arg0, std::uint32_t arg1, int only_server,
                std::string* text_out) {
    const std::size_t servers = links_.size();
    auto targets_server = [&](std::size_t s) {
      if (only_server >= 0) return static_cast<int>(s) == only_server;
      return kind == wire::Op::clock || !op->slices[s].empty();
    };
    std::uint32_t targets = 0;
    for (std::size_t s = 0; s < servers; ++s) targets += op->targeted[s] = targets_server(s);
    op->kind = kind;
    op->clock_at_issue = clock_.load(std::memory_order_relaxed);
    if (retrying_) {
      try {
        submit_for_retry(op, kind, arg0, arg1, text_out);
      } catch (...) {
        release(ticket);  // refused before anything was sent
        throw;
      }
      return ticket;
    }
    op->completion.reset(targets);
    for (std::size_t s = 0; s < servers; ++s) {
      if (!op->targeted[s]) continue;
      transport::Request& r = op->requests[s];
      r.op = kind;
      r.arg0 = arg0;
      r.arg1 = arg1;
      r.keys = op->slices[s];
      r.completion = &op->completion;
      r.text_out = text_out;
      links_[s]->conn->submit(r);
    }
    return ticket;
  }

  // Retry mode: one completion per server, each request listed on its link until the op is
  // finished, so that a reconnection can send again whatever its connection failed, in order.
  // The push's sequence number and its submissions are taken under one lock, so every server
  // receives one client's pushes in sequence order (what PushId relies on). A push carries its
  // session in arg0's high half (its clock in the low one) and its sequence number in arg1; a
  // table push, whose args name the table and the clock, carries both in its first key
  // (wire::take_table_push_identity).
  void submit_for_retry(Op* op, wire::Op kind, std::uint64_t arg0, std::uint32_t arg1, std::string* text_out) {
    std::lock_guard order(order_mu_);
    if (kind == wire::Op::push) {
      if (arg0 >> 32)
        throw Error(Errc::invalid_argument, "clock " + std::to_string(arg0) +
                                                " is past 2^32, which a retrying "
                                                "client's pushes cannot carry");
      arg1 = pushes_->next([&] { return pushes_may_be_sent_again(); });
      arg0 = wire::identified_push_arg0(arg0, pushes_->session());
    } else if (kind == wire::Op::table_push) {
      const std::uint32_t seq = pushes_->next([&] { return pushes_may_be_sent_again(); });
      const Key identity = (Key{pushes_->session()} << 32) | seq;
      for (std::size_t s = 0; s < links_.size(); ++s)
        if (op->targeted[s]) op->slices[s].insert(op->slices[s].begin(), transport::KeySlice{identity, 0, &no_values_});
    }
    for (std::size_t s = 0; s < links_.size(); ++s) {
      if (!op->targeted[s]) continue;
      transport::Request& r = op->requests[s];
      r.op = kind;
      r.arg0 = arg0;
      r.arg1 = arg1;
      r.keys = op->slices[s];
      r.completion = &op->parts[s].completion;
      r.text_out = text_out;
      Link& link = *links_[s];
      Sent& p = op->parts[s];
      p.completion.reset(1);
      p.stands = false;
      p.retried_out = false;
      p.silent_since = kNever;
      std::lock_guard lock(link.mu);
      link.append(&p);
      p.generation = link.generation;
      if (link.conn)
        link.conn->submit(r);
      else
        p.completion.complete_part(Errc::peer_failure, link.gave_up);
    }
  }

  // Whether a push of the current session is listed and not yet answered, or lost with its
  // connection (and so may be sent again). Under order_mu_.
  bool pushes_may_be_sent_again() {
    for (auto& l : links_) {
      std::lock_guard lock(l->mu);
      for (Sent* p = l->head; p; p = p->next)
        if ((p->op->kind == wire::Op::push || p->op->kind == wire::Op::table_push) &&
            (!p->completion.done() || to_send_again(*p)))
          return true;
    }
    return false;
  }

  // Waits for every part of `op`; in retry mode, reconnects a server whose connection failed
  // under a part and sends it again. False if `deadline` passed first.
  bool wait_until(Op* op, std::chrono::steady_clock::time_point deadline) {
    if (!retrying_) return op->completion.wait(deadline, poller_.get());
    std::size_t targets = 0;
    for (std::size_t s = 0; s < links_.size(); ++s) targets += op->targeted[s];
    // A part lost with its connection is sent again as soon as it fails, not once the parts
    // before it are answered: its restarted server may be holding, for this worker's clock, the
    // very answer those parts wait for (another worker's bounded read). So the wait is cut into
    // slices, and every part looked at after each.
    constexpr auto kRecheck = std::chrono::milliseconds(50);
    for (;;) {
      std::size_t waiting_on = links_.size();
      for (std::size_t s = 0; s < links_.size(); ++s) {
        if (!op->targeted[s]) continue;
        Sent& p = op->parts[s];
        if (p.stands || (p.completion.done() && settled(s, p))) continue;
        if (waiting_on == links_.size()) waiting_on = s;
      }
      if (waiting_on == links_.size()) return true;
      transport::Poller* poller = nullptr;
      std::shared_ptr<transport::Connection> conn;  // keeps the poller alive while it is used
      {
        Link& link = *links_[waiting_on];
        std::unique_lock lock(link.mu);
        if (link.recovering) {
          // Its part is sent again (or given up on) when the recovery ends.
          const auto now = std::chrono::steady_clock::now();
          if (now >= deadline) return false;
          link.recovery_ended.wait_until(lock, std::min(deadline, now + kRecheck), [&] { return !link.recovering; });
          continue;
        }
        conn = link.conn;
      }
      if (conn && conn->poller()) {
        if (targets == 1)
          poller = conn->poller();
        else
          conn->poller()->rely_on_transport();
      }
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) return false;
      op->parts[waiting_on].completion.wait(std::min(deadline, now + kRecheck), poller);
    }
  }

  // Whether a completed part stands (answered, refused, or its server is given up on). A part
  // whose connection broke under it is sent again once the server is back: false, wait again
  // (the link's recovery, started here if it is not running, sends it).
  // A part lost again and again to the server's silence on connections it accepts (it parks the
  // request past the client's io_timeout) stands once retry_timeout has passed since the first
  // of those losses: reconnecting, which succeeds each time, must not keep a wait alive forever.
  bool settled(std::size_t server, Sent& p) {
    Link& link = *links_[server];
    std::lock_guard lock(link.mu);
    return settled_locked(link, p);
  }

  // settled(), under link.mu. done() takes this path too, so that a caller who only polls
  // (Work.is_completed() in a loop) still has a lost part sent again.
  bool settled_locked(Link& link, Sent& p) {
    if (!p.completion.done()) return false;  // another waiter sent it again meanwhile
    if (!must_send_again(link, p)) {
      p.stands = true;
      return true;
    }
    const auto now = std::chrono::steady_clock::now();
    note_loss(p, now);
    if (p.silent_since != kNever && now - p.silent_since >= options_.retry_timeout) {
      p.retried_out = true;
      p.stands = true;
      return true;
    }
    start_recovery(link);
    return false;
  }

  // Under link.mu: hands the link to a recovery thread of its own unless one has it. No lock is
  // held while a recovery connects, waits or sleeps, so issuing and waiting on other links and
  // other ops go on meanwhile, and a wait returns at its own deadline.
  void start_recovery(Link& link) {
    if (link.recovering || stopping_.load()) return;
    // A thread that ended its recovery holds nothing more: its join is immediate.
    if (link.recoverer.joinable()) link.recoverer.join();
    // Closing, within the goodbye's budget: a server that is not back by then is not waited for.
    // Each link still gets kGoodbyeFloor, so that one server gone for good does not use up the
    // budget of a restarted one recovered after it.
    const auto deadline = closing_.load()
                              ? std::max(closing_deadline_, std::chrono::steady_clock::now() + kGoodbyeFloor)
                              : std::chrono::steady_clock::now() + options_.retry_timeout;
    // Every request on the old connection completes once it is gone (it is broken: they are
    // failing already). Its teardown (an rdma one deregisters memory) is the thread's, not
    // this lock's.
    std::shared_ptr<transport::Connection> old = std::move(link.conn);
    link.recovering = true;
    try {
      link.recoverer = std::thread([this, &link, deadline, old = std::move(old)]() mutable {
        old.reset();
        try {
          recover(link, deadline);
        } catch (const std::exception& e) {  // Errors are caught inside: a thread or memory
          end_recovery(link, std::string("reconnecting failed: ") + e.what());
        }
      });
    } catch (const std::system_error& e) {
      link.recovering = false;
      throw Error(Errc::io, std::string("cannot start a thread to reconnect: ") + e.what());
    }
  }

  void end_recovery(Link& link, std::string gave_up) {
    std::lock_guard lock(link.mu);
    link.gave_up = std::move(gave_up);
    link.recovering = false;
    link.recovery_ended.notify_all();
  }

  // Under link.mu, for a completed part: whether it failed with the connection it was sent on,
  // which has broken, and is to be sent again once the server is back. Otherwise its outcome
  // stands: answered, refused by a live server, or failed on a connection since replaced
  // (recover() sends every failed part again, so only when it gave up).
  bool must_send_again(const Link& link, const Sent& p) const {
    return lost_with_connection(p) && link.gave_up.empty() && p.generation == link.generation &&
           (!link.conn || link.conn->broken());
  }

  // How a connection fails its requests. A server refuses a push with neither (a refused push
  // sent again after a later one was applied would be taken for a duplicate), so what failed
  // otherwise stands.
  static bool lost_with_connection(const Sent& p) noexcept {
    const Errc e = p.completion.status();
    return e == Errc::peer_failure || e == Errc::timeout;
  }

  // Times a run of losses to silence (Errc::timeout: the connection heard nothing for io_timeout
  // while the part was outstanding); a loss of any other kind (the server died or restarted), or
  // one after which the server could not be reached at once (recover()), ends the run, so
  // restarts never count against a part however long they take together.
  static void note_loss(Sent& p, std::chrono::steady_clock::time_point now) noexcept {
    if (p.completion.status() != Errc::timeout)
      p.silent_since = kNever;
    else if (p.silent_since == kNever)
      p.silent_since = now;
  }

  // What remains until `deadline`, at least 1 ms: a timeout of 0 would mean none to a transport.
  static std::chrono::milliseconds time_left(std::chrono::steady_clock::time_point deadline) noexcept {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
  }

  // A listed part that recover() sends again: lost with its connection, outcome not yet taken.
  static bool to_send_again(const Sent& p) noexcept { return !p.stands && lost_with_connection(p); }
  static void clock_request(transport::Request& r, transport::Completion& done, std::uint64_t clock) noexcept {
    done.reset(1);
    r = transport::Request{};
    r.op = wire::Op::clock;
    r.arg0 = clock;
    r.completion = &done;
  }

  // A link's recovery thread: reconnects and sends again, in their original order, the listed
  // parts that failed. Gives up (link.gave_up) once the server has been unreachable until
  // `deadline`. Takes link.mu only to read the list and to install the new connection.
  void recover(Link& link, std::chrono::steady_clock::time_point deadline) {
    const bool began_closing = closing_.load();
    // A recovery begun before the goodbye ends within the goodbye's bound too.
    const auto bound = [&] {
      if (!began_closing && closing_.load()) deadline = std::min(deadline, closing_deadline_ + kGoodbyeFloor);
      return deadline;
    };
    // No listed part may still be in the old connection's hands when it is sent again, nor the
    // old announcement (its request is reused).
    for (;;) {
      bool in_hands = false;
      {
        std::lock_guard lock(link.mu);
        for (Sent* p = link.head; p && !in_hands; p = p->next) in_hands = !p->completion.done();
        in_hands = in_hands && std::chrono::steady_clock::now() < bound();
        in_hands = in_hands || !link.announced.done();
      }
      if (!in_hands) break;
      if (stopping_.load()) return end_recovery(link, "");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::string last = "no attempt";
    // An attempt failed before one got through: the server was away, not silent (see note_loss).
    bool was_away = false;
    // A restarted server is back within tens of ms: look often at first, then back off.
    auto pause = std::chrono::milliseconds(2);
    const std::size_t server = index_of(link);
    // Failover: the server's keys may be served elsewhere now.
    LookupSchedule lookups;
    // This loop is the retry (an rdma connection would otherwise wait out its connect timeout on
    // a dead server's port before the certificates are asked).
    transport::ConnectOptions reconnect = connect_options_;
    reconnect.wait_for_listener = false;
    reconnect.cancel = &stopping_;  // close_links() joins this thread: no connect outlasts it
    while (std::chrono::steady_clock::now() < bound() && !stopping_.load()) {
      try {
        // No attempt outlasts the deadline (a blackholed host would hold connect() for the whole
        // connect_timeout); the goodbye's connection lives only for its one request, so its hello
        // is bounded too.
        const std::chrono::milliseconds left = time_left(deadline);
        constexpr std::chrono::milliseconds kAtLeast{1};  // a timeout of 0 set in the options
        reconnect.connect_timeout = std::max(kAtLeast, std::min(left, connect_options_.connect_timeout));
        if (closing_.load()) reconnect.io_timeout = std::max(kAtLeast, std::min(left, connect_options_.io_timeout));
        auto conn = std::shared_ptr<transport::Connection>(transport::connect(link.uri, reconnect));
        // The restarted server knows nothing of this worker's clock (a retrying client always has
        // a worker id): announce the one its oldest unanswered request was issued at (what was
        // answered before it came earlier); the clock requests sent again carry it forward in order.
        std::uint64_t clock = clock_.load(std::memory_order_relaxed);
        {
          std::lock_guard lock(link.mu);
          for (Sent* p = link.head; p; p = p->next)
            if (to_send_again(*p)) {
              clock = p->op->clock_at_issue;
              break;
            }
        }
        transport::Completion announced;
        transport::Request r;
        clock_request(r, announced, clock);
        conn->submit(r);
        // In slices, so that close_links() is not kept waiting.
        bool answered = false;
        while (!(answered =
                     announced.wait(std::min(bound(), std::chrono::steady_clock::now() + std::chrono::milliseconds(50)),
                                    conn->poller())) &&
               std::chrono::steady_clock::now() < bound() && !stopping_.load()) {
        }
        if (!answered) {
          conn.reset();  // completes `r` before it goes out of scope
          break;
        }
        if (announced.status() != Errc::ok) throw Error(announced.status(), announced.message());
        // registered_mu_ before link.mu, as register_buffer takes them: a buffer registered
        // meanwhile is either in registered_ now or finds the new connection installed.
        std::lock_guard registered(registered_mu_);
        for (const auto& [data, bytes] : registered_) conn->register_buffer(data, bytes);
        std::lock_guard lock(link.mu);
        if (stopping_.load()) break;
        ++link.generation;
        link.conn = conn;
        const auto now = std::chrono::steady_clock::now();
        // Parts issued during the recovery were listed, and failed at once, behind the others.
        for (Sent* p = link.head; p; p = p->next) {
          if (!to_send_again(*p)) continue;
          if (was_away)
            p->silent_since = kNever;
          else
            note_loss(*p, now);
          p->completion.reset(1);
          p->generation = link.generation;
          conn->submit(p->op->requests[p->server]);
        }
        // Then the clock this worker is at: a clock the old server answered, before it died, is
        // not among what was sent again (the server only ever moves a clock forward).
        clock_request(link.announce, link.announced, clock_.load(std::memory_order_relaxed));
        conn->submit(link.announce);
        link.recovering = false;
        link.recovery_ended.notify_all();
        return;
      } catch (const Error& e) {
        last = e.what();
        was_away = true;
      }
      if (!no_failover_.load() && lookups.due() && !stopping_.load()) {
        if (std::optional<Uri> to = moved_to(server, bound()); to && !same_endpoint(*to, link.uri)) {
          link.uri = *to;  // only a recovery reads or writes it once the constructor is done
          last = "server " + std::to_string(server) + "'s keys moved to " + to->str();
          continue;
        }
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::milliseconds(25));
    }
    if (stopping_.load()) return end_recovery(link, "");
    const auto ms = [](auto d) {
      return std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(d).count()) + " ms";
    };
    const std::string how_long = began_closing     ? "for " + ms(kGoodbyeBudget) + " (the goodbye's bound)"
                                 : closing_.load() ? std::string("until the goodbye")
                                                   : "for " + ms(options_.retry_timeout);
    end_recovery(link, "gave up on " + link.uri.str() + " after retrying " + how_long + "; last attempt: " + last);
  }

  // Connects to server `server`, wherever the certificates say its keys are served now, trying
  // again until `deadline`; throws the last attempt's error then. For the constructor: nothing
  // is outstanding on the link yet.
  std::shared_ptr<transport::Connection> connect_following(Link& link, std::size_t server,
                                                           std::chrono::steady_clock::time_point deadline) {
    transport::ConnectOptions once = connect_options_;
    once.wait_for_listener = false;  // this loop is the retry
    LookupSchedule lookups;
    for (;;) {
      try {
        return std::shared_ptr<transport::Connection>(transport::connect(link.uri, once));
      } catch (const Error& e) {
        // Only a server that is not there, or not answering, is waited for: a wrong token, a
        // worker id out of range or another protocol version is said at once.
        if ((e.code() != Errc::peer_failure && e.code() != Errc::timeout) ||
            std::chrono::steady_clock::now() >= deadline)
          throw;
      }
      if (!no_failover_.load() && lookups.due())
        if (std::optional<Uri> to = moved_to(server, deadline); to && !same_endpoint(*to, link.uri)) {
          link.uri = *to;
          continue;
        }
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
  }

  // When a client that cannot reach a server asks the others where its keys went. Each look asks
  // every other server, so looks come every 25 ms for the first second (a takeover takes tens of
  // ms), then 50, 100, ... up to 500 ms apart (a server that is merely restarting is not asked
  // about forever).
  class LookupSchedule {
   public:
    bool due() {
      const auto now = std::chrono::steady_clock::now();
      if (now < next_) return false;
      next_ = now + pause_;
      if (next_ - began_ > std::chrono::seconds(1)) pause_ = std::min(pause_ * 2, std::chrono::milliseconds(500));
      return true;
    }

   private:
    std::chrono::steady_clock::time_point began_ = std::chrono::steady_clock::now(), next_ = began_;
    std::chrono::milliseconds pause_{25};
  };

  static bool same_endpoint(const Uri& a, const Uri& b) noexcept {
    return a.scheme == b.scheme && a.host == b.host && a.port == b.port;
  }

  std::size_t index_of(const Link& link) const {
    for (std::size_t s = 0; s < links_.size(); ++s)
      if (links_[s].get() == &link) return s;
    return links_.size();
  }

  // Where server `server`'s keys are served now, if a failover moved them (a certificate another
  // server knows: docs/ARCHITECTURE.md, "Failover"); nothing if none says so, or if it names a URI
  // no client could follow. The latest incarnation's certificate counts: a takeover's holder, or
  // the server itself once a restart took its keys back. Each server is asked on a connection of
  // its own, made without a worker id (a worker's connection coming and going would count as that
  // worker joining and leaving). A ring whose servers all refuse the question (run without
  // --failover-ms) is not asked again.
  std::optional<Uri> moved_to(std::size_t server, std::chrono::steady_clock::time_point deadline) {
    transport::ConnectOptions c = connect_options_;
    c.worker_id = kNoWorker;
    // Never past the caller's deadline (the goodbye's is 2 s away at most).
    const std::chrono::milliseconds left = time_left(deadline);
    c.connect_timeout = std::min({c.connect_timeout, std::chrono::milliseconds(500), left});
    c.io_timeout = std::min({c.io_timeout, std::chrono::milliseconds(1000), left});
    c.wait_for_listener = false;  // a dead server: the others answer
    c.cancel = &stopping_;
    // The servers are asked at once (a few at a time), so a lookup costs the slowest answer, not
    // their sum: a hung server costs its io timeout once, and an rdma connection's setup once.
    constexpr std::size_t kAtOnce = 8;
    const std::size_t n = options_.servers.size();
    std::vector<Errc> status(n, Errc::peer_failure);
    std::vector<std::vector<wire::Certificate>> known(n);
    const auto ask = [&](std::size_t s) {
      try {
        auto conn = transport::connect(parse_uri(options_.servers[s]), c);
        std::string text;
        transport::Completion done;
        done.reset(1);
        transport::Request q;
        q.op = wire::Op::certificates;
        q.arg0 = wire::certificates_about(static_cast<std::uint32_t>(server));
        q.text_out = &text;
        q.completion = &done;
        conn->submit(q);
        // Bounded by the connection's io timeout, which fails the request.
        while (!done.wait(std::chrono::steady_clock::now() + std::chrono::seconds(1), conn->poller())) {
        }
        std::string why;
        status[s] = done.status();
        if (status[s] == Errc::ok && wire::decode_certificates(text, &known[s], &why) != Errc::ok)
          status[s] = Errc::protocol;
      } catch (const Error&) {
        // That server is down too: the others answer.
      }
    };
    std::size_t asked = 0;
    for (std::size_t begin = 0; begin < n && std::chrono::steady_clock::now() < deadline; begin += kAtOnce) {
      std::vector<std::thread> askers;
      for (std::size_t s = begin; s < std::min(n, begin + kAtOnce); ++s)
        if (s != server) {
          askers.emplace_back(ask, s);
          ++asked;
        }
      for (std::thread& t : askers) t.join();
    }
    std::size_t refused = 0;
    std::optional<wire::Certificate> latest;
    for (std::size_t s = 0; s < n; ++s) {
      refused += status[s] == Errc::unsupported;
      if (status[s] != Errc::ok) continue;
      // Of one incarnation, a takeover is later than its claim (a claim's hand-back names a
      // later incarnation than the takeover it ends).
      for (wire::Certificate& cert : known[s])
        if (cert.server == server && (cert.holder == server || !cert.uri.empty()) &&
            (!latest || cert.incarnation > latest->incarnation ||
             (cert.incarnation == latest->incarnation && latest->holder == server && cert.holder != server)))
          latest = std::move(cert);
    }
    if (asked > 0 && refused == asked) no_failover_.store(true);
    if (!latest) return std::nullopt;
    try {
      Uri to = parse_uri(latest->holder == server ? options_.servers[server] : latest->uri);
      // This client's own parameters go along (rdma's poll=busy, dev, gid): a holder's URI has none.
      if (const Uri mine = parse_uri(options_.servers[server]); mine.scheme == to.scheme)
        for (const auto& [key, value] : mine.params) to.params.emplace(key, value);
      return to;
    } catch (const Error&) {
      return std::nullopt;  // a URI no client could follow
    }
  }

  void wait(Ticket ticket) {
    Op* op = lookup(ticket);
    // Transports guarantee every request completes (answer, error, or their own timeout), so
    // this wait is bounded by them (and by retry_timeout); the deadline only re-checks.
    while (!wait_until(op, std::chrono::steady_clock::now() + std::chrono::hours(1))) {
    }
    finish(ticket, op);
  }

  bool wait_for(Ticket ticket, std::chrono::milliseconds timeout) {
    Op* op = lookup(ticket);
    if (!wait_until(op, std::chrono::steady_clock::now() + timeout)) return false;
    finish(ticket, op);
    return true;
  }

  // Spends a completed ticket: records what a pull saw, frees the op, throws its error.
  void finish(Ticket ticket, Op* op) {
    Errc status = Errc::ok;
    std::string message;
    std::uint64_t bound = ~0ull;
    if (!retrying_) {
      status = op->completion.status();
      message = op->completion.message();
      bound = op->completion.bound();
    } else {
      for (std::size_t s = 0; s < links_.size(); ++s) {
        if (!op->targeted[s]) continue;
        Sent& p = op->parts[s];
        std::lock_guard lock(links_[s]->mu);
        links_[s]->remove(&p);
        bound = std::min(bound, p.completion.bound());
        if (status == Errc::ok && p.completion.status() != Errc::ok) {
          status = p.completion.status();
          message = p.completion.message();
          if (lost_with_connection(p) && !links_[s]->gave_up.empty() && message != links_[s]->gave_up)
            message = message.empty() ? links_[s]->gave_up : message + "; " + links_[s]->gave_up;
          if (p.retried_out)
            message += "; sent again on new connections for " + std::to_string(options_.retry_timeout.count()) +
                       " ms (ClientOptions.retry_timeout), each accepted and then left without an answer for "
                       "io_timeout; given up";
        }
      }
    }
    if (status == Errc::ok && op->kind == wire::Op::pull) record_staleness(op->clock_at_issue, bound);
    if (status == Errc::ok && op->rows_out)
      for (const auto& [to, from] : op->repeats)
        std::copy_n(op->rows_out + std::size_t{from} * op->row_dim, op->row_dim,
                    op->rows_out + std::size_t{to} * op->row_dim);
    const wire::Op kind = op->kind;
    release(ticket);
    if (status != Errc::ok)
      throw Error(status, std::string(wire::op_name(static_cast<std::uint16_t>(kind))) + ": " + message);
  }

  // Drives the connections too: an answer that landed completes here, with nobody waiting.
  bool done(Ticket ticket) {
    Op* op = lookup(ticket);
    if (retrying_) {
      // Done once every part stands; one that must be sent again is handed to its link's
      // recovery, as a wait would.
      for (std::size_t s = 0; s < links_.size(); ++s) {
        if (!op->targeted[s]) continue;
        Sent& p = op->parts[s];
        if (!p.completion.done()) return false;
        Link& link = *links_[s];
        std::unique_lock lock(link.mu, std::try_to_lock);
        if (!lock.owns_lock()) return false;
        if (p.stands) continue;  // its outcome is taken (one given up on still looks lost)
        try {
          if (!settled_locked(link, p)) return false;
        } catch (const Error&) {
          return false;  // no thread to reconnect with: the next wait starts it, or says why
        }
      }
      return true;
    }
    if (!op->completion.done())
      if (transport::Poller* p = poller_.get()) p->poll();
    return op->completion.done();
  }

  void send_clock(std::uint64_t value) {
    const Ticket t = issue(wire::Op::clock, {}, kNoValues, value);
    wait(t);
  }

  void clock() {
    require_worker("clock()");
    const std::uint64_t next = clock_.load(std::memory_order_relaxed) + 1;
    send_clock(next);
    clock_.store(next, std::memory_order_relaxed);
  }

  Ticket clock_async() {
    require_worker("clock()");
    const std::uint64_t next = clock_.load(std::memory_order_relaxed) + 1;
    const Ticket t = issue(wire::Op::clock, {}, kNoValues, next);
    clock_.store(next, std::memory_order_relaxed);
    return t;
  }

  Ticket barrier_async() {
    require_worker("barrier()");
    ++barrier_generation_;
    return issue(wire::Op::barrier, {}, kNoValues, barrier_generation_, 0);
  }

  void create_table(std::uint32_t table, const TableSpec& spec) {
    if (std::string why = check_table_spec(spec); !why.empty()) throw Error(Errc::invalid_argument, why);
    check_table_use(table, "create_table");
    if (links_.empty()) throw Error(Errc::invalid_argument, "this client was disconnected; create a new one");
    const auto acquired = acquire();
    Op* const op = acquired.first;
    for (auto& sl : op->slices) sl.clear();
    op->owned.resize(wire::kTableSpecFloats);
    wire::encode_table_spec(spec, op->owned.data());
    for (auto& sl : op->slices) sl.push_back({table, wire::kTableSpecFloats, op->owned.data()});
    wait(submit(op, acquired.second, wire::Op::table_create, 0, 0, -1, nullptr));
    table_dims_[table].store(spec.dim, std::memory_order_release);
  }

  // pull_rows (`grads` null) and push_rows: the ids' rows go to their home servers; an id
  // repeated in the batch is sent once (its gradients summed; its row copied to the repeats
  // once it has arrived).
  Ticket rows(wire::Op kind, std::uint32_t table, std::span<const Key> ids, float* data, std::size_t floats) {
    check_table_use(table, wire::op_name(static_cast<std::uint16_t>(kind)));
    const std::uint32_t dim = table_dims_[table].load(std::memory_order_acquire);
    if (dim == 0)
      throw Error(Errc::invalid_argument, "table " + std::to_string(table) +
                                              " is unknown to this client: call create_table first (every "
                                              "worker may, with the same spec)");
    if (floats != ids.size() * dim)
      throw Error(Errc::invalid_argument, std::to_string(ids.size()) + " rows of table " + std::to_string(table) +
                                              " take " + std::to_string(ids.size() * dim) + " floats, not " +
                                              std::to_string(floats));
    if (links_.empty()) throw Error(Errc::invalid_argument, "this client was disconnected; create a new one");
    const auto acquired = acquire();
    Op* const op = acquired.first;
    for (auto& sl : op->slices) sl.clear();
    op->owned.clear();
    // Each id's distinct index, in order of first sight (open addressing over a table twice the
    // batch), and each distinct id's first occurrence.
    thread_local std::vector<Key> seen_key;
    thread_local std::vector<std::uint32_t> seen_as;
    thread_local std::vector<std::uint32_t> distinct;  // per id
    thread_local std::vector<std::uint32_t> first;     // per distinct id
    std::size_t cap = 16;
    while (cap < 2 * ids.size()) cap *= 2;
    seen_key.resize(cap);
    seen_as.assign(cap, UINT32_MAX);
    distinct.resize(ids.size());
    first.clear();
    for (std::size_t i = 0; i < ids.size(); ++i) {
      std::size_t b = mix64(ids[i]) & (cap - 1);
      while (seen_as[b] != UINT32_MAX && seen_key[b] != ids[i]) b = (b + 1) & (cap - 1);
      if (seen_as[b] == UINT32_MAX) {
        seen_key[b] = ids[i];
        seen_as[b] = static_cast<std::uint32_t>(first.size());
        first.push_back(static_cast<std::uint32_t>(i));
      }
      distinct[i] = seen_as[b];
    }
    const bool pushing = kind == wire::Op::table_push;
    const bool repeats = first.size() < ids.size();
    if (pushing && repeats) {
      // Summed into a buffer of the op's own, one row per distinct id.
      op->owned.assign(first.size() * dim, 0.0f);
      for (std::size_t i = 0; i < ids.size(); ++i) {
        float* to = op->owned.data() + std::size_t{distinct[i]} * dim;
        const float* from = data + i * dim;
        for (std::uint32_t j = 0; j < dim; ++j) to[j] += from[j];
      }
    }
    float* const rows = pushing && repeats ? op->owned.data() : data;
    // A distinct id's row: in the op's sums, or at its first occurrence in the caller's buffer.
    for (std::size_t u = 0; u < first.size(); ++u) {
      const Key id = ids[first[u]];
      op->slices[home_server(placement_, id)].push_back({id, dim, rows + (pushing && repeats ? u : first[u]) * dim});
    }
    if (!pushing && repeats) {
      for (std::size_t i = 0; i < ids.size(); ++i)
        if (first[distinct[i]] != i) op->repeats.emplace_back(static_cast<std::uint32_t>(i), first[distinct[i]]);
      op->rows_out = data;
      op->row_dim = dim;
    }
    return submit(op, acquired.second, kind, clock_.load(std::memory_order_relaxed), table, -1, nullptr);
  }

  void check_table_use(std::uint32_t table, std::string_view what) const {
    if (table >= kMaxTables)
      throw Error(Errc::invalid_argument, std::string(what) + ": table id " + std::to_string(table) + " is past the " +
                                              std::to_string(kMaxTables) + " a server holds");
  }

  void require_worker(const char* what) const {
    if (options_.worker_id == kNoWorker)
      throw Error(Errc::invalid_argument,
                  std::string(what) + " needs ClientOptions.worker_id (this client is anonymous)");
  }

  std::string server_stats(std::size_t server) {
    if (server >= links_.size()) throw Error(Errc::invalid_argument, "no server " + std::to_string(server));
    std::string text;
    wait(issue(wire::Op::stats, {}, kNoValues, 0, static_cast<int>(server), &text));
    return text;
  }

  void register_buffer(void* data, std::size_t bytes) {
    // Held across the links: a recovery installing a connection meanwhile registers it too.
    std::unique_lock registered(registered_mu_, std::defer_lock);
    if (retrying_) {
      registered.lock();
      registered_.emplace_back(data, bytes);  // for the connections recover() makes
    }
    for (auto& l : links_) {
      std::lock_guard lock(l->mu);
      if (l->conn) l->conn->register_buffer(data, bytes);
    }
  }

  StalenessStats staleness() const {
    std::lock_guard lock(stats_mu_);
    return staleness_;
  }

  std::uint64_t current_clock() const noexcept { return clock_.load(std::memory_order_relaxed); }
  std::size_t num_servers() const noexcept { return links_.size(); }

 private:
  // Retry mode: an op's request to one server, listed on that server's link until finished.
  struct Sent {
    transport::Completion completion;
    Op* op = nullptr;
    std::size_t server = 0;
    std::uint64_t generation = 0;  // the link's connection it was last submitted on
    // A waiter has taken its outcome: never sent again. Set under the link's lock, read without
    // it by waiters (done() may set it while another thread waits).
    std::atomic<bool> stands{false};
    bool retried_out = false;  // stands: lost to silence again and again for a whole retry_timeout
    // When the current run of losses to the server's silence began (note_loss), or kNever.
    std::chrono::steady_clock::time_point silent_since = kNever;
    Sent* prev = nullptr;
    Sent* next = nullptr;
  };
  struct Op {
    transport::Completion completion;  // all parts, when not retrying
    std::vector<transport::Request> requests;
    std::vector<std::vector<KeySlice>> slices;
    std::vector<char> targeted;  // per server
    std::unique_ptr<Sent[]> parts;
    wire::Op kind = wire::Op::pull;
    std::uint64_t clock_at_issue = 0;
    std::uint32_t generation = 0;
    bool in_use = false;
    // Table ops: what the op sends from a buffer of its own (a table's spec, gradients of repeated
    // ids summed), and for a pull_rows with repeated ids, (repeat, first occurrence) pairs whose
    // rows are copied in rows_out once it completes.
    std::vector<float> owned;
    std::vector<std::pair<std::uint32_t, std::uint32_t>> repeats;
    float* rows_out = nullptr;
    std::uint32_t row_dim = 0;
  };
  // One server. Without retries `conn` is set once and never replaced. With them, `mu` orders
  // submissions, reconnection and the list of parts not yet finished, in submission order.
  struct Link {
    Uri uri;
    std::mutex mu;
    std::shared_ptr<transport::Connection> conn;
    std::uint64_t generation = 0;
    std::string gave_up;  // why this server was given up on: its parts fail
    // A thread of its own reconnects the link (start_recovery); waiters wait for it to end.
    bool recovering = false;
    std::condition_variable recovery_ended;
    std::thread recoverer;
    // recover()'s last request to a new connection: the worker's clock. Not waited for; the next
    // recovery reuses it once its connection has completed it.
    transport::Request announce;
    transport::Completion announced;
    Link() { announced.reset(0); }
    Sent* head = nullptr;
    Sent* tail = nullptr;
    void append(Sent* p) noexcept {
      p->prev = tail;
      p->next = nullptr;
      (tail ? tail->next : head) = p;
      tail = p;
    }
    void remove(Sent* p) noexcept {
      (p->prev ? p->prev->next : head) = p->next;
      (p->next ? p->next->prev : tail) = p->prev;
      p->prev = p->next = nullptr;
    }
  };
  static constexpr unsigned kIndexBits = 20;
  static constexpr std::chrono::steady_clock::time_point kNever{};
  static constexpr std::chrono::seconds kGoodbyeBudget{2};
  static constexpr std::chrono::milliseconds kGoodbyeFloor{300};  // per link, past the budget

  std::pair<Op*, Ticket> acquire() {
    std::lock_guard lock(ops_mu_);
    std::uint32_t index;
    if (!free_.empty()) {
      index = free_.back();
      free_.pop_back();
    } else {
      if (ops_.size() >= (1u << kIndexBits))
        throw Error(Errc::capacity, "more than 2^20 operations outstanding: wait() for some tickets");
      index = static_cast<std::uint32_t>(ops_.size());
      const std::size_t servers = links_.size();
      auto op = std::make_unique<Op>();
      op->requests.resize(servers);
      op->slices.resize(servers);
      op->targeted.resize(servers);
      op->parts = std::make_unique<Sent[]>(servers);
      for (std::size_t s = 0; s < servers; ++s) {
        op->parts[s].op = op.get();
        op->parts[s].server = s;
      }
      ops_.push_back(std::move(op));
    }
    Op* op = ops_[index].get();
    op->in_use = true;
    // What a pull_rows left for finish(): no other op may copy rows into its caller's buffer.
    op->rows_out = nullptr;
    op->repeats.clear();
    ++op->generation;
    return {op, (Ticket{op->generation} << kIndexBits) | index};
  }

  Op* lookup(Ticket ticket) {
    std::lock_guard lock(ops_mu_);
    const auto index = static_cast<std::uint32_t>(ticket & ((1u << kIndexBits) - 1));
    if (index >= ops_.size() || !ops_[index]->in_use || ops_[index]->generation != (ticket >> kIndexBits))
      throw Error(Errc::invalid_argument, "ticket " + std::to_string(ticket) + " is unknown or was already waited");
    return ops_[index].get();
  }

  void release(Ticket ticket) {
    std::lock_guard lock(ops_mu_);
    const auto index = static_cast<std::uint32_t>(ticket & ((1u << kIndexBits) - 1));
    ops_[index]->in_use = false;
    free_.push_back(index);
  }

  void record_staleness(std::uint64_t clock, std::uint64_t bound) {
    if (options_.worker_id == kNoWorker || bound == ~0ull || bound == kClockDone) return;
    const std::uint64_t s = clock > bound ? clock - bound : 0;
    std::lock_guard lock(stats_mu_);
    ++staleness_.reads;
    staleness_.max = std::max(staleness_.max, s);
    ++staleness_.histogram[std::min<std::uint64_t>(s, StalenessStats::kBuckets - 1)];
  }

  ClientOptions options_;
  PlacementOptions placement_;
  transport::ConnectOptions connect_options_;
  bool retrying_ = false;
  // Every server asked for certificates said it runs without failover: recover() stops asking.
  std::atomic<bool> no_failover_{false};
  float no_values_ = 0;  // where a table push's identity points: no floats, but never null (memcpy)
  // The destructor's goodbye, which recover() waits for no longer than closing_deadline_
  // (written before closing_ is set, by the destroying thread, the only one left).
  std::atomic<bool> closing_{false};
  std::chrono::steady_clock::time_point closing_deadline_{};
  std::atomic<bool> stopping_{false};   // close_links(): recoveries end without installing anything
  std::mutex order_mu_;                 // retry mode: a push's sequence number and its submissions
  std::optional<PushSequence> pushes_;  // retry mode only (it draws a session); under order_mu_
  // Declared before links_ so that it is destroyed after them: a connection's teardown
  // completes its outstanding requests, which live in these ops.
  std::mutex ops_mu_;
  std::vector<std::unique_ptr<Op>> ops_;
  std::vector<std::unique_ptr<Link>> links_;
  ConnectionsPoller poller_;  // points into links_' connections (never retrying): cleared with them
  std::vector<std::uint32_t> free_;
  // Written by clock() (the training loop's thread), read by push/pull on any thread: a request
  // issued concurrently with clock() carries either step, as a racing caller must expect.
  std::atomic<std::uint64_t> clock_{0};
  std::uint64_t barrier_generation_ = 0;
  std::array<std::atomic<std::uint32_t>, kMaxTables> table_dims_{};  // 0: not created by this client
  // Retry mode: the buffers registered so far, registered again on every new connection.
  std::mutex registered_mu_;
  std::vector<std::pair<void*, std::size_t>> registered_;
  bool finished_on_close_ = true;
  const int uncaught_at_start_ = std::uncaught_exceptions();
  mutable std::mutex stats_mu_;
  StalenessStats staleness_;
};

}  // namespace detail

Client::Client(const ClientOptions& options) : impl_(std::make_unique<detail::ClientImpl>(options)) {}
Client::~Client() = default;

Ticket Client::init(std::span<const Key> keys, std::span<const std::span<const float>> values) {
  return impl_->issue(wire::Op::init, keys, values, 0);
}

Ticket Client::push(std::span<const Key> keys, std::span<const std::span<const float>> values) {
  return impl_->issue(wire::Op::push, keys, values, impl_->current_clock());
}

Ticket Client::pull(std::span<const Key> keys, std::span<const std::span<float>> out) {
  return impl_->issue(wire::Op::pull, keys, out, impl_->current_clock());
}

void Client::create_table(std::uint32_t table, const TableSpec& spec) {
  impl_->create_table(table, spec);
}

Ticket Client::pull_rows(std::uint32_t table, std::span<const Key> ids, std::span<float> out) {
  return impl_->rows(wire::Op::table_pull, table, ids, out.data(), out.size());
}

Ticket Client::push_rows(std::uint32_t table, std::span<const Key> ids, std::span<const float> grads) {
  // Only read: the one KeySlice type serves both directions.
  return impl_->rows(wire::Op::table_push, table, ids, const_cast<float*>(grads.data()), grads.size());
}

void Client::disconnect() {
  impl_->disconnect();
}
void Client::wait(Ticket ticket) {
  impl_->wait(ticket);
}
bool Client::wait_for(Ticket ticket, std::chrono::milliseconds timeout) {
  return impl_->wait_for(ticket, timeout);
}
bool Client::done(Ticket ticket) {
  return impl_->done(ticket);
}
void Client::clock() {
  impl_->clock();
}
Ticket Client::clock_async() {
  return impl_->clock_async();
}
Ticket Client::barrier_async() {
  return impl_->barrier_async();
}
std::uint64_t Client::current_clock() const noexcept {
  return impl_->current_clock();
}
void Client::barrier() {
  wait(barrier_async());
}
void Client::register_buffer(void* data, std::size_t bytes) {
  impl_->register_buffer(data, bytes);
}
std::size_t Client::num_servers() const noexcept {
  return impl_->num_servers();
}
StalenessStats Client::staleness() const {
  return impl_->staleness();
}
std::string Client::server_stats(std::size_t server) {
  return impl_->server_stats(server);
}

}  // namespace pskv
