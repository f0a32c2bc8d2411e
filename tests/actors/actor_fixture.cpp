#include "actors/actor_fixture.h"

#include "engine/kv_stream.h"

#include <mutex>

#include "model/checkpoint.h"
#include "engine/engine.h"
#include "engine/kv_format.h"
#include "support/test_paths.h"

namespace disagg::test {

DisaggConfig shared_model_config(int prefill, int decode) {
  DisaggConfig c;
  c.model = shared_model();
  c.backend = "cpu";
  c.prefill_workers = prefill;
  c.decode_workers = decode;
  c.pool_blocks = 512;  // 8192 positions: 16 full-length sequences
  c.default_deadline_ms = 30000;
  // Every prompt to a prefill worker: these tests are about the disaggregated
  // path (a prefill worker's faults, streams, reservations), which the
  // default would skip for their short prompts (conditional disaggregation);
  // the tests of the decode worker's own prefill set it back.
  c.local_prefill_tokens = 0;
  return c;
}

gpu::GenerateResult colocated(const std::vector<int32_t>& prompt, int max_new_tokens,
                              const Sampling& sampling) {
  static std::mutex mutex;
  static std::unique_ptr<gpu::Engine> engine;
  static std::unique_ptr<gpu::Constraints> constraints;
  std::lock_guard<std::mutex> lock(mutex);
  if (!engine) {
    gpu::EngineOptions options;
    options.backend = "cpu";
    const auto checkpoint = gpu::Checkpoint::open(shared_model());
    engine = std::make_unique<gpu::Engine>(checkpoint, options);
    constraints = std::make_unique<gpu::Constraints>(gpu::grammar_vocabulary(
        gpu::load_tokenizer(*checkpoint, shared_tokenizer()), engine->config().end_tokens));
  }
  return gpu::generate(*engine, prompt, max_new_tokens, sampling, constraints.get());
}

GenerateRequest make_request(std::vector<int32_t> prompt, int max_new_tokens, const Sampling& sampling) {
  GenerateRequest r;
  r.prompt_tokens = std::move(prompt);
  r.max_new_tokens = max_new_tokens;
  r.sampling = sampling;
  return r;
}

const std::vector<int32_t> kOnceUponATime{1, 403, 407, 261, 378};
const std::vector<int32_t> kTomHadARedBall{1,   274, 287, 381, 261, 352, 266, 268, 388, 426,
                                           346, 397, 355, 267, 308, 420, 327, 312, 270, 333,
                                           415, 322, 265, 262, 433, 422, 426, 385, 328};

size_t kv_bytes_for(int positions) {
  const auto model = gpu::Checkpoint::open(shared_model())->config();
  gpu::KvShape shape{uint32_t(model.n_layers), uint32_t(model.n_kv_heads), uint32_t(model.head_size()),
                     uint32_t(positions)};
  return gpu::kv_buffer_bytes(shape);
}

size_t stream_bytes_for(int prompt_len, int block_size) {
  const auto model = gpu::Checkpoint::open(shared_model())->config();
  return gpu::KvStreamPlan(model.n_layers, model.kv_dim(), prompt_len, block_size).total_bytes();
}

void ActorTest::SetUp() { system_ = std::make_unique<caf::actor_system>(system_config_); }

void ActorTest::TearDown() {
  if (cluster_ && expect_pools_free_) {
    EXPECT_TRUE(cluster_->wait_pools_free()) << "a decode pool did not return to full capacity";
    for (const auto& load : cluster_->decode_loads()) {
      EXPECT_EQ(load.free_blocks, load.total_blocks);
      EXPECT_EQ(load.active_sequences, 0);
    }
  }
  client_.reset();
  cluster_.reset();
  system_.reset();
}

LocalCluster& ActorTest::start(LocalClusterOptions options) {
  cluster_ = std::make_unique<LocalCluster>(*system_, std::move(options));
  client_ = std::make_unique<Client>(*system_, cluster_->router());
  return *cluster_;
}

LocalCluster& ActorTest::start(int prefill, int decode) {
  LocalClusterOptions options;
  options.config = shared_model_config(prefill, decode);
  return start(std::move(options));
}

}  // namespace disagg::test
