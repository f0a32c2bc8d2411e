// Sampling in the order engine/sampling.h gives, with counter-based randomness.
#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "engine/speculation.h"
#include "gpu/error.h"
#include "grammar/grammar.h"
#include "grammar/matcher.h"

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

uint64_t sample_seed(uint64_t seed, int index) {
  return index == 0 ? seed : splitmix64(seed ^ splitmix64(0x5eed0000ULL + uint64_t(index)));
}

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

std::string check_sampling(const SamplingParams& p, int vocab) {
  auto in = [](float x, float lo, float hi) { return std::isfinite(x) && x >= lo && x <= hi; };
  auto num = [](double x) {
    std::ostringstream out;
    out << x;
    return out.str();
  };
  auto token_ok = [&](int32_t t) { return t >= 0 && t < vocab; };
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f) return "temperature must be >= 0 (got " + num(p.temperature) + ")";
  if (!std::isfinite(p.top_p) || p.top_p <= 0.0f || p.top_p > 1.0f) return "top_p must be in (0, 1] (got " + num(p.top_p) + ")";
  if (p.top_k < 0) return "top_k must be >= 0 (0: off; got " + std::to_string(p.top_k) + ")";
  if (!in(p.min_p, 0.0f, 1.0f)) return "min_p must be in [0, 1] (got " + num(p.min_p) + ")";
  if (!in(p.presence_penalty, -kMaxPresencePenalty, kMaxPresencePenalty))
    return "presence_penalty must be in [-2, 2] (got " + num(p.presence_penalty) + ")";
  if (!in(p.frequency_penalty, -kMaxFrequencyPenalty, kMaxFrequencyPenalty))
    return "frequency_penalty must be in [-2, 2] (got " + num(p.frequency_penalty) + ")";
  if (!in(p.repetition_penalty, 0.0f, kMaxRepetitionPenalty) || p.repetition_penalty == 0.0f)
    return "repetition_penalty must be in (0, 2] (got " + num(p.repetition_penalty) + ")";
  if (p.logit_bias.size() > kMaxLogitBiasEntries)
    return "at most " + std::to_string(kMaxLogitBiasEntries) + " logit_bias entries (got " +
           std::to_string(p.logit_bias.size()) + ")";
  std::vector<int32_t> seen;
  for (const TokenBias& b : p.logit_bias) {
    if (!token_ok(b.token))
      return "logit_bias token " + std::to_string(b.token) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")";
    if (!in(b.bias, -kMaxLogitBias, kMaxLogitBias))
      return "logit_bias of token " + std::to_string(b.token) + " must be in [-100, 100] (got " + num(b.bias) + ")";
    seen.push_back(b.token);
  }
  std::sort(seen.begin(), seen.end());
  if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) return "logit_bias names a token twice";
  if (p.stop.min_tokens < 0) return "min_tokens must be >= 0 (got " + std::to_string(p.stop.min_tokens) + ")";
  // (a text the grammar has ended can only be followed by end tokens, which
  // min_tokens would write out as text)
  if (p.stop.min_tokens > 0 && !p.grammar.empty())
    return "min_tokens with structured output (a grammar) is not supported: the grammar decides where the text ends";
  if (p.stop.stop_token_ids.size() > kMaxStopTokenIds)
    return "at most " + std::to_string(kMaxStopTokenIds) + " stop_token_ids (got " +
           std::to_string(p.stop.stop_token_ids.size()) + ")";
  for (int32_t t : p.stop.stop_token_ids)
    if (!token_ok(t))
      return "stop token id " + std::to_string(t) + " is outside the vocabulary [0, " + std::to_string(vocab) + ")";
  if (p.logprobs < -1 || p.logprobs > kMaxLogprobs)
    return "logprobs must be in [0, " + std::to_string(kMaxLogprobs) + "] (got " + std::to_string(p.logprobs) + ")";
  if (p.prompt_logprobs < -1 || p.prompt_logprobs > kMaxLogprobs)
    return "prompt_logprobs must be in [0, " + std::to_string(kMaxLogprobs) + "] (got " +
           std::to_string(p.prompt_logprobs) + ")";
  // (its size only: the worker that samples compiles it and refuses a bad
  // one, invalid_request, so the router's thread never parses a grammar)
  if (p.grammar.size() > grammar::kMaxGrammarBytes)
    return "a grammar of " + std::to_string(p.grammar.size()) + " bytes (at most " +
           std::to_string(grammar::kMaxGrammarBytes) + ")";
  return check_speculation(p.speculation);
}

namespace {

// Step 1 and 2 of the order (sampling.h) on `work`, a copy of the logits.
void process_logits(std::vector<float>& work, const SamplingParams& p, uint64_t step, const std::vector<int>& history,
                    const std::vector<int>& end_tokens, const grammar::TokenMask* mask) {
  const int vocab = int(work.size());
  auto checked = [&](int t) {
    if (t < 0 || t >= vocab) throw Error("sample: token id " + std::to_string(t) + " outside the vocabulary");
    return size_t(t);
  };
  for (const TokenBias& b : p.logit_bias) work[checked(b.token)] += b.bias;
  if (mask) mask->apply(work.data(), vocab);
  if (step < uint64_t(p.stop.min_tokens) && !(mask && mask->only_end))
    for (int t : stopping_tokens(end_tokens, p.stop)) work[checked(t)] = -std::numeric_limits<float>::infinity();
  if (!p.penalized()) return;
  if (history.size() < step)
    throw Error("sample: the penalties need the request's tokens, " + std::to_string(history.size()) +
                " were given for step " + std::to_string(step));
  // The output so far: the last `step` tokens of the history; sorted, a
  // token's count is the length of its run.
  std::vector<int> output(history.end() - std::ptrdiff_t(step), history.end());
  std::sort(output.begin(), output.end());
  if (p.repetition_penalty != 1.0f) {
    std::vector<int> seen(history.begin(), history.end());
    std::sort(seen.begin(), seen.end());
    seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
    for (int t : seen) {
      float& l = work[checked(t)];
      l = l > 0.0f ? l / p.repetition_penalty : l * p.repetition_penalty;
    }
  }
  for (size_t i = 0; i < output.size();) {
    size_t j = i;
    while (j < output.size() && output[j] == output[i]) ++j;
    work[checked(output[i])] -= p.frequency_penalty * float(j - i) + p.presence_penalty;
    i = j;
  }
}

// Step 3 on (processed) logits.
int draw(const float* logits, int vocab, const SamplingParams& params, uint64_t step) {
  if (!(params.temperature > 0.0f)) return argmax(logits, vocab);  // also catches NaN

  // Softmax of logits / temperature in double, shifted by the max for range.
  const int best = argmax(logits, vocab);
  const float max_logit = logits[best];
  const double inv_t = 1.0 / double(params.temperature);
  std::vector<double> weights(static_cast<size_t>(vocab));
  double total = 0.0;
  // min_p: the top weight is exp(0) = 1, so a token below min_p x the top
  // probability has a weight below min_p.
  const double min_weight = double(params.min_p);
  for (int i = 0; i < vocab; ++i) {
    double w = std::exp((double(logits[i]) - double(max_logit)) * inv_t);
    if (w < min_weight) w = 0.0;
    weights[i] = w;
    total += w;
  }
  const float r = sampling_uniform(params.seed, step);

  auto by_weight = [&](int a, int b) { return weights[a] > weights[b] || (weights[a] == weights[b] && a < b); };
  std::vector<int> candidates;
  if (params.top_k > 0 && params.top_k < vocab) {
    // The k most probable, most probable first (ties: lower id).
    candidates.resize(size_t(vocab));
    std::iota(candidates.begin(), candidates.end(), 0);
    std::partial_sort(candidates.begin(), candidates.begin() + params.top_k, candidates.end(), by_weight);
    candidates.resize(size_t(params.top_k));
    total = 0.0;
    for (int t : candidates) total += weights[t];
  } else if (params.top_p >= 1.0f) {
    return pick(weights, [](size_t i) { return int(i); }, size_t(vocab), total, r);
  } else {
    // Nucleus: the smallest set of most probable tokens holding >= top_p of the mass.
    // A token below (1 - top_p) / (vocab - 1) of the mass can never be in it (all
    // such tokens together hold less than 1 - top_p), so only the rest is sorted.
    // The most probable token always qualifies, which the argument needs when the
    // cutoff exceeds every weight (near-uniform logits, tiny top_p).
    const double need = std::max(0.0, double(params.top_p)) * total;
    const double cutoff = vocab > 1 ? (total - need) / double(vocab - 1) : 0.0;
    for (int i = 0; i < vocab; ++i)
      if (weights[i] >= cutoff || i == best) candidates.push_back(i);
    std::stable_sort(candidates.begin(), candidates.end(),
                     [&](int a, int b) { return weights[a] > weights[b]; });  // ties: lower id first
  }
  if (params.top_p >= 1.0f) return pick(weights, [&](size_t i) { return candidates[i]; }, candidates.size(), total, r);
  const double need = std::max(0.0, double(params.top_p)) * total;
  double kept_mass = 0.0;
  size_t kept = 0;
  while (kept < candidates.size()) {
    kept_mass += weights[candidates[kept++]];
    if (kept_mass >= need) break;
  }
  return pick(weights, [&](size_t i) { return candidates[i]; }, kept, kept_mass, r);
}

// Log probabilities of the raw logits: the sampled token's and the top n.
}  // namespace

TokenLogprobs token_logprobs(const float* logits, int vocab, int token, int n) {
  const float max_logit = logits[argmax(logits, vocab)];
  double sum = 0.0;
  for (int i = 0; i < vocab; ++i) sum += std::exp(double(logits[i]) - double(max_logit));
  const double log_z = double(max_logit) + std::log(sum);
  TokenLogprobs out;
  out.logprob = float(double(logits[token]) - log_z);
  n = std::min(n, vocab);
  if (n <= 0) return out;
  std::vector<int> ids(static_cast<size_t>(vocab));
  std::iota(ids.begin(), ids.end(), 0);
  std::partial_sort(ids.begin(), ids.begin() + n, ids.end(),
                    [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  for (int k = 0; k < n; ++k) {
    out.top_tokens.push_back(ids[size_t(k)]);
    out.top_logprobs.push_back(float(double(logits[ids[size_t(k)]]) - log_z));
  }
  return out;
}

Sampled sample(const float* logits, int vocab, const SamplingParams& params, uint64_t step,
               const std::vector<int>& history, const std::vector<int>& end_tokens,
               const grammar::TokenMask* mask) {
  if (vocab <= 0) throw Error("sample: empty logits");
  if (!params.grammar.empty() && !mask) throw Error("sample: a request with a grammar needs its mask");
  if (mask && (mask->allowed == 0 || mask->bits.size() * 64 < size_t(vocab)))
    throw Error("sample: the grammar allows no token here");
  Sampled out;
  const bool processed = !params.logit_bias.empty() || params.penalized() || mask ||
                         step < uint64_t(params.stop.min_tokens);
  if (processed) {
    std::vector<float> work(logits, logits + vocab);
    process_logits(work, params, step, history, end_tokens, mask);
    out.token = draw(work.data(), vocab, params, step);
  } else {
    out.token = draw(logits, vocab, params, step);
  }
  if (params.logprobs >= 0) out.logprobs = token_logprobs(logits, vocab, out.token, params.logprobs);
  return out;
}

int sample_token(const float* logits, int vocab, const SamplingParams& params, uint64_t step) {
  if (params.uses_history() || params.stop.min_tokens > 0)
    throw Error("sample_token: the penalties, a grammar and min_tokens need the request's tokens (use sample)");
  return sample(logits, vocab, params, step, {}, {}).token;
}

}  // namespace disagg::gpu
