// The log of a cluster node: one line per event on stderr, with the time and
// the node's identity, so the interleaved logs of a cluster stay readable.
// Safe to call from any thread (CAF's workers and the main thread).
#pragma once
#include <string>

namespace disagg {

// "router", "decode@127.0.0.1:4611", ...; set once, before the actor system starts.
void set_node_log_name(const std::string& name);

// Writes "HH:MM:SS.mmm [name] message" to stderr.
void node_log(const std::string& message);

}  // namespace disagg
