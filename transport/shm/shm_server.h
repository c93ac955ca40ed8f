// Server side of the shared-memory backend: threads that apply each client's ring in order,
// sleeping on a futex doorbell when every ring is empty, and a watchdog that notices clients
// that died, rolls back a push one left half-applied, releases its stripe lock and frees its slot.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/shard_engine.h"
#include "transport/shm/segment.h"

namespace pskv::shm {

struct ShmServerOptions {
  std::uint32_t threads = 1;
  std::uint32_t slots = 64;
  std::uint64_t slot_data_bytes = 32ull << 20;
  // Clients apply their own pushes (no hand-off to a server thread); false: through the ring.
  bool worker_push = true;
};

// Trust: every client, and any other process of the job's user, can write the whole segment.
// The server takes the segment's geometry (slot count, offsets, stride, data size) from its own
// configuration, the store's from the Store's private copy, and each key's offset and length from
// the Store's private records; ring entries, undo records and slot words are read once and
// checked against those before use. A client that scribbles over its own slot gets errors (and
// log lines), and when its ring no longer makes sense it is ignored until its slot is freed.
//
// Thread-safety: construct and destroy from one thread; stop() is idempotent. Server threads
// own disjoint sets of slots (i % threads); the watchdog thread frees slots of dead clients.
class ShmServer {
 public:
  // `prepare` runs on the engine before any client can see the segment (e.g. a restore).
  ShmServer(const std::string& name, const EngineOptions& engine, const ShmServerOptions& options,
            const std::function<void(ShardEngine&)>& prepare = {});
  ~ShmServer();
  ShmServer(const ShmServer&) = delete;
  ShmServer& operator=(const ShmServer&) = delete;

  ShardEngine& engine() noexcept { return *engine_; }
  // The engine's stats plus the pushes clients applied themselves and those rolled back.
  std::string stats_json() const;
  void stop();

 private:
  friend class SlotParked;
  void serve(std::uint32_t thread);
  // Answers ring entries of slot `i` until it is empty or blocked on a parked request.
  bool drain(std::uint32_t i);
  // Returns false when the request was parked (answered later by resume()).
  bool process(std::uint32_t i, RingEntry& e, std::uint64_t seq);
  void answer(std::uint32_t i, RingEntry& e, Errc status, const std::string& text);
  void publish(std::uint32_t i, std::uint64_t seq);
  void wake_thread(std::uint32_t i);
  void wake_clock_waiters();
  void watchdog();
  // "client slot I (pid P)", for log lines.
  std::string who(std::uint32_t i);

  ShmServerOptions options_;
  std::unique_ptr<Segment> segment_;
  SegmentGeometry geo_;  // private: what the server laid out, never re-read from the segment
  std::unique_ptr<ShardEngine> engine_;
  std::unique_ptr<std::atomic<bool>[]> blocked_;  // slot has a parked request
  // The pid whose ring stopped making sense (published more than the ring holds): its slot is
  // not served until the slot changes hands. 0: none.
  std::unique_ptr<std::atomic<std::int32_t>[]> ignored_;
  std::atomic<bool> stopping_{false};
  std::vector<std::thread> threads_;
  std::thread watchdog_;
};

}  // namespace pskv::shm
