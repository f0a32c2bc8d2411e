// GBNF, llama.cpp's grammar notation (its grammars/README.md), compiled
// into a Grammar: what vLLM's `guided_grammar` and llama.cpp's `grammar`
// request fields carry.
//
//   root   ::= answer ws "." ws      # rules: name ::= alternatives; `root` is the start
//   answer ::= "yes" | "no" | num    # "literals" with \n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH
//   num    ::= [1-9] [0-9]{0,5}      # [classes] of code points ([^...] negated), ranges a-z
//   ws     ::= ([ \t\n] ws)?         # ( groups ), postfix * + ? {m} {m,} {m,n}; . any character
//
// As in llama.cpp: names are [a-zA-Z0-9_-]+, a newline ends a rule except
// inside parentheses or after a `|`, and # starts a comment. Literals and
// classes are over Unicode code points, spelled out as UTF-8 (a class never
// admits a surrogate or anything past U+10FFFF); `.` is any one code point.
// Errors (GrammarError) name the line and column: a rule defined twice or
// never defined, no root, a bound past kMaxRepeat, left recursion (as
// Grammar::check), past the grammar's size limits.
#pragma once
#include <string_view>

#include "grammar/grammar.h"

namespace disagg::grammar {

// The largest m or n of a {m,n} repetition (each copy is spelled out).
constexpr int kMaxRepeat = 1000;

Grammar gbnf_grammar(std::string_view text);

}  // namespace disagg::grammar
