// What the grammar tests share: the shared tokenizer's vocabulary as a
// grammar reads it, and whether a compiled grammar takes a whole text.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "grammar/grammar.h"

#include "grammar/matcher.h"

namespace disagg::grammar {

// The shared tok512.bin's tokens (end tokens 1 and 2), built once.
std::shared_ptr<const TokenVocabulary> stories_vocabulary();

// Whether `text`, byte by byte from the start state, is a whole sentence of c.
bool takes(CompiledGrammar& c, const std::string& text);

// The shared stories260K model sampling under `g` (temperature 1, seeds 1 to
// `seeds`, at most 120 tokens after BOS): the texts of the outputs that
// ended (the grammar complete, then an end token); one cut by the length
// gives no verdict and is left out.
std::vector<std::string> model_texts_under(const Grammar& g, int seeds);

// Each (source, why): compile(source) throws a GrammarError whose message
// holds `why` (a test failure otherwise).
void expect_refused(const std::function<Grammar(const std::string&)>& compile,
                    const std::vector<std::pair<std::string, std::string>>& cases);

}  // namespace disagg::grammar
