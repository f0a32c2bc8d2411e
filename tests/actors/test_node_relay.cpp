// The relay of a worker node (node/relay.h) keeps trying to register
// its worker while the router it knows is alive but refuses or does not
// answer, instead of leaving the worker unknown to the cluster for good.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <mutex>
#include <vector>
#include <chrono>
#include <memory>
#include <thread>

#include "actors/config.h"
#include "node/relay.h"
#include "caf/all.hpp"

namespace disagg::test {
namespace {

// A router that refuses the first `refusals` registrations, then accepts.
caf::behavior refusing_router(caf::event_based_actor*, std::shared_ptr<std::atomic<int>> attempts,
                              int refusals) {
  return {
      [=](register_atom, WorkerInfo&, decode_actor&) -> caf::result<caf::ok_atom> {
        if (attempts->fetch_add(1) < refusals) return caf::make_error(caf::sec::runtime_error, "not now");
        return caf::ok_atom::value;
      },
  };
}

// A worker that registers itself with its relay (as the node's workers do),
// saying whether the relay took it.
caf::behavior self_registering_worker(caf::event_based_actor* self, router_actor relay, std::string name,
                                      std::shared_ptr<std::promise<bool>> taken) {
  WorkerInfo info;
  info.role = WorkerRole::decode;
  info.name = std::move(name);
  self->request(relay, std::chrono::seconds(5), register_atom::value, info, caf::actor_cast<decode_actor>(self))
      .then([=](caf::ok_atom) { taken->set_value(true); },  // (then linked: it ends with the relay)
            [=](caf::error&) {
              taken->set_value(false);
              self->quit();
            });
  return {[](status_atom) {}, [](router_atom, caf::actor_addr&) {}};
}

bool registers(caf::actor_system& system, const router_actor& relay, const std::string& name) {
  auto taken = std::make_shared<std::promise<bool>>();
  auto answer = taken->get_future();
  system.spawn(self_registering_worker, relay, name, taken);
  return answer.wait_for(std::chrono::seconds(10)) == std::future_status::ready && answer.get();
}

// A router that counts the registrations it is sent (and accepts them).
caf::behavior counting_router(caf::event_based_actor*, std::shared_ptr<std::atomic<int>> registrations) {
  return {
      [=](register_atom, WorkerInfo&, decode_actor&) -> caf::result<caf::ok_atom> {
        registrations->fetch_add(1);
        return caf::ok_atom::value;
      },
      [](status_atom) { return RouterStatus{}; },
  };
}

TEST(NodeRelay, RetriesARegistrationTheRouterRefused) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  auto attempts = std::make_shared<std::atomic<int>>(0);
  auto router = system.spawn(refusing_router, attempts, 2);

  RelaySpec spec;
  spec.register_timeout = std::chrono::seconds(1);
  spec.register_retry = std::chrono::milliseconds(10);
  spec.register_retry_max = std::chrono::milliseconds(40);
  router_actor relay = spawn_router_relay(system, spec);
  ASSERT_TRUE(registers(system, relay, "decode-under-test"));
  set_relay_endpoint(relay, "127.0.0.1:1");
  set_relay_router(relay, caf::actor_cast<router_actor>(router));

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  while (attempts->load() < 3 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(attempts->load(), 3) << "two refusals, then one accepted registration";
  // Accepted: no further attempts.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(attempts->load(), 3);

  caf::anon_send_exit(relay, caf::exit_reason::user_shutdown);  // linked: the worker goes too
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
}

// Any peer that reaches a worker node can address its relay (CAF delivers
// to any actor id it made known): the relay takes its worker's registration
// from that worker only, and once (a registration of another's had it link
// to and register that one: its refusal or loss ended the relay and, linked,
// the node's worker), and its router and endpoint from the node only.
TEST(NodeRelay, TakesItsWorkerFromTheWorkerAndItsRouterFromTheNodeOnly) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  RelaySpec spec;
  spec.register_timeout = std::chrono::seconds(5);
  router_actor relay = spawn_router_relay(system, spec);
  auto someone = system.spawn(counting_router, std::make_shared<std::atomic<int>>(0));  // any actor
  caf::scoped_actor outsider{system};
  WorkerInfo info;
  info.role = WorkerRole::decode;
  info.name = "not-its-own";
  bool taken = true;
  outsider->request(relay, std::chrono::seconds(5), register_atom::value, info, caf::actor_cast<decode_actor>(someone))
      .receive([&](caf::ok_atom) { taken = true; }, [&](caf::error&) { taken = false; });
  EXPECT_FALSE(taken) << "a registration of another actor than its sender";
  ASSERT_TRUE(registers(system, relay, "the-worker"));
  EXPECT_FALSE(registers(system, relay, "a-second-worker")) << "the relay took a second worker";

  auto wrong = std::make_shared<std::atomic<int>>(0), right = std::make_shared<std::atomic<int>>(0);
  auto wrong_router = system.spawn(counting_router, wrong);
  auto right_router = system.spawn(counting_router, right);
  const caf::actor as_message_target = caf::actor_cast<caf::actor>(relay);
  using endpoint_atom = caf::atom_constant<caf::atom("endpoint")>;
  caf::anon_send(as_message_target, endpoint_atom::value, std::string("10.0.0.1:1"));
  caf::anon_send(as_message_target, router_atom::value, caf::actor_cast<router_actor>(wrong_router));
  outsider->send(as_message_target, router_atom::value, caf::actor_cast<router_actor>(wrong_router));
  set_relay_endpoint(relay, "127.0.0.1:1");
  set_relay_router(relay, caf::actor_cast<router_actor>(right_router));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (right->load() == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(right->load(), 1) << "the node's own router got no registration";
  // (one round trip: a registration the relay sent the wrong router before
  // the right one's is in its mailbox before this question)
  outsider->request(wrong_router, std::chrono::seconds(5), status_atom::value)
      .receive([](RouterStatus&) {}, [](caf::error&) {});
  EXPECT_EQ(wrong->load(), 0) << "the relay took its router from a peer";

  for (const caf::actor& a : {caf::actor_cast<caf::actor>(relay), caf::actor_cast<caf::actor>(someone),
                              caf::actor_cast<caf::actor>(wrong_router), caf::actor_cast<caf::actor>(right_router)})
    caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
}

// A prefill worker that registers itself with its relay and answers a
// status (what its gate passes on).
caf::behavior prefill_worker(caf::event_based_actor* self, router_actor relay) {
  WorkerInfo info;
  info.role = WorkerRole::prefill;
  info.name = "prefill-under-test";
  self->request(relay, std::chrono::seconds(5), register_atom::value, info, caf::actor_cast<prefill_actor>(self))
      .then([](caf::ok_atom) {}, [](caf::error&) {});
  return {[](status_atom) { return PrefillLoad{}; }, [](router_atom, caf::actor_addr&) {}};
}

// What a prefill node's router saw: the face its worker registered with,
// the status questions it was asked (a gate asks for the decode workers'
// endpoints) and the KV event batches it was sent (by their seq).
struct RouterSaw {
  std::promise<prefill_actor> face;
  std::atomic<int> asked{0};
  std::mutex mutex;
  std::vector<uint64_t> seqs;
};

caf::behavior gate_router(caf::event_based_actor*, std::shared_ptr<RouterSaw> saw) {
  auto once = std::make_shared<bool>(false);
  return {
      [=](register_atom, WorkerInfo&, prefill_actor& registered) -> caf::result<caf::ok_atom> {
        if (!*once) saw->face.set_value(registered);
        *once = true;
        return caf::ok_atom::value;
      },
      [=](status_atom) {
        saw->asked.fetch_add(1);
        return RouterStatus{};
      },
      [=](kv_events_atom, KvEvents& events) {
        std::lock_guard<std::mutex> lock(saw->mutex);
        saw->seqs.push_back(events.seq);
      },
  };
}

// A prefill node's relay passes on its worker's KV events only (through
// the gate, as the face the router knows): a peer's had the router credit
// them to this worker (its prefix index, which routes requests here).
TEST(NodeRelay, PassesOnItsPrefillWorkersKvEventsOnly) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  RelaySpec spec;
  spec.peer_refresh = std::chrono::hours(1);
  router_actor relay = spawn_router_relay(system, spec);
  auto saw = std::make_shared<RouterSaw>();
  auto router = system.spawn(gate_router, saw);
  caf::scoped_actor worker{system};
  WorkerInfo info;
  info.role = WorkerRole::prefill;
  info.name = "prefill-under-test";
  bool taken = false;
  worker->request(relay, std::chrono::seconds(5), register_atom::value, info, caf::actor_cast<prefill_actor>(worker))
      .receive([&](caf::ok_atom) { taken = true; }, [](caf::error&) {});
  ASSERT_TRUE(taken);
  set_relay_router(relay, caf::actor_cast<router_actor>(router));
  auto registered = saw->face.get_future();
  ASSERT_EQ(registered.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const prefill_actor gate = registered.get();  // (linked to this test's worker, which ends normally: stopped below)
  caf::scoped_actor outsider{system};
  outsider->send(relay, kv_events_atom::value, KvEvents{7, false, {1, 2, 3}, {}});
  worker->send(relay, kv_events_atom::value, KvEvents{42, false, {4}, {}});  // (after the peer's: behind it)
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  auto seen = [&] {
    std::lock_guard<std::mutex> lock(saw->mutex);
    return saw->seqs;
  };
  while (std::find(seen().begin(), seen().end(), 42u) == seen().end() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  EXPECT_EQ(seen(), std::vector<uint64_t>{42}) << "the router got a peer's events as the worker's";
  for (const caf::actor& a : {caf::actor_cast<caf::actor>(relay), caf::actor_cast<caf::actor>(router),
                              caf::actor_cast<caf::actor>(gate)})
    caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
}

// A prefill node's gate (the face its relay registers) takes its router
// from its relay only (one from anyone else had it ask that router for the
// decode workers to connect to), and its refresh timer from itself.
TEST(NodeRelay, APrefillGateTakesItsRouterAndTimerFromItsRelayAndItselfOnly) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  RelaySpec spec;
  spec.peer_refresh = std::chrono::hours(1);  // (its own timer asks no one meanwhile)
  router_actor relay = spawn_router_relay(system, spec);
  system.spawn(prefill_worker, relay);
  auto saw = std::make_shared<RouterSaw>(), wrong_saw = std::make_shared<RouterSaw>();
  std::atomic<int>& asked = saw->asked;
  auto router = system.spawn(gate_router, saw);
  auto wrong = system.spawn(gate_router, wrong_saw);
  set_relay_router(relay, caf::actor_cast<router_actor>(router));
  auto registered = saw->face.get_future();
  ASSERT_EQ(registered.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const prefill_actor gate = registered.get();
  caf::scoped_actor outsider{system};
  outsider->send(caf::actor_cast<caf::actor>(gate), router_atom::value, caf::actor_cast<router_actor>(wrong));
  // (the gate answers this after it handled the message above; a question
  // it asked the wrong router then is in that one's mailbox before ours)
  outsider->request(gate, std::chrono::seconds(5), status_atom::value).receive([](PrefillLoad&) {}, [](caf::error&) {});
  outsider->request(wrong, std::chrono::seconds(5), status_atom::value).receive([](RouterStatus&) {}, [](caf::error&) {});
  EXPECT_EQ(wrong_saw->asked.load(), 1) << "the gate asked a router a peer named (1: this test's question)";

  // Its refresh timer is its own too: a refresh from anyone asked the router
  // at once and started a chain of its own. (Each round trip below counts
  // one question of this test's at the router.)
  const auto asked_by = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (asked.load() == 0 && std::chrono::steady_clock::now() < asked_by)
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  ASSERT_EQ(asked.load(), 1) << "the gate's own question at its router";
  auto round_trip = [&](const caf::actor& to, auto answer) {
    outsider->request(to, std::chrono::seconds(5), status_atom::value).receive(answer, [](caf::error&) {});
  };
  round_trip(caf::actor_cast<caf::actor>(router), [](RouterStatus&) {});  // (its answer is in the gate's mailbox now)
  round_trip(caf::actor_cast<caf::actor>(gate), [](PrefillLoad&) {});     // (and taken: no question out)
  using refresh_atom = caf::atom_constant<caf::atom("refresh")>;
  outsider->send(caf::actor_cast<caf::actor>(gate), refresh_atom::value);
  round_trip(caf::actor_cast<caf::actor>(gate), [](PrefillLoad&) {});
  round_trip(caf::actor_cast<caf::actor>(router), [](RouterStatus&) {});
  EXPECT_EQ(asked.load(), 3) << "a peer's refresh had the gate ask its router (3: two of this test's)";
  for (const caf::actor& a : {caf::actor_cast<caf::actor>(relay), caf::actor_cast<caf::actor>(router),
                              caf::actor_cast<caf::actor>(wrong)})
    caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
}

}  // namespace
}  // namespace disagg::test
