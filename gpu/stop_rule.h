// The stop rule: the one place that says when a generation ends, asked by
// every path that makes tokens (gpu::generate, the decode worker, a migrated
// sequence) and by the router's books of what has streamed.
//
// A request ends
//   - before an end token (ModelConfig::end_tokens): finish eos, the token is
//     not output;
//   - after its last allowed token: finish length. The allowance is
//     max_new_tokens, capped so that prompt + output never exceed seq_len.
// (Stop strings are text, cut at the HTTP edge: http/api.h TextAssembler.)
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace disagg::gpu {

enum class FinishReason : uint8_t {
  eos = 0,     // the model emitted an end token (not included in the tokens)
  length = 1,  // max_new_tokens reached, or the model's seq_len
};
inline std::string to_string(FinishReason reason) {
  switch (reason) {
    case FinishReason::eos: return "eos";
    case FinishReason::length: return "length";
  }
  return "unknown(" + std::to_string(static_cast<int>(reason)) + ")";
}

// The tokens a request after a prompt of `prompt_len` positions may make:
// max_new_tokens, so that the sequence never grows beyond seq_len (0 when
// the prompt fills the context already).
inline int token_limit(int prompt_len, int max_new_tokens, int seq_len) {
  return std::max(0, std::min(max_new_tokens, seq_len - prompt_len));
}

// Does `token` end the generation (an end token of the model)?
inline bool ends_generation(const std::vector<int>& end_tokens, int token) {
  return std::find(end_tokens.begin(), end_tokens.end(), token) != end_tokens.end();
}

// The verdict on a sampled `token` when `made` tokens are out already and
// the request may make `limit` (token_limit):
//   nullopt: output it, go on;  eos: do not output it, stop;
//   length: output it, it was the last.
inline std::optional<FinishReason> check_stop(const std::vector<int>& end_tokens, int token, int made, int limit) {
  if (ends_generation(end_tokens, token)) return FinishReason::eos;
  if (made + 1 >= limit) return FinishReason::length;
  return std::nullopt;
}

}  // namespace disagg::gpu
