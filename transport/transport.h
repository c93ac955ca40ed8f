// The transport interface. A client holds one Connection per server; the client layer splits
// each user operation into one Request per server and tracks them with one Completion.
// Control path (connect, register) and hot path (submit) are separate: connect() and
// register_buffer() may block and allocate; submit() must not allocate in steady state.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "pskv/error.h"
#include "pskv/types.h"
#include "transport/auth.h"
#include "transport/uri.h"
#include "transport/wire.h"

namespace pskv::transport {

// One key's part on one server: `data` is the caller's buffer (source for push/init,
// destination for pull); nothing is copied on the client side.
struct KeySlice {
  Key key;
  std::uint32_t length;
  float* data;
};

class Completion;

// Something a waiter drives while it spins: it completes requests whose answers have already
// landed, on the waiting thread, so a local reply does not wait for a transport thread to be
// woken and scheduled (on two cores that hand-off cost more than a small shm push itself).
// Thread-safety: any number of threads may poll at once.
class Poller {
 public:
  // Cheap when nothing has landed; never blocks.
  virtual void poll() noexcept = 0;
  // Bracket a spell of polling, so the far side may skip waking the transport thread meanwhile.
  // begin_polling() may refuse (false: the machine already has as many spinners as it has
  // cores to spare), and then the waiter sleeps instead. After a true, end_polling() completes
  // whatever landed before it returns: nothing is left unannounced.
  virtual bool begin_polling() noexcept { return true; }
  virtual void end_polling() noexcept {}
  // Sleeps until `c` is done or an answer may have landed (or `until`), then completes what
  // landed. A waiter that cannot spin sleeps here rather than on its completion, so the far side
  // wakes it directly instead of through the transport's thread. Whoever completes a request
  // must wake these sleepers. `until` is a slice of the waiter's own `deadline` (at or after it):
  // a transport that cannot wake at `until` cheaply must still not keep the waiter past
  // `deadline`. False: not supported, nothing done.
  virtual bool sleep_for_answers(const Completion& /*c*/, std::chrono::steady_clock::time_point /*until*/,
                                 std::chrono::steady_clock::time_point /*deadline*/) noexcept {
    return false;
  }
  // The waiter will sleep on its completion without driving this poller (it waits on several
  // connections at once): answers must then be read by the transport's own thread.
  virtual void rely_on_transport() noexcept {}
  // The longest wait worth spinning for, fixed for the connection's life (a client reads it once).
  // A transport whose server has no core to spare lowers it: a spinner then takes the core the
  // answer is being computed on.
  virtual int max_spin_micros() const noexcept;

 protected:
  ~Poller() = default;
};

// Completion of one user operation that may span several servers.
// Thread-safety: complete_part() from any transport thread; wait()/status() from the owner.
class Completion {
 public:
  void reset(std::uint32_t parts) noexcept;
  // The first failure wins; its message is kept.
  void complete_part(Errc status, std::string_view message = {}) noexcept;
  // Records the read bound a server reported (the minimum over parts is kept).
  void note_bound(std::uint64_t bound) noexcept;
  // Done only once the last part's completer has published through wake_: that exchange is its
  // final access, so the owner may free this object as soon as done() is true.
  bool done() const noexcept { return wake_.load(std::memory_order_acquire) == 1; }
  // Spins briefly (a local reply often lands within microseconds), driving `poller` if given,
  // then sleeps on a futex. Returns false if the deadline passed first.
  bool wait(std::chrono::steady_clock::time_point deadline, Poller* poller = nullptr) noexcept;
  Errc status() const noexcept { return status_; }
  const std::string& message() const noexcept { return message_; }
  std::uint64_t bound() const noexcept { return bound_.load(std::memory_order_relaxed); }
  static constexpr int kMaxSpinMicros = 100;
  // A waiter whose server's threads hold every core spins only while its waits are this short:
  // about what a futex sleep and wake-up cost. Longer answers (a batch of 1,000 table rows takes
  // ~100 us) are worked out on the core a spinner would take: two shm server threads served
  // 13 M rows/s to two spinning clients on 2 cores and 17-23 M to sleeping ones.
  static constexpr int kContendedSpinMicros = 25;
  // How long a waiter spins before it sleeps, given the moving average of its recent waits
  // (negative: none yet) and its poller's max_spin_micros(): up to twice that average, and not at
  // all (0) while the average is longer than the limit (then one wait in 16 still spins 5 us, to
  // find out whether the answers became short).
  static double spin_budget_micros(double typical_wait_us, int max_spin_us) noexcept;

 private:
  std::atomic<std::uint32_t> remaining_{0};
  std::atomic<std::uint32_t> wake_{0};
  std::atomic<std::uint64_t> bound_{~0ull};
  std::mutex mu_;
  Errc status_ = Errc::ok;
  std::string message_;
};

struct Request {
  wire::Op op = wire::Op::pull;
  std::uint64_t arg0 = 0;
  std::uint32_t arg1 = 0;
  std::span<const KeySlice> keys;
  Completion* completion = nullptr;
  std::string* text_out = nullptr;  // stats: receives the server's JSON
};

struct ConnectOptions {
  std::uint32_t worker_id = kNoWorker;
  std::chrono::milliseconds connect_timeout{10000};
  // rdma: a port nobody listens on is asked again until connect_timeout (the server may still be
  // starting). false fails at once, as tcp's refused connection does: a caller that looks for a
  // dead server's replacement elsewhere must not spend its timeout on the dead one.
  bool wait_for_listener = true;
  // No byte from a server for this long while requests are outstanding means it is gone.
  std::chrono::milliseconds io_timeout{30000};
  std::uint32_t max_in_flight = 128;
  bool checksum = false;
  wire::Limits limits{};
  // tcp/rdma: prove this token to the server and require the server to prove it back.
  std::shared_ptr<const auth::Token> token;
  // tcp/rdma: once true, a connect under way (its handshake included) gives up within about
  // 50 ms (Errc::peer_failure), rather than waiting out its timeouts on a peer that does not
  // answer: a replicator stopping its keepers. Must outlive the connect.
  const std::atomic<bool>* cancel = nullptr;
  bool cancelled() const noexcept { return cancel && cancel->load(std::memory_order_acquire); }
};

// What the server said about itself at connect time.
struct ServerInfo {
  std::uint32_t server_id = 0;
  std::uint32_t num_workers = 0;
  std::uint32_t incarnation = 0;  // the server's start, in seconds (0 where not told: shm)
};

// Thread-safety: submit() and register_buffer() may be called from any number of threads.
class Connection {
 public:
  virtual ~Connection() = default;
  // Hands the request to the server. Blocks only while the in-flight window is full. The request
  // and its slices must stay valid until the completion part is reported.
  virtual void submit(Request& request) = 0;
  // Announces a buffer that later requests will use (RDMA registers it); others ignore it.
  virtual void register_buffer(void* data, std::size_t bytes) { (void)data, (void)bytes; }
  virtual const ServerInfo& info() const noexcept = 0;
  virtual const std::string& endpoint() const noexcept = 0;
  // Backends whose answers a waiting thread can pick up itself return their Poller; the others
  // complete requests on their own threads.
  virtual Poller* poller() noexcept { return nullptr; }
  // True once the connection has failed (the server died, closed or went silent): its requests
  // fail and new ones fail at once. A request that failed on a connection not broken was refused
  // by the server. Backends that cannot tell say false.
  virtual bool broken() noexcept { return false; }
};

// Connects by scheme. Throws Error with what to do when the server cannot be reached.
std::unique_ptr<Connection> connect(const Uri& uri, const ConnectOptions& options);

}  // namespace pskv::transport
