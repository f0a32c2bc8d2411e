// The client library's side of a stream (actors/client.h): the token events
// of a request come from its decode worker (direct-token-streams) and its
// outcome from the router, so the client passes on each index once and in
// order, and takes from a completed outcome the tokens no event brought,
// before the outcome. A scripted router stands in for the cluster.
#include <gtest/gtest.h>

#include <future>
#include <mutex>
#include <vector>

#include "actors/client.h"
#include "actors/config.h"
#include "caf/all.hpp"
#include "metrics/disagg_metrics.h"

namespace disagg::test {
namespace {

// Answers a generate with the events (index, token) of `script`, sent to the
// client first, then with a completed outcome of `tokens`.
caf::behavior scripted_router(caf::event_based_actor* self, std::vector<std::pair<int32_t, int32_t>> script,
                              std::vector<int32_t> tokens) {
  return {
      [=](generate_atom, GenerateRequest& request, client_actor& client) {
        for (const auto& [index, token] : script)
          self->send(client, token_atom::value, TokenEvent{request.id, index, token, {}, 0});
        RequestOutcome outcome;
        outcome.id = request.id;
        outcome.tokens = tokens;
        outcome.timings.cached_tokens = 16;
        return outcome;
      },
  };
}

struct Seen {
  std::vector<int32_t> indices, tokens, cached;
  RequestOutcome outcome;
};

Seen run(std::vector<std::pair<int32_t, int32_t>> script, std::vector<int32_t> tokens) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  auto router = caf::actor_cast<router_actor>(system.spawn(scripted_router, std::move(script), std::move(tokens)));
  Client client(system, router);
  auto seen = std::make_shared<Seen>();
  std::mutex mutex;
  GenerateRequest request;
  request.prompt_tokens = {1, 2};
  request.max_new_tokens = 8;
  auto future = client.submit(request, [&, seen](const TokenEvent& e) {
    std::lock_guard<std::mutex> lock(mutex);
    seen->indices.push_back(e.index);
    seen->tokens.push_back(e.token);
    seen->cached.push_back(e.cached_tokens);
  });
  EXPECT_EQ(future.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  seen->outcome = future.get();
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
  return *seen;
}

TEST(ClientStream, RepeatsAfterAMigrationArePassedOnOnce) {
  const double before = metrics::disagg_metrics().tokens_from_outcome.value();
  // A migrated request: the new decode worker streams again from index 1.
  const Seen s = run({{0, 50}, {1, 51}, {2, 52}, {1, 51}, {2, 52}, {3, 53}}, {50, 51, 52, 53});
  EXPECT_TRUE(s.outcome.ok());
  EXPECT_EQ(s.indices, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{50, 51, 52, 53}));
  EXPECT_EQ(metrics::disagg_metrics().tokens_from_outcome.value() - before, 0);
}

TEST(ClientStream, TokensNoEventBroughtComeFromTheOutcomeBeforeIt) {
  const double before = metrics::disagg_metrics().tokens_from_outcome.value();
  // Index 1 never came (lost with a worker), 2 and 3 are past the gap, 4 and
  // 5 came after the outcome: all are taken from it, in order.
  const Seen s = run({{0, 50}, {2, 52}, {3, 53}}, {50, 51, 52, 53, 54, 55});
  EXPECT_TRUE(s.outcome.ok());
  EXPECT_EQ(s.indices, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(s.tokens, (std::vector<int32_t>{50, 51, 52, 53, 54, 55}));
  EXPECT_EQ(s.cached.back(), 16) << "the outcome's count of cached prompt tokens";
  EXPECT_EQ(metrics::disagg_metrics().tokens_from_outcome.value() - before, 5);
}

// What the callbacks hold (the HTTP frontend's connection, which must not
// outlive its I/O context) is released as the outcome is passed on: the
// token callback's before the outcome callback runs, the outcome callback's
// by the callback itself (it may move what it holds out), not whenever the
// request's actor destroys its handlers after it quit.
TEST(ClientStream, TheCallbacksAreReleasedAsTheOutcomeComes) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  auto router = caf::actor_cast<router_actor>(system.spawn(scripted_router, std::vector<std::pair<int32_t, int32_t>>{{0, 50}},
                                                           std::vector<int32_t>{50, 51}));
  Client client(system, router);
  auto held_by_tokens = std::make_shared<int>(1);
  auto held_by_outcome = std::make_shared<int>(2);
  const std::weak_ptr<int> tokens_ref = held_by_tokens, outcome_ref = held_by_outcome;
  std::promise<bool> token_callback_gone;
  std::promise<bool> outcome_callback_gone;
  GenerateRequest request;
  request.prompt_tokens = {1, 2};
  request.max_new_tokens = 8;
  client.submit_async(
      request, [held = std::move(held_by_tokens)](const TokenEvent&) {},
      [&, held = std::move(held_by_outcome)](RequestOutcome) mutable {
        token_callback_gone.set_value(tokens_ref.expired());
        held.reset();  // (what the frontend's callback does with its connection)
        outcome_callback_gone.set_value(outcome_ref.expired());
      });
  auto gone = token_callback_gone.get_future();
  ASSERT_EQ(gone.wait_for(std::chrono::seconds(30)), std::future_status::ready);
  EXPECT_TRUE(gone.get()) << "the token callback still held its captures when the outcome came";
  EXPECT_TRUE(outcome_callback_gone.get_future().get()) << "a copy of the outcome callback held its captures";
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
}

// A cancel goes through the request's own actor (the router takes it from
// no one else): one made before that actor has started is kept for it, a
// second submission of an id in flight neither takes nor ends the first's
// entry, and an outcome ends the entry.
TEST(ClientCancel, ACancelBeforeTheRequestsActorStartsIsKeptForIt) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  caf::scoped_actor actor{system};
  const auto handle = caf::actor_cast<client_actor>(actor);
  LiveRequests live;
  const uint64_t ticket = live.open(7);
  EXPECT_NE(ticket, 0u);
  EXPECT_EQ(live.open(7), 0u) << "a second submission of an id in flight";
  EXPECT_FALSE(live.cancel(7).has_value()) << "no actor yet: kept";
  EXPECT_FALSE(live.attach(7, 0, handle)) << "the duplicate's actor";
  EXPECT_TRUE(live.attach(7, ticket, handle)) << "the cancel made before the actor started was lost";
  const auto through = live.cancel(7);
  ASSERT_TRUE(through.has_value());
  EXPECT_EQ(through->address(), handle.address());
  live.close(7, 0);  // (the duplicate's outcome)
  EXPECT_EQ(live.size(), 1u);
  live.close(7, ticket);
  EXPECT_EQ(live.size(), 0u);
  EXPECT_FALSE(live.cancel(7).has_value());
  const uint64_t other = live.open(8);
  EXPECT_FALSE(live.attach(8, other, handle)) << "never cancelled";
}

}  // namespace
}  // namespace disagg::test
