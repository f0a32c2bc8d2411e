// The stop rule: the one place that says when a generation ends, asked by
// every path that makes tokens (gpu::generate, the decode worker, a migrated
// sequence) and by the router's books of what has streamed.
//
// A request ends
//   - before an end token (ModelConfig::end_tokens, unless it asks
//     ignore_eos) or one of its stop_token_ids, once min_tokens are out:
//     finish eos, the token is not output;
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

// What a request asks of the stop rule beyond the model's end tokens
// (vLLM's min_tokens, ignore_eos and stop_token_ids).
struct StopParams {
  int32_t min_tokens = 0;    // no token ends the generation before this many are out (the sampler masks them)
  bool ignore_eos = false;   // the model's end tokens are ordinary tokens, output like any other
  std::vector<int32_t> stop_token_ids;  // end the generation as end tokens do (finish eos, not output)
};

// Is `token` one of the model's end tokens?
inline bool is_end_token(const std::vector<int>& end_tokens, int token) {
  return std::find(end_tokens.begin(), end_tokens.end(), token) != end_tokens.end();
}

// Does `token` end the generation (once min_tokens are out)?
inline bool ends_generation(const std::vector<int>& end_tokens, const StopParams& stop, int token) {
  return (!stop.ignore_eos && is_end_token(end_tokens, token)) ||
         std::find(stop.stop_token_ids.begin(), stop.stop_token_ids.end(), token) != stop.stop_token_ids.end();
}

// The tokens the sampler masks while fewer than min_tokens are out: every
// token that would end the generation.
inline std::vector<int> stopping_tokens(const std::vector<int>& end_tokens, const StopParams& stop) {
  std::vector<int> out = stop.ignore_eos ? std::vector<int>{} : end_tokens;
  out.insert(out.end(), stop.stop_token_ids.begin(), stop.stop_token_ids.end());
  return out;
}

// The verdict on a sampled `token`, number `index` of the request's output
// (0: the first after the prompt), when the request may output `limit`
// tokens in all (a migrated attempt's first_step plus its token_limit):
//   nullopt: output it, go on;  eos: do not output it, stop;
//   length: output it, it was the last.
inline std::optional<FinishReason> check_stop(const std::vector<int>& end_tokens, const StopParams& stop, int token,
                                              int index, int limit) {
  if (index >= stop.min_tokens && ends_generation(end_tokens, stop, token)) return FinishReason::eos;
  if (index + 1 >= limit) return FinishReason::length;
  return std::nullopt;
}

}  // namespace disagg::gpu
