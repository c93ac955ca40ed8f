// Client side of the TCP backend: one pipelined connection to one server. Requests go out with
// one sendmsg of [header | key table | the caller's value buffers]. Replies are read, and pull
// payloads readv()d straight into the caller's buffers, by whichever thread holds the socket's
// read side: normally the thread waiting for the answer, which the socket itself wakes. Handing
// each reply over from a reader thread cost a second wake-up per reply (a 4 KiB round trip took
// 32 us at p50 that way on this VM, 24 us this way). The connection's own reader thread reads
// only answers nobody is waiting for, and for waiters that wait on several connections at once.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <sys/uio.h>

#include "transport/tcp/socket.h"
#include "transport/transport.h"

namespace pskv::tcp {

// Thread-safety: submit() and the Poller calls from any number of threads. Sends are serialised
// by a mutex; reads by the read side, which one thread at a time holds (a waiter, a poller or the
// internal reader thread); waiters that find it taken sleep until the holder completes something.
class TcpConnection final : public transport::Connection, private transport::Poller {
 public:
  TcpConnection(const Uri& uri, const transport::ConnectOptions& options);
  ~TcpConnection() override;

  void submit(transport::Request& request) override;
  const transport::ServerInfo& info() const noexcept override { return info_; }
  const std::string& endpoint() const noexcept override { return endpoint_; }
  transport::Poller* poller() noexcept override { return this; }
  bool broken() noexcept override {
    std::lock_guard lock(in_flight_mu_);
    return broken_ || send_broken_;
  }

 private:
  // Poller: a waiting thread reads the replies itself. poll() blocks only to finish a frame
  // whose header has arrived.
  void poll() noexcept override;
  void end_polling() noexcept override { poll(); }
  // Reads until `c` is done, or `until` has passed (checked between frames and at the socket's
  // one-second receive tick, or at `deadline` when that comes first). If another thread holds
  // the read side, sleeps until it completes something or lets go.
  bool sleep_for_answers(const transport::Completion& c, std::chrono::steady_clock::time_point until,
                         std::chrono::steady_clock::time_point deadline) noexcept override;
  // Sleeps until the read side's holder completes something or lets go; true if the read side
  // turned out free instead (taken: the caller reads).
  bool follow(const transport::Completion& c, std::chrono::steady_clock::time_point until) noexcept;
  void rely_on_transport() noexcept override;

  // What the holder of the read side reads until.
  enum class ReadUntil {
    nothing_waits,  // a poller: only frames whose header has already arrived
    done,           // a waiter: its completion is done (or the time is up)
    idle,           // the reader thread: nothing outstanding, or a waiter wants the read side
    quiet,          // the reader thread, summoned: a receive tick with nothing outstanding, or a waiter wants it
  };
  bool take_read_side() noexcept { return !reading_.exchange(true); }
  void release_read_side() noexcept;
  // ReadUntil::done: returns at the first tick past `until`, or at `deadline` if that is closer
  // than a tick (the waiter's own; the slices it comes in may be shorter).
  void read_frames(ReadUntil until, const transport::Completion* mine, std::chrono::steady_clock::time_point until_at,
                   std::chrono::steady_clock::time_point deadline = {});
  enum class HeaderRead { complete, none, broken };
  // Reads header_ (blocking up to the receive tick, or not at all); resumes a partial one.
  HeaderRead read_header(bool block);
  // After a tick with nothing read: false if the server has been silent too long (all failed).
  bool still_alive();
  void notify_followers() noexcept;
  void wake_reader() noexcept;
  // An entry is registered before its frame is sent (the reply may come before writev returns),
  // and its request stays valid only until it is completed, while the sender still reads its
  // buffers. So while `sending`, a failure of the connection leaves the outcome here and the
  // sender completes it when it is done; a reply waits for the sender (release_in_flight). An
  // entry whose reply is being read is completed by its reader alone.
  struct InFlight {
    transport::Request* request = nullptr;
    std::uint64_t id = 0;
    bool sending = false;
    bool receiving = false;   // a reader is reading its reply and will complete it
    bool asked_copy = false;  // sent again after a torn reply: its answer may not come from the store
    bool deferred = false;
    Errc deferred_status = Errc::ok;
    std::string deferred_why;
  };
  void handshake();
  wire::FrameHeader read_handshake_reply(const char* step);
  // Writes the request's frame (header, key table, values) under send_mu_.
  IoResult send_request(std::uint64_t id, const transport::Request& request, std::uint16_t flags);
  void reader_loop();
  bool receive_one(const wire::FrameHeader& h, std::string* why, Errc* failure);
  void fail_all(Errc status, const std::string& why);
  // Returns the entry's index (UINT32_MAX once broken) and its request id in *id.
  std::uint32_t acquire_in_flight(transport::Request* request, std::uint64_t* id);
  // Frees the entry of an answered request (the caller completes it), once its sender is done.
  void release_in_flight(std::uint32_t index);
  // The sender is done with the entry's buffers: completes the request if its outcome came
  // meanwhile.
  void sent(std::uint32_t index);

  transport::ConnectOptions options_;
  std::string endpoint_;
  transport::ServerInfo info_;
  Fd fd_;

  std::mutex send_mu_;
  std::vector<iovec> iov_;

  std::mutex in_flight_mu_;
  std::condition_variable in_flight_free_;
  std::vector<InFlight> in_flight_;
  std::vector<std::uint32_t> free_;
  std::uint64_t next_generation_ = 1;
  bool broken_ = false;
  bool send_broken_ = false;  // the server closed while we sent; replies may still be read
  std::string broken_why_;

  std::atomic<std::uint32_t> outstanding_{0};    // requests holding an entry; changed under in_flight_mu_
  std::atomic<std::int64_t> quiet_since_ns_{0};  // steady_now_ns: last frame read, or last idle moment

  // The read side. header_, header_fill_ and recv_iov_ belong to its holder.
  std::atomic<bool> reading_{false};
  wire::FrameHeader header_{};
  std::size_t header_fill_ = 0;
  std::string read_error_;
  std::vector<iovec> recv_iov_;
  std::atomic<std::uint32_t> followers_{0};  // waiters sleeping on turn_
  std::atomic<std::uint32_t> turn_{0};       // bumped when a reader completes something or lets go

  std::atomic<bool> stopping_{false};
  std::atomic<std::uint32_t> reader_word_{0};  // the reader thread sleeps on it
  std::atomic<bool> reader_sleeps_long_{false};
  std::atomic<bool> summoned_{false};  // a waiter relies on the reader thread
  std::atomic<bool> reader_on_duty_{false};
  std::thread reader_;
};

}  // namespace pskv::tcp
