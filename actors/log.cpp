#include "actors/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace disagg {

namespace {

std::mutex& log_mutex() {
  static std::mutex m;
  return m;
}

std::string& log_name() {
  static std::string name = "node";
  return name;
}

std::atomic<int>& log_level() {
  static std::atomic<int> level{int(LogLevel::info)};
  return level;
}

}  // namespace

void set_node_log_name(const std::string& name) {
  std::lock_guard<std::mutex> lock(log_mutex());
  log_name() = name;
}

bool parse_log_level(const std::string& text, LogLevel* level) {
  if (text == "error") *level = LogLevel::error;
  else if (text == "warning") *level = LogLevel::warning;
  else if (text == "info") *level = LogLevel::info;
  else return false;
  return true;
}

void set_node_log_level(LogLevel level) { log_level() = int(level); }

void node_log(LogLevel level, const std::string& message) {
  if (int(level) > log_level().load()) return;
  const auto now = std::chrono::system_clock::now();
  const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
  const int millis = int(std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm local{};
  localtime_r(&seconds, &local);
  char stamp[32];
  std::snprintf(stamp, sizeof stamp, "%02d:%02d:%02d.%03d", local.tm_hour, local.tm_min, local.tm_sec, millis);
  std::lock_guard<std::mutex> lock(log_mutex());
  // One fprintf per line: lines of concurrent callers never interleave.
  std::fprintf(stderr, "%s [%s] %s\n", stamp, log_name().c_str(), message.c_str());
  std::fflush(stderr);
}

}  // namespace disagg
