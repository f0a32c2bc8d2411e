// The compute actor: owns one gpu::Engine (and, for a decode worker, the KV
// pool storage) and answers messages/interfaces.h compute_actor. It runs
// detached (its own thread), so a long prefill or decode step never holds up
// the scheduler threads that the router and the workers run on.
#pragma once
#include <memory>

#include "caf/actor_system.hpp"
#include "gpu/checkpoint.h"
#include "gpu/engine.h"
#include "messages/interfaces.h"

namespace disagg {

struct ComputeSpec {
  std::shared_ptr<const gpu::Checkpoint> checkpoint;
  gpu::EngineOptions engine;
  int pool_block_size = 16;
  int pool_blocks = 0;  // 0: no KV pool (a prefill worker's compute)
};

// Builds the engine and pool here, so a load or backend failure throws
// gpu::Error in the caller; then spawns the detached actor that owns them.
compute_actor spawn_compute(caf::actor_system& system, const ComputeSpec& spec);

ModelInfo model_info(const gpu::Engine& engine);
// The same from a checkpoint alone (no engine, no backend): what the router
// knows of the cluster's model.
ModelInfo model_info(const gpu::Checkpoint& checkpoint);

// What the compute actors of this process did with the prompts they were
// given, since the process started: computed, or skipped because the request
// was cancelled or past its deadline before its prefill began. (Counts for
// tests and diagnostics: they show that ended requests cost no compute.)
struct PrefillCounts {
  int64_t computed = 0;
  int64_t skipped_cancelled = 0;
  int64_t skipped_expired = 0;
};
PrefillCounts prefill_counts();

}  // namespace disagg
