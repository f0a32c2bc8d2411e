// Regular expressions -> grammar (grammar/regex.h): the grammar takes a
// text exactly when std::regex (ECMAScript, an independent matcher) matches
// it whole, over every text up to 5 characters of a small alphabet and a
// set of patterns; the model sampling under a pattern writes only matches;
// what is not regular is refused by name.
#include <gtest/gtest.h>

#include <regex>
#include <string>
#include <vector>

#include "grammar/grammar_texts.h"
#include "grammar/matcher.h"
#include "grammar/regex.h"

namespace disagg::grammar {
namespace {

TEST(Regex, TakesWhatStdRegexMatchesWhole) {
  // Patterns in the syntax Python's re and ECMAScript share (the alphabet
  // has no \r: ECMAScript's '.' also refuses it, Python's takes it).
  const std::vector<std::string> patterns = {
      "a|b", "ab*", "(ab)+", "a?b{2}", "[ab]{1,3}", "[^a]*", "\\d+(\\.\\d{1,2})?", "\\w+", "\\s?\\S+", "(a|b0)*_",
      "(?:a|)b", ".{2,}", "a.b", "[\\d_-]+", "^a+$", "[-a]b?", "a{2,}b*?", "(a|ab)(c|bcd)?", "[.]\\.", "0{0}a",
  };
  const std::string alphabet = "ab01_ -.\n";
  std::vector<std::string> texts = {""};
  for (size_t i = 0; i < texts.size(); ++i)
    if (texts[i].size() < 5)
      for (char ch : alphabet) texts.push_back(texts[i] + ch);
  for (const std::string& pattern : patterns) {
    SCOPED_TRACE(pattern);
    CompiledGrammar c(regex_grammar(pattern), stories_vocabulary());
    const std::regex reference(pattern, std::regex::ECMAScript);
    size_t wrong = 0;
    for (const std::string& t : texts)
      if (takes(c, t) != std::regex_match(t, reference) && ++wrong <= 3)
        ADD_FAILURE() << "text \"" << t << "\": grammar " << takes(c, t) << ", std::regex " << std::regex_match(t, reference);
    EXPECT_EQ(wrong, 0u) << "of " << texts.size() << " texts";
  }
}

TEST(Regex, ClassesAndEscapesOverUnicode) {
  CompiledGrammar c(regex_grammar("[α-γ]\\u00e9[^\\x00-\\x7f]\\U0001F600(?P<n>x)(?<m>y)"), stories_vocabulary());
  EXPECT_TRUE(takes(c, "β\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80xy"));
  EXPECT_FALSE(takes(c, "δ\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80xy"));
  EXPECT_FALSE(takes(c, "β\xC3\xA9" "a\xF0\x9F\x98\x80xy"));
  EXPECT_FALSE(takes(c, "β\xC3\xA9\xED\xA0\x80\xF0\x9F\x98\x80xy"));  // a surrogate is no character
}

// The shared model sampling under a pattern writes only whole matches.
TEST(Regex, TheModelWritesOnlyMatches) {
  const std::string pattern = "Once upon a time, (a|the) [a-z]+( [a-z]+){1,6}\\.";
  const std::regex reference(pattern);
  const std::vector<std::string> texts = model_texts_under(regex_grammar(pattern), 6);
  EXPECT_GE(texts.size(), 3u);
  for (const std::string& text : texts) EXPECT_TRUE(std::regex_match(text, reference)) << text;
}

// Python reads {,n} as {0,n} and {,} as {0,} (and "{" without a bound as
// itself).
TEST(Regex, ABoundWithoutItsMinimumStartsAtZero) {
  CompiledGrammar upto(regex_grammar("a{,3}b"), stories_vocabulary());
  for (const char* t : {"b", "ab", "aaab"}) EXPECT_TRUE(takes(upto, t)) << t;
  for (const char* t : {"aaaab", "a{,3}b"}) EXPECT_FALSE(takes(upto, t)) << t;
  CompiledGrammar any(regex_grammar("a{,}b"), stories_vocabulary());
  for (const char* t : {"b", "aaaaaaab"}) EXPECT_TRUE(takes(any, t)) << t;
  CompiledGrammar text(regex_grammar("a{x}"), stories_vocabulary());
  EXPECT_TRUE(takes(text, "a{x}"));
}

TEST(Regex, WhatIsNotRegularOrNotSupportedIsRefusedByName) {
  expect_refused([](const std::string& source) { return regex_grammar(source); }, {
      {"(a)\\1", "at offset 3: a backreference"},
      {"a(?=b)", "lookaround"},
      {"\\bword", "word boundary"},
      {"a^b", "an anchor '^' inside the pattern"},
      {"a$b", "an anchor '$' inside the pattern"},
      {"a++", "possessive"},
      {"*a", "nothing to repeat"},
      {"(ab", "never closed"},
      {"ab)", "an unmatched ')'"},
      {"[ab", "never closed"},
      {"[z-a]", "end comes before its start"},
      {"a{3,1}", "n < m"},
      {"a{1001}", "past 1000"},
      {"((a{1000}){1000}){1000}", "more than"},
      {"\\q", "unknown escape"},
      {"(a*)*", "left-recursive"},
      {std::string(300, '(') + "a" + std::string(300, ')'), "at offset 256: groups nested deeper than 256"},
  });
}

}  // namespace
}  // namespace disagg::grammar
