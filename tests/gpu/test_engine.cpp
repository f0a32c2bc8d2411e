// The Engine's two paths (batched prefill, batched paged decode) agree with
// each other and with themselves under batching; invalid input is rejected.
// Runs on the "auto" backend: CPU here, CUDA on a GPU machine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gpu/backend.h"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "engine/engine.h"
#include "gpu/pool_contents.h"
#include "gpu/error.h"
#include "engine/generate.h"
#include "engine/sampling.h"
#include "text/tokenizer.h"
#include "support/reference_cases.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {


std::shared_ptr<const Checkpoint> shared_checkpoint() {
  static auto checkpoint = Checkpoint::open(test::shared_model());
  return checkpoint;
}

// The longest prompt of the shared reference files (478 tokens today; callers
// size their blocks from its length).
std::vector<int> long_prompt() {
  std::vector<int> best;
  for (const auto& c : test::load_all_reference_cases())
    if (c.prompt_tokens.size() > best.size()) best = c.prompt_tokens;
  return best;
}

// Blocks for `positions` positions, scattered: out of order with gaps
// ({3, 1} for two blocks); the pool needs 2 * their count blocks.
std::vector<int> scattered_blocks(int positions, int block_size) {
  std::vector<int> blocks;
  const int n = KvPool::blocks_for(positions, block_size);
  for (int i = 0; i < n; ++i) blocks.push_back(2 * (n - 1 - i) + 1);
  return blocks;
}

// Bit for bit: a prefill row and a decode step run the same fixed arithmetic
// (gpu/fixed_math.h), so they must agree exactly; the message gives the size
// of a difference.
void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  float worst = 0.0f;
  size_t differing = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(a[i] - b[i]));
    differing += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  }
  EXPECT_EQ(differing, 0u) << what << ": " << differing << " of " << a.size()
                           << " values differ, max abs difference " << worst;
}

using test::gather_kv;

KvView view_of(const Engine& engine, const PrefillOutput& prefilled) {
  KvView view;
  view.header.fingerprint = engine.fingerprint();
  view.header.shape = prefilled.shape;
  view.payload = prefilled.kv.data();
  return view;
}

// Prefill's logits and KV against the same prompt fed one token per decode step.
void expect_prefill_matches_stepwise(Engine& engine, const std::vector<int>& prompt, int block_size,
                                     const std::vector<int>& blocks) {
  const PrefillOutput prefilled = engine.prefill(prompt);
  ASSERT_EQ(prefilled.shape, engine.kv_shape(int(prompt.size())));
  ASSERT_EQ(prefilled.kv.size(), prefilled.shape.floats());
  ASSERT_EQ(prefilled.logits.size(), size_t(engine.config().vocab_size));

  KvPool pool = kv_pool_for(engine, block_size, *std::max_element(blocks.begin(), blocks.end()) + 1);
  std::vector<float> logits;
  for (size_t pos = 0; pos < prompt.size(); ++pos)
    logits = engine.decode_step(pool, {DecodeSlot{prompt[pos], int(pos), &blocks}});
  expect_same_bits(prefilled.logits, logits, "prefill vs stepwise logits");
  expect_same_bits(prefilled.kv, gather_kv(pool, blocks, int(prompt.size())), "prefill vs stepwise KV");
}

TEST(Engine, PrefillMatchesStepwiseDecodeOnTheSharedModel) {
  Engine engine(shared_checkpoint());
  const std::vector<int> prompt = long_prompt();
  ASSERT_GT(prompt.size(), 16u) << "the longest reference prompt should span several blocks";
  expect_prefill_matches_stepwise(engine, prompt, 16, scattered_blocks(int(prompt.size()), 16));
  expect_prefill_matches_stepwise(engine, {kBosToken}, 16, {0});
}

// Prompt log probabilities read every position's logits: the same bits as a
// decode step at that position, whole or in chunks, and the last one is the
// logits a prefill returns anyway.
TEST(Engine, EveryPositionsLogitsAreThoseOfADecodeStepThere) {
  Engine engine(shared_checkpoint());
  const std::vector<int> prompt = long_prompt();
  const size_t vocab = size_t(engine.config().vocab_size);
  std::vector<float> rows(prompt.size() * vocab, NAN);
  PrefillHooks hooks;
  hooks.on_logits = [&](int first, int count, const float* logits) {
    std::copy(logits, logits + size_t(count) * vocab, rows.begin() + long(size_t(first) * vocab));
  };
  const PrefillOutput with = engine.prefill(prompt, hooks);
  const PrefillOutput without = engine.prefill(prompt);
  EXPECT_EQ(with.logits, without.logits);
  EXPECT_EQ(with.kv, without.kv);
  EXPECT_TRUE(std::equal(with.logits.begin(), with.logits.end(), rows.end() - long(vocab)));

  const int n_blocks = KvPool::blocks_for(int(prompt.size()), 16);
  std::vector<int> blocks(static_cast<size_t>(n_blocks));
  std::iota(blocks.begin(), blocks.end(), 0);
  KvPool stepwise = kv_pool_for(engine, 16, n_blocks);
  KvPool chunked = kv_pool_for(engine, 16, n_blocks);
  std::vector<float> chunk_rows(rows.size(), NAN);
  for (size_t first = 0; first < prompt.size(); first += 7) {
    const size_t count = std::min<size_t>(7, prompt.size() - first);
    const std::vector<float> last = engine.prefill_chunk(
        chunked, std::vector<int>(prompt.begin() + long(first), prompt.begin() + long(first + count)), int(first),
        blocks, [&](int at, int k, const float* logits) {
          std::copy(logits, logits + size_t(k) * vocab, chunk_rows.begin() + long(size_t(at) * vocab));
        });
    EXPECT_TRUE(std::equal(last.begin(), last.end(), chunk_rows.begin() + long((first + count - 1) * vocab)));
  }
  for (size_t pos = 0; pos < prompt.size(); ++pos) {
    const std::vector<float> step = engine.decode_step(stepwise, {DecodeSlot{prompt[pos], int(pos), &blocks}});
    ASSERT_TRUE(std::equal(step.begin(), step.end(), rows.begin() + long(pos * vocab))) << "position " << pos;
    ASSERT_TRUE(std::equal(step.begin(), step.end(), chunk_rows.begin() + long(pos * vocab))) << "chunked, position " << pos;
  }
  // What gpu::generate reports of them: token i's log probability after i - 1.
  SamplingParams p;
  p.prompt_logprobs = 2;
  const GenerateResult r = generate(engine, prompt, 4, p);
  ASSERT_EQ(r.prompt_logprobs.size(), prompt.size() - 1);
  for (size_t i = 1; i < prompt.size(); ++i) {
    const TokenLogprobs want = token_logprobs(rows.data() + (i - 1) * vocab, int(vocab), prompt[i], 2);
    EXPECT_EQ(r.prompt_logprobs[i - 1].logprob, want.logprob) << i;
    EXPECT_EQ(r.prompt_logprobs[i - 1].top_tokens, want.top_tokens) << i;
  }
}

TEST(Engine, LongPrefillAttendedInChunksMatchesStepwiseDecode) {
  // 400 positions over 25 scattered blocks of the pool.
  std::vector<int> prompt = {kBosToken};
  while (prompt.size() < 400)
    for (const auto& c : test::load_reference_cases(test::shared_reference()))
      prompt.insert(prompt.end(), c.output_tokens.begin(), c.output_tokens.end());
  prompt.resize(400);
  std::vector<int> blocks;
  for (int i = 0; i < KvPool::blocks_for(400, 16); ++i) blocks.push_back((i * 7) % 25);  // a permutation
  Engine engine(shared_checkpoint());
  expect_prefill_matches_stepwise(engine, prompt, 16, blocks);
}

TEST(Engine, PrefillMatchesStepwiseOnARandomGqaModelWithItsOwnClassifier) {
  // 4 query heads per kv head and a separately stored classifier: paths the
  // shared model (2 per kv head, shared classifier) does not take.
  const std::string dir = test::make_temp_dir("engine-gqa");
  const std::string path = dir + "/model.bin";
  ModelConfig config{32, 40, 2, 4, 1, 300, 40, false};
  write_random_checkpoint(path, config, 7);
  Engine engine(Checkpoint::open(path));
  std::vector<int> prompt;
  for (int i = 0; i < 30; ++i) prompt.push_back((i * 37 + 5) % config.vocab_size);
  expect_prefill_matches_stepwise(engine, prompt, 16, {2, 0});

  // generate stops when prompt + generated reaches seq_len.
  const std::vector<int> near_end(35, 7);
  const GenerateResult r = generate(engine, near_end, 100, SamplingParams{});
  EXPECT_LE(r.tokens.size(), 5u);
  if (r.finish == FinishReason::length) EXPECT_EQ(r.tokens.size(), 5u);
  EXPECT_EQ(generate_stepwise(engine, near_end, 100, SamplingParams{}).tokens, r.tokens);
  std::filesystem::remove_all(dir);
}

// The other layouts' paths (Qwen2's biases, NeoX rotary and epsilon; Qwen3's
// Q/K norms and wider heads; Llama
// 3.1's RoPE factors) keep the arithmetic fixed: prefill equals stepwise
// decode bit for bit, and a batch decodes each sequence as it would alone.
TEST(Engine, QwenAndRopeFactorModelsAreBatchAndChunkInvariant) {
  const std::string dir = test::make_temp_dir("engine-arch");
  ModelConfig qwen2{64, 96, 2, 4, 2, 300, 64, true};
  qwen2.arch = Architecture::qwen2;
  qwen2.rms_epsilon = 1e-6f;
  ModelConfig qwen3{64, 96, 2, 4, 2, 300, 64, true};
  qwen3.arch = Architecture::qwen3;
  qwen3.head_dim = 32;  // q is 128 wide, the residual 64
  qwen3.rms_epsilon = 1e-6f;
  ModelConfig factors{64, 96, 2, 4, 2, 300, 64, false};
  factors.rope_theta = 500000.0f;
  factors.rope_factors = llama3_rope_factors(factors, 32.0f, 1.0f, 4.0f, 8192);
  for (const ModelConfig& config : {qwen2, qwen3, factors}) {
    SCOPED_TRACE(to_string(config.arch));
    const std::string path = dir + "/" + to_string(config.arch) + std::to_string(config.rope_factors.size()) + ".gguf";
    write_gguf(*random_weights(config, 3), byte_vocabulary(300), "arch", path, FileType::f32);
    const auto checkpoint = Checkpoint::open(path);
    EXPECT_EQ(checkpoint->config().arch, config.arch);
    EXPECT_EQ(checkpoint->config().rms_epsilon, config.rms_epsilon);
    EXPECT_EQ(checkpoint->config().rope_factors, config.rope_factors);
    EXPECT_EQ(checkpoint->config().head_size(), config.head_size());
    Engine engine(checkpoint);
    std::vector<int> prompt;
    for (int i = 0; i < 40; ++i) prompt.push_back((i * 37 + 5) % config.vocab_size);
    expect_prefill_matches_stepwise(engine, prompt, 16, {3, 0, 1});
    // Three sequences decoded together, each against itself alone.
    KvPool pool = kv_pool_for(engine, 16, 12);
    std::vector<std::vector<int>> blocks{{0, 3, 6, 9}, {1, 4, 7, 10}, {2, 5, 8, 11}};
    std::vector<DecodeSlot> slots;
    for (int s = 0; s < 3; ++s) {
      const std::vector<int> p(prompt.begin(), prompt.begin() + 10 + 7 * s);
      pool.write(blocks[size_t(s)], view_of(engine, engine.prefill(p)));
      slots.push_back(DecodeSlot{11 + s, int(p.size()), &blocks[size_t(s)]});
    }
    const std::vector<float> together = engine.decode_step(pool, slots);
    for (int s = 0; s < 3; ++s) {
      const std::vector<float> alone = engine.decode_step(pool, {slots[size_t(s)]});
      const size_t v = size_t(config.vocab_size);
      EXPECT_TRUE(alone == std::vector<float>(together.begin() + long(s * v), together.begin() + long((s + 1) * v)))
          << "sequence " << s;
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(Engine, BatchedDecodeMatchesDecodingEachSequenceAlone) {
  Engine engine(shared_checkpoint());
  const int steps = 12, block_size = 16;
  std::vector<std::vector<int>> prompts = {{kBosToken}, {1, 403, 407, 261, 378}, long_prompt()};
  if (int(prompts[2].size()) + steps > engine.config().seq_len) prompts[2].resize(engine.config().seq_len - steps);
  // Sequence 2 joins the batch after 4 steps of the others (mid-generation).
  const std::vector<int> joins_at = {0, 0, 4};

  struct Sequence {
    std::vector<int> blocks, tokens;
    int pos = 0;  // where the last token will be fed
    std::vector<float> last_logits;
  };
  std::vector<Sequence> seqs(prompts.size());
  // Blocks handed out round-robin, so every sequence's blocks are scattered.
  std::vector<int> needed(prompts.size());
  for (size_t s = 0; s < prompts.size(); ++s)
    needed[s] = KvPool::blocks_for(int(prompts[s].size()) + steps, block_size);
  BlockPool allocator(std::accumulate(needed.begin(), needed.end(), 0));
  for (int round = 0; round < *std::max_element(needed.begin(), needed.end()); ++round)
    for (size_t s = 0; s < prompts.size(); ++s)
      if (round < needed[s]) seqs[s].blocks.push_back(allocator.allocate(1).at(0));
  KvPool pool = kv_pool_for(engine, block_size, allocator.num_blocks());

  for (int step = 0; step < steps + joins_at.back(); ++step) {
    std::vector<DecodeSlot> slots;
    std::vector<size_t> owners;
    for (size_t s = 0; s < seqs.size(); ++s) {
      Sequence& q = seqs[s];
      if (step < joins_at[s] || int(q.tokens.size()) >= steps) continue;
      if (step == joins_at[s]) {  // prefill, ship the KV into the pool, sample the first token
        const PrefillOutput prefilled = engine.prefill(prompts[s]);
        pool.write(q.blocks, view_of(engine, prefilled));
        q.tokens.push_back(argmax(prefilled.logits.data(), engine.config().vocab_size));
        q.pos = int(prompts[s].size());
        continue;
      }
      slots.push_back(DecodeSlot{q.tokens.back(), q.pos, &q.blocks});
      owners.push_back(s);
    }
    if (slots.empty()) continue;
    const std::vector<float> logits = engine.decode_step(pool, slots);
    ASSERT_EQ(logits.size(), slots.size() * engine.config().vocab_size);
    for (size_t i = 0; i < owners.size(); ++i) {
      Sequence& q = seqs[owners[i]];
      const float* row = logits.data() + i * engine.config().vocab_size;
      q.last_logits.assign(row, row + engine.config().vocab_size);
      q.tokens.push_back(argmax(row, engine.config().vocab_size));
      ++q.pos;
    }
  }

  for (size_t s = 0; s < seqs.size(); ++s) {
    const GenerateResult alone = generate(engine, prompts[s], steps, SamplingParams{});
    ASSERT_EQ(alone.tokens.size(), size_t(steps)) << "sequence " << s << " ended early; pick other prompts";
    EXPECT_EQ(seqs[s].tokens, alone.tokens) << "sequence " << s;

    // Its last batched step again, alone: bit-identical logits. Sampling
    // compares probabilities with a random number, so a last-bit difference
    // between batch sizes could change a sampled token; a request must give
    // the same tokens whichever sequences it is batched with.
    Sequence& q = seqs[s];
    const auto single = engine.decode_step(pool, {DecodeSlot{q.tokens[steps - 2], q.pos - 1, &q.blocks}});
    EXPECT_TRUE(single == q.last_logits) << "sequence " << s << ": batched vs alone logits differ in some bit";
  }
}

// A batch of 1, 2, 17 or 64 sequences (distinct prompts, every one decoded
// in every step): each sequence's logits at every step are the bits of the
// same step decoded alone, and its tokens are generate()'s. (The product
// kernels tile rows by 12 and 8: 17 and 64 leave edges.)
class BatchSize : public ::testing::TestWithParam<int> {};

TEST_P(BatchSize, EverySequenceDecodesAsItWouldAlone) {
  Engine engine(shared_checkpoint());
  const int batch = GetParam(), steps = 6, block_size = 16, vocab = engine.config().vocab_size;
  std::vector<std::vector<int>> prompts;
  for (int s = 0; s < batch; ++s) {
    std::vector<int> prompt = {kBosToken};
    for (int i = 0; i <= s % 7; ++i) prompt.push_back(3 + (s * 31 + i * 17) % 500);
    prompts.push_back(prompt);
  }
  std::vector<std::vector<int>> blocks(static_cast<size_t>(batch)), tokens(static_cast<size_t>(batch));
  std::vector<int> pos(static_cast<size_t>(batch));
  const int per = KvPool::blocks_for(8 + steps, block_size);
  KvPool pool = kv_pool_for(engine, block_size, batch * per);
  for (int s = 0; s < batch; ++s) {
    for (int b = 0; b < per; ++b) blocks[s].push_back(b * batch + s);  // interleaved with the others'
    const PrefillOutput prefilled = engine.prefill(prompts[s]);
    pool.write(blocks[s], view_of(engine, prefilled));
    tokens[s].push_back(argmax(prefilled.logits.data(), vocab));
    pos[s] = int(prompts[s].size());
  }
  for (int step = 1; step < steps; ++step) {
    std::vector<DecodeSlot> slots;
    for (int s = 0; s < batch; ++s) slots.push_back(DecodeSlot{tokens[s].back(), pos[s], &blocks[s]});
    const std::vector<float> logits = engine.decode_step(pool, slots);
    ASSERT_EQ(logits.size(), size_t(batch) * vocab);
    for (int s = 0; s < batch; ++s) {
      const std::vector<float> row(logits.begin() + size_t(s) * vocab, logits.begin() + size_t(s + 1) * vocab);
      // The same step alone (it rewrites this position's KV with the same bits).
      const auto alone = engine.decode_step(pool, {DecodeSlot{tokens[s].back(), pos[s], &blocks[s]}});
      ASSERT_TRUE(alone == row) << "batch " << batch << ", sequence " << s << ", step " << step;
      tokens[s].push_back(argmax(row.data(), vocab));
      ++pos[s];
    }
  }
  for (int s = 0; s < batch; ++s) {  // (generate stops at an end token; the batch went on)
    const std::vector<int> alone = generate(engine, prompts[s], steps, SamplingParams{}).tokens;
    ASSERT_FALSE(alone.empty());
    EXPECT_EQ(std::vector<int>(tokens[s].begin(), tokens[s].begin() + long(alone.size())), alone) << "sequence " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Engine, BatchSize, ::testing::Values(1, 2, 17, 64));

// 20 positions: two blocks of 16.
std::vector<int> twenty_tokens() {
  std::vector<int> prompt = {1, 403, 407, 261, 378};
  for (int i = 0; prompt.size() < 20; ++i) prompt.push_back(3 + (i * 37) % 500);
  return prompt;
}

TEST(Engine, KvPoolWriteScattersThePrefillCacheIntoItsBlocks) {
  Engine engine(shared_checkpoint());
  const std::vector<int> prompt = twenty_tokens();
  const PrefillOutput prefilled = engine.prefill(prompt);
  KvPool pool = kv_pool_for(engine, 16, 8);
  const std::vector<int> blocks = {5, 2};
  pool.write(blocks, view_of(engine, prefilled));
  EXPECT_EQ(gather_kv(pool, blocks, int(prompt.size())), prefilled.kv);  // a pure copy

  // Decoding on from the written cache equals decoding on from a stepwise one.
  const int next = argmax(prefilled.logits.data(), engine.config().vocab_size);
  const auto from_written = engine.decode_step(pool, {DecodeSlot{next, int(prompt.size()), &blocks}});
  KvPool stepwise_pool = kv_pool_for(engine, 16, 2);
  const std::vector<int> stepwise_blocks = {1, 0};
  for (size_t pos = 0; pos < prompt.size(); ++pos)
    engine.decode_step(stepwise_pool, {DecodeSlot{prompt[pos], int(pos), &stepwise_blocks}});
  const auto from_stepwise =
      engine.decode_step(stepwise_pool, {DecodeSlot{next, int(prompt.size()), &stepwise_blocks}});
  expect_same_bits(from_written, from_stepwise, "decode after KvPool::write vs after stepwise prefill");
}

// From a first position (a prefix cache's shared blocks before it): the
// positions after it land, the blocks before it are not touched (another
// sequence may be reading them).
TEST(Engine, KvPoolWriteFromAFirstPositionLeavesTheBlocksBeforeIt) {
  Engine engine(shared_checkpoint());
  const std::vector<int> prompt = twenty_tokens();
  const PrefillOutput prefilled = engine.prefill(prompt);
  const std::vector<int> other = {1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11, 12, 13, 14, 15, 16, 17};
  KvPool pool = kv_pool_for(engine, 16, 8);
  const std::vector<int> blocks = {5, 2};
  pool.write(blocks, view_of(engine, engine.prefill(other)));  // block 5: another prompt's first 16 positions
  const std::vector<float> shared_before = gather_kv(pool, {5}, 16);
  pool.write(blocks, view_of(engine, prefilled), 16);
  EXPECT_EQ(gather_kv(pool, {5}, 16), shared_before) << "a block before the first position was written";
  KvPool whole = kv_pool_for(engine, 16, 8);
  whole.write(blocks, view_of(engine, prefilled));
  const std::vector<float> all = gather_kv(whole, blocks, int(prompt.size()));
  const std::vector<float> written = gather_kv(pool, blocks, int(prompt.size()));
  EXPECT_NE(written, all) << "precondition: the two prompts' first blocks differ";
  // (gather_kv lays positions out per layer: compare the positions past 16)
  const size_t kv_dim = pool.model().kv_dim();
  const size_t plane = prompt.size() * kv_dim;
  for (size_t p = 0; p < 2 * size_t(pool.model().n_layers); ++p)
    for (size_t i = 16 * kv_dim; i < plane; ++i)
      ASSERT_EQ(written[p * plane + i], all[p * plane + i]) << "plane " << p << ", float " << i;
  EXPECT_THROW(pool.write(blocks, view_of(engine, prefilled), 8), Error);   // not a block's start
  EXPECT_THROW(pool.write(blocks, view_of(engine, prefilled), 32), Error);  // past the positions
}

TEST(Engine, KvPoolWriteRejectsMismatchedInput) {
  Engine engine(shared_checkpoint());
  const PrefillOutput prefilled = engine.prefill(twenty_tokens());
  KvPool pool = kv_pool_for(engine, 16, 3);
  KvView view = view_of(engine, prefilled);
  EXPECT_THROW(pool.write({0}, view), Error);      // 20 positions need 2 blocks
  EXPECT_THROW(pool.write({0, 3}, view), Error);   // block outside the pool
  view.header.shape.n_layers += 1;
  EXPECT_THROW(pool.write({0, 1}, view), Error);   // another model's shape
  EXPECT_THROW(kv_pool_for(engine, 0, 3), Error);
  EXPECT_THROW(kv_pool_for(engine, 8, 3), Error);  // not whole key tiles of 16
}

// The message of the Error thrown by f, or "" when none is thrown.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Engine, RejectsInvalidTokensPositionsAndBlocks) {
  Engine engine(shared_checkpoint());
  const int vocab = engine.config().vocab_size, seq_len = engine.config().seq_len;
  EXPECT_NE(error_of([&] { engine.prefill({}); }).find("empty"), std::string::npos);
  EXPECT_NE(error_of([&] { engine.prefill({1, vocab}); }).find("token id 512"), std::string::npos);
  EXPECT_NE(error_of([&] { engine.prefill({-1}); }).find("token id -1"), std::string::npos);
  EXPECT_NE(error_of([&] { engine.prefill(std::vector<int>(seq_len + 1, 5)); }).find("seq_len"), std::string::npos);

  KvPool pool = kv_pool_for(engine, 16, 2);
  const std::vector<int> blocks = {0, 1};
  EXPECT_NE(error_of([&] { engine.decode_step(pool, {{vocab, 0, &blocks}}); }).find("token id"), std::string::npos);
  EXPECT_NE(error_of([&] { engine.decode_step(pool, {{5, seq_len, &blocks}}); }).find("position 512"),
            std::string::npos);
  EXPECT_NE(error_of([&] { engine.decode_step(pool, {{5, -1, &blocks}}); }).find("position -1"), std::string::npos);
  EXPECT_NE(error_of([&] { engine.decode_step(pool, {{5, 0, nullptr}}); }).find("block table"), std::string::npos);
  EXPECT_NE(error_of([&] { engine.decode_step(pool, {{5, 32, &blocks}}); }).find("needs 3 blocks"),
            std::string::npos);
  const std::vector<int> outside = {2};
  EXPECT_NE(error_of([&] { engine.decode_step(pool, {{5, 0, &outside}}); }).find("outside the pool"),
            std::string::npos);

  Engine other(shared_checkpoint());
  EXPECT_NE(error_of([&] { other.decode_step(pool, {{5, 0, &blocks}}); }).find("another engine"),
            std::string::npos);

  EXPECT_THROW(generate(engine, {}, 4, SamplingParams{}), Error);
  EXPECT_THROW(generate(engine, {1, vocab}, 4, SamplingParams{}), Error);
  EXPECT_TRUE(generate(engine, {1}, 0, SamplingParams{}).tokens.empty());
}

TEST(Engine, DescribesItsModelAndBackend) {
  Engine engine(shared_checkpoint());
  EXPECT_EQ(engine.fingerprint(), shared_checkpoint()->fingerprint());
  if (cuda_device_count() > 0)
    EXPECT_EQ(engine.backend_name().rfind("cuda:", 0), 0u) << engine.backend_name();
  else
    EXPECT_EQ(engine.backend_name(), "cpu");
  const KvExpectation e = engine.kv_expectation();
  EXPECT_EQ(e.n_layers, 5u);
  EXPECT_EQ(e.n_kv_heads, 4u);
  EXPECT_EQ(e.head_dim, 8u);
  EXPECT_EQ(e.max_positions, 512u);
  EXPECT_EQ(engine.kv_shape(3).floats(), 5u * 2 * 3 * 32);
  EXPECT_THROW(Engine(shared_checkpoint(), EngineOptions{"tpu"}), Error);
}

TEST(BlockPool, AllocatesAllOrNothingAndTakesBlocksBack) {
  BlockPool allocator(4);
  const auto a = allocator.allocate(3);
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(allocator.free_blocks(), 1);
  EXPECT_TRUE(allocator.allocate(2).empty());
  EXPECT_EQ(allocator.free_blocks(), 1);  // nothing taken by the failed request
  const auto b = allocator.allocate(1);
  ASSERT_EQ(b.size(), 1u);
  std::vector<int> all = a;
  all.push_back(b[0]);
  std::sort(all.begin(), all.end());
  EXPECT_EQ(all, (std::vector<int>{0, 1, 2, 3}));  // distinct blocks
  allocator.release(a);
  EXPECT_EQ(allocator.free_blocks(), 3);
  EXPECT_EQ(allocator.allocate(3).size(), 3u);
  allocator.release(b);
  EXPECT_THROW(allocator.release({0, 1, 2, 3}), Error);  // more than were taken
  EXPECT_EQ(allocator.free_blocks(), 1);                   // and nothing released
  EXPECT_THROW(allocator.release({9}), Error);
}

}  // namespace
}  // namespace disagg::gpu
