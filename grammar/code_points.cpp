#include "grammar/code_points.h"

#include <algorithm>

namespace disagg::grammar {

std::string utf8_bytes(uint32_t cp) {
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

uint32_t next_code_point(std::string_view text, size_t& pos) {
  const size_t at = pos;
  const auto c = uint8_t(text[pos++]);
  if (c < 0x80) return c;
  const int length = c >= 0xF8 ? 0 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
  if (length == 0 || at + size_t(length) > text.size()) throw GrammarError("not UTF-8");
  uint32_t cp = c & (0xFF >> (length + 1));
  for (int i = 1; i < length; ++i) {
    const auto b = uint8_t(text[pos++]);
    if ((b & 0xC0) != 0x80) throw GrammarError("not UTF-8");
    cp = cp << 6 | (b & 0x3F);
  }
  return cp;
}

const std::vector<ByteForm>& plain_char_forms() {
  static const std::vector<ByteForm> forms = [] {
    const ByteSet tail = ByteSet::range(0x80, 0xBF);
    return std::vector<ByteForm>{
        {ByteSet().add(0x20, 0x21).add(0x23, 0x5B).add(0x5D, 0x7E)},
        {ByteSet::range(0xC2, 0xDF), tail},
        {ByteSet::of(0xE0), ByteSet::range(0xA0, 0xBF), tail},
        {ByteSet().add(0xE1, 0xEC).add(0xEE, 0xEF), tail, tail},
        {ByteSet::of(0xED), ByteSet::range(0x80, 0x9F), tail},
        {ByteSet::of(0xF0), ByteSet::range(0x90, 0xBF), tail, tail},
        {ByteSet::range(0xF1, 0xF3), tail, tail, tail},
        {ByteSet::of(0xF4), ByteSet::range(0x80, 0x8F), tail, tail},
    };
  }();
  return forms;
}

uint32_t hex_code_point(std::string_view text, size_t& pos, int digits) {
  uint32_t v = 0;
  for (int i = 0; i < digits; ++i) {
    if (pos >= text.size()) throw GrammarError("a short hex escape");
    const char h = text[pos++];
    const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10 : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
    if (d < 0) throw GrammarError("a hex escape with a non-hex digit");
    v = v << 4 | uint32_t(d);
  }
  if (v > kMaxCodePoint || (v >= kSurrogateFirst && v <= kSurrogateLast)) throw GrammarError("an escape that is no character");
  return v;
}

namespace {

using Ranges = CodePointRanges;

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
  const std::string a = utf8_bytes(lo), b = utf8_bytes(hi);
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

}  // namespace

Expr code_point_class(const CodePointRanges& ranges, bool negate) { return utf8_class(normalize(ranges, negate)); }

CodePointRanges normalized(const CodePointRanges& ranges, bool negate) { return normalize(ranges, negate); }

CodePointRanges intersection(const CodePointRanges& a, const CodePointRanges& b) {
  CodePointRanges out;
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const uint32_t lo = std::max(a[i].first, b[j].first), hi = std::min(a[i].second, b[j].second);
    if (lo <= hi) out.push_back({lo, hi});
    if (a[i].second < b[j].second) ++i;
    else ++j;
  }
  return out;
}

bool contains(const CodePointRanges& normalized_ranges, uint32_t cp) {
  for (const auto& [lo, hi] : normalized_ranges)
    if (cp >= lo && cp <= hi) return true;
  return false;
}

}  // namespace disagg::grammar
