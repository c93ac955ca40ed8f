// Replication of a server's keys to the next servers on the ring (--replicas R --peers ...): the
// origin side, which ships the state of every key it applies, and the rejoin of a restarted
// server, which takes its keys back from a replica before it serves. docs/ARCHITECTURE.md,
// "Replication", says why state is shipped rather than operations, and what is not done yet.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "engine/shard_engine.h"
#include "transport/transport.h"

namespace pskv {

struct ReplicaPeer {
  std::uint32_t id = 0;
  std::string uri;
};

struct ReplicatorOptions {
  std::uint32_t server_id = 0;
  std::vector<ReplicaPeer> replicas;         // the servers that keep this one's keys, in ring order
  std::shared_ptr<const auth::Token> token;  // what this server proves to its peers
  // A replica silent this long with shipments outstanding is dropped (and reconnected).
  std::chrono::milliseconds io_timeout{5000};
  std::uint64_t max_request_bytes = 256ull << 20;
  // Records shipped and not yet answered, over all clients: a push that would pass it is refused
  // (capacity) before it is applied.
  std::uint64_t max_in_flight_bytes = 512ull << 20;
  // Where this server's table stream starts (the furthest a replica had seen, after a rejoin), so
  // that its replicas see every new frame as later than what they hold.
  std::uint32_t table_position = 0;
  // Failover (src/server/failover.h): asked before a replica that was reached is dropped. False:
  // this server may not drop it (it could not have it certified down, so it is deposed), and
  // nothing that waits for that replica is acknowledged, from then on.
  std::function<bool(std::uint32_t replica, std::uint32_t incarnation, const std::string& why)> may_drop;
  // A takeover's engine: a replica not reached yet is waited for until it is reached, or until
  // this says it was certified down, not given up after io_timeout as at a start (when the
  // servers of a job come up one by one): the taken-over keys' other copy was just lost, so
  // acknowledging without the replica would leave one. After 10 io timeouts it is given up all
  // the same (logged as an error): nobody may ever certify a replica cut off from this server
  // alone, and the keys would stall for good.
  std::function<bool(std::uint32_t replica)> certified_down;
};

// Ships the state of each key an init or push applied here (its record: update count, value,
// optimizer state, read under the stripe lock) to every live replica, and resumes the request's
// reply once they all hold it. Replicas keep the latest record of each key (Store::put_if_newer),
// so records may cross and repeat and every replica still ends with this server's very bytes.
//
// A replica is live from the moment it (re)connects: a keeper thread per replica connects, marks
// the replica syncing, sends every key (a full transfer, concurrent with the shipments), and
// marks it synced. A replica whose connection fails is dropped (the acknowledgements go on
// without it: a dead replica no longer counts) and its keeper reconnects. One not yet reached
// since this server started is waited for (up to the io timeout, or until it is certified down
// with ReplicatorOptions::certified_down): servers of a job start one by one, and acknowledging
// before the replica has the keys would promise what it cannot keep.
//
// Embedding tables' rows are not versioned: they reach each replica in the order they were read
// (ship_table, ship_rows and the full transfer's tables all read and queue under table_order_mu_),
// and the replica applies them as they come (docs/ARCHITECTURE.md, "Embedding tables").
//
// Thread-safety: ship*() and stats() from any thread; start() and stop() once each, from the
// server's thread that builds and stops it.
class TcpReplicator final : public Replicator {
 public:
  TcpReplicator(ShardEngine& engine, const ReplicatorOptions& options);
  ~TcpReplicator() override;
  TcpReplicator(const TcpReplicator&) = delete;
  TcpReplicator& operator=(const TcpReplicator&) = delete;

  Errc reserve(std::span<const KeyEntry> keys, bool creating, std::string* why) override;
  void release(std::span<const KeyEntry> keys) override;
  void ship(std::span<const KeyEntry> keys, std::unique_ptr<Parked> reply) override;
  void ship_clock(std::uint32_t worker, std::uint64_t clock, std::unique_ptr<Parked> reply) override;
  void ship_barrier(std::uint32_t worker, std::uint64_t generation, std::unique_ptr<Parked> reply) override;
  void ship_eviction(std::uint32_t worker) override;
  Errc reserve_bytes(std::uint64_t bytes, std::string* why) override;
  void release_bytes(std::uint64_t bytes) override;
  Errc create_table(std::uint32_t id, const TableSpec& spec, std::string* why,
                    const std::function<std::unique_ptr<Parked>()>& park, bool* parked) override;
  void ship_rows(std::uint32_t table, std::span<const KeyEntry> ids, std::uint64_t reserved,
                 std::unique_ptr<Parked> reply) override;
  Errc push_rows_in_order(std::uint32_t table, std::uint32_t worker, std::span<const KeyEntry> ids,
                          std::uint64_t reserved, const std::function<Errc()>& apply,
                          const std::function<std::unique_ptr<Parked>()>& park, std::string* why,
                          bool* parked) override;
  JsonObject stats() const override;
  // Starts reaching the replicas. Call once this server's listener accepts connections: a
  // replica that syncs watches its origin from then on, and over rdma the port refuses
  // connections until the listener has registered its memory; a refused origin is taken over.
  // Until then what is shipped waits, as for a replica not yet reached.
  void start();
  // This server was certified down (failover): from now on nothing is acknowledged; every reply
  // that waits for the replicas, or would, is resumed with peer_failure.
  void depose() noexcept;

  // The position of the last table frame queued (in this server's table stream).
  std::uint32_t table_position();

  // Waits (up to the io timeout) for the acknowledgements of what was shipped, resumes every
  // waiting reply, and stops the threads. Call after the listener drained, before it closes.
  void stop() noexcept;

 private:
  // pending: not reached since this server started; what is shipped meanwhile waits until it is
  // synced (its full transfer carries those keys), or until it has stayed unreachable past the
  // io timeout and is declared down.
  enum class State : int { down = 0, syncing = 1, synced = 2, pending = 3 };
  struct Replica;
  // What one replica is sent of a shipment (or a full transfer's batch): its requests and their
  // completion.
  struct Leg {
    Replica* replica = nullptr;
    std::shared_ptr<transport::Connection> conn;  // null: wait for the pending replica's sync
    std::vector<transport::Request> requests;
    transport::Completion done;
    // Set by the sender once send() has returned. The last request can be completed (answered,
    // or failed with the connection) before its submit() returns, and send() still reads the leg
    // after that, so the acker frees a leg only once its sender is done with it, not merely once
    // it is complete.
    std::atomic<bool> sent{false};
    std::uint64_t wire_bytes = 0;  // its frames' bytes, counted in Replica::unanswered_bytes
  };
  struct Replica {
    ReplicaPeer peer;
    mutable std::mutex mu;
    std::shared_ptr<transport::Connection> conn;  // null while down
    std::atomic<int> state{static_cast<int>(State::pending)};
    std::atomic<std::uint64_t> shipped_bytes{0}, transfers{0}, failures{0};
    std::thread keeper;
    // Legs an I/O thread prepared, submitted in order by this replica's sender thread: a submit
    // blocks while the connection's window or socket is full, which must stall only this replica,
    // never an I/O thread (and with it every client on that thread).
    std::mutex out_mu;
    std::condition_variable out_cv;
    std::deque<Leg*> outbox;
    std::thread sender;
    // Bytes of legs queued or sent and not yet seen answered.
    std::atomic<std::uint64_t> unanswered_bytes{0};
    // I/O threads about to submit a small leg themselves instead of waking the sender: one
    // hand-off less for the small pushes whose latency is all hand-offs. Only when nothing is
    // unanswered (an empty socket takes a frame of up to kInlineBytes at once, whatever the
    // peer does), and never behind another frame: the sender and the keeper, having counted
    // their bytes, wait for these to go out before they write (let_inline_sends_go_first).
    std::atomic<std::uint32_t> inline_sends{0};
  };
  // One request's records (or one worker's clock), in flight to every live replica.
  struct Shipment {
    // What each leg's requests are: `replicate` (arg0 = this server), `replica_clock`,
    // `replica_barrier` or `replica_evict`.
    wire::Op op = wire::Op::replicate;
    std::uint64_t arg0 = 0, arg1 = 0;
    std::vector<KeyEntry> keys;  // record lengths
    // Reused from shipment to shipment (see pool_): a fresh megabyte costs its page faults and,
    // in a vector, a pass of zeroes, each as much as the copy itself.
    std::unique_ptr<float[]> records;
    std::uint64_t record_floats = 0, capacity = 0;
    std::vector<transport::KeySlice> slices;
    std::deque<Leg> legs;
    std::unique_ptr<Parked> reply;
    std::uint64_t reserved = 0;  // bytes of reserve() this shipment gives back when answered
  };
  // Snapshots `keys` (value lengths) of the own store into s->records and s->slices, cut into
  // requests under the size limit; returns the requests' key ranges.
  std::vector<std::pair<std::size_t, std::size_t>> snapshot(std::span<const KeyEntry> keys, Shipment* s);
  // Fills in `leg`'s requests (one per range of s.slices; one without keys when `ranges` is
  // empty) and resets its completion; send() submits them.
  void prepare(Shipment& s, Leg& leg, const std::vector<std::pair<std::size_t, std::size_t>>& ranges);
  // Hands a prepared shipment to every live replica (its records to `ranges`' requests) and
  // queues it for the acker.
  // A clock or barrier generation `worker` entered here (op replica_clock or replica_barrier).
  void ship_worker_word(wire::Op op, std::uint32_t worker, std::uint64_t value, std::unique_ptr<Parked> reply);
  // Every worker's clock or generation, as a full transfer sends them.
  bool send_worker_words(Replica& r, const std::shared_ptr<transport::Connection>& conn, wire::Op op,
                         const std::vector<std::uint64_t>& values);
  void dispatch(std::unique_ptr<Shipment> s, const std::vector<std::pair<std::size_t, std::size_t>>& ranges);
  static void send(Leg& leg) noexcept;
  // The keeper's own legs (a full transfer): sent from its thread, counted while unanswered.
  static void send_and_wait(Replica& r, Leg& leg);
  static void let_inline_sends_go_first(Replica& r);
  void sender(Replica& r);
  // Marks `r` down, unless `conn` (when given) is no longer its connection.
  void drop(Replica& r, const transport::Connection* conn, const std::string& why);
  void keeper(Replica& r);
  // The keeper's own leg to `r` over `conn`, sent from its thread and waited for; false, with `r`
  // dropped, if it failed.
  bool keeper_send(Replica& r, const std::shared_ptr<transport::Connection>& conn, Leg& leg);
  // `requests` requests without keys, each completing leg.done; the caller sets their op and args.
  static void headers_only(Leg& leg, std::size_t requests);
  // Asks the replica for its stats over its connection: false (and dropped) if it is gone.
  bool still_there(Replica& r);
  bool full_transfer(Replica& r, const std::shared_ptr<transport::Connection>& conn);
  // Tables travel in one order per replica (the order their rows were read in, under
  // table_order_mu_), so the replica needs no versions: it applies them as they come. These fill
  // `s` with a table's spec and push marks, or with the removals and rows of `ids` read now (and,
  // for an identified push, its worker's mark: `marked`); under table_order_mu_.
  void table_spec_shipment(std::uint32_t table, Shipment* s);
  void rows_shipment(std::uint32_t table, std::span<const Key> removed, std::span<const KeyEntry> ids, Shipment* s,
                     std::vector<std::pair<std::size_t, std::size_t>>* ranges,
                     const ShardEngine::RowsMark* marked = nullptr);
  // Ships the rows `table` lost since the last shipment; under table_order_mu_.
  void ship_removals(std::uint32_t table);
  // Queues a table shipment behind every other, at the next position of the table stream; under
  // table_order_mu_.
  void dispatch_in_order(std::unique_ptr<Shipment> s, const std::vector<std::pair<std::size_t, std::size_t>>& ranges);
  // Hands `s` to the acker, which answers its reply once everything queued before it is.
  void queue_for_acker(std::unique_ptr<Shipment> s);
  // After a push to `table` (under table_order_mu_): queues the removals since the last
  // shipment, and returns the shipment of `ids`' rows as they are now (with `marked`'s mark),
  // holding `reserved`; *gone, if set, removes the ids pushed but no longer held, and must be
  // queued before it. Throws (bad_alloc) with nothing held.
  std::unique_ptr<Shipment> read_pushed_rows(std::uint32_t table, std::span<const KeyEntry> ids, std::uint64_t reserved,
                                             const ShardEngine::RowsMark* marked, std::unique_ptr<Shipment>* gone,
                                             std::vector<std::pair<std::size_t, std::size_t>>* ranges,
                                             std::vector<std::pair<std::size_t, std::size_t>>* gone_ranges);
  // The keeper's table transfer: each table's copy restarted, then its rows, every leg queued
  // behind the shipments before it (not sent by the keeper itself, which could overtake them).
  bool transfer_tables(Replica& r, const std::shared_ptr<transport::Connection>& conn);
  bool send_in_order(Replica& r, const std::shared_ptr<transport::Connection>& conn, Shipment& s,
                     const std::vector<std::pair<std::size_t, std::size_t>>& ranges);
  void acker();
  // Resumes a reply whose records every live replica holds: ok, unless this server was deposed.
  void answer_held(Parked& reply) const;

  ShardEngine& engine_;
  ReplicatorOptions options_;
  std::vector<std::unique_ptr<Replica>> replicas_;
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::unique_ptr<Shipment>> queue_;  // in shipping order
  std::mutex pool_mu_;
  std::vector<std::unique_ptr<Shipment>> pool_;  // shipments done with, their buffers kept
  std::unique_ptr<Shipment> take_shipment();
  void give_back(std::unique_ptr<Shipment> s);
  std::atomic<bool> stopping_{false};
  std::atomic<bool> senders_stop_{false};  // after the acker has answered everything
  std::atomic<bool> deposed_{false};       // may_drop refused: nothing is acknowledged any more
  std::atomic<std::uint64_t> reserved_bytes_{0};
  std::uint64_t record_bytes(std::span<const KeyEntry> keys) const noexcept;
  std::mutex table_order_mu_;     // reading tables' rows and queueing them, in one order
  std::uint32_t table_position_;  // under table_order_mu_: the last table frame's position
  std::vector<Key> removed_;      // under table_order_mu_: scratch
  std::vector<Key> missing_;      // under table_order_mu_: the ids rows_shipment found no row for
  bool stopped_ = false;
  std::thread acker_;
};

// A restarted server (--rejoin) takes its keys back from its replicas before it serves anyone:
// from every reachable one that holds all of them (synced), keeping each key's newest record.
// Throws Error naming the replicas tried when none does.
struct RejoinReport {
  std::vector<std::uint32_t> from;
  std::uint64_t keys = 0, bytes = 0;
  double milliseconds = 0;
  // Tables come from the one replica furthest along the table stream (every replica applies the
  // same stream in order; one dropped for a timeout stopped early).
  std::uint32_t tables = 0, table_rows = 0, table_position = 0;
  std::uint32_t tables_from = UINT32_MAX;
};
RejoinReport rejoin_from_replicas(ShardEngine& engine, const ReplicatorOptions& options,
                                  std::chrono::milliseconds patience);

}  // namespace pskv
