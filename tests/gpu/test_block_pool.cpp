// The prefix cache's bookkeeping (engine/kv_cache.h BlockPool) and its keys
// (engine/block_hash.h), checked against a naive model of what must hold.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <stdexcept>

#include "engine/block_hash.h"
#include "gpu/error.h"
#include "engine/kv_cache.h"

namespace disagg::gpu {
namespace {

TEST(BlockHash, ChainsOverThePrefixAndTheSeed) {
  const uint64_t seed = block_hash_seed(7, 16, "");
  std::vector<int32_t> a(50);
  for (size_t i = 0; i < a.size(); ++i) a[i] = int32_t(i * 31 % 97);
  const auto ha = block_hashes(a, 16, seed);
  ASSERT_EQ(ha.size(), 3u);  // 50 / 16 full blocks; the partial one has none
  std::vector<int32_t> b = a;
  b[49] = 5;  // in the partial block (positions 48, 49): no full block changes
  EXPECT_EQ(block_hashes(b, 16, seed), ha);
  b = a;
  b[3] = 1000;  // in block 0: every later block's hash changes too (the chain)
  const auto hb = block_hashes(b, 16, seed);
  for (size_t i = 0; i < ha.size(); ++i) EXPECT_NE(hb[i], ha[i]) << i;
  b = a;
  b[20] = 1000;  // in block 1: block 0 keeps its hash
  const auto hc = block_hashes(b, 16, seed);
  EXPECT_EQ(hc[0], ha[0]);
  EXPECT_NE(hc[1], ha[1]);
  // What changes the KV or must keep tenants apart changes every hash.
  for (uint64_t other : {block_hash_seed(8, 16, ""), block_hash_seed(7, 32, ""), block_hash_seed(7, 16, "tenant")})
    EXPECT_NE(block_hashes(a, 16, other)[0], ha[0]);
  // The same prefix at the front of a longer sequence: the same hashes.
  std::vector<int32_t> longer = a;
  longer.insert(longer.end(), 30, 9);
  const auto hl = block_hashes(longer, 16, seed);
  EXPECT_TRUE(std::equal(ha.begin(), ha.end(), hl.begin()));
  // Extending a's hashes to the longer sequence hashes only the new blocks
  // and gives the longer one's.
  std::vector<uint64_t> extended = ha;
  extend_block_hashes(extended, longer, 16, seed);
  EXPECT_EQ(extended, hl);
  std::vector<uint64_t> too_many(hl.size() + 1, 0);
  EXPECT_THROW(extend_block_hashes(too_many, longer, 16, seed), std::invalid_argument);
}

TEST(BlockPool, SharesPublishedBlocksAndKeepsThemUntilRoomRunsOut) {
  BlockPool pool(4);
  const auto a = pool.allocate(2);
  ASSERT_EQ(a, (std::vector<int>{0, 1}));
  EXPECT_TRUE(pool.publish(a[0], 100));
  EXPECT_TRUE(pool.publish(a[1], 101));
  EXPECT_TRUE(pool.publish(a[1], 101));   // again, the same: fine
  EXPECT_FALSE(pool.publish(a[1], 102));  // another hash for a published block: refused
  // A second holder of the prefix shares the blocks (up to where it differs).
  const auto shared = pool.take_cached({100, 999, 101}, 8);
  EXPECT_EQ(shared, (std::vector<int>{0}));
  EXPECT_EQ(pool.refs(0), 2);
  EXPECT_EQ(pool.take_cached({100, 101}, 1), (std::vector<int>{0}));  // at most max_blocks
  pool.release({0});
  pool.release(a);
  EXPECT_EQ(pool.refs(0), 1);
  EXPECT_EQ(pool.free_blocks(), 3);  // block 1 is free and still cached
  EXPECT_EQ(pool.cached_blocks(), 2);
  // Another hash for the same block id cannot be published twice.
  const auto c = pool.allocate(1);
  EXPECT_FALSE(pool.publish(c[0], 100));  // block 0 holds 100 already
  pool.release(c);
  // Plain free blocks go before cached ones.
  const auto d = pool.allocate(2);
  EXPECT_EQ(std::set<int>(d.begin(), d.end()), (std::set<int>{2, 3}));
  EXPECT_EQ(pool.cached_blocks(), 2);
  EXPECT_TRUE(pool.take_events().size() == 2u);  // stored 100, stored 101
  // Now the cached one is evicted: its hash goes, and the event says so.
  const auto e = pool.allocate(1);
  EXPECT_EQ(e, (std::vector<int>{1}));
  EXPECT_EQ(pool.cached_blocks(), 1);
  const auto events = pool.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_FALSE(events[0].stored);
  EXPECT_EQ(events[0].hash, 101u);
  EXPECT_TRUE(pool.take_cached({101}, 1).empty());
  EXPECT_TRUE(pool.allocate(1).empty());  // block 0 is held: no room
  EXPECT_THROW(pool.release({1, 1}), Error);  // held once, released twice: refused, nothing changes
  EXPECT_EQ(pool.refs(1), 1);
  EXPECT_THROW(pool.publish(9, 1), Error);
}

// Random traffic against the rules: a held block is never handed out again,
// a hash names one block, the room is the free and the unheld cached blocks.
TEST(BlockPool, NeverHandsOutAHeldBlockUnderRandomTraffic) {
  std::mt19937 rng(42);
  BlockPool pool(32);
  std::map<int, int> held;  // what the test holds: block -> references
  std::vector<std::vector<int>> owners;
  for (int round = 0; round < 20000; ++round) {
    const int op = int(rng() % 4);
    if (op == 0) {
      const auto got = pool.allocate(int(rng() % 5) + 1);
      for (int b : got) {
        ASSERT_EQ(held[b], 0) << "block " << b << " handed out while held";
        held[b] = 1;
      }
      if (!got.empty()) owners.push_back(got);
    } else if (op == 1 && !owners.empty()) {
      const size_t k = rng() % owners.size();
      pool.release(owners[k]);
      for (int b : owners[k]) --held[b];
      owners.erase(owners.begin() + long(k));
    } else if (op == 2 && !owners.empty()) {
      const auto& o = owners[rng() % owners.size()];
      pool.publish(o[rng() % o.size()], rng() % 64);
    } else {
      std::vector<uint64_t> want;
      for (int i = 0; i < 4; ++i) want.push_back(rng() % 64);
      const auto got = pool.take_cached(want, 4);
      for (int b : got) ++held[b];
      if (!got.empty()) owners.push_back(got);
    }
    int unheld = 0;
    for (int b = 0; b < 32; ++b) {
      ASSERT_EQ(pool.refs(b), held[b]);
      unheld += held[b] == 0;
    }
    ASSERT_EQ(pool.free_blocks(), unheld);
  }
  const auto hashes = pool.cached_hashes();
  EXPECT_EQ(std::set<uint64_t>(hashes.begin(), hashes.end()).size(), hashes.size());
}

}  // namespace
}  // namespace disagg::gpu
