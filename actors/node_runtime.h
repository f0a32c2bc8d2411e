// One process of a multi-process cluster (disagg-node): loads its options
// (actors/node_config.h) and runs its role until SIGINT/SIGTERM.
//   router   spawns the router and publishes it on node.host:node.port.
//   prefill  connects to the router (retrying with backoff while it is not up
//            yet), spawns compute + prefill worker; registers through a relay
//            (actors/node_relay.h) whose gate dials decode nodes directly.
//   decode   publishes its decode worker on node.host:node.port (prefill nodes
//            connect there: KV never crosses the router's node), connects to
//            the router and registers with that endpoint.
// A worker that loses its router drops its worker actors and joins again once
// the router is back (within node.connect-timeout-ms).
#pragma once

namespace disagg {

// The whole program: exit code 0 after a clean stop (or --help), 2 for a bad
// configuration (every problem printed as "disagg-node: error: ..."), 1 when
// the node cannot start or fails while running.
int node_main(int argc, char** argv);

}  // namespace disagg
