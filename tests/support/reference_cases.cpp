#include "support/reference_cases.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "support/test_paths.h"

namespace disagg::test {

namespace {

// A recursive-descent reader of exactly the JSON the reference file and
// disagg-generate produce: objects, arrays, strings, numbers, literals.
class JsonReader {
 public:
  explicit JsonReader(const std::string& text) : s_(text) {}

  ReferenceCase read_case() {
    ReferenceCase c;
    expect('{');
    if (!consume('}')) {
      do {
        const std::string key = read_string();
        expect(':');
        if (key == "prompt") {
          c.prompt = read_string();
        } else if (key == "text") {
          c.text = read_string();
        } else if (key == "prompt_tokens") {
          c.prompt_tokens = read_int_array();
        } else if (key == "output_tokens") {
          c.output_tokens = read_int_array();
        } else if (key == "max_new_tokens") {
          c.max_new_tokens = int(read_number());
        } else {
          skip_value();
        }
      } while (consume(','));
      expect('}');
    }
    skip_space();
    if (i_ != s_.size()) fail("trailing characters");
    return c;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error("JSON: " + what + " at offset " + std::to_string(i_));
  }
  void skip_space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool consume(char c) {
    skip_space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!consume(c)) fail(std::string("expected '") + c + "'");
  }

  double read_number() {
    skip_space();
    const char* begin = s_.c_str() + i_;
    char* end = nullptr;
    const double v = std::strtod(begin, &end);
    if (end == begin) fail("expected a number");
    i_ += size_t(end - begin);
    return v;
  }

  std::vector<int> read_int_array() {
    std::vector<int> values;
    expect('[');
    if (consume(']')) return values;
    do values.push_back(int(read_number()));
    while (consume(','));
    expect(']');
    return values;
  }

  void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  uint32_t read_hex4() {
    if (i_ + 4 > s_.size()) fail("truncated \\u escape");
    const std::string hex = s_.substr(i_, 4);
    char* end = nullptr;
    const unsigned long v = std::strtoul(hex.c_str(), &end, 16);
    if (end != hex.c_str() + 4) fail("bad \\u escape");
    i_ += 4;
    return uint32_t(v);
  }

  std::string read_string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = read_hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(i_, 2, "\\u") == 0) {  // surrogate pair
            i_ += 2;
            const uint32_t low = read_hex4();
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default: fail(std::string("bad escape \\") + e);
      }
    }
  }

  void skip_value() {
    skip_space();
    if (i_ >= s_.size()) fail("expected a value");
    const char c = s_[i_];
    if (c == '"') {
      read_string();
    } else if (c == '[' || c == '{') {
      const char close = c == '[' ? ']' : '}';
      ++i_;
      if (consume(close)) return;
      do {
        if (close == '}') {
          read_string();
          expect(':');
        }
        skip_value();
      } while (consume(','));
      expect(close);
    } else if (s_.compare(i_, 4, "true") == 0 || s_.compare(i_, 4, "null") == 0) {
      i_ += 4;
    } else if (s_.compare(i_, 5, "false") == 0) {
      i_ += 5;
    } else {
      read_number();
    }
  }

  const std::string& s_;
  size_t i_ = 0;
};

}  // namespace

ReferenceCase parse_reference_case(const std::string& json_line) { return JsonReader(json_line).read_case(); }

std::vector<ReferenceCase> load_reference_cases(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::vector<ReferenceCase> cases;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      cases.push_back(parse_reference_case(line));
      cases.back().origin = path.substr(path.find_last_of('/') + 1) + ":" + std::to_string(number);
    } catch (const std::exception& e) {
      throw std::runtime_error(path + ":" + std::to_string(number) + ": " + e.what());
    }
  }
  return cases;
}

std::vector<ReferenceCase> load_all_reference_cases() {
  std::vector<ReferenceCase> all;
  for (const std::string& path : shared_reference_files()) {
    std::vector<ReferenceCase> cases = load_reference_cases(path);
    if (cases.empty()) throw std::runtime_error(path + ": no cases");
    all.insert(all.end(), std::make_move_iterator(cases.begin()), std::make_move_iterator(cases.end()));
  }
  return all;
}

std::string describe(const ReferenceCase& c) {
  // At most 48 bytes of the prompt, cut before a UTF-8 continuation byte.
  size_t shown = std::min<size_t>(c.prompt.size(), 48);
  while (shown < c.prompt.size() && shown > 0 && (uint8_t(c.prompt[shown]) & 0xC0) == 0x80) --shown;
  std::string prompt;
  for (const char ch : c.prompt.substr(0, shown)) {
    if (ch == '\n') prompt += "\\n";
    else if (ch == '\t') prompt += "\\t";
    else if (ch == '"' || ch == '\\') prompt += std::string("\\") + ch;
    else prompt += ch;
  }
  if (shown < c.prompt.size()) prompt += "...";
  return (c.origin.empty() ? std::string("case") : c.origin) + ", prompt \"" + prompt + "\" (" +
         std::to_string(c.prompt_tokens.size()) + " prompt tokens, " + std::to_string(c.max_new_tokens) + " new)";
}

}  // namespace disagg::test
