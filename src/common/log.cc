#include "common/log.h"

#include <sys/time.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>
#include <unordered_map>

namespace pskv::log {
namespace {

Level level_from_env() {
  const char* v = std::getenv("PSKV_LOG_LEVEL");
  if (!v) return Level::info;
  if (!std::strcmp(v, "error")) return Level::error;
  if (!std::strcmp(v, "warn")) return Level::warn;
  if (!std::strcmp(v, "debug")) return Level::debug;
  return Level::info;
}

std::atomic<int> g_level{static_cast<int>(level_from_env())};
std::atomic<unsigned long long> g_suppressed{0};

struct Window {
  std::int64_t second = 0;
  int lines = 0;
  unsigned long long dropped = 0;
};

// One mutex for the rate table and the sink: logging is for rare events (a flood is cut to
// kBurst lines a second per category), so contention is not worth more machinery.
std::mutex g_mu;
std::unordered_map<std::string, Window> g_windows;
std::function<void(std::string_view)> g_sink;

const char* level_name(Level l) {
  switch (l) {
    case Level::error:
      return "error";
    case Level::warn:
      return "warn";
    case Level::info:
      return "info";
    case Level::debug:
      return "debug";
  }
  return "?";
}

}  // namespace

void set_level(Level l) {
  g_level.store(static_cast<int>(l));
}
Level level() {
  return static_cast<Level>(g_level.load());
}
bool enabled(Level l) {
  return static_cast<int>(l) <= g_level.load(std::memory_order_relaxed);
}

void set_sink(std::function<void(std::string_view)> sink) {
  std::lock_guard lock(g_mu);
  g_sink = std::move(sink);
}

unsigned long long suppressed() {
  return g_suppressed.load();
}

void write(Level l, std::string_view category, std::string_view message) {
  if (!enabled(l)) return;
  timeval tv{};
  ::gettimeofday(&tv, nullptr);
  std::lock_guard lock(g_mu);
  Window& w = g_windows[std::string(category)];
  if (w.second != tv.tv_sec) {
    w.second = tv.tv_sec;
    w.lines = 0;
  }
  if (w.lines >= kBurst) {
    ++w.dropped;
    g_suppressed.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  ++w.lines;
  tm utc{};
  ::gmtime_r(&tv.tv_sec, &utc);
  char stamp[96];
  std::snprintf(stamp, sizeof stamp, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", utc.tm_year + 1900, utc.tm_mon + 1,
                utc.tm_mday, utc.tm_hour, utc.tm_min, utc.tm_sec, static_cast<int>(tv.tv_usec / 1000));
  std::string line;
  line.reserve(message.size() + category.size() + 64);
  line += stamp;
  line += ' ';
  line += level_name(l);
  line += ' ';
  line += category;
  line += ": ";
  line += message;
  if (w.dropped) {
    line += " (" + std::to_string(w.dropped) + " more like this suppressed)";
    w.dropped = 0;
  }
  if (g_sink) {
    g_sink(line);
  } else {
    line += '\n';
    std::fwrite(line.data(), 1, line.size(), stderr);
  }
}

}  // namespace pskv::log
