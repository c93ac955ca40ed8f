#include <algorithm>
#include <thread>

#include "common/sync.h"
#include "transport/transport.h"

namespace pskv::transport {

namespace {
// wake_ states: the waiter announces that it sleeps, so completers only pay for FUTEX_WAKE when
// someone is actually asleep.
constexpr std::uint32_t kPending = 0, kDone = 1, kSleeping = 2;
}  // namespace

void Completion::reset(std::uint32_t parts) noexcept {
  status_ = Errc::ok;
  message_.clear();
  bound_.store(~0ull, std::memory_order_relaxed);
  wake_.store(parts == 0 ? kDone : kPending, std::memory_order_relaxed);
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
    // After this exchange the waiter may free us; the futex wake only passes the address to
    // the kernel (a stale address at worst wakes nobody, or someone who re-checks).
    if (wake_.exchange(kDone, std::memory_order_acq_rel) == kSleeping) futex_wake_all(&wake_);
  }
}

namespace {
// A reply over loopback or shared memory often lands within tens of microseconds, and spinning
// that long saves a sleep/wake pair. But a spinner holds a core the server or a receiver thread
// may need, so: at most one spinner per two cores in this process, and a per-thread budget that
// grows when spins pay off and halves when they do not.
std::atomic<int> g_spinners{0};
const int g_max_spinners = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2);
thread_local int t_spin_budget_us = Completion::kSpinMicros;

bool spin_for(const Completion& c, Poller* poller) noexcept {
  if (t_spin_budget_us <= 0 || g_spinners.fetch_add(1, std::memory_order_relaxed) >= g_max_spinners) {
    g_spinners.fetch_sub(1, std::memory_order_relaxed);
    t_spin_budget_us = std::min(Completion::kSpinMicros, t_spin_budget_us + 1);  // probe again slowly
    return c.done();
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(t_spin_budget_us);
  bool done = false;
  if (poller) poller->begin_polling();
  for (unsigned i = 0; !(done = c.done()); ++i) {
    if (poller)
      poller->poll();
    else
      cpu_relax();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > until) break;
  }
  if (poller) {
    poller->end_polling();
    done = c.done();
  }
  g_spinners.fetch_sub(1, std::memory_order_relaxed);
  t_spin_budget_us = done ? std::min(Completion::kSpinMicros * 2, t_spin_budget_us + 4) : t_spin_budget_us / 2;
  return done;
}
}  // namespace

bool Completion::wait(std::chrono::steady_clock::time_point deadline, Poller* poller) noexcept {
  if (spin_for(*this, poller)) return true;
  while (!done()) {
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds::zero()) return done();
    std::uint32_t expected = kPending;
    if (!wake_.compare_exchange_strong(expected, kSleeping, std::memory_order_acq_rel) && expected == kDone) break;
    futex_wait(&wake_, kSleeping, std::chrono::duration_cast<std::chrono::nanoseconds>(left));
  }
  return true;
}

}  // namespace pskv::transport
