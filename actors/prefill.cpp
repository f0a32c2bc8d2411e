#include "actors/prefill.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <unordered_map>

#include "actors/errors.h"
#include "actors/request_metrics.h"
#include "actors/senders.h"
#include "actors/timing.h"
#include "caf/all.hpp"
#include "engine/kv_stream.h"
#include "kv/plane.h"

namespace disagg {

namespace {

// A job from its arrival until its one report. Cancelling only sets the flag:
// the report goes out when the work in progress (compute, or the KV ack) is
// over, so the router's slot for this worker stays held while it is busy.
struct Job {
  RequestId id = 0;
  caf::typed_response_promise<PrefillReport> promise;
  int64_t prompt_tokens = 0;
  Clock::time_point received;
  Clock::time_point deadline;
  CancelFlag cancelled = std::make_shared<std::atomic<bool>>(false);
  bool local = false;  // computed into its decode worker's own pool: no KV crosses to another worker
};

struct PrefillState {
  DisaggConfig config;
  std::string name;  // also the actor's name in CAF (stateful_actor reads state.name)
  compute_actor compute;
  router_actor router;  // its router, or its node's relay to one
  // The router behind the relay, as its node told it (router_atom): with
  // its own node, the one sender whose jobs and cancels it takes.
  caf::actor_addr router_behind;
  std::unordered_map<uint64_t, Job> jobs;        // by serial: received, not yet reported
  std::unordered_map<RequestId, uint64_t> live;  // request id -> its job, until cancelled
  uint64_t next_serial = 1;
  int64_t queued_tokens = 0;
  ModelInfo model;  // from compute: the fingerprint sent with streamed KV, the shape of stream plans
  std::string colocated;  // WorkerInfo::colocated
  bool joined = false;     // registered with the router (its prefix cache's events go there)
  uint64_t events_seq = 0;  // the last KvEvents batch sent to the router
};

using Self = prefill_actor::stateful_pointer<PrefillState>;

// Every job ends here: its one report goes to the router and it is forgotten.
void finish(Self self, uint64_t serial, PrefillReport report) {
  auto& st = self->state;
  auto it = st.jobs.find(serial);
  if (it == st.jobs.end()) return;
  Job& job = it->second;
  if (job.cancelled->load()) {
    report.code = ErrorCode::cancelled;
    report.message = "cancelled";
  }
  st.queued_tokens -= job.prompt_tokens;
  auto live = st.live.find(job.id);
  if (live != st.live.end() && live->second == serial) st.live.erase(live);
  if (!job.local) record_prefill_report(report);  // (the KV transfer metrics)
  job.promise.deliver(std::move(report));
  st.jobs.erase(it);
}

PrefillReport failure(RequestId id, ErrorCode code, std::string message) {
  PrefillReport r;
  r.id = id;
  r.code = code;
  r.message = std::move(message);
  return r;
}

// What CAF adds to a message's own bytes (BASP's header, the message's type
// names, ids): well under this.
constexpr int64_t kMessageFramingBytes = 4096;

// Hands the KV to the decode worker: one KvTransfer message carrying it, or,
// when it was streamed into the decode worker's blocks during the prefill,
// one carrying only what the decode side needs to continue (the commit).
// Either way the decode worker's KvAck ends the job.
void ship_kv(Self self, uint64_t serial, PrefillJob job, decode_actor decode, PrefillResult computed,
             int64_t prefill_us) {
  const auto& cfg = self->state.config;
  const uint64_t kv_bytes = computed.streamed ? computed.kv_bytes : computed.kv.size();
  if (!computed.streamed && int64_t(kv_bytes) > cfg.max_kv_transfer_bytes) {
    auto r = failure(job.id, ErrorCode::kv_too_large,
                     "KV of " + std::to_string(kv_bytes) + " bytes exceeds max-kv-transfer-bytes " +
                         std::to_string(cfg.max_kv_transfer_bytes));
    r.kv_bytes = kv_bytes;
    r.prefill_us = prefill_us;
    finish(self, serial, std::move(r));
    return;
  }
  KvTransfer transfer;
  transfer.id = job.id;
  transfer.prompt_len = int32_t(job.prompt_tokens.size());
  transfer.max_new_tokens = job.max_new_tokens;
  transfer.sampling = job.sampling;
  transfer.first_token = computed.first_token;
  transfer.first_logprobs = std::move(computed.first_logprobs);
  transfer.prompt_logprobs = std::move(computed.prompt_logprobs);
  transfer.first_step = job.first_step;
  transfer.context = job.prompt_tokens;  // (the penalties, a grammar and speculation read it)
  transfer.attempt = job.attempt;
  transfer.ticket = job.target.ticket;
  transfer.cached_tokens = computed.cached_tokens;
  transfer.bytes = std::move(computed.kv);
  if (computed.streamed) {
    transfer.transfer_id = job.target.transfer_id;
    transfer.fingerprint = self->state.model.fingerprint;
  } else if (job.target.max_message_bytes > 0) {
    // One message must fit the decode node's port (its guard cuts the
    // connection, every request on it, at a larger one): measured as CAF
    // writes it, its KV aside (the prompt, log probabilities and sampling,
    // a grammar too, come on top of the KV's bytes).
    std::vector<uint8_t> kv = std::move(transfer.bytes);
    std::vector<char> rest;
    caf::binary_serializer sink{self->system(), rest};
    const caf::error written = sink(transfer);
    transfer.bytes = std::move(kv);
    const int64_t size = int64_t(rest.size() + transfer.bytes.size()) + kMessageFramingBytes;
    if (written || size > job.target.max_message_bytes) {
      auto r = failure(job.id, ErrorCode::kv_too_large,
                       "a KV message of " + std::to_string(size) + " bytes exceeds the decode node's limit of " +
                           std::to_string(job.target.max_message_bytes) +
                           " (its node.max-message-bytes; a streamed KV has none: kv-transport tcp)");
      r.kv_bytes = kv_bytes;
      r.prefill_us = prefill_us;
      finish(self, serial, std::move(r));
      return;
    }
  }
  const bool streamed = computed.streamed;
  const int32_t cached_tokens = computed.cached_tokens;
  const int64_t tail_us = computed.tail_us;  // streamed: already spent between the last layer and the verdict
  const auto sent = Clock::now();
  const RequestId id = job.id;
  self->request(decode, std::chrono::milliseconds(cfg.ack_timeout_ms), kv_atom::value,
                std::move(transfer))
      .then(
          [=](KvAck& ack) {
            PrefillReport r;
            r.id = id;
            r.code = ack.code;
            r.message = std::move(ack.message);
            r.kv_bytes = kv_bytes;
            r.prefill_us = prefill_us;
            r.kv_transfer_us = tail_us + micros_since(sent);
            r.streamed = streamed;
            r.decode_load = ack.load;
            r.cached_tokens = cached_tokens;
            finish(self, serial, std::move(r));
          },
          [=](caf::error& e) {
            auto r = failure(id, code_of(e), describe("KV ack from decode worker", e));
            r.kv_bytes = kv_bytes;
            r.prefill_us = prefill_us;
            finish(self, serial, std::move(r));
          });
}

// The compute actor's answer to a job's prompt: ship the KV, unless the job
// ended meanwhile.
void on_computed(Self self, uint64_t serial, const PrefillJob& job, const decode_actor& decode,
                 PrefillResult& computed) {
  auto& st = self->state;
  record_prefix_evictions(WorkerRole::prefill, computed.cache_events.removed.size());
  if (st.joined && (!computed.cache_events.stored.empty() || !computed.cache_events.removed.empty())) {
    // (in the compute's order: its answers come in the order it computed them)
    computed.cache_events.seq = ++st.events_seq;
    self->send(st.router, kv_events_atom::value, std::move(computed.cache_events));
  }
  auto it = self->state.jobs.find(serial);
  if (it == self->state.jobs.end()) return;
  const Job& j = it->second;
  if (j.cancelled->load()) {
    finish(self, serial, failure(job.id, ErrorCode::cancelled, "cancelled"));
  } else if (computed.code != ErrorCode::none) {
    finish(self, serial, failure(job.id, computed.code, std::move(computed.message)));
  } else if (Clock::now() >= j.deadline) {
    finish(self, serial, failure(job.id, ErrorCode::timeout, "deadline passed during the prefill"));
  } else {
    // (streamed: prefill_us ends with the last layer, the rest is transfer)
    const int64_t prefill_us = micros_since(j.received) - computed.tail_us;
    // (computed into a pool that held a cached prefix: only the rest ran;
    // a stream's prefill computes every position and sends the rest)
    // (its own prefix cache: what it held was copied, not computed)
    const size_t skipped = size_t(j.local ? job.target.first_position : computed.cached_tokens);
    record_prefill_computed(job.prompt_tokens.size() - skipped);
    if (!j.local) record_prefill_prefix_lookup(int(job.prompt_tokens.size()), computed.cached_tokens);
    ship_kv(self, serial, job, decode, std::move(computed), prefill_us);
  }
}

// Membership: learn the model from compute, then (join_router) register
// with the router; a failure of either ends the actor.
void join(Self self, bool join_router) {
  const auto compute_timeout = std::chrono::milliseconds(self->state.config.compute_timeout_ms);
  self->request(self->state.compute, compute_timeout, info_atom::value)
      .then(
          [=](ModelInfo& model) {
            self->state.model = model;
            if (!join_router) return;
            self->state.joined = true;
            WorkerInfo info;
            info.role = WorkerRole::prefill;
            info.block_size = self->state.config.block_size;
            // (a colocated unit's compute keeps its prefixes in its decode pool)
            info.cache_blocks = self->state.colocated.empty() ? self->state.config.prefill_cache_blocks_in_use() : 0;
            // (only where it can send over shared memory: the decode worker picks shm for a host_id like its own)
            info.host_id = self->state.config.kv_shared_memory() ? kv::host_identity() : std::string();
            info.name = self->state.name;
            info.colocated = self->state.colocated;
            info.model = std::move(model);
            self->request(self->state.router, compute_timeout, register_atom::value, std::move(info),
                          caf::actor_cast<prefill_actor>(self))
                .then([](caf::ok_atom) {}, [=](caf::error& e) { self->quit(e); });
          },
          [=](caf::error& e) { self->quit(e); });
}

// Whether the job's KV is streamed (else it goes as one message).
bool streams(const PrefillState& st, const PrefillJob& job) {
  return st.config.kv_transport != "message" && job.target.transfer_id != 0;
}

// Why a job is refused before any compute, if it is: already in prefill,
// or a stream whose size (known before any compute) is over
// max-kv-transfer-bytes, or a target no plan fits (a block size that is no
// whole number of tiles, a first position past the prompt).
std::optional<PrefillReport> refusal_of(const PrefillState& st, const PrefillJob& job) {
  if (st.live.count(job.id))
    return failure(job.id, ErrorCode::invalid_request, "request " + std::to_string(job.id) + " is already in prefill");
  if (!streams(st, job) || job.target.block_size <= 0 || job.prompt_tokens.empty()) return std::nullopt;
  uint64_t bytes = 0;
  try {
    // (the target's runs too: the plan the compute will make must hold)
    bytes = gpu::KvStreamPlan(std::max(1, st.model.n_layers), std::max(1, st.model.n_kv_heads * st.model.head_dim),
                              int(job.prompt_tokens.size()), job.target.block_size, job.target.runs,
                              job.target.first_position)
                .total_bytes();
  } catch (const std::exception& e) {  // (invalid_argument, or length_error from a size a peer made up)
    return failure(job.id, ErrorCode::invalid_request, std::string("KV target: ") + e.what());
  }
  // A local target's KV crosses nothing: computed into its own pool's blocks.
  if (job.target.local() || int64_t(bytes) <= st.config.max_kv_transfer_bytes) return std::nullopt;
  auto r = failure(job.id, ErrorCode::kv_too_large,
                   "KV of " + std::to_string(bytes) + " bytes exceeds max-kv-transfer-bytes " +
                       std::to_string(st.config.max_kv_transfer_bytes));
  r.kv_bytes = bytes;
  return r;
}

// The job, booked, goes to the compute actor; its report answers `promise`.
void start_job(Self self, PrefillJob& job, decode_actor& decode, caf::typed_response_promise<PrefillReport> promise) {
  auto& st = self->state;
  const uint64_t serial = st.next_serial++;
  // (clamped: a job from elsewhere than the router may carry anything)
  const auto time_left = std::chrono::milliseconds(std::clamp<int64_t>(job.deadline_ms, 1, kMaxDeadlineMs));
  Job j;
  j.id = job.id;
  j.promise = promise;
  j.prompt_tokens = int64_t(job.prompt_tokens.size());
  j.local = job.target.local();
  j.received = Clock::now();
  j.deadline = j.received + time_left;
  PrefillWork work;
  work.id = job.id;
  work.tokens = job.prompt_tokens;
  work.sampling = job.sampling;
  work.deadline_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(j.deadline.time_since_epoch()).count();
  work.cancelled = j.cancelled;
  if (streams(st, job)) work.target = job.target;  // else: send it as a message
  work.kv_wait_ms = st.config.ack_timeout_ms;
  work.first_step = job.first_step;
  work.cache_salt = job.cache_salt;
  st.queued_tokens += j.prompt_tokens;
  st.live[job.id] = serial;
  st.jobs.emplace(serial, std::move(j));
  // The compute actor answers by the deadline by itself (it skips work
  // it reaches later); the margin covers a prompt it had already begun.
  const auto bound = time_left + std::chrono::milliseconds(st.config.compute_timeout_ms);
  self->request(st.compute, bound, prefill_atom::value, std::move(work))
      .then([=](PrefillResult& computed) { on_computed(self, serial, job, decode, computed); },
            [=](caf::error& e) {
              // (past the bound the compute may still be at it: told to stop at its next check, the
              // report already given) Its answer carried the prefix cache's events since the last
              // one: a number skipped, so the router's next batch shows the gap and asks for a snapshot.
              ++self->state.events_seq;
              auto it = self->state.jobs.find(serial);
              const auto stop = it != self->state.jobs.end() ? it->second.cancelled : nullptr;
              finish(self, serial, failure(job.id, code_of(e), describe("prefill compute", e)));
              if (stop) stop->store(true);
            });
}

prefill_actor::behavior_type prefill_behavior(Self self, DisaggConfig config, compute_actor compute,
                                              router_actor router, std::string name, std::string colocated,
                                              bool join_router) {
  self->state.config = std::move(config);
  self->state.name = std::move(name);
  self->state.colocated = std::move(colocated);
  self->state.compute = compute;
  self->state.router = router;
  self->link_to(compute);
  join(self, join_router);
  return {
      [=](prefill_atom, PrefillJob& job,
          decode_actor& decode) -> caf::typed_response_promise<PrefillReport> {
        // (the router's orders: from it or from this node only, as a decode
        // worker's; read before make_response_promise, which takes the sender)
        const bool ordered = from_node_or(self, self->state.router_behind);
        auto promise = self->make_response_promise<PrefillReport>();
        if (!ordered) promise.deliver(PrefillReport{job.id, ErrorCode::invalid_request, kNotItsRouter});
        else if (auto refused = refusal_of(self->state, job)) promise.deliver(std::move(*refused));
        else start_job(self, job, decode, promise);
        return promise;
      },
      [=](router_atom, caf::actor_addr& router) {
        if (from_this_node(self)) self->state.router_behind = std::move(router);
      },
      [=](cancel_atom, RequestId id) {
        // The router has already answered its client; this only stops the
        // work: the compute actor skips the prompt if it has not begun it (a
        // KV already sent is cancelled at the decode worker by the router).
        if (!from_node_or(self, self->state.router_behind)) return;
        auto& st = self->state;
        auto it = st.live.find(id);
        if (it == st.live.end()) return;
        st.jobs.at(it->second).cancelled->store(true);
        st.live.erase(it);  // the id may come again, as a new job
      },
      [=](status_atom) {
        return PrefillLoad{int32_t(self->state.jobs.size()), self->state.queued_tokens};
      },
      [=](kv_events_atom) -> caf::typed_response_promise<KvEvents> {
        // The compute's answer comes after those of every prompt before it,
        // whose events are numbered by then: the snapshot is as of that number.
        auto promise = self->make_response_promise<KvEvents>();
        self->request(self->state.compute, std::chrono::milliseconds(self->state.config.compute_timeout_ms),
                      kv_events_atom::value)
            .then(
                [=](KvEvents& all) mutable {
                  all.seq = self->state.events_seq;
                  promise.deliver(std::move(all));
                },
                [=](caf::error& e) mutable { promise.deliver(std::move(e)); });
        return promise;
      },
  };
}

}  // namespace

prefill_actor spawn_prefill(caf::actor_system& system, const DisaggConfig& config,
                            compute_actor compute, router_actor router, std::string name,
                            std::string colocated, bool join_router) {
  return system.spawn(prefill_behavior, config, std::move(compute), std::move(router),
                      std::move(name), std::move(colocated), join_router);
}

}  // namespace disagg
