// What the actors tell metrics/ (the disagg_ metrics of their process): one
// call per event, plain updates of atomics, so a handler never blocks on a
// metric. Which role moves which metric: README "Metrics".
#pragma once
#include <optional>

#include "actors/timing.h"
#include "messages/request.h"
#include "messages/transfer.h"
#include "messages/worker.h"
#include "metrics/disagg_metrics.h"

namespace disagg {

inline double seconds_of_micros(int64_t us) { return double(us) / 1e6; }

inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Router: a token of a request accepted at `accepted` (TTFT for the first,
// the gap since the previous one after it).
inline void record_token(Clock::time_point accepted, std::optional<Clock::time_point>& last_token) {
  auto& m = metrics::disagg_metrics();
  const auto now = Clock::now();
  if (last_token) m.inter_token_latency.observe(std::chrono::duration<double>(now - *last_token).count());
  else m.time_to_first_token.observe(std::chrono::duration<double>(now - accepted).count());
  last_token = now;
}

// Router: the terminal reply of an accepted request (`dispatched`: it left the queue).
inline void record_finished(const RequestOutcome& outcome, Clock::time_point accepted, bool dispatched) {
  auto& m = metrics::disagg_metrics();
  m.e2e_request_latency.observe(seconds_since(accepted));
  if (dispatched) m.request_queue_time.observe(seconds_of_micros(outcome.timings.queued_us));
  if (!outcome.ok()) {
    const size_t index = size_t(outcome.code) - 1;  // kErrorCodes follows ErrorCode, none excluded
    if (index < metrics::kErrorCodes.size()) m.errors_by_code[index]->inc();
    return;
  }
  m.request_prefill_time.observe(seconds_of_micros(outcome.timings.prefill_us));
  m.request_decode_time.observe(seconds_of_micros(outcome.timings.decode_us));
  m.prompt_tokens.inc(double(outcome.prompt_tokens.size()));
  m.generation_tokens.inc(double(outcome.tokens.size()));
  (outcome.finish == FinishReason::eos ? m.success_stop : m.success_length).inc();
}

// Router: its books after a change.
inline void record_router_books(size_t waiting, size_t running, int prefill_workers, int decode_workers) {
  auto& m = metrics::disagg_metrics();
  m.num_requests_waiting.set(double(waiting));
  m.num_requests_running.set(double(running));
  m.prefill_workers.set(prefill_workers);
  m.decode_workers.set(decode_workers);
}

// Prefill worker: a job's report (KV shipped and acknowledged when it succeeded).
inline void record_prefill_report(const PrefillReport& report) {
  if (report.code != ErrorCode::none || report.kv_bytes == 0) return;
  auto& m = metrics::disagg_metrics();
  m.kv_transfer.observe(seconds_of_micros(report.kv_transfer_us));
  m.kv_transfer_bytes.inc(double(report.kv_bytes));
}

// Prefill worker: a prefill computed, of `tokens` positions (a migrated
// request's: its prompt and the tokens its lost decode worker had streamed).
inline void record_prefill_computed(size_t tokens) { metrics::disagg_metrics().prefill_tokens.inc(double(tokens)); }

// Client: tokens of a completed request that no token event brought.
inline void record_tokens_from_outcome(size_t n) { metrics::disagg_metrics().tokens_from_outcome.inc(double(n)); }

// Decode worker: a token its sequences made (every one, cancelled or not).
inline void record_decoded_token() { metrics::disagg_metrics().decode_tokens.inc(); }

// Decode worker: a sequence's speculative step fed `proposed` guesses, of
// which `accepted` were the tokens made (engine/speculation.h).
inline void record_speculation(int proposed, int accepted) {
  auto& m = metrics::disagg_metrics();
  m.spec_decode_drafts.inc();
  m.spec_decode_draft_tokens.inc(double(proposed));
  m.spec_decode_accepted_tokens.inc(double(accepted));
}

// Decode worker's compute: a sequence's draft KV made (+1) or dropped (-1).
inline void record_draft_sequences(int change) { metrics::disagg_metrics().spec_decode_draft_sequences.add(change); }

// Decode worker: a decode step's compute time; `verify`: some sequence of it
// fed guesses.
inline void record_decode_step(int64_t us, bool verify) {
  auto& m = metrics::disagg_metrics();
  (verify ? m.decode_step_verify : m.decode_step_plain).observe(seconds_of_micros(us));
}

// Decode worker: a reservation's look-up in its prefix cache: `prompt`
// positions asked for, `cached` found; `not_sent` positions of KV will not
// travel (the cached ones, or the whole prompt when it prefills it itself),
// of `position_bytes` each.
inline void record_prefix_lookup(int prompt, int cached, int not_sent, uint64_t position_bytes) {
  auto& m = metrics::disagg_metrics();
  m.decode_prefix_cache_queries.inc(double(prompt));
  m.decode_prefix_cache_hits.inc(double(cached));
  m.kv_bytes_not_sent.inc(double(uint64_t(not_sent) * position_bytes));
}

// Prefill worker: a prompt's look-up in its own prefix cache: `prompt`
// positions asked for, `cached` found (copied, not computed).
inline void record_prefill_prefix_lookup(int prompt, int cached) {
  auto& m = metrics::disagg_metrics();
  m.prefill_prefix_cache_queries.inc(double(prompt));
  m.prefill_prefix_cache_hits.inc(double(cached));
}

// A worker's prefix cache evicted `blocks` blocks (decode: its pool's;
// prefill: its own cache's).
inline void record_prefix_evictions(WorkerRole role, size_t blocks) {
  if (blocks == 0) return;
  auto& m = metrics::disagg_metrics();
  (role == WorkerRole::decode ? m.decode_prefix_cache_evictions : m.prefill_prefix_cache_evictions)
      .inc(double(blocks));
}

// Decode worker: its load whenever it changes.
inline void record_decode_load(const DecodeLoad& load) {
  auto& m = metrics::disagg_metrics();
  m.num_requests_running.set(load.active_sequences);
  if (load.total_blocks > 0)
    m.kv_cache_usage_perc.set(1.0 - double(load.free_blocks) / double(load.total_blocks));
}

}  // namespace disagg
