// Command-line helpers shared by the executables: strict number parsing with
// usage errors that name the flag, and the JSON output of generated tokens.
#pragma once
#include <string>
#include <vector>

namespace disagg::cli {

// A bad command line; an empty message means --help was asked for.
struct UsageError {
  std::string message;
};

// Whole-string integer/number in [min, max], else UsageError naming the flag.
long long parse_integer(const std::string& flag, const std::string& text, long long min, long long max);
float parse_float(const std::string& flag, const std::string& text, float min, float max);
// Whitespace-separated token ids ("1 403 407"), at least one.
std::vector<int> parse_token_list(const std::string& flag, const std::string& text);

// A JSON string literal; bytes that are not valid UTF-8 (a token may be one
// byte of a multi-byte character) become U+FFFD, so the output stays valid JSON.
std::string json_string(const std::string& s);
std::string json_int_array(const std::vector<int>& values);

}  // namespace disagg::cli
