// Stopping a process at a chosen instant, for tests that kill or hang a peer in a given state.
// Header-only, so unit tests that do not link the process-spawning support library can use it.
#pragma once

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>

#include <chrono>
#include <random>
#include <thread>

namespace pskv::testing {

// SIGSTOPs `pid` (a child of this process) and returns once it is stopped: kill() only queues
// the signal, and the child would otherwise run on for a while. False if it did not stop.
inline bool stop_process(pid_t pid) {
  if (kill(pid, SIGSTOP) != 0) return false;
  int status = 0;
  return waitpid(pid, &status, WUNTRACED) == pid && WIFSTOPPED(status);
}

// Stops `pid` until `caught()`, checked while it is stopped, holds; in between it lets the
// child run for 50-250 us. Leaves it stopped and returns true once caught; false if it could
// not be stopped or was not caught in `tries` stops.
template <class Caught>
bool stop_when(pid_t pid, Caught caught, std::mt19937& rng, int tries = 10000) {
  for (int i = 0; i < tries; ++i) {
    if (!stop_process(pid)) return false;
    if (caught()) return true;
    kill(pid, SIGCONT);
    std::this_thread::sleep_for(std::chrono::microseconds(50 + rng() % 200));
  }
  return false;
}

}  // namespace pskv::testing
