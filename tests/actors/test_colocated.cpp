// Colocated workers (node role `worker`): a prefill and a decode worker on one
// compute actor and pool, the prompt's KV copied by the compute straight into
// the reserved blocks (kv/local.h). Token identity with gpu::generate on
// several topologies is in test_generation.cpp (ReferenceTopology); here: the
// compute's local target is used once and only as registered, cancels free
// everything, and prompts are prefilled between decode steps.
#include <gtest/gtest.h>

#include <future>

#include "actors/actor_fixture.h"
#include "actors/compute.h"
#include "caf/all.hpp"
#include "gpu/checkpoint.h"
#include "gpu/kv_stream.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

// A compute unit with a pool and local targets, as a colocated node makes it.
struct LocalCompute {
  std::shared_ptr<kv::LocalKvTargets> targets = std::make_shared<kv::LocalKvTargets>();
  ComputeUnit unit;
  explicit LocalCompute(caf::actor_system& system) {
    ComputeSpec spec;
    spec.checkpoint = gpu::Checkpoint::open(shared_model());
    spec.engine.backend = "cpu";
    spec.pool_block_size = 16;
    spec.pool_blocks = 64;
    spec.local_targets = targets;
    unit = spawn_compute_unit(system, spec);
  }
};

PrefillResult run(caf::actor_system& system, const compute_actor& compute, PrefillWork work) {
  caf::scoped_actor self{system};
  PrefillResult result;
  self->request(compute, std::chrono::seconds(30), prefill_atom::value, std::move(work))
      .receive([&](PrefillResult& r) { result = std::move(r); },
               [&](caf::error& e) { ADD_FAILURE() << system.render(e); });
  return result;
}

PrefillWork local_work(uint64_t transfer_id, const std::vector<int32_t>& prompt, const std::vector<int32_t>& blocks) {
  PrefillWork work;
  work.id = 7;
  work.tokens = prompt;
  work.target = KvTarget{transfer_id, kLocalKvTransport, {}, 16,
                         gpu::KvStreamPlan::runs_of(blocks, int(blocks.size()))};
  return work;
}

TEST_F(ActorTest, ALocalTargetIsWrittenOnceAndOnlyWhenRegistered) {
  LocalCompute compute(*system_);
  const std::vector<int32_t>& prompt = kTomHadARedBall;  // 29 tokens: 2 blocks
  const std::vector<int32_t> blocks = {5, 6};

  // Unregistered: nothing is computed into the pool.
  PrefillResult unknown = run(*system_, compute.unit.actor, local_work(42, prompt, blocks));
  EXPECT_EQ(unknown.code, ErrorCode::invalid_request) << unknown.message;
  EXPECT_FALSE(unknown.streamed);

  compute.targets->expect(42, blocks);
  PrefillResult first = run(*system_, compute.unit.actor, local_work(42, prompt, blocks));
  ASSERT_EQ(first.code, ErrorCode::none) << first.message;
  EXPECT_TRUE(first.streamed);
  EXPECT_EQ(first.kv_bytes, stream_bytes_for(int(prompt.size())));
  EXPECT_EQ(first.first_token, colocated(prompt, 1).tokens.at(0));
  EXPECT_EQ(compute.targets->size(), 0u) << "the compute took the registration";

  // Taken: the same id again writes nothing.
  PrefillResult again = run(*system_, compute.unit.actor, local_work(42, prompt, blocks));
  EXPECT_EQ(again.code, ErrorCode::invalid_request);

  // Cancelled before the prefill: nothing either.
  compute.targets->expect(43, blocks);
  compute.targets->cancel(43);
  EXPECT_EQ(run(*system_, compute.unit.actor, local_work(43, prompt, blocks)).code, ErrorCode::invalid_request);
  caf::anon_send_exit(compute.unit.actor, caf::exit_reason::user_shutdown);
}

// Cancels at every phase (queued, reserving, prefilling, decoding) on two
// colocated workers: the others finish as gpu::generate does, and every pool
// is empty afterwards (TearDown), so no registration or block is stranded.
TEST_F(ActorTest, CancelledRequestsOnColocatedWorkersFreeTheirBlocks) {
  LocalClusterOptions options;
  options.config = shared_model_config(0, 0);
  options.colocated_workers = 2;
  start(std::move(options));
  // Every fourth is cancelled at once (queued, reserving or prefilling),
  // every fourth plus one at its first token (decoding).
  std::vector<std::future<RequestOutcome>> futures;
  Client* client = client_.get();
  for (int i = 0; i < 24; ++i) {
    GenerateRequest request = make_request(i % 2 ? kTomHadARedBall : kOnceUponATime, 40 + i);
    request.id = client->next_id();
    const RequestId id = request.id;
    TokenCallback on_token;
    if (i % 4 == 1) on_token = [client, id](const TokenEvent& e) { if (e.index == 0) client->cancel(id); };
    futures.push_back(client->submit(request, on_token));
    if (i % 4 == 0) client->cancel(id);
  }
  int cancelled = 0;
  for (size_t k = 0; k < futures.size(); ++k) {
    const RequestOutcome out = futures[k].get();
    if (k % 4 <= 1 && out.code == ErrorCode::cancelled) {
      ++cancelled;
      continue;
    }
    ASSERT_TRUE(out.ok()) << k << ": " << to_string(out.code) << ": " << out.message;
    EXPECT_EQ(out.tokens, colocated(k % 2 ? kTomHadARedBall : kOnceUponATime, 40 + int(k)).tokens);
  }
  EXPECT_GE(cancelled, 6) << "most cancels came before their request ended";
}

// Continuous batching on a colocated worker: a request that arrives while
// another decodes is prefilled between two decode steps of it, so it starts
// streaming before the first one ends (one worker, one compute thread).
TEST_F(ActorTest, AColocatedWorkerPrefillsNewPromptsBetweenDecodeSteps) {
  LocalClusterOptions options;
  options.config = shared_model_config(0, 0);
  options.colocated_workers = 1;
  start(std::move(options));
  TokenLog long_log;
  auto long_request = client_->submit(make_request(kOnceUponATime, 200), long_log.callback());
  // Wait until the long request streams, then send a short one.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(long_log.mutex);
      if (long_log.events.size() >= 3) break;
    }
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the long request never streamed";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const RequestOutcome short_out = client_->generate(make_request(kTomHadARedBall, 4));
  ASSERT_TRUE(short_out.ok()) << short_out.message;
  size_t long_tokens_then = 0;
  {
    std::lock_guard<std::mutex> lock(long_log.mutex);
    long_tokens_then = long_log.events.size();
  }
  const RequestOutcome long_out = long_request.get();
  ASSERT_TRUE(long_out.ok()) << long_out.message;
  EXPECT_EQ(long_out.tokens, colocated(kOnceUponATime, 200).tokens);
  EXPECT_EQ(short_out.tokens, colocated(kTomHadARedBall, 4).tokens);
  EXPECT_EQ(short_out.decode_worker, long_out.decode_worker);
  EXPECT_LT(long_tokens_then, long_out.tokens.size()) << "the short request waited for the long one to end";
}

}  // namespace
}  // namespace disagg::test
