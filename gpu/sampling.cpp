// Greedy, temperature and nucleus (top-p) sampling with counter-based randomness.
#include "gpu/sampling.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gpu/error.h"

namespace disagg::gpu {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Picks from weights[order[0..n)] (unnormalised, total `mass`) by scanning the
// cumulative sum until it passes r * mass. Falls back to the last candidate with
// non-zero weight, which rounding can otherwise skip when r is close to 1.
template <class Index>
int pick(const std::vector<double>& weights, Index order, size_t n, double mass, float r) {
  const double target = double(r) * mass;
  double cumulative = 0.0;
  int last_positive = order(0);
  for (size_t i = 0; i < n; ++i) {
    const int token = order(i);
    if (weights[token] <= 0.0) continue;
    cumulative += weights[token];
    last_positive = token;
    if (cumulative > target) return token;
  }
  return last_positive;
}

}  // namespace

float sampling_uniform(uint64_t seed, uint64_t step) {
  // Hashing the seed first decorrelates nearby seeds; the step is the counter.
  const uint64_t bits = splitmix64(splitmix64(seed) ^ step);
  return float(bits >> 40) * (1.0f / 16777216.0f);  // top 24 bits: exact in a float, < 1
}

int argmax(const float* logits, int vocab) {
  if (vocab <= 0) throw Error("argmax: empty logits");
  int best = 0;
  for (int i = 1; i < vocab; ++i)
    if (logits[i] > logits[best]) best = i;  // strict: the first maximum wins ties
  return best;
}

int sample_token(const float* logits, int vocab, const SamplingParams& params, uint64_t step) {
  if (vocab <= 0) throw Error("sample_token: empty logits");
  if (!(params.temperature > 0.0f)) return argmax(logits, vocab);  // also catches NaN

  // Softmax of logits / temperature in double, shifted by the max for range.
  const int best = argmax(logits, vocab);
  const float max_logit = logits[best];
  const double inv_t = 1.0 / double(params.temperature);
  std::vector<double> weights(static_cast<size_t>(vocab));
  double total = 0.0;
  for (int i = 0; i < vocab; ++i) {
    weights[i] = std::exp((double(logits[i]) - double(max_logit)) * inv_t);
    total += weights[i];
  }
  const float r = sampling_uniform(params.seed, step);

  if (params.top_p >= 1.0f) return pick(weights, [](size_t i) { return int(i); }, size_t(vocab), total, r);

  // Nucleus: the smallest set of most probable tokens holding >= top_p of the mass.
  // A token below (1 - top_p) / (vocab - 1) of the mass can never be in it (all
  // such tokens together hold less than 1 - top_p), so only the rest is sorted.
  // The most probable token always qualifies, which the argument needs when the
  // cutoff exceeds every weight (near-uniform logits, tiny top_p).
  const double need = std::max(0.0, double(params.top_p)) * total;
  const double cutoff = vocab > 1 ? (total - need) / double(vocab - 1) : 0.0;
  std::vector<int> candidates;
  for (int i = 0; i < vocab; ++i)
    if (weights[i] >= cutoff || i == best) candidates.push_back(i);
  std::stable_sort(candidates.begin(), candidates.end(),
                   [&](int a, int b) { return weights[a] > weights[b]; });  // ties: lower id first

  double kept_mass = 0.0;
  size_t kept = 0;
  while (kept < candidates.size()) {
    kept_mass += weights[candidates[kept++]];
    if (kept_mass >= need) break;
  }
  return pick(weights, [&](size_t i) { return candidates[i]; }, kept, kept_mass, r);
}

}  // namespace disagg::gpu
