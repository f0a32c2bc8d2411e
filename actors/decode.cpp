#include "actors/decode.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <variant>

#include "actors/deadlines.h"
#include "actors/errors.h"
#include "actors/log.h"
#include "actors/prefill.h"
#include "actors/request_metrics.h"
#include "actors/senders.h"
#include "actors/timing.h"
#include "caf/all.hpp"
#include "engine/block_hash.h"
#include "engine/engine.h"
#include "engine/kv_stream.h"
#include "engine/generate.h"
#include "text/tokenizer.h"

namespace disagg {

namespace {

// The prefill worker's commit of a streamed KV, held until the receiver's
// verdict on the stream is in.
struct PendingCommit {
  KvTransfer transfer;
  caf::typed_response_promise<KvAck> promise;
};

// A request's blocks, taken when the router reserved them and held until its
// KV arrives (then they become the Sequence's), it is cancelled, or the lease
// timer with this serial fires. With a stream open (transfer_id != 0 and no
// verdict yet) the KV receiver may write into the blocks: they are freed only
// after the receiver gave them back (DecodeState::draining).
struct Reservation {
  std::vector<int32_t> blocks;  // the first `cached` of them shared from the prefix cache
  int32_t positions = 0;
  int32_t prompt_len = 0;       // KvReservation::prompt_len: the positions a stream fills
  uint64_t serial = 0;
  int32_t cached = 0;           // prompt positions those shared blocks hold
  std::vector<int32_t> prompt;  // KvReservation::prompt_tokens (empty: not cached)
  uint64_t hash_seed = 0;
  std::vector<uint64_t> hashes;  // of the prompt's full blocks (engine/block_hash.h)
  uint64_t transfer_id = 0;
  kv::Transport transport = kv::Transport::tcp;
  bool local = false;                   // the compute writes the KV in (kv/local.h), no receiver
  std::optional<KvLanded> verdict;      // the stream is over
  std::optional<PendingCommit> commit;  // arrived before the verdict
  client_actor client;                  // KvReservation::client: its tokens go there too
  uint64_t attempt = 0;                 // KvReservation::attempt: its tokens and done name it
  uint64_t ticket = 0;                  // KvTarget::ticket: the KV or commit must carry it
  Clock::time_point lease_end;          // KvReservation::lease_ms from its taking (DecodeState::leases)
  bool streaming() const { return transfer_id != 0 && !verdict && !local; }
};

struct Sequence {
  std::vector<int32_t> blocks;
  int32_t prompt_len = 0;
  std::vector<int32_t> prompt;  // the prompt's tokens when its blocks go to the prefix cache, else empty
  uint64_t hash_seed = 0;       // gpu::block_hash_seed of the request
  std::vector<uint64_t> hashes;  // of its full blocks so far (the prompt's, at first)
  int32_t limit = 0;  // output tokens the request may have in all: first_step + this attempt's gpu::token_limit
  Sampling sampling;
  std::vector<int32_t> context;  // KvTransfer::context: the tokens before tokens[0] when the sampling reads them
  std::vector<TokenLogprobs> prompt_logprobs;  // KvTransfer::prompt_logprobs, passed on in DecodeDone
  std::vector<int32_t> tokens;  // generated so far
  int32_t first_step = 0;       // the request's output index of tokens[0] (a migrated request: > 0)
  Clock::time_point admitted;
  // Streaming straight to the request's client (KvReservation::client;
  // invalid: the router forwards), with the prompt positions a prefix cache
  // held, this pool's or the prefill worker's, of the request's own prompt.
  client_actor client;
  int32_t cached_tokens = 0;
  // Speculative decoding (engine/speculation.h; sampling.speculation holds
  // the request's wishes resolved against this worker's configuration): the
  // gate that pauses guessing while it fails. Guessing needs the prompt (context).
  gpu::SpeculationGate gate;
  bool drafted = false;  // the compute holds a draft model's KV for it (told to drop it at the end)
  // Which attempt of the request this is (DecodeState::next_serial): a step's
  // answer goes only to the sequence it was asked for, not to a later attempt
  // of the same request admitted here while the step ran.
  uint64_t serial = 0;
  uint64_t attempt = 0;  // the router's (KvReservation::attempt), in its tokens and done
  bool speculates() const {
    return sampling.speculation.method != gpu::SpeculationMethod::off && !context.empty();
  }
};

// The KV arrived as one message and the compute actor is storing it in the
// blocks (the Sequence-to-be, blocks and all, waits in the admission's
// callback). A cancel ends it here at once, so that a new attempt of the
// request may reserve meanwhile: the callback, finding no Admitting of its
// serial, frees the blocks when the compute has answered.
struct Admitting {
  uint64_t serial = 0;
};

// A request's phase at this worker, the one entry it has:
//
//   reserve --> Reservation --(a stream's commit and the receiver's verdict)--> Sequence --(done)--> gone
//   (blocks held,  |                                                           (decoding)
//    a lease)      +--(one message: the KV)--> Admitting --(stored)--------------^
//                                              (the compute stores it)
//   Reservation --(cancel, the lease's end, a failed stream)--> gone (blocks freed)
//   Sequence --(cancel)--> gone (blocks freed after the step in flight)
//   Admitting --(cancel)--> gone (its blocks freed when the compute answers; refused then)
using RequestPhase = std::variant<Reservation, Admitting, Sequence>;
using Requests = std::map<RequestId, RequestPhase>;

// What a sequence takes from its reservation: its blocks and what puts them
// in the prefix cache (the reservation's are moved out).
void take_blocks(Sequence& seq, Reservation& held) {
  seq.blocks = std::move(held.blocks);
  seq.prompt = std::move(held.prompt);
  seq.hash_seed = held.hash_seed;
  seq.hashes = std::move(held.hashes);
  seq.attempt = held.attempt;
}

// What a sequence takes from its commit and its reservation's answer.
void continue_from(Sequence& seq, const KvTransfer& t, const client_actor& client, int32_t pool_cached,
                   int32_t seq_len, const gpu::SpeculationParams& configured) {
  seq.prompt_len = t.prompt_len;
  seq.limit = t.first_step + gpu::token_limit(t.prompt_len, t.max_new_tokens, seq_len);
  seq.sampling = t.sampling;
  seq.context = t.context;
  seq.prompt_logprobs = t.prompt_logprobs;
  seq.first_step = t.first_step;
  seq.client = client;
  seq.cached_tokens = cached_prompt_tokens(pool_cached, t.cached_tokens, t.prompt_len - t.first_step);
  seq.sampling.speculation = gpu::resolve_speculation(t.sampling.speculation, configured);
}

// Ids cancelled recently: a KV transfer that arrives after its cancel (the two
// come from different senders) is refused instead of decoded for nobody.
class RecentIds {
 public:
  explicit RecentIds(size_t capacity) : capacity_(capacity) {}
  void add(RequestId id) {
    if (!set_.insert(id).second) return;
    order_.push_back(id);
    if (order_.size() > capacity_) {
      set_.erase(order_.front());
      order_.pop_front();
    }
  }
  bool contains(RequestId id) const { return set_.count(id) != 0; }
  void erase(RequestId id) {
    if (set_.erase(id)) order_.erase(std::find(order_.begin(), order_.end(), id));
  }

 private:
  size_t capacity_;
  std::deque<RequestId> order_;
  std::unordered_set<RequestId> set_;
};

struct DecodeState {
  ~DecodeState();
  DisaggConfig config;
  DecodeKv kv;             // streams: the pool's memory and the process's receivers
  std::string name;  // also the actor's name in CAF (stateful_actor reads state.name)
  compute_actor compute;
  router_actor router;  // its router, or its node's relay to one
  // The router behind the relay, as its node told it (router_atom): with
  // its own node, the one sender whose reserve, prefill and cancel it takes.
  caf::actor_addr router_behind;
  // Not colocated: its own unregistered prefill worker on `compute`, which
  // prefills short uncached rests of prompts the prefix cache mostly holds.
  prefill_actor local_prefill;
  std::optional<gpu::BlockPool> allocator;  // also the prefix cache (config.prefix_caching)
  int32_t seq_len = 0;     // from the compute actor's model
  int32_t vocab_size = 0;  // from the compute actor's model
  int32_t n_layers = 0;    // from the compute actor's model (stream plans)
  int32_t kv_dim = 0;
  uint64_t fingerprint = 0;
  std::vector<int32_t> end_tokens;  // from the compute actor's model: the stop rule's ids
  Requests requests;  // each request held here, in its phase (RequestPhase)
  uint64_t next_serial = 1;
  uint64_t events_seq = 0;  // the last KvEvents batch sent to the router
  TokenBatch tokens_out;    // tokens made and not yet sent to the router (flush_tokens)
  RecentIds cancelled{4096};
  bool step_in_flight = false;
  gpu::GuessCost guess_cost;  // its steps' compute time against their rows: what a guess row costs the gates
  size_t cursor = 0;  // round robin over active sequences when more than max_batch
  // The sequences of the step in flight, and blocks of those among them that
  // ended meanwhile: the step still writes their KV at one position, so the
  // blocks go back to the allocator (and to a stream's receiver) only after it.
  std::unordered_set<RequestId> in_step;
  std::vector<int32_t> release_after_step;
  // Blocks of calls to the compute that timed out, and of cancelled local
  // prefills: it may still be running them and writing KV there, so they go
  // back to the allocator only once the compute has answered a later call
  // (it takes its calls in order: a barrier, re-sent at each timeout while
  // it stays silent).
  std::vector<int32_t> quarantined;
  std::vector<int32_t> barrier_covers;  // quarantined blocks the call out now releases
  bool barrier_in_flight = false;
  // Blocks of streams dropped while pieces still wrote into them: by
  // transfer id, freed at the receiver's verdict on it, which comes when
  // those pieces end (over TCP at the receiver's drain deadline, when it
  // cuts their connection; over shared memory, where it cannot, when the
  // sender's piece ends: a sender stalled for good holds them for good,
  // logged). This actor never waits for a receiver.
  struct Draining {
    kv::Transport transport;
    std::vector<int32_t> blocks;
  };
  std::unordered_map<uint64_t, Draining> draining;
  // Each reservation's lease end, by (request id, serial), served by a few
  // wake-ups (actors/deadlines.h; lease_atom): removed as the reservation
  // ends (end_lease), whichever way.
  DeadlineSet<std::pair<RequestId, uint64_t>> leases;
};

// An actor that ends with streams open gives their memory back first (the
// pool may go with it): here it waits for the receivers.
DecodeState::~DecodeState() {
  for (auto& [id, phase] : requests)
    if (auto* r = std::get_if<Reservation>(&phase)) {
      if (r->streaming()) kv.plane->receiver(r->transport).cancel(r->transfer_id);
      if (r->local) kv.local->cancel(r->transfer_id);
    }
  for (auto& [transfer_id, d] : draining) kv.plane->receiver(d.transport).cancel(transfer_id);
}

// Drops a reservation's open stream; true when its receiver still writes
// into the blocks (they go to DecodeState::draining, not the allocator).
bool drop_stream(DecodeState& st, const Reservation& r) {
  return r.streaming() && st.kv.plane->receiver(r.transport).drop(r.transfer_id) == kv::Dropped::draining;
}

using Self = decode_actor::stateful_pointer<DecodeState>;

// The request's entry when it is in phase P, else requests.end().
template <class P>
Requests::iterator find_in(DecodeState& st, RequestId id) {
  auto it = st.requests.find(id);
  return it != st.requests.end() && std::holds_alternative<P>(it->second) ? it : st.requests.end();
}

// The sequence a step was asked for (`serial`: Sequence::serial then), if it
// is still there: not one that ended meanwhile, nor a later attempt of the
// same request admitted here while the step ran.
Requests::iterator find_scheduled(DecodeState& st, RequestId id, uint64_t serial) {
  auto it = find_in<Sequence>(st, id);
  return it != st.requests.end() && std::get<Sequence>(it->second).serial == serial ? it : st.requests.end();
}

int32_t active_sequences(const DecodeState& st) {
  return int32_t(std::count_if(st.requests.begin(), st.requests.end(),
                               [](const auto& entry) { return std::holds_alternative<Sequence>(entry.second); }));
}

DecodeLoad load_of(Self self) {
  const auto& st = self->state;
  DecodeLoad load;
  load.total_blocks = st.allocator->num_blocks();
  load.free_blocks = st.allocator->free_blocks();
  load.block_size = st.config.block_size;
  load.active_sequences = active_sequences(st);
  load.leases = int32_t(st.leases.size());
  load.lease_wakeups = int32_t(st.leases.wakeups());
  return load;
}

// What the prefix cache stored and evicted since the last batch goes to the
// router's index, as each hash's net change (the router's view before the
// batch is the pool's, so the net change brings it to the pool's now).
void flush_events(Self self) {
  auto& st = self->state;
  const std::vector<gpu::BlockEvent> events = st.allocator->take_events();
  if (events.empty()) return;
  // (a block's hash is forgotten only when it is evicted: engine/kv_cache.h)
  record_prefix_evictions(WorkerRole::decode, size_t(std::count_if(events.begin(), events.end(),
                                                                   [](const gpu::BlockEvent& e) { return !e.stored; })));
  std::unordered_map<uint64_t, bool> last;  // hash -> stored at the end of the batch
  std::vector<uint64_t> order;
  for (const auto& e : events) {
    if (!last.count(e.hash)) order.push_back(e.hash);
    last[e.hash] = e.stored;
  }
  KvEvents batch;
  batch.seq = ++st.events_seq;
  for (uint64_t h : order) (last[h] ? batch.stored : batch.removed).push_back(h);
  self->send(st.router, kv_events_atom::value, std::move(batch));
}

void report_load(Self self) {
  flush_events(self);
  const DecodeLoad load = load_of(self);
  record_decode_load(load);
  self->send(self->state.router, load_atom::value, load);
}

KvAck make_ack(Self self, RequestId id, ErrorCode code, std::string message) {
  return KvAck{id, code, std::move(message), load_of(self)};
}

// The prefix cache learns the full blocks named by `hashes`, held in
// `blocks` (their KV final): later prompts that start with them share them.
void publish_blocks(Self self, const std::vector<uint64_t>& hashes, const std::vector<int32_t>& blocks) {
  for (size_t i = 0; i < hashes.size() && i < blocks.size(); ++i) self->state.allocator->publish(blocks[i], hashes[i]);
}

// A sequence's KV is final up to its last token, which no step has fed
// (or whose step may still be in flight): the prompt and all tokens but the
// last go to the prefix cache (the prompt's blocks are published already).
void publish_sequence(Self self, Sequence& seq) {
  if (seq.prompt.empty() || seq.tokens.size() < 2) return;
  std::vector<int32_t> done = seq.prompt;
  done.insert(done.end(), seq.tokens.begin(), seq.tokens.end() - 1);
  gpu::extend_block_hashes(seq.hashes, done, self->state.config.block_size, seq.hash_seed);
  publish_blocks(self, seq.hashes, seq.blocks);
}

// Blocks of a sequence that ended: back to the allocator now, or after the
// step in flight if it includes the sequence; and what the compute holds for
// it (a draft model's KV) goes, after that step.
void release_sequence_blocks(Self self, RequestId id, const Sequence& seq) {
  auto& st = self->state;
  const std::vector<int32_t>& blocks = seq.blocks;
  if (seq.drafted) self->send(st.compute, cancel_atom::value, id);
  if (st.in_step.count(id))
    st.release_after_step.insert(st.release_after_step.end(), blocks.begin(), blocks.end());
  else
    st.allocator->release(blocks);
}

// The tokens made since the last flush go to the router, one message: at
// the end of each step, with an attempt's first token, and before any done (which must
// come after its sequence's tokens).
void flush_tokens(Self self) {
  auto& st = self->state;
  if (st.tokens_out.events.empty()) return;
  self->send(st.router, token_atom::value, std::move(st.tokens_out));
  st.tokens_out.events.clear();
}

void finish_sequence(Self self, Requests::iterator it, ErrorCode code, std::string message, FinishReason finish) {
  auto& st = self->state;
  Sequence& seq = std::get<Sequence>(it->second);
  flush_tokens(self);
  if (code == ErrorCode::none) publish_sequence(self, seq);
  release_sequence_blocks(self, it->first, seq);
  flush_events(self);  // before the done: the router's index knows the blocks when the client hears
  DecodeDone done;
  done.id = it->first;
  done.code = code;
  done.message = std::move(message);
  done.tokens = std::move(seq.tokens);
  done.finish = finish;
  done.decode_us = micros_since(seq.admitted);
  done.first_step = seq.first_step;
  done.prompt_logprobs = std::move(seq.prompt_logprobs);
  done.attempt = seq.attempt;
  st.requests.erase(it);
  self->send(st.router, done_atom::value, std::move(done));
}

// Applies a sampled token with the stop rule (engine/stop_rule.h, as
// gpu::generate does); true when the sequence finished.
bool accept_token(Self self, Requests::iterator it, int32_t token, TokenLogprobs logprobs) {
  Sequence& seq = std::get<Sequence>(it->second);
  const int32_t index = seq.first_step + int32_t(seq.tokens.size());
  const auto stop = gpu::check_stop(self->state.end_tokens, seq.sampling.stop, token, index, seq.limit);
  if (stop != FinishReason::eos) {
    seq.tokens.push_back(token);
    record_decoded_token();
    // (with the log probabilities: the router's outcome carries them too,
    // for tokens whose event a client missed)
    self->state.tokens_out.events.push_back(TokenEvent{it->first, index, token, {}, 0, logprobs, seq.attempt});
    // The attempt's first token tells the router this worker has the KV (a
    // late prefill error no longer fails the request): it goes there before
    // the client can see it.
    if (seq.tokens.size() == 1) flush_tokens(self);
    if (seq.client)
      self->send(seq.client, token_atom::value,
                 TokenEvent{it->first, index, token, {}, seq.cached_tokens, std::move(logprobs), seq.attempt});
  }
  if (stop) finish_sequence(self, it, ErrorCode::none, {}, *stop);
  return stop.has_value();
}

// The step in flight has ended: what waited for it is released. True when
// that freed blocks (the router hears of them with the next load report).
bool step_over(Self self) {
  auto& st = self->state;
  st.step_in_flight = false;
  st.in_step.clear();
  if (st.release_after_step.empty()) return false;
  st.allocator->release(st.release_after_step);
  st.release_after_step.clear();
  return true;
}

// Blocks the compute may still write (a timed-out call's, a cancelled local
// prefill's): held until the compute answers a call made after they were
// quarantined (DecodeState::quarantined). Blocks quarantined while a call
// is out wait for the next one: that call may have been answered before
// the write that holds them began.
void quarantine(Self self, std::vector<int32_t> blocks) {
  auto& st = self->state;
  st.quarantined.insert(st.quarantined.end(), blocks.begin(), blocks.end());
  if (st.quarantined.empty() || st.barrier_in_flight) return;
  st.barrier_in_flight = true;
  st.barrier_covers.insert(st.barrier_covers.end(), st.quarantined.begin(), st.quarantined.end());
  st.quarantined.clear();
  auto release = [self] {
    auto& state = self->state;
    state.barrier_in_flight = false;
    state.allocator->release(state.barrier_covers);
    state.barrier_covers.clear();
    report_load(self);
    quarantine(self, {});  // (those quarantined meanwhile)
  };
  self->request(st.compute, std::chrono::milliseconds(st.config.compute_timeout_ms), info_atom::value)
      .then([=](ModelInfo&) { release(); },
            [=](caf::error& e) {
              if (e != caf::sec::request_timeout) return release();  // the compute is gone: nothing writes them
              // Still busy: ask again (covering those quarantined meanwhile too).
              auto& state = self->state;
              state.barrier_in_flight = false;
              state.quarantined.insert(state.quarantined.end(), state.barrier_covers.begin(), state.barrier_covers.end());
              state.barrier_covers.clear();
              quarantine(self, {});
            });
}

// Why a step's answer does not fit the `slots` it was asked for, or "".
std::string step_result_problem(const StepResult& r, size_t slots) {
  size_t tokens = slots;
  if (!r.made.empty()) {
    if (r.made.size() != slots || r.proposed.size() != slots || r.accepted.size() != slots)
      return "decode step returned counts for " + std::to_string(r.made.size()) + " of " + std::to_string(slots) +
             " sequences";
    tokens = 0;
    for (size_t i = 0; i < slots; ++i) {
      if (r.made[i] < 1 || r.made[i] > r.proposed[i] + 1 || r.accepted[i] < 0 || r.accepted[i] > r.proposed[i])
        return "decode step returned " + std::to_string(r.made[i]) + " tokens for " + std::to_string(r.proposed[i]) +
               " guesses";
      tokens += size_t(r.made[i]);
    }
  }
  if (r.next_tokens.size() != tokens || r.logprobs.size() != tokens)
    return "decode step returned " + std::to_string(r.next_tokens.size()) + " tokens for " + std::to_string(slots) +
           " sequences";
  return {};
}

// Continuous batching: whenever no step is running, run one over the active
// sequences (those admitted meanwhile included).
void schedule_step(Self self) {
  auto& st = self->state;
  if (st.step_in_flight) return;
  std::vector<RequestId> all;
  for (const auto& [id, phase] : st.requests)
    if (std::holds_alternative<Sequence>(phase)) all.push_back(id);
  if (all.empty()) return;
  const size_t take = std::min(all.size(), size_t(st.config.max_batch));
  const double guess_cost = st.guess_cost.share(int(take));  // a guess row's price, in tokens of this step
  DecodeStep step;
  std::vector<RequestId> ids;
  std::vector<uint64_t> serials;  // of the sequences scheduled (Sequence::serial)
  for (size_t k = 0; k < take; ++k) {
    const RequestId id = all[(st.cursor + k) % all.size()];
    Sequence& seq = std::get<Sequence>(st.requests.at(id));
    serials.push_back(seq.serial);
    StepSlot slot;
    slot.id = id;
    slot.token = seq.tokens.back();  // the last emitted token, fed at the next position
    slot.pos = seq.prompt_len + int32_t(seq.tokens.size()) - 1;
    slot.step = seq.first_step + int32_t(seq.tokens.size());
    slot.sampling = seq.sampling;
    slot.blocks = seq.blocks;
    // Guesses for the tokens after this one, inside the request's limit.
    const int32_t room = gpu::guess_room(seq.sampling.speculation.num_tokens, slot.step, seq.limit);
    if (seq.speculates() && room > 0) slot.draft_limit = seq.gate.allowed(room, guess_cost);
    seq.drafted |= slot.draft_limit > 0 && seq.sampling.speculation.method == gpu::SpeculationMethod::draft;
    if (seq.sampling.uses_history() || slot.draft_limit > 0) {
      slot.history.reserve(seq.context.size() + seq.tokens.size());
      slot.history = seq.context;
      slot.history.insert(slot.history.end(), seq.tokens.begin(), seq.tokens.end());
    }
    step.slots.push_back(std::move(slot));
    ids.push_back(id);
  }
  st.cursor += take;
  st.step_in_flight = true;
  st.in_step.insert(ids.begin(), ids.end());
  // A step may write into the blocks of a sequence cancelled while it runs;
  // harmless: the compute actor handles messages in order, so any later
  // admission overwrites those blocks only after this step is done.
  self->request(st.compute, std::chrono::milliseconds(st.config.compute_timeout_ms),
                step_atom::value, std::move(step))
      .then(
          [=](StepResult& r) {
            const bool freed = step_over(self);
            if (r.code == ErrorCode::none) {
              if (const std::string why = step_result_problem(r, ids.size()); !why.empty()) {
                r.code = ErrorCode::internal;
                r.message = why;
              }
            }
            bool changed = freed;
            size_t first = 0;  // slot i's tokens: next_tokens[first, first + made)
            for (size_t i = 0; i < ids.size(); ++i) {
              const size_t made = r.code != ErrorCode::none || r.made.empty() ? 1 : size_t(r.made[i]);
              const size_t from = first;
              first += made;
              auto it = find_scheduled(self->state, ids[i], serials[i]);
              if (it == self->state.requests.end()) continue;  // cancelled during the step
              if (r.code != ErrorCode::none) {
                finish_sequence(self, it, r.code, r.message, FinishReason::length);
                changed = true;
                continue;
              }
              if (i < r.slot_errors.size() && !r.slot_errors[i].empty()) {
                finish_sequence(self, it, ErrorCode::invalid_request, r.slot_errors[i], FinishReason::length);
                changed = true;
                continue;
              }
              if (!r.proposed.empty() && r.proposed[i] > 0) {
                std::get<Sequence>(it->second).gate.record(r.proposed[i], r.accepted[i]);
                record_speculation(r.proposed[i], r.accepted[i]);
              }
              // In order, each through the stop rule: none after the one that ends it.
              for (size_t k = from; k < from + made; ++k)
                if (accept_token(self, it, r.next_tokens[k], std::move(r.logprobs[k]))) {
                  changed = true;
                  break;
                }
            }
            record_decode_step(r.compute_us, !r.proposed.empty());
            if (r.code == ErrorCode::none)
              self->state.guess_cost.record(int(ids.size()) + std::accumulate(r.proposed.begin(), r.proposed.end(), 0),
                                            double(r.compute_us) * 1e-6);
            flush_tokens(self);
            if (changed) report_load(self);
            schedule_step(self);
          },
          [=](caf::error& e) {
            // Its sequences end (their blocks wait for the step: in_step),
            // then the step is over here; at a timeout the compute may still
            // be running it, so what waited for it waits for the compute.
            for (size_t i = 0; i < ids.size(); ++i) {
              auto it = find_scheduled(self->state, ids[i], serials[i]);
              if (it != self->state.requests.end())
                finish_sequence(self, it, code_of(e), describe("decode step", e), FinishReason::length);
            }
            if (e == caf::sec::request_timeout) {
              quarantine(self, std::move(self->state.release_after_step));
              self->state.release_after_step.clear();
            }
            step_over(self);
            report_load(self);
            schedule_step(self);
          });
}

bool can_stream(const DecodeState& st) {
  return st.config.kv_transport != "message" && st.kv.pool && st.kv.plane && st.kv.plane->receiving();
}

// Registers the reserved blocks with the KV receiver for the prompt's
// positions (engine/kv_stream.h) under a new transfer id, before the router (and
// through it the prefill worker) learns the id. The receiver's verdict comes
// back as a landed_atom message to this actor.
KvTarget open_stream(Self self, const KvReservation& r, Reservation& held) {
  auto& st = self->state;
  const int bs = st.config.block_size;
  const int prompt_blocks = gpu::KvPool::blocks_for(gpu::kv_layout::padded(r.prompt_len), bs);
  if (size_t(prompt_blocks) > held.blocks.size())
    throw std::invalid_argument(std::to_string(r.prompt_len) + " prompt positions need " +
                                std::to_string(prompt_blocks) + " blocks");
  std::vector<int32_t> runs = gpu::KvStreamPlan::runs_of(held.blocks, prompt_blocks);
  const gpu::KvStreamPlan plan(st.n_layers, st.kv_dim, r.prompt_len, bs, runs, held.cached);
  std::vector<kv::Region> regions;
  for (const gpu::PoolSpan& span : st.kv.pool->stream_spans(plan, held.blocks))
    regions.push_back({span.data, span.floats * sizeof(float)});
  held.transport = st.config.kv_shared_memory() ? st.kv.plane->transport_for(r.prefill_host) : kv::Transport::tcp;
  held.transfer_id = kv::new_transfer_id();
  // (weak: the receiver's thread must never hold the last reference to this actor)
  const caf::actor_addr me = self->address();
  const RequestId id = r.id;
  const uint64_t serial = held.serial;
  st.kv.plane->receiver(held.transport)
      .expect(held.transfer_id, std::move(regions), kv::Clock::now() + std::chrono::milliseconds(r.lease_ms),
              [me, id, serial](const kv::TransferResult& result) {
                if (auto decode = caf::actor_cast<decode_actor>(me))  // (as itself: a peer's is ignored)
                  caf::send_as(decode, decode, landed_atom::value, id, serial,
                               KvLanded{result.transfer_id, uint8_t(result.status), result.bytes_received,
                                        result.detail});
              });
  return KvTarget{held.transfer_id, uint8_t(held.transport), st.kv.plane->address(held.transport), bs,
                  std::move(runs)};
}

// Where a local reservation's prompt KV goes, as this worker planned it:
// the prompt's blocks as runs, after the positions its prefix cache holds.
KvTarget local_target(const DecodeState& st, const Reservation& held) {
  const int bs = st.config.block_size;
  const int prompt_blocks = gpu::KvPool::blocks_for(gpu::kv_layout::padded(held.prompt_len), bs);
  KvTarget target{held.transfer_id, kLocalKvTransport, {}, bs, gpu::KvStreamPlan::runs_of(held.blocks, prompt_blocks)};
  target.first_position = held.cached;
  target.ticket = held.ticket;
  return target;
}

// A colocated worker's reservation: the prompt's blocks are registered for
// its own compute, which computes the KV into them during the prefill
// (kv/local.h). Like a stream, the commit names the transfer id; unlike one,
// there is no receiver's verdict to wait for (the KV is in place when the
// prefill worker commits).
KvTarget open_local(Self self, const KvReservation& r, Reservation& held) {
  auto& st = self->state;
  const int prompt_blocks = gpu::KvPool::blocks_for(gpu::kv_layout::padded(r.prompt_len), st.config.block_size);
  if (size_t(prompt_blocks) > held.blocks.size())
    throw std::invalid_argument(std::to_string(r.prompt_len) + " prompt positions need " +
                                std::to_string(prompt_blocks) + " blocks");
  held.local = true;
  held.transfer_id = kv::new_transfer_id();
  st.kv.local->expect(held.transfer_id,
                      std::vector<int32_t>(held.blocks.begin(), held.blocks.begin() + prompt_blocks));
  return local_target(st, held);
}

// The reservation ends (filled, dropped, cancelled): its lease with it.
void end_lease(DecodeState& st, RequestId id, const Reservation& r) { st.leases.remove(r.lease_end, {id, r.serial}); }

// The answer to the router's reservation: the receiver allocates before any
// prefill work is done, so a full worker costs nothing but this message.
ReserveReply reserve(Self self, const KvReservation& r) {
  auto& st = self->state;
  auto reply = [&](ErrorCode code, std::string message) {
    return ReserveReply{r.id, code, std::move(message), load_of(self)};
  };
  // A reservation after a cancel of the same id is a new attempt of it (the
  // router restarts requests whose worker was lost; its messages to this
  // worker arrive in order): what was cancelled is gone (an admission's
  // blocks come back when its compute answers), this one counts. An id held
  // and never cancelled is refused.
  if (st.requests.count(r.id))
    return reply(ErrorCode::invalid_request, "request " + std::to_string(r.id) + " is already held");
  st.cancelled.erase(r.id);
  if (r.positions <= 0 || r.positions > st.seq_len || r.lease_ms <= 0 || r.lease_ms > kMaxLeaseMs)
    return reply(ErrorCode::invalid_request, "reservation of " + std::to_string(r.positions) +
                                                 " positions for " + std::to_string(r.lease_ms) +
                                                 " ms (seq_len " + std::to_string(st.seq_len) + ")");
  const int bs = st.config.block_size;
  const int needed = gpu::KvPool::blocks_for(r.positions, bs);
  const bool colocated = !st.kv.colocated.empty() && st.kv.local;
  const bool into_blocks = (colocated || can_stream(st)) && r.prompt_len > 0 && r.prompt_len <= r.positions;
  // The prefix cache: the prompt's leading full blocks that this pool holds
  // are shared, and only the rest is computed or sent. At least the last
  // prompt position is always computed (its logits give token 0). A worker
  // that takes its KV in one message only (kv-transport "message") caches
  // nothing; one that streams also takes a one-message KV from a prefill
  // node on "message", and writes only the positions after the shared
  // blocks (admit_message).
  Reservation held;
  const bool cacheable = st.config.prefix_caching && into_blocks && int(r.prompt_tokens.size()) == r.prompt_len;
  if (cacheable) {
    held.prompt = r.prompt_tokens;
    held.hash_seed = gpu::block_hash_seed(st.fingerprint, bs, r.cache_salt);
    held.hashes = gpu::block_hashes(held.prompt, bs, held.hash_seed);
    held.blocks = st.allocator->take_cached(held.hashes, std::min(needed, (r.prompt_len - 1) / bs));
    held.cached = int32_t(held.blocks.size()) * bs;
  }
  std::vector<int32_t> fresh = st.allocator->allocate(needed - int(held.blocks.size()));
  if (fresh.empty() && needed > int(held.blocks.size())) {
    st.allocator->release(held.blocks);
    return reply(ErrorCode::overloaded, st.name + " needs " + std::to_string(needed) + " KV blocks, " +
                                            std::to_string(st.allocator->free_blocks()) + " free");
  }
  held.blocks.insert(held.blocks.end(), fresh.begin(), fresh.end());
  held.positions = r.positions;
  held.prompt_len = r.prompt_len;
  held.client = r.client;
  held.attempt = r.attempt;
  held.serial = st.next_serial++;
  held.ticket = kv::new_transfer_id();  // (64 random bits, drawn as a transfer id is)
  const uint64_t serial = held.serial;
  ReserveReply answer = reply(ErrorCode::none, {});
  if (into_blocks) {
    // Conditional disaggregation: a short rest (after a cached prefix, or a
    // short prompt with nothing cached) is computed here, between decode
    // steps; no prefill worker, no transfer.
    const bool local =
        colocated || (st.local_prefill && r.prompt_len - held.cached <= r.local_prefill_tokens);
    try {
      answer.target = local ? open_local(self, r, held) : open_stream(self, r, held);
    } catch (const std::exception& e) {
      st.allocator->release(held.blocks);
      return reply(ErrorCode::internal, std::string("cannot open the KV stream: ") + e.what());
    }
    answer.target.first_position = held.cached;
    answer.cached_tokens = held.cached;
    if (cacheable)
      record_prefix_lookup(r.prompt_len, held.cached, local && !colocated ? r.prompt_len : held.cached,
                           2 * uint64_t(st.n_layers) * uint64_t(st.kv_dim) * sizeof(float));
  }
  answer.target.ticket = held.ticket;
  answer.target.max_message_bytes = st.kv.max_message_bytes;
  const auto now = Clock::now();
  held.lease_end = now + std::chrono::milliseconds(r.lease_ms);
  arm_wakeup(self, st.leases.add(held.lease_end, {r.id, serial}, now), lease_atom::value);
  st.requests.emplace(r.id, std::move(held));
  flush_events(self);  // (evictions)
  answer.load = load_of(self);
  return answer;
}

// Gives a reservation's blocks back (cancel, lease end, failed stream): a
// stream still open is dropped first (blocks its receiver still writes into
// wait for its verdict), a commit waiting for it is refused with `code`.
// False when nothing was reserved.
bool drop_reservation(Self self, RequestId id, ErrorCode code = ErrorCode::cancelled,
                      const std::string& message = "request was cancelled") {
  auto& st = self->state;
  auto it = find_in<Reservation>(st, id);
  if (it == st.requests.end()) return false;
  Reservation& r = std::get<Reservation>(it->second);
  end_lease(st, id, r);
  const bool draining = drop_stream(st, r);
  if (r.local) st.kv.local->cancel(r.transfer_id);
  if (r.commit) r.commit->promise.deliver(make_ack(self, id, code, message));
  // A local prefill's chunk may be running into the blocks now (the compute
  // looks at the registration only before each chunk): they wait for the
  // compute's next answer. (Freed at once, a stream's receiver, which is no
  // work of the compute, could be writing another request's KV into them
  // while the chunk still wrote.)
  if (draining)
    node_log(LogLevel::warning, "request " + std::to_string(id) + ": its KV stream still writes into " +
                                    std::to_string(r.blocks.size()) + " blocks; they are freed when it ends");
  if (r.local) quarantine(self, std::move(r.blocks));
  else if (draining) st.draining.emplace(r.transfer_id, DecodeState::Draining{r.transport, std::move(r.blocks)});
  else st.allocator->release(r.blocks);
  st.requests.erase(it);
  return true;
}

// The KV is in the sequence's blocks: it joins the next decode step.
void activate(Self self, RequestId id, Sequence seq, int32_t first_token, TokenLogprobs first_logprobs,
              caf::typed_response_promise<KvAck> promise) {
  seq.admitted = Clock::now();
  seq.serial = self->state.next_serial++;
  publish_blocks(self, seq.hashes, seq.blocks);  // the prompt's KV is final
  auto it = self->state.requests.insert_or_assign(id, std::move(seq)).first;
  accept_token(self, it, first_token, std::move(first_logprobs));  // sampled by the prefill side (sent at once)
  promise.deliver(make_ack(self, id, ErrorCode::none, {}));
  report_load(self);
  schedule_step(self);
}

// A streamed KV's commit and the receiver's verdict are both in: the
// sequence starts, or its reservation ends with the stream's failure.
void settle_stream(Self self, RequestId id) {
  auto& st = self->state;
  auto it = find_in<Reservation>(st, id);
  if (it == st.requests.end()) return;
  Reservation& held = std::get<Reservation>(it->second);
  if (!held.verdict || !held.commit) return;
  const KvLanded verdict = *held.verdict;
  PendingCommit commit = std::move(*held.commit);
  held.commit.reset();
  const auto status = kv::TransferStatus(verdict.status);
  if (status != kv::TransferStatus::complete) {
    commit.promise.deliver(make_ack(self, id, code_of(status),
                                    std::string("KV stream ") + kv::to_string(status) +
                                        (verdict.detail.empty() ? "" : ": " + verdict.detail)));
    drop_reservation(self, id);
    report_load(self);
    return;
  }
  const KvTransfer& t = commit.transfer;
  end_lease(st, id, held);
  Sequence seq;
  take_blocks(seq, held);
  continue_from(seq, t, held.client, held.cached, st.seq_len, st.config.speculation_params());
  activate(self, id, std::move(seq), t.first_token, t.first_logprobs, commit.promise);
}

// The prefill worker's commit of a KV it streamed into `held`'s blocks.
caf::typed_response_promise<KvAck> commit_stream(Self self, Reservation& held, KvTransfer transfer,
                                                  caf::typed_response_promise<KvAck> promise) {
  auto& st = self->state;
  const RequestId id = transfer.id;
  if (transfer.transfer_id != held.transfer_id || held.commit) {
    promise.deliver(make_ack(self, id, ErrorCode::invalid_request,
                             "no KV stream " + std::to_string(transfer.transfer_id) + " for request " +
                                 std::to_string(id)));
    return promise;
  }
  if (transfer.fingerprint != st.fingerprint) {
    promise.deliver(make_ack(self, id, ErrorCode::incompatible_kv, "KV of another model (fingerprint)"));
    drop_reservation(self, id);
    report_load(self);
    return promise;
  }
  // Local: the compute wrote the blocks before the prefill worker heard
  // back from it, so the KV is in.
  if (held.local) held.verdict = KvLanded{held.transfer_id, uint8_t(kv::TransferStatus::complete), 0, {}};
  held.commit = PendingCommit{std::move(transfer), promise};
  settle_stream(self, id);  // now, or when the verdict comes
  return promise;
}

// A refusal of a KV transfer: the ack's code and message.
struct Refusal {
  ErrorCode code;
  std::string message;
};

// Why a KV transfer is refused whatever was reserved for it, if it is.
std::optional<Refusal> check_transfer(const DecodeState& st, const KvTransfer& transfer) {
  const RequestId id = transfer.id;
  if (st.cancelled.contains(id)) return Refusal{ErrorCode::cancelled, "request was cancelled"};
  if (auto it = st.requests.find(id); it != st.requests.end() && !std::holds_alternative<Reservation>(it->second))
    return Refusal{ErrorCode::invalid_request, "request " + std::to_string(id) + " is already held"};
  if (transfer.chunk != 0 || transfer.chunk_count != 1)
    return Refusal{ErrorCode::invalid_request, "chunked KV transfers are not supported yet"};
  // (first_step: the tokens a migrated request made before, now part of its prompt)
  if (transfer.prompt_len <= 0 || transfer.max_new_tokens <= 0 || transfer.first_step < 0 ||
      transfer.first_step >= transfer.prompt_len || transfer.prompt_len >= st.seq_len)
    return Refusal{ErrorCode::invalid_request, "prompt_len " + std::to_string(transfer.prompt_len) +
                                                   ", max_new_tokens " + std::to_string(transfer.max_new_tokens) +
                                                   " do not fit seq_len " + std::to_string(st.seq_len)};
  // Checked here: the token is fed to the next batched step, where an id the
  // model lacks would fail every sequence of that batch.
  if (transfer.first_token < 0 || transfer.first_token >= st.vocab_size)
    return Refusal{ErrorCode::invalid_request, "first_token " + std::to_string(transfer.first_token) +
                                                   " is outside the vocabulary [0, " +
                                                   std::to_string(st.vocab_size) + ")"};
  // Checked here too: a step samples this sequence with the rest of its batch.
  if (const std::string why = gpu::check_sampling(transfer.sampling, st.vocab_size); !why.empty())
    return Refusal{ErrorCode::invalid_request, "sampling: " + why};
  if ((transfer.sampling.uses_history() || !transfer.context.empty()) &&
      int64_t(transfer.context.size()) != transfer.prompt_len)
    return Refusal{ErrorCode::invalid_request, "the context must be the prompt's " +
                                                   std::to_string(transfer.prompt_len) +
                                                   " tokens, the transfer carries " +
                                                   std::to_string(transfer.context.size())};
  for (int32_t t : transfer.context)
    if (t < 0 || t >= st.vocab_size)
      return Refusal{ErrorCode::invalid_request, "context token " + std::to_string(t) + " is outside the vocabulary"};
  return std::nullopt;
}

// Why `what` (the KV, a prefill) of request `id`'s attempt `attempt` has
// no blocks here, if it has none (`held`: its reservation, or nullptr).
std::optional<Refusal> check_held(RequestId id, uint64_t attempt, const Reservation* held, const std::string& what) {
  if (!held)
    return Refusal{ErrorCode::timeout, "no KV blocks reserved for request " + std::to_string(id) +
                                           " (its reservation's lease ended, or none was made)"};
  if (attempt != held->attempt)
    return Refusal{ErrorCode::cancelled, "request " + std::to_string(id) + ": " + what + " of attempt " +
                                             std::to_string(attempt) + ", the blocks are attempt " +
                                             std::to_string(held->attempt) + "'s"};
  return std::nullopt;
}

// Why the request's reservation cannot take the transfer, if it cannot
// (`held`: its reservation, or nullptr when none is held).
std::optional<Refusal> check_reservation(const DecodeState& st, const KvTransfer& transfer, const Reservation* held) {
  if (auto refusal = check_held(transfer.id, transfer.attempt, held, "the KV")) return refusal;
  // Only the prefill worker the router sent the reservation's target to has
  // its ticket: a KV from anyone else is refused, the blocks kept for the
  // real one.
  if (transfer.ticket != held->ticket)
    return Refusal{ErrorCode::invalid_request,
                   "request " + std::to_string(transfer.id) + ": the KV does not carry its reservation's ticket"};
  // A stream's commit waits here for its verdict: a KV sent as one message
  // now would take the blocks from under it, its ack never sent.
  if (transfer.transfer_id == 0 && held->commit)
    return Refusal{ErrorCode::invalid_request, "request " + std::to_string(transfer.id) +
                                                   ": its KV stream's commit is waiting for the stream; a KV sent as "
                                                   "one message is refused"};
  const int positions = gpu::kv_positions_needed(transfer.prompt_len, transfer.max_new_tokens, st.seq_len);
  if (positions > held->positions)
    return Refusal{ErrorCode::invalid_request, "the KV needs " + std::to_string(positions) + " positions, " +
                                                   std::to_string(held->positions) + " were reserved"};
  // A KV must be of the prompt reserved: its blocks go to the prefix cache
  // under that prompt's hashes, and the shared ones are taken as its first
  // positions. A stream's commit (whose bytes fill exactly the reserved
  // prompt's positions, whatever prompt they were made from) is also of the
  // prompt's length: a longer one would read positions never written.
  if (transfer.transfer_id != 0 && transfer.prompt_len != held->prompt_len)
    return Refusal{ErrorCode::invalid_request, "request " + std::to_string(transfer.id) + ": a KV stream of " +
                                                   std::to_string(held->prompt_len) + " prompt positions committed as " +
                                                   std::to_string(transfer.prompt_len)};
  if (!held->prompt.empty() && transfer.context != held->prompt)
    return Refusal{ErrorCode::invalid_request, "request " + std::to_string(transfer.id) +
                                                   ": the KV is of another prompt than the one its blocks were reserved for"};
  return std::nullopt;
}

// Whether the request's entry is still the admission of `serial` (not
// cancelled meanwhile, nor replaced by a later attempt's reservation).
bool admitting(const DecodeState& st, RequestId id, uint64_t serial) {
  auto it = st.requests.find(id);
  return it != st.requests.end() && std::holds_alternative<Admitting>(it->second) &&
         std::get<Admitting>(it->second).serial == serial;
}

// A one-message KV: the reservation's blocks become the sequence's, the
// compute actor validates and stores the KV, and the ack waits for it.
void admit_message(Self self, Requests::iterator held, KvTransfer& transfer,
                   caf::typed_response_promise<KvAck> promise) {
  auto& st = self->state;
  const RequestId id = transfer.id;
  Reservation& r = std::get<Reservation>(held->second);
  end_lease(st, id, r);  // (whatever follows: the reservation ends here)
  // A stream offered for this reservation is not used; one whose pieces
  // still write into the blocks leaves them to nothing else until its
  // verdict (a prefill that sent both): the message is refused.
  if (drop_stream(st, r)) {
    st.draining.emplace(r.transfer_id, DecodeState::Draining{r.transport, std::move(r.blocks)});
    st.requests.erase(held);
    promise.deliver(make_ack(self, id, ErrorCode::invalid_request,
                             "request " + std::to_string(id) + ": its KV stream still writes into the blocks"));
    report_load(self);
    return;
  }
  if (r.streaming()) r.verdict = KvLanded{r.transfer_id, uint8_t(kv::TransferStatus::cancelled), 0, {}};
  if (r.local) st.kv.local->cancel(r.transfer_id);
  // (a one-message KV holds every position: those of the shared cached
  // blocks, the same KV, are not written)
  const int32_t cached = r.cached;
  Sequence seq;
  take_blocks(seq, r);
  std::vector<int32_t> blocks = seq.blocks;
  continue_from(seq, transfer, r.client, r.cached, st.seq_len, st.config.speculation_params());
  const uint64_t serial = st.next_serial++;
  held->second = Admitting{serial};  // (r is gone)
  const int32_t first_token = transfer.first_token;
  TokenLogprobs first_logprobs = transfer.first_logprobs;
  KvAdmit request{std::move(transfer), std::move(blocks), cached};
  self->request(st.compute, std::chrono::milliseconds(st.config.compute_timeout_ms),
                admit_atom::value, std::move(request))
      .then(
          [=](AdmitResult& result) mutable {
            auto& state = self->state;  // (not the outer `st`: lambdas must not copy it)
            const bool current = admitting(state, id, serial);
            if (result.code == ErrorCode::none && !current) {
              result.code = ErrorCode::cancelled;
              result.message = "request was cancelled";
            }
            if (result.code != ErrorCode::none) {
              if (current) state.requests.erase(id);
              state.allocator->release(seq.blocks);
              promise.deliver(make_ack(self, id, result.code, std::move(result.message)));
              report_load(self);
              return;
            }
            activate(self, id, std::move(seq), first_token, std::move(first_logprobs), promise);
          },
          [=](caf::error& e) mutable {
            if (admitting(self->state, id, serial)) self->state.requests.erase(id);
            // Timed out, the compute may still be writing the KV in.
            if (e == caf::sec::request_timeout) quarantine(self, seq.blocks);
            else self->state.allocator->release(seq.blocks);
            promise.deliver(make_ack(self, id, code_of(e), describe("KV admission", e)));
            report_load(self);
          });
}

// The answer to a KV transfer: its checks, then the request's reserved
// blocks take it (a stream's commit, or one message).
caf::typed_response_promise<KvAck> admit(Self self, KvTransfer& transfer) {
  auto& st = self->state;
  auto promise = self->make_response_promise<KvAck>();
  auto held = find_in<Reservation>(st, transfer.id);
  auto refusal = check_transfer(st, transfer);
  if (!refusal)
    refusal = check_reservation(st, transfer,
                                held == st.requests.end() ? nullptr : &std::get<Reservation>(held->second));
  if (refusal) {
    promise.deliver(make_ack(self, transfer.id, refusal->code, std::move(refusal->message)));
    return promise;
  }
  if (transfer.transfer_id != 0)
    return commit_stream(self, std::get<Reservation>(held->second), std::move(transfer), promise);
  admit_message(self, held, transfer, promise);
  return promise;
}

// Membership: learn the model from compute, then register with the router;
// either failing ends this actor (its node then exits).
void join_cluster(Self self, const compute_actor& compute, const router_actor& router) {
  const auto compute_timeout = std::chrono::milliseconds(self->state.config.compute_timeout_ms);
  self->request(compute, compute_timeout, info_atom::value)
      .then(
          [=](ModelInfo& model) {
            auto& st = self->state;
            st.seq_len = model.seq_len;
            st.vocab_size = model.vocab_size;
            st.n_layers = model.n_layers;
            st.kv_dim = model.n_kv_heads * model.head_dim;
            st.fingerprint = model.fingerprint;
            st.end_tokens = model.end_tokens;
            WorkerInfo info;
            info.role = WorkerRole::decode;
            info.host_id = kv::host_identity();
            info.name = st.name;
            info.colocated = st.kv.colocated;
            info.model = std::move(model);
            info.block_size = st.config.block_size;
            info.total_blocks = st.config.pool_blocks;
            self->request(router, compute_timeout, register_atom::value, std::move(info),
                          caf::actor_cast<decode_actor>(self))
                .then([](caf::ok_atom) {}, [=](caf::error& e) { self->quit(e); });
          },
          [=](caf::error& e) { self->quit(e); });
}

// A prompt for this worker's own prefill actor (a local cluster's decode
// worker that also prefills), into a local reservation of its own only, as
// it planned it: the job's target names the reservation, and its blocks and
// first position come from here, not from the message (a wrong first
// position wrote blocks the prefix cache shares with other sequences). Any
// other decode worker, or a job for no such reservation, is refused before
// the compute does anything.
caf::result<PrefillReport> prefill_here(Self self, PrefillJob& job) {
  auto& st = self->state;
  auto refused = [&](ErrorCode code, std::string why) {
    PrefillReport report;
    report.id = job.id;
    report.code = code;
    report.message = std::move(why);
    return report;
  };
  if (!st.local_prefill) return refused(ErrorCode::invalid_request, st.name + " prefills no prompt itself");
  auto it = find_in<Reservation>(st, job.id);
  const Reservation* held = it == st.requests.end() ? nullptr : &std::get<Reservation>(it->second);
  if (auto refusal = check_held(job.id, job.attempt, held, "a prefill"))
    return refused(refusal->code, std::move(refusal->message));
  if (!held->local || !job.target.local() || job.target.transfer_id != held->transfer_id)
    return refused(ErrorCode::invalid_request,
                   "request " + std::to_string(job.id) + ": the prefill's target is not the local one reserved here");
  job.target = local_target(st, *held);
  return self->delegate(st.local_prefill, prefill_atom::value, std::move(job), caf::actor_cast<decode_actor>(self));
}

// The transport's verdict on a reservation's KV stream: with the commit
// already here it settles the stream; a failed one frees the blocks now. On
// a stream dropped while it wrote, it frees the blocks it held.
void on_landed(Self self, RequestId id, uint64_t serial, KvLanded& verdict) {
  auto& st = self->state;
  if (auto d = st.draining.find(verdict.transfer_id); d != st.draining.end()) {
    st.allocator->release(d->second.blocks);  // a dropped stream's: no piece writes into them now
    st.draining.erase(d);
    report_load(self);
    return;
  }
  auto it = find_in<Reservation>(self->state, id);
  if (it == self->state.requests.end()) return;  // the reservation ended meanwhile
  Reservation& held = std::get<Reservation>(it->second);
  if (held.serial != serial || held.transfer_id != verdict.transfer_id || held.verdict) return;  // (another)
  const bool ok = kv::TransferStatus(verdict.status) == kv::TransferStatus::complete;
  held.verdict = std::move(verdict);
  if (held.commit) {
    settle_stream(self, id);
  } else if (!ok) {
    // No commit will come (the prefill worker hears the same verdict):
    // the blocks are free now, not at the lease's end.
    drop_reservation(self, id);
    report_load(self);
  }
}

// A lease wake-up: each reservation whose lease has ended is dropped (its
// KV came too late, or never), and the next lease gets its wake-up.
void on_lease_wakeup(Self self, Clock::time_point at) {
  auto& st = self->state;
  std::vector<DeadlineSet<std::pair<RequestId, uint64_t>>::Entry> due;
  const std::optional<Clock::time_point> next = st.leases.fired(at, Clock::now(), due);
  for (const auto& [end, lease] : due) {
    const auto& [id, serial] = lease;
    auto it = find_in<Reservation>(st, id);
    if (it == st.requests.end() || std::get<Reservation>(it->second).serial != serial) continue;  // (defensive: ended)
    drop_reservation(self, id, ErrorCode::timeout, "the reservation's lease ended before its KV arrived");
  }
  if (!due.empty()) report_load(self);
  arm_wakeup(self, next, lease_atom::value);
}

// The router's cancel, in whatever phase the request is here.
void cancel_request(Self self, RequestId id) {
  auto& state = self->state;
  state.cancelled.add(id);
  if (state.local_prefill) self->send(state.local_prefill, cancel_atom::value, id);
  drop_reservation(self, id);
  if (auto it = find_in<Sequence>(state, id); it != state.requests.end()) {
    release_sequence_blocks(self, id, std::get<Sequence>(it->second));
    state.requests.erase(it);
  }
  // (its admission's callback holds the blocks, and frees them)
  if (auto it = find_in<Admitting>(state, id); it != state.requests.end()) state.requests.erase(it);
  // Also when it held nothing (never arrived, or admitting: refused when
  // compute answers): the router gives back what it had reserved here
  // and needs the real load to count on again.
  report_load(self);
}

decode_actor::behavior_type decode_behavior(Self self, DisaggConfig config, compute_actor compute,
                                            router_actor router, std::string name, DecodeKv kv) {
  auto& st = self->state;
  st.config = std::move(config);
  st.kv = std::move(kv);
  st.name = std::move(name);
  st.compute = compute;
  st.router = router;
  st.allocator.emplace(st.config.pool_blocks);
  self->link_to(compute);
  if (st.kv.local && st.kv.colocated.empty() && st.kv.pool) {
    st.local_prefill = spawn_prefill(self->system(), st.config, compute, router, st.name + "/prefill", {}, false);
    self->link_to(st.local_prefill);
  }
  join_cluster(self, compute, router);
  return {
      // The router's orders: from it or from this node only (else any peer
      // that learnt this worker's handle could hold its pool's blocks for a
      // lease or end another client's request here).
      [=](reserve_atom, const KvReservation& r) {
        if (from_node_or(self, self->state.router_behind)) return reserve(self, r);
        return ReserveReply{r.id, ErrorCode::invalid_request, kNotItsRouter, load_of(self)};
      },
      [=](kv_atom, KvTransfer& transfer) { return admit(self, transfer); },
      [=](prefill_atom, PrefillJob& job) -> caf::result<PrefillReport> {
        if (from_node_or(self, self->state.router_behind)) return prefill_here(self, job);
        return PrefillReport{job.id, ErrorCode::invalid_request, kNotItsRouter};
      },
      [=](router_atom, caf::actor_addr& router) {
        if (!from_this_node(self)) return;
        self->state.router_behind = router;
        if (self->state.local_prefill) self->send(self->state.local_prefill, router_atom::value, std::move(router));
      },
      // (from anyone: a wake-up ends only leases past their end, actors/deadlines.h)
      [=](lease_atom, int64_t at) { on_lease_wakeup(self, wakeup_time(at)); },
      [=](landed_atom, RequestId id, uint64_t serial, KvLanded& verdict) {
        // (a peer's: only this worker's receiver says its KV landed, else any
        // holder of its handle could free blocks a stream still writes into)
        if (from_itself(self)) on_landed(self, id, serial, verdict);
      },
      [=](cancel_atom, RequestId id) {
        if (from_node_or(self, self->state.router_behind)) cancel_request(self, id);
      },
      [=](status_atom) { return load_of(self); },
      [=](kv_events_atom) {
        flush_events(self);  // what the router has not heard yet comes first, numbered
        KvEvents snapshot;
        snapshot.seq = self->state.events_seq;
        snapshot.snapshot = true;
        snapshot.stored = self->state.allocator->cached_hashes();
        return snapshot;
      },
  };
}

}  // namespace

decode_actor spawn_decode(caf::actor_system& system, const DisaggConfig& config,
                          compute_actor compute, router_actor router, std::string name, DecodeKv kv) {
  return system.spawn(decode_behavior, config, std::move(compute), std::move(router),
                      std::move(name), std::move(kv));
}

}  // namespace disagg
