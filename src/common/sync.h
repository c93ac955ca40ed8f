// Low-level synchronisation that works across processes: shared futexes, a CPU pause hint, and a
// helper to copy memory that a seqlock writer may be changing concurrently.
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

// Waits while *word == expected. Uses a shared (not PRIVATE) futex so that a waker in another
// process that maps the same page reaches us. Returns false on timeout. Spurious returns happen;
// callers re-check their condition.
bool futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected,
                std::chrono::nanoseconds timeout = std::chrono::nanoseconds::max()) noexcept;
void futex_wake(std::atomic<std::uint32_t>* word, int count) noexcept;
inline void futex_wake_all(std::atomic<std::uint32_t>* word) noexcept { futex_wake(word, 1 << 30); }

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

// A mutex that lives in (possibly shared) memory: 4 bytes, zero-initialised means unlocked.
// Uncontended lock/unlock is one atomic each; contended waiters spin briefly, then sleep on a
// shared futex (Drepper, "Futexes Are Tricky", mutex #3). Not robust against its holder dying:
// only processes whose death ends the job (the server) may take it.
// Thread-safety: fully thread- and process-safe.
class SharedMutex {
 public:
  void lock() noexcept {
    std::uint32_t c = 0;
    if (state_.compare_exchange_strong(c, 1, std::memory_order_acquire)) return;
    for (int i = 0; i < 128; ++i) {
      cpu_relax();
      c = 0;
      if (state_.load(std::memory_order_relaxed) == 0 &&
          state_.compare_exchange_strong(c, 1, std::memory_order_acquire))
        return;
    }
    if (c != 2) c = state_.exchange(2, std::memory_order_acquire);
    while (c != 0) {
      futex_wait(&state_, 2);
      c = state_.exchange(2, std::memory_order_acquire);
    }
  }
  bool try_lock() noexcept {
    std::uint32_t c = 0;
    return state_.compare_exchange_strong(c, 1, std::memory_order_acquire);
  }
  void unlock() noexcept {
    if (state_.fetch_sub(1, std::memory_order_release) != 1) {
      state_.store(0, std::memory_order_release);
      futex_wake(&state_, 1);
    }
  }

 private:
  std::atomic<std::uint32_t> state_{0};
};

}  // namespace pskv
