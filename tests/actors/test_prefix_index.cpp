// The router's index of a decode worker's prefix cache (router_policy.h
// PrefixIndex) and the KV-aware pick (pick_decode's compute_cost).
#include <gtest/gtest.h>

#include <limits>
#include <numeric>
#include <random>

#include "actors/router_policy.h"

namespace disagg {
namespace {

KvEvents batch(uint64_t seq, std::vector<uint64_t> stored, std::vector<uint64_t> removed = {}) {
  KvEvents e;
  e.seq = seq;
  e.stored = std::move(stored);
  e.removed = std::move(removed);
  return e;
}

KvEvents snapshot(uint64_t seq, std::vector<uint64_t> stored) {
  KvEvents e = batch(seq, std::move(stored));
  e.snapshot = true;
  return e;
}

TEST(PrefixIndex, AppliesNumberedBatchesInOrderAndResyncsOnAGap) {
  PrefixIndex index(8);
  EXPECT_EQ(index.apply(batch(1, {10})), PrefixIndex::Applied::ignored) << "nothing before the first snapshot";
  EXPECT_FALSE(index.synced());
  EXPECT_EQ(index.apply(snapshot(3, {10, 11})), PrefixIndex::Applied::applied);
  EXPECT_EQ(index.matched({10, 11, 12}), 2);
  EXPECT_EQ(index.matched({11, 10}), 2);
  EXPECT_EQ(index.matched({12, 10}), 0) << "a prefix counts from its first block";
  EXPECT_EQ(index.apply(batch(3, {99})), PrefixIndex::Applied::ignored) << "already in the snapshot";
  EXPECT_EQ(index.matched({99}), 0);
  EXPECT_EQ(index.apply(batch(4, {12}, {10})), PrefixIndex::Applied::applied);
  EXPECT_EQ(index.matched({10, 11, 12}), 0);
  EXPECT_EQ(index.matched({11, 12}), 2);
  // A skipped number: the index cannot know what it missed.
  EXPECT_EQ(index.apply(batch(6, {13})), PrefixIndex::Applied::resync);
  EXPECT_FALSE(index.synced());
  EXPECT_EQ(index.size(), 0u);
  EXPECT_EQ(index.apply(batch(7, {14})), PrefixIndex::Applied::ignored) << "until the snapshot";
  EXPECT_EQ(index.apply(snapshot(7, {11})), PrefixIndex::Applied::applied);
  EXPECT_EQ(index.matched({11}), 1);
}

TEST(PrefixIndex, ABatchThatDoesNotFitThePoolIsNotTrusted) {
  PrefixIndex index(3);
  ASSERT_EQ(index.apply(snapshot(1, {1, 2})), PrefixIndex::Applied::applied);
  EXPECT_EQ(index.apply(batch(2, {3, 4})), PrefixIndex::Applied::resync) << "4 hashes in a pool of 3 blocks";
  EXPECT_EQ(index.size(), 0u);
  ASSERT_EQ(index.apply(snapshot(2, {1, 2, 3, 4, 5})), PrefixIndex::Applied::applied);
  EXPECT_EQ(index.size(), 0u) << "nor a snapshot larger than the pool";
}

// A worker's claim of its cache's size bounds its index, up to
// kMaxIndexedBlocks whatever it claims.
TEST(PrefixIndex, AWorkersClaimOfItsCacheIsBounded) {
  PrefixIndex index(std::numeric_limits<size_t>::max());
  KvEvents snapshot;
  snapshot.snapshot = true;
  snapshot.stored.resize(kMaxIndexedBlocks + 1);
  std::iota(snapshot.stored.begin(), snapshot.stored.end(), uint64_t(1));
  index.apply(snapshot);
  EXPECT_EQ(index.held(), 0u) << "more blocks than any index follows were taken";
  snapshot.stored.resize(3);
  index.apply(snapshot);
  EXPECT_EQ(index.held(), 3u);
}

// Predicted blocks (a prompt just sent there) count as held until the
// worker's events say otherwise, bounded, whether or not the index is
// synced: they are about requests in flight.
TEST(PrefixIndex, PredictedBlocksCountUntilTheWorkersEventsSpeak) {
  PrefixIndex index(4);
  index.predict({1, 2});
  EXPECT_EQ(index.matched({1, 2}), 2) << "before the first snapshot too";
  ASSERT_EQ(index.apply(snapshot(1, {1})), PrefixIndex::Applied::applied);
  index.predict({1, 2, 3});
  EXPECT_EQ(index.matched({1, 2, 3, 4}), 3);
  EXPECT_EQ(index.size(), 3u) << "1 held, 2 and 3 predicted";
  ASSERT_EQ(index.apply(batch(2, {2})), PrefixIndex::Applied::applied);  // stored: now held
  EXPECT_EQ(index.size(), 3u);
  ASSERT_EQ(index.apply(batch(3, {}, {3})), PrefixIndex::Applied::applied);  // evicted, or never stored
  EXPECT_EQ(index.matched({1, 2, 3}), 2);
  index.predict({10, 11, 12, 13, 14});  // more than the pool: the oldest predictions go
  EXPECT_EQ(index.matched({10}), 0);
  EXPECT_EQ(index.matched({14}), 1);
  EXPECT_LE(index.size(), 2u + 4u);
  EXPECT_EQ(index.apply(batch(9, {})), PrefixIndex::Applied::resync);
  EXPECT_EQ(index.matched({1}), 0) << "what the events said is forgotten";
  EXPECT_EQ(index.matched({14}), 1) << "the requests in flight are not";
  ASSERT_EQ(index.apply(snapshot(9, {14})), PrefixIndex::Applied::applied);
  EXPECT_EQ(index.size(), 4u) << "14 held now, no longer predicted; 11-13 still on their way";
}

// The router's one index over all workers (PrefixHolders) against the
// naive reference, each worker's own PrefixIndex::matched: random snapshots,
// batches (in order, skipped, too large), predictions past capacity and
// workers leaving, checked on random prompts after every step.
TEST(PrefixHolders, AgreesWithEveryWorkersOwnIndex) {
  std::mt19937_64 rng(7);
  auto pick = [&](uint64_t n) { return uint64_t(rng() % n); };
  PrefixHolders holders;
  constexpr int kWorkers = 6;
  std::vector<PrefixIndex> indexes;
  std::vector<uint64_t> seqs(kWorkers, 0);
  for (int w = 0; w < kWorkers; ++w) {
    indexes.emplace_back(4 + size_t(w));
    indexes.back().attach(&holders, WorkerKey(w + 1));
  }
  std::vector<bool> attached(kWorkers, true);
  auto hashes = [&](size_t n) {
    std::vector<uint64_t> out;
    for (size_t i = 0; i < n; ++i) out.push_back(1 + pick(12));  // few values: prompts share prefixes
    return out;
  };
  size_t compared = 0, nonzero = 0;
  for (int step = 0; step < 3000; ++step) {
    const int w = int(pick(kWorkers));
    PrefixIndex& index = indexes[size_t(w)];
    switch (pick(6)) {
      case 0: index.apply(snapshot(seqs[size_t(w)], hashes(pick(8)))); break;
      case 1: index.apply(batch(++seqs[size_t(w)], hashes(pick(3)), hashes(pick(3)))); break;
      case 2: index.apply(batch(seqs[size_t(w)] += 2, hashes(1))); break;  // a gap: resync
      case 3:
      case 4: index.predict(hashes(1 + pick(4))); break;
      case 5:
        if (attached[size_t(w)]) index.detach();
        else index.attach(&holders, WorkerKey(w + 1));
        attached[size_t(w)] = !attached[size_t(w)];
        break;
    }
    for (int probe = 0; probe < 4; ++probe) {
      std::vector<uint64_t> prompt = hashes(1 + pick(5));
      const auto depth = holders.matched(prompt);
      for (int v = 0; v < kWorkers; ++v) {
        const auto found = depth.find(WorkerKey(v + 1));
        const int got = found == depth.end() ? 0 : found->second;
        const int want = attached[size_t(v)] ? indexes[size_t(v)].matched(prompt) : 0;
        ASSERT_EQ(got, want) << "worker " << v << " at step " << step;
        ++compared;
        nonzero += want > 0 ? 1 : 0;
      }
    }
  }
  EXPECT_GT(nonzero, compared / 10) << "the prompts hit the indexes often enough to test them";
  for (int w = 0; w < kWorkers; ++w)
    if (attached[size_t(w)]) indexes[size_t(w)].detach();
  EXPECT_EQ(holders.size(), 0u) << "every worker gone: nothing held anywhere";
}

TEST(PickDecode, PrefersTheWorkerThatHoldsThePromptUnlessItIsMuchFuller) {
  size_t cursor = 0;
  // Both have room; worker 2 holds the prompt's blocks (less to compute).
  std::vector<DecodeCandidate> c = {{1, 16, 100, 90, 0}, {2, 16, 100, 85, 3}};
  c[0].compute_cost = 10;  // 10 blocks to compute
  c[1].compute_cost = 1;
  EXPECT_EQ(pick_decode(c, 160, std::nullopt, {}, cursor), 2u);
  // Without the index the most free blocks win.
  c[0].compute_cost = c[1].compute_cost = 0;
  EXPECT_EQ(pick_decode(c, 160, std::nullopt, {}, cursor), 1u);
  // The load counts too: 9 blocks saved do not outweigh 40 more blocks in
  // use at weight 1; at weight 10 (90 blocks saved) they do.
  c[0].compute_cost = 10;
  c[1].compute_cost = 1;
  c[1].free_blocks = 50;
  EXPECT_EQ(pick_decode(c, 160, std::nullopt, {}, cursor), 1u);
  c[0].compute_cost = 100;
  c[1].compute_cost = 10;
  EXPECT_EQ(pick_decode(c, 160, std::nullopt, {}, cursor), 2u);
}

}  // namespace
}  // namespace disagg
