// Vocabulary shared by the client and server APIs.
#pragma once

#include <chrono>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>

namespace pskv {

using Key = std::uint64_t;
using Ticket = std::uint64_t;

inline constexpr std::uint32_t kNoWorker = std::numeric_limits<std::uint32_t>::max();
// The most workers a server clocks (--workers): every peer's declared count is checked against it.
inline constexpr std::uint32_t kMaxWorkers = 1u << 20;

// How far a worker may run ahead of the slowest one before its pulls wait.
enum class ConsistencyMode : std::uint8_t {
  asp,   // no bound
  bsp,   // staleness 0
  ssp,   // bounded staleness s
  sync,  // aggregate-then-apply: the server applies the mean of K of N gradients once per step
};

std::string_view to_string(ConsistencyMode mode) noexcept;
std::optional<ConsistencyMode> parse_consistency_mode(std::string_view name) noexcept;

// What the job does when a worker stops advancing its clock for longer than the timeout.
enum class StragglerPolicy : std::uint8_t {
  fail,   // waiting pulls fail with an error naming the worker and its clock
  evict,  // the worker is removed from the minimum and the job goes on without it
};

enum class Partition : std::uint8_t { hash, range };

}  // namespace pskv
