#include "metrics/disagg_metrics.h"

namespace disagg::metrics {

std::vector<double> ttft_buckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
          1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}

std::vector<double> inter_token_buckets() {
  return {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0};
}

std::vector<double> request_latency_buckets() {
  return {0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
          120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

std::vector<double> kv_transfer_buckets() {
  return {0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
}

DisaggMetrics::DisaggMetrics(Registry& r)
    : time_to_first_token(r.histogram("disagg_time_to_first_token_seconds",
                                      "Time from the request's acceptance to its first generated token.",
                                      ttft_buckets())
                              .get()),
      inter_token_latency(r.histogram("disagg_inter_token_latency_seconds",
                                      "Time between two consecutive generated tokens of a request.",
                                      inter_token_buckets())
                              .get()),
      e2e_request_latency(r.histogram("disagg_e2e_request_latency_seconds",
                                      "Time from the request's acceptance to its terminal reply.",
                                      request_latency_buckets())
                              .get()),
      request_queue_time(r.histogram("disagg_request_queue_time_seconds",
                                     "Time a request waited in the router's queue before dispatch.",
                                     request_latency_buckets())
                             .get()),
      request_prefill_time(r.histogram("disagg_request_prefill_time_seconds",
                                       "Time a prefill worker spent on a request's prompt (job received to KV ready).",
                                       request_latency_buckets())
                               .get()),
      request_decode_time(r.histogram("disagg_request_decode_time_seconds",
                                      "Time a decode worker spent on a request (admitted to finished).",
                                      request_latency_buckets())
                              .get()),
      num_requests_running(
          r.gauge("disagg_num_requests_running",
                  "Requests in flight (router, frontend: dispatched; decode: active sequences).")
              .get()),
      num_requests_waiting(r.gauge("disagg_num_requests_waiting", "Requests waiting in the router's queue.").get()),
      kv_cache_usage_perc(
          r.gauge("disagg_kv_cache_usage_perc", "Fraction of the decode worker's KV blocks in use (0 to 1).").get()),
      prompt_tokens(r.counter("disagg_prompt_tokens_total", "Prompt tokens of finished requests.").get()),
      generation_tokens(r.counter("disagg_generation_tokens_total", "Generated tokens of finished requests.").get()),
      prefill_tokens(r.counter("disagg_prefill_tokens_total",
                               "Positions the prefill workers computed (a migrated request's prompt and streamed tokens).")
                         .get()),
      decode_tokens(r.counter("disagg_decode_tokens_total",
                              "Tokens the decode workers made, cancelled and failed requests' included.")
                        .get()),
      request_success(r.counter("disagg_request_success_total", "Requests that completed, by finish reason.",
                                {"finished_reason"})),
      request_errors(r.counter("disagg_request_errors_total", "Requests that ended with an error, by error code.",
                               {"code"})),
      kv_transfer(r.histogram("disagg_kv_transfer_seconds",
                              "Time from a prefill worker sending a prompt's KV to the decode worker's ack.",
                              kv_transfer_buckets())
                      .get()),
      kv_transfer_bytes(
          r.counter("disagg_kv_transfer_bytes_total", "Bytes of KV sent from prefill to decode workers.").get()),
      kv_pieces_sent(r.counter("disagg_kv_pieces_sent_total",
                               "KV stream pieces a prefill worker handed to the data plane, layer by layer.")
                         .get()),
      tokens_from_outcome(r.counter("disagg_tokens_from_outcome_total",
                                    "Tokens a client took from the request's outcome because no token event "
                                    "brought them (a stream's message lost or late).")
                              .get()),
      prefix_cache_queries(r.counter("disagg_prefix_cache_queries_total",
                                     "Prompt tokens looked up in a worker's prefix cache, by role.", {"role"})),
      prefix_cache_hits(r.counter("disagg_prefix_cache_hits_total",
                                  "Prompt tokens found in a worker's prefix cache (their KV reused), by role.",
                                  {"role"})),
      prefix_cache_evictions(r.counter("disagg_prefix_cache_evictions_total",
                                       "KV blocks a worker's prefix cache evicted to make room, by role.", {"role"})),
      kv_bytes_not_sent(r.counter("disagg_kv_transfer_bytes_saved_total",
                                  "KV bytes no prefill worker sent: positions a decode worker's prefix cache held, "
                                  "and prompts it prefilled itself.")
                            .get()),
      workers(r.gauge("disagg_workers", "Workers registered at the router, by role.", {"role"})),
      connections_closed(r.counter("disagg_connections_closed_total",
                                   "Connections a node's port guard refused or closed, by reason.", {"reason"})),
      success_stop(request_success.with({"stop"})),
      success_length(request_success.with({"length"})),
      prefill_workers(workers.with({"prefill"})),
      decode_workers(workers.with({"decode"})),
      decode_prefix_cache_queries(prefix_cache_queries.with({"decode"})),
      decode_prefix_cache_hits(prefix_cache_hits.with({"decode"})),
      prefill_prefix_cache_queries(prefix_cache_queries.with({"prefill"})),
      prefill_prefix_cache_hits(prefix_cache_hits.with({"prefill"})),
      decode_prefix_cache_evictions(prefix_cache_evictions.with({"decode"})),
      prefill_prefix_cache_evictions(prefix_cache_evictions.with({"prefill"})),
      spec_decode_drafts(r.counter("disagg_spec_decode_num_drafts_total",
                                   "Speculative steps of a sequence: decode steps that fed it guesses.")
                             .get()),
      spec_decode_draft_tokens(
          r.counter("disagg_spec_decode_num_draft_tokens_total", "Guessed tokens fed to speculative steps.").get()),
      spec_decode_accepted_tokens(r.counter("disagg_spec_decode_num_accepted_tokens_total",
                                            "Guessed tokens that were the tokens plain decoding makes (accepted).")
                                      .get()),
      spec_decode_draft_sequences(r.gauge("disagg_spec_decode_draft_sequences",
                                          "Sequences whose draft-model KV a decode worker holds (speculation draft).")
                                      .get()),
      decode_step_seconds(r.histogram("disagg_decode_step_seconds",
                                      "Compute time of a decode worker's batched step, by kind: plain, or verify "
                                      "(some sequence fed guesses).",
                                      inter_token_buckets(), {"kind"})),
      decode_step_plain(decode_step_seconds.with({"plain"})),
      decode_step_verify(decode_step_seconds.with({"verify"})) {
  for (size_t i = 0; i < kErrorCodes.size(); ++i) errors_by_code[i] = &request_errors.with({kErrorCodes[i]});
  // (node/port_guard.h GuardRefusal's names: every reason exists at zero)
  for (const char* reason : {"connection_cap", "pending_cap", "source_cap", "bad_header", "message_too_large",
                             "handshake_timeout", "message_timeout", "buffer_budget"})
    connections_closed.with({reason});
}

Counter& DisaggMetrics::success(const std::string& finished_reason) {
  if (finished_reason == "stop") return success_stop;
  if (finished_reason == "length") return success_length;
  return request_success.with({finished_reason});
}

Counter& DisaggMetrics::error(const std::string& code) {
  for (size_t i = 0; i < kErrorCodes.size(); ++i)
    if (code == kErrorCodes[i]) return *errors_by_code[i];
  return request_errors.with({code});
}

Registry& process_registry() {
  static Registry registry;
  return registry;
}

DisaggMetrics& disagg_metrics() {
  static DisaggMetrics metrics(process_registry());
  return metrics;
}

}  // namespace disagg::metrics
