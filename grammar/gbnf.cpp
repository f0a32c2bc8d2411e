#include "grammar/gbnf.h"

#include "grammar/code_points.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace disagg::grammar {

namespace {

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
        item = code_point_class({{0, kMaxCodePoint}}, false);
      } else if (c == '(') {
        ++pos_;
        skip_space(true);
        if (++depth_ > kMaxNesting) fail("groups nested deeper than " + std::to_string(kMaxNesting), at);
        item = parse_alternates(true);
        --depth_;
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
        try {
          item = g_.repeat(item, min, max);
        } catch (const GrammarError& e) {
          fail(e.what(), at);
        }
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
    pos_ = at;  // UTF-8 (the text came in a JSON string: valid, but checked anyway)
    try {
      return next_code_point(s_, pos_);
    } catch (const GrammarError& e) {
      fail(e.what(), at);
    }
  }

  uint32_t parse_hex(int digits, size_t at) {
    try {
      return hex_code_point(s_, pos_, digits);
    } catch (const GrammarError& e) {
      fail(e.what(), at);
    }
  }


  Expr parse_literal() {
    const size_t at = pos_++;
    std::string bytes;
    while (true) {
      if (pos_ >= s_.size() || s_[pos_] == '\n') fail("an unterminated string", at);
      if (s_[pos_] == '"') break;
      bytes += utf8_bytes(parse_char());
    }
    ++pos_;
    return Grammar::literal(bytes);
  }

  Expr parse_class() {
    const size_t at = pos_++;
    const bool negate = pos_ < s_.size() && s_[pos_] == '^';
    if (negate) ++pos_;
    CodePointRanges ranges;
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
      return code_point_class(ranges, negate);
    } catch (const GrammarError& e) {
      fail(e.what(), at);
    }
  }

  std::string_view s_;
  size_t pos_ = 0;
  int depth_ = 0;  // groups open (kMaxNesting)
  Grammar g_;
  std::map<std::string, int> rules_;    // name -> rule (root: 0)
  std::set<std::string> defined_;
  std::map<std::string, size_t> used_;  // name -> where first named
};

}  // namespace

Grammar gbnf_grammar(std::string_view text) { return Parser(text).parse(); }

}  // namespace disagg::grammar
