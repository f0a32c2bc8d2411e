// A regular expression as a grammar whose sentences are exactly the texts
// it matches whole: vLLM's `guided_regex` (Outlines matches the whole
// output too). The syntax is Python's `re` (and ECMAScript's) where they
// describe a regular language:
//
//   a|b  ab  (x)  (?:x)  (?P<name>x)  (?<name>x)    alternation, sequence, groups
//   x*  x+  x?  x{m}  x{m,}  x{m,n}  (a ? after one: lazy, the same language)
//   .  (any code point but \n)   [a-z_]  [^"\\]    classes of code points
//   \d \w \s \D \W \S  (ASCII: [0-9], [A-Za-z0-9_], [ \t\n\r\f\v])
//   \n \t \r \f \v \0 \xHH \uHHHH \U00HHHHHH, and \ before any punctuation
//   ^ at the start and $ at the end (no-ops: the whole text matches anyway)
//
// Anything that is not regular or not supported is a GrammarError that
// names it and its offset: backreferences, lookaround, \b, anchors
// elsewhere, possessive quantifiers, a repetition of something that can
// match the empty text, a bound past kMaxRepeat (grammar/gbnf.h).
#pragma once
#include <string_view>

#include "grammar/grammar.h"

namespace disagg::grammar {

Grammar regex_grammar(std::string_view pattern);

// The body of a JSON string (between its quotes, escaped as JSON) whose
// value a JSON Schema `pattern` matches: ECMAScript's syntax (the same
// subset; '.' takes no line terminator), a search (the match may lie
// anywhere in the value unless ^ / $ anchor it; `any_char`, one character of
// a string's body, fills the rest). Each code point the value holds is
// written as itself, or escaped where JSON must ('"', '\\', controls).
Expr json_pattern_body(Grammar& g, std::string_view pattern, const Expr& any_char);

}  // namespace disagg::grammar
