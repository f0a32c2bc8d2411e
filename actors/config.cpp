#include "actors/config.h"

#include "gpu/kv_layout.h"
#include "messages/registration.h"
#include "messages/request.h"

namespace disagg {

std::string DisaggConfig::validate() const {
  std::string problems;
  auto require = [&](bool ok, const std::string& what) {
    if (ok) return;
    if (!problems.empty()) problems += "; ";
    problems += what;
  };
  const bool cluster_ok = !cluster.empty() && cluster.size() <= 64 &&
                          cluster.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                    "0123456789._-") == std::string::npos;
  require(cluster_ok, "cluster must be 1-64 characters of A-Z a-z 0-9 . _ - (got '" + cluster + "')");
  require(backend == "auto" || backend == "cpu" || backend == "cuda",
          "backend must be auto, cpu or cuda (got '" + backend + "')");
  require(prefill_workers >= 0, "prefill-workers must be >= 0");
  require(decode_workers >= 0, "decode-workers must be >= 0");
  require(max_kv_transfer_bytes > 0, "max-kv-transfer-bytes must be > 0");
  // (Each timeout at most a request's longest deadline: a reservation's
  // lease, its deadline plus ack-timeout-ms, stays within kMaxLeaseMs.)
  const std::string day = ", " + std::to_string(kMaxDeadlineMs) + "] (24 h)";
  require(ack_timeout_ms > 0 && ack_timeout_ms <= kMaxDeadlineMs, "ack-timeout-ms must be in [1" + day);
  require(kv_transport == "tcp" || kv_transport == "shm" || kv_transport == "message",
          "kv-transport must be tcp, shm or message (got '" + kv_transport + "')");
  require(block_size >= 1 && block_size % gpu::kv_layout::kTile == 0,
          "block-size must be a positive multiple of " + std::to_string(gpu::kv_layout::kTile) +
              " (whole key tiles, gpu/kv_layout.h)");
  require(pool_blocks >= 1, "pool-blocks must be >= 1");
  require(prefill_cache_blocks >= 0, "prefill-cache-blocks must be >= 0");
  require(local_prefill_tokens >= 0, "local-prefill-tokens must be >= 0");
  require(kv_routing_prefill_weight >= 0, "kv-routing-prefill-weight must be >= 0");
  require(max_batch >= 1, "max-batch must be >= 1");
  gpu::SpeculationMethod method;
  require(gpu::parse_speculation_method(speculation, method),
          "speculation must be off, ngram or draft (got '" + speculation + "')");
  require(speculation != "draft" || !draft_model.empty(), "speculation draft needs a draft-model");
  require(num_speculative_tokens >= 1 && num_speculative_tokens <= gpu::kMaxSpeculativeTokens,
          "num-speculative-tokens must be in [1, " + std::to_string(gpu::kMaxSpeculativeTokens) + "]");
  require(prompt_lookup_max >= 1 && prompt_lookup_max <= gpu::kMaxLookupTokens,
          "prompt-lookup-max must be in [1, " + std::to_string(gpu::kMaxLookupTokens) + "]");
  require(prompt_lookup_min >= 1 && prompt_lookup_min <= prompt_lookup_max,
          "prompt-lookup-min must be in [1, prompt-lookup-max]");
  require(prefill_chunk >= 0, "prefill-chunk must be >= 0");
  require(queue_capacity >= 0, "queue-capacity must be >= 0");
  require(max_prefill_inflight >= 1, "max-prefill-inflight must be >= 1");
  require(default_deadline_ms > 0 && default_deadline_ms <= kMaxDeadlineMs, "default-deadline-ms must be in [1" + day);
  require(max_prompt_bytes >= 1, "max-prompt-bytes must be >= 1");
  require(session_affinity_size >= 0, "session-affinity-size must be >= 0");
  require(max_decode_retries >= 0, "max-decode-retries must be >= 0");
  require(max_worker_retries >= 0, "max-worker-retries must be >= 0");
  require(heartbeat_interval_ms >= 0 && heartbeat_interval_ms <= kMaxDeadlineMs,
          "heartbeat-interval-ms must be in [0" + day);
  require(heartbeat_timeout_ms > 0 && heartbeat_timeout_ms <= kMaxDeadlineMs,
          "heartbeat-timeout-ms must be in [1" + day);
  require(compute_timeout_ms > 0 && compute_timeout_ms <= kMaxDeadlineMs, "compute-timeout-ms must be in [1" + day);
  return problems;
}

gpu::SpeculationParams DisaggConfig::speculation_params() const {
  gpu::SpeculationParams p;
  if (!gpu::parse_speculation_method(speculation, p.method)) p.method = gpu::SpeculationMethod::off;
  p.num_tokens = num_speculative_tokens;
  p.lookup_min = prompt_lookup_min;
  p.lookup_max = prompt_lookup_max;
  return p;
}

void add_disagg_options(caf::config_option_set& options, DisaggConfig& c) {
  OptionAdder{options, "disagg"}
      .add(c.cluster, "cluster", "the cluster's name; the router refuses workers of another")
      .add(c.model, "model", "model file: GGUF, llama2.c checkpoint or Hugging Face directory")
      .add(c.tokenizer, "tokenizer", "tokenizer path (text prompts and token text; workers: structured output)")
      .add(c.backend, "backend", "compute backend: auto, cpu or cuda")
      .add(c.weight_cache, "weight-cache",
           "packed weights in a file every process of the host maps (one copy, no re-lay at restart): off, "
           "model (beside the model file) or a folder")
      .add(c.prefill_workers, "prefill-workers", "prefill workers of a local cluster")
      .add(c.decode_workers, "decode-workers", "decode workers of a local cluster")
      .add(c.max_kv_transfer_bytes, "max-kv-transfer-bytes", "largest KV a prefill worker ships (larger: kv_too_large)")
      .add(c.ack_timeout_ms, "ack-timeout-ms", "how long a prefill worker waits for the KV ack")
      .add(c.kv_transport, "kv-transport",
           "KV from prefill to decode: tcp (UCX stream), shm (UCX stream, shared memory on one host; see README), "
           "message (one CAF message)")
      .add(c.kv_host, "kv-host", "address a decode node's KV receivers listen on (default: the node's own address)")
      .add(c.block_size, "block-size", "positions per KV block of the decode pool")
      .add(c.pool_blocks, "pool-blocks", "KV blocks per decode worker")
      .add(c.max_batch, "max-batch", "sequences per decode step")
      .add(c.speculation, "speculation",
           "speculative decoding at a decode worker, exact (no token changes): off, ngram (prompt lookup) or "
           "draft (draft-model); a request may choose its own")
      .add(c.draft_model, "draft-model",
           "a decode worker's draft model for speculation draft: a smaller model file with the same vocabulary")
      .add(c.num_speculative_tokens, "num-speculative-tokens", "guesses a speculative step feeds per sequence, at most")
      .add(c.prompt_lookup_min, "prompt-lookup-min", "shortest n-gram the ngram proposer matches")
      .add(c.prompt_lookup_max, "prompt-lookup-max", "longest n-gram the ngram proposer matches")
      .add(c.prefix_caching, "prefix-caching",
           "decode workers keep finished sequences' KV blocks and share them with prompts that start alike; "
           "prefill workers keep recent prompts' (prefill-cache-blocks)")
      .add(c.prefill_cache_blocks, "prefill-cache-blocks",
           "KV blocks (of block-size positions) of a prefill worker's prefix cache (0: none)")
      .add(c.prefill_chunk, "prefill-chunk",
           "a colocated worker's prompt positions per turn between decode steps (0: the whole prompt)")
      .add(c.local_prefill_tokens, "local-prefill-tokens",
           "a decode worker prefills a prompt itself when at most this many positions are left after its "
           "prefix cache's (0: never)")
      .add(c.kv_routing_prefill_weight, "kv-routing-prefill-weight",
           "weight of the prompt blocks a decode worker's prefix cache lacks in the router's choice (0: ignore)")
      .add(c.direct_token_streams, "direct-token-streams",
           "tokens go from the decode worker to the client (false: through the router)")
      .add(c.queue_capacity, "queue-capacity", "requests the router holds before dispatch (more: overloaded)")
      .add(c.max_prefill_inflight, "max-prefill-inflight", "jobs per prefill worker at once")
      .add(c.default_deadline_ms, "default-deadline-ms", "deadline of a request that sets none")
      .add(c.max_prompt_bytes, "max-prompt-bytes", "longest text prompt the router encodes (longer: invalid_request)")
      .add(c.session_affinity_size, "session-affinity-size", "sessions the router remembers")
      .add(c.max_decode_retries, "max-decode-retries", "reservations tried again after an unanswered one")
      .add(c.max_worker_retries, "max-worker-retries",
           "restarts of a request that has no token yet when a worker is lost or stops answering")
      .add(c.heartbeat_interval_ms, "heartbeat-interval-ms", "how often the router checks every worker (0: never)")
      .add(c.heartbeat_timeout_ms, "heartbeat-timeout-ms",
           "a worker silent this long gets no new work until it answers")
      .add(c.compute_timeout_ms, "compute-timeout-ms", "deadline of every call to a compute actor");
}

void prefer_sharing_scheduler(caf::actor_system_config& config) {
  config.set("scheduler.policy", caf::atom("sharing"));
}

void watch_connections(caf::actor_system_config& config) {
  config.set("middleman.heartbeat-interval", caf::timespan{kMiddlemanHeartbeat});
  config.set("middleman.connection-timeout", caf::timespan{kMiddlemanConnectionTimeout});
}

DisaggSystemConfig::DisaggSystemConfig() {
  register_messages(*this);
  prefer_sharing_scheduler(*this);
  watch_connections(*this);
  add_disagg_options(custom_options_, disagg);
}

}  // namespace disagg
