// Membership and load: what a worker tells the router about itself when it
// registers, what a decode worker reports as its pool fills and drains, and
// what the router reports about the cluster.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "caf/meta/type_name.hpp"
#include "caf/sec.hpp"

namespace disagg {

enum class WorkerRole : uint8_t { prefill = 0, decode = 1 };
std::string to_string(WorkerRole role);

// The model a compute actor serves (from its gpu::Engine).
struct ModelInfo {
  uint64_t fingerprint = 0;  // gpu::Checkpoint::fingerprint: equal => interchangeable KV
  int32_t vocab_size = 0;
  int32_t seq_len = 0;
  int32_t n_layers = 0;
  int32_t n_kv_heads = 0;
  int32_t head_dim = 0;
  std::string backend;  // "cpu" or "cuda:<device>"
  std::vector<int32_t> end_tokens;  // gpu::ModelConfig::end_tokens: the ids that end a generation
};

// The router's refusals of a registration, as the error's code (its context
// says why): for good (another cluster, another model: trying again cannot
// help), or while another worker holds the name (it may be one that is gone
// and the router has not noticed yet: a worker restarted at once).
constexpr caf::sec kRegistrationRefused = caf::sec::invalid_argument;
constexpr caf::sec kRegistrationNameHeld = caf::sec::unavailable_or_would_block;

// Sent with the worker's typed handle in (register_atom, WorkerInfo, handle).
struct WorkerInfo {
  WorkerRole role = WorkerRole::prefill;
  std::string name;  // unique per cluster, e.g. "node1/decode-0"
  ModelInfo model;
  int32_t block_size = 0;    // positions per KV block (of a decode pool; of a prefill worker's prefix cache)
  int32_t total_blocks = 0;  // decode only: KV pool capacity in blocks
  int32_t cache_blocks = 0;  // prefill only: its prefix cache's capacity in blocks (0: none)
  // "host:port" where other nodes reach this worker's node directly (a decode
  // node's own listening port: prefill nodes ship KV there, not via the
  // router's node); empty for an in-process worker.
  std::string endpoint;
  // kv::host_identity() of the worker's process: a prefill and a decode
  // worker with equal ids stream KV through shared memory (kv/plane.h).
  // Empty from a prefill worker that does not send over shared memory.
  std::string host_id;
  // The cluster the worker's node belongs to (disagg.cluster), set by the
  // node's relay (node/relay.h); empty for an in-process worker.
  std::string cluster;
  // A colocated worker (node role `worker`): the name of the unit whose
  // prefill and decode worker share one compute actor. The router gives such
  // a decode worker only requests prefilled by the prefill worker of the same
  // unit, and that prefill worker only those. Empty: disaggregated.
  std::string colocated;
};

// A decode worker's load: sent to the router whenever it changes (admit,
// finish, cancel) and answered to (status_atom).
struct DecodeLoad {
  int32_t free_blocks = 0;
  int32_t total_blocks = 0;
  int32_t block_size = 0;
  int32_t active_sequences = 0;
  int32_t leases = 0;         // reservations whose lease runs (their KV not in yet)
  int32_t lease_wakeups = 0;  // timers pending for them (actors/deadlines.h: a few, whatever the rate)
};

// What a decode worker's prefix cache stored and evicted (gpu::BlockEvent),
// for the router's index of which worker holds which blocks (Dynamo's KV
// events). Numbered per worker: the router applies batch seq only after
// seq - 1 and asks for a snapshot (the reply to kv_events_atom: every hash
// the pool holds, `snapshot` set) when a number is skipped, when a batch
// does not fit the worker's pool, or after it restarted.
struct KvEvents {
  uint64_t seq = 0;     // this batch (a snapshot: the last batch it includes)
  bool snapshot = false;
  std::vector<uint64_t> stored;   // hashes (engine/block_hash.h) a block now holds
  std::vector<uint64_t> removed;  // hashes no block holds any more
};

// A prefill worker's load, answered to (status_atom).
struct PrefillLoad {
  int32_t in_flight = 0;       // jobs received and not yet reported
  int64_t queued_tokens = 0;   // prompt tokens of those jobs
};

// One worker as the router sees it.
struct WorkerStatus {
  std::string name;
  WorkerRole role = WorkerRole::prefill;
  uint64_t fingerprint = 0;
  int32_t in_flight = 0;            // prefill: jobs sent, not yet reported; decode: requests not finished
  int64_t outstanding_tokens = 0;   // prefill: prompt tokens not yet reported
  int32_t free_blocks = 0;          // decode: as last reported
  int32_t total_blocks = 0;         // decode
  int32_t active_sequences = 0;     // decode: as last reported
  // blocks the router's index says its prefix cache holds, from the
  // worker's own KV events (not counting predictions: PrefixIndex::held)
  int32_t cached_blocks = 0;
  std::string endpoint;             // WorkerInfo::endpoint
  // false while it leaves a heartbeat unanswered (no new work meanwhile)
  bool responsive = true;
};

// Answer of the router to (status_atom).
struct RouterStatus {
  std::vector<WorkerStatus> workers;
  int32_t queued = 0;     // accepted, waiting for a prefill slot or decode room
  int32_t in_flight = 0;  // dispatched, not yet finished
  int32_t deadline_wakeups = 0;  // the router's deadline timers pending (actors/router.cpp, Deadlines)

  int count(WorkerRole role) const {
    int n = 0;
    for (const auto& w : workers) n += w.role == role ? 1 : 0;
    return n;
  }
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, ModelInfo& x) {
  return f(caf::meta::type_name("ModelInfo"), x.fingerprint, x.vocab_size, x.seq_len, x.n_layers,
           x.n_kv_heads, x.head_dim, x.backend, x.end_tokens);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, WorkerInfo& x) {
  return f(caf::meta::type_name("WorkerInfo"), x.role, x.name, x.model, x.block_size,
           x.total_blocks, x.cache_blocks, x.endpoint, x.host_id, x.cluster, x.colocated);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, KvEvents& x) {
  return f(caf::meta::type_name("KvEvents"), x.seq, x.snapshot, x.stored, x.removed);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, DecodeLoad& x) {
  return f(caf::meta::type_name("DecodeLoad"), x.free_blocks, x.total_blocks, x.block_size,
           x.active_sequences, x.leases, x.lease_wakeups);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, PrefillLoad& x) {
  return f(caf::meta::type_name("PrefillLoad"), x.in_flight, x.queued_tokens);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, WorkerStatus& x) {
  return f(caf::meta::type_name("WorkerStatus"), x.name, x.role, x.fingerprint, x.in_flight,
           x.outstanding_tokens, x.free_blocks, x.total_blocks, x.active_sequences, x.cached_blocks,
           x.endpoint, x.responsive);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, RouterStatus& x) {
  return f(caf::meta::type_name("RouterStatus"), x.workers, x.queued, x.in_flight, x.deadline_wakeups);
}

}  // namespace disagg
