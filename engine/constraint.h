// Constrained decoding's side of a running model: the grammars requests
// bring (SamplingParams::grammar, grammar/grammar.h's JSON form), compiled
// for this model's vocabulary and cached by the hash of their source, and
// the mask for a request's next token, found from its output so far.
//
// Stateless for its callers: the mask of token `step` is a function of the
// grammar and the request's first `step` output tokens, whoever asks, in
// whatever batch or after whatever migration, so a masked request keeps the
// project's exactness. A cache of (grammar, output prefix) -> parse state
// makes a sequence's next step cost one token's bytes (and one hash over its
// output), not a parse of its whole output.
#pragma once
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "grammar/matcher.h"

namespace disagg::gpu {

class Tokenizer;

// The vocabulary as a grammar reads it: each token's decoded bytes; control,
// user-defined, unknown and unused tokens special; `end_tokens` the model's.
std::shared_ptr<const grammar::TokenVocabulary> grammar_vocabulary(const Tokenizer& tokenizer,
                                                                   const std::vector<int>& end_tokens);

// The most compiled grammars and cached parse states one Constraints keeps,
// and the parse states a compiled grammar may hold before it is compiled
// anew (its memo tables start again; requests under way replay their output
// on the new one): a grammar such as json_object meets new states for as
// long as a server runs, so its tables are bounded here, far below
// grammar::kMaxStates.
constexpr size_t kMaxCompiledGrammars = 64;
constexpr size_t kMaxCachedParses = size_t(1) << 16;
constexpr size_t kRecompileStates = size_t(1) << 16;
// Likewise its parse stacks and their closures (one that reached
// grammar::kMaxStacks or kMaxClosureEntries in a request would refuse every
// later one, and a cache of such grammars would hold gigabytes).
constexpr size_t kRecompileStacks = size_t(1) << 18;
constexpr size_t kRecompileClosureEntries = size_t(1) << 21;

class Constraints {
 public:
  explicit Constraints(std::shared_ptr<const grammar::TokenVocabulary> vocabulary);

  // The tokens allowed as output token `step` of a request under `grammar`
  // whose tokens so far are `history` (the prompt, then `step` output
  // tokens). Throws grammar::GrammarError: a bad grammar, or an output so
  // far that the grammar does not allow (a peer's).
  std::shared_ptr<const grammar::TokenMask> mask(const std::string& grammar, const std::vector<int>& history,
                                                 uint64_t step);
  // The compiled grammar of a source (compiled on first use).
  std::shared_ptr<grammar::CompiledGrammar> compiled(const std::string& grammar);

  const grammar::TokenVocabulary& vocabulary() const { return *vocab_; }

 private:
  std::shared_ptr<const grammar::TokenVocabulary> vocab_;
  std::mutex mutex_;
  // Source hash -> (source, compiled), least recently used last.
  std::list<std::pair<std::string, std::shared_ptr<grammar::CompiledGrammar>>> grammars_;
  std::unordered_map<uint64_t, decltype(grammars_)::iterator> by_hash_;
  // Hash of (grammar, output prefix) -> the matcher after that prefix (and
  // the prefix's length, checked on a hit).
  std::unordered_map<uint64_t, std::pair<uint64_t, grammar::Matcher>> parses_;
};

}  // namespace disagg::gpu
