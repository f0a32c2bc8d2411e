// How a worker process joins a remote router without changing the worker
// actors: they are spawned with a local *relay* in place of the router handle.
// The relay passes every message on to the real router unchanged (delegated,
// so the router still sees the worker as sender) except the registration,
// which it completes for the multi-process cluster and owns from then on:
//   - it registers the worker with the node's cluster name (RelaySpec::cluster);
//   - it answers the worker at once and registers it with the router as soon
//     as the node has reached one (set_relay_router), and again with every
//     new router after the old one went away; a registration the router
//     refuses or does not answer is retried with backoff (register_retry);
//   decode:  WorkerInfo::endpoint = this node's own listening "host:port",
//            where prefill nodes connect to ship KV (set_relay_endpoint);
//   prefill: the handle registered is a *gate* in front of the prefill actor.
//            Before a job reaches the prefill actor, the gate makes sure this
//            node has its own middleman connection to the decode worker's node
//            (it learns the decode endpoints from the router's status and
//            connects to each), so CAF's BASP sends the KV straight there: its
//            routing table prefers a direct connection over the indirect route
//            through the router's node. A job whose decode node cannot be
//            reached directly fails (internal) rather than travel via the
//            router. The gate also refreshes the endpoints every
//            node.peer-refresh-ms, so new decode nodes are dialled ahead of
//            their first job.
#pragma once
#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "caf/actor_system.hpp"
#include "actors/config.h"
#include "messages/interfaces.h"

namespace disagg {

struct RelaySpec {
  std::string cluster;     // WorkerInfo::cluster of the registration (disagg.cluster)
  std::string ready_file;  // rewritten with the worker's name on each registration (may be empty)
  // Registrations (of relays sharing the counter) still to come before the
  // ready file is written: a colocated worker's prefill and decode worker
  // each register through a relay of their own, and the node is ready once
  // both are in. Null: at the first.
  std::shared_ptr<std::atomic<int>> ready_after;
  // A registration's deadline: a worker -> router call, so the compute
  // timeout's (DisaggConfig::compute_timeout_ms, which a node sets here).
  std::chrono::milliseconds register_timeout{DisaggConfig{}.compute_timeout_ms};
  // A registration the router refused or did not answer is tried again after
  // this delay, doubling up to register_retry_max, while that router is alive.
  std::chrono::milliseconds register_retry{100};
  std::chrono::milliseconds register_retry_max{2000};
  // A name the router says another worker holds is asked for again, as a
  // registration that was not answered, for this long from the first such
  // answer before the node gives up: the holder may be this worker's earlier
  // run, gone, which the router notices only once its connection ends (at
  // the latest its middleman's connection timeout after the last heartbeat).
  std::chrono::milliseconds name_held_wait{kMiddlemanConnectionTimeout + kMiddlemanHeartbeat};
  std::chrono::milliseconds peer_refresh{1000};  // prefill gate
};

// A relay without a router yet; registrations wait for set_relay_router (and,
// for a decode worker, set_relay_endpoint). It links itself to the worker
// that registers through it, so they stop together (node_runtime links them
// as soon as the worker is spawned, for a worker that stops before that).
router_actor spawn_router_relay(caf::actor_system& system, RelaySpec spec);

// The router the relay passes messages to; (re-)registers its worker there.
void set_relay_router(const router_actor& relay, const router_actor& router);

// The "host:port" a decode worker registers with.
void set_relay_endpoint(const router_actor& relay, const std::string& endpoint);

// Writes `content` to `path` atomically (temp file + rename); false on failure.
bool write_ready_file(const std::string& path, const std::string& content);

}  // namespace disagg
