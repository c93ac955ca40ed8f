#include "support/process.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

#ifndef PSKV_SERVER_BIN
#error "PSKV_SERVER_BIN must name the pskv-server binary"
#endif

namespace pskv::testing {

Process::Process(const std::string& program, const std::vector<std::string>& args, const std::string& stderr_path) {
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    dup2(pipefd[1], STDOUT_FILENO);
    if (!stderr_path.empty()) {
      const int err = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (err >= 0) dup2(err, STDERR_FILENO);
    }
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(program.c_str()));
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(program.c_str(), argv.data());
    std::perror("execv");
    _exit(127);
  }
  close(pipefd[1]);
  out_fd_ = pipefd[0];
}

Process::~Process() {
  // Graceful first, so servers clean up (a shm server removes its segment), then forceful.
  if (pid_ > 0 && running()) {
    ::kill(pid_, SIGTERM);
    if (wait(std::chrono::seconds(5)) == -1) {
      ::kill(pid_, SIGKILL);
      wait(std::chrono::seconds(10));
    }
  }
  if (out_fd_ >= 0) close(out_fd_);
}

Process::Process(Process&& o) noexcept : pid_(o.pid_), out_fd_(o.out_fd_), buffer_(std::move(o.buffer_)) {
  o.pid_ = -1;
  o.out_fd_ = -1;
}

Process& Process::operator=(Process&& o) noexcept {
  std::swap(pid_, o.pid_);
  std::swap(out_fd_, o.out_fd_);
  std::swap(buffer_, o.buffer_);
  return *this;
}

std::string Process::read_line(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (auto nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return {};
    pollfd p{out_fd_, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left.count())) <= 0) return {};
    char buf[512];
    const ssize_t n = ::read(out_fd_, buf, sizeof buf);
    if (n <= 0) return {};
    buffer_.append(buf, static_cast<std::size_t>(n));
  }
}

void Process::signal(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

bool Process::running() {
  if (pid_ <= 0) return false;
  int status;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    pid_ = -1;
    return false;
  }
  return r == 0;
}

int Process::wait(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  const int rc = wait_pid(pid_, timeout);
  if (rc != -1) pid_ = -1;
  return rc;
}

pid_t fork_worker(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    int rc = 1;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "worker %d: %s\n", getpid(), e.what());
      rc = 1;
    }
    std::fflush(nullptr);
    _exit(rc);
  }
  return pid;
}

int wait_pid(pid_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (r < 0) return -2;
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

int fault_trials() {
  const char* v = std::getenv("PSKV_FAULT_TRIALS");
  return v ? std::max(1, std::atoi(v)) : 20;
}

KillOnExit::~KillOnExit() {
  for (pid_t pid : pids_)
    if (pid > 0 && ::waitpid(pid, nullptr, WNOHANG) == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
}

ServerProcess ServerProcess::start(const std::vector<std::string>& args, const std::string& stderr_path) {
  ServerProcess s{Process(PSKV_SERVER_BIN, args, stderr_path), {}};
  const std::string line = s.process.read_line();
  const std::string marker = "listening on ";
  const auto at = line.find(marker);
  if (at == std::string::npos) throw std::runtime_error("pskv-server did not start: '" + line + "'");
  s.uri = line.substr(at + marker.size());
  s.uri = s.uri.substr(0, s.uri.find(' '));
  return s;
}

namespace {
long status_field(pid_t pid, const char* field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stol(line.substr(std::strlen(field)));
  return -1;
}
}  // namespace

long peak_rss_kib(pid_t pid) {
  return status_field(pid, "VmHWM:");
}
long rss_kib(pid_t pid) {
  return status_field(pid, "VmRSS:");
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

namespace {

// The state letter of /proc/PID/task/TID/stat ('R' running, 'S'/'D' blocked, ...); 0 if gone.
char thread_state(const std::string& stat_path) {
  std::ifstream in(stat_path);
  std::string line;
  if (!std::getline(in, line)) return 0;
  const std::size_t close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() ? 0 : line[close + 2];
}

}  // namespace

int samples_all_threads_asleep(pid_t pid, int samples, pid_t except_tid) {
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  int asleep = 0;
  for (int i = 0; i < samples; ++i) {
    bool all = true;
    for (const auto& entry : std::filesystem::directory_iterator(tasks)) {
      if (entry.path().filename() == std::to_string(except_tid)) continue;
      const char state = thread_state(entry.path() / "stat");
      if (state == 'R') all = false;
    }
    asleep += all;
    std::this_thread::sleep_for(std::chrono::microseconds(2500));
  }
  return asleep;
}

bool wait_stopped(pid_t pid, std::chrono::milliseconds timeout) {
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  for (const auto until = std::chrono::steady_clock::now() + timeout; std::chrono::steady_clock::now() < until;) {
    bool all = true;
    std::error_code ec;
    for (const auto& entry : std::filesystem::directory_iterator(tasks, ec))
      if (thread_state(entry.path() / "stat") != 'T') all = false;
    if (all && !ec) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

}  // namespace pskv::testing
