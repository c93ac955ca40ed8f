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

int Poller::max_spin_micros() const noexcept {
  return Completion::kMaxSpinMicros;
}

double Completion::spin_budget_micros(double typical_wait_us, int max_spin_us) noexcept {
  const double cap = std::min(max_spin_us, kMaxSpinMicros);
  if (typical_wait_us < 0) return cap;
  if (typical_wait_us > cap) return 0;
  return std::min(cap, 2 * typical_wait_us + 5);
}

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
// A reply over loopback or shared memory often lands within microseconds, and spinning that long
// saves a sleep/wake pair. But a spinner holds a core (hence the SpinTicket), and only while this
// thread's recent waits were short: each thread keeps a moving average of how long its waits took
// (slept ones included). A slept wait counts its wake-up too, which on a busy machine can keep
// the average over a 25 us limit however short the answers became; so one wait in kProbeEvery
// that would not spin spins for kProbeMicros, and an answer caught by it sets the average anew.
thread_local double t_typical_wait_us = -1;  // negative: no wait seen yet
thread_local unsigned t_waits_unspun = 0;
constexpr unsigned kProbeEvery = 16;
constexpr double kProbeMicros = 5;

enum class Spun { answered, probe_answered, not_answered };

Spun spin_for(const Completion& c, Poller* poller) noexcept {
  const int limit = poller ? poller->max_spin_micros() : Completion::kMaxSpinMicros;
  double budget_us = Completion::spin_budget_micros(t_typical_wait_us, limit);
  const bool probe = budget_us <= 0;
  if (probe) {
    if (++t_waits_unspun < kProbeEvery) return c.done() ? Spun::answered : Spun::not_answered;
    t_waits_unspun = 0;
    budget_us = std::min<double>(kProbeMicros, limit);
  }
  const Spun answered = probe ? Spun::probe_answered : Spun::answered;
  const SpinTicket ticket;
  if (!ticket || (poller && !poller->begin_polling())) return c.done() ? answered : Spun::not_answered;
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::nanoseconds(static_cast<std::int64_t>(budget_us * 1000));
  bool done = false;
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
  return done ? answered : Spun::not_answered;
}

void note_wait(std::chrono::steady_clock::duration took, bool anew = false) noexcept {
  const double us = std::chrono::duration<double, std::micro>(took).count();
  t_typical_wait_us = t_typical_wait_us < 0 || anew ? us : 0.875 * t_typical_wait_us + 0.125 * us;
}
}  // namespace

bool Completion::wait(std::chrono::steady_clock::time_point deadline, Poller* poller) noexcept {
  const auto start = std::chrono::steady_clock::now();
  if (const Spun spun = spin_for(*this, poller); spun != Spun::not_answered) {
    note_wait(std::chrono::steady_clock::now() - start, spun == Spun::probe_answered);
    return true;
  }
  // Sleep where the far side can wake this thread directly. Answers completed by a transport
  // thread instead (errors, parked pulls) bump that word too; the slices are a safety net.
  while (poller && !done()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return done();
    if (!poller->sleep_for_answers(*this, std::min(deadline, now + std::chrono::milliseconds(20)), deadline)) break;
  }
  while (!done()) {
    const auto left = deadline - std::chrono::steady_clock::now();
    if (left <= std::chrono::nanoseconds::zero()) return done();
    std::uint32_t expected = kPending;
    if (!wake_.compare_exchange_strong(expected, kSleeping, std::memory_order_acq_rel) && expected == kDone) break;
    futex_wait(&wake_, kSleeping, std::chrono::duration_cast<std::chrono::nanoseconds>(left));
  }
  note_wait(std::chrono::steady_clock::now() - start);
  return true;
}

}  // namespace pskv::transport
