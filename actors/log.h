// The log of a cluster node: one line per event on stderr, with the time and
// the node's identity, so the interleaved logs of a cluster stay readable.
// Safe to call from any thread (CAF's workers and the main thread).
#pragma once
#include <string>

namespace disagg {

// How much a node logs (option node.log-level): errors only (refused
// workers and connections, lost workers, nodes that cannot start), then
// warnings (failed requests, one line each with id and code), then info
// (registrations, listening, the default).
enum class LogLevel { error = 0, warning = 1, info = 2 };

// "error", "warning" or "info"; false for anything else.
bool parse_log_level(const std::string& text, LogLevel* level);

// "router", "decode@127.0.0.1:4611", ...; set once, before the actor system starts.
void set_node_log_name(const std::string& name);
void set_node_log_level(LogLevel level);

// Writes "HH:MM:SS.mmm [name] message" to stderr when `level` is logged.
void node_log(LogLevel level, const std::string& message);
inline void node_log(const std::string& message) { node_log(LogLevel::info, message); }

}  // namespace disagg
