// Client side of the shared-memory backend. Pulls copy straight from the server's arena into
// the caller's buffer under the seqlock (the one unavoidable copy, no round trip). Pushes are
// applied by the calling thread itself under the stripe lock, the old value saved in this
// client's own area first so that the server can roll the push back if we die mid-way (when the
// server allows it, outside sync mode, and once this client's earlier ring requests are
// answered). Other pushes and control requests are copied once into this client's own area and
// published on its ring. A waiting thread picks up the server's answers itself, while it spins
// or after the server woke it from the area's waiter_word (Poller); otherwise a helper thread
// turns them into completions. The helper also runs pulls that had to wait for the consistency
// bound or for this client's earlier pushes, and notices a dead server.
#pragma once

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "layout/clock_table.h"
#include "store/store.h"
#include "transport/shm/segment.h"
#include "transport/transport.h"

namespace pskv::shm {

// Trust: the segment's geometry and the job's settings (mode, staleness, wait timeout, server
// threads) are read once at connect, checked, and kept here; every wait is bounded by the
// server's wait timeout as read then, clamped to this client's own io_timeout, whatever the
// segment says later. Store offsets and lengths are checked against the Store's private copy of
// its geometry. What another process can still do by writing the segment: change values, clocks
// and this client's own area, which the client reads as the server's word.
//
// Thread-safety: submit() and the Poller calls from any number of threads; one internal helper
// thread.
class ShmConnection final : public transport::Connection, private transport::Poller {
 public:
  ShmConnection(const Uri& uri, const transport::ConnectOptions& options);
  ~ShmConnection() override;

  void submit(transport::Request& request) override;
  const transport::ServerInfo& info() const noexcept override { return info_; }
  const std::string& endpoint() const noexcept override { return endpoint_; }
  transport::Poller* poller() noexcept override { return this; }

 private:
  struct ParkedPull {
    transport::Request* request;
    std::uint64_t after_seq;  // this client's pushes up to here must be applied first
    std::uint64_t clock;
    std::chrono::steady_clock::time_point deadline;
    std::chrono::steady_clock::time_point give_up;  // parked + io_timeout: no wait outlives it
  };
  void enqueue(transport::Request& request);
  // Applies a push on this thread; false if it must go through the ring instead.
  bool push_directly(transport::Request& request);
  // Finds and checks every key of the request; returns the error text on failure.
  Errc lookup(const transport::Request& request, std::vector<SlotRef>& slots, std::string* why) const;
  // Who holds a stripe lock, for error messages.
  std::string describe_owner(std::uint32_t owner) const;
  std::string server_gone() const;
  bool bound_allows(std::uint64_t clock, std::uint64_t* observed) const;
  // Copies the values; returns the error text on failure (empty on success).
  Errc read_values(const transport::Request& request, std::string* why) const;
  // The server published answers not yet turned into completions (read without mu_).
  bool answers_waiting() const noexcept;
  void poll() noexcept override;
  bool begin_polling() noexcept override;
  void end_polling() noexcept override;
  bool sleep_for_answers(const transport::Completion& c, std::chrono::steady_clock::time_point until,
                         std::chrono::steady_clock::time_point deadline) noexcept override;
  int max_spin_micros() const noexcept override { return max_spin_micros_; }
  // Turns answered ring entries into completions and frees their ring space; with mu_ held.
  bool complete_answered();
  // With mu_ held, on a waiting thread: complete_answered(), then the pulls parked behind those
  // answers, then wake the threads asleep on waiter_word (they may own any of them).
  void settle();
  void helper_loop();
  bool run_parked(std::chrono::steady_clock::time_point now);
  // Under mu_: whether requests in the ring wait for the server (`done`: its word), barriers aside.
  bool server_owes_answer_locked(std::uint64_t done) const;
  void fail_everything(Errc status, const std::string& why);
  // After completing anything: the threads asleep in sleep_for_answers may own those requests.
  void wake_sleeping_waiters() noexcept;

  transport::ConnectOptions options_;
  std::string endpoint_;
  transport::ServerInfo info_;
  std::unique_ptr<Segment> segment_;
  std::unique_ptr<Store> store_;
  std::unique_ptr<ClockTable> clocks_;
  SegmentHeader* header_ = nullptr;
  ClientArea* area_ = nullptr;
  std::uint32_t area_index_ = 0;
  std::byte* data_ = nullptr;
  std::uint64_t data_capacity_ = 0;
  std::uint32_t max_spinners_ = 1;                               // spinning client threads this machine can afford
  int max_spin_micros_ = transport::Completion::kMaxSpinMicros;  // set by the constructor, then read only
  std::uint32_t server_threads_ = 1;
  std::chrono::milliseconds wait_timeout_{0};  // the server's, clamped to [1 ms, io_timeout]
  std::uint32_t quorum_ = 0;
  std::uint64_t staleness_ = 0;
  bool bounded_ = false;
  bool worker_push_ = false;
  std::atomic<std::int64_t> last_alive_check_ns_{0};  // CLOCK_MONOTONIC_COARSE, by push_directly

  std::mutex mu_;  // guards everything below
  std::condition_variable space_;
  std::uint64_t next_seq_ = 0;  // last published seq
  // Last seq turned into a completion; its ring entry and data may be reused. Written under
  // mu_, read without it by poll() to skip the lock when nothing new was answered.
  std::atomic<std::uint64_t> completed_{0};
  // When the ring last went from owing nothing to owing a request (steady_now_ns).
  std::atomic<std::int64_t> ring_busy_since_ns_{0};
  std::uint64_t data_head_ = 0;  // monotonically increasing byte positions in the area
  std::uint64_t data_tail_ = 0;
  transport::Request* pending_[kRingEntries] = {};
  std::uint64_t data_end_[kRingEntries] = {};
  std::uint64_t data_offset_[kRingEntries] = {};  // where each entry's data lies in the area (its own record)
  std::deque<ParkedPull> parked_;
  // A thread is applying a push itself: the data area's front holds its undo copy, so the ring
  // takes no new request until it is done.
  bool direct_active_ = false;
  bool broken_ = false;
  std::string broken_why_;
  bool stopping_ = false;
  std::thread helper_;
};

}  // namespace pskv::shm
