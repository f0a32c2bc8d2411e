// Token sampling: what one decode step does with a sequence's logits.
// Deterministic for a seed: the random number for the n-th generated token is
// a pure function of (seed, n), and every other input is the request's own
// tokens, so a sequence samples the same tokens wherever, in whatever batch
// and after whatever migration it runs.
//
// The order (vLLM v1's sampler), each step, on a copy of the logits:
//   1. logit_bias added; while fewer than stop.min_tokens tokens are out, every
//      token that would end the generation (engine/stop_rule.h) masked to -inf;
//   2. penalties: repetition_penalty on each token of the prompt and the output
//      (a positive logit divided by it, a negative one multiplied),
//      frequency_penalty times the token's count in the output and
//      presence_penalty once for a token in the output, both subtracted;
//   3. temperature 0: the argmax (first maximum). Else softmax of logits /
//      temperature; min_p drops tokens below min_p x the top probability;
//      top_k keeps the k most probable; top_p keeps the smallest most probable
//      set holding top_p of what is left; one draw of sampling_uniform(seed, step).
// Log probabilities are of the raw logits, before 1-3 (the model's own
// distribution: vLLM's default logprobs mode, raw_logprobs).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/speculation_params.h"
#include "engine/stop_rule.h"

namespace disagg::grammar {
struct TokenMask;
}

namespace disagg::gpu {

// The most alternatives a token's log probabilities list (OpenAI's top_logprobs limit).
constexpr int kMaxLogprobs = 20;
// logit_bias values are clamped to this range by OpenAI; here they are checked against it.
constexpr float kMaxLogitBias = 100.0f;
// The penalties' ranges: presence and frequency in [-2, 2] (OpenAI's),
// repetition in (0, kMaxRepetitionPenalty] (1: off).
constexpr float kMaxPresencePenalty = 2.0f;
constexpr float kMaxFrequencyPenalty = 2.0f;
constexpr float kMaxRepetitionPenalty = 2.0f;
// The most logit_bias entries and stop_token_ids a request may carry.
constexpr size_t kMaxLogitBiasEntries = 1024;
constexpr size_t kMaxStopTokenIds = 64;

struct TokenBias {
  int32_t token = 0;
  float bias = 0.0f;  // added to the token's logit, in [-kMaxLogitBias, kMaxLogitBias]
};

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax)
  float top_p = 1.0f;        // nucleus mass in (0, 1]
  uint64_t seed = 0;
  int32_t top_k = 0;                // 0: every token
  float min_p = 0.0f;               // in [0, 1]; 0: off
  float presence_penalty = 0.0f;    // in [-2, 2]
  float frequency_penalty = 0.0f;   // in [-2, 2]
  float repetition_penalty = 1.0f;  // in (0, 2]; 1: off
  std::vector<TokenBias> logit_bias;  // distinct tokens
  StopParams stop;                  // min_tokens, ignore_eos, stop_token_ids
  int32_t logprobs = -1;            // -1: none; else the sampled token's and this many alternatives' (<= kMaxLogprobs)
  // -1: none; else each prompt token's log probability after the tokens
  // before it, with this many alternatives (vLLM's prompt_logprobs; OpenAI's
  // echo with logprobs). Every prompt position is computed then: no prefix
  // cache serves such a request.
  int32_t prompt_logprobs = -1;
  // Constrained decoding: a grammar (grammar/grammar.h's JSON form) every
  // output token must keep to; empty: none. Its mask (engine/constraint.h)
  // applies with logit_bias (step 1), and an end token only where the
  // grammar may end; while it allows only end tokens, min_tokens does not
  // mask them.
  std::string grammar;
  // Speculative decoding (engine/speculation.h): how this request's decode
  // steps may guess ahead. Not sampling and changes no token: it travels
  // with the sampling so that every worker that decodes the request reads it.
  SpeculationParams speculation;

  bool penalized() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f;
  }
  // Whether sampling reads the request's earlier tokens (the penalties, a
  // grammar's place): then every step needs them (the decode worker keeps
  // them for the sequence).
  bool uses_history() const { return penalized() || !grammar.empty(); }
};

// Empty when `p` is valid for a vocabulary of `vocab` tokens, else why not
// (a range, a token id outside the vocabulary, a repeated logit_bias token,
// a grammar over grammar::kMaxGrammarBytes; its rules are checked where it is
// compiled, engine/constraint.h):
// the one check of a request's sampling, by the router and by a decode worker
// of what a peer sent.
std::string check_sampling(const SamplingParams& p, int vocab);

// The log probabilities of one sampled token (SamplingParams::logprobs >= 0).
struct TokenLogprobs {
  float logprob = 0.0f;               // of the sampled token
  std::vector<int32_t> top_tokens;    // the `logprobs` most probable tokens, most probable first (ties: lower id)
  std::vector<float> top_logprobs;    // theirs
};

// The log probabilities of `token` and the top `n` tokens of raw `logits`.
TokenLogprobs token_logprobs(const float* logits, int vocab, int token, int n);

struct Sampled {
  int32_t token = 0;
  TokenLogprobs logprobs;  // filled when SamplingParams::logprobs >= 0
};

// The seed of sample `index` of a request with several (OpenAI's n, best_of):
// sample 0 keeps the request's seed, the others get their own random numbers
// sampling_uniform(sample_seed(seed, i), step).
uint64_t sample_seed(uint64_t seed, int index);

// Uniform in [0, 1) from (seed, step), by a counter-based mixer.
float sampling_uniform(uint64_t seed, uint64_t step);

int argmax(const float* logits, int vocab);

// Token number `step` of a request (0: the one after the prompt) from the
// logits that followed `history`: the request's tokens so far, the prompt
// then the `step` output tokens (read only when the sampling uses_history()
// or masks for min_tokens; may be empty otherwise). `end_tokens`: the
// model's (ModelConfig::end_tokens). Throws Error on an empty vocabulary, a
// history shorter than `step` that is needed, or a token id outside it.
// `mask`: the grammar's for this step (Constraints::mask), required when
// params.grammar is set; Error when it allows no token.
Sampled sample(const float* logits, int vocab, const SamplingParams& params, uint64_t step,
               const std::vector<int>& history, const std::vector<int>& end_tokens,
               const grammar::TokenMask* mask = nullptr);

// The token alone, for a request that needs no history and no end tokens
// (temperature, top_p, top_k, min_p, logit_bias).
int sample_token(const float* logits, int vocab, const SamplingParams& params, uint64_t step);

}  // namespace disagg::gpu
