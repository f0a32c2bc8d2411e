// The prefill worker: takes a PrefillJob from the router, has its compute
// actor run the prompt, ships the KV to the decode worker the router chose,
// waits for the ack (with a deadline) and reports to the router. Many jobs
// may be in flight; each is keyed by its request id.
#pragma once
#include <string>

#include "actors/config.h"
#include "caf/actor_system.hpp"
#include "messages/interfaces.h"

namespace disagg {

// The worker links itself to `compute` (one goes down, both do), asks it for
// its model and registers with `router` under `name`. `colocated`: the unit
// name of a colocated worker (WorkerInfo::colocated), whose decode worker
// shares `compute`; empty for a disaggregated prefill worker. A decode
// worker's own prefill worker (conditional disaggregation) does not
// register: `join_router` false; the decode worker hands it its jobs.
prefill_actor spawn_prefill(caf::actor_system& system, const DisaggConfig& config,
                            compute_actor compute, router_actor router, std::string name,
                            std::string colocated = {}, bool join_router = true);

}  // namespace disagg
