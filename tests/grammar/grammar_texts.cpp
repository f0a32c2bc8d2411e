#include "grammar/grammar_texts.h"

#include "engine/constraint.h"
#include "support/test_paths.h"
#include "text/tokenizer.h"

namespace disagg::grammar {

std::shared_ptr<const TokenVocabulary> stories_vocabulary() {
  static auto v = [] {
    const gpu::Tokenizer t = gpu::Tokenizer::load(test::shared_tokenizer(), 512);
    return gpu::grammar_vocabulary(t, {1, 2});
  }();
  return v;
}

bool takes(CompiledGrammar& c, const std::string& text) {
  int s = c.start();
  for (char ch : text) {
    s = c.next(s, uint8_t(ch));
    if (s < 0) return false;
  }
  return c.accepting(s);
}

}  // namespace disagg::grammar
