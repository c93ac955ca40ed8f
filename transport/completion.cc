#include <thread>

#include "common/sync.h"
#include "transport/transport.h"

namespace pskv::transport {

void Completion::reset(std::uint32_t parts) noexcept {
  status_ = Errc::ok;
  message_.clear();
  bound_.store(~0ull, std::memory_order_relaxed);
  wake_.store(0, std::memory_order_relaxed);
  remaining_.store(parts, std::memory_order_release);
}

void Completion::note_bound(std::uint64_t bound) noexcept {
  std::uint64_t cur = bound_.load(std::memory_order_relaxed);
  while (bound < cur && !bound_.compare_exchange_weak(cur, bound, std::memory_order_relaxed)) {
  }
}

void Completion::complete_part(Errc status, std::string_view message) noexcept {
  if (status != Errc::ok) {
    std::lock_guard lock(mu_);
    if (status_ == Errc::ok) {
      status_ = status;
      message_.assign(message);
    }
  }
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    wake_.store(1, std::memory_order_release);
    futex_wake_all(&wake_);
  }
}

bool Completion::wait(std::chrono::steady_clock::time_point deadline) noexcept {
  for (int i = 0; i < 256; ++i) {
    if (done()) return true;
    cpu_relax();
  }
  while (!done()) {
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds::zero()) return done();
    futex_wait(&wake_, 0, std::chrono::duration_cast<std::chrono::nanoseconds>(left));
  }
  return true;
}

}  // namespace pskv::transport
