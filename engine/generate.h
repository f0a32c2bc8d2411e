// Colocated generation: prefill, then decode steps from a paged pool, in one
// process. The reference behaviour that the disaggregated cluster must match.
#pragma once
#include <functional>
#include <vector>

#include "engine/constraint.h"
#include "engine/engine.h"
#include "engine/sampling.h"
#include "engine/speculation.h"
#include "engine/stop_rule.h"

namespace disagg::gpu {

struct GenerateResult {
  std::vector<int> tokens;  // generated, prompt excluded, stopping before an end token (ModelConfig::end_tokens)
  FinishReason finish = FinishReason::length;
  std::vector<TokenLogprobs> logprobs;  // one per token when SamplingParams::logprobs >= 0
  // SamplingParams::prompt_logprobs >= 0 (generate() only): prompt token i's (i >= 1) at i - 1.
  std::vector<TokenLogprobs> prompt_logprobs;
};

// KV positions a request can ever hold: the prompt plus every generated token
// but the last (which is emitted, never fed), capped at seq_len. The decode
// pool reserves this many for a request, colocated or disaggregated.
int kv_positions_needed(int prompt_len, int max_new_tokens, int seq_len);

// Stops where the stop rule says (engine/stop_rule.h: before an end token, after
// max_new_tokens or at the model's seq_len). Throws Error on an empty prompt or a bad token id.
// A request with a grammar (SamplingParams::grammar) needs `constraints`
// for the engine's vocabulary; Error without.
GenerateResult generate(Engine& engine, const std::vector<int>& prompt, int max_new_tokens,
                        const SamplingParams& sampling, Constraints* constraints = nullptr);

// Speculative generation (engine/speculation.h): each decode step feeds up to
// num_tokens of the proposer's guesses after the last token and keeps what
// plain decoding makes, so the result is generate()'s, token for token and
// log probability for log probability, whatever the proposer says.
struct Speculation {
  Proposer propose;
  int num_tokens = 4;  // guesses per step, at most
  bool gated = true;   // false: no SpeculationGate (the benchmark's every-step floor)
  bool priced = true;  // false: the gate does not weigh a guess row's measured cost (tests that count steps)
};
struct SpeculationStats {
  int64_t proposed = 0;  // guesses fed
  int64_t accepted = 0;  // of them, equal to the token made
  int64_t steps = 0;     // decode steps (the first token, sampled after the prefill, counts as one)
};
// Each output token as soon as it is made, in order: exactly the result's
// tokens (none past a stop), for a caller that streams them.
using TokenSink = std::function<void(int token)>;
// spec null: generate().
GenerateResult generate_speculative(Engine& engine, const std::vector<int>& prompt, int max_new_tokens,
                                    const SamplingParams& sampling, const Speculation* spec,
                                    Constraints* constraints = nullptr, SpeculationStats* stats = nullptr,
                                    const TokenSink& on_token = {});

// Same tokens, with the prompt fed one token at a time through decode steps
// (no prefill): a cross-check of the KV cache path.
GenerateResult generate_stepwise(Engine& engine, const std::vector<int>& prompt, int max_new_tokens,
                                 const SamplingParams& sampling, Constraints* constraints = nullptr);

}  // namespace disagg::gpu
