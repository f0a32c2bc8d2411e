// Chat requests' prompts (http/api.h's parse_request and /tokenize use it):
// the messages checked and rendered in the chat format (the model's own
// Jinja template through jinja2, or a built-in), with the request's tools,
// chat_template_kwargs and the rule that a client's text of control tokens
// stays text; and the tools a request defines, with the grammar a required
// or named tool_choice generates under.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "http/api.h"

namespace disagg::http {

// A request's own chat_template (vLLM's field: a Jinja template used
// instead of the model's, rendered by jinja2 as the model's is): at most this
// many bytes, and the frontend keeps this many compiled (least recently used
// out), so a client that sends the same template each time compiles it once.
constexpr size_t kMaxChatTemplateBytes = 64 * 1024;
constexpr size_t kCompiledRequestTemplates = 16;

// What a chat template reads beside the messages (from the request body).
struct ChatOptions {
  bool enable_thinking = true;             // chat_template_kwargs' enable_thinking: the only one the built-ins read
  bool special_tokens_in_content = false;  // true: control-token text in messages becomes those tokens
  // vLLM's: the template opens the assistant's turn (default), or (with
  // continue_final_message) the prompt ends inside the last message, an
  // assistant's, which the output continues. Both but the default need the
  // model file's template (the built-ins always open the turn).
  bool add_generation_prompt = true;
  bool continue_final_message = false;
  // The body's text (the caller's, read while rendering): a Jinja template
  // reads its messages, tools and chat_template_kwargs in the client's key
  // order. Empty: `messages` alone.
  std::string_view body_text;
  // Whose template renders, for its errors: the request's own chat_template or the model's.
  bool request_template = false;
};
// The body's chat_template_kwargs (an object), special_tokens_in_content,
// add_generation_prompt and continue_final_message (booleans; the last two
// not both true); `text` is the body's text. Throws ApiError.
ChatOptions chat_options(const json& body, const std::string& text);

// The prompt tokens of `messages` (a validated array of messages) in the
// chat format (text/chat_template.h): the model's Jinja template rendered
// by jinja2 (its output bounded at `max_characters`), or a built-in. The
// text of control tokens in what the client wrote is encoded as plain text
// (Tokenizer::defused_text) unless options.special_tokens_in_content.
// Throws ApiError (param "messages") when the template refuses the messages
// (raise_exception, a role order a built-in does not take) or fails.
std::vector<int32_t> render_chat(const ChatFormat& chat, const json& messages, const gpu::Tokenizer& tokenizer,
                                 const ChatOptions& options = {}, size_t max_characters = size_t(1) << 20);

// The prompt of a chat request's `messages` (body's, whose text is `text`):
// checked (shape, roles, bytes: disagg.max-prompt-bytes), then rendered
// (render_chat, its output bounded at twice that) by the body's own
// chat_template when it has one (a string of at most kMaxChatTemplateBytes
// that jinja2 compiles; the model's family still reads tool calls and
// reasoning), else `chat`. Throws ApiError.
std::vector<int32_t> chat_prompt(const json& body, const std::string& text, const ServedModel& model,
                                 const gpu::Tokenizer& tokenizer, const ChatFormat& chat);

// tools, tool_choice and parallel_tool_calls of a chat body, for the
// family's call syntax; `grammar` gets the calls' grammar when the choice
// is required or named. Throws ApiError.
ToolUse parse_tools(const json& body, const nlohmann::ordered_json& in_order, ChatTemplate family, std::string& grammar);

}  // namespace disagg::http
