// The per-request messages between workers: the router's prefill job and the
// prefill worker's report, the KV transfer from prefill to decode and its ack,
// and the decode worker's final report. Each carries the request id.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "caf/meta/type_name.hpp"
#include "messages/request.h"
#include "messages/worker.h"

namespace disagg {

// The longest lease a decode worker takes: the router's is a request's
// time left plus ack-timeout-ms, each at most kMaxDeadlineMs (24 h).
constexpr int64_t kMaxLeaseMs = 2 * kMaxDeadlineMs;

// Router -> decode, sent as request(reserve_atom, KvReservation) before any
// prefill work starts: the receiver allocates first. The decode worker takes
// the blocks of `positions` (gpu::kv_positions_needed: prompt + new tokens)
// and holds them for the request until its KV arrives, it is cancelled, or
// the lease ends (so a prefill that never comes cannot strand them).
struct KvReservation {
  RequestId id = 0;
  int32_t positions = 0;
  int64_t lease_ms = 0;
  int32_t prompt_len = 0;    // positions the prefill will stream into the blocks
  std::string prefill_host;  // the prefill worker's WorkerInfo::host_id (same host: shared memory)
  // The prompt itself (prompt_len tokens; empty: no prefix caching) and the
  // request's cache salt: the decode worker hashes its full blocks
  // (engine/block_hash.h) and shares the ones its prefix cache holds.
  std::vector<int32_t> prompt_tokens;
  std::string cache_salt;
  // The router's local-prefill-tokens: when the prefix cache holds part of
  // the prompt and at most this many positions are left, the decode worker
  // computes them itself (a local target) instead of a prefill worker.
  int32_t local_prefill_tokens = 0;
  // Where the decode worker streams the request's tokens itself (the router
  // only records them); invalid: the router forwards them (it adds text).
  client_actor client;
  // The router's serial of this dispatch: the worker's tokens and done for
  // it name it (TokenEvent::attempt, DecodeDone::attempt), so a late message
  // of an earlier attempt of the same request on this worker is not taken
  // for this one's.
  uint64_t attempt = 0;
};

// Where a prefill worker streams a request's KV (kv/plane.h): the decode
// worker registered its reserved blocks under `transfer_id` with the receiver
// at `address` before answering. transfer_id 0: no stream, send the KV as one
// KvTransfer message (kv-transport "message", or a node without UCX).
// KvTarget::transport of a colocated worker's own decode actor: the prefill
// compute is the decode's compute and copies the KV into the blocks itself
// (kv/local.h); `address` is empty.
constexpr uint8_t kLocalKvTransport = 2;

struct KvTarget {
  uint64_t transfer_id = 0;   // 64 random bits, a capability: only its pieces land in the blocks
  uint8_t transport = 0;      // kv::Transport (0 tcp, 1 shm) or kLocalKvTransport
  std::string address;        // "host:port" of the decode node's receiver
  int32_t block_size = 0;     // the decode pool's positions per block (gpu::KvStreamPlan)
  std::vector<int32_t> runs;  // the prompt's blocks as runs of consecutive ids (gpu::KvStreamPlan::runs_of)
  // Positions [0, first_position) are in the blocks already (the decode
  // worker's prefix cache): not sent, and not computed by a prefill into the
  // pool itself (gpu::KvStreamPlan's first position).
  int32_t first_position = 0;
  // 64 random bits the decode worker drew for this reservation, whatever the
  // transport: it takes the request's KV (one message, or a stream's commit)
  // only with them (KvTransfer::ticket). It travels only in actor messages
  // (decode -> router -> prefill), never on the KV data plane, so another
  // member cannot hand the request a KV of its own making.
  uint64_t ticket = 0;
  // The largest message the decode node's port takes (its port guard's
  // limit, node.max-message-bytes or more); 0: no limit known (an
  // in-process worker, no guard). A KV sent as one message is measured
  // against it before it goes: a larger one would have its connection cut.
  int64_t max_message_bytes = 0;

  // A target in the decode worker's own pool, which its compute writes itself
  // (kLocalKvTransport): no KV crosses to another worker.
  bool local() const { return transfer_id != 0 && transport == kLocalKvTransport; }
};

// Decode -> router: the reply to KvReservation. code none: reserved;
// overloaded: no room (nothing held; the router tries another worker or
// waits); cancelled / invalid_request: refused.
struct ReserveReply {
  RequestId id = 0;
  ErrorCode code = ErrorCode::none;
  std::string message;
  DecodeLoad load;  // after the reservation
  KvTarget target;  // code none: where the KV goes
  int32_t cached_tokens = 0;  // prompt positions the prefix cache had (target.first_position)
};

// Router -> prefill, sent as (prefill_atom, PrefillJob, decode_actor): run the
// prompt and ship its KV to that decode worker. Validated by the router.
struct PrefillJob {
  RequestId id = 0;
  std::vector<int32_t> prompt_tokens;
  int32_t max_new_tokens = 0;
  Sampling sampling;
  int64_t deadline_ms = 0;  // time left when the router sent it
  KvTarget target;          // from the decode worker's ReserveReply
  // The sampling step of the token this prefill samples: 0, or, for a
  // request migrated after its decode worker was lost, the number of tokens
  // already streamed (prompt_tokens then ends with them, and max_new_tokens
  // counts only what is left), so the continuation is exactly the original.
  int32_t first_step = 0;
  std::string cache_salt;  // GenerateRequest::cache_salt (the prefill worker's prefix cache)
  uint64_t attempt = 0;    // KvReservation::attempt: passed on in KvTransfer::attempt
};

// Prefill -> router: the reply to PrefillJob. code none: the decode worker
// acked the KV and now owns the request; else nothing of it is held anywhere
// (kv_too_large, overloaded, incompatible_kv, timeout, cancelled, internal).
struct PrefillReport {
  RequestId id = 0;
  ErrorCode code = ErrorCode::none;
  std::string message;
  uint64_t kv_bytes = 0;       // KV bytes sent (serialized, or streamed)
  int64_t prefill_us = 0;      // from the job's arrival to the prompt computed (and, streamed, sent)
  int64_t kv_transfer_us = 0;  // one message: send to ack; streamed: the last layer computed to the ack
  bool streamed = false;       // the KV went as a stream of pieces during the prefill
  DecodeLoad decode_load;      // from the decode worker's ack (overloaded: how full)
  int32_t cached_tokens = 0;   // prompt positions the prefill worker's prefix cache held
};

// Prefill -> decode, sent as request(kv_atom, KvTransfer): a request's KV in
// the engine/kv_format.h wire format (header, layer-major payload, checksum), and
// what the decode side needs to continue it. The first token was sampled by the
// prefill side (step 0) and has not been streamed yet.
// A transfer is one chunk today (chunk 0 of 1); the layer-major layout lets a
// later version send chunk_count pieces of whole layers with the same id.
struct KvTransfer {
  RequestId id = 0;
  int32_t prompt_len = 0;
  int32_t max_new_tokens = 0;
  Sampling sampling;
  int32_t first_token = 0;
  uint32_t chunk = 0;
  uint32_t chunk_count = 1;
  std::vector<uint8_t> bytes;  // gpu::serialize_kv output; empty when streamed
  // Streamed (KvTarget): the KV is already in the reserved blocks, this only
  // commits it. The receiver verified every piece; the fingerprint is
  // checked again against the decode worker's model.
  uint64_t transfer_id = 0;
  uint64_t fingerprint = 0;
  int32_t first_step = 0;  // PrefillJob::first_step: the index of first_token in the request's output
  int32_t cached_tokens = 0;  // prompt positions the prefill worker's own prefix cache held
  TokenLogprobs first_logprobs;  // of first_token (Sampling::logprobs >= 0)
  std::vector<TokenLogprobs> prompt_logprobs;  // PrefillResult::prompt_logprobs, passed on in DecodeDone
  // The job's prompt (a migrated request's ends with its earlier output):
  // prompt_len tokens, checked by the decode worker; what the sampling
  // (Sampling::uses_history) and speculation's proposer read. Empty from a
  // peer that sends none: then the request must not need it, and does not
  // speculate.
  std::vector<int32_t> context;
  // PrefillJob::attempt: the decode worker takes it only into the
  // reservation of that attempt (a late KV of an earlier attempt, as one
  // message, would fill a retry's reservation of the same prompt).
  uint64_t attempt = 0;
  // PrefillJob::target's ticket: without it the decode worker refuses the KV.
  uint64_t ticket = 0;
};

// The prompt positions a prefix cache held, as a request's outcome (the
// router) and its token events (a streaming decode worker) both report
// them: the more of what the decode pool and the prefill worker's own cache
// held, at most the request's own prompt (a migrated request's job prompt
// ends with the tokens it had streamed).
inline int32_t cached_prompt_tokens(int32_t pool_cached, int32_t prefill_cached, int32_t prompt_len) {
  return std::min(std::max(pool_cached, prefill_cached), prompt_len);
}

// The KV receiver's verdict on a stream, posted by its callback to the decode
// actor (same process) as (landed_atom, request id, reservation serial, KvLanded).
struct KvLanded {
  uint64_t transfer_id = 0;
  uint8_t status = 0;  // kv::TransferStatus
  uint64_t bytes = 0;
  std::string detail;
};

// Decode -> prefill: the reply to KvTransfer. code none: admitted into the
// blocks reserved for it, KV written; timeout: no reservation (its lease
// ended); incompatible_kv: header/fingerprint/shape/checksum mismatch;
// invalid_request; cancelled.
struct KvAck {
  RequestId id = 0;
  ErrorCode code = ErrorCode::none;
  std::string message;
  DecodeLoad load;  // the decode worker's load after handling the transfer
};

// Decode -> router, sent as (done_atom, DecodeDone) after the last token event
// of the request (same sender, so it arrives after them).
struct DecodeDone {
  RequestId id = 0;
  ErrorCode code = ErrorCode::none;
  std::string message;
  std::vector<int32_t> tokens;  // all generated tokens, first included
  FinishReason finish = FinishReason::length;
  int64_t decode_us = 0;
  int32_t first_step = 0;  // KvTransfer::first_step: tokens[0] is output token number first_step
  std::vector<TokenLogprobs> prompt_logprobs;  // KvTransfer::prompt_logprobs
  uint64_t attempt = 0;  // KvReservation::attempt
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, KvReservation& x) {
  return f(caf::meta::type_name("KvReservation"), x.id, x.positions, x.lease_ms, x.prompt_len, x.prefill_host,
           x.prompt_tokens, x.cache_salt, x.local_prefill_tokens, x.client, x.attempt);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, KvTarget& x) {
  return f(caf::meta::type_name("KvTarget"), x.transfer_id, x.transport, x.address, x.block_size, x.runs,
           x.first_position, x.ticket, x.max_message_bytes);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, ReserveReply& x) {
  return f(caf::meta::type_name("ReserveReply"), x.id, x.code, x.message, x.load, x.target, x.cached_tokens);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, PrefillJob& x) {
  return f(caf::meta::type_name("PrefillJob"), x.id, x.prompt_tokens, x.max_new_tokens, x.sampling,
           x.deadline_ms, x.target, x.first_step, x.cache_salt, x.attempt);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, PrefillReport& x) {
  return f(caf::meta::type_name("PrefillReport"), x.id, x.code, x.message, x.kv_bytes,
           x.prefill_us, x.kv_transfer_us, x.streamed, x.decode_load, x.cached_tokens);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, KvTransfer& x) {
  return f(caf::meta::type_name("KvTransfer"), x.id, x.prompt_len, x.max_new_tokens, x.sampling,
           x.first_token, x.chunk, x.chunk_count, x.bytes, x.transfer_id, x.fingerprint, x.first_step,
           x.cached_tokens, x.first_logprobs, x.context, x.prompt_logprobs, x.attempt, x.ticket);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, KvLanded& x) {
  return f(caf::meta::type_name("KvLanded"), x.transfer_id, x.status, x.bytes, x.detail);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, KvAck& x) {
  return f(caf::meta::type_name("KvAck"), x.id, x.code, x.message, x.load);
}

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, DecodeDone& x) {
  return f(caf::meta::type_name("DecodeDone"), x.id, x.code, x.message, x.tokens, x.finish,
           x.decode_us, x.first_step, x.prompt_logprobs, x.attempt);
}

}  // namespace disagg
