#include "engine/constraint.h"

#include <xxhash.h>

#include <optional>

#include "text/tokenizer.h"

namespace disagg::gpu {

std::shared_ptr<const grammar::TokenVocabulary> grammar_vocabulary(const Tokenizer& tokenizer,
                                                                   const std::vector<int>& end_tokens) {
  const int n = tokenizer.vocab_size();
  const Vocabulary& v = tokenizer.vocabulary();
  std::vector<std::string> bytes(static_cast<size_t>(n));
  std::vector<bool> special(static_cast<size_t>(n), false);
  for (int t = 0; t < n; ++t) {
    const TokenType type = tokenizer.type_of(t);
    special[size_t(t)] = type == TokenType::control || type == TokenType::user_defined ||
                         type == TokenType::unknown || type == TokenType::unused || t == v.bos || t == v.eos ||
                         (v.types.empty() && t == 0);  // (a llama2.c tokenizer file: <unk>, untyped)
    // The text as it follows any token but BOS (SentencePiece keeps the
    // leading space then): what the client reads after the prompt.
    if (!special[size_t(t)]) bytes[size_t(t)] = tokenizer.decode(-1, t);
  }
  return std::make_shared<const grammar::TokenVocabulary>(std::move(bytes), special, end_tokens);
}

Constraints::Constraints(std::shared_ptr<const grammar::TokenVocabulary> vocabulary) : vocab_(std::move(vocabulary)) {}

std::shared_ptr<grammar::CompiledGrammar> Constraints::compiled(const std::string& source) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t h = XXH3_64bits(source.data(), source.size());
  auto it = by_hash_.find(h);
  auto fresh = [](const grammar::CompiledGrammar& g) {
    return g.states() < kRecompileStates && g.stacks() < kRecompileStacks &&
           g.closure_entries() < kRecompileClosureEntries;
  };
  if (it != by_hash_.end() && it->second->first == source && fresh(*it->second->second)) {
    grammars_.splice(grammars_.begin(), grammars_, it->second);
    return it->second->second;
  }
  auto compiled = std::make_shared<grammar::CompiledGrammar>(grammar::Grammar::from_json(source), vocab_);
  // A grammar let go takes its cached parses along (they hold it: else the
  // cache's bound on grammars would not bound their memory).
  auto let_go = [&](decltype(grammars_)::iterator g) {
    for (auto p = parses_.begin(); p != parses_.end();)
      p = p->second.second.grammar() == g->second ? parses_.erase(p) : std::next(p);
    grammars_.erase(g);
  };
  if (it != by_hash_.end()) {  // (a hash collision, or one worn past the kRecompile bounds: the new one takes the slot)
    let_go(it->second);
    by_hash_.erase(it);
  }
  grammars_.emplace_front(source, compiled);
  by_hash_[h] = grammars_.begin();
  if (grammars_.size() > kMaxCompiledGrammars) {
    by_hash_.erase(XXH3_64bits(grammars_.back().first.data(), grammars_.back().first.size()));
    let_go(std::prev(grammars_.end()));
  }
  return compiled;
}

std::shared_ptr<const grammar::TokenMask> Constraints::mask(const std::string& source, const std::vector<int>& history,
                                                            uint64_t step) {
  if (step > history.size())
    throw grammar::GrammarError("constrained decoding: step " + std::to_string(step) + " with " +
                                std::to_string(history.size()) + " tokens of history");
  std::shared_ptr<grammar::CompiledGrammar> g = compiled(source);
  const size_t first = history.size() - size_t(step);  // the output's first token
  // The key of the output's first k tokens: one hash over them, seeded with
  // the grammar's (a few microseconds for thousands of tokens).
  const uint64_t seed = XXH3_64bits(source.data(), source.size());
  auto key = [&](size_t k) { return XXH3_64bits_withSeed(history.data() + first, k * sizeof(int), seed); };
  // This step's parse, or the step before's (a decode step asks token by
  // token); else the output is replayed from its start (a request new here,
  // or one the cache let go).
  const uint64_t now = key(step), before = step > 0 ? key(step - 1) : 0;
  std::unique_lock<std::mutex> lock(mutex_);
  size_t k = 0;
  std::optional<grammar::Matcher> m;
  auto take = [&](uint64_t h, size_t at) {
    auto it = parses_.find(h);
    if (it == parses_.end() || it->second.first != at || it->second.second.grammar() != g) return false;
    m = it->second.second;
    k = at;
    return true;
  };
  if (!take(now, size_t(step)) && step > 0) take(before, size_t(step) - 1);
  lock.unlock();
  if (!m) m.emplace(g);
  for (size_t i = k; i < step; ++i)
    if (!m->accept(history[first + i]))
      throw grammar::GrammarError("constrained decoding: output token " + std::to_string(i) + " (id " +
                                  std::to_string(history[first + i]) + ") is not allowed by the request's grammar");
  lock.lock();
  if (parses_.size() >= kMaxCachedParses) parses_.clear();
  parses_.insert_or_assign(now, std::make_pair(uint64_t(step), *m));
  lock.unlock();
  return m->mask();
}

}  // namespace disagg::gpu
