// Sampling: greedy, determinism, and agreement with a naive reference sampler;
// the stop rule that decides what each sampled token does.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "gpu/error.h"
#include "engine/sampling.h"
#include "engine/stop_rule.h"

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

// ---- the processors (engine/sampling.h's order), against a reference written
// the obvious way: a count per token, every token of the vocabulary visited.

struct Reference {
  std::vector<float> logits;
  SamplingParams p;
  uint64_t step = 0;
  std::vector<int> history;  // prompt, then `step` output tokens
  std::vector<int> ends;

  std::vector<float> processed() const {
    std::vector<float> l = logits;
    const int vocab = int(l.size());
    for (const TokenBias& b : p.logit_bias) l[size_t(b.token)] += b.bias;
    for (int t = 0; t < vocab; ++t) {
      const bool ends_it = (!p.stop.ignore_eos && std::count(ends.begin(), ends.end(), t) > 0) ||
                           std::count(p.stop.stop_token_ids.begin(), p.stop.stop_token_ids.end(), t) > 0;
      if (ends_it && step < uint64_t(p.stop.min_tokens)) l[size_t(t)] = -INFINITY;
    }
    const size_t prompt_len = history.size() - step;
    for (int t = 0; t < vocab; ++t) {
      const auto in_prompt = std::count(history.begin(), history.begin() + long(prompt_len), t);
      const auto in_output = std::count(history.begin() + long(prompt_len), history.end(), t);
      float& x = l[size_t(t)];
      if ((in_prompt + in_output > 0) && p.repetition_penalty != 1.0f)
        x = x > 0.0f ? x / p.repetition_penalty : x * p.repetition_penalty;
      if (in_output > 0) x -= p.frequency_penalty * float(in_output) + p.presence_penalty;
    }
    return l;
  }

  // The draw: softmax / temperature, min_p, top_k, top_p, then the walk of
  // reference_sample (token order for the whole distribution, else by
  // probability).
  int draw(float r) const {
    const std::vector<float> l = processed();
    if (!(p.temperature > 0.0f)) return argmax(l.data(), int(l.size()));
    const double max_logit = *std::max_element(l.begin(), l.end());
    std::vector<double> w(l.size());
    for (size_t i = 0; i < w.size(); ++i) w[i] = std::exp((l[i] - max_logit) / p.temperature);
    const double top = *std::max_element(w.begin(), w.end());
    for (double& x : w)
      if (x < p.min_p * top) x = 0.0;
    std::vector<size_t> order(w.size());
    std::iota(order.begin(), order.end(), 0);
    const bool sorted = (p.top_k > 0 && p.top_k < int(w.size())) || p.top_p < 1.0f;
    if (sorted) std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return w[a] > w[b]; });
    if (p.top_k > 0 && p.top_k < int(w.size()))
      for (size_t k = size_t(p.top_k); k < order.size(); ++k) w[order[k]] = 0.0;
    double total = std::accumulate(w.begin(), w.end(), 0.0);
    if (p.top_p < 1.0f) {
      double mass = 0.0;
      bool full = false;
      for (size_t i : order) {
        if (full) w[i] = 0.0;
        mass += w[i];
        if (mass >= p.top_p * total) full = true;
      }
      total = std::accumulate(w.begin(), w.end(), 0.0);
    }
    double cumulative = 0.0;
    int last = -1;
    for (size_t i : order) {
      if (w[i] == 0.0) continue;
      cumulative += w[i] / total;
      last = int(i);
      if (r < cumulative) return int(i);
    }
    return last;
  }
};

TEST(Sampling, EveryProcessorMatchesTheReferenceDrawForDraw) {
  std::mt19937 gen(2026);
  int cases = 0;
  for (uint32_t c = 0; c < 400; ++c) {
    Reference ref;
    const int vocab = 40 + int(gen() % 160);
    ref.logits = random_logits(vocab, c, 1.0f + float(gen() % 3));
    ref.ends = {int(gen() % vocab), int(gen() % vocab)};
    SamplingParams& p = ref.p;
    p.seed = c;
    p.temperature = std::array<float, 4>{0.0f, 0.5f, 1.0f, 1.7f}[gen() % 4];
    p.top_p = std::array<float, 3>{1.0f, 0.9f, 0.4f}[gen() % 3];
    p.top_k = std::array<int, 4>{0, 1, 5, 30}[gen() % 4];
    p.min_p = std::array<float, 3>{0.0f, 0.05f, 0.3f}[gen() % 3];
    p.presence_penalty = std::array<float, 3>{0.0f, 0.5f, -1.0f}[gen() % 3];
    p.frequency_penalty = std::array<float, 3>{0.0f, 0.7f, 2.0f}[gen() % 3];
    p.repetition_penalty = std::array<float, 3>{1.0f, 1.3f, 0.8f}[gen() % 3];
    for (int k = int(gen() % 4); k-- > 0;) {
      const int t = int(gen() % vocab);
      bool seen = false;
      for (const auto& b : p.logit_bias) seen |= b.token == t;
      if (!seen) p.logit_bias.push_back({t, float(int(gen() % 21) - 10)});
    }
    p.stop.min_tokens = int(gen() % 6);
    p.stop.ignore_eos = gen() % 2;
    if (gen() % 2) p.stop.stop_token_ids = {int(gen() % vocab)};
    ASSERT_EQ(check_sampling(p, vocab), "");
    const size_t prompt_len = 1 + gen() % 12;
    for (size_t i = 0; i < prompt_len; ++i) ref.history.push_back(int(gen() % vocab));
    for (uint64_t step = 0; step < 12; ++step) {
      ref.step = step;
      const int got = disagg::gpu::sample(ref.logits.data(), vocab, p, step, ref.history, ref.ends).token;
      ASSERT_EQ(got, ref.draw(sampling_uniform(p.seed, step))) << "case " << c << " step " << step;
      ref.history.push_back(got);  // the next step's history, as a sequence grows
      ++cases;
    }
  }
  EXPECT_EQ(cases, 400 * 12);
}

TEST(Sampling, MinTokensMasksEveryTokenThatWouldStop) {
  // Greedy, with the end token (9) the most likely, a stop token (4) next.
  std::vector<float> logits(12, 0.0f);
  logits[9] = 5.0f;
  logits[4] = 4.0f;
  logits[2] = 3.0f;
  SamplingParams p;
  p.stop.min_tokens = 3;
  p.stop.stop_token_ids = {4};
  const std::vector<int> ends{9};
  for (uint64_t step = 0; step < 3; ++step)
    EXPECT_EQ(disagg::gpu::sample(logits.data(), 12, p, step, {}, ends).token, 2) << "step " << step;
  EXPECT_EQ(disagg::gpu::sample(logits.data(), 12, p, 3, {}, ends).token, 9) << "from min_tokens on, unmasked";
  p.stop.ignore_eos = true;  // the end token is ordinary then: not masked, as it would not stop
  EXPECT_EQ(disagg::gpu::sample(logits.data(), 12, p, 0, {}, ends).token, 9);
}

TEST(Sampling, PenaltiesFollowTheOutputAndThePrompt) {
  std::vector<float> logits{1.0f, 3.0f, 2.9f, -0.5f, 2.0f};
  const std::vector<int> history{4, 1, 1};  // prompt {4}, output {1, 1} (step 2)
  SamplingParams p;
  p.frequency_penalty = 0.1f;  // 3.0 - 0.2 = 2.8 < 2.9
  EXPECT_EQ(disagg::gpu::sample(logits.data(), 5, p, 2, history, {}).token, 2);
  p = {};
  p.presence_penalty = 0.05f;  // 3.0 - 0.05 = 2.95: still first
  EXPECT_EQ(disagg::gpu::sample(logits.data(), 5, p, 2, history, {}).token, 1);
  p = {};
  p.repetition_penalty = 1.5f;  // 3.0 / 1.5 = 2; prompt token 4: 2.0 / 1.5
  EXPECT_EQ(disagg::gpu::sample(logits.data(), 5, p, 2, history, {}).token, 2);
  p.logit_bias = {{3, 4.0f}};  // -0.5 + 4 = 3.5 (not a repeat: no penalty)
  EXPECT_EQ(disagg::gpu::sample(logits.data(), 5, p, 2, history, {}).token, 3);
  EXPECT_THROW(disagg::gpu::sample(logits.data(), 5, p, 4, history, {}), Error) << "a history shorter than the step";
  EXPECT_THROW(sample_token(logits.data(), 5, p, 2), Error) << "penalties need the history";
}

TEST(Sampling, LogprobsAreTheRawLogSoftmaxWithTheTopAlternatives) {
  const auto logits = random_logits(300, 5);
  double z = 0.0;
  for (float l : logits) z += std::exp(double(l));
  SamplingParams p;
  p.temperature = 0.8f;
  p.seed = 3;
  p.logprobs = 5;
  p.logit_bias = {{7, 50.0f}};  // moves the draw, not the model's distribution
  p.repetition_penalty = 1.2f;
  const std::vector<int> history{1, 2, 3};
  const Sampled s = disagg::gpu::sample(logits.data(), 300, p, 0, history, {});
  EXPECT_EQ(s.token, 7);
  EXPECT_NEAR(s.logprobs.logprob, std::log(std::exp(double(logits[7])) / z), 1e-5);
  std::vector<int> order(300);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  ASSERT_EQ(s.logprobs.top_tokens.size(), 5u);
  ASSERT_EQ(s.logprobs.top_logprobs.size(), 5u);
  for (size_t k = 0; k < 5; ++k) {
    EXPECT_EQ(s.logprobs.top_tokens[k], order[k]);
    EXPECT_NEAR(s.logprobs.top_logprobs[k], double(logits[size_t(order[k])]) - std::log(z), 1e-5);
  }
  p.logprobs = 0;
  EXPECT_TRUE(disagg::gpu::sample(logits.data(), 300, p, 0, history, {}).logprobs.top_tokens.empty());
  p.logprobs = -1;
  EXPECT_EQ(disagg::gpu::sample(logits.data(), 300, p, 0, history, {}).logprobs.logprob, 0.0f) << "none asked";
}

TEST(Sampling, CheckSamplingNamesWhatIsOutOfRange) {
  auto why = [](auto edit) {
    SamplingParams p;
    edit(p);
    return check_sampling(p, 100);
  };
  EXPECT_EQ(why([](SamplingParams&) {}), "");
  EXPECT_NE(why([](SamplingParams& p) { p.temperature = -1; }).find("temperature"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.top_p = 0; }).find("top_p"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) {
              p.stop.min_tokens = 3;
              p.grammar = "{}";
            }).find("min_tokens with structured output"),
            std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.top_k = -1; }).find("top_k"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.min_p = 1.5f; }).find("min_p"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.presence_penalty = 2.5f; }).find("presence_penalty"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.frequency_penalty = NAN; }).find("frequency_penalty"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.repetition_penalty = 0; }).find("repetition_penalty"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.logit_bias = {{100, 1}}; }).find("vocabulary"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.logit_bias = {{3, 101}}; }).find("logit_bias"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.logit_bias = {{3, 1}, {3, 2}}; }).find("twice"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.stop.min_tokens = -1; }).find("min_tokens"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.stop.stop_token_ids = {-2}; }).find("stop token"), std::string::npos);
  EXPECT_NE(why([](SamplingParams& p) { p.logprobs = 21; }).find("logprobs"), std::string::npos);
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
  EXPECT_EQ(check_stop(ends, StopParams{}, 3, 0, 5), std::nullopt);
  EXPECT_EQ(check_stop(ends, StopParams{}, 3, 3, 5), std::nullopt);
  EXPECT_EQ(check_stop(ends, StopParams{}, 3, 4, 5), FinishReason::length) << "the fifth of five is output, and the last";
  EXPECT_EQ(check_stop(ends, StopParams{}, 7, 0, 5), FinishReason::eos);
  EXPECT_EQ(check_stop(ends, StopParams{}, 1, 4, 5), FinishReason::eos) << "an end token at the limit is still not output";
  EXPECT_EQ(check_stop({}, StopParams{}, 1, 0, 1), FinishReason::length) << "no end tokens: only the limit";
  StopParams stop;
  stop.min_tokens = 2;
  EXPECT_EQ(check_stop(ends, stop, 7, 1, 5), std::nullopt) << "before min_tokens an end token is output";
  EXPECT_EQ(check_stop(ends, stop, 7, 2, 5), FinishReason::eos);
  stop.ignore_eos = true;
  EXPECT_EQ(check_stop(ends, stop, 7, 2, 5), std::nullopt) << "ignore_eos: an ordinary token";
  stop.stop_token_ids = {3};
  EXPECT_EQ(check_stop(ends, stop, 3, 2, 5), FinishReason::eos) << "a stop token id ends it as an end token does";
  EXPECT_EQ(check_stop(ends, stop, 3, 4, 5), FinishReason::eos);
  EXPECT_EQ(to_string(FinishReason::eos), "eos");
  EXPECT_EQ(to_string(FinishReason::length), "length");
}

}  // namespace
}  // namespace disagg::gpu
