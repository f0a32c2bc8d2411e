// The router: admits requests, places them on a prefill and a decode
// worker, relays their tokens, and gives each exactly one terminal reply.
//
// A request's lifecycle: Request::phase, one of the structs below, each
// holding its own data ("finished" is its removal, after the one reply):
//
//                  refused reservation: another decode worker (max-decode-retries)
//              +----------------------------------------------+
//              v                                              |
//   submit --> Queued --(dispatch: decode room and a    --> Reserving --(blocks held: send_prefill_job;
//              ^  ^      prefill slot, or local prefill)    {Attempt}     the decode worker's own
//              |  |                                             |          prefill when local)
//              |  |                                             v
//              |  +----- worker lost / silent, no token yet -- Prefilling --(prefill report ok, or a
//              |         (starts over: max-worker-retries)    {Attempt}      first token of this attempt)
//              |                                                  v
//              +-------- decode worker lost after tokens ----- Decoding --(done: eos or length, the stop
//                        (migrates: prompt + streamed tokens,  {Attempt,     rule; and the prefill report
//                         sampling from step k; same retries)   report,      or none waited for)--> finished
//                                                               done}
//
//   any phase --(cancel, deadline, client gone, a worker's error, retries spent)--> finished
//
// Attempt: the workers of this dispatch, its serial (answers that name
// another are ignored), the blocks booked, the cached prompt positions.
// Leaving a phase releases what the request held: the prefill slot it kept
// while Reserving (a job once sent holds its slot until the worker's
// report), the decode blocks (Reserving on). What lives as long as the
// request (its tokens streamed so far, retries, the decode workers that
// refused it) is in Request itself.
#include "actors/router.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>

#include "actors/deadlines.h"
#include "actors/errors.h"
#include "actors/log.h"
#include "actors/request_metrics.h"
#include "actors/router_policy.h"
#include "actors/senders.h"
#include "actors/timing.h"
#include "caf/all.hpp"
#include "engine/block_hash.h"

namespace disagg {

namespace {

struct Worker {
  WorkerInfo info;
  caf::actor_addr address;
  prefill_actor prefill;  // exactly one of prefill / decode is valid
  decode_actor decode;
  // prefill: jobs the router has sent and not yet heard back about (held
  // until the worker's report arrives, also for requests that ended or went
  // on without it before; a report that never comes is given up at the job's
  // own bound, its deadline + ack-timeout-ms, so no slot is held forever)
  int in_flight = 0;
  int64_t outstanding_tokens = 0;
  DecodeRoom room;  // decode: its free blocks as the router books them
  // Liveness: a worker that leaves a heartbeat unanswered for
  // heartbeat-timeout-ms gets no new work until it answers again.
  bool responsive = true;
  bool heartbeat_pending = false;
  // decode: what its prefix cache holds, as its KV events say (routing only)
  PrefixIndex prefix{0};
  bool snapshot_pending = false;
};

// A request's phases at the router: the diagram at the top of this file.

// One dispatch to a pair of workers: what every phase after Queued holds.
struct Attempt {
  uint64_t serial = 0;        // this dispatch: an answer that names another is stale
  WorkerKey prefill_key = 0;  // 0: none (the decode worker prefills it itself)
  WorkerKey decode_key = 0;
  int reserved_blocks = 0;  // booked in the decode worker's DecodeRoom
  bool local_prefill = false;  // the reservation's target is local: the decode worker prefills
  // Of the prompt, in a prefix cache: the decode worker's (ReserveReply) or,
  // if more, the prefill worker's (PrefillReport).
  int32_t cached_tokens = 0;
};

// Waiting in RouterState::queue for workers with room (again, after a
// refused reservation or a lost worker: nothing of the last attempt is held).
struct Queued {};

// The decode worker is asked to reserve the blocks; the prefill worker's slot
// is booked for the job that follows.
struct Reserving {
  Attempt attempt;
};

// The job is out: the prefill worker (or the decode worker itself) computes
// the prompt and ships the KV into the reserved blocks.
struct Prefilling {
  Attempt attempt;
};

// The decode worker has this attempt's KV (the prefill worker reported, or
// a token or a done of this attempt came from the decode worker). The
// prefill worker is not needed any more: it going down or silent, or
// answering with an error, changes nothing for the request.
struct Decoding {
  Attempt attempt;
  std::optional<PrefillReport> prefill_report;  // its timings, once reported
  bool prefill_over = false;  // no report is waited for: the prefill worker went down, silent or answered an error
  std::optional<DecodeDone> done;  // the decode worker's last word on it
};

using Phase = std::variant<Queued, Reserving, Prefilling, Decoding>;

struct Request {
  GenerateRequest request;
  std::vector<int32_t> prompt;
  client_actor client;
  caf::actor_addr requester;  // who sent it (none: anonymous); a cancel comes from it or the client
  caf::typed_response_promise<RequestOutcome> promise;
  Phase phase;
  // The job prompt's block hashes for one block size (prompt_hashes), kept
  // across dispatch attempts.
  int hashed_block_size = 0;
  size_t hashed_tokens = 0;
  std::vector<uint64_t> hashes;
  bool validated = false;  // against the model limits (known once a prefill worker registered)
  Clock::time_point accepted;
  Clock::time_point deadline;  // accepted + its deadline_ms (RouterState::deadlines)
  std::optional<Clock::time_point> dispatched;  // its first dispatch (queued_us); kept across attempts
  int retries = 0;
  int worker_retries = 0;  // restarts after a lost or hung worker (max-worker-retries)
  std::vector<WorkerKey> excluded;  // decode workers that answered overloaded
  // Decode workers of attempts that failed (a lost or silent decode worker,
  // a broken KV stream: the link between its workers may be cut, an
  // unanswered reservation): a restart goes to another while another could
  // hold the request.
  std::vector<WorkerKey> avoided;
  // streaming:
  std::vector<int32_t> streamed;  // tokens forwarded to the client, every attempt's
  std::vector<TokenLogprobs> logprobs;  // theirs, when the request asks for them (Sampling::logprobs)
  // Tokens earlier attempts streamed before their decode worker was lost: the
  // current attempt prefills prompt + these and continues from there (its
  // PrefillJob::first_step is their count).
  std::vector<int32_t> earlier;
  int32_t previous_token = 0;
  std::optional<Clock::time_point> last_token;  // metrics: time between tokens
  std::string text;
};

// The current attempt of a dispatched request (nullptr: queued).
const Attempt* attempt_of(const Request& r) {
  return std::visit(
      [](const auto& phase) -> const Attempt* {
        if constexpr (std::is_same_v<std::decay_t<decltype(phase)>, Queued>) return nullptr;
        else return &phase.attempt;
      },
      r.phase);
}
Attempt* attempt_of(Request& r) { return const_cast<Attempt*>(attempt_of(std::as_const(r))); }

// The current attempt when it is the one an answer names (nullptr: stale).
Attempt* current_attempt(Request& r, uint64_t serial) {
  Attempt* a = attempt_of(r);
  return a && a->serial == serial ? a : nullptr;
}

bool is_queued(const Request& r) { return std::holds_alternative<Queued>(r.phase); }

// The decode worker's done, if it has said it.
const DecodeDone* done_of(const Request& r) {
  const auto* d = std::get_if<Decoding>(&r.phase);
  return d && d->done ? &*d->done : nullptr;
}

// The decode worker has the KV: a Prefilling request moves on to Decoding
// (from Decoding it stays). nullptr from the phases before (no KV can be
// there yet).
Decoding* to_decoding(Request& r) {
  if (auto* p = std::get_if<Prefilling>(&r.phase)) r.phase = Decoding{p->attempt, std::nullopt, false, std::nullopt};
  return std::get_if<Decoding>(&r.phase);
}

// Whether the request's decode worker streams its tokens to its client
// itself (direct-token-streams): unless the router adds their text.
bool streams_direct(const DisaggConfig& config, bool has_tokenizer, const Request& r) {
  return config.direct_token_streams && r.client && !(has_tokenizer && r.request.token_text);
}

// What the request's next prefill runs: its prompt, then the tokens earlier
// attempts streamed (Request::earlier), and how many tokens are left to make.
int64_t job_prompt_len(const Request& r) { return int64_t(r.prompt.size() + r.earlier.size()); }
std::vector<int32_t> job_prompt(const Request& r) {
  std::vector<int32_t> tokens = r.prompt;
  tokens.insert(tokens.end(), r.earlier.begin(), r.earlier.end());
  return tokens;
}
int job_new_tokens(const Request& r) { return r.request.max_new_tokens - int(r.earlier.size()); }

// Whether the request still needs its prefill worker (see Decoding).
bool prefill_holds(const Request& r) {
  return std::holds_alternative<Reserving>(r.phase) || std::holds_alternative<Prefilling>(r.phase);
}

// Whether the request's prefill worker may still hold its job: it has not
// reported (in Decoding too: the decode worker has the KV, but the job
// waits for its ack until then, and a new attempt's job of the same id
// would be refused there as "already in prefill"; also when the router no
// longer waits for the report, the worker having been silent: it may
// answer again).
bool prefill_unreported(const Request& r) {
  const auto* d = std::get_if<Decoding>(&r.phase);
  return prefill_holds(r) || (d && !d->prefill_report);
}

// Accepted requests waiting for dispatch, oldest first (a request back from
// a failed attempt goes to the front of its line). Further choices of a
// client request (GenerateRequest::first_choice: OpenAI's n and best_of)
// wait in a line of their own, behind every request of its own: they count
// with their first choice against queue-capacity (which counts `requests`
// only), and one client's n = 16 cannot fill the queue nor make a single
// request wait for its 15 extra choices.
struct AdmissionQueue {
  std::deque<RequestId> requests;  // requests of their own (and first choices)
  std::deque<RequestId> choices;   // further choices

  static bool further_choice(const Request& r) { return r.request.first_choice != 0; }
  size_t size() const { return requests.size() + choices.size(); }
  size_t counted() const { return requests.size(); }  // against queue-capacity
  bool empty() const { return requests.empty() && choices.empty(); }
  RequestId front() const { return requests.empty() ? choices.front() : requests.front(); }
  void pop_front() { requests.empty() ? choices.pop_front() : requests.pop_front(); }
  void push_back(const Request& r) { (further_choice(r) ? choices : requests).push_back(r.request.id); }
  void push_front(const Request& r) { (further_choice(r) ? choices : requests).push_front(r.request.id); }
  void erase(const Request& r) {
    auto& line = further_choice(r) ? choices : requests;
    line.erase(std::find(line.begin(), line.end(), r.request.id));
  }
};

struct RouterState {
  DisaggConfig config;
  std::shared_ptr<const gpu::Tokenizer> tokenizer;
  std::optional<ModelLimits> limits;
  std::optional<ModelInfo> model;  // the cluster's model (the router's own), when it has one
  PrefixHolders holders;  // what every worker's prefix index holds (their Worker::prefix)
  std::map<WorkerKey, Worker> workers;
  // The same workers by actor address (every message from a worker is
  // looked up by its sender: O(1), not a walk over a thousand workers) and
  // counted by role.
  std::unordered_map<caf::actor_addr, WorkerKey> by_address;
  int prefill_count = 0;
  WorkerKey next_worker_key = 1;
  std::unordered_map<RequestId, Request> requests;
  // Each request's client actor, monitored: a client that goes away (its
  // process killed, Ctrl-C) cancels what it asked for.
  std::unordered_multimap<caf::actor_addr, RequestId> clients;
  // Each request's deadline, and the wake-ups armed for them (actors/deadlines.h).
  DeadlineSet<RequestId> deadlines;
  AdmissionQueue queue;  // accepted, not dispatched
  uint64_t next_serial = 1;
  SessionAffinity sessions{0};
  size_t prefill_cursor = 0;
  size_t decode_cursor = 0;
  const char* name = "disagg.router";
};

using Self = router_actor::stateful_pointer<RouterState>;

// The tokens the request may make (the stop rule's gpu::token_limit; 0 while
// the model's limits are unknown: then nothing has been dispatched).
int token_allowance(Self self, const Request& r) {
  const auto& limits = self->state.limits;
  return limits ? gpu::token_limit(int(r.prompt.size()), r.request.max_new_tokens, limits->seq_len) : 0;
}

// Whether the request's tokens are all there: its decode worker said done, or
// its last allowed token has streamed. Such a request completes, whatever
// fails afterwards.
bool tokens_final(Self self, const Request& r) {
  return done_of(r) || (self->state.limits && int(r.streamed.size()) >= token_allowance(self, r));
}

// The books' metrics (queue, in flight, workers) as dispatch() leaves them:
// every change of them ends in a dispatch.
struct BooksMetrics {
  const RouterState& st;
  ~BooksMetrics() {
    record_router_books(st.queue.size(), st.requests.size() - st.queue.size(), st.prefill_count,
                        int(st.workers.size()) - st.prefill_count);
  }
};

Worker* find_worker(Self self, WorkerKey key) {
  auto it = self->state.workers.find(key);
  return it == self->state.workers.end() ? nullptr : &it->second;
}

// The registered worker the current message comes from (0: none).
WorkerKey sender_key(Self self) {
  const auto& index = self->state.by_address;
  auto it = index.find(caf::actor_cast<caf::actor_addr>(self->current_sender()));
  return it == index.end() ? 0 : it->second;
}

Worker* sender_worker(Self self) { return find_worker(self, sender_key(self)); }

std::string worker_name(Self self, WorkerKey key) {
  const Worker* w = find_worker(self, key);
  return w ? w->info.name : std::string();
}

// The request's blocks on its decode worker go back in the router's books:
// the reservation, and the free-block estimate that start() lowered (capped:
// a load report may have counted them free already). The decode worker's
// next report corrects the estimate; this keeps it right if none comes.
void release_reservations(Self self, Request& r) {
  Attempt* a = attempt_of(r);
  if (!a || a->reserved_blocks <= 0) return;
  if (Worker* d = find_worker(self, a->decode_key)) d->room.release(a->reserved_blocks);
  a->reserved_blocks = 0;
}

// A prefill job's slot is free once the worker has answered it (or the
// answer's own deadline passed): until then its compute may still be busy
// with it, whether or not the request has ended meanwhile.
void release_prefill_slot(Self self, WorkerKey prefill_key, int64_t prompt_tokens) {
  if (Worker* p = find_worker(self, prefill_key)) {
    p->in_flight -= 1;
    p->outstanding_tokens -= prompt_tokens;
  }
}

// The request `id` when the current message comes from its decode worker
// and names its current attempt: token and done messages of anybody else
// (e.g. a late one of an earlier request with the same id from another
// worker), or of an earlier attempt on the same worker (sent through its
// node's relay, they can arrive after that worker's answer to the new
// reservation), must not touch it.
Request* from_its_decode_worker(Self self, RequestId id, uint64_t attempt) {
  auto it = self->state.requests.find(id);
  if (it == self->state.requests.end()) return nullptr;  // already finished (e.g. cancelled)
  Request& r = it->second;
  // Queued: no decode worker holds it. Reserving: the job that brings the
  // KV is not out yet, so nothing of this attempt can come from there.
  if (is_queued(r) || std::holds_alternative<Reserving>(r.phase) || attempt_of(r)->serial != attempt) return nullptr;
  const Worker* d = find_worker(self, attempt_of(r)->decode_key);
  if (!d || d->address != caf::actor_cast<caf::actor_addr>(self->current_sender())) return nullptr;
  return &r;
}

// Ends the request's current attempt on its workers: when `tell`, the ones
// that have not answered yet are told to drop it; and while reserving, no
// prefill job is out, so its slot comes back here (once a job is out, only
// the worker's report frees it).
void end_attempt(Self self, Request& r, bool tell) {
  const RequestId id = r.request.id;
  const Attempt* a = attempt_of(r);
  if (!a) return;
  if (tell && prefill_unreported(r))
    if (Worker* p = find_worker(self, a->prefill_key)) self->send(p->prefill, cancel_atom::value, id);
  if (tell && !done_of(r))
    if (Worker* d = find_worker(self, a->decode_key)) self->send(d->decode, cancel_atom::value, id);
  if (std::holds_alternative<Reserving>(r.phase)) release_prefill_slot(self, a->prefill_key, job_prompt_len(r));
}

// THE exit of every accepted request: one terminal reply, everything it holds
// released (and, when it failed, its workers told to drop it), then forgotten.
void finish(Self self, RequestId id, RequestOutcome outcome) {
  auto& st = self->state;
  auto it = st.requests.find(id);
  if (it == st.requests.end()) return;
  Request& r = it->second;
  end_attempt(self, r, !outcome.ok() && r.dispatched);
  release_reservations(self, r);
  if (is_queued(r)) st.queue.erase(r);
  outcome.id = id;
  if (r.dispatched) outcome.timings.queued_us = micros_between(r.accepted, *r.dispatched);
  if (const Attempt* a = attempt_of(r)) {
    if (outcome.prefill_worker.empty())
      outcome.prefill_worker = worker_name(self, a->local_prefill ? a->decode_key : a->prefill_key);
    if (outcome.decode_worker.empty()) outcome.decode_worker = worker_name(self, a->decode_key);
  }
  record_finished(outcome, r.accepted, r.dispatched.has_value());
  r.promise.deliver(std::move(outcome));
  if (r.client) {
    const caf::actor_addr client = r.client.address();
    auto [first, last] = st.clients.equal_range(client);
    for (auto c = first; c != last; ++c)
      if (c->second == id) {
        st.clients.erase(c);
        break;
      }
    // (not a worker's: demonitor removes every monitor of this router's on it)
    if (!st.clients.count(client) && !st.by_address.count(client)) self->demonitor(client);
  }
  st.deadlines.remove(r.deadline, id);
  st.requests.erase(it);
}

void fail(Self self, RequestId id, ErrorCode code, std::string message) {
  node_log(LogLevel::warning, "request " + std::to_string(id) + " failed: " + to_string(code) + ": " + message);
  finish(self, id, make_failure(id, code, std::move(message)));
}

// The request completes with the tokens it has (tokens_final): the decode
// worker's done, or every token streamed (then a decode worker that has not
// said done is told to drop it). Timings a missing half would have given are 0.
void complete(Self self, RequestId id) {
  Request& r = self->state.requests.at(id);
  const Attempt* a = attempt_of(r);
  const auto* decoding = std::get_if<Decoding>(&r.phase);
  RequestOutcome out;
  out.prompt_tokens = r.prompt;
  const ptrdiff_t allowed = token_allowance(self, r);
  if (const DecodeDone* done = done_of(r)) {
    out.tokens = r.earlier;  // a migrated request: what its lost decode worker had streamed
    out.tokens.insert(out.tokens.end(), done->tokens.begin(), done->tokens.end());
    out.finish = done->finish;
    if (ptrdiff_t(out.tokens.size()) > allowed) {  // (nor a worker's past it: cut at the length)
      out.tokens.resize(size_t(allowed));
      out.finish = FinishReason::length;
    }
    out.timings.decode_us = done->decode_us;
    // (a migrated attempt's cover the earlier output too: the prompt's come first)
    out.prompt_logprobs.assign(done->prompt_logprobs.begin(),
                               done->prompt_logprobs.begin() +
                                   std::min(done->prompt_logprobs.size(), r.prompt.empty() ? 0 : r.prompt.size() - 1));
  } else {
    out.tokens.assign(r.streamed.begin(),
                      r.streamed.begin() + std::min<ptrdiff_t>(ptrdiff_t(r.streamed.size()), allowed));
    out.finish = FinishReason::length;
    if (a)
      if (Worker* d = find_worker(self, a->decode_key)) self->send(d->decode, cancel_atom::value, id);
  }
  if (r.request.sampling.logprobs >= 0)
    out.logprobs.assign(r.logprobs.begin(),
                        r.logprobs.begin() + std::min(r.logprobs.size(), out.tokens.size()));
  out.text = std::move(r.text);
  if (decoding && decoding->prefill_report) {
    const PrefillReport& report = *decoding->prefill_report;
    out.timings.prefill_us = report.prefill_us;
    out.timings.kv_transfer_us = report.kv_transfer_us;
    out.timings.kv_bytes = report.kv_bytes;
    out.timings.kv_streamed = report.streamed;
  }
  out.timings.cached_tokens = a ? a->cached_tokens : 0;
  finish(self, id, std::move(out));
}

// Both halves are in: the decode worker's done, and the prefill worker's
// report unless none is waited for any more (prefill_over).
void complete_if_done(Self self, RequestId id) {
  auto it = self->state.requests.find(id);
  if (it == self->state.requests.end()) return;
  const auto* d = std::get_if<Decoding>(&it->second.phase);
  if (!d || (!d->prefill_report && !d->prefill_over) || !d->done) return;
  complete(self, id);
}

std::vector<PrefillCandidate> prefill_candidates(Self self) {
  std::vector<PrefillCandidate> out;
  for (const auto& kv : self->state.workers)
    if (kv.second.prefill && kv.second.responsive)
      out.push_back({kv.first, kv.second.in_flight, kv.second.outstanding_tokens, !kv.second.info.colocated.empty()});
  return out;
}

// A colocated decode worker's prefill worker: the responsive one of its unit.
WorkerKey colocated_partner(Self self, const Worker& decode) {
  for (const auto& kv : self->state.workers)
    if (kv.second.prefill && kv.second.responsive && kv.second.info.colocated == decode.info.colocated)
      return kv.first;
  return 0;
}

std::vector<DecodeCandidate> decode_candidates(Self self) {
  std::vector<DecodeCandidate> out;
  for (const auto& kv : self->state.workers) {
    const Worker& w = kv.second;
    if (!w.decode || !w.responsive) continue;
    DecodeCandidate c{kv.first, std::max(1, w.info.block_size), w.info.total_blocks, w.room.free_blocks(),
                      w.room.active_sequences()};
    if (!w.info.colocated.empty()) {
      c.colocated = true;
      c.partner = colocated_partner(self, w);
    }
    out.push_back(c);
  }
  return out;
}

// The job prompt's block hashes for `block_size` (engine/block_hash.h), as the
// workers' caches name their blocks.
const std::vector<uint64_t>& prompt_hashes(Self self, Request& r, int block_size) {
  const size_t tokens = r.prompt.size() + r.earlier.size();
  if (r.hashed_block_size != block_size || r.hashed_tokens != tokens) {
    r.hashes = gpu::block_hashes(job_prompt(r), block_size,
                                 gpu::block_hash_seed(self->state.model->fingerprint, block_size, r.request.cache_salt));
    r.hashed_block_size = block_size;
    r.hashed_tokens = tokens;
  }
  return r.hashes;
}

// How many of the job prompt's positions each worker's prefix cache holds
// for `block_size`, as the router's index says (PrefixHolders; a worker it
// does not name holds none), at most all but the last position: a worker
// computes that one itself.
std::unordered_map<WorkerKey, int> cached_positions(Self self, Request& r, int block_size) {
  if (block_size <= 0) return {};
  auto cached = self->state.holders.matched(prompt_hashes(self, r, block_size));
  const int most = (int(job_prompt_len(r)) - 1) / block_size;
  for (auto& kv : cached) kv.second = std::min(kv.second, most) * block_size;
  return cached;
}

// The request's prompt blocks, in the index of the worker it was just sent
// to (PrefixIndex::predict): the next request of its group finds them there
// before the worker's own events come.
void predict_prefix(Self self, Request& r, Worker& w) {
  if (!self->state.model || self->state.config.kv_routing_prefill_weight <= 0 || w.info.block_size <= 0) return;
  w.prefix.predict(prompt_hashes(self, r, w.info.block_size));
}

// KV-aware routing (README "Prefix caching"): a decode candidate's
// compute_cost is kv-routing-prefill-weight x the prompt's blocks its prefix
// cache lacks; a prefill candidate's compute_tokens the positions it would
// compute. Only steers: each worker decides what it shares.
void score_prefixes(Self self, Request& r, std::vector<DecodeCandidate>& decodes,
                    std::vector<PrefillCandidate>& prefills) {
  auto& st = self->state;
  if (!st.model || st.config.kv_routing_prefill_weight <= 0) return;
  const int tokens = int(job_prompt_len(r));
  std::map<int, std::unordered_map<WorkerKey, int>> by_block_size;  // (one entry, unless pools differ)
  auto positions_at = [&](WorkerKey key, int block_size) {
    auto it = by_block_size.find(block_size);
    if (it == by_block_size.end()) it = by_block_size.emplace(block_size, cached_positions(self, r, block_size)).first;
    auto found = it->second.find(key);
    return found == it->second.end() ? 0 : found->second;
  };
  for (DecodeCandidate& c : decodes) {
    const int blocks = gpu::KvPool::blocks_for(tokens, c.block_size);
    const int cached = positions_at(c.key, c.block_size) / c.block_size;
    c.compute_cost = st.config.kv_routing_prefill_weight * double(blocks - cached);
  }
  for (PrefillCandidate& c : prefills) {
    const Worker* w = find_worker(self, c.key);
    c.compute_tokens = tokens - (w && w->info.block_size > 0 ? positions_at(c.key, w->info.block_size) : 0);
  }
}

void dispatch(Self self);
void on_prefill_report(Self self, RequestId id, uint64_t attempt, PrefillReport report, WorkerKey silent);
enum class Rescue { retried, completed, failed };
Rescue retry_or_fail(Self self, RequestId id, const std::string& why, WorkerKey lost);
void on_reservation(Self self, RequestId id, uint64_t attempt, ReserveReply reply);

// Milliseconds left of the request's deadline (at least 1).
int64_t time_left_ms(const Request& r) {
  const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - r.accepted);
  return std::max<int64_t>(1, r.request.deadline_ms - elapsed.count());
}

// Books the request on both workers (a prefill slot, the decode blocks) and
// asks the decode worker to reserve the blocks; the prefill job waits for its
// answer, so no prompt is computed for a worker without room.
void start(Self self, RequestId id, WorkerKey prefill_key, WorkerKey decode_key) {
  auto& st = self->state;
  Request& r = st.requests.at(id);
  Worker& p = st.workers.at(prefill_key);
  Worker& d = st.workers.at(decode_key);
  const int positions = gpu::kv_positions_needed(int(job_prompt_len(r)), job_new_tokens(r), st.limits->seq_len);
  if (!r.dispatched) r.dispatched = Clock::now();
  Attempt a;
  a.serial = st.next_serial++;
  a.prefill_key = prefill_key;
  a.decode_key = decode_key;
  a.reserved_blocks = gpu::KvPool::blocks_for(positions, std::max(1, d.info.block_size));
  r.phase = Reserving{a};
  p.in_flight += 1;
  p.outstanding_tokens += job_prompt_len(r);
  d.room.reserve(a.reserved_blocks);
  st.sessions.remember(r.request.session, decode_key);
  predict_prefix(self, r, d);

  // The lease outlives the request's deadline by the ack timeout: a request
  // still alive never loses its blocks, a lost one frees them by itself.
  KvReservation reservation{id, positions, time_left_ms(r) + st.config.ack_timeout_ms, int32_t(job_prompt_len(r)),
                            p.info.host_id};
  // (A request for prompt log probabilities computes every position: it
  // neither shares cached blocks nor leaves its own.)
  if (r.request.sampling.prompt_logprobs < 0) reservation.prompt_tokens = job_prompt(r);
  reservation.cache_salt = r.request.cache_salt;
  reservation.local_prefill_tokens = st.config.local_prefill_tokens;
  if (streams_direct(st.config, bool(st.tokenizer), r)) reservation.client = r.client;
  reservation.attempt = a.serial;
  const uint64_t attempt = a.serial;
  self->request(d.decode, std::chrono::milliseconds(st.config.ack_timeout_ms), reserve_atom::value, reservation)
      .then([=](ReserveReply& reply) { on_reservation(self, id, attempt, std::move(reply)); },
            [=](caf::error& e) {
              on_reservation(self, id, attempt,
                             ReserveReply{id, code_of(e), describe("decode worker (reservation)", e), {}});
            });
}

// The blocks are reserved (at `target`): the prefill worker runs the prompt
// and ships the KV.
void send_prefill_job(Self self, RequestId id, KvTarget target) {
  auto& st = self->state;
  Request& r = st.requests.at(id);
  const Attempt a = std::get<Reserving>(r.phase).attempt;
  Worker* p = find_worker(self, a.prefill_key);
  Worker* d = find_worker(self, a.decode_key);
  if ((!p && !a.local_prefill) || !d) {  // gone meanwhile (remove_worker fails its requests; defensive)
    fail(self, id, ErrorCode::worker_lost, "a worker chosen for the request went down");
    return;
  }
  r.phase = Prefilling{a};
  PrefillJob job;
  job.id = id;
  job.prompt_tokens = job_prompt(r);
  job.max_new_tokens = job_new_tokens(r);
  job.first_step = int32_t(r.earlier.size());
  job.sampling = r.request.sampling;
  job.deadline_ms = time_left_ms(r);
  job.target = std::move(target);
  job.cache_salt = r.request.cache_salt;
  job.attempt = a.serial;
  if (p && !a.local_prefill && p->info.cache_blocks > 0) predict_prefix(self, r, *p);
  const uint64_t attempt = a.serial;
  const WorkerKey prefill_key = a.prefill_key;
  const WorkerKey decode_key = a.decode_key;
  const int64_t prompt_tokens = job_prompt_len(r);
  // The router's own deadline timer fires first; this bound only guarantees
  // that the response handler itself never waits forever.
  const auto bound = std::chrono::milliseconds(job.deadline_ms + st.config.ack_timeout_ms);
  const bool local = a.local_prefill;
  auto on_report = [=](PrefillReport& report) {
    release_prefill_slot(self, prefill_key, prompt_tokens);  // (none booked for a local prefill)
    on_prefill_report(self, id, attempt, std::move(report), 0);
  };
  auto on_error = [=](caf::error& e) {
    release_prefill_slot(self, prefill_key, prompt_tokens);
    PrefillReport report;
    report.id = id;
    report.code = code_of(e);
    report.message = describe(local ? "decode worker (its own prefill)" : "prefill worker", e);
    on_prefill_report(self, id, attempt, std::move(report), local ? decode_key : prefill_key);
  };
  if (local)
    self->request(d->decode, bound, prefill_atom::value, std::move(job)).then(on_report, on_error);
  else
    self->request(p->prefill, bound, prefill_atom::value, std::move(job), d->decode).then(on_report, on_error);
}

// Puts a dispatched request that holds nothing on its workers any more back
// at the front of the queue.
void back_to_queue(Self self, Request& r) {
  release_reservations(self, r);
  r.phase = Queued{};  // answers about the previous dispatch are stale now
  self->state.queue.push_front(r);
}

// The same, for another decode worker than this one, within its retries.
void requeue_elsewhere(Self self, Request& r) {
  r.excluded.push_back(attempt_of(r)->decode_key);
  r.retries += 1;
  back_to_queue(self, r);
}

// Later attempts go to another decode worker than `key` while another could
// hold the request (Request::avoided).
void avoid(Request& r, WorkerKey key) {
  if (std::find(r.avoided.begin(), r.avoided.end(), key) == r.avoided.end()) r.avoided.push_back(key);
}

// The decode worker's answer to a reservation.
void on_reservation(Self self, RequestId id, uint64_t attempt, ReserveReply reply) {
  auto& st = self->state;
  auto it = st.requests.find(id);
  auto* reserving = it == st.requests.end() ? nullptr : std::get_if<Reserving>(&it->second.phase);
  if (!reserving || reserving->attempt.serial != attempt) {
    // Finished meanwhile: finish() released its books and told the decode
    // worker to drop it (a reservation made after that cancel is refused or
    // dropped there).
    dispatch(self);
    return;
  }
  Request& r = it->second;
  Attempt& a = reserving->attempt;
  if (Worker* d = find_worker(self, a.decode_key))
    if (reply.load.total_blocks > 0) d->room.reported(reply.load);
  if (reply.code == ErrorCode::none) {
    a.cached_tokens = cached_prompt_tokens(reply.cached_tokens, 0, int32_t(r.prompt.size()));
    const Worker* d = find_worker(self, a.decode_key);
    if (reply.target.local() && d && d->info.colocated.empty()) {
      // Conditional disaggregation: the prefill worker booked at start() is
      // not needed after all.
      release_prefill_slot(self, a.prefill_key, job_prompt_len(r));
      a.prefill_key = 0;
      a.local_prefill = true;
    }
    const bool slot_freed = a.local_prefill;
    send_prefill_job(self, id, std::move(reply.target));
    if (slot_freed) dispatch(self);  // (a request that waits for that prefill slot goes now)
    return;
  }
  // Refused or unanswered: no job went out.
  if (reply.code == ErrorCode::overloaded) {
    // No room there now. Its real load is in the router's books from this
    // answer (the booking goes, adding nothing free), so the request waits
    // at the front of the queue until some decode worker has room (another
    // one, or this one after a finish).
    if (Worker* d = find_worker(self, a.decode_key); d && a.reserved_blocks > 0) d->room.refused(a.reserved_blocks);
    a.reserved_blocks = 0;
    release_prefill_slot(self, a.prefill_key, job_prompt_len(r));
    back_to_queue(self, r);
  } else if ((reply.code == ErrorCode::timeout || reply.code == ErrorCode::worker_lost) &&
             r.retries < st.config.max_decode_retries) {
    // Unanswered: it may hold the blocks after all; try another worker (or,
    // when no other could hold the request, this one again: it said no
    // "no room"), within max-decode-retries.
    if (Worker* d = find_worker(self, a.decode_key)) self->send(d->decode, cancel_atom::value, id);
    release_prefill_slot(self, a.prefill_key, job_prompt_len(r));
    avoid(r, a.decode_key);
    r.retries += 1;
    back_to_queue(self, r);
  } else {
    fail(self, id, reply.code, std::move(reply.message));  // finish() frees the slot and the blocks
  }
  dispatch(self);
}

// Moves queued requests to workers, oldest first, while there is room.
void dispatch(Self self) {
  auto& st = self->state;
  const BooksMetrics books{st};
  while (!st.queue.empty() && st.limits) {
    const RequestId id = st.queue.front();
    Request& r = st.requests.at(id);
    if (!r.validated) {
      if (auto problem = validate_request(r.request, r.prompt, st.limits); !problem.empty()) {
        fail(self, id, ErrorCode::invalid_request, problem);
        continue;
      }
      r.validated = true;
    }
    auto decodes = decode_candidates(self);
    auto prefills = prefill_candidates(self);
    score_prefixes(self, r, decodes, prefills);
    if (r.request.up_to_capacity && r.earlier.empty() && !decodes.empty()) {
      // The client asked for as much as the context holds: as much as a pool holds.
      const int most = most_new_tokens(decodes, int(r.prompt.size()));
      if (most >= 1 && most < r.request.max_new_tokens) r.request.max_new_tokens = most;
    }
    const int positions = gpu::kv_positions_needed(int(job_prompt_len(r)), job_new_tokens(r), st.limits->seq_len);
    if (!decodes.empty() && !any_decode_could_fit(decodes, positions, r.excluded)) {
      fail(self, id, ErrorCode::overloaded,
           r.excluded.empty()
               ? "no decode worker can hold " + std::to_string(positions) + " positions"
               : "every decode worker that could hold the request answered overloaded");
      continue;
    }
    // A restart goes to a decode worker its failed attempts did not use,
    // unless none of the others could ever hold it.
    std::vector<WorkerKey> shunned = r.excluded;
    shunned.insert(shunned.end(), r.avoided.begin(), r.avoided.end());
    if (r.avoided.empty() || !any_decode_could_fit(decodes, positions, shunned)) shunned = r.excluded;
    // Nothing yet: every prefill worker is busy, or no decode worker has
    // room; wait for a report, a finish or a load report.
    const auto pair = pick_workers(prefills, decodes, st.config.max_prefill_inflight, positions,
                                   st.sessions.find(r.request.session), shunned, st.prefill_cursor, st.decode_cursor);
    if (!pair) return;
    st.queue.pop_front();
    start(self, id, pair->prefill, pair->decode);
  }
}

// The prefill worker's answer to a job (its slot is already released).
// `silent`: the worker that did not answer it (the report is the router's
// own, from the request's error), 0 when a worker did.
void on_prefill_report(Self self, RequestId id, uint64_t attempt, PrefillReport report, WorkerKey silent) {
  auto& st = self->state;
  auto it = st.requests.find(id);
  Attempt* a = it == st.requests.end() ? nullptr : current_attempt(it->second, attempt);
  if (!a) {
    dispatch(self);  // finished or retried meanwhile; the freed slot may take another
    return;
  }
  Request& r = it->second;
  if (report.code == ErrorCode::none) {
    // (a prompt its prefill worker's own cache held more of than the decode
    // worker's: that many positions were not computed)
    a->cached_tokens = cached_prompt_tokens(a->cached_tokens, report.cached_tokens, int32_t(r.prompt.size()));
    if (Decoding* d = to_decoding(r)) {
      d->prefill_report = std::move(report);
      complete_if_done(self, id);
    }
  } else if (auto* decoding = std::get_if<Decoding>(&r.phase)) {
    // The decode worker already has the KV (its tokens stream): whatever
    // went wrong at the prefill worker since (its ack wait, the worker going
    // down) is no failure of the request.
    node_log(LogLevel::warning, "request " + std::to_string(id) + ": its prefill worker answered " +
                                    to_string(report.code) + " (" + report.message +
                                    ") after its decode worker took the KV; it goes on there");
    decoding->prefill_over = true;
    complete_if_done(self, id);
  } else if (report.code == ErrorCode::overloaded && r.retries < st.config.max_decode_retries) {
    // A decode worker that had reserved the blocks should never say this;
    // nothing is held there then, so try another one.
    if (Worker* d = find_worker(self, a->decode_key))
      if (report.decode_load.total_blocks > 0) d->room.reported(report.decode_load);
    end_attempt(self, r, true);  // (should it hold them after all)
    requeue_elsewhere(self, r);
  } else if (report.code == ErrorCode::worker_lost) {
    // The prefill worker lost its KV stream to the decode worker (that node
    // died, and the router may not have heard yet), or the job's worker is
    // gone (`silent`): a lost worker, so the request starts over as when the
    // router sees one go (max-worker-retries).
    retry_or_fail(self, id, report.message, silent);
  } else {
    fail(self, id, report.code, std::move(report.message));
  }
  dispatch(self);
}

// Deadlines: a few wake-ups serve every request's (actors/deadlines.h: CAF
// 0.17 cannot cancel a timer, and one per request stayed pending long after
// it ended; RouterStatus::deadline_wakeups counts them).

caf::typed_response_promise<RequestOutcome> admit(Self self, GenerateRequest& request,
                                                  client_actor& client) {
  auto& st = self->state;
  // (before the promise: making it takes the sender out of the message)
  const auto requester = caf::actor_cast<caf::actor_addr>(self->current_sender());
  auto promise = self->make_response_promise<RequestOutcome>();
  const RequestId id = request.id;
  auto reject = [&](ErrorCode code, std::string message) {
    node_log(LogLevel::warning, "request " + std::to_string(id) + " refused: " + to_string(code) + ": " + message);
    promise.deliver(make_failure(id, code, std::move(message)));
    return promise;
  };
  if (st.requests.count(id))
    return reject(ErrorCode::invalid_request, "request id " + std::to_string(id) + " is already in flight");
  std::vector<int32_t> prompt = request.prompt_tokens;
  if (request.prompt_is_text) {
    if (!st.tokenizer) return reject(ErrorCode::invalid_request, "text prompt, but the router has no tokenizer");
    // Checked before encoding: encoding is quadratic, on this actor's thread.
    if (int64_t(request.prompt_text.size()) > st.config.max_prompt_bytes)
      return reject(ErrorCode::invalid_request,
                    "text prompt of " + std::to_string(request.prompt_text.size()) +
                        " bytes exceeds max-prompt-bytes " + std::to_string(st.config.max_prompt_bytes));
    prompt = st.tokenizer->encode(request.prompt_text);
  }
  if (auto problem = validate_request(request, prompt, st.limits); !problem.empty())
    return reject(ErrorCode::invalid_request, problem);
  if (request.deadline_ms == 0) request.deadline_ms = st.config.default_deadline_ms;

  Request r;
  r.previous_token = prompt.back();
  r.prompt = std::move(prompt);
  r.request = std::move(request);
  r.client = std::move(client);
  r.requester = requester;
  r.promise = promise;
  r.validated = st.limits.has_value();
  r.accepted = Clock::now();
  r.deadline = r.accepted + std::chrono::milliseconds(r.request.deadline_ms);
  const Clock::time_point deadline = r.deadline;
  if (r.client) {
    // One monitor a client actor, however many of its requests are here:
    // CAF keeps one for each monitor() until the client ends (a long-lived
    // client's grew with every request it made); its last request's end
    // removes it (finish). A registered worker is watched already.
    if (!st.clients.count(r.client.address()) && !st.by_address.count(r.client.address())) self->monitor(r.client);
    st.clients.emplace(r.client.address(), id);
  }
  st.queue.push_back(st.requests.emplace(id, std::move(r)).first->second);
  dispatch(self);
  // Still waiting, and the waiting room was already full: turn it away now.
  auto it = st.requests.find(id);
  const bool further = it != st.requests.end() && AdmissionQueue::further_choice(it->second);
  if (it != st.requests.end() && is_queued(it->second) && !further &&
      st.queue.counted() > size_t(st.config.queue_capacity)) {
    fail(self, id, ErrorCode::overloaded,
         "admission queue full (" + std::to_string(st.config.queue_capacity) + " waiting)");
  } else if (further && is_queued(it->second) &&
             st.queue.choices.size() > size_t(st.config.queue_capacity) * size_t(kMaxChoices - 1)) {
    // (they wait behind every request of their own; a client naming first
    // choices that are not there must not grow their line without bound)
    fail(self, id, ErrorCode::overloaded,
         "admission queue full (" + std::to_string(st.queue.choices.size() - 1) + " further choices waiting)");
  } else if (it != st.requests.end()) {
    arm_wakeup(self, st.deadlines.add(deadline, id, Clock::now()), deadline_atom::value);
  }
  return promise;
}

// Why a worker may not join, if it may not: another cluster's name, another model than the
// cluster's (its KV would be garbage to the others: the fingerprint hashes
// every byte of the checkpoint), both for good; or, for now, a name another
// worker holds.
struct Refusal {
  caf::sec code;
  std::string why;
};
std::optional<Refusal> refusal(Self self, const WorkerInfo& info, const caf::actor_addr& address) {
  const auto& st = self->state;
  // A worker node's relay names its cluster; an in-process worker (same
  // node as the router, e.g. node/local_cluster.h) is the router's own.
  const bool own_process = info.cluster.empty() && address.node() == self->node();
  if (!own_process && info.cluster != st.config.cluster)
    return Refusal{kRegistrationRefused, "it belongs to cluster \"" + info.cluster + "\", this router serves cluster \"" + st.config.cluster + "\""};
  if (st.model && (info.model.fingerprint != st.model->fingerprint || info.model.vocab_size != st.model->vocab_size ||
                   info.model.seq_len != st.model->seq_len))
    return Refusal{kRegistrationRefused, "its model (fingerprint " + std::to_string(info.model.fingerprint) + ", vocabulary " +
           std::to_string(info.model.vocab_size) + ", context " + std::to_string(info.model.seq_len) +
           ") is not the cluster's (fingerprint " + std::to_string(st.model->fingerprint) + ", vocabulary " +
           std::to_string(st.model->vocab_size) + ", context " + std::to_string(st.model->seq_len) + ")"};
  for (const auto& kv : st.workers)
    if (kv.second.info.name == info.name && kv.second.address != address)
      return Refusal{kRegistrationNameHeld, "the name \"" + info.name + "\" is taken by another worker"};
  // Registered again (its relay's retry): what the router's books were made
  // from (its role, its pool, its partner, its host) cannot change under them.
  if (auto known = st.by_address.find(address); known != st.by_address.end()) {
    const WorkerInfo& was = st.workers.at(known->second).info;
    if (info.role != was.role || info.block_size != was.block_size || info.total_blocks != was.total_blocks ||
        info.cache_blocks != was.cache_blocks || info.colocated != was.colocated || info.host_id != was.host_id)
      return Refusal{kRegistrationRefused, "it registered before as another " + to_string(was.role) +
                                               " worker (its role, block size, blocks, colocated unit or host)"};
  }
  return std::nullopt;
}

// A refused registration: logged here, and the error the worker's relay acts on.
caf::error refuse(const WorkerInfo& info, const Refusal& r) {
  const std::string message = "registration of " + to_string(info.role) + " worker \"" + info.name +
                              "\" refused: " + r.why;
  node_log(r.code == kRegistrationRefused ? LogLevel::error : LogLevel::warning, message);
  return caf::make_error(r.code, message);
}

// Asks a worker for all it caches: its index starts again from there.
void request_snapshot(Self self, WorkerKey key) {
  Worker* w = find_worker(self, key);
  if (!w || w->snapshot_pending) return;
  w->snapshot_pending = true;
  auto on_snapshot = [=](KvEvents& snapshot) {
    if (Worker* found = find_worker(self, key)) {
      found->snapshot_pending = false;
      snapshot.snapshot = true;
      found->prefix.apply(snapshot);
    }
  };
  auto on_error = [=](caf::error&) {
    if (Worker* found = find_worker(self, key)) found->snapshot_pending = false;  // the next batch asks again
  };
  const auto timeout = std::chrono::milliseconds(self->state.config.ack_timeout_ms);
  if (w->decode) self->request(w->decode, timeout, kv_events_atom::value).then(on_snapshot, on_error);
  else self->request(w->prefill, timeout, kv_events_atom::value).then(on_snapshot, on_error);
}

void add_worker(Self self, WorkerInfo info, prefill_actor prefill, decode_actor decode) {
  auto& st = self->state;
  const caf::actor_addr address = prefill ? prefill.address() : decode.address();
  if (auto known = st.by_address.find(address); known != st.by_address.end()) {
    st.workers.at(known->second).info = std::move(info);  // registered again: refresh what it says
    return;
  }
  if (!st.model) {  // a router without disagg.model: its first worker's model is the cluster's
    st.model = info.model;
    if (!st.limits) st.limits = ModelLimits{info.model.vocab_size, info.model.seq_len};
    node_log(LogLevel::info, "the cluster's model is that of " + to_string(info.role) + " worker \"" + info.name +
                                 "\" (fingerprint " + std::to_string(info.model.fingerprint) + ")");
  }
  Worker w;
  w.address = address;
  w.prefill = std::move(prefill);
  w.decode = std::move(decode);
  w.room = DecodeRoom(info.total_blocks);
  w.prefix = PrefixIndex(size_t(std::max(0, w.decode ? info.total_blocks : info.cache_blocks)));
  w.info = std::move(info);
  if (w.prefill) self->monitor(w.prefill);
  if (w.decode) self->monitor(w.decode);
  node_log("registered " + to_string(w.info.role) + " worker " + w.info.name +
           (w.info.endpoint.empty() ? "" : " (KV endpoint " + w.info.endpoint + ")"));
  const WorkerKey key = st.next_worker_key++;
  const bool is_decode = bool(w.decode);
  st.by_address.emplace(address, key);
  st.prefill_count += is_decode ? 0 : 1;
  st.workers.emplace(key, std::move(w)).first->second.prefix.attach(&st.holders, key);
  if (is_decode) request_snapshot(self, key);  // (a worker that restarted starts from what it holds now)
  dispatch(self);
}

// The requests that still need worker `key`: on a prefill worker, those it
// has not handed to their decode worker yet (prefill_holds); on a decode
// worker, those it has not said done for.
std::vector<RequestId> requests_on(Self self, WorkerKey key) {
  std::vector<RequestId> out;
  for (const auto& kv : self->state.requests) {
    const Request& r = kv.second;
    const Attempt* a = attempt_of(r);
    if (!a) continue;
    if ((a->prefill_key == key && prefill_holds(r)) || (a->decode_key == key && !done_of(r)))
      out.push_back(kv.first);
  }
  return out;
}

// Prefill worker `key` is gone or silent: the requests whose KV it had
// already handed over wait for its report no longer (those whose decode
// worker is done complete now). Returns how many there were.
size_t let_go_of_prefill_worker(Self self, WorkerKey key) {
  std::vector<RequestId> past;
  for (auto& kv : self->state.requests) {
    auto* d = std::get_if<Decoding>(&kv.second.phase);
    if (!d || d->attempt.prefill_key != key || d->prefill_report || d->prefill_over) continue;
    d->prefill_over = true;
    past.push_back(kv.first);
  }
  for (RequestId id : past) complete_if_done(self, id);
  return past.size();
}

// A request whose worker went down or stopped answering starts over on other
// workers, at most max-worker-retries times (past that: worker_lost). Before
// its first token it simply runs again. After it (its decode worker was
// lost mid-generation) it migrates: the next prefill runs the prompt plus the
// tokens already streamed and samples from step k = their count, so, with the
// fixed arithmetic and sampling stateless per step, the continuation is
// exactly the tokens the lost worker would have made; the client's stream
// goes on at index k, with no gap and no duplicate. A request whose tokens
// are all there (tokens_final) completes instead. `lost`: the worker that
// went down or silent; 0: the link between the attempt's two workers. The
// next attempt avoids the decode worker unless it was the prefill worker's.
Rescue retry_or_fail(Self self, RequestId id, const std::string& why, WorkerKey lost) {
  auto& st = self->state;
  Request& r = st.requests.at(id);
  if (tokens_final(self, r)) {
    complete(self, id);
    return Rescue::completed;
  }
  if (r.worker_retries >= st.config.max_worker_retries) {
    fail(self, id, ErrorCode::worker_lost,
         why + " (restarted " + std::to_string(r.worker_retries) + " times, " + std::to_string(r.streamed.size()) +
             " tokens streamed)");
    return Rescue::failed;
  }
  r.worker_retries += 1;
  r.earlier = r.streamed;
  if (const Attempt* a = attempt_of(r))
    if (lost == 0 || lost == a->decode_key) avoid(r, a->decode_key);
  // Both workers drop what they hold of this attempt (a hung one when it
  // wakes); their late answers name an old attempt and are ignored.
  end_attempt(self, r, true);
  node_log(LogLevel::warning, "request " + std::to_string(id) + " starts over on other workers (retry " +
                                  std::to_string(r.worker_retries) +
                                  (r.earlier.empty() ? "" : ", continuing after " + std::to_string(r.earlier.size()) +
                                                                " streamed tokens") +
                                  "): " + why);
  back_to_queue(self, r);
  return Rescue::retried;
}

// How the requests that needed a lost or silent worker ended up, for its log line.
struct RescueCount {
  int retried = 0, completed = 0, failed = 0;
  size_t handed_over = 0;  // a prefill worker's requests already on their decode worker
  void add(Rescue r) { (r == Rescue::retried ? retried : r == Rescue::completed ? completed : failed) += 1; }
  std::string describe() const {
    std::string s = std::to_string(retried) + " start over elsewhere, " + std::to_string(failed) +
                    " fail with worker_lost, " + std::to_string(completed) + " complete";
    if (handed_over > 0) s += "; " + std::to_string(handed_over) + " already on their decode worker go on there";
    return s;
  }
};

void remove_worker(Self self, const caf::actor_addr& address) {
  auto& st = self->state;
  auto known = st.by_address.find(address);
  if (known == st.by_address.end()) return;
  const WorkerKey key = known->second;
  const std::string name = st.workers.at(key).info.name;
  const std::vector<RequestId> lost = requests_on(self, key);
  RescueCount count;
  count.handed_over = let_go_of_prefill_worker(self, key);
  for (RequestId id : lost)
    if (st.requests.count(id)) count.add(retry_or_fail(self, id, "worker " + name + " went down", key));
  node_log(LogLevel::error, "lost worker " + name + " (" + std::to_string(lost.size()) +
                                " requests needed it: " + count.describe() + ")");
  st.sessions.forget_worker(key);
  st.prefill_count -= st.workers.at(key).prefill ? 1 : 0;
  st.workers.at(key).prefix.detach();
  st.by_address.erase(address);
  st.workers.erase(key);
  dispatch(self);
}

// Heartbeats: every heartbeat-interval-ms each worker is asked for its
// status. One that has not answered within heartbeat-timeout-ms (a hung or
// stopped process: its connection is still open, so CAF reports nothing) gets
// no new work, and the requests that still need it start over or migrate
// (requests_on: not those a prefill worker had already handed to their
// decode worker); it gets work again once it answers.
void on_heartbeat_answer(Self self, WorkerKey key) {
  Worker* w = find_worker(self, key);
  if (!w) return;
  w->heartbeat_pending = false;
  if (w->responsive) return;
  w->responsive = true;
  node_log(LogLevel::warning, "worker " + w->info.name + " answers again: it gets work again");
  dispatch(self);
}

void on_heartbeat_silence(Self self, WorkerKey key) {
  Worker* w = find_worker(self, key);
  if (!w) return;
  w->heartbeat_pending = false;
  if (!w->responsive) return;
  w->responsive = false;
  const std::string name = w->info.name;
  const std::vector<RequestId> stuck = requests_on(self, key);
  RescueCount count;
  count.handed_over = let_go_of_prefill_worker(self, key);
  for (RequestId id : stuck)
    if (self->state.requests.count(id)) count.add(retry_or_fail(self, id, "worker " + name + " stopped answering", key));
  node_log(LogLevel::error, "worker " + name + " did not answer a heartbeat within " +
                                std::to_string(self->state.config.heartbeat_timeout_ms) + " ms: no new work (" +
                                std::to_string(stuck.size()) + " requests need it: " + count.describe() + ")");
  dispatch(self);
}

void send_heartbeats(Self self) {
  const auto timeout = std::chrono::milliseconds(self->state.config.heartbeat_timeout_ms);
  for (auto& [key, w] : self->state.workers) {
    if (w.heartbeat_pending) continue;  // still waiting for the last one
    w.heartbeat_pending = true;
    const WorkerKey k = key;
    auto on_error = [=](caf::error&) { on_heartbeat_silence(self, k); };
    if (w.prefill)
      self->request(w.prefill, timeout, status_atom::value)
          .then([=](PrefillLoad&) { on_heartbeat_answer(self, k); }, on_error);
    else
      self->request(w.decode, timeout, status_atom::value)
          .then([=](DecodeLoad&) { on_heartbeat_answer(self, k); }, on_error);
  }
}

RouterStatus status_of(Self self) {
  const auto& st = self->state;
  RouterStatus s;
  for (const auto& kv : st.workers) {
    const Worker& w = kv.second;
    WorkerStatus ws;
    ws.name = w.info.name;
    ws.role = w.info.role;
    ws.fingerprint = w.info.model.fingerprint;
    ws.in_flight = w.prefill ? w.in_flight : w.room.requests();
    ws.outstanding_tokens = w.outstanding_tokens;
    ws.free_blocks = w.room.free_blocks();
    ws.total_blocks = w.info.total_blocks;
    ws.active_sequences = w.room.active_sequences();
    ws.cached_blocks = int32_t(w.prefix.held());
    ws.endpoint = w.info.endpoint;
    ws.responsive = w.responsive;
    s.workers.push_back(std::move(ws));
  }
  s.queued = int32_t(st.queue.size());
  s.in_flight = int32_t(st.requests.size() - st.queue.size());
  s.deadline_wakeups = int32_t(st.deadlines.wakeups());
  return s;
}

// A token from the request's decode worker: recorded (what a migration
// continues from, the text, metrics) and, unless that worker streams to the
// client itself, forwarded to it; once per index, in order.
void forward_token(Self self, TokenEvent& event) {
  Request* found = from_its_decode_worker(self, event.id, event.attempt);
  if (!found) return;
  Request& r = *found;
  // Each index once, in order (an attempt's tokens start where the earlier
  // ones' stopped: a worker that sends another index breaks the protocol),
  // and none past the request's allowance (nor does such a worker's).
  if (event.index != int32_t(r.streamed.size()) || event.index >= token_allowance(self, r)) return;
  if (self->state.tokenizer && r.request.token_text) {
    try {
      event.text = self->state.tokenizer->decode(r.previous_token, event.token);
    } catch (const std::exception&) {
      event.text.clear();  // an id the tokenizer lacks: no text, tokens still count
    }
    r.text += event.text;
  }
  r.previous_token = event.token;
  r.streamed.push_back(event.token);
  if (r.request.sampling.logprobs >= 0) r.logprobs.push_back(event.logprobs);
  const Decoding* d = to_decoding(r);  // the decode worker has the KV (from_its_decode_worker: not before)
  record_token(r.accepted, r.last_token);
  event.cached_tokens = d->attempt.cached_tokens;
  if (r.client && !streams_direct(self->state.config, bool(self->state.tokenizer), r))
    self->send(r.client, token_atom::value, std::move(event));
}

// A client gone: its requests are cancelled, their blocks freed now, not at
// their deadlines (a client that got its reply has quit normally: nothing of
// it is left). A worker gone is removed, also when it was named as some
// request's client too (anyone may name any actor as one).
void on_down(Self self, caf::down_msg& down) {
  auto& clients = self->state.clients;
  std::vector<RequestId> orphans;
  auto [first, last] = clients.equal_range(down.source);
  for (auto c = first; c != last; ++c) orphans.push_back(c->second);
  for (RequestId id : orphans) fail(self, id, ErrorCode::cancelled, "the client went away");
  if (self->state.by_address.count(down.source)) {
    remove_worker(self, down.source);
  } else if (!orphans.empty()) {
    dispatch(self);
  }
}

// A decode worker's last word on a request: the end of its tokens, or its
// failure (which may come after every token had already streamed).
void on_decode_done(Self self, DecodeDone& done) {
  Request* found = from_its_decode_worker(self, done.id, done.attempt);
  if (!found) return;
  Request& r = *found;
  if (done.code != ErrorCode::none && tokens_final(self, r)) {
    release_reservations(self, r);  // freed at the decode worker
    complete(self, done.id);  // every token had streamed
  } else if (done.code != ErrorCode::none) {
    to_decoding(r)->done = done;  // the decode worker already dropped it
    fail(self, done.id, done.code, std::move(done.message));
  } else {
    release_reservations(self, r);  // freed at the decode worker
    to_decoding(r)->done = std::move(done);  // (a first token that ends it: no token event before)
    complete_if_done(self, r.request.id);
  }
  dispatch(self);
}

// A worker's prefix-cache changes: from a registered worker only; anybody
// else's are ignored. A gap in their numbering asks for a snapshot.
void on_kv_events(Self self, KvEvents& events) {
  const WorkerKey key = sender_key(self);
  Worker* w = find_worker(self, key);
  if (!w) return;
  if (w->prefix.apply(events) == PrefixIndex::Applied::resync || (!w->prefix.synced() && !w->snapshot_pending))
    request_snapshot(self, key);
}

// A request ended from outside (its deadline, the router's stop): it
// completes when its tokens are final (only a report was missing), else
// fails with `code`.
void end_request(Self self, RequestId id, ErrorCode code, std::string why) {
  if (tokens_final(self, self->state.requests.at(id)))
    complete(self, id);
  else
    fail(self, id, code, std::move(why));
}

// A cancel's sender is the request's client or whoever submitted it: no
// other holder of the router's handle (another frontend, a worker, an
// anonymous message) ends a request that is not its own.
bool may_cancel(Self self, RequestId id) {
  auto it = self->state.requests.find(id);
  if (it == self->state.requests.end() || !self->current_sender()) return false;
  const auto sender = caf::actor_cast<caf::actor_addr>(self->current_sender());
  const Request& r = it->second;
  return (r.client && sender == r.client.address()) || sender == r.requester;
}

// A wake-up: every request whose deadline has passed ends (timeout), and
// the next deadline gets its wake-up.
void on_wakeup(Self self, Clock::time_point at) {
  auto& st = self->state;
  std::vector<DeadlineSet<RequestId>::Entry> due;  // (out of the set here, whatever end_request does: never due twice)
  const std::optional<Clock::time_point> next = st.deadlines.fired(at, Clock::now(), due);
  for (const auto& [deadline, id] : due)
    if (auto it = st.requests.find(id); it != st.requests.end() && it->second.deadline == deadline)
      end_request(self, id, ErrorCode::timeout,
                  "deadline of " + std::to_string(it->second.request.deadline_ms) + " ms passed");
  if (!due.empty()) dispatch(self);
  arm_wakeup(self, next, deadline_atom::value);
}

router_actor::behavior_type router_behavior(Self self, DisaggConfig config,
                                            std::shared_ptr<const gpu::Tokenizer> tokenizer,
                                            std::optional<ModelInfo> model) {
  auto& st = self->state;
  if (model) st.limits = ModelLimits{model->vocab_size, model->seq_len};
  st.model = std::move(model);
  st.sessions = SessionAffinity(size_t(std::max(0, config.session_affinity_size)));
  st.config = std::move(config);
  st.tokenizer = std::move(tokenizer);
  if (st.config.heartbeat_interval_ms > 0)
    self->delayed_send(self, std::chrono::milliseconds(st.config.heartbeat_interval_ms), heartbeat_atom::value);
  self->set_down_handler([=](caf::down_msg& down) { on_down(self, down); });
  // Asked to stop (its node shuts down): every request still here gets its
  // terminal reply now (a promise destroyed unanswered sends nothing in CAF
  // 0.17: a requester that does not monitor the router waited out its own
  // timeout), and its workers are told to drop it.
  self->set_exit_handler([=](caf::exit_msg& exit) {
    if (exit.reason == caf::exit_reason::normal) return;  // (CAF's default: only another reason ends an actor)
    std::vector<RequestId> held;
    for (const auto& entry : self->state.requests) held.push_back(entry.first);
    for (RequestId id : held) end_request(self, id, ErrorCode::worker_lost, "the router shut down");
    self->quit(exit.reason);
  });
  return {
      [=](generate_atom, GenerateRequest& request, client_actor& client) {
        return admit(self, request, client);
      },
      [=](heartbeat_atom) {
        send_heartbeats(self);
        // Only the router's own timer schedules the next round: a round asked
        // for by anyone else (a test, an operator) starts no second chain
        // (with heartbeats off, one such message started a 0 ms loop).
        if (from_itself(self) && self->state.config.heartbeat_interval_ms > 0)
          self->delayed_send(self, std::chrono::milliseconds(self->state.config.heartbeat_interval_ms),
                             heartbeat_atom::value);
      },
      [=](cancel_atom, RequestId id) {
        if (!may_cancel(self, id)) return;
        fail(self, id, ErrorCode::cancelled, "cancelled by the client");
        dispatch(self);
      },
      [=](register_atom, WorkerInfo& info, prefill_actor& worker) -> caf::result<caf::ok_atom> {
        info.role = WorkerRole::prefill;
        if (auto why = refusal(self, info, worker.address())) return refuse(info, *why);
        add_worker(self, std::move(info), std::move(worker), decode_actor{});
        return caf::ok_atom::value;
      },
      [=](register_atom, WorkerInfo& info, decode_actor& worker) -> caf::result<caf::ok_atom> {
        info.role = WorkerRole::decode;
        if (auto why = refusal(self, info, worker.address())) return refuse(info, *why);
        add_worker(self, std::move(info), prefill_actor{}, std::move(worker));
        return caf::ok_atom::value;
      },
      [=](token_atom, TokenBatch& batch) {
        for (TokenEvent& event : batch.events) forward_token(self, event);
      },
      [=](done_atom, DecodeDone& done) { on_decode_done(self, done); },
      [=](load_atom, DecodeLoad& load) {
        if (Worker* w = sender_worker(self)) {
          w->room.reported(load);
          dispatch(self);
        }
      },
      [=](kv_events_atom, KvEvents& events) { on_kv_events(self, events); },
      [=](deadline_atom, int64_t at) {
        if (from_itself(self)) on_wakeup(self, wakeup_time(at));
      },
      [=](status_atom) { return status_of(self); },
  };
}

}  // namespace

router_actor spawn_router(caf::actor_system& system, const DisaggConfig& config,
                          std::shared_ptr<const gpu::Tokenizer> tokenizer, std::optional<ModelInfo> model,
                          RouterThread thread) {
  if (thread == RouterThread::own)
    return system.spawn<caf::detached>(router_behavior, config, std::move(tokenizer), std::move(model));
  return system.spawn(router_behavior, config, std::move(tokenizer), std::move(model));
}

}  // namespace disagg
