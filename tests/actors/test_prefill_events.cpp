// A prefill worker's prefix-cache events (KvEvents) reach the router
// numbered, so that a batch the router misses shows as a gap and it asks
// for a snapshot (router.cpp, on_kv_events). A compute answer that never
// comes (past its bound) takes its events along: the worker skips their
// number. Here the prefill actor is real and everything around it is a
// stand-in the test holds: a compute that answers the first prompt never and
// the second with a stored block, a router that records the events'
// numbers, a decode worker that acks every KV.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <vector>

#include "actors/actor_fixture.h"
#include "actors/compute.h"
#include "actors/prefill.h"
#include "caf/all.hpp"
#include "model/checkpoint.h"

namespace disagg::test {
namespace {

using namespace std::chrono_literals;

struct Seen {
  std::mutex mutex;
  std::vector<uint64_t> event_numbers;
  std::promise<void> registered, events;
  std::vector<caf::response_promise> never_answered;  // (kept, so the compute's silence is not an error)
};

caf::behavior silent_then_storing_compute(caf::event_based_actor* self, ModelInfo model, std::shared_ptr<Seen> seen) {
  auto calls = std::make_shared<int>(0);
  return {
      [=](info_atom) { return model; },
      [=](prefill_atom, PrefillWork& work) {
        caf::response_promise promise = self->make_response_promise();
        if ((*calls)++ == 0) {
          std::lock_guard<std::mutex> lock(seen->mutex);
          seen->never_answered.push_back(promise);
          return promise;
        }
        PrefillResult r;
        r.id = work.id;
        r.first_token = 5;
        r.cache_events.stored = {42};
        promise.deliver(std::move(r));
        return promise;
      },
      [](kv_events_atom) { return KvEvents{}; },
      [](cancel_atom, RequestId) {},
  };
}

caf::behavior recording_router(caf::event_based_actor* self, std::shared_ptr<Seen> seen) {
  self->set_default_handler(caf::drop);
  return {
      [=](register_atom, WorkerInfo&, prefill_actor&) {
        seen->registered.set_value();
        return caf::ok_atom::value;
      },
      [=](kv_events_atom, KvEvents& events) {
        std::lock_guard<std::mutex> lock(seen->mutex);
        seen->event_numbers.push_back(events.seq);
        if (seen->event_numbers.size() == 1) seen->events.set_value();
      },
  };
}

caf::behavior acking_decode(caf::event_based_actor* self) {
  self->set_default_handler(caf::drop);
  return {[](kv_atom, KvTransfer& t) {
    KvAck ack;
    ack.id = t.id;
    return ack;
  }};
}

TEST(PrefillEvents, AComputeAnswerLostPastItsBoundSkipsItsEventsNumber) {
  DisaggSystemConfig system_config;
  caf::actor_system system{system_config};
  DisaggConfig config = shared_model_config(1, 1);
  config.kv_transport = "message";
  config.compute_timeout_ms = 1000;  // (also the bound of its model and registration requests)
  auto seen = std::make_shared<Seen>();
  const ModelInfo model = model_info(*gpu::Checkpoint::open(config.model));
  auto compute = caf::actor_cast<compute_actor>(system.spawn(silent_then_storing_compute, model, seen));
  auto router = caf::actor_cast<router_actor>(system.spawn(recording_router, seen));
  auto decode = caf::actor_cast<decode_actor>(system.spawn(acking_decode));
  const prefill_actor prefill = spawn_prefill(system, config, compute, router, "prefill-events");
  // Whatever the test's end: the held answer given, every actor told to go (the system waits for them).
  struct Stop {
    std::function<void()> f;
    ~Stop() { f(); }
  } stop{[&] {
    {
      std::lock_guard<std::mutex> lock(seen->mutex);
      for (auto& p : seen->never_answered) p.deliver(caf::make_error(caf::sec::request_timeout));
      seen->never_answered.clear();
    }
    for (const caf::actor& a : {caf::actor_cast<caf::actor>(prefill), caf::actor_cast<caf::actor>(compute),
                                caf::actor_cast<caf::actor>(router), caf::actor_cast<caf::actor>(decode)})
      caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  }};
  ASSERT_EQ(seen->registered.get_future().wait_for(10s), std::future_status::ready);
  caf::scoped_actor self{system};
  auto run = [&](RequestId id, int64_t deadline_ms) {
    PrefillJob job;
    job.id = id;
    job.prompt_tokens = {1, 2, 3};
    job.max_new_tokens = 4;
    job.deadline_ms = deadline_ms;
    PrefillReport report;
    self->request(prefill, 10s, prefill_atom::value, job, decode)
        .receive([&](PrefillReport& r) { report = std::move(r); }, [&](caf::error& e) { FAIL() << system.render(e); });
    return report;
  };
  // The first prompt's answer never comes: past its deadline and the compute bound, it fails.
  const PrefillReport lost = run(1, 50);
  EXPECT_NE(lost.code, ErrorCode::none) << lost.message;
  // The second's answer stores a block: its events are numbered after the lost ones.
  const PrefillReport stored = run(2, 5000);
  EXPECT_EQ(stored.code, ErrorCode::none) << stored.message;
  ASSERT_EQ(seen->events.get_future().wait_for(10s), std::future_status::ready);
  std::lock_guard<std::mutex> lock(seen->mutex);
  EXPECT_EQ(seen->event_numbers, std::vector<uint64_t>{2}) << "no gap for the events the lost answer carried";
}

}  // namespace
}  // namespace disagg::test
