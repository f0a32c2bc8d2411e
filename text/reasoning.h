// A thinking model's reasoning apart from its answer, as vLLM's reasoning
// parsers split them (message.reasoning_content and content): Qwen3 writes
// <think>...</think> before its answer.
//   - an output that begins with <think>: reasoning until </think> (all of
//     it when cut before), then the answer (its leading newlines dropped);
//   - one that does not but has </think> (a template that opened the
//     thought in the prompt): the text before it is reasoning;
//   - otherwise all of it is content.
// Streamed, the second case cannot be known until </think> comes, so a
// stream treats it as content; the other two split the same way streamed.
#pragma once
#include <string>

namespace disagg::gpu {

enum class ReasoningSyntax { none, qwen3 };

// qwen3 for the qwen3 chat template (text/chat_template.h), else none.
ReasoningSyntax reasoning_syntax_of(const std::string& template_name);

struct Reasoned {
  std::string reasoning, content;
};

Reasoned split_reasoning(ReasoningSyntax syntax, const std::string& text);

// The split made as the text streams in: each piece's reasoning part and
// content part. Text that may be the start of <think> (at the beginning) or
// of </think> (while thinking) is held back until it is known; flush gives
// back what is held at the end.
class ReasoningStream {
 public:
  explicit ReasoningStream(ReasoningSyntax syntax) : syntax_(syntax) {}
  Reasoned add(const std::string& piece);
  Reasoned flush();

 private:
  enum class Phase { start, thinking, answer_start, answer };
  ReasoningSyntax syntax_;
  Phase phase_ = Phase::start;
  std::string pending_;
};

}  // namespace disagg::gpu
