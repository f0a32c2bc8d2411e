// Unicode code points as the grammar's bytes: a character class (sets of
// code point ranges, perhaps negated) spelled out as UTF-8 byte sequences,
// for the notations that speak in characters (GBNF, regular expressions).
// A class never admits a surrogate (U+D800-DFFF) or anything past
// U+10FFFF, and each code point only in its shortest UTF-8 form.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "grammar/grammar.h"

namespace disagg::grammar {

constexpr uint32_t kMaxCodePoint = 0x10FFFF;
constexpr uint32_t kSurrogateFirst = 0xD800, kSurrogateLast = 0xDFFF;

using CodePointRanges = std::vector<std::pair<uint32_t, uint32_t>>;  // inclusive, any order, may overlap

// `cp` (<= kMaxCodePoint) as UTF-8.
std::string utf8_bytes(uint32_t cp);

// The code point whose UTF-8 starts at text[pos], pos moved past it.
// Throws GrammarError("not UTF-8").
uint32_t next_code_point(std::string_view text, size_t& pos);

// One character JSON writes unescaped in a string (not '"', '\\' or a
// control character: printable ASCII, or a multi-byte UTF-8 sequence as RFC
// 3629 allows), as its byte forms: each a sequence of byte sets, no two
// forms sharing a first byte. JSON's grammar (json_grammar.h) spells its
// strings' characters with them, and a vocabulary (matcher.h) finds its
// tokens of such characters alone by them: one owner of the class.
using ByteForm = std::vector<ByteSet>;
const std::vector<ByteForm>& plain_char_forms();

// `digits` hex digits at text[pos] as a code point, pos moved past them.
// Throws GrammarError: too few digits, a non-hex digit, a surrogate or
// past U+10FFFF.
uint32_t hex_code_point(std::string_view text, size_t& pos, int digits);

// `ranges` sorted, merged and without surrogates (`negate`: every other
// code point instead).
CodePointRanges normalized(const CodePointRanges& ranges, bool negate);

// The code points in both (each normalized).
CodePointRanges intersection(const CodePointRanges& a, const CodePointRanges& b);

bool contains(const CodePointRanges& normalized_ranges, uint32_t cp);

// Any one code point of `ranges` (`negate`: of every other code point), as
// UTF-8. Throws GrammarError when that is no code point at all.
Expr code_point_class(const CodePointRanges& ranges, bool negate);

}  // namespace disagg::grammar
