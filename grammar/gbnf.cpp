#include "grammar/gbnf.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace disagg::grammar {

namespace {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr uint32_t kSurrogateFirst = 0xD800, kSurrogateLast = 0xDFFF;

using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;  // code points, inclusive

// `cp` as UTF-8.
std::string utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6)), out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12)), out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18)), out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F)), out += char(0x80 | (cp & 0x3F));
  }
  return out;
}

// The code points [lo, hi] of one UTF-8 length as byte-range sequences:
// split until each byte position of the sequence ranges independently (the
// construction of RE2's and Rust regex-syntax's UTF-8 compilers).
void utf8_sequences(uint32_t lo, uint32_t hi, int length, std::vector<Expr>& out) {
  if (length == 1) {
    out.push_back(Grammar::bytes(ByteSet::range(uint8_t(lo), uint8_t(hi))));
    return;
  }
  for (int i = 1; i < length; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;  // the low i continuation bytes' bits
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_sequences(lo, lo | m, length, out);
        utf8_sequences((lo | m) + 1, hi, length, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_sequences(lo, (hi & ~m) - 1, length, out);
        utf8_sequences(hi & ~m, hi, length, out);
        return;
      }
    }
  }
  const std::string a = utf8(lo), b = utf8(hi);
  Expr seq = Grammar::empty();
  seq.alternatives[0].clear();
  for (size_t k = 0; k < a.size(); ++k) seq.alternatives[0].push_back(Symbol{-1, ByteSet::range(uint8_t(a[k]), uint8_t(b[k]))});
  out.push_back(seq);
}

// Any one code point of `ranges` (sorted, disjoint, no surrogates), as UTF-8.
Expr utf8_class(const Ranges& ranges) {
  static constexpr uint32_t kLast[] = {0x7F, 0x7FF, 0xFFFF, kMaxCodePoint};  // the largest of each length
  std::vector<Expr> out;
  for (const auto& [lo, hi] : ranges)
    for (int length = 1; length <= 4; ++length) {
      const uint32_t first = length == 1 ? 0 : kLast[length - 2] + 1;
      const uint32_t a = std::max(lo, first), b = std::min(hi, kLast[length - 1]);
      if (a <= b) utf8_sequences(a, b, length, out);
    }
  if (out.empty()) throw GrammarError("a character class that admits no character");
  return Grammar::alt(out);
}

// Sorted, merged, without surrogates; `negate`: everything else.
Ranges normalize(Ranges r, bool negate) {
  std::sort(r.begin(), r.end());
  Ranges merged;
  for (const auto& x : r) {
    if (!merged.empty() && x.first <= merged.back().second + 1) merged.back().second = std::max(merged.back().second, x.second);
    else merged.push_back(x);
  }
  if (negate) {
    Ranges other;
    uint32_t next = 0;
    for (const auto& [lo, hi] : merged) {
      if (lo > next) other.push_back({next, lo - 1});
      next = hi + 1;
    }
    if (next <= kMaxCodePoint) other.push_back({next, kMaxCodePoint});
    merged = std::move(other);
  }
  Ranges out;  // the surrogates cut out
  for (const auto& [lo, hi] : merged) {
    if (hi < kSurrogateFirst || lo > kSurrogateLast) {
      out.push_back({lo, hi});
      continue;
    }
    if (lo < kSurrogateFirst) out.push_back({lo, kSurrogateFirst - 1});
    if (hi > kSurrogateLast) out.push_back({kSurrogateLast + 1, hi});
  }
  return out;
}

size_t expr_symbols(const Expr& e) {
  size_t n = 0;
  for (const auto& a : e.alternatives) n += a.size();
  return std::max<size_t>(n, 1);
}

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) { rules_["root"] = 0; }

  Grammar parse() {
    skip_space(true);
    while (pos_ < s_.size()) {
      const size_t at = pos_;
      const std::string name = parse_name();
      skip_space(false);
      if (s_.substr(pos_, 3) != "::=") fail("expected '::=' after the rule name '" + name + "'");
      pos_ += 3;
      skip_space(true);
      if (!defined_.insert(name).second) fail("rule '" + name + "' is defined twice", at);
      const Expr e = parse_alternates(false);
      g_.define(rule_of(name, at), e);
      skip_space(false);
      if (pos_ < s_.size() && s_[pos_] != '\n' && s_[pos_] != '\r')
        fail(std::string("unexpected '") + s_[pos_] + "' (a rule ends at the end of its line)");
      skip_space(true);
    }
    if (!defined_.count("root")) fail("no rule 'root' (where the grammar starts)", 0);
    for (const auto& [name, at] : used_)
      if (!defined_.count(name)) fail("rule '" + name + "' is used but never defined", at);
    g_.check();
    return std::move(g_);
  }

 private:
  [[noreturn]] void fail(const std::string& what, size_t at = std::string_view::npos) const {
    if (at == std::string_view::npos) at = pos_;
    at = std::min(at, s_.size());
    size_t line = 1, column = 1;
    for (size_t i = 0; i < at; ++i) {
      if (s_[i] == '\n') ++line, column = 1;
      else ++column;
    }
    throw GrammarError("line " + std::to_string(line) + ", column " + std::to_string(column) + ": " + what);
  }

  static bool is_name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  }

  // Spaces and comments; newlines too where a rule may go on (`newlines`).
  void skip_space(bool newlines) {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == ' ' || c == '\t' || (newlines && (c == '\n' || c == '\r'))) {
        ++pos_;
      } else if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n' && s_[pos_] != '\r') ++pos_;
      } else {
        break;
      }
    }
  }

  std::string parse_name() {
    const size_t begin = pos_;
    while (pos_ < s_.size() && is_name_char(s_[pos_])) ++pos_;
    if (pos_ == begin) fail(pos_ < s_.size() ? std::string("expected a rule name, found '") + s_[pos_] + "'" : "expected a rule name");
    return std::string(s_.substr(begin, pos_ - begin));
  }

  int rule_of(const std::string& name, size_t at) {
    auto [it, added] = rules_.try_emplace(name, 0);
    if (added) it->second = g_.declare();
    used_.try_emplace(name, at);
    return it->second;
  }

  Expr parse_alternates(bool nested) {
    std::vector<Expr> alternatives{parse_sequence(nested)};
    while (pos_ < s_.size() && s_[pos_] == '|') {
      ++pos_;
      skip_space(true);
      alternatives.push_back(parse_sequence(nested));
    }
    return alternatives.size() == 1 ? alternatives[0] : Grammar::alt(alternatives);
  }

  Expr parse_sequence(bool nested) {
    std::vector<Expr> items;
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      const size_t at = pos_;
      Expr item;
      if (c == '"') {
        item = parse_literal();
      } else if (c == '[') {
        item = parse_class();
      } else if (c == '.') {
        ++pos_;
        item = utf8_class(normalize({{0, kMaxCodePoint}}, false));
      } else if (c == '(') {
        ++pos_;
        skip_space(true);
        item = parse_alternates(true);
        if (pos_ >= s_.size() || s_[pos_] != ')') fail("expected ')' to close the group", at);
        ++pos_;
      } else if (is_name_char(c)) {
        const std::string name = parse_name();
        item = Grammar::ref(rule_of(name, at));
      } else {
        break;  // '|', ')', the end of the line or of the text
      }
      skip_space(nested);
      item = parse_postfix(item, nested);
      if (g_.symbol_count() > kMaxSymbols) fail("the grammar is larger than " + std::to_string(kMaxSymbols) + " symbols");
      items.push_back(std::move(item));
    }
    return items.empty() ? Grammar::empty() : items.size() == 1 ? items[0] : g_.seq(items);
  }

  Expr parse_postfix(Expr item, bool nested) {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == '*' || c == '+' || c == '?') {
        ++pos_;
        item = c == '*' ? g_.star(item) : c == '+' ? g_.plus(item) : g_.optional(item);
      } else if (c == '{') {
        const size_t at = pos_++;
        const int min = parse_count();
        int max = min;
        if (pos_ < s_.size() && s_[pos_] == ',') {
          ++pos_;
          max = pos_ < s_.size() && s_[pos_] == '}' ? -1 : parse_count();
        }
        if (pos_ >= s_.size() || s_[pos_] != '}') fail("expected '}' to close the repetition", at);
        ++pos_;
        if (max >= 0 && max < min) fail("a repetition {m,n} with n < m", at);
        if (expr_symbols(item) * size_t(std::max(min, max)) > kMaxSymbols)
          fail("the repetition would spell out more than " + std::to_string(kMaxSymbols) + " symbols", at);
        item = g_.repeat(item, min, max);
      } else {
        break;
      }
      skip_space(nested);
    }
    return item;
  }

  int parse_count() {
    const size_t begin = pos_;
    long long v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      v = v * 10 + (s_[pos_++] - '0');
      if (v > kMaxRepeat) fail("a repetition count past " + std::to_string(kMaxRepeat), begin);
    }
    if (pos_ == begin) fail("expected a number in the repetition");
    return int(v);
  }

  // One code point of a literal or class: an escape or the UTF-8 at pos_.
  uint32_t parse_char() {
    const size_t at = pos_;
    const auto c = uint8_t(s_[pos_++]);
    if (c == '\\') {
      if (pos_ >= s_.size()) fail("an escape at the end of the text", at);
      const char e = s_[pos_++];
      switch (e) {
        case 'n': return '\n';
        case 'r': return '\r';
        case 't': return '\t';
        case '\\': case '"': case '[': case ']': case '-': case '^': return uint32_t(uint8_t(e));
        case 'x': return parse_hex(2, at);
        case 'u': return parse_hex(4, at);
        case 'U': return parse_hex(8, at);
        default: fail(std::string("unknown escape '\\") + e + "'", at);
      }
    }
    if (c < 0x80) return c;
    // UTF-8 (the text came in a JSON string: valid, but checked anyway).
    const int length = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
    if (length == 0 || at + size_t(length) > s_.size()) fail("not UTF-8", at);
    uint32_t cp = c & (0xFF >> (length + 1));
    for (int i = 1; i < length; ++i) {
      const auto b = uint8_t(s_[pos_++]);
      if ((b & 0xC0) != 0x80) fail("not UTF-8", at);
      cp = cp << 6 | (b & 0x3F);
    }
    return cp;
  }

  uint32_t parse_hex(int digits, size_t at) {
    uint32_t v = 0;
    for (int i = 0; i < digits; ++i) {
      if (pos_ >= s_.size()) fail("a short hex escape", at);
      const char h = s_[pos_++];
      const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) fail("a hex escape with a non-hex digit", at);
      v = v << 4 | uint32_t(d);
    }
    if (v > kMaxCodePoint || (v >= kSurrogateFirst && v <= kSurrogateLast)) fail("an escape that is no character", at);
    return v;
  }

  Expr parse_literal() {
    const size_t at = pos_++;
    std::string bytes;
    while (true) {
      if (pos_ >= s_.size() || s_[pos_] == '\n') fail("an unterminated string", at);
      if (s_[pos_] == '"') break;
      bytes += utf8(parse_char());
    }
    ++pos_;
    return Grammar::literal(bytes);
  }

  Expr parse_class() {
    const size_t at = pos_++;
    const bool negate = pos_ < s_.size() && s_[pos_] == '^';
    if (negate) ++pos_;
    Ranges ranges;
    while (true) {
      if (pos_ >= s_.size() || s_[pos_] == '\n') fail("an unterminated character class", at);
      if (s_[pos_] == ']') break;
      const uint32_t lo = parse_char();
      uint32_t hi = lo;
      if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
        ++pos_;
        hi = parse_char();
        if (hi < lo) fail("a character range whose end comes before its start", at);
      }
      ranges.push_back({lo, hi});
    }
    ++pos_;
    try {
      return utf8_class(normalize(ranges, negate));
    } catch (const GrammarError& e) {
      fail(e.what(), at);
    }
  }

  std::string_view s_;
  size_t pos_ = 0;
  Grammar g_;
  std::map<std::string, int> rules_;    // name -> rule (root: 0)
  std::set<std::string> defined_;
  std::map<std::string, size_t> used_;  // name -> where first named
};

}  // namespace

Grammar gbnf_grammar(std::string_view text) { return Parser(text).parse(); }

}  // namespace disagg::grammar
