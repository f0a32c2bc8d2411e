// Tool calls in a model's output, as each family writes them (vLLM's tool
// parsers): the calls apart from the text around them.
//   llama3  Llama 3.1+: a JSON object {"name": ..., "parameters": {...}}
//           (or "arguments"), optionally after <|python_tag|>; several
//           separated by ";" or newlines.
//   hermes  Hermes, Qwen2.5, Qwen3: <tool_call>{"name": ..., "arguments":
//           {...}}</tool_call>, any number, text before them kept.
//   mistral [TOOL_CALLS] then a JSON array of {"name", "arguments"}.
// A text with no call, or one whose call is not valid JSON of that shape,
// is content (never an error: the model may write anything).
#pragma once
#include <string>
#include <vector>

namespace disagg::gpu {

enum class ToolSyntax { none, llama3, hermes, mistral };

// A call's JSON nested deeper than this is taken for text, not a call.
constexpr int kMaxCallDepth = 64;

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object's text, as OpenAI's function.arguments
};

struct ParsedOutput {
  std::string content;  // the text that is not a call (trimmed of the calls' markup)
  std::vector<ToolCall> calls;
};

ParsedOutput parse_tool_calls(ToolSyntax syntax, const std::string& text);

// The family's syntax by the chat template's name (text/chat_template.h's
// built-ins): llama3* -> llama3, qwen2*/qwen3/chatml -> hermes, mistral ->
// mistral, else none.
ToolSyntax tool_syntax_of(const std::string& template_name);

}  // namespace disagg::gpu
