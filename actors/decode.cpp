#include "actors/decode.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <unordered_set>

#include "actors/errors.h"
#include "actors/request_metrics.h"
#include "actors/timing.h"
#include "caf/all.hpp"
#include "gpu/engine.h"
#include "gpu/generate.h"
#include "gpu/tokenizer.h"

namespace disagg {

namespace {

// A request's blocks, taken when the router reserved them and held until its
// KV arrives (then they become the Sequence's), it is cancelled, or the lease
// timer with this serial fires.
struct Reservation {
  std::vector<int32_t> blocks;
  int32_t positions = 0;
  uint64_t serial = 0;
};

struct Sequence {
  std::vector<int32_t> blocks;
  int32_t prompt_len = 0;
  int32_t limit = 0;  // tokens it may generate: max_new_tokens, capped by seq_len
  Sampling sampling;
  std::vector<int32_t> tokens;  // generated so far
  Clock::time_point admitted;
};

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

 private:
  size_t capacity_;
  std::deque<RequestId> order_;
  std::unordered_set<RequestId> set_;
};

struct DecodeState {
  DisaggConfig config;
  std::string name;  // also the actor's name in CAF (stateful_actor reads state.name)
  compute_actor compute;
  router_actor router;
  std::optional<gpu::BlockAllocator> allocator;
  int32_t seq_len = 0;     // from the compute actor's model
  int32_t vocab_size = 0;  // from the compute actor's model
  // A request's phases here: reserved (blocks held, KV not yet arrived) ->
  // admitting (compute writing the KV into them) -> active (decoding) -> gone.
  std::map<RequestId, Reservation> reserved;
  std::map<RequestId, Sequence> active;
  std::unordered_set<RequestId> admitting;
  uint64_t next_serial = 1;
  RecentIds cancelled{4096};
  bool step_in_flight = false;
  size_t cursor = 0;  // round robin over active sequences when more than max_batch
};

using Self = decode_actor::stateful_pointer<DecodeState>;

DecodeLoad load_of(Self self) {
  const auto& st = self->state;
  DecodeLoad load;
  load.total_blocks = st.allocator->num_blocks();
  load.free_blocks = st.allocator->free_blocks();
  load.block_size = st.config.block_size;
  load.active_sequences = int32_t(st.active.size());
  return load;
}

void report_load(Self self) {
  const DecodeLoad load = load_of(self);
  record_decode_load(load);
  self->send(self->state.router, load_atom::value, load);
}

KvAck make_ack(Self self, RequestId id, ErrorCode code, std::string message) {
  return KvAck{id, code, std::move(message), load_of(self)};
}

// Every sequence ends here: blocks freed, its one DecodeDone sent (after all
// of its token events, so the router sees them first).
void finish_sequence(Self self, std::map<RequestId, Sequence>::iterator it, ErrorCode code,
                     std::string message, FinishReason finish) {
  auto& st = self->state;
  st.allocator->release(it->second.blocks);
  DecodeDone done;
  done.id = it->first;
  done.code = code;
  done.message = std::move(message);
  done.tokens = std::move(it->second.tokens);
  done.finish = finish;
  done.decode_us = micros_since(it->second.admitted);
  st.active.erase(it);
  self->send(st.router, done_atom::value, std::move(done));
}

// Applies a sampled token with gpu::generate's stop rules; true when the
// sequence finished.
bool accept_token(Self self, std::map<RequestId, Sequence>::iterator it, int32_t token) {
  Sequence& seq = it->second;
  if (token == gpu::kBosToken) {
    finish_sequence(self, it, ErrorCode::none, {}, FinishReason::eos);
    return true;
  }
  const int32_t index = int32_t(seq.tokens.size());
  seq.tokens.push_back(token);
  self->send(self->state.router, token_atom::value, TokenEvent{it->first, index, token, {}});
  if (int32_t(seq.tokens.size()) >= seq.limit) {
    finish_sequence(self, it, ErrorCode::none, {}, FinishReason::length);
    return true;
  }
  return false;
}

// Continuous batching: whenever no step is running, run one over the active
// sequences (those admitted meanwhile included).
void schedule_step(Self self) {
  auto& st = self->state;
  if (st.step_in_flight || st.active.empty()) return;
  std::vector<RequestId> all;
  all.reserve(st.active.size());
  for (const auto& kv : st.active) all.push_back(kv.first);
  const size_t take = std::min(all.size(), size_t(st.config.max_batch));
  DecodeStep step;
  std::vector<RequestId> ids;
  for (size_t k = 0; k < take; ++k) {
    const RequestId id = all[(st.cursor + k) % all.size()];
    const Sequence& seq = st.active.at(id);
    StepSlot slot;
    slot.id = id;
    slot.token = seq.tokens.back();  // the last emitted token, fed at the next position
    slot.pos = seq.prompt_len + int32_t(seq.tokens.size()) - 1;
    slot.step = int32_t(seq.tokens.size());
    slot.sampling = seq.sampling;
    slot.blocks = seq.blocks;
    step.slots.push_back(std::move(slot));
    ids.push_back(id);
  }
  st.cursor += take;
  st.step_in_flight = true;
  // A step may write into the blocks of a sequence cancelled while it runs;
  // harmless: the compute actor handles messages in order, so any later
  // admission overwrites those blocks only after this step is done.
  self->request(st.compute, std::chrono::milliseconds(st.config.compute_timeout_ms),
                step_atom::value, std::move(step))
      .then(
          [=](StepResult& r) {
            self->state.step_in_flight = false;
            if (r.code == ErrorCode::none && r.next_tokens.size() != ids.size()) {
              r.code = ErrorCode::internal;
              r.message = "decode step returned " + std::to_string(r.next_tokens.size()) +
                          " tokens for " + std::to_string(ids.size()) + " sequences";
            }
            bool changed = false;
            for (size_t i = 0; i < ids.size(); ++i) {
              auto it = self->state.active.find(ids[i]);
              if (it == self->state.active.end()) continue;  // cancelled during the step
              if (r.code != ErrorCode::none) {
                finish_sequence(self, it, r.code, r.message, FinishReason::length);
                changed = true;
              } else if (accept_token(self, it, r.next_tokens[i])) {
                changed = true;
              }
            }
            if (changed) report_load(self);
            schedule_step(self);
          },
          [=](caf::error& e) {
            self->state.step_in_flight = false;
            for (RequestId id : ids) {
              auto it = self->state.active.find(id);
              if (it != self->state.active.end())
                finish_sequence(self, it, code_of(e), describe("decode step", e), FinishReason::length);
            }
            report_load(self);
            schedule_step(self);
          });
}

// The answer to the router's reservation: the receiver allocates before any
// prefill work is done, so a full worker costs nothing but this message.
ReserveReply reserve(Self self, const KvReservation& r) {
  auto& st = self->state;
  auto reply = [&](ErrorCode code, std::string message) {
    return ReserveReply{r.id, code, std::move(message), load_of(self)};
  };
  if (st.cancelled.contains(r.id)) return reply(ErrorCode::cancelled, "request was cancelled");
  if (st.reserved.count(r.id) || st.active.count(r.id) || st.admitting.count(r.id))
    return reply(ErrorCode::invalid_request, "request " + std::to_string(r.id) + " is already held");
  if (r.positions <= 0 || r.positions > st.seq_len || r.lease_ms <= 0)
    return reply(ErrorCode::invalid_request, "reservation of " + std::to_string(r.positions) +
                                                 " positions for " + std::to_string(r.lease_ms) +
                                                 " ms (seq_len " + std::to_string(st.seq_len) + ")");
  const int needed = gpu::KvPool::blocks_for(r.positions, st.config.block_size);
  std::vector<int32_t> blocks = st.allocator->allocate(needed);
  if (blocks.empty())
    return reply(ErrorCode::overloaded, st.name + " needs " + std::to_string(needed) + " KV blocks, " +
                                            std::to_string(st.allocator->free_blocks()) + " free");
  const uint64_t serial = st.next_serial++;
  st.reserved.emplace(r.id, Reservation{std::move(blocks), r.positions, serial});
  self->delayed_send(self, std::chrono::milliseconds(r.lease_ms), lease_atom::value, r.id, serial);
  return reply(ErrorCode::none, {});
}

// Gives a reservation's blocks back (cancel, lease end); false when none.
bool drop_reservation(Self self, RequestId id) {
  auto& st = self->state;
  auto it = st.reserved.find(id);
  if (it == st.reserved.end()) return false;
  st.allocator->release(it->second.blocks);
  st.reserved.erase(it);
  return true;
}

// The answer to a KV transfer: checks, the request's reserved blocks, then
// the compute actor validates and stores the KV; the ack waits for it.
caf::typed_response_promise<KvAck> admit(Self self, KvTransfer& transfer) {
  auto& st = self->state;
  auto promise = self->make_response_promise<KvAck>();
  const RequestId id = transfer.id;
  auto refuse = [&](ErrorCode code, std::string message) {
    promise.deliver(make_ack(self, id, code, std::move(message)));
    return promise;
  };
  if (st.cancelled.contains(id)) return refuse(ErrorCode::cancelled, "request was cancelled");
  if (st.active.count(id) || st.admitting.count(id))
    return refuse(ErrorCode::invalid_request, "request " + std::to_string(id) + " is already held");
  if (transfer.chunk != 0 || transfer.chunk_count != 1)
    return refuse(ErrorCode::invalid_request, "chunked KV transfers are not supported yet");
  if (transfer.prompt_len <= 0 || transfer.max_new_tokens <= 0 ||
      transfer.prompt_len >= st.seq_len)
    return refuse(ErrorCode::invalid_request,
                  "prompt_len " + std::to_string(transfer.prompt_len) + ", max_new_tokens " +
                      std::to_string(transfer.max_new_tokens) + " do not fit seq_len " +
                      std::to_string(st.seq_len));
  // Checked here: the token is fed to the next batched step, where an id the
  // model lacks would fail every sequence of that batch.
  if (transfer.first_token < 0 || transfer.first_token >= st.vocab_size)
    return refuse(ErrorCode::invalid_request,
                  "first_token " + std::to_string(transfer.first_token) + " is outside the vocabulary [0, " +
                      std::to_string(st.vocab_size) + ")");
  auto held = st.reserved.find(id);
  if (held == st.reserved.end())
    return refuse(ErrorCode::timeout, "no KV blocks reserved for request " + std::to_string(id) +
                                          " (its reservation's lease ended, or none was made)");
  const int positions = gpu::kv_positions_needed(transfer.prompt_len, transfer.max_new_tokens, st.seq_len);
  if (positions > held->second.positions)
    return refuse(ErrorCode::invalid_request, "the KV needs " + std::to_string(positions) + " positions, " +
                                                  std::to_string(held->second.positions) + " were reserved");
  std::vector<int32_t> blocks = std::move(held->second.blocks);
  st.reserved.erase(held);
  Sequence seq;
  seq.blocks = blocks;
  seq.prompt_len = transfer.prompt_len;
  seq.limit = std::min(transfer.max_new_tokens, st.seq_len - transfer.prompt_len);
  seq.sampling = transfer.sampling;
  const int32_t first_token = transfer.first_token;
  st.admitting.insert(id);
  KvAdmit request{std::move(transfer), std::move(blocks)};
  self->request(st.compute, std::chrono::milliseconds(st.config.compute_timeout_ms),
                admit_atom::value, std::move(request))
      .then(
          [=](AdmitResult& r) mutable {
            auto& state = self->state;  // (not the outer `st`: lambdas must not copy it)
            state.admitting.erase(id);
            if (r.code == ErrorCode::none && state.cancelled.contains(id)) {
              r.code = ErrorCode::cancelled;
              r.message = "request was cancelled";
            }
            if (r.code != ErrorCode::none) {
              state.allocator->release(seq.blocks);
              promise.deliver(make_ack(self, id, r.code, std::move(r.message)));
              report_load(self);
              return;
            }
            seq.admitted = Clock::now();
            auto it = state.active.emplace(id, std::move(seq)).first;
            accept_token(self, it, first_token);  // token 0, sampled by the prefill side
            promise.deliver(make_ack(self, id, ErrorCode::none, {}));
            report_load(self);
            schedule_step(self);
          },
          [=](caf::error& e) mutable {
            self->state.admitting.erase(id);
            self->state.allocator->release(seq.blocks);
            promise.deliver(make_ack(self, id, code_of(e), describe("KV admission", e)));
            report_load(self);
          });
  return promise;
}

decode_actor::behavior_type decode_behavior(Self self, DisaggConfig config, compute_actor compute,
                                            router_actor router, std::string name) {
  auto& st = self->state;
  st.config = std::move(config);
  st.name = std::move(name);
  st.compute = compute;
  st.router = router;
  st.allocator.emplace(st.config.pool_blocks);
  self->link_to(compute);
  const auto compute_timeout = std::chrono::milliseconds(st.config.compute_timeout_ms);
  // Membership: learn the model from compute, then register with the router.
  self->request(compute, compute_timeout, info_atom::value)
      .then(
          [=](ModelInfo& model) {
            self->state.seq_len = model.seq_len;
            self->state.vocab_size = model.vocab_size;
            WorkerInfo info;
            info.role = WorkerRole::decode;
            info.name = self->state.name;
            info.model = std::move(model);
            info.block_size = self->state.config.block_size;
            info.total_blocks = self->state.config.pool_blocks;
            self->request(router, compute_timeout, register_atom::value, std::move(info),
                          caf::actor_cast<decode_actor>(self))
                .then([](caf::ok_atom) {}, [=](caf::error& e) { self->quit(e); });
          },
          [=](caf::error& e) { self->quit(e); });
  return {
      [=](reserve_atom, const KvReservation& r) { return reserve(self, r); },
      [=](kv_atom, KvTransfer& transfer) { return admit(self, transfer); },
      [=](lease_atom, RequestId id, uint64_t serial) {
        auto it = self->state.reserved.find(id);
        if (it == self->state.reserved.end() || it->second.serial != serial) return;  // filled or gone
        drop_reservation(self, id);
        report_load(self);
      },
      [=](cancel_atom, RequestId id) {
        auto& state = self->state;
        state.cancelled.add(id);
        drop_reservation(self, id);
        auto it = state.active.find(id);
        if (it != state.active.end()) {
          state.allocator->release(it->second.blocks);
          state.active.erase(it);
        }
        // Also when it held nothing (never arrived, or admitting: refused when
        // compute answers): the router gives back what it had reserved here
        // and needs the real load to count on again.
        report_load(self);
      },
      [=](status_atom) { return load_of(self); },
  };
}

}  // namespace

decode_actor spawn_decode(caf::actor_system& system, const DisaggConfig& config,
                          compute_actor compute, router_actor router, std::string name) {
  return system.spawn(decode_behavior, config, std::move(compute), std::move(router),
                      std::move(name));
}

}  // namespace disagg
