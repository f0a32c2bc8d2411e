// The router's books stay true: the KV blocks it counts on a decode worker
// come back whatever way a request ends, a request is sized as gpu::generate
// sizes it, and token/done messages count only from the request's own decode
// worker.
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <thread>

#include "actors/actor_fixture.h"
#include "caf/all.hpp"

namespace disagg::test {
namespace {

// The router's estimate of free blocks on its (only) decode worker, once it
// equals what the decode worker itself reports; -1 when they never agree.
int router_free_blocks_once_settled(Client& client, LocalCluster& cluster) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  int seen = -1;
  while (std::chrono::steady_clock::now() < deadline) {
    const auto status = client.status();
    const auto loads = cluster.decode_loads();
    if (status && loads.size() == 1)
      for (const auto& w : status->workers)
        if (w.role == WorkerRole::decode) {
          seen = w.free_blocks;
          if (w.free_blocks == loads[0].free_blocks) return seen;
        }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << "router says " << seen << " free blocks, the decode worker disagrees";
  return -1;
}

TEST_F(ActorTest, RequestFailingInPrefillGivesItsBlocksBackToTheRouter) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.block_size = 16;
  options.config.pool_blocks = 4;  // 64 positions
  options.config.max_kv_transfer_bytes = int64_t(stream_bytes_for(16));
  start(std::move(options));

  // 29 + 35 - 1 = 63 positions: the whole pool, reserved at dispatch; the
  // prefill worker then refuses the KV, so the decode worker never sees it.
  const RequestOutcome large = client_->generate(make_request(kTomHadARedBall, 35));
  ASSERT_EQ(large.code, ErrorCode::kv_too_large) << large.message;
  EXPECT_EQ(router_free_blocks_once_settled(*client_, *cluster_), 4);

  auto small = make_request(kOnceUponATime, 8);
  small.deadline_ms = 3000;
  const RequestOutcome out = client_->generate(small);
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(router_free_blocks_once_settled(*client_, *cluster_), 4);
}

TEST_F(ActorTest, RequestThatExactlyFitsThePoolAsGenerateCountsIsServed) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.block_size = 16;
  options.config.pool_blocks = 4;  // 64 positions
  start(std::move(options));
  // gpu::generate feeds 5 prompt + 59 generated positions (the 60th token is
  // emitted, never fed): exactly the pool.
  const int max_new = 60;
  const auto local = colocated(kOnceUponATime, max_new);
  ASSERT_EQ(local.tokens.size(), size_t(max_new)) << "precondition: no BOS before max_new_tokens";
  const RequestOutcome out = client_->generate(make_request(kOnceUponATime, max_new));
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.tokens, local.tokens);
  // One position more no decode worker can hold.
  const RequestOutcome over = client_->generate(make_request(kOnceUponATime, max_new + 1));
  EXPECT_EQ(over.code, ErrorCode::overloaded) << over.message;
}

// A chat request without max_tokens asks for the rest of the context; where
// no pool holds that much the router lowers it to what the largest holds
// (the request is served, and ends with finish length there), instead of
// refusing it. A request that set its own limit is still refused.
TEST_F(ActorTest, UpToCapacityRequestsAreLoweredToTheLargestPool) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.block_size = 16;
  options.config.pool_blocks = 4;  // 64 positions; the model's context is 512
  start(std::move(options));
  auto request = make_request(kOnceUponATime, 512 - 5);
  request.up_to_capacity = true;
  const auto local = colocated(kOnceUponATime, 60);
  ASSERT_EQ(local.tokens.size(), 60u) << "precondition: no BOS before 60 tokens";
  const RequestOutcome out = client_->generate(request);
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.tokens, local.tokens);  // 5 prompt + 59 fed positions: the pool
  EXPECT_EQ(out.finish, FinishReason::length);
  request.up_to_capacity = false;
  EXPECT_EQ(client_->generate(request).code, ErrorCode::overloaded);
}

// Sends a forged token event and a failed DecodeDone for `id` to the router
// whenever told to, naming every attempt serial a test's few requests can
// have: an actor the router knows nothing about.
caf::behavior forger(caf::event_based_actor* self, router_actor router) {
  return {
      [=](RequestId id) {
        for (uint64_t attempt = 0; attempt < 64; ++attempt) {
          self->send(router, token_atom::value, TokenBatch{{TokenEvent{id, 0, 7, {}, 0, {}, attempt}}});
          DecodeDone forged;
          forged.id = id;
          forged.code = ErrorCode::internal;
          forged.message = "forged";
          forged.attempt = attempt;
          self->send(router, done_atom::value, std::move(forged));
        }
      },
  };
}

TEST_F(ActorTest, TokenAndDoneFromAnActorOtherThanTheDecodeWorkerAreIgnored) {
  start(1, 1);
  const int max_new = 300;
  const auto local = colocated(kOnceUponATime, max_new);
  ASSERT_EQ(local.tokens.size(), size_t(max_new));
  auto fake = system_->spawn(forger, cluster_->router());
  auto request = make_request(kOnceUponATime, max_new);
  request.id = client_->next_id();
  const RequestId id = request.id;
  TokenLog log;
  auto record = log.callback();
  std::atomic<int> seen{0};
  // At the third token, while ~300 steps are still to come, the forger strikes.
  auto future = client_->submit(request, [&, id](const TokenEvent& e) {
    record(e);
    if (seen++ == 2) caf::anon_send(fake, id);
  });
  const RequestOutcome out = future.get();
  ASSERT_GT(seen.load(), 2);
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.tokens, local.tokens);
  std::vector<int32_t> streamed;
  for (const auto& e : log.events) streamed.push_back(e.token);
  EXPECT_EQ(streamed, local.tokens) << "a forged token event reached the client";
  caf::anon_send_exit(fake, caf::exit_reason::user_shutdown);
}

}  // namespace
}  // namespace disagg::test
