// The compute actor: owns one gpu::Engine (and, for a decode worker, the KV
// pool storage) and answers messages/interfaces.h compute_actor. It runs
// detached (its own thread), so a long prefill or decode step never holds up
// the scheduler threads that the router and the workers run on.
#pragma once
#include <memory>

#include "actors/config.h"
#include "caf/actor_system.hpp"
#include "model/checkpoint.h"
#include "engine/engine.h"
#include "engine/kv_cache.h"
#include "kv/local.h"
#include "kv/plane.h"
#include "messages/interfaces.h"

namespace disagg {

struct ComputeSpec {
  std::shared_ptr<const gpu::Checkpoint> checkpoint;
  gpu::EngineOptions engine;
  int pool_block_size = gpu::kDefaultBlockSize;
  int pool_blocks = 0;  // 0: no KV pool (a prefill worker's compute)
  // The process's KV data plane: a prefill compute streams KV through it
  // (PrefillWork::target). Null: it can only return KV serialized.
  std::shared_ptr<kv::KvPlane> kv_plane;
  // A colocated worker's compute (with a pool): the prompts of its own
  // prefill worker go straight into the blocks its decode worker registered
  // here (kv/local.h, KvTarget transport kLocalKvTransport).
  std::shared_ptr<kv::LocalKvTargets> local_targets;
  // ... computed this many positions per turn, decode steps between turns
  // (DisaggConfig::prefill_chunk; 0: the whole prompt in one turn).
  int prefill_chunk = 0;
  // A prefill worker's prefix cache (engine/prefix_cache.h): blocks of
  // pool_block_size positions; 0: none (DisaggConfig::prefill_cache_blocks_in_use).
  int prefix_cache_blocks = 0;
  // The tokenizer file constrained decoding reads the vocabulary's bytes
  // from (DisaggConfig::tokenizer); empty: the model file's own vocabulary.
  // Without either, a request with a grammar is refused (invalid_request).
  std::string tokenizer;
  // A decode worker's draft model (DisaggConfig::draft_model; null: none):
  // its engine and a pool of pool_blocks blocks for the sequences' draft KV.
  std::shared_ptr<const gpu::Checkpoint> draft;
};

// A compute actor and, on a decode worker, its pool: the decode actor lets
// its KV receiver write streamed pieces straight into the pool's reserved
// blocks. The pool keeps its engine alive, so the memory stays valid while
// any holder needs it.
struct ComputeUnit {
  compute_actor actor;
  std::shared_ptr<gpu::KvPool> pool;  // null without one
  // With a pool: where its decode worker registers blocks the compute fills
  // itself (ComputeSpec::local_targets, or new ones): a colocated unit's
  // prompts, and a decode worker's own prefills of short uncached rests.
  std::shared_ptr<kv::LocalKvTargets> local;
};

// Builds the engine and pool here, so a load or backend failure throws
// gpu::Error in the caller; then spawns the detached actor that owns them.
ComputeUnit spawn_compute_unit(caf::actor_system& system, const ComputeSpec& spec);
compute_actor spawn_compute(caf::actor_system& system, const ComputeSpec& spec);

// The process's KV data plane as `config` asks for it (kv-transport,
// kv-host); receivers only when `receive` (a decode worker lives here).
// Throws kv::KvError when UCX cannot make it.
std::shared_ptr<kv::KvPlane> make_kv_plane(const DisaggConfig& config, bool receive);

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
