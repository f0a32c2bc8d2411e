// Messages between a worker and its own compute actor (same process): the
// compute actor owns the gpu::Engine (and, on a decode worker, the KV pool
// storage) and runs the heavy work off CAF's shared scheduler.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "caf/meta/type_name.hpp"
#include "messages/request.h"
#include "messages/transfer.h"
#include "messages/worker.h"

namespace disagg {

// Set by the prefill worker when its request is cancelled. The compute actor
// handles messages in order, so a cancel *message* would reach it only after
// the work it should stop; it reads this flag instead, just before the work.
// Shared between the prefill worker and its compute actor, which always live
// in one process: never serialized.
using CancelFlag = std::shared_ptr<std::atomic<bool>>;

// Prefill -> compute: run the prompt, sample the first token (step 0).
// Work reached after its deadline or cancellation is skipped, not computed
// (PrefillResult code timeout / cancelled), so prompts of requests that have
// ended cannot pile up in the compute actor's mailbox.
struct PrefillWork {
  RequestId id = 0;
  std::vector<int32_t> tokens;
  Sampling sampling;
  // The request's deadline as std::chrono::steady_clock's time_since_epoch
  // in nanoseconds (the clock of the one process both actors share); 0: none.
  int64_t deadline_ns = 0;
  CancelFlag cancelled;  // null: cannot be cancelled
  // Where to stream the KV while the prompt runs (transfer_id 0: return it
  // serialized in PrefillResult::kv instead), and how long to wait for the
  // receiver's verdict after the last piece.
  KvTarget target;
  int64_t kv_wait_ms = 0;
  int32_t first_step = 0;  // the sampling step of the token sampled here (PrefillJob::first_step)
  std::string cache_salt;  // keeps the request's cached prefixes apart (GenerateRequest::cache_salt)
};

struct PrefillResult {
  RequestId id = 0;
  ErrorCode code = ErrorCode::none;  // none, timeout, cancelled (skipped) or internal
  std::string message;
  int32_t first_token = 0;
  TokenLogprobs first_logprobs;  // Sampling::logprobs >= 0
  std::vector<TokenLogprobs> prompt_logprobs;  // Sampling::prompt_logprobs >= 0: token i's (i >= 1) at i - 1
  std::vector<uint8_t> kv;  // gpu::serialize_kv bytes (not streamed)
  int64_t compute_us = 0;   // the prompt's forward pass (streamed: sending overlapped it)
  // Streamed: every piece is in the decode worker's blocks, verified.
  bool streamed = false;
  uint64_t kv_bytes = 0;
  int64_t tail_us = 0;  // from the last layer computed to the receiver's verdict
  int32_t cached_tokens = 0;  // prompt positions the prefill worker's prefix cache held (not computed)
  KvEvents cache_events;      // what its prefix cache stored and evicted meanwhile (seq unset)
};

// Decode -> compute, sent as (admit_atom, KvAdmit): validate the KV against
// the engine (gpu::parse_kv) and write it into these pool blocks.
struct KvAdmit {
  KvTransfer transfer;
  std::vector<int32_t> blocks;
  int32_t first_position = 0;  // the positions before it are in shared prefix-cache blocks, not written
};

struct AdmitResult {
  RequestId id = 0;
  ErrorCode code = ErrorCode::none;  // none or incompatible_kv / internal
  std::string message;
};

// One sequence of a batched decode step: feed `token` at `pos`, then sample
// token number `step` of the request from the logits.
struct StepSlot {
  RequestId id = 0;
  int32_t token = 0;
  int32_t pos = 0;
  int32_t step = 0;
  Sampling sampling;
  std::vector<int32_t> blocks;
  // The request's tokens so far (prompt, then output) when the sampling
  // reads them (Sampling::uses_history: the penalties) or a proposer does
  // (draft_limit > 0), else empty.
  std::vector<int32_t> history;
  // Speculative decoding (engine/speculation.h): the most guesses the
  // compute may feed after `token` (at pos + 1, ...) from the proposer of
  // sampling.speculation (resolved by the decode worker); 0: a plain step.
  // The decode worker keeps every guess inside the request's token limit and
  // its reserved blocks.
  int32_t draft_limit = 0;
};

struct DecodeStep {
  std::vector<StepSlot> slots;
};

struct StepResult {
  ErrorCode code = ErrorCode::none;
  std::string message;
  // The tokens each slot made, in slot order: one per slot, or made[i] for
  // slot i when `made` is not empty (a speculative step: 1..draft_limit + 1,
  // each the token plain decoding makes there; the stop rule still applies
  // to each in order).
  std::vector<int32_t> next_tokens;
  std::vector<TokenLogprobs> logprobs;  // one per token (empty where its Sampling::logprobs < 0)
  std::vector<int32_t> made;      // empty, or tokens per slot
  std::vector<int32_t> proposed;  // empty, or guesses fed per slot
  std::vector<int32_t> accepted;  // empty, or of them those equal to the token made (gpu::accepted_of)
  // Empty, or one per slot: why that slot's grammar could not go on (its
  // sequence ends, invalid_request; its token means nothing); "" for the others.
  std::vector<std::string> slot_errors;
  int64_t compute_us = 0;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, PrefillWork& x) {
  return f(caf::meta::type_name("PrefillWork"), x.id, x.tokens, x.sampling, x.deadline_ns, x.target,
           x.kv_wait_ms, x.first_step, x.cache_salt);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, PrefillResult& x) {
  return f(caf::meta::type_name("PrefillResult"), x.id, x.code, x.message, x.first_token, x.first_logprobs, x.prompt_logprobs, x.kv,
           x.compute_us, x.streamed, x.kv_bytes, x.tail_us, x.cached_tokens,
           x.cache_events);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, KvAdmit& x) {
  return f(caf::meta::type_name("KvAdmit"), x.transfer, x.blocks, x.first_position);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, AdmitResult& x) {
  return f(caf::meta::type_name("AdmitResult"), x.id, x.code, x.message);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, StepSlot& x) {
  return f(caf::meta::type_name("StepSlot"), x.id, x.token, x.pos, x.step, x.sampling, x.blocks, x.history,
           x.draft_limit);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, DecodeStep& x) {
  return f(caf::meta::type_name("DecodeStep"), x.slots);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, StepResult& x) {
  return f(caf::meta::type_name("StepResult"), x.code, x.message, x.next_tokens, x.logprobs, x.slot_errors,
           x.made, x.proposed, x.accepted, x.compute_us);
}

}  // namespace disagg
