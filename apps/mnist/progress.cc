#include "progress.h"

#include <unistd.h>

#include "pskv/error.h"

namespace pskv::mnist {

Progress::Progress(bool quiet, const std::string& csv_path) : quiet_(quiet), tty_(isatty(STDOUT_FILENO) != 0) {
  if (!csv_path.empty()) {
    csv_ = std::fopen(csv_path.c_str(), "w");
    if (!csv_) throw Error(Errc::io, "cannot write the CSV log " + csv_path);
    std::fprintf(csv_, "time_s,epoch,step,samples,loss,test_accuracy,samples_per_s,max_staleness\n");
  }
}

Progress::~Progress() {
  if (csv_) std::fclose(csv_);
}

double Progress::elapsed_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Progress::step(int epoch, int epochs, std::size_t step, std::size_t steps, float loss, double samples_per_s,
                    std::uint64_t max_staleness) {
  if (quiet_ || !tty_) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(100) && step + 1 != steps) return;
  last_draw_ = now;
  constexpr int kWidth = 28;
  const int filled = static_cast<int>(kWidth * (step + 1) / std::max<std::size_t>(steps, 1));
  std::string bar(static_cast<std::size_t>(filled), '#');
  bar.resize(kWidth, '.');
  std::printf("\r\033[Kepoch %d/%d [%s] %zu/%zu loss %.3f acc %s %.0f samples/s staleness<=%llu", epoch + 1, epochs,
              bar.c_str(), step + 1, steps, loss,
              last_accuracy_ < 0 ? "  -  " : (std::to_string(last_accuracy_ * 100).substr(0, 5) + "%").c_str(),
              samples_per_s, static_cast<unsigned long long>(max_staleness));
  std::fflush(stdout);
}

void Progress::eval(int epoch, std::size_t step, std::uint64_t samples, float loss, double accuracy,
                    double samples_per_s, std::uint64_t max_staleness) {
  last_accuracy_ = accuracy;
  const double t = elapsed_s();
  if (csv_) {
    std::fprintf(csv_, "%.3f,%d,%zu,%llu,%.5f,%.5f,%.1f,%llu\n", t, epoch, step,
                 static_cast<unsigned long long>(samples), loss, accuracy, samples_per_s,
                 static_cast<unsigned long long>(max_staleness));
    std::fflush(csv_);
  }
  if (quiet_) return;
  if (tty_) std::printf("\r\033[K");
  std::printf("[%7.1fs] epoch %d step %zu: loss %.4f test accuracy %.2f%% %.0f samples/s max staleness %llu\n", t,
              epoch + 1, step, loss, accuracy * 100, samples_per_s, static_cast<unsigned long long>(max_staleness));
  std::fflush(stdout);
}

void Progress::finish() {
  if (!quiet_ && tty_) {
    std::printf("\r\033[K");
    std::fflush(stdout);
  }
}

}  // namespace pskv::mnist
