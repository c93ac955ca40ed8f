// Server side of the shared-memory backend: threads that apply each client's ring in order,
// sleeping on a futex doorbell when every ring is empty, and a watchdog that notices clients
// that died, rolls back a push one left half-applied, releases its stripe lock and frees its area.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/shard_engine.h"
#include "transport/shm/segment.h"

namespace pskv::shm {

class SyncStateFile;
struct ShmServerOptions {
  std::uint32_t threads = 1;
  JsonObject extra_stats;         // fields of the listener's own (what it adopted), for stats requests
  SyncStateFile* sync = nullptr;  // sync mode with adopt=1: each thread's SyncApplyMark is there
};

// Trust: every client, and any other process of the job's user, can write the whole segment.
// The server takes the segment's geometry (client count, offsets, stride, data size) from its own
// configuration, the store's from the Store's private copy, and each key's offset and length from
// the Store's private records; ring entries, undo records and area words are read once and
// checked against those before use. A client that scribbles over its own area gets errors (and
// log lines), and when its ring no longer makes sense it is ignored until its area is freed.
//
// Thread-safety: construct, stop and destroy from one thread (the listener's). Server threads
// own disjoint sets of areas (i % threads); the watchdog thread frees areas of dead clients.
class ShmServer {
 public:
  // Serves `engine`, whose store lives in `segment` (laid out by the caller); both outlive this.
  // Clients are let in from here on.
  ShmServer(Segment& segment, ShardEngine& engine, const ShmServerOptions& options);
  ~ShmServer();
  ShmServer(const ShmServer&) = delete;
  ShmServer& operator=(const ShmServer&) = delete;

  // New clients are refused an area.
  void stop_accepting() noexcept;
  // No client applies a push itself any more, none is in the middle of one (those that are get
  // a bounded time to finish), and the server threads have stopped: nothing changes the store
  // after this but the engine's own shutdown and the watchdog's roll-backs of dead clients.
  void drain() noexcept;
  // The watchdog stops, every client is woken to find the server gone, and the name is removed.
  void close() noexcept;
  // Keys clients applied themselves, and the fields saying so (and how many were rolled back).
  std::uint64_t worker_pushes() const noexcept;
  JsonObject stats_fields() const;

 private:
  friend class AreaParked;
  void serve(std::uint32_t thread);
  // Answers ring entries of area `i` until it is empty or blocked on a parked request.
  bool drain(std::uint32_t i);
  // Returns false when the request was parked (answered later by resume()).
  bool process(std::uint32_t i, RingEntry& e, std::uint64_t seq);
  void answer(std::uint32_t i, RingEntry& e, Errc status, const std::string& text);
  void publish(std::uint32_t i, std::uint64_t seq);
  void wake_thread(std::uint32_t i);
  void wake_clock_waiters();
  // A dead client's push rolled back and its stripe locks released (its area stays taken).
  void release_dead_owner(std::uint32_t area, pid_t pid);
  void watchdog();
  // "client area I (pid P)", for log lines.
  std::string who(std::uint32_t i);
  // How long a server thread waits for a stripe lock a client holds.
  std::chrono::nanoseconds lock_patience() const noexcept;

  ShmServerOptions options_;
  Segment* segment_;
  SegmentGeometry geo_;  // private: what the server laid out, never re-read from the segment
  ShardEngine* engine_;
  std::unique_ptr<std::atomic<bool>[]> blocked_;  // the area has a parked request
  // The pid whose ring stopped making sense (published more than the ring holds): its area is
  // not served until the area changes hands. 0: none.
  std::unique_ptr<std::atomic<std::int32_t>[]> ignored_;
  std::atomic<bool> stopping_{false};       // server threads: stop (drain)
  std::atomic<bool> watchdog_stop_{false};  // the watchdog keeps rolling back dead clients until close
  bool drained_ = false, closed_ = false;
  std::vector<std::thread> threads_;
  std::thread watchdog_;
};

}  // namespace pskv::shm
