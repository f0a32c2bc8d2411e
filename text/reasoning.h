// A thinking model's reasoning apart from its answer, as vLLM's reasoning
// parsers split them (message.reasoning_content and content): Qwen3 writes
// <think>...</think> before its answer.
//   - a reply whose prompt opened the thought (the template ended it with
//     <think>: prompt_opens_thought) or that begins with <think> (after
//     spaces or newlines): reasoning until </think> (all of it when cut
//     before), then the answer (its leading newlines dropped);
//   - otherwise all of it is content, a </think> in it included.
// Streamed, the pieces split exactly as the whole text does.
#pragma once
#include <string>

namespace disagg::gpu {

enum class ReasoningSyntax { none, qwen3 };

// qwen3 for the qwen3 chat template (text/chat_template.h), else none.
ReasoningSyntax reasoning_syntax_of(const std::string& template_name);

// Whether a prompt whose text ends with `prompt_tail` leaves the model
// inside a thought: it ends with <think>, then at most spaces and newlines
// (the generation prompt of Qwen3's thinking-only templates).
bool prompt_opens_thought(ReasoningSyntax syntax, const std::string& prompt_tail);

struct Reasoned {
  std::string reasoning, content;
};

Reasoned split_reasoning(ReasoningSyntax syntax, const std::string& text, bool opened = false);

// The split made as the text streams in: each piece's reasoning part and
// content part. Text that may be the start of <think> (at the beginning) or
// of </think> (while thinking) is held back until it is known; flush gives
// back what is held at the end.
class ReasoningStream {
 public:
  explicit ReasoningStream(ReasoningSyntax syntax, bool opened = false)
      : syntax_(syntax), phase_(opened ? Phase::thinking : Phase::start) {}
  Reasoned add(const std::string& piece);
  Reasoned flush();

 private:
  enum class Phase { start, thinking, answer_start, answer };
  ReasoningSyntax syntax_;
  Phase phase_;
  std::string pending_;
  size_t spaces_ = 0;  // start: how many of pending_'s first bytes are known spaces and newlines
};

}  // namespace disagg::gpu
