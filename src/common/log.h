// The one logging facility of the library and its binaries. Every refusal, closed connection and
// limit hit goes through here, naming the peer, the operation and the reason, so an operator can
// act on what a hostile or broken peer did. Lines go to stderr (or a sink set by a program), one
// line each, with a UTC timestamp and the level.
//
// Rate limiting: each call names a category ("tcp.refused", "shm.bad-entry", ...). A category
// writes at most kBurst lines per second; the rest are counted and the count is reported by the
// category's next line that gets through, so a flood costs the log a few lines per second, not
// a disk, and the operator still learns how many there were.
//
// Thread-safety: every function may be called from any thread at any time.
#pragma once

#include <functional>
#include <string>
#include <string_view>

namespace pskv::log {

enum class Level { error = 0, warn = 1, info = 2, debug = 3 };

inline constexpr int kBurst = 10;  // lines per category per second

// Lines above this level are dropped. Default: info, or PSKV_LOG_LEVEL (error|warn|info|debug).
void set_level(Level level);
Level level();
bool enabled(Level level);

// Replaces the destination (nullptr: stderr). The sink gets whole lines without the newline.
void set_sink(std::function<void(std::string_view)> sink);

// Writes `message` unless the level is off or `category` is over its rate.
void write(Level level, std::string_view category, std::string_view message);

inline void error(std::string_view category, std::string_view message) {
  write(Level::error, category, message);
}
inline void warn(std::string_view category, std::string_view message) {
  write(Level::warn, category, message);
}
inline void info(std::string_view category, std::string_view message) {
  write(Level::info, category, message);
}
inline void debug(std::string_view category, std::string_view message) {
  write(Level::debug, category, message);
}

// Lines suppressed by the rate limit since start (all categories), for tests and stats.
unsigned long long suppressed();

}  // namespace pskv::log
