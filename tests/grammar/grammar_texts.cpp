#include "grammar/grammar_texts.h"

#include <gtest/gtest.h>

#include "engine/constraint.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "model/checkpoint.h"
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

std::vector<std::string> model_texts_under(const Grammar& g, int seeds) {
  const auto checkpoint = gpu::Checkpoint::open(test::shared_model());
  const gpu::Tokenizer tokenizer = gpu::Tokenizer::load(test::shared_tokenizer(), checkpoint->config().vocab_size);
  gpu::Engine engine(checkpoint, gpu::EngineOptions{"cpu"});
  gpu::Constraints constraints(stories_vocabulary());
  std::vector<std::string> texts;
  for (uint64_t seed = 1; seed <= uint64_t(seeds); ++seed) {
    gpu::SamplingParams sampling;
    sampling.temperature = 1.0f;
    sampling.seed = seed;
    sampling.grammar = g.to_json();
    const auto out = gpu::generate(engine, {1}, 120, sampling, &constraints);
    if (out.finish == gpu::FinishReason::eos) texts.push_back(tokenizer.decode_all(1, out.tokens));
  }
  return texts;
}

void expect_refused(const std::function<Grammar(const std::string&)>& compile,
                    const std::vector<std::pair<std::string, std::string>>& cases) {
  for (const auto& [source, why] : cases) {
    SCOPED_TRACE(source);
    try {
      compile(source);
      ADD_FAILURE() << "not refused";
    } catch (const GrammarError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
}

}  // namespace disagg::grammar
