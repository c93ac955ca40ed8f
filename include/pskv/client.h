// The worker-side API: asynchronous push and pull by key against one or more servers.
//
//   pskv::ClientOptions o;
//   o.servers = {"tcp://10.0.0.1:9000", "tcp://10.0.0.2:9000"};
//   o.worker_id = rank;                     // needed for clock()/barrier() and bounded reads
//   pskv::Client client(o);
//   client.wait(client.init(keys, initial));
//   for (;;) {
//     client.wait(client.pull(keys, weights));   // waits for the consistency bound
//     ... compute gradients ...
//     client.push(keys, grads);                  // ticket may be waited later
//     client.clock();                             // ends the step
//   }
//
// Nothing is copied on the client: pushes are sent from, and pulls land in, the caller's buffers,
// which must stay valid until the ticket is waited.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "pskv/error.h"
#include "pskv/table.h"
#include "pskv/types.h"

namespace pskv {

struct ClientOptions {
  std::vector<std::string> servers;       // one URI per server: tcp://, shm://, rdma://
  std::uint32_t worker_id = kNoWorker;    // this worker's rank among the server's --workers
  Partition partition = Partition::hash;  // where a key lives
  std::uint64_t range_keys = 0;           // range partition: keys [0, range_keys) split evenly
  // Values longer than this are split into one contiguous chunk per server (BytePS-style), so no
  // single server carries a whole large layer. 0 disables splitting.
  std::uint64_t chunk_floats = 1u << 18;
  std::chrono::milliseconds connect_timeout{10000};
  std::chrono::milliseconds io_timeout{30000};
  std::uint32_t max_in_flight = 128;  // outstanding requests per server connection
  bool checksum = false;              // CRC-32 over every request and reply
  // A worker that reconnects mid-job (e.g. after a server restarted from a checkpoint) passes
  // its clock here; it is announced to every server at connect, so bounded reads of the other
  // workers do not wait for clocks this worker already passed.
  std::uint64_t initial_clock = 0;
  // tcp/rdma: a file holding the servers' shared secret (mode 0600). With it, the client proves
  // the token to every server and refuses a server that cannot prove it back. Unused by shm://,
  // whose segments are protected by their file mode.
  std::string auth_token_file;
  // tcp and rdma, servers run with --replicas: when a server's connection fails (it died, or went silent
  // past io_timeout), keep reconnecting to it for up to this long and send its unanswered
  // requests again, in order, instead of failing them: a server restarted with --rejoin takes
  // its keys back from its replicas, and the marks those keys (and tables) carry let it apply
  // each push and push_rows sent again exactly once (a push_rows' rows and optimizer state on a
  // replicated tcp:// server must then fit half of --max-request-mb, and its identity takes one
  // key of each server's request). Nothing fails meanwhile: a wait() or wait_for() that finds the connection
  // failed hands it to a thread that reconnects it, and goes on waiting (wait_for until its own
  // timeout); done() hands it over likewise, and stays false until the request, sent again, is answered. No lock is
  // held while a server is away, so other threads issue and wait (on that server too) meanwhile. Needs worker_id (a
  // retried push is recognised by its worker) and tcp:// or rdma:// servers; pushes must carry clocks below
  // 2^32. A wait sends a part of its request lost with its server again within 50 ms, whatever
  // the request's other parts wait for. The constructor, too, keeps trying a server it cannot
  // reach (or, with --failover-ms, wherever its keys are served now) for up to this long. A
  // request lost again and again to silence on connections the server accepts (it parks the
  // request past io_timeout) fails once this long has passed since the first such loss; losses
  // to restarts do not count. The destructor's goodbye reconnects too (to a restarted server,
  // or wherever a failover moved its keys), for about 2 s (2.3 s at most; servers are reconnected at once), so that
  // the other workers' bounded reads there stop waiting for this one. 0: a failed server fails
  // its requests.
  std::chrono::milliseconds retry_timeout{0};
};

// Staleness seen by reads: how many clocks the slowest worker was behind this worker's clock.
struct StalenessStats {
  static constexpr std::size_t kBuckets = 17;  // 0..15, and 16 or more
  std::uint64_t reads = 0;
  std::uint64_t max = 0;
  std::array<std::uint64_t, kBuckets> histogram{};
};

namespace detail {
class ClientImpl;
}

// Thread-safety: init/push/pull/wait may be called concurrently from several threads;
// clock() and barrier() belong to the worker's training loop (one thread).
class Client {
 public:
  // Connects to every server; throws Error naming the server that could not be reached.
  explicit Client(const ClientOptions& options);
  // Tells the servers this worker is finished (so it holds nobody back) and disconnects,
  // unless disconnect() was called first or an exception is destroying it: a worker that fails
  // did not finish, and under --straggler-policy fail the reads that wait for it get an error.
  ~Client();
  // Disconnects without announcing that this worker finished: for a worker that will come back
  // (reconnect after a server restart). Outstanding tickets fail; the object is unusable after.
  void disconnect();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // keys[i] goes with values[i]. The spans' lengths fix each key's length at init.
  Ticket init(std::span<const Key> keys, std::span<const std::span<const float>> values);
  Ticket push(std::span<const Key> keys, std::span<const std::span<const float>> values);
  Ticket pull(std::span<const Key> keys, std::span<const std::span<float>> out);
  Ticket init(Key key, std::span<const float> value) { return init({&key, 1}, {&value, 1}); }
  Ticket push(Key key, std::span<const float> value) { return push({&key, 1}, {&value, 1}); }
  Ticket pull(Key key, std::span<float> out) { return pull({&key, 1}, {&out, 1}); }

  // Embedding tables (pskv/table.h): rows keyed by ids nobody enumerates in advance, each kept by
  // the server its id hashes to. create_table declares table `table` (an id below 64) on every
  // server; every worker calls it with the same spec (the first wins, another spec is an error),
  // which also tells this client the table's dimension. tcp:// and shm:// servers without
  // --replicas, for now.
  void create_table(std::uint32_t table, const TableSpec& spec);
  // The rows of `ids` into `out` (ids.size() * dim floats, row i at out[i * dim]); an id without
  // a row reads as the table's initial value for it. An id repeated in the batch is fetched once.
  Ticket pull_rows(std::uint32_t table, std::span<const Key> ids, std::span<float> out);
  // Gradients of `ids` (ids.size() * dim floats), applied by the table's rule; rows are created
  // as the table admits ids. The gradients of an id repeated in the batch are summed and sent
  // once; otherwise they are sent from `grads` without a copy (valid until the ticket is waited).
  Ticket push_rows(std::uint32_t table, std::span<const Key> ids, std::span<const float> grads);

  // Blocks until the operation completes; throws Error with the server's explanation on failure.
  void wait(Ticket ticket);
  // Waits at most `timeout`. True: the operation completed and the ticket is spent, exactly as
  // after wait() (which it then throws like). False: still in flight, the ticket stays valid and
  // must be waited again. Lets a caller that must stay responsive (Python's Ctrl-C) wait in slices.
  bool wait_for(Ticket ticket, std::chrono::milliseconds timeout);
  // True when the operation has completed (wait() then returns or throws at once). Not const: it
  // also polls the connections, so an answer that has landed is noticed without a wait().
  bool done(Ticket ticket);

  // Ends this worker's step: the pushes issued before it are applied on every server before
  // the new clock is visible to anyone. Synchronous: wait(clock_async()).
  void clock();
  // clock() as a ticket, for a caller that must stay responsive while it completes. The new
  // clock applies to operations issued after this call (servers see the clock first, since it
  // precedes them on every connection); a ticket that fails leaves the servers' clocks unknown.
  Ticket clock_async();
  std::uint64_t current_clock() const noexcept;
  // Waits until every live worker reached this barrier: wait(barrier_async()).
  void barrier();
  Ticket barrier_async();
  // Announces memory later used as push sources or pull destinations (RDMA registers it once).
  void register_buffer(void* data, std::size_t bytes);

  std::size_t num_servers() const noexcept;
  StalenessStats staleness() const;
  // The server's own counters as a JSON object.
  std::string server_stats(std::size_t server);

 private:
  std::unique_ptr<detail::ClientImpl> impl_;
};

}  // namespace pskv
