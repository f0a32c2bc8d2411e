// A prompt at a long model's full context: prefilled in bounded chunks, its
// logits, KV and the greedy tokens after it are bit for bit those of feeding
// the same prompt one decode step at a time (the fixed arithmetic of
// gpu/fixed_math.h makes a prefill row and a decode step the same computation).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "gpu/small_model.h"
#include "gpu/backend.h"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "engine/engine.h"
#include "gpu/error.h"
#include "engine/kv_cache.h"
#include "engine/kv_stream.h"
#include "gpu/pool_contents.h"

namespace disagg::gpu {
namespace {

constexpr int kPrompt = 2048;  // prompt tokens
constexpr int kNew = 16;       // greedy tokens after it
constexpr int kBlock = 16;     // positions per KV block

// Small dimensions, long context.
std::shared_ptr<const Checkpoint> long_model() {
  return test::small_random_model(kPrompt + kNew, 2048, "disagg-test-long-context.bin");
}

int argmax(const float* logits, int n) { return int(std::max_element(logits, logits + n) - logits); }

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(LongContext, FullContextPromptPrefillsInChunksBitIdenticalToStepwiseDecode) {
  Engine engine(long_model());
  const int vocab = engine.config().vocab_size;
  std::vector<int> prompt(kPrompt);
  for (int i = 0; i < kPrompt; ++i) prompt[i] = 3 + (i * 131 + i / 7) % (vocab - 3);
  prompt[0] = 1;

  // Blocks for prompt + generated positions, in reverse order (scattered).
  const int n_blocks = KvPool::blocks_for(kPrompt + kNew, kBlock);
  std::vector<int> blocks(n_blocks);
  std::iota(blocks.rbegin(), blocks.rend(), 0);

  // Path 1: one prefill (in chunks inside the engine), its KV into a pool, then greedy steps.
  const PrefillOutput pre = engine.prefill(prompt);
  KvPool pool_a = kv_pool_for(engine, kBlock, n_blocks);
  KvView view;
  view.header.fingerprint = engine.fingerprint();
  view.header.shape = pre.shape;
  view.payload = pre.kv.data();
  pool_a.write(blocks, view);
  std::vector<int> tokens_a = {argmax(pre.logits.data(), vocab)};
  for (int i = 1; i < kNew; ++i) {
    const auto logits = engine.decode_step(pool_a, {DecodeSlot{tokens_a.back(), kPrompt + i - 1, &blocks}});
    tokens_a.push_back(argmax(logits.data(), vocab));
  }

  // Path 2: every prompt token through a decode step, then the same greedy steps.
  KvPool pool_b = kv_pool_for(engine, kBlock, n_blocks);
  std::vector<float> logits;
  for (int p = 0; p < kPrompt; ++p) logits = engine.decode_step(pool_b, {DecodeSlot{prompt[p], p, &blocks}});
  EXPECT_TRUE(same_bits(logits, pre.logits)) << "last prompt position: prefill and stepwise logits differ";
  EXPECT_TRUE(same_bits(test::gather_kv(pool_b, blocks, kPrompt), pre.kv)) << "prefill and stepwise KV differ";
  std::vector<int> tokens_b = {argmax(logits.data(), vocab)};
  for (int i = 1; i < kNew; ++i) {
    logits = engine.decode_step(pool_b, {DecodeSlot{tokens_b.back(), kPrompt + i - 1, &blocks}});
    tokens_b.push_back(argmax(logits.data(), vocab));
  }
  EXPECT_EQ(tokens_a, tokens_b);
}

// The per-layer hook (the KV transfer's source): every (chunk, layer) piece in
// order, and the pieces put together are the prefill's KV, byte for byte.
TEST(LongContext, PrefillHookHandsOutEveryLayerOfEveryChunkInOrder) {
  Engine engine(long_model());
  const ModelConfig& c = engine.config();
  std::vector<int> prompt(kPrompt);
  for (int i = 0; i < kPrompt; ++i) prompt[i] = 3 + (i * 17) % (c.vocab_size - 3);
  const size_t kv_dim = size_t(c.kv_dim()), plane = size_t(kPrompt) * kv_dim;
  std::vector<float> assembled(size_t(c.n_layers) * 2 * plane, -1.0f);
  std::vector<std::pair<int, int>> calls;  // (first position, layer)
  PrefillHooks hooks;
  hooks.on_layer_kv = [&](int layer, int first, int count, const float* k, const float* v) {
    calls.emplace_back(first, layer);
    std::copy_n(k, size_t(count) * kv_dim, assembled.begin() + size_t(layer) * 2 * plane + size_t(first) * kv_dim);
    std::copy_n(v, size_t(count) * kv_dim, assembled.begin() + (size_t(layer) * 2 + 1) * plane + size_t(first) * kv_dim);
  };
  const PrefillOutput out = engine.prefill(prompt, hooks);
  EXPECT_TRUE(same_bits(assembled, out.kv)) << "the hook's pieces are not the prefill's KV";
  // Chunks in order, each with every layer in order.
  ASSERT_FALSE(calls.empty());
  EXPECT_GT(calls.back().first, 0) << "a 2,048-token prompt should prefill in several chunks";
  for (size_t i = 1; i < calls.size(); ++i) {
    const bool next_layer = calls[i].first == calls[i - 1].first && calls[i].second == calls[i - 1].second + 1;
    const bool next_chunk = calls[i].first > calls[i - 1].first && calls[i].second == 0 &&
                            calls[i - 1].second == c.n_layers - 1;
    EXPECT_TRUE(next_layer || next_chunk) << "call " << i << " out of order";
  }

  // A hook that throws aborts the prefill with its error.
  hooks.on_layer_kv = [](int, int, int, const float*, const float*) { throw Error("transfer cancelled"); };
  EXPECT_THROW(engine.prefill(prompt, hooks), Error);
}

// What a receiver's transport does with a piece at byte `offset` of the
// transfer (host memory: the CPU backend): copies it into the span it starts
// in, and fails the test when it crosses that span's end or lies past all.
void write_piece(const std::vector<PoolSpan>& spans, size_t offset, const void* src, size_t bytes) {
  size_t start = 0;
  for (const PoolSpan& span : spans) {
    const size_t span_bytes = span.floats * sizeof(float);
    if (offset < start + span_bytes) {
      ASSERT_LE(offset + bytes, start + span_bytes) << "the piece at byte " << offset << " crosses its region";
      std::memcpy(reinterpret_cast<char*>(span.data) + (offset - start), src, bytes);
      return;
    }
    start += span_bytes;
  }
  FAIL() << "byte " << offset << " is past the transfer's " << start << " bytes";
}

// A target's block size and runs come from a peer: ones whose products
// pass INT_MAX are not wrapped into a negative count (which threw
// length_error out of the prefill worker) or a negative run end (read past).
TEST(KvStreamPlan, APeersHugeBlockSizeOrRunsAreNotWrapped) {
  const KvStreamPlan wide(2, 64, 17, 2147483632);  // (a multiple of 16 near INT_MAX)
  EXPECT_EQ(wide.blocks(), 1);
  const KvStreamPlan long_run(2, 64, 40, 16, {1 << 27});
  size_t bytes = 0;
  long_run.for_each_piece(0, 0, 48, [&](size_t, size_t, size_t n) { bytes += n; });
  EXPECT_EQ(bytes, 2 * 48 * 64 * sizeof(float));
  size_t floats = 0;  // (the regions a receiver registers: every layer's K and V of the 48 positions)
  long_run.for_each_region([&](int, bool, int, size_t n) { floats += n; });
  EXPECT_EQ(floats, size_t(2 * 2 * 48 * 64));
}

// The streamed KV transfer's arithmetic (engine/kv_stream.h): the pieces a
// prefill hands out from its cache, each copied to its byte offset in the
// spans of a decode pool's blocks (KvPool::stream_spans, what a receiver
// registers, each piece copied as the receiver's transport does), give that pool exactly the KV a
// one-message admission (KvPool::write) gives it, for prompt lengths that end
// mid-tile, on a tile and on a block, blocks of several sizes, and blocks in
// one run, in reverse (runs of one) and in a mix. Every byte of the regions
// is written once (no piece overlaps another, crosses a region or leaves a
// gap), and a run of consecutive blocks takes pieces of up to kMaxPieceBytes.
TEST(LongContext, StreamedPiecesLandInPoolBlocksAsTheSourceKv) {
  Engine engine(long_model());
  const ModelConfig& c = engine.config();
  namespace kvl = kv_layout;
  for (const int block : {16, 48, 128}) {
    for (const int n : {1, 15, 16, 100, 512, 700, kPrompt}) {
      const int nb = KvPool::blocks_for(kvl::padded(n), block);
      // Destination blocks in a pool with room to spare: one run, reversed, mixed.
      std::vector<std::vector<int32_t>> orders(3);
      for (int j = 0; j < nb; ++j) {
        orders[0].push_back(3 + j);
        orders[1].push_back(2 * (nb - j));
        orders[2].push_back(j % 3 == 2 ? 3 * nb + j : j);
      }
      for (size_t o = 0; o < orders.size(); ++o) {
        const std::vector<int32_t>& blocks = orders[o];
        SCOPED_TRACE("block " + std::to_string(block) + ", prompt " + std::to_string(n) + ", order " + std::to_string(o));
        std::vector<int> prompt(static_cast<size_t>(n));
        for (int i = 0; i < n; ++i) prompt[size_t(i)] = 3 + (i * 31) % (c.vocab_size - 3);
        const KvStreamPlan plan(c.n_layers, c.kv_dim(), n, block, KvStreamPlan::runs_of(blocks, nb));
        KvPool streamed = kv_pool_for(engine, block, 4 * nb + 3);
        const std::vector<int> dest(blocks.begin(), blocks.end());
        const std::vector<PoolSpan> spans = streamed.stream_spans(plan, dest);  // what a receiver registers
        size_t region_bytes = 0;
        for (const auto& span : spans) region_bytes += span.floats * sizeof(float);
        ASSERT_EQ(region_bytes, plan.total_bytes());
        std::vector<int> written(plan.total_bytes(), 0);
        size_t largest = 0;
        PrefillHooks hooks;
        hooks.on_layer_cache = [&](int layer, int first, int count, const float* cache) {
          plan.for_each_piece(layer, first, count, [&](size_t offset, size_t source, size_t bytes) {
            ASSERT_EQ(source, offset) << "nothing skipped: the byte space is the cache";
            write_piece(spans, offset, reinterpret_cast<const char*>(cache) + offset, bytes);
            for (size_t b = offset; b < offset + bytes; ++b) written[b] += 1;
            largest = std::max(largest, bytes);
          });
        };
        const PrefillOutput out = engine.prefill(prompt, hooks);
        EXPECT_TRUE(std::all_of(written.begin(), written.end(), [](int w) { return w == 1; }))
            << "every byte of the transfer is written exactly once";
        EXPECT_TRUE(same_bits(test::gather_kv(streamed, std::vector<int>(blocks.begin(), blocks.end()), n),
                              out.kv))
            << "the streamed pool differs from the prefill's KV";
        if (o == 0)  // one run: a piece spans blocks (up to a prefill chunk of positions)
          EXPECT_EQ(largest, std::min<size_t>(KvStreamPlan::kMaxPieceBytes,
                                              size_t(std::min(kvl::padded(n), 512)) * c.kv_dim() * sizeof(float)));
        if (o == 1) EXPECT_LE(largest, size_t(block) * c.kv_dim() * sizeof(float)) << "a piece crossed blocks";
      }
    }
  }
}

// A prefix cache hit on the streamed path: the decode pool's first blocks
// hold a shorter prompt's KV (the same tokens), and the plan with
// first_position S sends only positions [S, P). The pool then holds exactly
// the whole prompt's KV: the cached prefix is bit for bit what the longer
// prefill computes, and the pieces from S on land where they belong, with
// no byte of the transfer written twice or left out.
TEST(LongContext, StreamedPiecesAfterACachedPrefixGiveTheWholePromptsKv) {
  Engine engine(long_model());
  const ModelConfig& c = engine.config();
  namespace kvl = kv_layout;
  for (const int block : {16, 48}) {
    for (const int n : {40, 100, 700}) {
      for (const int cached_blocks : {1, 2, (n - 1) / block}) {
        const int skip = cached_blocks * block;
        if (skip >= n || cached_blocks < 1) continue;
        SCOPED_TRACE("block " + std::to_string(block) + ", prompt " + std::to_string(n) + ", cached " +
                     std::to_string(skip));
        std::vector<int> prompt(static_cast<size_t>(n));
        for (int i = 0; i < n; ++i) prompt[size_t(i)] = 3 + (i * 29) % (c.vocab_size - 3);
        const int nb = KvPool::blocks_for(kvl::padded(n), block);
        std::vector<int32_t> blocks;
        for (int j = 0; j < nb; ++j) blocks.push_back(j % 2 == 0 ? 2 * nb - j : j);  // runs of one and of two
        KvPool pool = kv_pool_for(engine, block, 2 * nb + 1);
        const std::vector<int> dest(blocks.begin(), blocks.end());
        const PrefillOutput prefix = engine.prefill(std::vector<int>(prompt.begin(), prompt.begin() + skip));
        KvView view;
        view.header.fingerprint = engine.fingerprint();
        view.header.shape = prefix.shape;
        view.payload = prefix.kv.data();
        pool.write(std::vector<int>(dest.begin(), dest.begin() + cached_blocks), view);
        const KvStreamPlan plan(c.n_layers, c.kv_dim(), n, block, KvStreamPlan::runs_of(blocks, nb), skip);
        const std::vector<PoolSpan> spans = pool.stream_spans(plan, dest);
        size_t region_bytes = 0;
        for (const auto& span : spans) region_bytes += span.floats * sizeof(float);
        ASSERT_EQ(region_bytes, plan.total_bytes());
        ASSERT_EQ(plan.total_bytes(), 2 * size_t(c.n_layers) * size_t(kvl::padded(n) - skip) * c.kv_dim() * 4);
        std::vector<int> written(plan.total_bytes(), 0);
        PrefillHooks hooks;
        hooks.on_layer_cache = [&](int layer, int first, int count, const float* cache) {
          plan.for_each_piece(layer, first, count, [&](size_t offset, size_t source, size_t bytes) {
            write_piece(spans, offset, reinterpret_cast<const char*>(cache) + source, bytes);
            for (size_t b = offset; b < offset + bytes; ++b) written[b] += 1;
          });
        };
        const PrefillOutput out = engine.prefill(prompt, hooks);
        EXPECT_TRUE(std::all_of(written.begin(), written.end(), [](int w) { return w == 1; }))
            << "every byte of the transfer is written exactly once";
        EXPECT_TRUE(same_bits(test::gather_kv(pool, dest, n), out.kv))
            << "cached prefix + streamed rest differ from the prompt's KV";
      }
    }
  }
  EXPECT_THROW(KvStreamPlan(c.n_layers, c.kv_dim(), 40, 16, {}, 8), std::invalid_argument) << "not a block";
  EXPECT_THROW(KvStreamPlan(c.n_layers, c.kv_dim(), 32, 16, {}, 32), std::invalid_argument) << "nothing left";
}

// Chunked prefill into a pool (Engine::prefill_chunk, a colocated worker's
// prefill between decode steps) gives prefill()'s KV and last logits bit for
// bit, whatever the chunk size (one position, a block, an odd size, one
// whose chunks straddle the engine's own 512-row boundary) and however the
// blocks lie. (Chunks of 512 or of the whole prompt would take prefill()'s
// own path: they tested nothing.)
TEST(LongContext, ChunkedPrefillIntoAPoolEqualsPrefill) {
  Engine engine(long_model());
  const ModelConfig& c = engine.config();
  for (const int n : {1, 29, 700}) {
    std::vector<int> prompt(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) prompt[size_t(i)] = 3 + (i * 37) % (c.vocab_size - 3);
    const PrefillOutput whole = engine.prefill(prompt);
    for (const int chunk : {1, 16, 77, 300}) {
      if (chunk == 1 && n > 29) continue;  // (700 one-row steps: slow, and 29 covers it)
      SCOPED_TRACE("prompt " + std::to_string(n) + ", chunk " + std::to_string(chunk));
      const int nb = KvPool::blocks_for(n, 16);
      KvPool pool = kv_pool_for(engine, 16, 2 * nb + 1);
      std::vector<int> blocks;
      for (int j = 0; j < nb; ++j) blocks.push_back(2 * (nb - j));  // reversed, with gaps
      std::vector<float> logits;
      for (int p0 = 0; p0 < n; p0 += chunk) {
        const int rows = std::min(chunk, n - p0);
        logits = engine.prefill_chunk(pool, std::vector<int>(prompt.begin() + p0, prompt.begin() + p0 + rows), p0,
                                      blocks);
      }
      EXPECT_TRUE(same_bits(logits, whole.logits)) << "last logits differ";
      EXPECT_TRUE(same_bits(test::gather_kv(pool, blocks, n), whole.kv)) << "KV differs";
    }
  }
  KvPool pool = kv_pool_for(engine, 16, 4);
  EXPECT_THROW(engine.prefill_chunk(pool, {5, 6}, 63, {0, 1, 2, 3}), Error) << "past the blocks given";
  EXPECT_THROW(engine.prefill_chunk(pool, {5}, 0, {9}), Error) << "a block outside the pool";
  EXPECT_THROW(engine.prefill_chunk(pool, {}, 0, {0}), Error) << "no tokens";
}

// Stream spans only for blocks the plan can use: a plan of the pool's block
// size, enough blocks, all inside the pool, runs as the plan says.
TEST(LongContext, StreamSpansRefuseBlocksThePlanCannotUse) {
  Engine engine(long_model());
  const ModelConfig& c = engine.config();
  KvPool pool = kv_pool_for(engine, 16, 8);
  const KvStreamPlan two_blocks(c.n_layers, c.kv_dim(), 20, 16, {2});
  EXPECT_NO_THROW(pool.stream_spans(two_blocks, {3, 4}));
  EXPECT_THROW(pool.stream_spans(KvStreamPlan(c.n_layers, c.kv_dim(), 20, 32), {3}), Error) << "another block size";
  EXPECT_THROW(pool.stream_spans(two_blocks, {3}), Error) << "too few blocks";
  EXPECT_THROW(pool.stream_spans(two_blocks, {7, 8}), Error) << "a block outside the pool";
  EXPECT_THROW(pool.stream_spans(two_blocks, {-1, 0}), Error) << "a negative block";
  EXPECT_THROW(pool.stream_spans(two_blocks, {3, 5}), Error) << "a run that is not consecutive";
}

TEST(LongContext, APromptBeyondTheContextIsRejected) {
  Engine engine(long_model());
  const std::vector<int> too_long(size_t(engine.config().seq_len) + 1, 5);
  EXPECT_THROW(engine.prefill(too_long), Error);
}

}  // namespace
}  // namespace disagg::gpu
