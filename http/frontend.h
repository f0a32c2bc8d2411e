// The frontend role of disagg-node: an OpenAI-compatible HTTP/1.1 API
// (Boost.Beast on its own io_context threads) in front of the router, which
// it reaches through the client library (actors/client.h) like any client.
// It encodes prompts and decodes tokens itself, so the router's single actor
// does neither for HTTP traffic.
//
//   POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (JSON or SSE stream)
//   GET  /v1/models, GET /health, GET /metrics
//
// Every accepted request gets exactly one reply: its outcome, or the
// client's deadline (disagg.default-deadline-ms plus a grace period). A
// client that disconnects cancels its request at the router.
#pragma once
#include "actors/config.h"
#include "node/config.h"
#include "caf/actor_system.hpp"

namespace disagg::http {

// The role's main(): serves until SIGINT/SIGTERM (exit code 0), 1 when it
// cannot start (model or tokenizer that does not load, port in use, or the
// router not reachable within node.connect-timeout-ms).
int run_frontend(caf::actor_system& system, const NodeOptions& node, const DisaggConfig& config);

}  // namespace disagg::http
