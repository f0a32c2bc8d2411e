// The relay of a worker node (node/relay.h) keeps trying to register
// its worker while the router it knows is alive but refuses or does not
// answer, instead of leaving the worker unknown to the cluster for good.
#include <gtest/gtest.h>

#include <atomic>
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

caf::behavior idle_worker(caf::event_based_actor*) {
  return {[](status_atom) {}};
}

TEST(NodeRelay, RetriesARegistrationTheRouterRefused) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  auto attempts = std::make_shared<std::atomic<int>>(0);
  auto router = system.spawn(refusing_router, attempts, 2);
  auto worker = system.spawn(idle_worker);

  RelaySpec spec;
  spec.register_timeout = std::chrono::seconds(1);
  spec.register_retry = std::chrono::milliseconds(10);
  spec.register_retry_max = std::chrono::milliseconds(40);
  router_actor relay = spawn_router_relay(system, spec);
  {
    caf::scoped_actor self{system};
    WorkerInfo info;
    info.role = WorkerRole::decode;
    info.name = "decode-under-test";
    bool taken = false;
    self->request(relay, std::chrono::seconds(5), register_atom::value, info,
                  caf::actor_cast<decode_actor>(worker))
        .receive([&](caf::ok_atom) { taken = true; }, [](caf::error&) {});
    ASSERT_TRUE(taken);
  }
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

}  // namespace
}  // namespace disagg::test
