// What a client sends to the router and what it gets back: the request, the
// streamed token events and the one terminal outcome.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "caf/meta/type_name.hpp"
#include "caf/replies_to.hpp"
#include "caf/typed_actor.hpp"
#include "engine/sampling.h"
#include "messages/atoms.h"

namespace disagg {

// Chosen by the client (actors/client.h draws a random prefix per client and
// counts up); the router rejects an id that is already in flight.
using RequestId = uint64_t;

// The code of a terminal reply. `none` means the request completed.
enum class ErrorCode : uint8_t {
  none = 0,
  invalid_request,  // malformed request: empty prompt, bad token id, too long, ...
  overloaded,       // admission queue full, or no decode worker has room
  kv_too_large,     // the prompt's KV exceeds max_kv_transfer_bytes
  incompatible_kv,  // the decode worker's model does not match the KV (fingerprint/shape/checksum)
  timeout,          // the request's deadline passed
  cancelled,        // cancel(request id)
  worker_lost,      // a worker serving the request (or the router) went down
  internal,         // a compute failure or a broken invariant
};
std::string to_string(ErrorCode code);

// Why a request's tokens ended: the stop rule's own vocabulary (engine/stop_rule.h).
using gpu::FinishReason;

// How each token of a request is sampled (engine/sampling.h, with the stop
// rule's min_tokens, ignore_eos and stop_token_ids): token i is sampled with
// (seed, i) from the request's own tokens, so the same request gives the
// same tokens wherever each step runs. Checked by gpu::check_sampling.
using Sampling = gpu::SamplingParams;
using gpu::TokenBias;
using gpu::TokenLogprobs;

// The most choices one client request may have (OpenAI's n, best_of): each
// is a request of its own to the router, holding its own KV blocks; further
// choices wait for dispatch in a line of their own, at most kMaxChoices - 1
// for each request queue-capacity counts.
constexpr int kMaxChoices = 16;

// The longest deadline a request may ask for: 24 hours. The router refuses
// more (invalid_request), so no deadline arithmetic can overflow.
constexpr int64_t kMaxDeadlineMs = int64_t{24} * 60 * 60 * 1000;
// The deadline of a request that sets none: the router's default-deadline-ms
// and the client library's ClientOptions start from this one figure.
constexpr int64_t kDefaultDeadlineMs = 60000;

struct GenerateRequest {
  RequestId id = 0;
  // The prompt: token ids (BOS first, as the tokenizer emits them), or text
  // that the router encodes with its tokenizer when prompt_is_text is set.
  std::vector<int32_t> prompt_tokens;
  std::string prompt_text;
  bool prompt_is_text = false;
  int32_t max_new_tokens = 0;
  Sampling sampling;
  std::string session;      // empty: no decode-worker affinity
  int64_t deadline_ms = 0;  // from the router's receipt; 0: the router's default; <= kMaxDeadlineMs
  // Whether the router adds each token's text (when it has a tokenizer); a
  // client that decodes by itself (the HTTP frontend) saves the router that work.
  bool token_text = true;
  // max_new_tokens is the client's "as many as the context holds" (a chat
  // request without max_tokens): the router lowers it to what the largest
  // decode pool can hold, rather than refusing a request no pool fits.
  bool up_to_capacity = false;
  // Keeps this request's prompt out of the prefix cache entries of requests
  // with another salt (a tenant's own cache, vLLM's cache_salt); "" shares.
  std::string cache_salt;
  // A further choice (OpenAI's n, best_of: at most kMaxChoices in all) of
  // the client request whose first choice has this id; 0: a request of its own. Further choices count with
  // their first against the router's queue-capacity and wait for dispatch
  // behind every request of its own (actors/router.cpp, AdmissionQueue), so
  // one client's n cannot fill the queue or hold others back.
  RequestId first_choice = 0;
};

// One generated token, streamed as soon as the decode step produced it.
struct TokenEvent {
  RequestId id = 0;
  int32_t index = 0;  // 0 for the first generated token
  int32_t token = 0;
  std::string text;   // the token's text piece when the router has a tokenizer
  // Set by the router: prompt tokens the decode worker's prefix cache held
  // (as RequestOutcome's timings will say), so a client that stops early
  // (a stop string) can report them.
  int32_t cached_tokens = 0;
  // Sampling::logprobs >= 0: the token's log probability and the top alternatives'.
  TokenLogprobs logprobs;
  uint64_t attempt = 0;  // the dispatch that made it (KvReservation::attempt)
};

// Whoever submitted a request: receives its token events as they are
// produced, from the request's decode worker (or, for a request whose text
// the router adds, from the router), each index once and in order (the
// client library drops repeats after a migration). The terminal
// RequestOutcome is the response to its generate request.
using client_actor = caf::typed_actor<caf::reacts_to<token_atom, TokenEvent>>;

// Decode -> router: the tokens one decode step made (or the first token of
// a sequence just admitted), one event per sequence, in the order the
// worker made them. One message per step, not per token: at a thousand
// decode workers the router's mailbox takes a message per worker step
// (bench/bench_router.cpp). The router records them (what a migration
// continues from, metrics) and forwards each event to the client only when
// the decode worker does not stream to it (GenerateRequest::token_text).
struct TokenBatch {
  std::vector<TokenEvent> events;
};

// Durations in microseconds, each measured on one machine's clock.
struct Timings {
  int64_t queued_us = 0;       // router: accepted -> dispatched to prefill
  int64_t prefill_us = 0;      // prefill worker: job received -> KV ready (streamed: last layer computed)
  int64_t kv_transfer_us = 0;  // prefill worker: KV sent -> decode's ack (streamed: last layer -> ack)
  int64_t decode_us = 0;       // decode worker: admitted -> finished
  uint64_t kv_bytes = 0;       // the KV as it travelled (prefilled where it is decoded: as a stream would carry it)
  bool kv_streamed = false;    // streamed during the prefill (else one message after it)
  int32_t cached_tokens = 0;   // prompt tokens whose KV the decode worker's prefix cache held
};

// The terminal reply: exactly one per request.
struct RequestOutcome {
  RequestId id = 0;
  ErrorCode code = ErrorCode::none;
  std::string message;          // why, when code != none
  std::vector<int32_t> prompt_tokens;  // the prompt as run (a text prompt encoded by the router)
  std::vector<int32_t> tokens;  // generated tokens (prompt excluded)
  std::vector<TokenLogprobs> logprobs;  // theirs, when Sampling::logprobs >= 0 (else empty)
  // Sampling::prompt_logprobs >= 0: prompt token i's (i >= 1) at i - 1.
  std::vector<TokenLogprobs> prompt_logprobs;
  FinishReason finish = FinishReason::length;
  std::string text;             // decoded tokens when the router has a tokenizer
  Timings timings;
  std::string prefill_worker;   // names of the workers that served it
  std::string decode_worker;

  bool ok() const { return code == ErrorCode::none; }
};

RequestOutcome make_failure(RequestId id, ErrorCode code, std::string message);

}  // namespace disagg

// Beside the types they describe (gpu/ knows no CAF): found by argument-dependent lookup.
namespace disagg::gpu {

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, TokenBias& x) {
  return f(caf::meta::type_name("TokenBias"), x.token, x.bias);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, StopParams& x) {
  return f(caf::meta::type_name("StopParams"), x.min_tokens, x.ignore_eos, x.stop_token_ids);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, SpeculationParams& x) {
  return f(caf::meta::type_name("Speculation"), x.method, x.num_tokens, x.lookup_min, x.lookup_max);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, SamplingParams& x) {
  return f(caf::meta::type_name("Sampling"), x.temperature, x.top_p, x.seed, x.top_k, x.min_p, x.presence_penalty,
           x.frequency_penalty, x.repetition_penalty, x.logit_bias, x.stop, x.logprobs, x.prompt_logprobs,
           x.grammar, x.speculation);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, TokenLogprobs& x) {
  return f(caf::meta::type_name("TokenLogprobs"), x.logprob, x.top_tokens, x.top_logprobs);
}

}  // namespace disagg::gpu

namespace disagg {

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, GenerateRequest& x) {
  return f(caf::meta::type_name("GenerateRequest"), x.id, x.prompt_tokens, x.prompt_text,
           x.prompt_is_text, x.max_new_tokens, x.sampling, x.session, x.deadline_ms, x.token_text,
           x.up_to_capacity, x.cache_salt, x.first_choice);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, TokenEvent& x) {
  return f(caf::meta::type_name("TokenEvent"), x.id, x.index, x.token, x.text, x.cached_tokens, x.logprobs, x.attempt);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, TokenBatch& x) {
  return f(caf::meta::type_name("TokenBatch"), x.events);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, Timings& x) {
  return f(caf::meta::type_name("Timings"), x.queued_us, x.prefill_us, x.kv_transfer_us,
           x.decode_us, x.kv_bytes, x.kv_streamed, x.cached_tokens);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, RequestOutcome& x) {
  return f(caf::meta::type_name("RequestOutcome"), x.id, x.code, x.message, x.prompt_tokens, x.tokens, x.logprobs, x.prompt_logprobs, x.finish,
           x.text, x.timings, x.prefill_worker, x.decode_worker);
}

}  // namespace disagg
