// Speculative decoding that changes no token.
//
// A proposer guesses the next few tokens of a sequence; one decode step feeds
// the last emitted token and the k guesses at their positions (k + 1 rows of
// the same sequence, each attending to the cache up to its own position), and
// row i's logits are then exactly the logits plain decoding would have had
// after the first i guesses: gpu/fixed_math.h makes a row's arithmetic
// independent of the rows computed with it. verify_draft() samples row 0 as
// plain decoding samples (every control: logit_bias, min_tokens, penalties
// over the history so far, a grammar's mask, the random number f(seed, step));
// while the token it made equals the guess fed after it, row i + 1 is sampled
// likewise. So a step makes 1..k+1 tokens, each the token plain decoding makes
// at that place: greedy and seeded sampling alike, bit for bit, whatever was
// proposed. A wrong guess costs only time; its row's KV (written at a position
// past the accepted tokens) is overwritten when the real token is fed there,
// and no attention reads past its own position.
//
//   proposer (n-gram lookup)  --draft-->  decode step (k + 1 rows)  --logits-->
//   verify_draft (sample, compare, stop)  -->  1..k+1 tokens  -->  stop rule
//
// The request's side: SpeculationParams (in its SamplingParams, so it travels
// wherever the request goes; it changes no token), resolved against the
// worker's configuration by resolve_speculation(); a SpeculationGate per
// sequence pauses proposals while they keep failing, and feeds only the
// guesses that pay for their rows at the price a GuessCost measured.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/sampling.h"
#include "engine/speculation_params.h"

namespace disagg::grammar {
struct TokenMask;
}

namespace disagg::gpu {

// Empty when a request's `p` is valid, else why not.
std::string check_speculation(const SpeculationParams& p);

// The request's wishes with the worker's (`configured`, all set) in place of
// what it left unset; a lookup_min above the resolved lookup_max is lowered to it.
SpeculationParams resolve_speculation(const SpeculationParams& request, const SpeculationParams& configured);

// The n-gram proposer (vLLM's `ngram`, prompt lookup decoding): for n from
// lookup_max down to lookup_min, the latest earlier place where the last n
// tokens of `tokens` occurred; the up to `max` tokens that followed it there.
// Empty when none matches. O(len x n) per call, no state.
std::vector<int> propose_ngram(const std::vector<int>& tokens, int lookup_min, int lookup_max, int max);

// The most guesses a step may feed after the token it feeds, when token
// `index` of the request comes next and it may output `limit` tokens in all:
// row i makes token index + i, so at most `k` and never a token past the
// limit; the positions fed then stay inside what the request reserved
// (gpu::kv_positions_needed). The one rule of the decode worker and of
// generate_speculative().
inline int guess_room(int k, int index, int limit) { return std::max(0, std::min(k, limit - index - 1)); }

// What one guess row costs a worker, measured: its decode steps' times
// against their rows, fitted as time = fixed + per_row x rows over the recent
// steps (sums that decay by kDecay a step). A guess row fed beside `rows`
// plain ones costs per_row of a step that makes `rows` tokens: `share`
// returns that in tokens, rows x per_row / (fixed + per_row x rows), the
// tokens the step could have made in the guess row's time. Until steps of
// different sizes have been seen, kUnmeasured: the most a row can cost (a
// whole step's token), so a worker's first guess is a probe of one.
class GuessCost {
 public:
  static constexpr double kDecay = 0.95;
  static constexpr double kUnmeasured = 1.0;
  void record(int rows, double seconds);
  double share(int rows) const;

 private:
  double w_ = 0, x_ = 0, y_ = 0, xx_ = 0, xy_ = 0;  // decayed sums of 1, rows, seconds, rows^2, rows x seconds
};

// Spends a sequence's guesses where they pay. After a step that accepted
// none of its guesses, none are made for the next `pause` steps, and the
// pause doubles with each such step (up to kMaxPause); a step that accepted
// any resets it. And a step feeds at most `cap` guesses: one more than the
// last step accepted, doubling while every guess is accepted. A proposer
// that is always wrong thus costs about one verification of one guess in
// kMaxPause steps; one that is always right keeps every step at k guesses.
// Given what a guess row costs (GuessCost::share, in tokens), it also feeds
// a guess only while the chance that it and every guess before it are right
// (a guess is right with the sequence's acceptance rate, estimated from its
// steps) is above that cost: on a CPU where a row costs half a step, a
// sequence whose guesses are right half the time guesses one at most. When
// not even one pays, it feeds one now and then to measure again: a wrong
// one pauses it as any step that accepted none, a right one that still
// leaves guesses not paying for as long as the last pause. And probes are
// paid from a budget: their net cost (their rows' price less the tokens
// they won) may reach kProbeAllowance tokens plus kProbeShare of the steps
// asked so far, no more; so a proposer that is always wrong costs a sequence
// about 1% of its steps whatever a row costs, and one that turned good is
// found again by the probes its right guesses paid for. Cost 0: by the cap
// and pauses alone.
class SpeculationGate {
 public:
  static constexpr int kMaxPause = 64;
  static constexpr double kMemory = 0.9;  // the weight of earlier steps in the acceptance rate
  static constexpr double kProbeShare = 0.01;     // of the steps asked, in tokens: the probes' budget
  static constexpr double kProbeAllowance = 0.5;  // tokens the first probes may spend before that
  // The guesses this step may feed, at most `k` (0: paused; counts the
  // paused steps down), a guess row costing `cost` tokens. Ask once per
  // step, only when k > 0.
  int allowed(int k, double cost = 0);
  void record(int proposed, int accepted);
  int64_t proposed() const { return proposed_; }
  int64_t accepted() const { return accepted_; }
  // The chance a guess is right, as estimated (0.5 before any step).
  double acceptance() const { return (right_ + 1) / (right_ + wrong_ + 2); }

 private:
  void pause();
  int pause_ = 0;  // steps still paused
  int next_ = 1;   // the pause after the next step that accepts none
  int cap_ = kMaxSpeculativeTokens;
  bool probe_ = false;  // the last guess fed did not pay by the estimate: a measurement
  double cost_ = 0;     // what a guess row cost then
  double debt_ = 0;     // the probes' net cost so far, in tokens (never below 0)
  int64_t asked_ = 0;   // steps allowed() was asked for
  double right_ = 0, wrong_ = 0;  // decayed counts of right guesses and of steps a guess was wrong in
  int64_t proposed_ = 0, accepted_ = 0;
};

// A proposer: up to `max` guesses of the tokens that follow `tokens` (the
// prompt, then the output so far). Any guesses do: verification keeps only
// what plain decoding makes.
using Proposer = std::function<std::vector<int>(const std::vector<int>& tokens, int max)>;

// The n-gram proposer of a resolved `p` (method ngram).
Proposer ngram_proposer(const SpeculationParams& p);

// Proposers that measure (the tests' and the benchmark's ceiling and floor):
// always right, replaying `plain`, the tokens plain decoding made after a
// prompt of `prompt_len` tokens; always wrong, each guess one past that
// token (mod `vocab`).
Proposer oracle_proposer(std::vector<int> plain, size_t prompt_len);
Proposer wrong_proposer(std::vector<int> plain, size_t prompt_len, int vocab);

// The mask for output token `step` after `history` (Constraints::mask), or
// null; required when the sampling has a grammar.
using MaskFor = std::function<std::shared_ptr<const grammar::TokenMask>(const std::vector<int>& history,
                                                                         uint64_t step)>;

// One sequence's rows of a speculative step: `logits` holds draft.size() + 1
// rows of vocab floats, row i the logits after the last emitted token and
// draft[0..i). Samples row 0 as token `step` of the request (sample()'s
// arguments), then row i + 1 while token i equalled draft[i] and did not end
// the generation (engine/stop_rule.h: an end or stop token once min_tokens
// are out). `history` (the request's tokens so far, when the sampling
// reads them) gets each made token appended. The tokens made, 1..k+1 of
// them: the caller applies the stop rule to each, in order. A row whose
// mask or sampling throws (a grammar that allows nothing there) throws if it
// is the first; a later one ends the tokens made before it, as plain
// decoding makes them before it fails at that row in a step of its own.
std::vector<Sampled> verify_draft(const float* logits, int vocab, const std::vector<int>& draft,
                                  const SamplingParams& sampling, uint64_t step, std::vector<int>& history,
                                  const std::vector<int>& end_tokens, const MaskFor& mask_for);

// The proposals of a step verify_draft() made `made` tokens from that were
// accepted: the leading made tokens equal to their guesses.
int accepted_of(const std::vector<int>& draft, const std::vector<Sampled>& made);

}  // namespace disagg::gpu
