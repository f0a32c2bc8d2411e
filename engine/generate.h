// Colocated generation: prefill, then decode steps from a paged pool, in one
// process. The reference behaviour that the disaggregated cluster must match.
#pragma once
#include <vector>

#include "engine/constraint.h"
#include "engine/engine.h"
#include "engine/sampling.h"
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

// Same tokens, with the prompt fed one token at a time through decode steps
// (no prefill): a cross-check of the KV cache path.
GenerateResult generate_stepwise(Engine& engine, const std::vector<int>& prompt, int max_new_tokens,
                                 const SamplingParams& sampling, Constraints* constraints = nullptr);

}  // namespace disagg::gpu
