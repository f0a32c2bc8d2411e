#include "apps/cli/cli.h"

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
    temperature = parse_float(flag, value, 0.0f, 100.0f);
  } else if (flag == "--top-p") {
    top_p = parse_float(flag, value, 1e-6f, 1.0f);
  } else if (flag == "--seed") {
    seed = uint64_t(parse_integer(flag, value, 0, LLONG_MAX));
  } else {
    return false;
  }
  return true;
}

void GenerationFlags::require_complete() const {
  if (has_prompt == has_prompt_tokens) throw UsageError{"give exactly one of --prompt and --prompt-tokens"};
  if (max_new_tokens < 0) throw UsageError{"--max-new-tokens N is required"};
}

std::string json_line(const nlohmann::ordered_json& value) {
  return value.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace disagg::cli
