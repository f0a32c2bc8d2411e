// What the grammar tests share: the shared tokenizer's vocabulary as a
// grammar reads it, and whether a compiled grammar takes a whole text.
#pragma once
#include <memory>
#include <string>

#include "grammar/matcher.h"

namespace disagg::grammar {

// The shared tok512.bin's tokens (end tokens 1 and 2), built once.
std::shared_ptr<const TokenVocabulary> stories_vocabulary();

// Whether `text`, byte by byte from the start state, is a whole sentence of c.
bool takes(CompiledGrammar& c, const std::string& text);

}  // namespace disagg::grammar
