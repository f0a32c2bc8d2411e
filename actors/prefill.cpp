#include "actors/prefill.h"

#include <chrono>
#include <unordered_map>

#include "actors/errors.h"
#include "caf/all.hpp"

namespace disagg {

namespace {

using Clock = std::chrono::steady_clock;

int64_t micros_since(Clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - start).count();
}

struct Job {
  caf::typed_response_promise<PrefillReport> promise;
  int64_t prompt_tokens = 0;
  Clock::time_point received;
};

struct PrefillState {
  DisaggConfig config;
  std::string name;  // also the actor's name in CAF (stateful_actor reads state.name)
  compute_actor compute;
  router_actor router;
  std::unordered_map<RequestId, Job> jobs;
  int64_t queued_tokens = 0;
};

using Self = prefill_actor::stateful_pointer<PrefillState>;

// Every job ends here: its one report goes to the router and it is forgotten.
void finish(Self self, PrefillReport report) {
  auto it = self->state.jobs.find(report.id);
  if (it == self->state.jobs.end()) return;  // already cancelled
  self->state.queued_tokens -= it->second.prompt_tokens;
  it->second.promise.deliver(std::move(report));
  self->state.jobs.erase(it);
}

PrefillReport failure(RequestId id, ErrorCode code, std::string message) {
  PrefillReport r;
  r.id = id;
  r.code = code;
  r.message = std::move(message);
  return r;
}

void ship_kv(Self self, PrefillJob job, decode_actor decode, PrefillResult computed,
             int64_t prefill_us) {
  const auto& cfg = self->state.config;
  const uint64_t kv_bytes = computed.kv.size();
  if (int64_t(kv_bytes) > cfg.max_kv_transfer_bytes) {
    auto r = failure(job.id, ErrorCode::kv_too_large,
                     "KV of " + std::to_string(kv_bytes) + " bytes exceeds max-kv-transfer-bytes " +
                         std::to_string(cfg.max_kv_transfer_bytes));
    r.kv_bytes = kv_bytes;
    r.prefill_us = prefill_us;
    finish(self, std::move(r));
    return;
  }
  KvTransfer transfer;
  transfer.id = job.id;
  transfer.prompt_len = int32_t(job.prompt_tokens.size());
  transfer.max_new_tokens = job.max_new_tokens;
  transfer.sampling = job.sampling;
  transfer.first_token = computed.first_token;
  transfer.bytes = std::move(computed.kv);
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
            r.kv_transfer_us = micros_since(sent);
            r.decode_load = ack.load;
            finish(self, std::move(r));
          },
          [=](caf::error& e) {
            auto r = failure(id, code_of(e), describe("KV ack from decode worker", e));
            r.kv_bytes = kv_bytes;
            r.prefill_us = prefill_us;
            finish(self, std::move(r));
          });
}

prefill_actor::behavior_type prefill_behavior(Self self, DisaggConfig config, compute_actor compute,
                                              router_actor router, std::string name) {
  self->state.config = std::move(config);
  self->state.name = std::move(name);
  self->state.compute = compute;
  self->state.router = router;
  self->link_to(compute);
  const auto compute_timeout = std::chrono::milliseconds(self->state.config.compute_timeout_ms);
  // Membership: learn the model from compute, then register with the router.
  self->request(compute, compute_timeout, info_atom::value)
      .then(
          [=](ModelInfo& model) {
            WorkerInfo info;
            info.role = WorkerRole::prefill;
            info.name = self->state.name;
            info.model = std::move(model);
            self->request(router, compute_timeout, register_atom::value, std::move(info),
                          caf::actor_cast<prefill_actor>(self))
                .then([](caf::ok_atom) {}, [=](caf::error& e) { self->quit(e); });
          },
          [=](caf::error& e) { self->quit(e); });
  return {
      [=](prefill_atom, PrefillJob& job,
          decode_actor& decode) -> caf::typed_response_promise<PrefillReport> {
        auto promise = self->make_response_promise<PrefillReport>();
        if (self->state.jobs.count(job.id)) {
          promise.deliver(failure(job.id, ErrorCode::invalid_request,
                                  "request " + std::to_string(job.id) + " is already in prefill"));
          return promise;
        }
        const auto received = Clock::now();
        self->state.jobs[job.id] = Job{promise, int64_t(job.prompt_tokens.size()), received};
        self->state.queued_tokens += int64_t(job.prompt_tokens.size());
        PrefillWork work{job.id, job.prompt_tokens, job.sampling};
        const auto deadline = std::chrono::milliseconds(std::max<int64_t>(job.deadline_ms, 1));
        self->request(self->state.compute, deadline, prefill_atom::value, std::move(work))
            .then(
                [=](PrefillResult& computed) {
                  if (!self->state.jobs.count(job.id)) return;  // cancelled meanwhile
                  if (computed.code != ErrorCode::none) {
                    finish(self, failure(job.id, computed.code, std::move(computed.message)));
                    return;
                  }
                  ship_kv(self, job, decode, std::move(computed), micros_since(received));
                },
                [=](caf::error& e) {
                  finish(self, failure(job.id, code_of(e), describe("prefill compute", e)));
                });
        return promise;
      },
      [=](cancel_atom, RequestId id) {
        // The router has already answered its client; this only stops the work
        // (a KV already sent is cancelled at the decode worker by the router).
        finish(self, failure(id, ErrorCode::cancelled, "cancelled"));
      },
      [=](status_atom) {
        return PrefillLoad{int32_t(self->state.jobs.size()), self->state.queued_tokens};
      },
  };
}

}  // namespace

prefill_actor spawn_prefill(caf::actor_system& system, const DisaggConfig& config,
                            compute_actor compute, router_actor router, std::string name) {
  return system.spawn(prefill_behavior, config, std::move(compute), std::move(router),
                      std::move(name));
}

}  // namespace disagg
