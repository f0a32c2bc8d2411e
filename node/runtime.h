// One process of a multi-process cluster (disagg-node): loads its options
// (node/config.h) and runs its role until SIGINT/SIGTERM.
//   router   spawns the router and publishes it on node.host:node.port.
//   prefill  connects to the router (retrying with backoff while it is not up
//            yet), spawns compute + prefill worker; registers through a relay
//            (node/relay.h) whose gate dials decode nodes directly.
//   decode   publishes its decode worker on node.host:node.port (prefill nodes
//            connect there: KV never crosses the router's node), connects to
//            the router and registers with that endpoint.
// A worker that loses its router drops its worker actors and joins again once
// the router is back (within node.connect-timeout-ms).
//   frontend runs `frontend` (http/frontend.h: the OpenAI-compatible HTTP
//            API), which reaches the router with connect_to_router.
// Every role also serves GET /metrics on node.metrics-port when it is set.
#pragma once
#include <functional>
#include <optional>

#include "actors/config.h"
#include "node/config.h"
#include "messages/interfaces.h"

namespace disagg {

// Runs a role given from outside actors/ (the frontend lives in http/, which
// links the actors): its exit code.
using RoleRunner = std::function<int(caf::actor_system&, const NodeOptions&, const DisaggConfig&)>;

// Each connection is a file descriptor (the port guard's three per guarded
// connection, the frontend's keep-alive connections): every role raises its
// soft limit to the hard one at start (the soft one is often 1024).
void raise_open_files_limit();

// The whole program: exit code 0 after a clean stop (or --help), 2 for a bad
// configuration (every problem printed as "disagg-node: error: ..."), 1 when
// the node cannot start or fails while running. `frontend` runs role frontend
// (without it that role fails with exit code 2).
int node_main(int argc, char** argv, RoleRunner frontend = {});

// Whether SIGINT or SIGTERM has asked the node to stop.
bool node_stopping();

// Tries to reach the router at node.router-host:router-port until it answers,
// the node is told to stop, or node.connect-timeout-ms passes (nullopt then);
// the delay between tries doubles up to node.connect-backoff-max-ms.
std::optional<router_actor> connect_to_router(caf::actor_system& system, const NodeOptions& node);

}  // namespace disagg
