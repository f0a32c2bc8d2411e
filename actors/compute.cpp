#include "actors/compute.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <optional>
#include <type_traits>

#include "actors/errors.h"
#include "actors/request_metrics.h"
#include "actors/timing.h"
#include "caf/all.hpp"
#include "engine/kv_format.h"
#include "engine/kv_stream.h"
#include "engine/prefix_cache.h"
#include "engine/constraint.h"
#include "engine/sampling.h"
#include "engine/draft.h"
#include "engine/speculation.h"
#include "model/checkpoint.h"
#include "text/tokenizer.h"
#include "metrics/disagg_metrics.h"

namespace disagg {

// Token ids and block lists travel as std::vector<int32_t> and are handed to
// gpu/ (std::vector<int>) without copies.
static_assert(std::is_same<int32_t, int>::value, "int32_t must be int");

namespace {

// prefill_counts(): process-wide, so every compute actor adds to the same counts.
std::atomic<int64_t> prefills_computed{0};
std::atomic<int64_t> prefills_skipped_cancelled{0};
std::atomic<int64_t> prefills_skipped_expired{0};

using Self = compute_actor::pointer;

// A colocated worker's prompt, computed into its reserved pool blocks a chunk
// per turn of the compute actor (run_local_chunk).
struct LocalPrefill {
  PrefillWork work;
  std::vector<int> blocks;  // the reservation's, in position order
  uint64_t kv_bytes = 0;    // the prompt's K and V, as a stream would carry them
  int done = 0;             // positions computed so far
  int64_t compute_us = 0;   // its chunks' time, not the decode steps between them
  std::vector<TokenLogprobs> prompt_logprobs;  // Sampling::prompt_logprobs, as its chunks compute them
  caf::typed_response_promise<PrefillResult> promise;
};

struct ComputeState {
  std::shared_ptr<gpu::Engine> engine;
  std::shared_ptr<gpu::KvPool> pool;  // holds the engine too (spawn_compute_unit)
  std::shared_ptr<kv::KvPlane> plane;
  std::shared_ptr<kv::LocalKvTargets> local;  // a colocated worker's
  int prefill_chunk = 0;                      // ComputeSpec::prefill_chunk
  // Colocated prompts in arrival order: the first one's chunks run, one per
  // chunk_atom; while any is queued, exactly one chunk_atom is on its way.
  std::deque<LocalPrefill> local_prefills;
  std::unique_ptr<gpu::PrefixCache> prefix_cache;  // a prefill worker's (ComputeSpec::prefix_cache_blocks)
  std::unique_ptr<gpu::Constraints> constraints;   // null: no vocabulary to constrain (ComputeSpec::tokenizer)
  // A decode worker's draft model (ComputeSpec::draft): its engine, its
  // pool, and each speculating sequence's draft KV, held until its decode
  // worker says the sequence ended (cancel_atom).
  std::shared_ptr<gpu::Engine> draft;
  std::unique_ptr<gpu::KvPool> draft_pool;
  std::optional<gpu::BlockPool> draft_blocks;
  std::unordered_map<RequestId, gpu::DraftSequence> drafts;
  ~ComputeState() { record_draft_sequences(-int(drafts.size())); }  // (a compute that ends holds none)
};

// The grammar's mask for token `step` of a request whose tokens so far are
// `history`; null without a grammar. Throws grammar::GrammarError.
std::shared_ptr<const grammar::TokenMask> mask_of(const ComputeState& st, const gpu::SamplingParams& sampling,
                                                  const std::vector<int>& history, int64_t step) {
  if (sampling.grammar.empty()) return nullptr;
  if (!st.constraints) {
    grammar::Grammar::from_json(sampling.grammar);  // (a bad grammar says what is wrong with it first)
    throw grammar::GrammarError("this worker has no vocabulary to constrain its output with");
  }
  return st.constraints->mask(sampling.grammar, history, uint64_t(step));
}

// Token `first_step` of the request from the logits after its prompt
// (work.tokens: the prompt, and a migrated request's earlier output).
// A grammar that cannot go on is the request's fault: r says so
// (invalid_request) and no token is sampled.
void sample_first(const ComputeState& st, const PrefillWork& work, const float* logits, PrefillResult& r) {
  const gpu::ModelConfig& c = st.engine->config();
  std::shared_ptr<const grammar::TokenMask> mask;
  try {
    mask = mask_of(st, work.sampling, work.tokens, work.first_step);
  } catch (const grammar::GrammarError& e) {
    r.code = ErrorCode::invalid_request;
    r.message = e.what();
    return;
  }
  gpu::Sampled sampled;
  try {
    sampled = gpu::sample(logits, c.vocab_size, work.sampling, uint64_t(work.first_step), work.tokens, c.end_tokens,
                          mask.get());
  } catch (const gpu::Error& e) {  // (the request's own: a grammar that allows no token here)
    r.code = ErrorCode::invalid_request;
    r.message = e.what();
    return;
  }
  r.first_token = sampled.token;
  r.first_logprobs = std::move(sampled.logprobs);
}

// What collects a prompt's log probabilities from the logits of each of its
// positions (PrefillHooks::on_logits) into `out` (token i's at i - 1); empty
// when the request asks for none.
std::function<void(int, int, const float*)> prompt_logprobs_of(const PrefillWork& work, int vocab,
                                                                std::vector<TokenLogprobs>& out) {
  if (work.sampling.prompt_logprobs < 0) return {};
  if (out.size() != work.tokens.size() - 1) out.assign(work.tokens.size() - 1, {});  // (a chunked prompt: once)
  return [&work, vocab, &out](int first, int count, const float* logits) {
    for (int i = 0; i < count; ++i) {
      const size_t next = size_t(first + i) + 1;
      if (next < work.tokens.size())
        out[next - 1] = gpu::token_logprobs(logits + size_t(i) * size_t(vocab), vocab, work.tokens[next],
                                            work.sampling.prompt_logprobs);
    }
  };
}

// A prefill worker's prompt with what its prefix cache holds of it: the
// cached positions are copied, not computed (engine/prefix_cache.h). Whatever
// ends the prefill, the held blocks are released; the prompt's own blocks
// are kept only when it was computed.
class CachedPrefix {
 public:
  // (A request for prompt log probabilities computes every position: no lookup.)
  CachedPrefix(ComputeState& st, const PrefillWork& work)
      : cache_(work.sampling.prompt_logprobs < 0 ? st.prefix_cache.get() : nullptr) {
    if (cache_) lookup_ = cache_->lookup(work.tokens, work.cache_salt);
  }
  ~CachedPrefix() {
    if (cache_) cache_->drop(lookup_);
  }
  CachedPrefix(const CachedPrefix&) = delete;
  CachedPrefix& operator=(const CachedPrefix&) = delete;
  const gpu::PrefillPrefix& prefix() const { return lookup_.prefix; }
  int32_t positions() const { return lookup_.prefix.positions(); }
  // The prefill succeeded: its full blocks join the cache.
  void keep() {
    if (cache_) cache_->keep(lookup_);
    cache_ = nullptr;
  }
  // The cache's stores and evictions since the last prompt (none without one).
  static KvEvents events_of(ComputeState& st) {
    KvEvents out;
    if (!st.prefix_cache) return out;
    for (const gpu::BlockEvent& e : st.prefix_cache->take_events())
      (e.stored ? out.stored : out.removed).push_back(e.hash);
    return out;
  }

 private:
  gpu::PrefixCache* cache_;
  gpu::PrefixCache::Lookup lookup_;
};

// Whether the request of `work` has been cancelled (the router's flag).
bool was_cancelled(const PrefillWork& work) { return work.cancelled && work.cancelled->load(); }

// Whether the deadline of `work` (none when 0) has passed.
bool past_deadline(const PrefillWork& work) {
  return work.deadline_ns > 0 && Clock::now().time_since_epoch() >= std::chrono::nanoseconds(work.deadline_ns);
}

// Thrown by the prefill hook to stop a streamed prefill part way.
struct StreamStopped {
  ErrorCode code;
  std::string message;
};

// How long an abandoned stream may take to get its pieces in flight back
// (they are bounded by the sender's in-flight budget).
constexpr auto kAbandonWait = std::chrono::seconds(2);
// How often a send waiting for room in flight looks at the cancel flag.
constexpr auto kCancelPoll = std::chrono::milliseconds(50);

// The sending side of one prompt's KV stream: each layer's new positions go
// out as pieces (engine/kv_stream.h), each send waiting for room in flight
// no longer than the request's deadline or the receiver's stall limit.
class PieceSender {
 public:
  PieceSender(const PrefillWork& work, const gpu::KvStreamPlan& plan, std::shared_ptr<kv::KvSender> tx)
      : work_(work),
        plan_(plan),
        tx_(std::move(tx)),
        // A receiver that takes no piece for this long (a dead decode node over
        // shared memory, which has no peer-failure detection) ends the stream.
        stall_limit_(std::max<int64_t>(1, work.kv_wait_ms)),
        request_deadline_(work.deadline_ns > 0 ? kv::Deadline(std::chrono::nanoseconds(work.deadline_ns))
                                                : kv::Deadline::max()) {}

  // The prefill hook: throws StreamStopped (cancelled, or the receiver failed
  // the stream) or kv::KvError (the transport).
  void send_layer(int layer, int first, int count, const float* cache) {
    if (was_cancelled(work_)) throw StreamStopped{ErrorCode::cancelled, "cancelled during its prefill"};
    const auto* bytes_of_cache = reinterpret_cast<const uint8_t*>(cache);
    plan_.for_each_piece(layer, first, count, [&](size_t offset, size_t source, size_t bytes) {
      send_piece(offset, bytes_of_cache + source, bytes);
    });
  }

 private:
  void send_piece(size_t offset, const uint8_t* data, size_t bytes) {
    const kv::Deadline until = std::min(request_deadline_, kv::Clock::now() + stall_limit_);
    // Waiting for room in flight, in slices: a cancel (the router's, e.g.
    // after the decode node died) ends the wait within one.
    for (;;) {
      try {
        if (!tx_->send(work_.target.transfer_id, piece_, offset, data, bytes,
                       std::min(until, kv::Clock::now() + kCancelPoll)))
          throw StreamStopped{ErrorCode::none, {}};  // the receiver failed it: its verdict says why
        break;
      } catch (const kv::KvError& e) {
        if (e.code() != kv::KvErrc::timed_out || kv::Clock::now() >= until) throw;
        if (was_cancelled(work_)) throw StreamStopped{ErrorCode::cancelled, "cancelled while its KV was waiting to be sent"};
      }
    }
    ++piece_;
    metrics::disagg_metrics().kv_pieces_sent.inc();
  }

  const PrefillWork& work_;
  const gpu::KvStreamPlan& plan_;
  std::shared_ptr<kv::KvSender> tx_;
  std::chrono::milliseconds stall_limit_;
  kv::Deadline request_deadline_;
  uint32_t piece_ = 0;
};

// The data plane's sender to the target's address; null (and `r` says why)
// where this node has none or cannot reach it.
std::shared_ptr<kv::KvSender> open_sender(ComputeState& st, const KvTarget& target, PrefillResult& r) {
  const auto transport = target.transport == uint8_t(kv::Transport::shm) ? kv::Transport::shm : kv::Transport::tcp;
  try {
    if (!st.plane) throw kv::KvError(kv::KvErrc::invalid_argument, "this node has no KV data plane");
    return st.plane->sender(transport, target.address);
  } catch (const kv::KvError& e) {
    r.code = ErrorCode::worker_lost;
    r.message = std::string("KV stream to the decode worker (") + kv::to_string(transport) + " " + target.address +
                "): " + e.what();
    return nullptr;
  }
}

// The prompt's KV streams to the decode worker's blocks while it is computed:
// after each layer of each chunk, that layer's new positions go out as pieces
// straight from the engine's prefill cache, which stays unchanged until the
// next prefill, i.e. until this function has the receiver's verdict (or has
// abandoned the stream).
void run_streamed_prefill(ComputeState& st, PrefillWork& work, PrefillResult& r) {
  const KvTarget& target = work.target;
  const gpu::ModelConfig& c = st.engine->config();
  const gpu::KvStreamPlan plan(c.n_layers, c.kv_dim(), int(work.tokens.size()), target.block_size, target.runs,
                               target.first_position);
  std::shared_ptr<kv::KvSender> tx = open_sender(st, target, r);
  if (!tx) return;
  PieceSender sender(work, plan, tx);
  gpu::PrefillHooks hooks;
  hooks.wire_kv = false;
  hooks.on_logits = prompt_logprobs_of(work, c.vocab_size, r.prompt_logprobs);
  hooks.on_layer_cache = [&](int layer, int first, int count, const float* cache) {
    sender.send_layer(layer, first, count, cache);
  };
  const auto start = Clock::now();
  std::optional<StreamStopped> stopped;
  CachedPrefix cached(st, work);
  r.cached_tokens = cached.positions();
  try {
    gpu::PrefillOutput out = st.engine->prefill(work.tokens, hooks, cached.prefix());
    sample_first(st, work, out.logits.data(), r);
    cached.keep();  // (reads the prompt's cache, as the pieces in flight do)
  } catch (const StreamStopped& s) {
    stopped = s;
  } catch (const kv::KvError& e) {
    stopped = StreamStopped{ErrorCode::worker_lost, std::string("KV stream: ") + e.what()};
  } catch (const std::exception& e) {
    stopped = StreamStopped{ErrorCode::internal, std::string("prefill: ") + e.what()};
  }
  const auto computed = Clock::now();
  r.compute_us = std::chrono::duration_cast<std::chrono::microseconds>(computed - start).count();
  r.kv_bytes = plan.total_bytes();
  if (stopped && stopped->code != ErrorCode::none) {
    tx->abandon(target.transfer_id, computed + kAbandonWait);
    r.code = stopped->code;
    r.message = stopped->message;
    return;
  }
  const kv::TransferResult verdict =
      tx->wait(target.transfer_id, computed + std::chrono::milliseconds(std::max<int64_t>(1, work.kv_wait_ms)));
  r.tail_us = micros_since(computed);
  if (!verdict.ok()) {
    r.code = code_of(verdict.status);
    r.message = "KV stream to " + target.address + ": " + kv::to_string(verdict.status) +
                (verdict.detail.empty() ? "" : " (" + verdict.detail + ")");
    return;
  }
  r.streamed = true;
}

// A colocated worker's prefill, started: the blocks its decode worker
// registered are claimed and the prompt queued; its chunks run in
// run_local_chunk, and the promise answers when the last one is done.
caf::result<PrefillResult> start_local_prefill(Self self, ComputeState& st, PrefillWork& work) {
  PrefillResult r;
  r.id = work.id;
  const KvTarget& target = work.target;
  std::optional<std::vector<int32_t>> blocks;
  if (st.pool && st.local) blocks = st.local->claim(target.transfer_id);
  if (!blocks) {
    r.code = ErrorCode::invalid_request;
    r.message = "no KV blocks of this worker are registered under transfer " + std::to_string(target.transfer_id) +
                " (a local target names the decode worker of the prefill's own unit)";
    return r;
  }
  LocalPrefill p;
  try {
    // The checks a stream's receiver makes: the plan fits the blocks.
    const gpu::ModelConfig& c = st.engine->config();
    const gpu::KvStreamPlan plan(c.n_layers, c.kv_dim(), int(work.tokens.size()), target.block_size, target.runs,
                                 target.first_position);
    p.blocks.assign(blocks->begin(), blocks->end());
    st.pool->stream_spans(plan, p.blocks);
    p.kv_bytes = plan.total_bytes();
  } catch (const std::exception& e) {
    st.local->release(target.transfer_id);
    r.code = ErrorCode::invalid_request;
    r.message = std::string("KV target: ") + e.what();
    return r;
  }
  p.done = target.first_position;  // the prefix the blocks hold already (the prefix cache)
  p.work = std::move(work);
  p.promise = self->make_response_promise<PrefillResult>();
  st.local_prefills.push_back(std::move(p));
  if (st.local_prefills.size() == 1) self->send(self, chunk_atom::value);
  return st.local_prefills.back().promise;
}

// The next chunk of prefill_chunk positions (all that are left when 0) of
// `p`, computed straight into its blocks; its result once it has ended
// (computed, or stopped: cancelled, its blocks given up, or past its deadline
// before the chunk).
std::optional<PrefillResult> local_chunk(ComputeState& st, LocalPrefill& p) {
  const PrefillWork& work = p.work;
  PrefillResult r;
  r.id = work.id;
  auto stopped = [&](ErrorCode code, std::string message) {
    r.code = code;
    r.message = std::move(message);
    r.compute_us = p.compute_us;
    return r;
  };
  if (was_cancelled(work)) return stopped(ErrorCode::cancelled, "cancelled during its prefill");
  if (!st.local->alive(work.target.transfer_id))
    return stopped(ErrorCode::cancelled, "its KV blocks were given up during its prefill");
  if (past_deadline(work)) return stopped(ErrorCode::timeout, "deadline passed during its prefill");
  const int n = int(work.tokens.size());
  const int rows = st.prefill_chunk > 0 ? std::min(st.prefill_chunk, n - p.done) : n - p.done;
  const auto start = Clock::now();
  std::vector<float> logits;
  try {
    logits = st.engine->prefill_chunk(
        *st.pool, std::vector<int>(work.tokens.begin() + p.done, work.tokens.begin() + p.done + rows), p.done,
        p.blocks, prompt_logprobs_of(work, st.engine->config().vocab_size, p.prompt_logprobs));
  } catch (const std::exception& e) {
    return stopped(ErrorCode::internal, std::string("prefill: ") + e.what());
  }
  p.compute_us += micros_since(start);
  p.done += rows;
  if (p.done < n) return std::nullopt;
  try {
    sample_first(st, work, logits.data(), r);
  } catch (const std::exception& e) {
    return stopped(ErrorCode::internal, std::string("sampling: ") + e.what());
  }
  r.streamed = true;
  r.kv_bytes = p.kv_bytes;
  r.compute_us = p.compute_us;
  r.prompt_logprobs = std::move(p.prompt_logprobs);
  return r;
}

// One turn: a chunk of the first queued colocated prompt. The next turn is
// sent to the back of the mailbox, so a decode step that came meanwhile runs
// first (continuous batching: the worker's running sequences wait at most one
// chunk for their next token).
void run_local_chunk(Self self, ComputeState& st) {
  if (st.local_prefills.empty()) return;
  LocalPrefill& p = st.local_prefills.front();
  if (std::optional<PrefillResult> result = local_chunk(st, p)) {
    st.local->release(p.work.target.transfer_id);
    p.promise.deliver(std::move(*result));
    st.local_prefills.pop_front();
  }
  if (!st.local_prefills.empty()) self->send(self, chunk_atom::value);
}

// Skipped, not computed, when the request has ended while this waited.
std::optional<PrefillResult> skip_ended(const PrefillWork& work) {
  PrefillResult r;
  r.id = work.id;
  if (was_cancelled(work)) {
    ++prefills_skipped_cancelled;
    r.code = ErrorCode::cancelled;
    r.message = "cancelled before its prefill ran";
    return r;
  }
  if (past_deadline(work)) {
    ++prefills_skipped_expired;
    r.code = ErrorCode::timeout;
    r.message = "deadline passed before its prefill ran";
    return r;
  }
  return std::nullopt;
}

// A prompt of a prefill worker (not colocated): its KV streamed to the
// decode worker while it is computed, or returned serialized.
PrefillResult run_prefill(ComputeState& st, PrefillWork& work) {
  PrefillResult r;
  r.id = work.id;
  const auto start = Clock::now();
  if (work.target.transfer_id != 0) {
    try {
      run_streamed_prefill(st, work, r);
    } catch (const std::exception& e) {  // a plan the prompt does not fit (the decode's block size)
      r.code = ErrorCode::invalid_request;
      r.message = std::string("KV stream: ") + e.what();
    }
  } else {
    try {
      CachedPrefix cached(st, work);
      r.cached_tokens = cached.positions();
      gpu::PrefillHooks hooks;
      hooks.on_logits = prompt_logprobs_of(work, st.engine->config().vocab_size, r.prompt_logprobs);
      gpu::PrefillOutput out = st.engine->prefill(work.tokens, hooks, cached.prefix());
      cached.keep();
      sample_first(st, work, out.logits.data(), r);
      r.kv = gpu::serialize_kv(st.engine->fingerprint(), out.shape, out.kv.data());
    } catch (const std::exception& e) {
      r.code = ErrorCode::internal;
      r.message = std::string("prefill: ") + e.what();
    }
    r.compute_us = micros_since(start);
  }
  // Whatever happened: what the prefix cache stored and evicted meanwhile.
  r.cache_events = CachedPrefix::events_of(st);
  return r;
}

AdmitResult run_admit(ComputeState& st, KvAdmit& admit) {
  AdmitResult r;
  r.id = admit.transfer.id;
  const auto& bytes = admit.transfer.bytes;
  try {
    if (!st.pool) throw gpu::Error("admit: this compute actor has no KV pool");
    gpu::KvView view = gpu::parse_kv(bytes.data(), bytes.size(), st.engine->kv_expectation());
    const auto positions = int64_t(view.header.shape.n_positions);
    if (positions != admit.transfer.prompt_len) {
      r.code = ErrorCode::incompatible_kv;
      r.message = "KV holds " + std::to_string(positions) + " positions, the prompt has " +
                  std::to_string(admit.transfer.prompt_len);
      return r;
    }
    if (int64_t(admit.blocks.size()) * st.pool->block_size() < positions)
      throw gpu::Error("admit: " + std::to_string(admit.blocks.size()) + " blocks cannot hold " +
                       std::to_string(positions) + " positions");
    st.pool->write(admit.blocks, view, admit.first_position);
  } catch (const gpu::KvFormatError& e) {
    r.code = ErrorCode::incompatible_kv;
    r.message = e.what();
  } catch (const std::exception& e) {
    r.code = ErrorCode::internal;
    r.message = std::string("admit: ") + e.what();
  }
  return r;
}

// The draft KV of a slot's sequence (made on its first speculating step,
// as many blocks as its reservation holds), or null when this worker has no
// draft model or no room for one.
gpu::DraftSequence* draft_sequence(ComputeState& st, const StepSlot& s) {
  if (!st.draft) return nullptr;
  auto it = st.drafts.find(s.id);
  if (it == st.drafts.end()) {
    std::vector<int> blocks = st.draft_blocks->allocate(int(s.blocks.size()));
    if (blocks.empty()) return nullptr;
    it = st.drafts.emplace(s.id, gpu::DraftSequence(*st.draft, *st.draft_pool, std::move(blocks))).first;
    record_draft_sequences(+1);
  }
  return &it->second;
}

void forget_draft(ComputeState& st, RequestId id) {
  auto it = st.drafts.find(id);
  if (it == st.drafts.end()) return;
  st.draft_blocks->release(it->second.blocks());
  st.drafts.erase(it);
  record_draft_sequences(-1);
}

// The guesses a slot's proposer makes (engine/speculation.h), at most its
// draft_limit (the decode worker's gpu::guess_room); none for a plain slot.
std::vector<int> draft_of(ComputeState& st, const StepSlot& s) {
  if (s.draft_limit <= 0) return {};
  const gpu::SpeculationParams& p = s.sampling.speculation;
  const int max = s.draft_limit;
  switch (p.method) {
    case gpu::SpeculationMethod::ngram: return gpu::propose_ngram(s.history, p.lookup_min, p.lookup_max, max);
    case gpu::SpeculationMethod::draft:
      if (gpu::DraftSequence* d = draft_sequence(st, s)) return d->propose(s.history, max);
      return {};
    default: return {};
  }
}

// One batched step: each slot's token and its guesses (one row each), then
// per slot the tokens plain decoding makes (gpu::verify_draft: one for a
// plain slot).
StepResult run_step(ComputeState& st, DecodeStep& step) {
  StepResult r;
  const auto start = Clock::now();
  try {
    if (!st.pool) throw gpu::Error("step: this compute actor has no KV pool");
    std::vector<std::vector<int>> drafts(step.slots.size());
    std::vector<gpu::DecodeSlot> slots;
    slots.reserve(step.slots.size());
    bool speculating = false;
    for (size_t i = 0; i < step.slots.size(); ++i) {
      const StepSlot& s = step.slots[i];
      drafts[i] = draft_of(st, s);
      speculating |= !drafts[i].empty();
      slots.push_back(gpu::DecodeSlot{s.token, s.pos, &s.blocks});
      for (size_t j = 0; j < drafts[i].size(); ++j)
        slots.push_back(gpu::DecodeSlot{drafts[i][j], s.pos + 1 + int(j), &s.blocks});
    }
    const std::vector<float> logits = st.engine->decode_step(*st.pool, slots);
    const int vocab = st.engine->config().vocab_size;
    const std::vector<int>& end_tokens = st.engine->config().end_tokens;
    r.next_tokens.reserve(step.slots.size());
    r.logprobs.reserve(step.slots.size());
    size_t row = 0;
    for (size_t i = 0; i < step.slots.size(); ++i) {
      StepSlot& s = step.slots[i];  // (its history grows by the tokens made: the message is this step's own)
      const float* rows = logits.data() + row * size_t(vocab);
      row += 1 + drafts[i].size();
      std::vector<gpu::Sampled> made;
      try {
        made = gpu::verify_draft(rows, vocab, drafts[i], s.sampling, uint64_t(s.step), s.history, end_tokens,
                                 [&](const std::vector<int>& h, uint64_t index) {
                                   return mask_of(st, s.sampling, h, int64_t(index));
                                 });
      } catch (const std::runtime_error& e) {
        // (grammar::GrammarError, or gpu::Error from sampling this request:
        // a grammar that allows no token here) This sequence alone ends;
        // the others of the batch go on.
        r.slot_errors.resize(step.slots.size());
        r.slot_errors[i] = e.what();
        made.assign(1, gpu::Sampled{});
      }
      if (speculating) {
        r.made.push_back(int32_t(made.size()));
        r.proposed.push_back(int32_t(drafts[i].size()));
        r.accepted.push_back(int32_t(gpu::accepted_of(drafts[i], made)));
      }
      for (gpu::Sampled& m : made) {
        r.next_tokens.push_back(m.token);
        r.logprobs.push_back(std::move(m.logprobs));
      }
    }
  } catch (const std::exception& e) {
    r.code = ErrorCode::internal;
    r.message = std::string("decode step: ") + e.what();
    r.next_tokens.clear();
    r.logprobs.clear();
    r.made.clear();
    r.proposed.clear();
    r.accepted.clear();
  }
  r.compute_us = micros_since(start);
  return r;
}

compute_actor::behavior_type compute_behavior(Self self, std::shared_ptr<ComputeState> st) {
  return {
      [st](info_atom) { return model_info(*st->engine); },
      [self, st](prefill_atom, PrefillWork& work) -> caf::result<PrefillResult> {
        if (std::optional<PrefillResult> skipped = skip_ended(work)) return std::move(*skipped);
        ++prefills_computed;
        if (work.target.local())
          return start_local_prefill(self, *st, work);
        return run_prefill(*st, work);
      },
      [self, st](chunk_atom) { run_local_chunk(self, *st); },
      [st](admit_atom, KvAdmit& admit) { return run_admit(*st, admit); },
      [st](step_atom, DecodeStep& step) { return run_step(*st, step); },
      [st](cancel_atom, RequestId id) { forget_draft(*st, id); },
      [st](kv_events_atom) {
        KvEvents all;
        all.snapshot = true;
        if (st->prefix_cache) all.stored = st->prefix_cache->cached_hashes();
        return all;
      },
  };
}

}  // namespace

PrefillCounts prefill_counts() {
  PrefillCounts c;
  c.computed = prefills_computed.load();
  c.skipped_cancelled = prefills_skipped_cancelled.load();
  c.skipped_expired = prefills_skipped_expired.load();
  return c;
}

namespace {

ModelInfo model_info_of(uint64_t fingerprint, const gpu::ModelConfig& c) {
  ModelInfo info;
  info.fingerprint = fingerprint;
  info.vocab_size = c.vocab_size;
  info.seq_len = c.seq_len;
  info.n_layers = c.n_layers;
  info.n_kv_heads = c.n_kv_heads;
  info.head_dim = c.head_size();
  info.end_tokens.assign(c.end_tokens.begin(), c.end_tokens.end());
  return info;
}

// One prefill of one token and, with a pool, one decode step, before the
// worker registers: the first request a worker served used to pay 20-45 ms of
// first-touch costs (the thread pools' start, scratch buffers' first pages).
// The step writes position 0 of block 0, which no request holds yet.
void warm_up(ComputeState& st) {
  const std::vector<int> bos{gpu::kBosToken};
  st.engine->prefill(bos);
  if (!st.pool) return;
  const std::vector<int> block{0};
  st.engine->decode_step(*st.pool, {gpu::DecodeSlot{gpu::kBosToken, 0, &block}});
}

}  // namespace

ModelInfo model_info(const gpu::Checkpoint& checkpoint) {
  return model_info_of(checkpoint.fingerprint(), checkpoint.config());
}

ModelInfo model_info(const gpu::Engine& engine) {
  ModelInfo info = model_info_of(engine.fingerprint(), engine.config());
  info.backend = engine.backend_name();
  return info;
}

ComputeUnit spawn_compute_unit(caf::actor_system& system, const ComputeSpec& spec) {
  if (!spec.checkpoint) throw gpu::Error("spawn_compute: no checkpoint");
  auto st = std::make_shared<ComputeState>();
  st->engine = std::make_shared<gpu::Engine>(spec.checkpoint, spec.engine);
  st->plane = spec.kv_plane;
  st->local = spec.local_targets;
  if (spec.pool_blocks > 0 && !st->local) st->local = std::make_shared<kv::LocalKvTargets>();
  st->prefill_chunk = spec.prefill_chunk;
  if (spec.prefix_cache_blocks > 0)
    st->prefix_cache = std::make_unique<gpu::PrefixCache>(*st->engine, spec.pool_block_size, spec.prefix_cache_blocks);
  if (!spec.tokenizer.empty() || spec.checkpoint->vocabulary()) {
    const gpu::Tokenizer tokenizer = gpu::load_tokenizer(*spec.checkpoint, spec.tokenizer);
    st->constraints = std::make_unique<gpu::Constraints>(
        gpu::grammar_vocabulary(tokenizer, st->engine->config().end_tokens));
  }
  if (spec.pool_blocks > 0) {
    // (the pool's memory is the engine's backend's: the engine outlives it)
    auto* pool = new gpu::KvPool(st->engine->backend(), st->engine->kv_shape(st->engine->config().seq_len),
                                 spec.pool_block_size, spec.pool_blocks);
    st->pool = std::shared_ptr<gpu::KvPool>(pool, [engine = st->engine](gpu::KvPool* p) { delete p; });
  }
  if (spec.draft && spec.pool_blocks > 0) {
    st->draft = std::make_shared<gpu::Engine>(spec.draft, spec.engine);
    if (const std::string why = gpu::check_draft(st->engine->config(), st->draft->config()); !why.empty())
      throw gpu::Error(why);
    st->draft_pool = std::make_unique<gpu::KvPool>(st->draft->backend(),
                                                   st->draft->kv_shape(st->draft->config().seq_len),
                                                   spec.pool_block_size, spec.pool_blocks);
    st->draft_blocks.emplace(spec.pool_blocks);
  }
  warm_up(*st);
  ComputeUnit unit;
  unit.pool = st->pool;
  unit.local = st->local;
  unit.actor = system.spawn<caf::detached>(compute_behavior, std::move(st));
  return unit;
}

compute_actor spawn_compute(caf::actor_system& system, const ComputeSpec& spec) {
  return spawn_compute_unit(system, spec).actor;
}

std::shared_ptr<kv::KvPlane> make_kv_plane(const DisaggConfig& config, bool receive) {
  // A stream's pieces are one per (layer, block, K|V) of each prefill chunk,
  // so small blocks make many small pieces: let the byte budget be the bound.
  constexpr uint32_t kStreamInflightPieces = 1024;
  kv::PlaneOptions options;
  if (receive) options.listen_host = config.kv_host.empty() ? "127.0.0.1" : config.kv_host;
  options.shared_memory = config.kv_shared_memory();
  options.sender.max_inflight_pieces = kStreamInflightPieces;
  return std::make_shared<kv::KvPlane>(options);
}

}  // namespace disagg
