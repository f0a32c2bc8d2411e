// The metrics of a disagg node, one set per process (every role registers
// all of them; each role moves the ones it measures, see README "Metrics").
// Names follow vLLM's meaning and histogram buckets where the meaning is the
// same, with the prefix disagg_ instead of vLLM's "vllm:" (colons are for
// Prometheus recording rules and fail `promtool check metrics`).
#pragma once
#include <array>
#include <string>

#include "metrics/metrics.h"

namespace disagg::metrics {

// Label values of request_errors_total{code}: the protocol's ErrorCode names
// (messages/request.h), in its order; index = the enum's value - 1.
inline constexpr std::array<const char*, 8> kErrorCodes = {
    "invalid_request", "overloaded", "kv_too_large", "incompatible_kv",
    "timeout",         "cancelled",  "worker_lost",  "internal"};

// vLLM's buckets (vllm/engine/metrics.py, v1/metrics/loggers.py).
std::vector<double> ttft_buckets();           // time_to_first_token_seconds
std::vector<double> inter_token_buckets();    // inter_token_latency_seconds (vLLM time_per_output_token)
std::vector<double> request_latency_buckets();  // e2e, queue, prefill, decode
std::vector<double> kv_transfer_buckets();    // ours: one prompt's KV, prefill -> decode

struct DisaggMetrics {
  explicit DisaggMetrics(Registry& registry);

  Histogram& time_to_first_token;   // seconds: request accepted -> first token
  Histogram& inter_token_latency;   // seconds between consecutive tokens of a request
  Histogram& e2e_request_latency;   // seconds: accepted -> terminal reply
  Histogram& request_queue_time;    // seconds waiting in the router's queue
  Histogram& request_prefill_time;  // seconds of prefill (the prefill worker's)
  Histogram& request_decode_time;   // seconds of decode (the decode worker's)
  Gauge& num_requests_running;      // router/frontend: in flight; decode: active sequences
  Gauge& num_requests_waiting;      // router: queued
  Gauge& kv_cache_usage_perc;       // decode: used / total KV blocks, 0..1
  Counter& prompt_tokens;
  Counter& generation_tokens;
  Counter& prefill_tokens;          // prefill: positions computed (a migration's streamed tokens included)
  Counter& decode_tokens;           // decode: tokens its sequences made, finished or not
  Family<Counter>& request_success;  // {finished_reason}: stop | length
  Family<Counter>& request_errors;   // {code}: kErrorCodes
  Histogram& kv_transfer;           // seconds
  Counter& kv_transfer_bytes;
  Counter& kv_pieces_sent;          // prefill: stream pieces handed to the KV data plane (each layer's, as it is computed)
  Counter& tokens_from_outcome;     // client: tokens no event brought, taken from the outcome (expected 0)
  // {role}: prompt tokens looked up in a prefix cache, and those found
  // (vLLM's prefix_cache_queries / prefix_cache_hits): role decode (its
  // pool) or prefill (its own cache, engine/prefix_cache.h).
  Family<Counter>& prefix_cache_queries;
  Family<Counter>& prefix_cache_hits;
  // {role}: KV blocks a prefix cache gave up to make room (the least
  // recently used first): a pool too small for the prefixes it is offered.
  Family<Counter>& prefix_cache_evictions;
  Counter& kv_bytes_not_sent;       // decode: KV a stream would have carried without the cache (or local prefill)
  Family<Gauge>& workers;           // {role}: prefill | decode registered at the router
  // {reason}: connections a node's port guard refused or closed (node/port_guard.h)
  Family<Counter>& connections_closed;

  // The labelled children, resolved once: no lock on the update path.
  Counter& success_stop;
  Counter& success_length;
  std::array<Counter*, kErrorCodes.size()> errors_by_code{};  // kErrorCodes' order
  Gauge& prefill_workers;
  Gauge& decode_workers;
  Counter& decode_prefix_cache_queries;
  Counter& decode_prefix_cache_hits;
  Counter& prefill_prefix_cache_queries;
  Counter& prefill_prefix_cache_hits;
  Counter& decode_prefix_cache_evictions;
  Counter& prefill_prefix_cache_evictions;
  // Speculative decoding (vLLM's spec_decode_* meanings): a sequence's step
  // with guesses, the guesses fed, those accepted; and decode steps' compute
  // time by kind: "plain", or "verify" (some sequence fed guesses).
  Counter& spec_decode_drafts;
  Counter& spec_decode_draft_tokens;
  Counter& spec_decode_accepted_tokens;
  Gauge& spec_decode_draft_sequences;  // sequences whose draft-model KV a compute holds
  Family<Histogram>& decode_step_seconds;
  Histogram& decode_step_plain;
  Histogram& decode_step_verify;

  // finished_reason "stop" or "length"; code one of kErrorCodes (else the
  // family's child for it is created, under its lock).
  Counter& success(const std::string& finished_reason);
  Counter& error(const std::string& code);
};

// The process's registry and its disagg metrics (created on first use, all
// label values of kErrorCodes, stop/length and prefill/decode included).
Registry& process_registry();
DisaggMetrics& disagg_metrics();

}  // namespace disagg::metrics
