#include "common/sync.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <thread>

namespace pskv {

namespace {
std::atomic<int> g_spinning_threads{0};
const int g_max_spinning_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / 2);
thread_local int t_tickets = 0;  // held by this thread, nested ones included
}  // namespace

SpinTicket::SpinTicket() noexcept {
  if (t_tickets > 0 || g_spinning_threads.fetch_add(1, std::memory_order_relaxed) < g_max_spinning_threads) {
    granted_ = true;
    ++t_tickets;
  } else {
    g_spinning_threads.fetch_sub(1, std::memory_order_relaxed);
  }
}

SpinTicket::~SpinTicket() {
  if (granted_ && --t_tickets == 0) g_spinning_threads.fetch_sub(1, std::memory_order_relaxed);
}

bool futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, std::chrono::nanoseconds timeout) noexcept {
  timespec ts{};
  timespec* tsp = nullptr;
  if (timeout != std::chrono::nanoseconds::max()) {
    if (timeout.count() <= 0) return false;
    ts.tv_sec = static_cast<time_t>(timeout.count() / 1'000'000'000);
    ts.tv_nsec = static_cast<long>(timeout.count() % 1'000'000'000);
    tsp = &ts;
  }
  long rc = syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT, expected, tsp, nullptr, 0);
  return !(rc == -1 && errno == ETIMEDOUT);
}

void futex_wake(std::atomic<std::uint32_t>* word, int count) noexcept {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE, count, nullptr, nullptr, 0);
}

}  // namespace pskv
