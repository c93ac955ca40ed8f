// Child processes for integration tests: pskv-server instances and forked client workers.
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace pskv::testing {

// A spawned program. The destructor stops it if it is still running: SIGTERM, then SIGKILL.
class Process {
 public:
  Process() = default;
  // stderr_path: where the child's stderr goes (default: inherited).
  Process(const std::string& program, const std::vector<std::string>& args, const std::string& stderr_path = {});
  ~Process();
  Process(Process&& o) noexcept;
  Process& operator=(Process&& o) noexcept;

  pid_t pid() const { return pid_; }
  // Reads one line of the child's stdout, waiting up to `timeout`. Empty on timeout/EOF.
  std::string read_line(std::chrono::milliseconds timeout = std::chrono::seconds(20));
  void signal(int sig);
  // Waits for exit; returns the exit status (128+signal when killed), or -1 on timeout.
  int wait(std::chrono::milliseconds timeout = std::chrono::seconds(60));
  bool running();

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1;
  std::string buffer_;
};

// Runs `body` in a forked child; the child's exit status is body's return value (1 if it threw).
pid_t fork_worker(const std::function<int()>& body);
int wait_pid(pid_t pid, std::chrono::milliseconds timeout = std::chrono::seconds(120));

// Trials per fault test: PSKV_FAULT_TRIALS (scripts/test.sh sets 20), at least 1.
int fault_trials();

// A zeroed array of `n` T in memory that forked children share with the test (MAP_SHARED), for
// the counts they report; unmapped with the object. T must be trivially destructible.
template <class T>
class SharedArray {
 public:
  explicit SharedArray(std::size_t n) : n_(n) {
    void* p = ::mmap(nullptr, sizeof(T) * n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap of a shared array failed");
    data_ = new (p) T[n]();
  }
  ~SharedArray() { ::munmap(data_, sizeof(T) * n_); }
  SharedArray(const SharedArray&) = delete;
  SharedArray& operator=(const SharedArray&) = delete;
  T& operator[](std::size_t i) const { return data_[i]; }
  T* get() const { return data_; }

 private:
  std::size_t n_;
  T* data_;
};

// SIGKILLs and reaps whichever of `pids` still run when it goes out of scope, so that a test that
// fails half-way (an ASSERT returns) leaves no forked worker behind to load the machine.
class KillOnExit {
 public:
  explicit KillOnExit(const std::vector<pid_t>& pids) : pids_(pids) {}
  ~KillOnExit();
  KillOnExit(const KillOnExit&) = delete;
  KillOnExit& operator=(const KillOnExit&) = delete;

 private:
  const std::vector<pid_t>& pids_;
};

// A pskv-server started with `args`; its URI is read from its first line of output.
struct ServerProcess {
  Process process;
  std::string uri;
  static ServerProcess start(const std::vector<std::string>& args, const std::string& stderr_path = {});
};

// The whole of a file (a server's stderr log, say); empty if it cannot be read.
std::string read_file(const std::string& path);

// Peak resident memory (VmHWM) of a process in KiB.
long peak_rss_kib(pid_t pid);
// Waits until every thread of `pid` is stopped (after a SIGSTOP, which kill() only sends): false
// if that took longer than `timeout`.
bool wait_stopped(pid_t pid, std::chrono::milliseconds timeout);
long rss_kib(pid_t pid);

// How many of `samples` looks at a process, a few milliseconds apart, found every one of its
// threads (but `except_tid`) blocked in the kernel rather than running. An idle server that
// sleeps scores near `samples`; one that spins or ticks fast scores near 0. No timing bound:
// the scheduler decides only how often a thread is caught in its rare wake-ups.
int samples_all_threads_asleep(pid_t pid, int samples, pid_t except_tid = 0);

}  // namespace pskv::testing
