// What a request or a worker asks of speculative decoding
// (engine/speculation.h). Carried in the request's SamplingParams so that it
// travels wherever the request goes; it changes no token.
#pragma once
#include <cstdint>
#include <string>

namespace disagg::gpu {

// The most tokens one step may propose (vLLM's num_speculative_tokens).
constexpr int kMaxSpeculativeTokens = 16;
// The longest n-gram a lookup matches (vLLM's prompt_lookup_max).
constexpr int kMaxLookupTokens = 16;

enum class SpeculationMethod : int32_t {
  configured = -1,  // a request's "as the worker is configured"
  off = 0,
  ngram = 1,        // prompt lookup: the tokens that followed the sequence's last n tokens before
  draft = 2,        // a draft model's greedy guesses (engine/draft.h), where the worker has one
};
std::string to_string(SpeculationMethod method);
// "off", "ngram", "draft"; false for anything else.
bool parse_speculation_method(const std::string& text, SpeculationMethod& out);

// What a request or a worker asks of speculation. In a request 0 (and
// method configured) means "the worker's"; a worker's own are all set.
struct SpeculationParams {
  SpeculationMethod method = SpeculationMethod::configured;
  int32_t num_tokens = 0;  // proposed per step, 1..kMaxSpeculativeTokens
  int32_t lookup_min = 0;  // the shortest n-gram matched, 1..lookup_max
  int32_t lookup_max = 0;  // the longest, ..kMaxLookupTokens
};

}  // namespace disagg::gpu
