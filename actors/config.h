// The one configuration of a disagg cluster: defaults, validation, and the
// binding to CAF config options (group "disagg", from INI files or the CLI,
// e.g. --disagg.block-size=32).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include "caf/actor_system_config.hpp"
#include "caf/config_option_adder.hpp"
#include "caf/deep_to_string.hpp"
#include "engine/engine.h"
#include "engine/speculation.h"
#include "messages/request.h"

namespace disagg {

struct DisaggConfig {
  // The cluster's name: a worker registers with it, and the router refuses a
  // worker of another cluster (e.g. a second cluster started on the same
  // hosts whose nodes dial the first one's router by mistake).
  std::string cluster = "disagg";

  // Model and compute.
  std::string model;              // llama2.c checkpoint path
  std::string tokenizer;          // optional: text prompts and token text at the router
  std::string backend = "auto";   // auto | cpu | cuda
  std::string weight_cache = "off";  // off | model | a folder (gpu::EngineOptions::weight_cache)

  // Topology of a local (in-process) cluster.
  int prefill_workers = 1;
  int decode_workers = 1;

  // Prefill worker.
  int64_t max_kv_transfer_bytes = int64_t{256} << 20;  // larger KV: kv_too_large
  int64_t ack_timeout_ms = 10000;  // KV sent -> decode's ack

  // KV data plane (kv/plane.h). How prefill ships KV to decode:
  //   tcp:     streamed over UCX's TCP transport while the prefill runs (the
  //            default; between hosts and on one);
  //   shm:     the same, over shared memory (posix + CMA) when both workers
  //            are on one host, TCP otherwise. Faster on one host, but UCX
  //            1.13's CMA aborts the receiving process when the sending one
  //            dies mid-stream (README, KV data plane): opt in knowingly;
  //   message: one CAF message after the prefill (the earlier path, kept for
  //            comparison).
  // The decode worker decides (it registers the memory); a prefill worker
  // set to message sends a message whatever the decode worker offers.
  std::string kv_transport = "tcp";
  // Whether this node takes part in shared-memory KV (kv-transport shm): its
  // plane has the transport, and a prefill worker tells its host's identity
  // (without it, a decode worker set to shm picked shm for a prefill node
  // that could not send it, and every transfer between them failed).
  bool kv_shared_memory() const { return kv_transport == "shm"; }
  // Address a decode node's KV receivers listen on (reachable by the prefill
  // nodes, and by nothing else: UCX authenticates no one). Empty: the node's
  // own (node.host; node.advertise-host when node.host is a wildcard; the
  // node fills it in), or 127.0.0.1 where there is no node (in-process).
  std::string kv_host;

  // Decode worker.
  int block_size = gpu::kDefaultBlockSize;  // positions per KV block
  int pool_blocks = 1024;  // KV pool capacity in blocks
  int max_batch = 64;      // sequences per decode step
  // Speculative decoding (engine/speculation.h): each decode step feeds up
  // to num-speculative-tokens guesses after a sequence's last token and keeps
  // the tokens plain decoding makes, so no token changes; a step that guesses
  // right makes several. off, or ngram (the tokens that followed the last
  // prompt-lookup-min..max tokens where they occurred before, in the prompt or
  // the output), or draft (draft-model's greedy guesses). A request may choose
  // its own (its speculation field).
  std::string speculation = "off";
  // A decode worker's draft model (engine/draft.h): a smaller model file with
  // the model's vocabulary; its KV in a pool of pool-blocks blocks of its own.
  // Empty: none, and no draft guesses.
  std::string draft_model;
  int num_speculative_tokens = 4;
  int prompt_lookup_min = 2;
  int prompt_lookup_max = 4;
  gpu::SpeculationParams speculation_params() const;
  // Prefix caching: a decode worker keeps the KV of finished sequences' full
  // blocks (engine/kv_cache.h BlockPool) and a prompt that starts with them
  // shares them instead of having them computed and sent again.
  bool prefix_caching = true;
  // Prefill worker: its own prefix cache (engine/prefix_cache.h), this many
  // blocks of block-size positions: a prompt whose start it holds computes
  // only the rest. Used when prefix-caching is on.
  int prefill_cache_blocks = 1024;
  int prefill_cache_blocks_in_use() const { return prefix_caching ? prefill_cache_blocks : 0; }

  // Colocated worker (node role `worker`): prompt positions computed per
  // turn of its compute, with the decode steps of its running sequences
  // between turns (chunked prefill, as vLLM and llama.cpp's server do). Small:
  // running sequences wait less for their next token, the prompt's first
  // token comes later and the prompt costs more (every chunk reads all the
  // weights). 0: the whole prompt in one turn. The default, the engine's own
  // forward size, costs nothing over whole prompts and holds a decode step
  // for at most one forward of it.
  int prefill_chunk = gpu::kPrefillRows;

  // Router.
  // Conditional disaggregation: a prompt with at most this many positions
  // left to compute (after its decode worker's cached prefix, or all of it
  // when nothing is cached) is prefilled by that decode worker itself (no
  // prefill worker, no KV transfer). 0: always a prefill worker. 256 takes
  // a chat turn's rest and short prompts, and keeps longer prompts off the
  // decode worker (the measurements that chose it: README, "Prefix caching").
  int local_prefill_tokens = 256;
  // KV-aware routing: a decode worker's score is this x the prompt's blocks
  // its prefix cache lacks (the router's index of the workers' KV events),
  // minus its free blocks; the lowest wins (README "Prefix caching").
  // A prefill worker's score: its queued prompt tokens plus those of this
  // prompt its own cache lacks. 0: blocks are not looked at (the most free
  // blocks and the fewest queued tokens win, nothing predicted). 2: the
  // best of bench/prefix.sh's shared-prefix run (README, "Prefix caching").
  double kv_routing_prefill_weight = 2.0;
  // Tokens from the decode worker straight to the request's client (the
  // router records them and keeps control: placement, cancel, deadline, the
  // outcome, migration), as Dynamo's frontends receive workers' streams.
  // false: the router forwards every token. A request whose text the router
  // adds (GenerateRequest::token_text, a router with a tokenizer) goes
  // through the router either way (measured: README, "The router at scale").
  bool direct_token_streams = true;
  int queue_capacity = 256;          // accepted requests waiting for dispatch
  int max_prefill_inflight = 8;      // jobs per prefill worker at once
  int64_t default_deadline_ms = kDefaultDeadlineMs;  // at most kMaxDeadlineMs (messages/request.h)
  // Longest text prompt the router encodes; longer: invalid_request, before
  // any encoding. Encoding runs on the router's own thread and is linear in
  // the length (text/merge_queue.h): 64 KiB take 2-14 ms on the 2-core dev VM
  // (bench_tokenizer, either tokenizer model), so 256 KiB hold it at most
  // ~55 ms; 256 KiB is ~65K Llama 3 tokens.
  int64_t max_prompt_bytes = 256 * 1024;
  int session_affinity_size = 4096;  // sessions remembered (least recently used evicted)
  int max_decode_retries = 2;        // reservations tried again after an unanswered one
  int max_worker_retries = 2;        // restarts of a request before its first token when a worker is lost or hung
  int64_t heartbeat_interval_ms = 1000;  // the router asks every worker whether it is alive (0: never)
  int64_t heartbeat_timeout_ms = 3000;   // ... and gives it no work while it has not answered in this time

  // Every worker -> compute call.
  int64_t compute_timeout_ms = 60000;

  // Empty when usable, else every problem found, separated by "; ".
  std::string validate() const;
};

// caf::config_option_adder whose help texts end with each field's default,
// its value when it is registered (so the default is written once, in the
// struct): "help (default 16)", strings quoted. add_computed: a default the
// code derives, which the help text itself describes.
class OptionAdder {
 public:
  OptionAdder(caf::config_option_set& options, caf::string_view category) : adder_(options, category) {}
  template <class T>
  OptionAdder& add(T& field, caf::string_view name, const char* help) {
    adder_.add(field, name, std::string(help) + " (default " + caf::deep_to_string(field) + ")");
    return *this;
  }
  template <class T>
  OptionAdder& add_computed(T& field, caf::string_view name, const char* help) {
    adder_.add(field, name, help);
    return *this;
  }

 private:
  caf::config_option_adder adder_;
};

// Registers the fields of `config` as options of group "disagg" in `options`
// (CAF writes parsed values straight into the fields, so `config` must outlive
// the parse).
void add_disagg_options(caf::config_option_set& options, DisaggConfig& config);

// Makes `scheduler.policy` default to 'sharing' (a config file or the command
// line may still choose 'stealing'). CAF 0.17's work-stealing workers poll
// their queues and sleep up to 10 ms between polls when idle; every decode step
// hands its result from the detached compute thread back to a scheduled actor,
// so that polling would add to every token. Sharing wakes a worker at once.
void prefer_sharing_scheduler(caf::actor_system_config& config);

// Makes CAF's middleman watch every connection (a config file may still set
// them): each side sends a heartbeat every kMiddlemanHeartbeat, and a
// connection that has carried nothing for kMiddlemanConnectionTimeout is
// closed (`middleman.heartbeat-interval`, `middleman.connection-timeout`;
// CAF's default sends none and closes none). Without it a connection that
// a partition silenced while nothing was left to send stayed open for good:
// a worker whose handshake with the router was cut, once the router's
// kernel had given up the other end, joined every later try to that dead
// handshake (CAF joins a connect to one pending to the same address) and
// had not registered 20 s after the heal (README, "Tested across hosts";
// test_cluster Partitions.AWorkerWhoseHandshakeWasSilenced...).
constexpr std::chrono::seconds kMiddlemanHeartbeat{5};
constexpr std::chrono::seconds kMiddlemanConnectionTimeout{30};
void watch_connections(caf::actor_system_config& config);

// An actor_system_config with all protocol messages registered, the sharing
// scheduler, connections watched, and the "disagg" options bound to `disagg`.
class DisaggSystemConfig : public caf::actor_system_config {
 public:
  DisaggSystemConfig();
  DisaggConfig disagg;
};

}  // namespace disagg
