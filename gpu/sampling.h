// Token sampling: greedy, temperature, top-p. Deterministic for a seed: the
// random number for the n-th generated token is a pure function of (seed, n),
// so a sequence samples the same tokens wherever and in whatever batch it runs.
#pragma once
#include <cstdint>
#include <vector>

namespace disagg::gpu {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax)
  float top_p = 1.0f;        // nucleus mass in (0, 1]
  uint64_t seed = 0;
};

// Uniform in [0, 1) from (seed, step), by a counter-based mixer.
float sampling_uniform(uint64_t seed, uint64_t step);

int argmax(const float* logits, int vocab);

// step: index of the token being generated (0 for the token after the prompt).
int sample_token(const float* logits, int vocab, const SamplingParams& params, uint64_t step);

}  // namespace disagg::gpu
