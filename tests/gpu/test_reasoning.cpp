// Qwen3's reasoning split from fixed texts, whole and streamed piece by piece
// (every split of the text into two pieces gives the whole text's split).
#include <gtest/gtest.h>

#include "text/reasoning.h"

namespace disagg::gpu {
namespace {

TEST(Reasoning, Qwen3ThinkingApartFromTheAnswer) {
  const ReasoningSyntax q = ReasoningSyntax::qwen3;
  Reasoned r = split_reasoning(q, "<think>\nThe user wants a number.\n</think>\n\n42");
  EXPECT_EQ(r.reasoning, "\nThe user wants a number.\n");
  EXPECT_EQ(r.content, "42");
  r = split_reasoning(q, "<think>cut while thinking");
  EXPECT_EQ(r.reasoning, "cut while thinking");
  EXPECT_EQ(r.content, "");
  r = split_reasoning(q, "opened in the prompt</think>answer", true);
  EXPECT_EQ(r.reasoning, "opened in the prompt");
  EXPECT_EQ(r.content, "answer");
  r = split_reasoning(q, "not opened</think>answer");  // (a stream cannot know: content, both ways)
  EXPECT_EQ(r.reasoning, "");
  EXPECT_EQ(r.content, "not opened</think>answer");
  r = split_reasoning(q, "\n <think>led by spaces</think>\n\nanswer");
  EXPECT_EQ(r.reasoning, "led by spaces");
  EXPECT_EQ(r.content, "answer");
  r = split_reasoning(q, "no thought at all");
  EXPECT_EQ(r.reasoning, "");
  EXPECT_EQ(r.content, "no thought at all");
  r = split_reasoning(ReasoningSyntax::none, "<think>x</think>y");
  EXPECT_EQ(r.content, "<think>x</think>y");
  EXPECT_EQ(reasoning_syntax_of("qwen3"), q);
  EXPECT_EQ(reasoning_syntax_of("qwen2.5"), ReasoningSyntax::none);
}

TEST(Reasoning, APromptOpensTheThoughtWhenItEndsWithThink) {
  const ReasoningSyntax q = ReasoningSyntax::qwen3;
  EXPECT_TRUE(prompt_opens_thought(q, "<|im_start|>assistant\n<think>\n"));
  EXPECT_TRUE(prompt_opens_thought(q, "<think>"));
  EXPECT_FALSE(prompt_opens_thought(q, "<|im_start|>assistant\n<think>\n\n</think>\n\n"));  // enable_thinking: false
  EXPECT_FALSE(prompt_opens_thought(q, "<|im_start|>assistant\n"));
  EXPECT_FALSE(prompt_opens_thought(q, "think>\n"));
  EXPECT_FALSE(prompt_opens_thought(q, "\n"));
  EXPECT_FALSE(prompt_opens_thought(ReasoningSyntax::none, "<think>\n"));
}

TEST(Reasoning, StreamedPiecesSplitAsTheWholeText) {
  for (const bool opened : {false, true})
  for (const std::string text : {std::string("<think>\nabc </ def\n</think>\n\nthe answer"), std::string("<think>only thought"),
                                 std::string("plain <think> not at the start"), std::string("<thin"), std::string(""),
                                 std::string("opened before</think>\n\nthe answer"), std::string("\n <think>x</think>y"),
                                 std::string(" \n"), std::string("\n<thi")}) {
    const Reasoned whole = split_reasoning(ReasoningSyntax::qwen3, text, opened);
    for (size_t cut = 0; cut <= text.size(); ++cut) {
      ReasoningStream s(ReasoningSyntax::qwen3, opened);
      Reasoned got;
      for (const std::string& piece : {text.substr(0, cut), text.substr(cut)}) {
        const Reasoned part = s.add(piece);
        got.reasoning += part.reasoning;
        got.content += part.content;
      }
      const Reasoned rest = s.flush();
      got.reasoning += rest.reasoning;
      got.content += rest.content;
      EXPECT_EQ(got.reasoning, whole.reasoning) << text << " cut at " << cut << (opened ? ", opened" : "");
      EXPECT_EQ(got.content, whole.content) << text << " cut at " << cut << (opened ? ", opened" : "");
    }
  }
}

}  // namespace
}  // namespace disagg::gpu
