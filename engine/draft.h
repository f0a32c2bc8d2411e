// Draft-model proposals, speculation's second proposer (engine/speculation.h):
// a smaller model with the target's vocabulary, run greedily ahead of the
// target for one sequence, its KV in blocks of a pool of the draft's own
// engine. Whatever it guesses, verification keeps only plain decoding's tokens.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/speculation.h"

namespace disagg::gpu {

// Why `draft` cannot propose tokens for `target`, or "": the same vocabulary
// size and end tokens (the same tokenizer is the deployer's promise: a
// different one costs only acceptance, never a token).
std::string check_draft(const ModelConfig& target, const ModelConfig& draft);

// The most tokens one DraftSequence::propose feeds before it guesses: a long
// context (a new sequence's whole prompt, a migrated one's output) is caught
// up over several steps, guessing nothing until then, so that no step of the
// decode worker (timed by its compute bound) carries a whole prompt's draft
// prefill. 512 tokens: well under a second of a draft model's prefill here.
constexpr int kDraftCatchUpTokens = 512;

class DraftSequence {
 public:
  // `blocks` of `pool` (the draft engine's) hold this sequence's draft KV.
  DraftSequence(Engine& draft, KvPool& pool, std::vector<int> blocks, int catch_up = kDraftCatchUpTokens);
  // Up to `max` greedy guesses of what follows `tokens` (the sequence so
  // far): feeds what of `tokens` it has not fed yet (all after the longest
  // prefix it fed before: the accepted tokens, the correction, or on first
  // use the whole prompt), then each guess but the last with a decode step
  // of its own. Fewer where its blocks or the draft's context end; none for
  // an empty sequence, nor while more than `catch_up` tokens are unfed (it
  // feeds that many, and guesses at a later call).
  std::vector<int> propose(const std::vector<int>& tokens, int max);
  int capacity() const { return capacity_; }  // positions its blocks hold (and the draft's context allows)
  const std::vector<int>& blocks() const { return blocks_; }

 private:
  Engine* engine_;
  KvPool* pool_;
  std::vector<int> blocks_;
  int capacity_ = 0;
  int catch_up_ = kDraftCatchUpTokens;
  std::vector<int> fed_;  // the tokens whose KV its blocks hold, position by position
};

// generate_speculative()'s draft proposer: one sequence in a pool of its
// own, as many positions as a request of `prompt_len` and `max_new_tokens`
// can hold (kv_positions_needed: at most the draft's context, whatever
// max_new_tokens a user asks for).
Proposer draft_proposer(Engine& draft, int prompt_len, int max_new_tokens);

}  // namespace disagg::gpu
