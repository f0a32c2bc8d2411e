#include "grammar/regex.h"

#include <cstdio>
#include <string>
#include <vector>

#include "grammar/code_points.h"
#include "grammar/gbnf.h"

namespace disagg::grammar {

namespace {

// The shorthand classes, ASCII: what Python's (Unicode) and ECMAScript's
// classes agree on. Their negations (\D, \W, \S, and a negated [...]
// that holds one) are ASCII too, so that every text written matches under
// both engines: Python's \s takes \x1c-\x1f and Unicode spaces, so \S
// takes neither.
const CodePointRanges kDigit = {{'0', '9'}};
const CodePointRanges kWord = {{'0', '9'}, {'A', 'Z'}, {'a', 'z'}, {'_', '_'}};
const CodePointRanges kSpace = {{' ', ' '}, {'\t', '\r'}};  // \t \n \v \f \r
const CodePointRanges kNotSpaceAnywhere = {{' ', ' '}, {'\t', '\r'}, {0x1C, 0x1F}};
const CodePointRanges kAscii = {{0, 0x7F}};
// A JSON string's body writes these unescaped (JSON: not '"', '\\' or a
// control character).
const CodePointRanges kJsonPlain = {{0x20, 0x21}, {0x23, 0x5B}, {0x5D, kMaxCodePoint}};

// The JSON escape of a code point JSON does not write as itself.
std::string json_escape(uint32_t cp) {
  switch (cp) {
    case '"': return "\\\"";
    case '\\': return "\\\\";
    case '\n': return "\\n";
    case '\r': return "\\r";
    case '\t': return "\\t";
    case '\b': return "\\b";
    case '\f': return "\\f";
    default: {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", unsigned(cp));
      return buf;
    }
  }
}

enum class Dialect {
  python_text,   // guided_regex: Python's re, the output as it is, '.' all but \n
  ecma_json,     // a JSON Schema pattern: ECMAScript, the value inside a JSON string's body
};

class RegexParser {
 public:
  RegexParser(Grammar& g, std::string_view p, Dialect dialect) : g_(g), p_(p), dialect_(dialect) {}

  struct Result {
    Expr e;
    bool anchored_start = false, anchored_end = false;
  };
  Result parse() {
    Result r;
    if (!p_.empty() && p_[0] == '^') ++pos_, r.anchored_start = true;
    r.e = parse_alternates();
    if (pos_ < p_.size()) fail(p_[pos_] == ')' ? "an unmatched ')'" : "unexpected '" + std::string(1, p_[pos_]) + "'");
    r.anchored_end = anchored_end_;
    return r;
  }

 private:
  [[noreturn]] void fail(const std::string& what, size_t at = std::string_view::npos) const {
    throw GrammarError("at offset " + std::to_string(at == std::string_view::npos ? pos_ : at) + ": " + what);
  }

  bool at_end_anchor() const { return pos_ + 1 == p_.size() && p_[pos_] == '$'; }

  Expr parse_alternates() {
    std::vector<Expr> alternatives{parse_sequence()};
    while (pos_ < p_.size() && p_[pos_] == '|') {
      ++pos_;
      alternatives.push_back(parse_sequence());
    }
    return alternatives.size() == 1 ? alternatives[0] : Grammar::alt(alternatives);
  }

  Expr parse_sequence() {
    std::vector<Expr> items;
    while (pos_ < p_.size() && p_[pos_] != '|' && p_[pos_] != ')') {
      if (at_end_anchor()) {
        ++pos_;
        anchored_end_ = true;
        break;
      }
      Expr atom = parse_atom();
      atom = parse_quantifiers(atom);
      if (g_.symbol_count() > kMaxSymbols) fail("the grammar is larger than " + std::to_string(kMaxSymbols) + " symbols");
      items.push_back(std::move(atom));
    }
    return items.empty() ? Grammar::empty() : items.size() == 1 ? items[0] : g_.seq(items);
  }

  Expr parse_atom() {
    const size_t at = pos_;
    const char c = p_[pos_];
    if (c == '(') {
      ++pos_;
      if (p_.substr(pos_, 2) == "?:") {
        pos_ += 2;
      } else if (p_.substr(pos_, 3) == "?P<" || (p_.substr(pos_, 2) == "?<" && p_.substr(pos_, 3) != "?<=" &&
                                                 p_.substr(pos_, 3) != "?<!")) {
        const size_t close = p_.find('>', pos_);
        if (close == std::string_view::npos) fail("an unterminated group name", at);
        pos_ = close + 1;
      } else if (pos_ < p_.size() && p_[pos_] == '?') {
        fail("lookaround and other (?...) groups are not regular: unsupported", at);
      }
      if (++depth_ > kMaxNesting) fail("groups nested deeper than " + std::to_string(kMaxNesting), at);
      const Expr inner = parse_alternates();
      --depth_;
      if (pos_ >= p_.size() || p_[pos_] != ')') fail("a '(' that is never closed", at);
      ++pos_;
      return inner;
    }
    if (c == '[') return parse_class();
    if (c == '.') {
      ++pos_;
      // (ECMAScript's '.' takes no line terminator; Python's no \n)
      if (dialect_ == Dialect::ecma_json) return class_of({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}, true);
      return class_of({{'\n', '\n'}}, true);
    }
    if (c == '^' || c == '$') fail(std::string("an anchor '") + c + "' inside the pattern: unsupported", at);
    if (c == '*' || c == '+' || c == '?') fail(std::string("nothing to repeat before '") + c + "'", at);
    if (c == '\\') {
      CodePointRanges set;
      const uint32_t cp = parse_escape(set, false);
      if (!set.empty()) return cp == 1 ? class_of(intersection(normalized(set, true), kAscii), false) : class_of(set, false);
      return literal_of(cp);
    }
    return literal_of(parse_utf8());
  }

  // One code point as the target writes it.
  Expr literal_of(uint32_t cp) const {
    if (dialect_ == Dialect::ecma_json && !contains(kJsonPlain, cp)) return Grammar::literal(json_escape(cp));
    return Grammar::literal(utf8_bytes(cp));
  }

  // Any one code point of a class, as the target writes it.
  Expr class_of(const CodePointRanges& ranges, bool negate) const {
    if (dialect_ != Dialect::ecma_json) return code_point_class(ranges, negate);
    const CodePointRanges set = normalized(ranges, negate);
    std::vector<Expr> options;
    const CodePointRanges plain = intersection(set, kJsonPlain);
    if (!plain.empty()) options.push_back(code_point_class(plain, false));
    for (uint32_t cp = 0; cp <= '\\'; ++cp)
      if (!contains(kJsonPlain, cp) && contains(set, cp)) options.push_back(Grammar::literal(json_escape(cp)));
    if (options.empty()) throw GrammarError("a character class that admits no character");
    return Grammar::alt(options);
  }

  // After a backslash: a code point (returned), or a class in `set` (then
  // the return says whether it is negated: 1, or 0).
  uint32_t parse_escape(CodePointRanges& set, bool in_class) {
    const size_t at = pos_++;
    if (pos_ >= p_.size()) fail("a '\\' at the end of the pattern", at);
    const char e = p_[pos_++];
    switch (e) {
      case 'd': set = kDigit; return 0;
      case 'D': set = kDigit; return 1;
      case 'w': set = kWord; return 0;
      case 'W': set = kWord; return 1;
      case 's': set = kSpace; return 0;
      case 'S': set = kNotSpaceAnywhere; return 1;
      case 'n': return '\n';
      case 't': return '\t';
      case 'r': return '\r';
      case 'f': return '\f';
      case 'v': return '\v';
      case '0': return 0;
      case 'x': return parse_hex(2, at);
      case 'u': return parse_hex(4, at);
      case 'U': return parse_hex(8, at);
      case 'b':
        if (in_class) return '\b';
        fail("a word boundary \\b is not regular here: unsupported", at);
      default:
        if ((e >= '1' && e <= '9') || e == 'k') fail("a backreference is not regular: unsupported", at);
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) fail(std::string("unknown escape \\") + e, at);
        --pos_;
        return parse_utf8();  // \ before punctuation (or any other character): itself
    }
  }

  uint32_t parse_hex(int digits, size_t at) {
    try {
      return hex_code_point(p_, pos_, digits);
    } catch (const GrammarError& e) {
      fail(e.what(), at);
    }
  }


  // One code point as UTF-8 at pos_ (the pattern came in a JSON string:
  // valid, but checked anyway).
  uint32_t parse_utf8() {
    const size_t at = pos_;
    try {
      return next_code_point(p_, pos_);
    } catch (const GrammarError& e) {
      fail(e.what(), at);
    }
  }


  Expr parse_class() {
    const size_t at = pos_++;
    const bool negate = pos_ < p_.size() && p_[pos_] == '^';
    if (negate) ++pos_;
    CodePointRanges ranges;
    bool first = true, shorthand = false;
    while (true) {
      if (pos_ >= p_.size()) fail("a '[' that is never closed", at);
      if (p_[pos_] == ']' && !first) break;
      first = false;
      uint32_t lo;
      if (p_[pos_] == '\\') {
        CodePointRanges set;
        lo = parse_escape(set, true);
        if (!set.empty()) {
          if (lo == 1) fail("a negated class escape (\\D, \\W, \\S) inside a class: unsupported", at);
          ranges.insert(ranges.end(), set.begin(), set.end());
          shorthand = true;
          continue;
        }
      } else {
        lo = parse_utf8();
      }
      uint32_t hi = lo;
      if (pos_ + 1 < p_.size() && p_[pos_] == '-' && p_[pos_ + 1] != ']') {
        ++pos_;
        CodePointRanges set;
        hi = p_[pos_] == '\\' ? parse_escape(set, true) : parse_utf8();
        if (!set.empty()) fail("a class escape as the end of a range", at);
        if (hi < lo) fail("a character range whose end comes before its start", at);
      }
      ranges.push_back({lo, hi});
    }
    ++pos_;
    try {
      // (negated with a shorthand inside: ASCII, as \D, \W and \S)
      if (negate && shorthand) return class_of(intersection(normalized(ranges, true), kAscii), false);
      return class_of(ranges, negate);
    } catch (const GrammarError& e) {
      fail(e.what(), at);
    }
  }

  Expr parse_quantifiers(Expr atom) {
    while (pos_ < p_.size()) {
      const size_t at = pos_;
      const char c = p_[pos_];
      int min = 0, max = -1;
      if (c == '*') {
        ++pos_;
      } else if (c == '+') {
        ++pos_, min = 1;
      } else if (c == '?') {
        ++pos_, max = 1;
      } else if (c == '{' && braces(min, max)) {
        // (parsed)
      } else {
        break;
      }
      if (pos_ < p_.size() && p_[pos_] == '?') ++pos_;  // lazy: the same language
      else if (pos_ < p_.size() && p_[pos_] == '+') fail("a possessive quantifier: unsupported", at);
      try {
        atom = max == 1 && min == 0 ? g_.optional(atom) : g_.repeat(atom, min, max);
      } catch (const GrammarError& e) {
        fail(e.what(), at);
      }
    }
    return atom;
  }

  // {m}, {m,}, {m,n} (and in Python's dialect {,n}) at pos_ (true,
  // consumed), or false: a '{' that is itself (as Python reads "{" not
  // followed by a bound).
  bool braces(int& min, int& max) {
    size_t i = pos_ + 1;
    auto number = [&](int& out) {
      const size_t begin = i;
      long long v = 0;
      while (i < p_.size() && p_[i] >= '0' && p_[i] <= '9') {
        v = v * 10 + (p_[i++] - '0');
        if (v > kMaxRepeat) fail("a repetition count past " + std::to_string(kMaxRepeat), pos_);
      }
      out = int(v);
      return i > begin;
    };
    if (!number(min)) {
      // Python reads {,n} as {0,n} (and {,} as {0,}); ECMAScript as text.
      if (dialect_ != Dialect::python_text || i >= p_.size() || p_[i] != ',') return false;
      min = 0;
    }
    max = min;
    if (i < p_.size() && p_[i] == ',') {
      ++i;
      if (!number(max)) max = -1;
    }
    if (i >= p_.size() || p_[i] != '}') return false;
    if (max >= 0 && max < min) fail("a repetition {m,n} with n < m", pos_);
    pos_ = i + 1;
    return true;
  }

  Grammar& g_;
  std::string_view p_;
  Dialect dialect_;
  size_t pos_ = 0;
  int depth_ = 0;  // groups open (kMaxNesting)
  bool anchored_end_ = false;
};

}  // namespace

Grammar regex_grammar(std::string_view pattern) {
  Grammar g;
  g.define(0, RegexParser(g, pattern, Dialect::python_text).parse().e);
  g.check();
  return g;
}

Expr json_pattern_body(Grammar& g, std::string_view pattern, const Expr& any_char) {
  const RegexParser::Result r = RegexParser(g, pattern, Dialect::ecma_json).parse();
  std::vector<Expr> parts;
  if (!r.anchored_start) parts.push_back(g.star(any_char));  // a search: anywhere in the value
  parts.push_back(r.e);
  if (!r.anchored_end) parts.push_back(g.star(any_char));
  return g.seq(parts);
}

}  // namespace disagg::grammar
