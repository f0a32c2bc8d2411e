// disagg-generate: colocated generation (prefill + decode in one process) from
// the command line; the single-process reference for the disaggregated cluster.
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/checkpoint.h"
#include "gpu/engine.h"
#include "gpu/error.h"
#include "gpu/generate.h"
#include "gpu/tokenizer.h"

namespace {

const char* kUsage =
    "usage: disagg-generate --model M --tokenizer T (--prompt TEXT | --prompt-tokens \"1 403 407\")\n"
    "                       --max-new-tokens N [--temperature X] [--top-p P] [--seed S]\n"
    "                       [--backend auto|cpu|cuda] [--json]\n"
    "Prints the prompt and its continuation, or with --json one line\n"
    "{\"prompt_tokens\":[...],\"output_tokens\":[...],\"text\":\"...\"} (text: the continuation).\n";

struct UsageError {
  std::string message;  // empty for --help
};

struct Options {
  std::string model, tokenizer, prompt, backend = "auto";
  std::vector<int> prompt_tokens;
  bool has_prompt = false, has_prompt_tokens = false, json = false;
  int max_new_tokens = -1;
  disagg::gpu::SamplingParams sampling;
};

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

std::vector<int> parse_token_list(const std::string& text) {
  std::vector<int> tokens;
  std::istringstream in(text);
  std::string word;
  while (in >> word) tokens.push_back(int(parse_integer("--prompt-tokens", word, 0, INT_MAX)));
  if (tokens.empty()) throw UsageError{"--prompt-tokens needs at least one token id"};
  return tokens;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") throw UsageError{};
    if (flag == "--json") {
      o.json = true;
      continue;
    }
    if (i + 1 >= argc) throw UsageError{flag + " needs a value"};
    const std::string value = argv[++i];
    if (flag == "--model") {
      o.model = value;
    } else if (flag == "--tokenizer") {
      o.tokenizer = value;
    } else if (flag == "--prompt") {
      o.prompt = value;
      o.has_prompt = true;
    } else if (flag == "--prompt-tokens") {
      o.prompt_tokens = parse_token_list(value);
      o.has_prompt_tokens = true;
    } else if (flag == "--max-new-tokens") {
      o.max_new_tokens = int(parse_integer(flag, value, 0, INT_MAX));
    } else if (flag == "--temperature") {
      o.sampling.temperature = parse_float(flag, value, 0.0f, 100.0f);
    } else if (flag == "--top-p") {
      o.sampling.top_p = parse_float(flag, value, 1e-6f, 1.0f);
    } else if (flag == "--seed") {
      o.sampling.seed = uint64_t(parse_integer(flag, value, 0, LLONG_MAX));
    } else if (flag == "--backend") {
      if (value != "auto" && value != "cpu" && value != "cuda")
        throw UsageError{"--backend expects auto, cpu or cuda, got '" + value + "'"};
      o.backend = value;
    } else {
      throw UsageError{"unknown option " + flag};
    }
  }
  if (o.model.empty()) throw UsageError{"--model M is required"};
  if (o.tokenizer.empty()) throw UsageError{"--tokenizer T is required"};
  if (o.has_prompt == o.has_prompt_tokens) throw UsageError{"give exactly one of --prompt and --prompt-tokens"};
  if (o.max_new_tokens < 0) throw UsageError{"--max-new-tokens N is required"};
  return o;
}

// Appends the code point as \uXXXX (a surrogate pair above the BMP).
void append_unicode_escape(std::string& out, uint32_t cp) {
  char buf[16];
  if (cp >= 0x10000) {
    cp -= 0x10000;
    std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
  } else {
    std::snprintf(buf, sizeof buf, "\\u%04x", cp);
  }
  out += buf;
}

// Length of the valid UTF-8 sequence at s[i], or 0 when it is not one.
size_t utf8_sequence_length(const std::string& s, size_t i) {
  const auto byte = [&](size_t j) { return static_cast<unsigned char>(s[j]); };
  const unsigned char c = byte(i);
  size_t n = 0;
  uint32_t cp = 0;
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2, cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3, cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4, cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t j = 1; j < n; ++j) {
    if ((byte(i + j) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + j) & 0x3F);
  }
  const bool overlong = (n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000);
  const bool surrogate = cp >= 0xD800 && cp <= 0xDFFF;
  return (overlong || surrogate || cp > 0x10FFFF) ? 0 : n;
}

// A JSON string literal. The tokenizer may emit a lone byte of a multi-byte
// character (byte-fallback pieces), so invalid UTF-8 becomes U+FFFD to keep
// the output valid JSON.
std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"') {
      out += "\\\"";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\b') {
      out += "\\b";
    } else if (c == '\f') {
      out += "\\f";
    } else if (c < 0x20) {
      append_unicode_escape(out, c);
    } else if (c < 0x80) {
      out += char(c);
    } else if (size_t n = utf8_sequence_length(s, i); n > 0) {
      out.append(s, i, n);
      i += n;
      continue;
    } else {
      append_unicode_escape(out, 0xFFFD);
    }
    ++i;
  }
  return out + "\"";
}

std::string json_int_array(const std::vector<int>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? "," : "") + std::to_string(values[i]);
  return out + "]";
}

// The prompt as text: every piece after its predecessor, BOS itself printing nothing.
std::string prompt_text(const disagg::gpu::Tokenizer& tokenizer, const std::vector<int>& prompt) {
  std::string text;
  int previous = disagg::gpu::kBosToken;
  for (int token : prompt) {
    if (token != disagg::gpu::kBosToken) text += tokenizer.decode(previous, token);
    previous = token;
  }
  return text;
}

int run(const Options& o) {
  using namespace disagg::gpu;
  auto checkpoint = Checkpoint::open(o.model);
  const Tokenizer tokenizer = Tokenizer::load(o.tokenizer, checkpoint->config().vocab_size);
  const std::vector<int> prompt = o.has_prompt ? tokenizer.encode(o.prompt) : o.prompt_tokens;

  Engine engine(checkpoint, EngineOptions{o.backend});
  const auto start = std::chrono::steady_clock::now();
  const GenerateResult result = generate(engine, prompt, o.max_new_tokens, o.sampling);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string text = tokenizer.decode_all(prompt.back(), result.tokens);

  if (o.json) {
    std::cout << "{\"prompt_tokens\":" << json_int_array(prompt) << ",\"output_tokens\":"
              << json_int_array(result.tokens) << ",\"text\":" << json_string(text) << "}" << std::endl;
  } else {
    std::cout << prompt_text(tokenizer, prompt) << text << std::endl;
    std::cerr << "[" << engine.backend_name() << "] " << prompt.size() << " prompt tokens, "
              << result.tokens.size() << " generated ("
              << (result.finish == FinishReason::eos ? "end of sequence" : "length") << ") in " << seconds
              << " s\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = parse_args(argc, argv);
  } catch (const UsageError& e) {
    if (e.message.empty()) {
      std::cout << kUsage;
      return 0;
    }
    std::cerr << "disagg-generate: " << e.message << "\n" << kUsage;
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    std::cerr << "disagg-generate: " << e.what() << "\n";
    return 1;
  }
}
