// The decode worker: reserves a request's blocks (prompt + max_new_tokens
// positions) when the router asks, before any prefill work, with a lease;
// admits the request's KV from any prefill worker into them, acks, and
// decodes all admitted sequences with continuous batching: one step
// in flight at its compute actor, every active sequence (up to max_batch) in
// each step, newcomers joining the next one. Each token is streamed to the
// router as soon as it exists; blocks are freed at finish, cancel or error.
#pragma once
#include <string>

#include <memory>

#include "actors/config.h"
#include "caf/actor_system.hpp"
#include "engine/kv_cache.h"
#include "kv/local.h"
#include "kv/plane.h"
#include "messages/interfaces.h"

namespace disagg {

// What a decode worker needs to take streamed KV: its compute actor's pool
// (ComputeUnit::pool), into whose reserved blocks the process's KV receiver
// writes. Without both it only takes KV as one message.
struct DecodeKv {
  std::shared_ptr<gpu::KvPool> pool;
  std::shared_ptr<kv::KvPlane> plane;  // must be receiving()
  // A colocated worker: its prefill worker shares the compute actor (and its
  // ComputeSpec::local_targets are these), so its KV is copied into the
  // blocks by the compute itself (kv/local.h); `colocated` names the unit
  // (WorkerInfo::colocated). The router pairs this worker with no other.
  std::shared_ptr<kv::LocalKvTargets> local;
  std::string colocated;
  // Its node's port guard limit (KvTarget::max_message_bytes); 0: none.
  int64_t max_message_bytes = 0;
};

// `compute` must own a KV pool of config.block_size x config.pool_blocks
// (actors/compute.h). The worker links itself to `compute`, asks it for its
// model and registers with `router` under `name`.
decode_actor spawn_decode(caf::actor_system& system, const DisaggConfig& config,
                          compute_actor compute, router_actor router, std::string name,
                          DecodeKv kv = {});

}  // namespace disagg
