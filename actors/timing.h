// The one clock of the actors' timings (queued, prefill, KV transfer, decode):
// steady, so durations measured on one machine never go backwards.
#pragma once
#include <chrono>
#include <cstdint>

namespace disagg {

using Clock = std::chrono::steady_clock;

inline int64_t micros_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration_cast<std::chrono::microseconds>(to - from).count();
}

inline int64_t micros_since(Clock::time_point start) { return micros_between(start, Clock::now()); }

}  // namespace disagg
