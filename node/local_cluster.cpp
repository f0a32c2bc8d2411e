#include "node/local_cluster.h"

#include <map>
#include <thread>

#include "actors/compute.h"
#include "actors/decode.h"
#include "actors/prefill.h"
#include "actors/router.h"
#include "caf/all.hpp"
#include "model/checkpoint.h"
#include "gpu/error.h"
#include "text/tokenizer.h"

namespace disagg {

namespace {

// Workers on the same file share one mapped checkpoint.
class CheckpointCache {
 public:
  std::shared_ptr<const gpu::Checkpoint> get(const std::string& path) {
    auto& slot = cache_[path];
    if (!slot) slot = gpu::Checkpoint::open(path);
    return slot;
  }

 private:
  std::map<std::string, std::shared_ptr<const gpu::Checkpoint>> cache_;
};

const std::string& model_for(const std::vector<std::string>& overrides, size_t i,
                             const std::string& fallback) {
  return i < overrides.size() && !overrides[i].empty() ? overrides[i] : fallback;
}

// Every worker's compute actor, spawned before any other actor: an engine
// that cannot load throws, and the ones already spawned are stopped.
struct Engines {
  std::vector<compute_actor> prefill;
  std::vector<ComputeUnit> decode;
  std::vector<ComputeUnit> colocated;
  std::vector<std::shared_ptr<kv::LocalKvTargets>> local_targets;  // a colocated worker's, by index

  void stop() {
    for (auto& c : prefill) caf::anon_send_exit(c, caf::exit_reason::user_shutdown);
    for (auto& c : decode) caf::anon_send_exit(c.actor, caf::exit_reason::user_shutdown);
    for (auto& c : colocated) caf::anon_send_exit(c.actor, caf::exit_reason::user_shutdown);
  }
};

Engines spawn_engines(caf::actor_system& system, const LocalClusterOptions& options, CheckpointCache& checkpoints,
                      const std::shared_ptr<kv::KvPlane>& plane) {
  const DisaggConfig& cfg = options.config;
  gpu::EngineOptions engine;
  engine.backend = cfg.backend;
  engine.weight_cache = cfg.weight_cache;
  Engines e;
  try {
    for (int i = 0; i < cfg.prefill_workers; ++i) {
      ComputeSpec spec{checkpoints.get(model_for(options.prefill_models, size_t(i), cfg.model)), engine,
                       cfg.block_size, 0, plane};
      spec.prefix_cache_blocks = cfg.prefill_cache_blocks_in_use();
      spec.tokenizer = cfg.tokenizer;
      e.prefill.push_back(spawn_compute(system, spec));
    }
    for (int i = 0; i < cfg.decode_workers; ++i) {
      ComputeSpec spec{checkpoints.get(model_for(options.decode_models, size_t(i), cfg.model)), engine,
                       cfg.block_size, cfg.pool_blocks, plane};
      spec.prefill_chunk = cfg.prefill_chunk;  // its own prefills of short uncached rests
      spec.tokenizer = cfg.tokenizer;
      if (!cfg.draft_model.empty()) spec.draft = checkpoints.get(cfg.draft_model);
      e.decode.push_back(spawn_compute_unit(system, spec));
    }
    for (int i = 0; i < options.colocated_workers; ++i) {
      e.local_targets.push_back(std::make_shared<kv::LocalKvTargets>());
      ComputeSpec spec{checkpoints.get(cfg.model), engine, cfg.block_size, cfg.pool_blocks, nullptr};
      spec.local_targets = e.local_targets.back();
      spec.prefill_chunk = cfg.prefill_chunk;
      spec.tokenizer = cfg.tokenizer;
      if (!cfg.draft_model.empty()) spec.draft = checkpoints.get(cfg.draft_model);
      e.colocated.push_back(spawn_compute_unit(system, spec));
    }
  } catch (...) {
    e.stop();
    throw;
  }
  return e;
}

}  // namespace

LocalCluster::LocalCluster(caf::actor_system& system, LocalClusterOptions options)
    : system_(system), options_(std::move(options)) {
  const DisaggConfig& cfg = options_.config;
  if (auto problem = cfg.validate(); !problem.empty()) throw gpu::Error("disagg config: " + problem);
  if (cfg.model.empty()) throw gpu::Error("disagg config: no model");
  if (options_.colocated_workers < 0 ||
      (options_.colocated_workers == 0 && (cfg.prefill_workers == 0 || cfg.decode_workers == 0)))
    throw gpu::Error("local cluster: needs a prefill and a decode worker, or a colocated worker");

  CheckpointCache checkpoints;
  std::shared_ptr<const gpu::Tokenizer> tokenizer;
  if (!cfg.tokenizer.empty() || checkpoints.get(cfg.model)->vocabulary())
    tokenizer = std::make_shared<const gpu::Tokenizer>(gpu::load_tokenizer(*checkpoints.get(cfg.model), cfg.tokenizer));

  // The process's KV data plane: every decode worker's receivers, every
  // prefill worker's connections (in one process: the shared-memory path).
  if (cfg.kv_transport != "message") plane_ = make_kv_plane(cfg, true);
  const auto& plane = plane_;

  // Engines first (they throw on failure), then the actors.
  Engines engines = spawn_engines(system_, options_, checkpoints, plane);
  router_ = spawn_router(system_, cfg, tokenizer, model_info(*checkpoints.get(cfg.model)));
  DisaggConfig prefill_cfg = cfg;
  if (!options_.prefill_kv_transport.empty()) prefill_cfg.kv_transport = options_.prefill_kv_transport;
  for (int i = 0; i < cfg.prefill_workers; ++i)
    prefill_.push_back(spawn_prefill(system_, prefill_cfg, engines.prefill[size_t(i)], router_,
                                     "prefill-" + std::to_string(i)));
  for (int i = 0; i < cfg.decode_workers; ++i) {
    const ComputeUnit& c = engines.decode[size_t(i)];
    decode_.push_back(spawn_decode(system_, cfg, c.actor, router_, "decode-" + std::to_string(i),
                                   DecodeKv{c.pool, plane, c.local}));
  }
  for (int i = 0; i < options_.colocated_workers; ++i) {
    const std::string unit = "worker-" + std::to_string(i);
    const ComputeUnit& c = engines.colocated[size_t(i)];
    prefill_.push_back(spawn_prefill(system_, cfg, c.actor, router_, unit + "/prefill", unit));
    decode_.push_back(spawn_decode(system_, cfg, c.actor, router_, unit + "/decode",
                                   DecodeKv{c.pool, nullptr, engines.local_targets[size_t(i)], unit}));
  }
  wait_until_registered();
}

// Registration is asynchronous (worker -> compute -> router): the router's
// status is polled until every worker counts, or the ready timeout stops all.
void LocalCluster::wait_until_registered() {
  const auto deadline = std::chrono::steady_clock::now() + options_.ready_timeout;
  caf::scoped_actor self{system_};
  for (;;) {
    int prefill = -1, decode = -1;
    self->request(router_, std::chrono::seconds(5), status_atom::value)
        .receive(
            [&](RouterStatus& s) {
              prefill = s.count(WorkerRole::prefill);
              decode = s.count(WorkerRole::decode);
            },
            [&](caf::error&) {});
    if (prefill == int(prefill_.size()) && decode == int(decode_.size())) break;
    if (std::chrono::steady_clock::now() > deadline) {
      stop();
      throw gpu::Error("local cluster: only " + std::to_string(prefill) + " prefill and " +
                       std::to_string(decode) + " decode workers registered");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

LocalCluster::~LocalCluster() { stop(); }

std::vector<DecodeLoad> LocalCluster::decode_loads(std::chrono::milliseconds timeout) {
  std::vector<DecodeLoad> loads;
  caf::scoped_actor self{system_};
  for (const auto& d : decode_)
    self->request(d, timeout, status_atom::value)
        .receive([&](DecodeLoad& load) { loads.push_back(load); }, [&](caf::error&) {});
  return loads;
}

bool LocalCluster::wait_pools_free(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto loads = decode_loads();
    bool all_free = loads.size() == decode_.size();
    for (const auto& l : loads) all_free = all_free && l.free_blocks == l.total_blocks && l.active_sequences == 0;
    if (all_free) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void LocalCluster::stop() {
  // Workers are linked to their compute actors, which therefore stop too.
  for (auto& p : prefill_) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
  for (auto& d : decode_) caf::anon_send_exit(d, caf::exit_reason::user_shutdown);
  if (router_) caf::anon_send_exit(router_, caf::exit_reason::user_shutdown);
  prefill_.clear();
  decode_.clear();
  router_ = router_actor{};
}

}  // namespace disagg
