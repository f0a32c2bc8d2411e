// GBNF -> grammar (grammar/gbnf.h): texts each grammar must take or refuse,
// character classes checked code point by code point against their
// definition (all of Unicode), and every malformed grammar refused with
// the line and column of its fault.
#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

#include "grammar/code_points.h"
#include "grammar/gbnf.h"
#include "grammar/grammar_texts.h"
#include "grammar/matcher.h"

namespace disagg::grammar {
namespace {

void expect_texts(const std::string& gbnf, const std::vector<std::string>& good, const std::vector<std::string>& bad) {
  CompiledGrammar c(gbnf_grammar(gbnf), stories_vocabulary());
  for (const auto& t : good) EXPECT_TRUE(takes(c, t)) << gbnf << "\nshould take: " << t;
  for (const auto& t : bad) EXPECT_FALSE(takes(c, t)) << gbnf << "\nshould refuse: " << t;
}

TEST(Gbnf, RulesSequencesAlternativesAndRepetitions) {
  expect_texts(R"(root ::= "yes" | "no")", {"yes", "no"}, {"", "y", "yesno", "No"});
  // Rules in any order, references, groups, * + ? and comments.
  expect_texts(R"(# a sum of numbers
root ::= num (ws "+" ws num)*   # at least one
num  ::= "-"? [1-9] [0-9]* | "0"
ws   ::= [ \t]*)",
               {"1", "0", "-12 + 3", "7+0+   -40", "10\t+\t2"}, {"", "01", "1 +", "+1", "1 + + 2", "-0"});
  expect_texts(R"(root ::= "a"+ "b"?)", {"a", "aaa", "ab", "aaab"}, {"", "b", "abb"});
  expect_texts(R"(root ::= [a-c]{2} [0-9]{1,3} "x"{0,} "y"{2,})",
               {"ab1yy", "cc123xxxyyy", "aa0xyy"}, {"a1yy", "ab1234yy", "ab1y", "ab yy"});
  // A newline ends a rule, except in parentheses or after '|'.
  expect_texts("root ::= (\n  \"a\"\n  | \"b\"\n) \"c\" |\n  \"d\"\n", {"ac", "bc", "d"}, {"a", "c", "dc"});
  // Escapes in literals and classes; an empty alternative.
  expect_texts(R"(root ::= "\"\\\n\x41\u00e9\U0001F600" [\]\-x]? | )",
               {"\"\\\nA\xC3\xA9\xF0\x9F\x98\x80", "\"\\\nA\xC3\xA9\xF0\x9F\x98\x80]", "\"\\\nA\xC3\xA9\xF0\x9F\x98\x80-", ""},
               {"\"\\\nA\xC3\xA9\xF0\x9F\x98\x80y", "x"});
  // Recursion (not left recursion): balanced parentheses.
  expect_texts(R"g(root ::= item*
item ::= "(" root ")")g",
               {"", "()", "(())()", "((()()))"}, {"(", ")(", "(()"});
}

// A class takes exactly its code points, each as its UTF-8, over all of
// Unicode; never a surrogate, an overlong form or a stray byte.
TEST(Gbnf, ClassesTakeExactlyTheirCodePoints) {
  struct Case {
    std::string gbnf;
    bool (*in)(uint32_t);
  };
  const Case cases[] = {
      {R"(root ::= [a-zA-Z_\u00e0-\u00ff])",
       [](uint32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (c >= 0xE0 && c <= 0xFF); }},
      {R"(root ::= [^"\\\x00-\x1f])", [](uint32_t c) { return c != '"' && c != '\\' && c > 0x1F; }},
      {R"(root ::= [\u07ff-\u0801\uffff-\U00010001\U0010fffe-\U0010ffff\ud7ff-\ue000])",
       [](uint32_t c) {
         return (c >= 0x7FF && c <= 0x801) || (c >= 0xFFFF && c <= 0x10001) || c >= 0x10FFFE || c == 0xD7FF || c == 0xE000;
       }},
      {"root ::= .", [](uint32_t) { return true; }},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.gbnf);
    CompiledGrammar c(gbnf_grammar(k.gbnf), stories_vocabulary());
    size_t wrong = 0;
    for (uint32_t cp = 0; cp <= 0x10FFFF; ++cp) {
      if (cp >= 0xD800 && cp <= 0xDFFF) continue;
      if (takes(c, utf8_bytes(cp)) != k.in(cp) && ++wrong <= 5) ADD_FAILURE() << "code point " << std::hex << cp;
    }
    EXPECT_EQ(wrong, 0u);
    for (const char* bad : {"\xED\xA0\x80", "\xED\xBF\xBF", "\xC0\x80", "\xC1\xBF", "\xE0\x80\x80", "\xF0\x80\x80\x80",
                            "\xF4\x90\x80\x80", "\x80", "\xFF", "\xC3"})
      EXPECT_FALSE(takes(c, bad)) << "bytes " << std::hex << int(uint8_t(bad[0]));
  }
}

// The shared model sampling under a GBNF grammar: every output that ends
// (the grammar complete, then an end token) is a sentence of the grammar, as
// std::regex, an independent recognizer, reads the same language.
TEST(Gbnf, TheModelWritesOnlyWhatTheGrammarAllows) {
  const std::string gbnf = R"(root ::= "Once upon a time" ("," | " there was") " a " word (" " word){2,8} "."
word ::= [a-z]+)";
  const std::regex language("Once upon a time(,| there was) a [a-z]+( [a-z]+){2,8}\\.");
  const std::vector<std::string> texts = model_texts_under(gbnf_grammar(gbnf), 6);
  EXPECT_GE(texts.size(), 3u);
  for (const std::string& text : texts) EXPECT_TRUE(std::regex_match(text, language)) << text;
}

// Sizes a short text could ask for that the checks of its rules do not see:
// symbols that may match nothing, in a row (each one closure call deeper,
// and n of them n^2 / 2 closure entries), and repetitions spelled out before
// a rule holds them.
TEST(Gbnf, WhatAShortTextWouldBlowUpIsRefused) {
  auto row = [](int n) {
    std::string text = "root ::=";
    for (int i = 0; i < n; ++i) text += " x";
    return text + "\nx ::= \"a\"?\n";
  };
  expect_texts(row(100), {"", "aaa", std::string(100, 'a')}, {std::string(101, 'a'), "b"});
  try {
    CompiledGrammar c(gbnf_grammar(row(10000)), stories_vocabulary());
    ADD_FAILURE() << "10,000 symbols that may match nothing in a row compiled";
  } catch (const GrammarError& e) {
    EXPECT_NE(std::string(e.what()).find("may match nothing in a row"), std::string::npos) << e.what();
  }
  std::string spelled = "root ::=";
  for (int i = 0; i < 5; ++i) spelled += " (\"a\"{1000}){1000}";
  try {
    gbnf_grammar(spelled);
    ADD_FAILURE() << "five repetitions of a million symbols each compiled";
  } catch (const GrammarError& e) {
    EXPECT_NE(std::string(e.what()).find("repetitions spell out more than"), std::string::npos) << e.what();
  }
}

TEST(Gbnf, MalformedGrammarsAreRefusedWithTheirPlace) {
  expect_refused([](const std::string& source) { return gbnf_grammar(source); }, {
      {"root ::= answer", "line 1, column 10: rule 'answer' is used but never defined"},
      {"a ::= \"x\"", "no rule 'root'"},
      {"root ::= \"a\"\nroot ::= \"b\"", "line 2, column 1: rule 'root' is defined twice"},
      {"root ::= \"a", "line 1, column 10: an unterminated string"},
      {"root ::= [a-", "an unterminated character class"},
      {"root ::= [z-a]", "a character range whose end comes before its start"},
      {R"(root ::= "\q")", "unknown escape"},
      {R"(root ::= "\ud800")", "an escape that is no character"},
      {"root ::= (\"a\"", "line 1, column 10: expected ')' to close the group"},
      {"root ::= " + std::string(300, '(') + "\"a\"" + std::string(300, ')'), "groups nested deeper than 256"},
      {"root = \"a\"", "expected '::=' after the rule name 'root'"},
      {"root ::= \"a\" )", "line 1, column 14: unexpected ')'"},
      {"root ::= \"a\"{3,1}", "n < m"},
      {"root ::= \"a\"{1001}", "a repetition count past 1000"},
      {"root ::= ((\"abcdefgh\"{1000}){1000})", "more than"},
      {"root ::= root \"a\"", "left-recursive"},
      {"root ::= (\"a\"?)*", "left-recursive"},
      {"root ::= [^\\x00-\\U0010ffff]", "a character class that admits no character"},
  });
}

}  // namespace
}  // namespace disagg::grammar
