// Low-level synchronisation that works across processes: shared futexes, a CPU pause hint, the
// steady clock as an integer, and a helper to copy memory that a seqlock writer may be changing
// concurrently.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SANITIZE_THREAD__)
#define PSKV_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PSKV_TSAN 1
#endif
#endif
#ifndef PSKV_TSAN
#define PSKV_TSAN 0
#endif

#if PSKV_TSAN
#define PSKV_NO_TSAN __attribute__((no_sanitize("thread")))
extern "C" void AnnotateIgnoreReadsBegin(const char* file, int line);
extern "C" void AnnotateIgnoreReadsEnd(const char* file, int line);
#else
#define PSKV_NO_TSAN
#endif

namespace pskv {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// The steady clock in nanoseconds, for timestamps kept in atomics (or in shared memory: it is
// CLOCK_MONOTONIC, the same in every process).
inline std::int64_t steady_now_ns() noexcept {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The right to busy-wait. At most one thread per two cores of this process holds one at a time:
// a spinner holds a core that a server or a receiving thread may need. A thread that holds one
// already is granted another (its nested waits spin on the core it holds). Thread-safety: a
// ticket belongs to the thread that made it.
class SpinTicket {
 public:
  SpinTicket() noexcept;
  ~SpinTicket();
  SpinTicket(const SpinTicket&) = delete;
  SpinTicket& operator=(const SpinTicket&) = delete;
  explicit operator bool() const noexcept { return granted_; }

 private:
  bool granted_ = false;
};

// Waits while *word == expected. Uses a shared (not PRIVATE) futex so that a waker in another
// process that maps the same page reaches us. Returns false on timeout. Spurious returns happen;
// callers re-check their condition.
bool futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected,
                std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max()) noexcept;
void futex_wake(std::atomic<std::uint32_t>* word, int count) noexcept;
inline void futex_wake_all(std::atomic<std::uint32_t>* word) noexcept {
  futex_wake(word, 1 << 30);
}

// Copies memory that a seqlock writer may be modifying. The caller validates the copy with the
// sequence number afterwards, so the race is benign by design; under TSan the copy is hidden
// from the race detector (a plain memcpy would be intercepted and reported).
PSKV_NO_TSAN inline void seqlock_copy(void* dst, const void* src, std::size_t n) noexcept {
#if PSKV_TSAN
  auto* d = static_cast<unsigned char*>(dst);
  auto* s = static_cast<const volatile unsigned char*>(src);
  for (std::size_t i = 0; i < n; ++i) d[i] = s[i];
#else
  std::memcpy(dst, src, n);
#endif
}

// The same promise for reads seqlock_copy cannot wrap: the kernel's, when a syscall sends memory
// a seqlock writer may be changing (a large pull sent straight from the store). While one is in
// scope, TSan does not record this thread's reads; its writes and other threads stay checked.
class SeqlockReadScope {
 public:
  SeqlockReadScope() noexcept {
#if PSKV_TSAN
    AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
#endif
  }
  ~SeqlockReadScope() {
#if PSKV_TSAN
    AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
#endif
  }
  SeqlockReadScope(const SeqlockReadScope&) = delete;
  SeqlockReadScope& operator=(const SeqlockReadScope&) = delete;
};

// A mutex that lives in (possibly shared) memory: 4 bytes, zero-initialised means unlocked.
// Uncontended lock/unlock is one atomic each; contended waiters spin briefly, then sleep on a
// shared futex (Drepper, "Futexes Are Tricky", mutex #3).
//
// The word holds the holder's owner tag (<< 1) and a waiters bit, so that a holder that may die
// (a shm worker, killed at any instant) can be recognised afterwards: whoever knows it is dead
// repairs what it guarded and calls release_for(its tag). Tags other than kAnonymousOwner must be
// unique among the processes that share the lock; kAnonymousOwner is for holders whose death ends
// the job anyway (the server, in-process users).
// Thread-safety: fully thread- and process-safe.
class SharedMutex {
 public:
  static constexpr std::uint32_t kAnonymousOwner = 1;

  void lock(std::uint32_t owner = kAnonymousOwner) noexcept {
    if (try_lock_spinning(owner)) return;
    lock_slow(owner << 1, std::chrono::steady_clock::time_point::max());
  }
  // False if the lock was still held after `patience` (the caller may check that the holder
  // lives). The clock is read only once the lock turns out to be contended.
  bool lock_for(std::uint32_t owner, std::chrono::nanoseconds patience) noexcept {
    return try_lock_spinning(owner) || lock_slow(owner << 1, std::chrono::steady_clock::now() + patience);
  }
  bool try_lock(std::uint32_t owner = kAnonymousOwner) noexcept {
    std::uint32_t c = 0;
    return state_.compare_exchange_strong(c, owner << 1, std::memory_order_acquire);
  }
  void unlock() noexcept {
    if (state_.exchange(0, std::memory_order_release) & kWaiters) futex_wake(&state_, 1);
  }
  // The holder's owner tag, 0 when free.
  std::uint32_t holder() const noexcept { return state_.load(std::memory_order_acquire) >> 1; }
  // Unlocks on behalf of `owner`, which is known to be dead, if it still holds the lock.
  bool release_for(std::uint32_t owner) noexcept {
    std::uint32_t c = state_.load(std::memory_order_acquire);
    while ((c >> 1) == owner) {
      if (state_.compare_exchange_weak(c, 0, std::memory_order_release)) {
        if (c & kWaiters) futex_wake_all(&state_);
        return true;
      }
    }
    return false;
  }

 private:
  static constexpr std::uint32_t kWaiters = 1;

  bool try_lock_spinning(std::uint32_t owner) noexcept {
    if (try_lock(owner)) return true;
    for (int i = 0; i < 128; ++i) {
      cpu_relax();
      if (state_.load(std::memory_order_relaxed) == 0 && try_lock(owner)) return true;
    }
    return false;
  }
  bool lock_slow(std::uint32_t mine, std::chrono::steady_clock::time_point deadline) noexcept {
    std::uint32_t c = state_.load(std::memory_order_relaxed);
    for (;;) {
      // Taken after sleeping, the lock keeps the waiters bit: others may still sleep on it.
      if (c == 0) {
        if (state_.compare_exchange_weak(c, mine | kWaiters, std::memory_order_acquire)) return true;
        continue;
      }
      if (!(c & kWaiters) && !state_.compare_exchange_weak(c, c | kWaiters, std::memory_order_relaxed)) continue;
      if (deadline == std::chrono::steady_clock::time_point::max()) {
        futex_wait(&state_, c | kWaiters);
      } else {
        const auto left = deadline - std::chrono::steady_clock::now();
        if (left <= std::chrono::nanoseconds::zero()) return false;
        futex_wait(&state_, c | kWaiters, left);
      }
      c = state_.load(std::memory_order_relaxed);
    }
  }

  std::atomic<std::uint32_t> state_{0};
};

}  // namespace pskv
