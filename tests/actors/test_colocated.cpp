// Colocated workers (node role `worker`): a prefill and a decode worker on one
// compute actor and pool, the prompt's KV computed straight into the reserved
// blocks (kv/local.h). Token identity with gpu::generate on
// several topologies is in test_generation.cpp (ReferenceTopology, also in
// chunks of 5 positions); here: the compute's local target is used once and
// only as registered, a chunked prefill lets decode steps run between its
// chunks and stops writing once its blocks are given up, cancels free
// everything, and prompts are prefilled between decode steps.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <future>

#include "actors/actor_fixture.h"
#include "actors/compute.h"
#include "caf/all.hpp"
#include "model/checkpoint.h"
#include "engine/kv_stream.h"
#include "gpu/pool_contents.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

// A compute unit with a pool and local targets, as a colocated node makes it.
struct LocalCompute {
  std::shared_ptr<kv::LocalKvTargets> targets = std::make_shared<kv::LocalKvTargets>();
  ComputeUnit unit;
  explicit LocalCompute(caf::actor_system& system, int prefill_chunk = 0) {
    ComputeSpec spec;
    spec.prefill_chunk = prefill_chunk;
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

// A colocated prompt runs a chunk per turn of the compute (here one position
// each): a decode step sent after it is answered before it ends, and once the
// decode worker gives its blocks up (a cancel between two chunks), no further
// chunk is computed or written. The second part depends on the test thread
// cancelling before some 470 one-position turns are done; it tries a few
// times and needs one stop part way.
TEST_F(ActorTest, AChunkedPrefillLetsDecodeStepsPassAndStopsWhenItsBlocksAreGivenUp) {
  LocalCompute compute(*system_, 1);
  gpu::KvPool& pool = *compute.unit.pool;
  constexpr int kPromptLen = 480;  // 30 blocks of 16
  std::vector<int32_t> prompt(kPromptLen);
  for (int i = 0; i < kPromptLen; ++i) prompt[size_t(i)] = 3 + (i * 37) % 500;
  std::vector<int32_t> blocks;
  for (int b = 1; b <= kPromptLen / 16; ++b) blocks.push_back(b);
  const std::vector<int> block_ids(blocks.begin(), blocks.end());
  DecodeStep step;  // one sequence at position 0 of a block the prompt does not use
  step.slots.push_back(StepSlot{99, 1, 0, 0, Sampling{}, {40}});

  caf::scoped_actor self{*system_};
  // The step's answer comes first, the prompt's after; returns the prompt's.
  // `between` runs when the step's answer is in.
  auto prefill_with_step = [&](uint64_t transfer_id, const std::function<void()>& between) {
    self->send(compute.unit.actor, prefill_atom::value, local_work(transfer_id, prompt, blocks));
    self->send(compute.unit.actor, step_atom::value, step);
    PrefillResult result;
    bool step_done = false;
    for (int answers = 0; answers < 2; ++answers)
      self->receive(
          [&](StepResult& r) {
            EXPECT_EQ(r.code, ErrorCode::none) << r.message;
            step_done = true;
            between();
          },
          [&](PrefillResult& r) {
            EXPECT_TRUE(step_done) << "the decode step waited for the whole prompt";
            result = std::move(r);
          },
          caf::after(std::chrono::seconds(30)) >> [&] { ADD_FAILURE() << "no answer in 30 s"; });
    return result;
  };

  compute.targets->expect(50, blocks);
  const PrefillResult whole = prefill_with_step(50, [] {});
  ASSERT_EQ(whole.code, ErrorCode::none) << whole.message;
  EXPECT_EQ(whole.first_token, colocated(prompt, 1).tokens.at(0));
  gpu::EngineOptions cpu;
  cpu.backend = "cpu";
  gpu::Engine reference(gpu::Checkpoint::open(shared_model()), cpu);
  EXPECT_EQ(test::gather_kv(pool, block_ids, kPromptLen), reference.prefill(prompt).kv)
      << "the chunks' KV differs from one prefill's";

  // Again into the same blocks, zeroed first, with the registration
  // cancelled when the step is answered: no chunk after that writes, so the
  // last block stays zero.
  const int kv_dim = int(pool.model().kv_dim());
  const int slabs = 2 * int(pool.model().n_layers);  // [layer][K then V]
  bool stopped_part_way = false;
  for (uint64_t id = 51; id < 56 && !stopped_part_way; ++id) {
    std::fill(pool.data(), pool.data() + pool.floats(), 0.0f);
    compute.targets->expect(id, blocks);
    const PrefillResult r = prefill_with_step(id, [&] { compute.targets->cancel(id); });
    if (r.code == ErrorCode::none) continue;  // all chunks done before the cancel: try again
    EXPECT_EQ(r.code, ErrorCode::cancelled) << r.message;
    EXPECT_NE(r.message.find("given up"), std::string::npos) << r.message;
    const std::vector<float> after = test::gather_kv(pool, block_ids, kPromptLen);
    for (int slab = 0; slab < slabs; ++slab) {
      const auto end = after.begin() + ptrdiff_t(slab + 1) * kPromptLen * kv_dim;
      EXPECT_TRUE(std::all_of(end - 16 * kv_dim, end, [](float x) { return x == 0.0f; }))
          << "a chunk after the cancel wrote the last block (layer " << slab / 2 << ")";
    }
    stopped_part_way = true;
  }
  EXPECT_TRUE(stopped_part_way) << "every prefill finished before its cancel (5 tries)";
  EXPECT_EQ(compute.targets->size(), 0u);
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
// A colocated prefill computes into its own pool: no KV crosses anything,
// so max-kv-transfer-bytes does not refuse its prompt (kv_too_large did).
TEST_F(ActorTest, AColocatedPromptIsNotRefusedForTheSizeOfAKvTransfer) {
  LocalClusterOptions options;
  options.config = shared_model_config(0, 0);
  options.config.max_kv_transfer_bytes = 1024;  // smaller than any prompt's KV
  options.colocated_workers = 1;
  start(std::move(options));
  const RequestOutcome out = client_->generate(make_request(kTomHadARedBall, 4));
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.tokens, colocated(kTomHadARedBall, 4).tokens);
}

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
