// Command-line helpers shared by the executables: strict number parsing with
// usage errors that name the flag, and the JSON output of generated tokens.
#pragma once
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/sampling.h"

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

// The request flags that disagg-generate and disagg-client share:
// (--prompt TEXT | --prompt-tokens "1 403 407") --max-new-tokens N
// [--temperature X] [--top-p P] [--seed S] [--top-k K] [--min-p P]
// [--presence-penalty X] [--frequency-penalty X] [--repetition-penalty X]
// [--logit-bias "ID=BIAS ..."] [--min-tokens N] [--ignore-eos 0|1]
// [--stop-token-ids "ID ..."] (engine/sampling.h's order and ranges).
inline constexpr const char* kSamplingUsage =
    "  --temperature X --top-p P --seed S --top-k K --min-p P\n"
    "  --presence-penalty X --frequency-penalty X --repetition-penalty X\n"
    "  --logit-bias \"ID=BIAS ...\" --min-tokens N --ignore-eos 0|1 --stop-token-ids \"ID ...\"\n"
    "  (engine/sampling.h: vLLM's order and ranges; default greedy)\n";

struct GenerationFlags {
  std::string prompt;
  std::vector<int> prompt_tokens;
  bool has_prompt = false;
  bool has_prompt_tokens = false;
  int max_new_tokens = -1;
  gpu::SamplingParams sampling;  // greedy unless the flags say otherwise

  // Takes `flag value` when it is one of these flags (UsageError on a bad
  // value); false when the flag is not one of them.
  bool take(const std::string& flag, const std::string& value);
  // UsageError unless exactly one prompt and --max-new-tokens were given,
  // and the sampling is in range (gpu::check_sampling).
  void require_complete() const;
};

// One line of JSON (nlohmann-json, keys in insertion order); bytes that are
// not valid UTF-8 (a token may be one byte of a multi-byte character) become
// U+FFFD, so the output stays valid JSON.
std::string json_line(const nlohmann::ordered_json& value);

// argv's flags one at a time, for a loop `for (Flags f(argc, argv); f.next();)`:
// --help or -h throws UsageError{} (the usage); a flag of `switches` stands
// alone (value ""); every other flag takes the next argument as its value,
// or throws UsageError "FLAG needs a value".
class Flags {
 public:
  Flags(int argc, char** argv, std::initializer_list<const char*> switches = {})
      : argc_(argc), argv_(argv), switches_(switches.begin(), switches.end()) {}
  bool next();
  const std::string& flag() const { return flag_; }
  const std::string& value() const { return value_; }

 private:
  int argc_;
  char** argv_;
  std::vector<std::string> switches_;
  int at_ = 1;
  std::string flag_, value_;
};

// main() of every executable: parse (UsageError: the message and the usage on
// stderr, exit 2; --help: the usage on stdout, exit 0), then run (any
// exception: its message on stderr, exit 1; else run's exit code).
template <class Parse, class Run>
int main_with_usage(const char* program, const char* usage, int argc, char** argv, Parse parse, Run run) {
  decltype(parse(argc, argv)) options;
  try {
    options = parse(argc, argv);
  } catch (const UsageError& e) {
    if (e.message.empty()) {
      std::cout << usage;
      return 0;
    }
    std::cerr << program << ": " << e.message << "\n" << usage;
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::cerr << program << ": " << e.what() << "\n";
    return 1;
  }
}

}  // namespace disagg::cli
