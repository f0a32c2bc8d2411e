// Sampling: greedy, determinism, and agreement with a naive reference sampler;
// the stop rule that decides what each sampled token does.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "gpu/error.h"
#include "gpu/sampling.h"
#include "gpu/stop_rule.h"

namespace disagg::gpu {
namespace {

std::vector<float> random_logits(int vocab, uint32_t seed, float scale = 2.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(vocab));
  for (float& f : v) f = dist(gen);
  return v;
}

// Probabilities of the distribution sample_token draws from, written the obvious
// way: full softmax, then (for top_p < 1) the smallest most-probable prefix of a
// stable descending sort whose mass reaches top_p, renormalised.
std::vector<double> reference_distribution(const std::vector<float>& logits, float temperature, float top_p) {
  const double max_logit = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  for (size_t i = 0; i < p.size(); ++i) p[i] = std::exp((logits[i] - max_logit) / temperature);
  const double sum = std::accumulate(p.begin(), p.end(), 0.0);
  for (double& x : p) x /= sum;
  if (top_p >= 1.0f) return p;

  std::vector<size_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
  std::vector<double> nucleus(p.size(), 0.0);
  double mass = 0.0;
  for (size_t i : order) {
    nucleus[i] = p[i];
    mass += p[i];
    if (mass >= top_p) break;
  }
  for (double& x : nucleus) x /= mass;
  return nucleus;
}

// The reference sampler: walk the tokens (in token order for the full
// distribution, in probability order for a nucleus) until the cumulative
// probability exceeds r.
int reference_sample(const std::vector<float>& logits, float temperature, float top_p, float r) {
  const std::vector<double> p = reference_distribution(logits, temperature, top_p);
  std::vector<size_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  if (top_p < 1.0f)
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
  double cumulative = 0.0;
  int last = -1;
  for (size_t i : order) {
    if (p[i] == 0.0) continue;
    cumulative += p[i];
    last = int(i);
    if (r < cumulative) return int(i);
  }
  return last;
}

int sample(const std::vector<float>& logits, float temperature, float top_p, uint64_t seed, uint64_t step) {
  return sample_token(logits.data(), int(logits.size()), SamplingParams{temperature, top_p, seed}, step);
}

TEST(Sampling, UniformIsInRangeDeterministicAndBalanced) {
  double sum = 0.0;
  std::set<float> distinct;
  const int n = 100000;
  for (int step = 0; step < n; ++step) {
    const float u = sampling_uniform(42, uint64_t(step));
    ASSERT_GE(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    ASSERT_EQ(u, sampling_uniform(42, uint64_t(step)));
    sum += u;
    distinct.insert(u);
  }
  EXPECT_NEAR(sum / n, 0.5, 0.01);
  EXPECT_GT(distinct.size(), size_t(n * 0.99));  // 24-bit values: few collisions
  EXPECT_NE(sampling_uniform(1, 0), sampling_uniform(2, 0));
}

TEST(Sampling, ArgmaxTakesFirstMaximum) {
  const std::vector<float> logits{0.5f, 3.0f, -1.0f, 3.0f, 2.9f};
  EXPECT_EQ(argmax(logits.data(), int(logits.size())), 1);
  EXPECT_EQ(argmax(logits.data(), 1), 0);
  EXPECT_THROW(argmax(logits.data(), 0), Error);
}

TEST(Sampling, GreedyIsArgmax) {
  for (uint32_t seed = 0; seed < 20; ++seed) {
    const auto logits = random_logits(300, seed);
    const int best = argmax(logits.data(), 300);
    EXPECT_EQ(logits[best], *std::max_element(logits.begin(), logits.end()));
    for (uint64_t step = 0; step < 5; ++step) {
      EXPECT_EQ(sample(logits, 0.0f, 1.0f, seed, step), best);
      EXPECT_EQ(sample(logits, -1.0f, 0.9f, seed, step), best);
    }
  }
}

TEST(Sampling, DeterministicForSeedAndStep) {
  // A token depends on (logits, parameters, seed, step) only: drawn again in
  // reverse order, interleaved with draws of other seeds (any hidden state
  // would move), the sequence is the same; and it is not one token repeated.
  const auto logits = random_logits(100, 3, 0.5f);
  std::vector<int> forward;
  for (uint64_t step = 0; step < 200; ++step) forward.push_back(sample(logits, 1.0f, 0.95f, 7, step));
  EXPECT_GT(std::set<int>(forward.begin(), forward.end()).size(), 10u);
  for (uint64_t step = 200; step-- > 0;) {
    sample(logits, 1.0f, 0.95f, 8 + step, step);
    EXPECT_EQ(sample(logits, 1.0f, 0.95f, 7, step), forward[step]) << "step " << step;
  }
}

TEST(Sampling, DifferentSeedsGiveDifferentSequences) {
  const auto logits = random_logits(100, 3, 0.5f);  // flat-ish: many plausible tokens
  std::set<std::vector<int>> sequences;
  for (uint64_t seed = 0; seed < 10; ++seed) {
    std::vector<int> tokens;
    for (uint64_t step = 0; step < 50; ++step) tokens.push_back(sample(logits, 1.0f, 1.0f, seed, step));
    sequences.insert(tokens);
    // Within one sequence the steps draw different tokens too.
    EXPECT_GT(std::set<int>(tokens.begin(), tokens.end()).size(), 10u);
  }
  EXPECT_EQ(sequences.size(), 10u);
}

TEST(Sampling, TinyTopPIsArgmax) {
  const std::vector<float> tied{0.0f, 1.0f, 4.0f, 2.0f, 4.0f};  // ties at 2 and 4: lower id wins
  for (uint64_t step = 0; step < 500; ++step) {
    EXPECT_EQ(sample(tied, 1.0f, 1e-6f, 9, step), 2);
    EXPECT_EQ(sample(tied, 5.0f, 0.0f, 9, step), 2);
  }
  const std::vector<float> flat(64, 0.25f);  // uniform: the nucleus is still one token
  for (uint64_t step = 0; step < 100; ++step) EXPECT_EQ(sample(flat, 1.0f, 1e-6f, 3, step), 0);
}

TEST(Sampling, MatchesReferenceSamplerDrawForDraw) {
  for (uint32_t case_seed = 0; case_seed < 4; ++case_seed) {
    const auto logits = random_logits(50 + 37 * int(case_seed), case_seed);
    for (float temperature : {0.5f, 1.0f, 2.0f})
      for (float top_p : {1.0f, 0.9f, 0.5f, 0.1f})
        for (uint64_t step = 0; step < 300; ++step) {
          const float r = sampling_uniform(case_seed, step);
          ASSERT_EQ(sample(logits, temperature, top_p, case_seed, step),
                    reference_sample(logits, temperature, top_p, r))
              << "T " << temperature << " top_p " << top_p << " step " << step;
        }
  }
}

// Frequencies over many steps follow the reference distribution.
void expect_frequencies(const std::vector<float>& logits, float temperature, float top_p) {
  const int draws = 200000;
  std::vector<int> counts(logits.size(), 0);
  for (int step = 0; step < draws; ++step) ++counts[size_t(sample(logits, temperature, top_p, 11, uint64_t(step)))];
  const std::vector<double> p = reference_distribution(logits, temperature, top_p);
  for (size_t i = 0; i < p.size(); ++i) {
    const double freq = double(counts[i]) / draws;
    if (p[i] == 0.0)
      EXPECT_EQ(counts[i], 0) << "token " << i << " is outside the nucleus";
    else
      EXPECT_NEAR(freq, p[i], 0.006) << "token " << i;  // >= 5 standard deviations
  }
}

TEST(Sampling, FrequenciesMatchSoftmax) {
  expect_frequencies({1.0f, 2.0f, 0.5f, 2.0f, -1.0f, 0.0f}, 0.8f, 1.0f);
}

TEST(Sampling, FrequenciesMatchNucleus) {
  expect_frequencies({1.0f, 2.0f, 0.5f, 2.0f, -1.0f, 0.0f}, 0.8f, 0.7f);
}

TEST(Sampling, HighTemperatureFlattens) {
  expect_frequencies({1.0f, 2.0f, 0.5f, 2.0f, -1.0f, 0.0f}, 10.0f, 1.0f);
}

// The stop rule every token-making path asks (gpu::generate, the decode
// worker, a migrated sequence): an end token is never output, even as the
// last allowed one; the allowance is max_new_tokens, cut so prompt + output
// stay within seq_len.
TEST(StopRule, EndTokensStopBeforeAndTheLimitAfter) {
  const std::vector<int> ends{1, 7};
  EXPECT_EQ(token_limit(10, 5, 100), 5);
  EXPECT_EQ(token_limit(98, 5, 100), 2) << "the context caps it";
  EXPECT_EQ(token_limit(100, 5, 100), 0);
  EXPECT_EQ(token_limit(120, 5, 100), 0) << "never negative";
  EXPECT_EQ(check_stop(ends, 3, 0, 5), std::nullopt);
  EXPECT_EQ(check_stop(ends, 3, 3, 5), std::nullopt);
  EXPECT_EQ(check_stop(ends, 3, 4, 5), FinishReason::length) << "the fifth of five is output, and the last";
  EXPECT_EQ(check_stop(ends, 7, 0, 5), FinishReason::eos);
  EXPECT_EQ(check_stop(ends, 1, 4, 5), FinishReason::eos) << "an end token at the limit is still not output";
  EXPECT_EQ(check_stop({}, 1, 0, 1), FinishReason::length) << "no end tokens: only the limit";
  EXPECT_EQ(to_string(FinishReason::eos), "eos");
  EXPECT_EQ(to_string(FinishReason::length), "length");
}

}  // namespace
}  // namespace disagg::gpu
