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

class DraftSequence {
 public:
  // `blocks` of `pool` (the draft engine's) hold this sequence's draft KV.
  DraftSequence(Engine& draft, KvPool& pool, std::vector<int> blocks);
  // Up to `max` greedy guesses of what follows `tokens` (the sequence so
  // far): feeds what of `tokens` it has not fed yet (all after the longest
  // prefix it fed before: the accepted tokens, the correction, or on first
  // use the whole prompt, in chunks), then each guess but the last with a
  // decode step of its own. Fewer where its blocks or the draft's context
  // end; none for an empty sequence.
  std::vector<int> propose(const std::vector<int>& tokens, int max);
  int capacity() const { return capacity_; }  // positions its blocks hold (and the draft's context allows)
  const std::vector<int>& blocks() const { return blocks_; }

 private:
  Engine* engine_;
  KvPool* pool_;
  std::vector<int> blocks_;
  int capacity_ = 0;
  std::vector<int> fed_;  // the tokens whose KV its blocks hold, position by position
};

// generate_speculative()'s draft proposer: one sequence of at most
// `positions` positions, in a pool of its own.
Proposer draft_proposer(Engine& draft, int positions);

}  // namespace disagg::gpu
