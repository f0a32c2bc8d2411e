// The merge loop both tokenizer models share: adjacent symbols are joined,
// best pair first, until no adjacent pair has a merge. A priority queue over
// the pairs with lazy invalidation: O(n log n) in the symbols, where the
// rescanning loop of llama2.c's run.c is O(n^2) (a 64 KiB prompt took about
// a minute with it). Same result as that loop: the lowest `priority` wins,
// the leftmost pair on ties.
#pragma once
#include <algorithm>
#include <optional>
#include <queue>
#include <vector>

namespace disagg::gpu {

struct Merge {
  double priority;  // lower merges first (BPE: the merge's rank; SentencePiece: -score)
  int merged;       // the id the pair becomes
};

// Merges `ids` in place; `merge_of(left, right)` says whether two adjacent
// ids merge (std::optional<Merge>).
template <class MergeOf>
void merge_greedily(std::vector<int>& ids, const MergeOf& merge_of) {
  const int n = int(ids.size());
  if (n < 2) return;
  struct Candidate {
    double priority;
    int left;  // index of the left symbol (symbols keep their order, so leftmost = smallest)
    int left_id, right_id, merged;
  };
  auto worse = [](const Candidate& a, const Candidate& b) {
    return a.priority > b.priority || (a.priority == b.priority && a.left > b.left);
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> queue(worse);
  std::vector<int> prev(static_cast<size_t>(n)), next(static_cast<size_t>(n));
  std::vector<char> alive(static_cast<size_t>(n), 1);
  for (int i = 0; i < n; ++i) {
    prev[size_t(i)] = i - 1;
    next[size_t(i)] = i + 1 < n ? i + 1 : -1;
  }
  auto offer = [&](int left) {
    if (left < 0) return;  // (the first symbol has none on its left)
    const int right = next[size_t(left)];
    if (right < 0) return;
    if (std::optional<Merge> m = merge_of(ids[size_t(left)], ids[size_t(right)]))
      queue.push({m->priority, left, ids[size_t(left)], ids[size_t(right)], m->merged});
  };
  for (int i = 0; i + 1 < n; ++i) offer(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    const int right = next[size_t(c.left)];
    // Stale: either side has merged since (a symbol's right neighbour only
    // changes when that neighbour merges into it, which changes its id).
    if (!alive[size_t(c.left)] || ids[size_t(c.left)] != c.left_id || right < 0 || ids[size_t(right)] != c.right_id)
      continue;
    ids[size_t(c.left)] = c.merged;
    alive[size_t(right)] = 0;
    next[size_t(c.left)] = next[size_t(right)];
    if (next[size_t(right)] >= 0) prev[size_t(next[size_t(right)])] = c.left;
    offer(prev[size_t(c.left)]);
    offer(c.left);
  }
  int kept = 0;
  for (int i = 0; i >= 0; i = next[size_t(i)]) ids[size_t(kept++)] = ids[size_t(i)];
  ids.resize(size_t(kept));
}

}  // namespace disagg::gpu
