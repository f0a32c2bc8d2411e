// A whole cluster in one actor_system: a router plus N prefill and M decode
// workers, each worker with its own detached compute actor and engine, and
// optionally colocated workers (a prefill and a decode worker on one compute). For
// tests, in-process demos and benchmarks; a multi-node cluster is the same
// actors spawned on different nodes (they register with the router alike).
//
// What a multi-process cluster has and this one does not, and the tests
// that cover each there (tests/cluster/ unless named):
//   - no relay: the workers hold the router's handle itself, so nothing
//     re-registers them with a restarted router and their registration
//     names no cluster (the router accepts a worker of its own process as
//     its own); relay: NodeRelay.* (tests/actors), ClusterMembership.*;
//   - no prefill gate: no direct node connection is made before a job, and
//     the KV never crosses a node; MultiProcessCluster.KvBytesGoFromPrefill*,
//     ...OverDirectKvConnections;
//   - no port guard, TLS or serialization: messages move between actors
//     unencoded; PortGuard.*, ClusterTls.*, and Protocol.Messages*
//     (tests/actors) round-trips every message type;
//   - one scheduler for all the actors, where nodes have one each;
//   - tokens streamed to a client (direct-token-streams) arrive in the
//     client's mailbox at once; across nodes CAF routes them through the
//     router's node: HttpFrontend.HealthThenCompletionsAndChatEqual* checks
//     that none had to come with the outcome instead.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "actors/config.h"
#include "kv/plane.h"
#include "caf/actor_system.hpp"
#include "messages/interfaces.h"

namespace disagg {

struct LocalClusterOptions {
  DisaggConfig config;  // model, tokenizer (optional), backend, worker counts, ...
  // Per-worker checkpoint overrides (index i: worker i; empty or missing: config.model).
  std::vector<std::string> prefill_models;
  std::vector<std::string> decode_models;
  // Colocated workers (node role `worker`), besides config's prefill and
  // decode workers: each one compute actor and pool shared by a prefill and
  // a decode worker of unit "worker-<i>", which prefill_workers() and
  // decode_workers() list after the disaggregated ones.
  int colocated_workers = 0;
  // The disaggregated prefill workers' kv-transport when not config's (empty):
  // a mixed cluster, as nodes configured apart may be ("message" beside
  // decode workers that stream).
  std::string prefill_kv_transport;
  std::chrono::milliseconds ready_timeout{30000};
};

class LocalCluster {
 public:
  // Validates the config, loads the models, spawns everything and waits until
  // every worker has registered with the router. Throws gpu::Error on a bad
  // config, a model that fails to load, or workers that never register.
  LocalCluster(caf::actor_system& system, LocalClusterOptions options);
  // stop()
  ~LocalCluster();
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  const router_actor& router() const { return router_; }
  const std::vector<prefill_actor>& prefill_workers() const { return prefill_; }
  const std::vector<decode_actor>& decode_workers() const { return decode_; }
  const DisaggConfig& config() const { return options_.config; }
  // The process's KV data plane (null with kv-transport message).
  const std::shared_ptr<kv::KvPlane>& kv_plane() const { return plane_; }

  // Each decode worker's load (asked directly), in worker order; a worker
  // that does not answer in time is missing from the result.
  std::vector<DecodeLoad> decode_loads(std::chrono::milliseconds timeout = std::chrono::seconds(5));
  // Waits until every decode pool has all its blocks free; false on timeout.
  bool wait_pools_free(std::chrono::milliseconds timeout = std::chrono::seconds(10));

  // Stops the router and the workers (their compute actors go with them).
  void stop();

 private:
  void wait_until_registered();

  caf::actor_system& system_;
  LocalClusterOptions options_;
  std::shared_ptr<kv::KvPlane> plane_;
  router_actor router_;
  std::vector<prefill_actor> prefill_;
  std::vector<decode_actor> decode_;
};

}  // namespace disagg
