// A prefill worker's prefix cache (engine/prefix_cache.h) and the engine's
// prefill over a cached prefix (Engine::prefill with a PrefillPrefix): a
// prompt whose start was cached gives the logits, the KV and the cache handed
// to the stream hook of a prefill that computed everything, bit for bit;
// salts keep prompts apart; eviction and held blocks never give wrong KV.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gpu/small_model.h"
#include "model/checkpoint.h"
#include "engine/engine.h"
#include "gpu/error.h"
#include "gpu/kv_layout.h"
#include "model/model_writer.h"
#include "engine/prefix_cache.h"

namespace disagg::gpu {
namespace {

constexpr int kBlock = 16;

std::shared_ptr<const Checkpoint> small_model() {
  return test::small_random_model(1024, 1234, "disagg-test-prefix-cache.bin");
}

std::vector<int> prompt_of(int n, int salt) {
  std::vector<int> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[size_t(i)] = 3 + (i * 37 + salt * 11 + i / 5) % 290;
  p[0] = 1;
  return p;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// What the stream hook saw: per layer, the cache's K and V of every position
// handed out so far (copied at each call), and which positions were handed
// out (each exactly once).
struct Seen {
  std::vector<std::vector<float>> cache;  // [layer]: the whole cache as last seen
  std::vector<std::vector<int>> count;    // [layer][position]: times handed out
};

PrefillHooks recording(Seen& seen, const ModelConfig& c, int n) {
  const int positions = kv_layout::padded(n);
  const size_t floats = size_t(c.n_layers) * 2 * size_t(positions) * size_t(c.kv_dim());
  seen.cache.assign(size_t(c.n_layers), std::vector<float>(floats));
  seen.count.assign(size_t(c.n_layers), std::vector<int>(size_t(positions)));
  PrefillHooks hooks;
  hooks.wire_kv = true;
  hooks.on_layer_cache = [&seen, &c, positions](int layer, int first, int count, const float* cache) {
    // Layer `layer`'s K and V planes, positions [first, first + count).
    const size_t row = size_t(c.kv_dim());
    for (int value = 0; value < 2; ++value) {
      const size_t plane = (size_t(layer) * 2 + size_t(value)) * size_t(positions) * row;
      std::memcpy(seen.cache[size_t(layer)].data() + plane + size_t(first) * row, cache + plane + size_t(first) * row,
                  size_t(kv_layout::padded(first + count) - first) * row * sizeof(float));
    }
    for (int p = first; p < first + count; ++p) ++seen.count[size_t(layer)][size_t(p)];
  };
  return hooks;
}

// Whether two seen caches of one layer agree on K and V of positions [0, n)
// (the padding after n is never written: whatever the buffer held).
bool same_positions(const Seen& a, const Seen& b, int layer, const ModelConfig& c, int n) {
  const int positions = kv_layout::padded(n), kv_dim = c.kv_dim();
  const float* x = a.cache[size_t(layer)].data();
  const float* y = b.cache[size_t(layer)].data();
  for (int value = 0; value < 2; ++value) {
    const size_t plane = (size_t(layer) * 2 + size_t(value)) * size_t(positions) * size_t(kv_dim);
    for (int p = 0; p < n; ++p)
      for (int e = 0; e < kv_dim; ++e) {
        const size_t at = plane + size_t(value ? (long long)p * kv_dim + e : kv_layout::k_index(kv_dim, p, e));
        if (std::memcmp(x + at, y + at, sizeof(float)) != 0) return false;
      }
  }
  return true;
}

TEST(PrefixCache, ACachedPrefixGivesTheWholePrefillBitForBit) {
  Engine engine(small_model());
  const ModelConfig& c = engine.config();
  PrefixCache cache(engine, kBlock, 256);
  const std::vector<int> turn2 = prompt_of(700, 0);
  const std::vector<int> turn1(turn2.begin(), turn2.begin() + 500);  // 31 full blocks + 4 positions

  // Turn 1: nothing cached; its 31 full blocks are kept.
  PrefixCache::Lookup first = cache.lookup(turn1, "");
  EXPECT_EQ(first.hashes.size(), 31u);
  EXPECT_EQ(first.prefix.positions(), 0);
  const PrefillOutput out1 = engine.prefill(turn1, {}, first.prefix);
  cache.keep(first);
  EXPECT_EQ(cache.cached_blocks(), 31);
  EXPECT_TRUE(same_bits(out1.logits, engine.prefill(turn1).logits));

  // Turn 2 starts with turn 1: 31 blocks (496 positions) come from the cache.
  const PrefillOutput whole = engine.prefill(turn2);
  Seen seen_whole;
  engine.prefill(turn2, recording(seen_whole, c, 700));
  PrefixCache::Lookup second = cache.lookup(turn2, "");
  ASSERT_EQ(second.prefix.positions(), 31 * kBlock);
  Seen seen;
  const PrefillOutput cached = engine.prefill(turn2, recording(seen, c, 700), second.prefix);
  cache.keep(second);
  EXPECT_EQ(cache.cached_blocks(), 700 / kBlock);
  EXPECT_TRUE(same_bits(cached.logits, whole.logits)) << "last logits differ";
  EXPECT_TRUE(same_bits(cached.kv, whole.kv)) << "KV differs";
  for (int l = 0; l < c.n_layers; ++l) {
    EXPECT_TRUE(same_positions(seen, seen_whole, l, c, 700)) << "hooked cache, layer " << l;
    for (int p = 0; p < 700; ++p) ASSERT_EQ(seen.count[size_t(l)][size_t(p)], 1) << "layer " << l << " position " << p;
  }

  // The same prompt again: all but its last (partial) block's positions come from the cache.
  PrefixCache::Lookup third = cache.lookup(turn2, "");
  EXPECT_EQ(third.prefix.positions(), 700 / kBlock * kBlock);
  EXPECT_TRUE(same_bits(engine.prefill(turn2, {}, third.prefix).kv, whole.kv));
  cache.drop(third);

  // A prompt of whole blocks: its last block is computed (it gives the logits).
  const std::vector<int> blocks_only(turn2.begin(), turn2.begin() + 640);
  PrefixCache::Lookup exact = cache.lookup(blocks_only, "");
  EXPECT_EQ(exact.prefix.positions(), 640 - kBlock);
  EXPECT_TRUE(same_bits(engine.prefill(blocks_only, {}, exact.prefix).logits, engine.prefill(blocks_only).logits));
  cache.drop(exact);

  // Another salt shares nothing.
  PrefixCache::Lookup salted = cache.lookup(turn2, "tenant-b");
  EXPECT_EQ(salted.prefix.positions(), 0);
  cache.drop(salted);
}

// A cache far smaller than the prompts: every lookup finds at most what is
// still there, and every prefill over it is exact, including one whose held
// blocks the other prompts' keeps could not evict.
TEST(PrefixCache, EvictionAndHeldBlocksNeverGiveWrongKv) {
  Engine engine(small_model());
  PrefixCache cache(engine, kBlock, 12);
  const std::vector<int> a = prompt_of(200, 1), b = prompt_of(200, 2);
  PrefixCache::Lookup la = cache.lookup(a, "");
  engine.prefill(a, {}, la.prefix);
  cache.keep(la);
  EXPECT_EQ(cache.cached_blocks(), 12) << "12 of a's 12 full blocks";

  // a's blocks held while b is computed and kept: b gets no room.
  PrefixCache::Lookup held = cache.lookup(a, "");
  ASSERT_EQ(held.prefix.positions(), 12 * kBlock);
  PrefixCache::Lookup lb = cache.lookup(b, "");
  engine.prefill(b, {}, lb.prefix);
  cache.keep(lb);
  EXPECT_EQ(cache.cached_blocks(), 12) << "held blocks are never evicted";
  const PrefillOutput whole_a = engine.prefill(a);
  EXPECT_TRUE(same_bits(engine.prefill(a, {}, held.prefix).kv, whole_a.kv));
  cache.drop(held);

  // Released, they go: b takes them (least recently used first), and a finds none.
  PrefixCache::Lookup lb2 = cache.lookup(b, "");
  engine.prefill(b, {}, lb2.prefix);
  cache.keep(lb2);
  PrefixCache::Lookup gone = cache.lookup(a, "");
  EXPECT_EQ(gone.prefix.positions(), 0);
  cache.drop(gone);
  PrefixCache::Lookup lb3 = cache.lookup(b, "");
  EXPECT_EQ(lb3.prefix.positions(), 12 * kBlock);
  EXPECT_TRUE(same_bits(engine.prefill(b, {}, lb3.prefix).kv, engine.prefill(b).kv));
  cache.drop(lb3);
}

// A prompt of whole blocks again, all of them cached: its last block (never
// taken: it gives the logits) is not made and kept a second time, which
// evicted another prompt's block from a full cache for nothing.
TEST(PrefixCache, AWholeBlockPromptAgainEvictsNothing) {
  Engine engine(small_model());
  PrefixCache cache(engine, kBlock, 13);
  const std::vector<int> a = prompt_of(12 * kBlock, 1), b = prompt_of(kBlock + 4, 2);
  for (const auto* p : {&b, &a}) {
    PrefixCache::Lookup l = cache.lookup(*p, "");
    engine.prefill(*p, {}, l.prefix);
    cache.keep(l);
  }
  ASSERT_EQ(cache.cached_blocks(), 13) << "precondition: the cache is full";
  cache.take_events();
  PrefixCache::Lookup again = cache.lookup(a, "");
  ASSERT_EQ(again.prefix.positions(), 11 * kBlock);
  engine.prefill(a, {}, again.prefix);
  cache.keep(again);
  for (const BlockEvent& e : cache.take_events()) EXPECT_TRUE(e.stored) << "evicted " << e.hash;
  PrefixCache::Lookup lb = cache.lookup(b, "");
  EXPECT_EQ(lb.prefix.positions(), kBlock) << "b's block was evicted";
  cache.drop(lb);
}

TEST(PrefixCache, APrefixTheEngineCannotUseIsRefused) {
  Engine engine(small_model());
  Engine other(small_model());
  KvPool pool = kv_pool_for(engine, kBlock, 4);
  KvPool foreign = kv_pool_for(other, kBlock, 4);
  const std::vector<int> p = prompt_of(40, 3);
  EXPECT_THROW(engine.prefill(p, {}, PrefillPrefix{&pool, {0, 1, 2}}), Error) << "the whole prompt";
  EXPECT_THROW(engine.prefill(p, {}, PrefillPrefix{&foreign, {0}}), Error) << "another engine's pool";
  EXPECT_THROW(engine.prefill(p, {}, PrefillPrefix{&pool, {7}}), Error) << "a block outside the pool";
  PrefillHooks rows;
  rows.on_layer_kv = [](int, int, int, const float*, const float*) {};
  EXPECT_THROW(engine.prefill(p, rows, PrefillPrefix{&pool, {0}}), Error) << "on_layer_kv has no prefix rows";
  engine.prefill(p);
  EXPECT_THROW(engine.keep_prefill_blocks(pool, {0, 1, 2}, 1), Error) << "past the last prefill's cache";
  EXPECT_THROW(engine.keep_prefill_blocks(foreign, {0}, 0), Error) << "another engine's pool";
}

}  // namespace
}  // namespace disagg::gpu
