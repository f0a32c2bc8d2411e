// Each family's tool-call syntax parsed from fixed texts (a model with random
// weights never writes one by itself): the calls, the content around them,
// and text that only looks like a call staying content.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "text/tool_calls.h"

namespace disagg::gpu {
namespace {

using json = nlohmann::json;

void expect_calls(const ParsedOutput& out, const std::vector<std::pair<std::string, json>>& calls) {
  ASSERT_EQ(out.calls.size(), calls.size()) << out.content;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(out.calls[i].name, calls[i].first);
    EXPECT_EQ(json::parse(out.calls[i].arguments), calls[i].second);
  }
}

TEST(ToolCalls, Llama3JsonCallsWithAndWithoutThePythonTag) {
  expect_calls(parse_tool_calls(ToolSyntax::llama3, R"({"name": "get_weather", "parameters": {"city": "Paris"}})"),
               {{"get_weather", {{"city", "Paris"}}}});
  const ParsedOutput tagged = parse_tool_calls(
      ToolSyntax::llama3, "Let me look.<|python_tag|>{\"name\": \"a\", \"arguments\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}");
  expect_calls(tagged, {{"a", {{"x", 1}}}, {"b", json::object()}});
  EXPECT_EQ(tagged.content, "Let me look.");
  // Braces inside strings do not end the object early.
  expect_calls(parse_tool_calls(ToolSyntax::llama3, R"({"name": "echo", "parameters": {"text": "} {"}})"),
               {{"echo", {{"text", "} {"}}}});
  // A name alone is a call without arguments; a name among other data is none.
  expect_calls(parse_tool_calls(ToolSyntax::llama3, R"({"name": "now"})"), {{"now", json::object()}});
  expect_calls(parse_tool_calls(ToolSyntax::llama3, R"({"name": "a", "arguments": {}};{"name": "b"} {"name": "c", "parameters": {"y": 2}})"),
               {{"a", json::object()}, {"b", json::object()}, {"c", {{"y", 2}}}});
  for (const char* content : {"The answer is {42}.", R"({"no_name": 1})", R"({"name": "x", "parameters": [1]})", "plain text",
                              R"({"name": "Bob", "age": 3})"}) {
    const ParsedOutput out = parse_tool_calls(ToolSyntax::llama3, content);
    EXPECT_TRUE(out.calls.empty()) << content;
    EXPECT_EQ(out.content, content);
  }
}

TEST(ToolCalls, HermesAndQwenToolCallTags) {
  const ParsedOutput out = parse_tool_calls(
      ToolSyntax::hermes,
      "I will call two tools.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"disagg\"}}\n</tool_call>\n"
      "<tool_call>\n{\"name\": \"fetch\", \"arguments\": \"{\\\"url\\\": \\\"u\\\"}\"}\n</tool_call>");
  expect_calls(out, {{"search", {{"q", "disagg"}}}, {"fetch", {{"url", "u"}}}});
  EXPECT_EQ(out.content, "I will call two tools.");
  // An unclosed last call (cut by max_tokens) is still a call when its JSON is whole.
  expect_calls(parse_tool_calls(ToolSyntax::hermes, "<tool_call>{\"name\": \"f\", \"arguments\": {}}"), {{"f", json::object()}});
  const std::string broken = "<tool_call>{\"name\": \"f\", \"argu</tool_call>";
  EXPECT_TRUE(parse_tool_calls(ToolSyntax::hermes, broken).calls.empty());
  EXPECT_EQ(parse_tool_calls(ToolSyntax::hermes, broken).content, broken);
}

TEST(ToolCalls, MistralToolCallsArray) {
  const ParsedOutput out =
      parse_tool_calls(ToolSyntax::mistral, R"([TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "now", "arguments": {}}])");
  expect_calls(out, {{"add", {{"a", 1}, {"b", 2}}}, {"now", json::object()}});
  EXPECT_EQ(out.content, "");
  EXPECT_TRUE(parse_tool_calls(ToolSyntax::mistral, "[TOOL_CALLS] not json").calls.empty());
  EXPECT_TRUE(parse_tool_calls(ToolSyntax::none, R"({"name": "a", "parameters": {}})").calls.empty());
}

// What a model writes is not checked by anyone first: arguments nested past
// kMaxCallDepth stay text (their dump would recurse 100,000 deep), and a
// long run of braces is read in one pass (a parse per '}' took minutes).
TEST(ToolCalls, DeepOrLongOutputsAreReadInBoundedTimeAndStack) {
  const std::string deep = "{\"name\": \"f\", \"arguments\": {\"a\": " + std::string(100000, '[') +
                           std::string(100000, ']') + "}}";
  for (ToolSyntax syntax : {ToolSyntax::hermes, ToolSyntax::llama3, ToolSyntax::mistral}) {
    const std::string text = syntax == ToolSyntax::hermes    ? "<tool_call>" + deep + "</tool_call>"
                             : syntax == ToolSyntax::mistral ? "[TOOL_CALLS]" + deep
                                                             : deep;
    const ParsedOutput out = parse_tool_calls(syntax, text);
    EXPECT_TRUE(out.calls.empty());
    EXPECT_EQ(out.content, text);
  }
  // Arguments written as a JSON string, nested as deep: text too.
  json stringly = {{"name", "f"}, {"arguments", std::string(100000, '[') + std::string(100000, ']')}};
  EXPECT_TRUE(parse_tool_calls(ToolSyntax::hermes, "<tool_call>" + stringly.dump() + "</tool_call>").calls.empty());
  // 64 deep is still a call.
  const std::string ok = "{\"name\": \"f\", \"arguments\": {\"a\": " + std::string(62, '[') + std::string(62, ']') + "}}";
  EXPECT_EQ(parse_tool_calls(ToolSyntax::llama3, ok).calls.size(), 1u);
  // (a million: hours of parsing, a test that times out, before)
  EXPECT_TRUE(parse_tool_calls(ToolSyntax::llama3, "{\"" + std::string(1000000, '}')).calls.empty());
}

TEST(ToolCalls, TheSyntaxFollowsTheTemplatesFamily) {
  EXPECT_EQ(tool_syntax_of("llama3.2"), ToolSyntax::llama3);
  EXPECT_EQ(tool_syntax_of("qwen3"), ToolSyntax::hermes);
  EXPECT_EQ(tool_syntax_of("chatml"), ToolSyntax::hermes);
  EXPECT_EQ(tool_syntax_of("mistral"), ToolSyntax::mistral);
  EXPECT_EQ(tool_syntax_of("llama2"), ToolSyntax::none);
}

}  // namespace
}  // namespace disagg::gpu
