#include "apps/cli/cli.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace disagg::cli {

long long parse_integer(const std::string& flag, const std::string& text, long long min, long long max) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE || v < min || v > max)
    throw UsageError{flag + " expects an integer in [" + std::to_string(min) + ", " + std::to_string(max) +
                     "], got '" + text + "'"};
  return v;
}

float parse_float(const std::string& flag, const std::string& text, float min, float max) {
  errno = 0;
  char* end = nullptr;
  const float v = std::strtof(text.c_str(), &end);
  if (text.empty() || *end != '\0' || errno == ERANGE || !(v >= min && v <= max))
    throw UsageError{flag + " expects a number in [" + std::to_string(min) + ", " + std::to_string(max) +
                     "], got '" + text + "'"};
  return v;
}

std::vector<int> parse_token_list(const std::string& flag, const std::string& text) {
  std::vector<int> tokens;
  std::istringstream in(text);
  std::string word;
  while (in >> word) tokens.push_back(int(parse_integer(flag, word, 0, INT_MAX)));
  if (tokens.empty()) throw UsageError{flag + " needs at least one token id"};
  return tokens;
}

bool GenerationFlags::take(const std::string& flag, const std::string& value) {
  if (flag == "--prompt") {
    prompt = value;
    has_prompt = true;
  } else if (flag == "--prompt-tokens") {
    prompt_tokens = parse_token_list(flag, value);
    has_prompt_tokens = true;
  } else if (flag == "--max-new-tokens") {
    max_new_tokens = int(parse_integer(flag, value, 0, INT_MAX));
  } else if (flag == "--temperature") {
    sampling.temperature = parse_float(flag, value, 0.0f, 100.0f);
  } else if (flag == "--top-p") {
    sampling.top_p = parse_float(flag, value, 1e-6f, 1.0f);
  } else if (flag == "--seed") {
    // Any 64-bit seed (the frontend's n > 1 choices use all of them: gpu::sample_seed).
    errno = 0;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(value.c_str(), &end, 10);
    if (value.empty() || value[0] == '-' || *end != '\0' || errno == ERANGE)
      throw UsageError{flag + " expects an integer in [0, 18446744073709551615], got '" + value + "'"};
    sampling.seed = uint64_t(v);
  } else if (flag == "--top-k") {
    sampling.top_k = int32_t(parse_integer(flag, value, 0, INT_MAX));
  } else if (flag == "--min-p") {
    sampling.min_p = parse_float(flag, value, 0.0f, 1.0f);
  } else if (flag == "--presence-penalty") {
    sampling.presence_penalty = parse_float(flag, value, -2.0f, 2.0f);
  } else if (flag == "--frequency-penalty") {
    sampling.frequency_penalty = parse_float(flag, value, -2.0f, 2.0f);
  } else if (flag == "--repetition-penalty") {
    sampling.repetition_penalty = parse_float(flag, value, 1e-6f, 2.0f);
  } else if (flag == "--logit-bias") {
    std::istringstream in(value);
    std::string word;
    while (in >> word) {
      const size_t eq = word.find('=');
      if (eq == std::string::npos) throw UsageError{flag + " expects ID=BIAS pairs, got '" + word + "'"};
      sampling.logit_bias.push_back(gpu::TokenBias{int32_t(parse_integer(flag, word.substr(0, eq), 0, INT_MAX)),
                                                   parse_float(flag, word.substr(eq + 1), -100.0f, 100.0f)});
    }
  } else if (flag == "--min-tokens") {
    sampling.stop.min_tokens = int32_t(parse_integer(flag, value, 0, INT_MAX));
  } else if (flag == "--ignore-eos") {
    sampling.stop.ignore_eos = parse_integer(flag, value, 0, 1) == 1;
  } else if (flag == "--stop-token-ids") {
    const std::vector<int> ids = parse_token_list(flag, value);
    sampling.stop.stop_token_ids.assign(ids.begin(), ids.end());
  } else {
    return false;
  }
  return true;
}

void GenerationFlags::require_complete() const {
  if (has_prompt == has_prompt_tokens) throw UsageError{"give exactly one of --prompt and --prompt-tokens"};
  if (max_new_tokens < 0) throw UsageError{"--max-new-tokens N is required"};
  if (const std::string why = gpu::check_sampling(sampling, INT_MAX); !why.empty()) throw UsageError{why};
}

std::string json_line(const nlohmann::ordered_json& value) {
  return value.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

bool Flags::next() {
  if (at_ >= argc_) return false;
  flag_ = argv_[at_++];
  value_.clear();
  if (flag_ == "--help" || flag_ == "-h") throw UsageError{};
  if (std::find(switches_.begin(), switches_.end(), flag_) != switches_.end()) return true;
  if (at_ >= argc_) throw UsageError{flag_ + " needs a value"};
  value_ = argv_[at_++];
  return true;
}

}  // namespace disagg::cli
