// Training progress for people and for plots: a one-line bar on a terminal, plain lines
// otherwise, and an optional CSV of accuracy against time.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace pskv::mnist {

// Thread-safety: none; one training loop owns it.
class Progress {
 public:
  Progress(bool quiet, const std::string& csv_path);
  ~Progress();
  void step(int epoch, int epochs, std::size_t step, std::size_t steps, float loss, double samples_per_s,
            std::uint64_t max_staleness);
  void eval(int epoch, std::size_t step, std::uint64_t samples, float loss, double accuracy, double samples_per_s,
            std::uint64_t max_staleness);
  void finish();
  double elapsed_s() const;

 private:
  bool quiet_;
  bool tty_;
  std::FILE* csv_ = nullptr;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_draw_{};
  double last_accuracy_ = -1;
};

}  // namespace pskv::mnist
