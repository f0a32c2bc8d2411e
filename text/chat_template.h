// Chat templates: a chat request's messages -> the prompt. A model file's
// own Jinja template (tokenizer.chat_template) is rendered by jinja2 itself
// (text/jinja.h); the built-in renderers below serve files that carry none
// (llama2.c) and a template named in the configuration. Each built-in
// renders byte for byte what jinja2 renders from its family's template for
// the same messages with add_generation_prompt=True
// (tests/gpu/test_chat_template.cpp checks that against python3-jinja2).
// A file's template is also recognised by its content, as llama.cpp's
// llm_chat_detect_template does, to name its family: the syntax of its
// tool calls and reasoning.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace disagg::gpu {

//   llama2:  Meta's Llama 2 chat: BOS "[INST] {user} [/INST]" per turn, an
//            answered one " {assistant} " EOS; a first system message goes into
//            the first turn as "<<SYS>>\n{system}\n<</SYS>>\n\n"; contents stripped.
//   llama3:  BOS, then "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>"
//            per message (contents trimmed), then the assistant header.
//   llama3.1, llama3.2: Llama 3.1-3.3 Instruct's: BOS, a system block always
//            ("Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
//            then the system message, trimmed), the other messages as llama3
//            (tool results as ipython, JSON-quoted), the assistant header. The
//            date: 3.1 and 3.3's fixed "26 Jul 2024"; 3.2's today's (strftime_now).
//   chatml:  "<|im_start|>{role}\n{content}<|im_end|>\n" per message, then
//            "<|im_start|>assistant\n" (many fine-tunes).
//   qwen2, qwen2.5: ChatML with the family's system message when the first
//            message is not one ("You are a helpful assistant."; Qwen2.5: "You
//            are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
//            Qwen2.5's tool results as Qwen3's.
//   qwen3:   ChatML as Qwen3's template writes it: reasoning (<think>...</think>)
//            dropped from assistant turns before the last user message, tool
//            messages as <tool_response> in user turns.
//   mistral: BOS, "[INST] {user} [/INST]" and "{assistant}" EOS; no system role.
//   gemma:   BOS, "<start_of_turn>{user|model}\n{content}<end_of_turn>\n", then
//            "<start_of_turn>model\n"; no system role.
//   plain:   "{role}: {content}\n" per message, then "assistant:" (after BOS as
//            the vocabulary adds it).
// Roles must alternate user/assistant (after an optional system message)
// where the family's template says so.
enum class ChatTemplate { llama2, llama3, llama31, llama32, chatml, qwen2, qwen25, qwen3, mistral, gemma, plain };

// By name ("llama2", "llama3", "llama3.1", "llama3.2", "chatml", "qwen2",
// "qwen2.5", "qwen3", "mistral", "gemma", "plain"), and back.
std::optional<ChatTemplate> parse_chat_template(const std::string& name);
const char* to_string(ChatTemplate tmpl);
// Every name parse_chat_template accepts, comma-separated (for messages).
std::string chat_template_names();

// The built-in that renders a model file's Jinja template, or nullopt.
std::optional<ChatTemplate> detect_chat_template(const std::string& jinja);

// The family of a template none of the built-ins renders, by the markup
// it writes (<|start_header_id|>: llama3.1, <|im_start|>: chatml, or qwen3
// with <think>, [INST]: mistral with [TOOL_CALLS] else llama2,
// <start_of_turn>: gemma), else plain.
ChatTemplate family_of_template(const std::string& jinja);

class JinjaTemplate;  // text/jinja.h

// How a frontend renders chat: the model file's template through jinja2,
// or the built-in `family`; either way `family` names the syntax of the
// model's tool calls and reasoning (text/tool_calls.h, text/reasoning.h).
struct ChatFormat {
  ChatFormat(ChatTemplate builtin = ChatTemplate::plain) : family(builtin) {}
  ChatTemplate family;
  std::shared_ptr<const JinjaTemplate> jinja;  // set: rendered by jinja2, not the built-in
  // The model file's template for a request with tools (Vocabulary::
  // tool_use_template), rendered instead of `jinja` when set and the
  // request has "tools" (transformers' rule); unset: `jinja` renders all.
  std::shared_ptr<const JinjaTemplate> tool_use;
  // node.trust-request-chat-template: a request's own chat_template (code a
  // client sends to run here) is rendered; false (vLLM's default too): a 400.
  bool trusts_request_templates = false;
};

// The format a frontend renders with, and why: `configured` is
// node.chat-template, a built-in by name, or "auto": the vocabulary's own
// template rendered by jinja2 (one jinja2 cannot compile is an `error`,
// with jinja2's message); without one in the file, the built-in llama2 for
// a SentencePiece vocabulary, plain otherwise.
struct ChosenTemplate {
  ChatFormat format;
  std::string source;  // for the log: "named by node.chat-template", "the model file's", ...
  std::string error;   // non-empty: none could be chosen
};
ChosenTemplate choose_chat_template(const std::string& configured, const Vocabulary& vocabulary);

struct ChatMessage {
  std::string role, content;
};

// One piece of a rendered prompt: text (special tokens written as their text,
// recognised by the tokenizer) or the vocabulary's BOS/EOS token.
struct ChatPiece {
  enum Kind { text, bos, eos } kind = text;
  std::string value;  // text only
};

// Throws ChatTemplateError when the messages break the template's rules
// (as the template's raise_exception would).
struct ChatTemplateError : std::runtime_error {
  explicit ChatTemplateError(const std::string& what) : std::runtime_error(what), message(what) {}
  std::string message;
};
// `today`: llama3.2's date ("02 Dec 2026"); empty: the local date now.
// `enable_thinking` false: qwen3's generation prompt holds an empty thought
// (its template's chat_template_kwargs).
std::vector<ChatPiece> render_chat_pieces(ChatTemplate tmpl, const std::vector<ChatMessage>& messages,
                                          const std::string& today = "", bool enable_thinking = true);

// The rendered prompt as text, BOS and EOS written as `bos` and `eos`: what
// jinja2 renders with bos_token / eos_token set to them.
std::string chat_text(const std::vector<ChatPiece>& pieces, const std::string& bos, const std::string& eos);

}  // namespace disagg::gpu
