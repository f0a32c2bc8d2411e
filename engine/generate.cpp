// Colocated generation: the reference loop that the disaggregated cluster
// (prefill on one worker, decode on another) must reproduce token for token.
#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <string>

#include "gpu/error.h"
#include "text/tokenizer.h"

namespace disagg::gpu {

namespace {

constexpr int kBlockSize = kDefaultBlockSize;

void check_request(const Engine& engine, const std::vector<int>& prompt, int max_new_tokens,
                   const SamplingParams& sampling, const Constraints* constraints) {
  if (prompt.empty()) throw Error("generate: empty prompt");
  if (max_new_tokens < 0) throw Error("generate: negative max_new_tokens " + std::to_string(max_new_tokens));
  const ModelConfig& c = engine.config();
  if (int(prompt.size()) > c.seq_len)
    throw Error("generate: prompt of " + std::to_string(prompt.size()) + " tokens exceeds seq_len " +
                std::to_string(c.seq_len));
  for (int t : prompt)
    if (t < 0 || t >= c.vocab_size)
      throw Error("generate: prompt token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                  std::to_string(c.vocab_size) + ")");
  if (const std::string why = check_sampling(sampling, c.vocab_size); !why.empty()) throw Error("generate: " + why);
  if (!sampling.grammar.empty() && (!constraints || int(constraints->vocabulary().size()) != c.vocab_size))
    throw Error("generate: a grammar needs the constraints of the model's vocabulary");
}

int positions_needed(const Engine& engine, const std::vector<int>& prompt, int max_new_tokens) {
  return kv_positions_needed(int(prompt.size()), max_new_tokens, engine.config().seq_len);
}

// Samples token 0 from `logits` (after the prompt), then feeds each emitted
// token at the next position until the stop rule says stop (limit >= 1).
// With `spec`, each step also feeds the proposer's guesses after it (one row
// each, engine/speculation.h) and makes every token verify_draft() keeps; a
// step without guesses is the plain step.
GenerateResult decode_loop(Engine& engine, KvPool& pool, const std::vector<int>& blocks, const std::vector<int>& prompt,
                           std::vector<float> logits, int max_new_tokens, const SamplingParams& sampling,
                           Constraints* constraints, const Speculation* spec, SpeculationStats* stats,
                           const TokenSink& on_token) {
  const ModelConfig& c = engine.config();
  GenerateResult result;
  const int limit = token_limit(int(prompt.size()), max_new_tokens, c.seq_len);
  // The prompt, then the output: what the penalties read (only when they do).
  std::vector<int> history = sampling.uses_history() ? prompt : std::vector<int>{};
  // The same, always, for the proposer.
  std::vector<int> sequence = spec ? prompt : std::vector<int>{};
  const MaskFor mask_for = [&](const std::vector<int>& h, uint64_t step) {
    return constraints->mask(sampling.grammar, h, step);
  };
  SpeculationGate gate;
  GuessCost guess_cost;  // this engine's steps of 1 and of 1 + k rows, timed
  std::vector<int> draft;  // the guesses fed after the last token, whose rows `logits` holds after its own
  for (int step = 0;;) {
    const std::vector<Sampled> made =
        verify_draft(logits.data(), c.vocab_size, draft, sampling, uint64_t(step), history, c.end_tokens, mask_for);
    if (spec) {
      const int accepted = accepted_of(draft, made);
      gate.record(int(draft.size()), accepted);
      if (stats) {
        stats->proposed += int64_t(draft.size());
        stats->accepted += accepted;
        stats->steps += 1;
      }
    }
    for (const Sampled& sampled : made) {
      const std::optional<FinishReason> stop = check_stop(c.end_tokens, sampling.stop, sampled.token, step, limit);
      if (stop != FinishReason::eos) {
        result.tokens.push_back(sampled.token);
        if (sampling.logprobs >= 0) result.logprobs.push_back(sampled.logprobs);
        if (on_token) on_token(sampled.token);
      }
      if (spec) sequence.push_back(sampled.token);
      ++step;
      if (stop) {
        result.finish = *stop;
        return result;
      }
    }
    // Token `step` comes next.
    int room = guess_room(spec ? spec->num_tokens : 0, step, limit);
    draft.clear();
    if (room > 0 && spec->gated) room = gate.allowed(room, spec->priced ? guess_cost.share(1) : 0);
    if (room > 0) draft = spec->propose(sequence, room);
    if (int(draft.size()) > room) draft.resize(size_t(room));
    const int pos = int(prompt.size()) + step - 1;  // the last made token's
    std::vector<DecodeSlot> slots{DecodeSlot{made.back().token, pos, &blocks}};
    for (size_t i = 0; i < draft.size(); ++i) slots.push_back(DecodeSlot{draft[i], pos + 1 + int(i), &blocks});
    const auto started = std::chrono::steady_clock::now();
    logits = engine.decode_step(pool, slots);
    if (spec)
      guess_cost.record(int(slots.size()),
                        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
}

std::vector<int> all_blocks(int n) {
  std::vector<int> blocks(static_cast<size_t>(n));
  std::iota(blocks.begin(), blocks.end(), 0);
  return blocks;
}

}  // namespace

int kv_positions_needed(int prompt_len, int max_new_tokens, int seq_len) {
  // (in 64 bits: a peer's max_new_tokens near INT32_MAX must not wrap past the check)
  return int(std::min<int64_t>(seq_len, int64_t(prompt_len) + std::max(max_new_tokens, 1) - 1));
}

GenerateResult generate(Engine& engine, const std::vector<int>& prompt, int max_new_tokens,
                        const SamplingParams& sampling, Constraints* constraints) {
  return generate_speculative(engine, prompt, max_new_tokens, sampling, nullptr, constraints);
}

GenerateResult generate_speculative(Engine& engine, const std::vector<int>& prompt, int max_new_tokens,
                                    const SamplingParams& sampling, const Speculation* spec, Constraints* constraints,
                                    SpeculationStats* stats, const TokenSink& on_token) {
  check_request(engine, prompt, max_new_tokens, sampling, constraints);
  if (token_limit(int(prompt.size()), max_new_tokens, engine.config().seq_len) == 0) return {};

  std::vector<TokenLogprobs> prompt_logprobs;
  PrefillHooks hooks;
  if (sampling.prompt_logprobs >= 0) {
    prompt_logprobs.resize(prompt.size() - 1);
    const int vocab = engine.config().vocab_size;
    hooks.on_logits = [&, vocab](int first, int count, const float* logits) {
      for (int i = 0; i < count; ++i)
        if (size_t(first + i) + 1 < prompt.size())
          prompt_logprobs[size_t(first + i)] = token_logprobs(logits + size_t(i) * size_t(vocab), vocab,
                                                              prompt[size_t(first + i) + 1], sampling.prompt_logprobs);
    };
  }
  PrefillOutput prefilled = engine.prefill(prompt, hooks);
  const int n_blocks = KvPool::blocks_for(positions_needed(engine, prompt, max_new_tokens), kBlockSize);
  KvPool pool = kv_pool_for(engine, kBlockSize, n_blocks);
  const std::vector<int> blocks = all_blocks(n_blocks);
  KvView view;
  view.header.fingerprint = engine.fingerprint();
  view.header.shape = prefilled.shape;
  view.payload = prefilled.kv.data();
  pool.write(blocks, view);
  GenerateResult result = decode_loop(engine, pool, blocks, prompt, std::move(prefilled.logits), max_new_tokens,
                                      sampling, constraints, spec, stats, on_token);
  result.prompt_logprobs = std::move(prompt_logprobs);
  return result;
}

GenerateResult generate_stepwise(Engine& engine, const std::vector<int>& prompt, int max_new_tokens,
                                 const SamplingParams& sampling, Constraints* constraints) {
  check_request(engine, prompt, max_new_tokens, sampling, constraints);
  if (token_limit(int(prompt.size()), max_new_tokens, engine.config().seq_len) == 0) return {};

  const int n_blocks = KvPool::blocks_for(positions_needed(engine, prompt, max_new_tokens), kBlockSize);
  KvPool pool = kv_pool_for(engine, kBlockSize, n_blocks);
  const std::vector<int> blocks = all_blocks(n_blocks);
  std::vector<float> logits;
  for (size_t pos = 0; pos < prompt.size(); ++pos)
    logits = engine.decode_step(pool, {DecodeSlot{prompt[pos], int(pos), &blocks}});
  return decode_loop(engine, pool, blocks, prompt, std::move(logits), max_new_tokens, sampling, constraints, nullptr,
                     nullptr, {});
}

}  // namespace disagg::gpu
