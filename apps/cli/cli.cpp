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

namespace {

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

}  // namespace

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

}  // namespace disagg::cli
