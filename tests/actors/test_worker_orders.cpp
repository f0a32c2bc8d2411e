// A worker's orders (a decode worker's reserve, prefill and cancel; a prefill
// worker's jobs) come from its own node or from the router it serves, never
// from another peer: CAF delivers to any actor whose handle a peer has seen
// (every prefill worker sees each decode worker's), and a peer's reserve
// held a pool's blocks for a lease, its cancel ended another's request.
// Here two actor systems of one process, joined by CAF's middleman on
// loopback, are two nodes: the worker's and a peer's.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <string>

#include "actors/actor_fixture.h"
#include "actors/compute.h"
#include "actors/decode.h"
#include "actors/prefill.h"
#include "actors/router.h"
#include "actors/senders.h"
#include "caf/all.hpp"
#include "caf/io/all.hpp"
#include "model/checkpoint.h"
#include "node/config.h"
#include "node/relay.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using namespace std::chrono_literals;

// Two nodes: `home` runs the worker, `peer` reaches it through its port.
struct TwoNodes {
  NodeSystemConfig home_config, peer_config;
  caf::actor_system home{home_config}, peer{peer_config};

  // `worker`, as the peer node sees it once published on home's loopback port.
  template <class Handle>
  Handle reach(const Handle& worker) {
    auto port = home.middleman().publish(worker, 0, "127.0.0.1");
    if (!port) return Handle{};
    auto remote = peer.middleman().remote_actor<Handle>("127.0.0.1", *port);
    return remote ? *remote : Handle{};
  }
};

compute_actor shared_compute(caf::actor_system& system) {
  ComputeSpec spec;
  spec.checkpoint = gpu::Checkpoint::open(shared_model());
  spec.pool_block_size = 16;
  spec.pool_blocks = 64;
  return spawn_compute(system, spec);
}

// Waits until `router` counts a worker of `role` (it registered: it knows
// its model and takes orders from then on).
void await_registered(caf::actor_system& system, const router_actor& router, WorkerRole role) {
  caf::scoped_actor self{system};
  int workers = 0;
  for (const auto deadline = std::chrono::steady_clock::now() + 10s;
       workers == 0 && std::chrono::steady_clock::now() < deadline;)
    self->request(router, 5s, status_atom::value)
        .receive([&](const RouterStatus& s) { workers = s.count(role); }, [](caf::error&) {});
  ASSERT_EQ(workers, 1);
}

TEST(WorkerOrders, ADecodeWorkerTakesOrdersFromItsNodeAndItsRouterOnly) {
  TwoNodes nodes;
  const DisaggConfig config = shared_model_config(1, 1);
  const router_actor router = spawn_router(nodes.home, config, nullptr);
  const decode_actor worker = spawn_decode(nodes.home, config, shared_compute(nodes.home), router, "ordered");
  const StopAll stop(worker, router);
  ASSERT_NO_FATAL_FAILURE(await_registered(nodes.home, router, WorkerRole::decode));
  const decode_actor remote = nodes.reach(worker);
  ASSERT_TRUE(remote) << "the peer node could not reach the worker";
  caf::scoped_actor local{nodes.home}, stranger{nodes.peer};

  auto free_blocks = [&] {
    int32_t free = -1;
    local->request(worker, 5s, status_atom::value).receive([&](const DecodeLoad& l) { free = l.free_blocks; },
                                                           [](caf::error&) {});
    return free;
  };
  auto reserve = [&](caf::scoped_actor& from, const decode_actor& to, RequestId id) {
    KvReservation r;
    r.id = id;
    r.positions = 40;  // 3 blocks
    r.prompt_len = 8;
    r.lease_ms = 60000;
    std::string answer = "no answer";
    from->request(to, 5s, reserve_atom::value, r)
        .receive([&](const ReserveReply& reply) { answer = reply.code == ErrorCode::none ? "" : reply.message; },
                 [&](caf::error& e) { answer = "error: " + caf::to_string(e); });
    return answer;
  };
  const int32_t all = free_blocks();
  EXPECT_EQ(reserve(stranger, remote, 0x0DD1), kNotItsRouter);
  EXPECT_EQ(free_blocks(), all) << "a peer's reservation held blocks";
  PrefillJob job;
  job.id = 0x0DD2;
  job.prompt_tokens = kOnceUponATime;
  std::string prefill_answer = "no answer";
  stranger->request(remote, 5s, prefill_atom::value, job)
      .receive([&](const PrefillReport& r) { prefill_answer = r.message; },
               [&](caf::error& e) { prefill_answer = "error: " + caf::to_string(e); });
  EXPECT_EQ(prefill_answer, kNotItsRouter);

  // Held by its node's order; a peer's cancel (and its claim to be the
  // router, which only the node tells) frees nothing.
  ASSERT_EQ(reserve(local, worker, 0x0DD3), "");
  ASSERT_EQ(free_blocks(), all - 3);
  stranger->send(remote, router_atom::value, stranger->address());
  stranger->send(remote, cancel_atom::value, RequestId{0x0DD3});
  // (the peer's messages reach the worker in order: a reply to its status
  // request comes after them)
  DecodeLoad seen;
  stranger->request(remote, 5s, status_atom::value).receive([&](const DecodeLoad& l) { seen = l; }, [](caf::error&) {});
  EXPECT_EQ(seen.free_blocks, all - 3) << "a peer's cancel freed a reservation";

  // Once its node says the peer is its router, the peer's orders count.
  local->send(worker, router_atom::value, stranger->address());
  stranger->send(remote, cancel_atom::value, RequestId{0x0DD3});
  stranger->request(remote, 5s, status_atom::value).receive([&](const DecodeLoad& l) { seen = l; }, [](caf::error&) {});
  EXPECT_EQ(seen.free_blocks, all) << "its router's cancel freed nothing";
  EXPECT_EQ(reserve(stranger, remote, 0x0DD4), "");
  EXPECT_EQ(free_blocks(), all - 3);
  local->send(worker, cancel_atom::value, RequestId{0x0DD4});
  EXPECT_EQ(free_blocks(), all);
}

TEST(WorkerOrders, APrefillWorkerTakesJobsFromItsNodeAndItsRouterOnly) {
  TwoNodes nodes;
  const DisaggConfig config = shared_model_config(1, 1);
  const router_actor router = spawn_router(nodes.home, config, nullptr);
  const prefill_actor worker = spawn_prefill(nodes.home, config, shared_compute(nodes.home), router, "ordered");
  const StopAll stop(worker, router);
  ASSERT_NO_FATAL_FAILURE(await_registered(nodes.home, router, WorkerRole::prefill));
  const prefill_actor remote = nodes.reach(worker);
  ASSERT_TRUE(remote) << "the peer node could not reach the worker";
  caf::scoped_actor local{nodes.home}, stranger{nodes.peer};
  auto job_answer = [&](RequestId id) {
    PrefillJob job;
    job.id = id;
    job.prompt_tokens = kOnceUponATime;
    job.max_new_tokens = 4;
    job.deadline_ms = 60000;
    std::string answer = "no answer";
    // (to no decode worker: a job taken is computed, then fails to ship)
    stranger->request(remote, 30s, prefill_atom::value, job, decode_actor{})
        .receive([&](const PrefillReport& r) { answer = r.message; },
                 [&](caf::error& e) { answer = "error: " + caf::to_string(e); });
    return answer;
  };
  stranger->send(remote, router_atom::value, stranger->address());  // (a peer's claim: ignored)
  EXPECT_EQ(job_answer(0x0DE1), kNotItsRouter);
  local->send(worker, router_atom::value, stranger->address());
  const std::string taken = job_answer(0x0DE2);
  EXPECT_NE(taken, kNotItsRouter);
  EXPECT_NE(taken, "no answer");

  // A job of its router's, in flight (its KV sent to a decode worker that
  // never acks), is cancelled by its router only: another peer's cancel
  // leaves it live, so the same id again is refused as in prefill.
  caf::scoped_actor silent_decode{nodes.peer}, intruder{nodes.peer};
  PrefillJob job;
  job.id = 0x0DE3;
  job.prompt_tokens = kOnceUponATime;
  job.max_new_tokens = 4;
  job.deadline_ms = 60000;  // (0: past before it runs, on a busy machine)
  stranger->send(remote, prefill_atom::value, job, caf::actor_cast<decode_actor>(silent_decode));
  auto again = [&](caf::scoped_actor& from) {
    std::string answer = "no answer";
    // (a job's refusal comes at once; one taken would wait for the ack)
    from->request(remote, 5s, prefill_atom::value, job, decode_actor{})
        .receive([&](const PrefillReport& r) { answer = r.message; },
                 [&](caf::error& e) { answer = "error: " + caf::to_string(e); });
    return answer;
  };
  intruder->send(remote, cancel_atom::value, job.id);
  intruder->request(remote, 5s, status_atom::value).receive([](const PrefillLoad&) {}, [](caf::error&) {});
  const std::string second = again(stranger);
  EXPECT_NE(second.find("already in prefill"), std::string::npos) << "a peer's cancel ended the job: " << second;
}

// A prefill node's gate (the face its relay registers at the router, which
// passes the router's jobs on to its worker) takes jobs and cancels from its
// router and its node only, as the worker does.
caf::behavior job_router(caf::event_based_actor* self, std::shared_ptr<std::promise<prefill_actor>> face,
                         std::shared_ptr<std::atomic<int>> asked) {
  auto once = std::make_shared<bool>(false);
  return {
      [=](register_atom, WorkerInfo&, prefill_actor& registered) -> caf::result<caf::ok_atom> {
        if (!*once) face->set_value(registered);
        *once = true;
        return caf::ok_atom::value;
      },
      // Asked for the decode workers' endpoints: the first time (when the
      // gate learns its router) none; later never, so the gate holds a job
      // for a decode worker elsewhere until its question times out.
      [=](status_atom) {
        auto answer = self->make_response_promise<RouterStatus>();
        if (asked->fetch_add(1) == 0) answer.deliver(RouterStatus{});
        return answer;
      },
      // The test's: send `job` to `gate` as this router, its report back.
      [=](prefill_atom, PrefillJob& job, prefill_actor& gate, decode_actor& decode) {
        auto report = self->make_response_promise<PrefillReport>();
        self->request(gate, 30s, prefill_atom::value, std::move(job), std::move(decode))
            .then([=](PrefillReport& r) mutable { report.deliver(std::move(r)); },
                  [=](caf::error& e) mutable { report.deliver(std::move(e)); });
        return report;
      },
      [=](cancel_atom, RequestId id, prefill_actor& gate) { self->send(gate, cancel_atom::value, id); },
  };
}

// A prefill worker that registers itself with its relay and answers a status.
caf::behavior idle_prefill(caf::event_based_actor* self, router_actor relay) {
  WorkerInfo info;
  info.role = WorkerRole::prefill;
  info.name = "gated";
  self->request(relay, 5s, register_atom::value, info, caf::actor_cast<prefill_actor>(self))
      .then([](caf::ok_atom) {}, [](caf::error&) {});
  return {[](status_atom) { return PrefillLoad{}; }, [](router_atom, caf::actor_addr&) {}};
}

TEST(WorkerOrders, APrefillGateTakesJobsAndCancelsFromItsNodeAndItsRouterOnly) {
  TwoNodes nodes;
  RelaySpec spec;
  spec.peer_refresh = std::chrono::hours(1);
  const router_actor relay = spawn_router_relay(nodes.home, spec);
  nodes.home.spawn(idle_prefill, relay);
  auto face = std::make_shared<std::promise<prefill_actor>>();
  auto registered = face->get_future();
  auto asked = std::make_shared<std::atomic<int>>(0);
  const caf::actor router = nodes.peer.spawn(job_router, face, asked);
  auto router_port = nodes.peer.middleman().publish(router, 0, "127.0.0.1");
  ASSERT_TRUE(router_port);
  auto router_there = nodes.home.middleman().remote_actor("127.0.0.1", *router_port);  // (untyped: this test's)
  ASSERT_TRUE(router_there);
  set_relay_router(relay, caf::actor_cast<router_actor>(*router_there));
  ASSERT_EQ(registered.wait_for(10s), std::future_status::ready);
  const prefill_actor gate = registered.get();  // (the peer node's proxy of it)
  const StopAll stop(relay, router);
  // (its first question answered before this test's first job: the router
  // handles that after it, and the answer goes first on the one connection)
  for (const auto deadline = std::chrono::steady_clock::now() + 5s;
       asked->load() == 0 && std::chrono::steady_clock::now() < deadline;)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(asked->load(), 1);
  caf::scoped_actor stranger{nodes.peer}, test{nodes.peer};
  // (a decode worker on the peer node, to which the gate has no route)
  const decode_actor elsewhere = caf::actor_cast<decode_actor>(test);
  PrefillJob job;
  job.id = 0x0DF1;
  job.prompt_tokens = kOnceUponATime;
  std::string answer = "no answer";
  stranger->request(gate, 5s, prefill_atom::value, job, elsewhere)
      .receive([&](const PrefillReport& r) { answer = r.message; },
               [&](caf::error& e) { answer = "error: " + caf::to_string(e); });
  EXPECT_EQ(answer, kNotItsRouter);

  // The router's job waits at the gate while the gate asks the router for
  // a route (a question this router leaves unanswered until it times out);
  // a peer's cancel leaves it there, its router's ends it.
  auto report_of = [&](RequestId id, bool cancel) {
    const int asked_before = asked->load();
    job.id = id;
    auto handle = test->request(router, 30s, prefill_atom::value, job, gate, elsewhere);
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (asked->load() == asked_before && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    EXPECT_GT(asked->load(), asked_before) << "the job never reached the gate";
    if (cancel) stranger->send(router, cancel_atom::value, id, gate);  // (as the router)
    else stranger->send(gate, cancel_atom::value, id);
    std::string message = "no answer";
    handle.receive([&](const PrefillReport& r) { message = r.message; },
                   [&](caf::error& e) { message = "error: " + caf::to_string(e); });
    return message;
  };
  // (first the peer's: its job ends when the gate's question does, after
  // which the next job has the gate ask again)
  EXPECT_NE(report_of(0x0DF2, false), "cancelled") << "a peer's cancel ended the router's job";
  EXPECT_EQ(report_of(0x0DF3, true), "cancelled");
}

}  // namespace
}  // namespace disagg::test
