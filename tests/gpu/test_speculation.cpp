// Speculative decoding (engine/speculation.h): the n-gram proposer, the gate,
// and the rule that matters: generate_speculative() makes generate()'s tokens
// and log probabilities whatever the proposer says (always right, always
// wrong, random, n-gram lookup), greedy and sampled, with penalties, bias,
// min_tokens and a grammar, on f32 and quantized weights.
#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>

#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/constraint.h"
#include "engine/draft.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "engine/speculation.h"
#include "grammar/json_grammar.h"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "support/reference_cases.h"
#include "support/run_command.h"
#include "support/test_paths.h"
#include "text/tokenizer.h"

namespace disagg::gpu {
namespace {

TEST(Ngram, ProposesWhatFollowedTheLongestLatestMatch) {
  // ... 7 8 9 | 1 2 3 4 | 5 6 | 1 2 3 4: the suffix "1 2 3 4" matched at 3, then 5 6 1 2 3 4 follow.
  const std::vector<int> tokens = {7, 8, 9, 1, 2, 3, 4, 5, 6, 1, 2, 3, 4};
  EXPECT_EQ(propose_ngram(tokens, 1, 4, 3), (std::vector<int>{5, 6, 1}));
  EXPECT_EQ(propose_ngram(tokens, 1, 4, 100), (std::vector<int>{5, 6, 1, 2, 3, 4}));  // to the end, no further
  EXPECT_EQ(propose_ngram(tokens, 1, 4, 0), std::vector<int>{});
  // Latest first: "4" alone last occurred at 6 -> 5 6.
  EXPECT_EQ(propose_ngram({4, 9, 4, 5, 4}, 1, 1, 2), (std::vector<int>{5, 4}));
  // Longest first: "3 4" at 0 beats the later "4" at 3.
  EXPECT_EQ(propose_ngram({3, 4, 8, 4, 7, 3, 4}, 1, 2, 1), std::vector<int>{8});
  // Shorter than lookup_min: nothing.
  EXPECT_EQ(propose_ngram({1, 2, 5, 2}, 2, 3, 4), std::vector<int>{});
  EXPECT_EQ(propose_ngram({1, 2, 5, 2}, 1, 3, 4), (std::vector<int>{5, 2}));
  EXPECT_EQ(propose_ngram({}, 1, 3, 4), std::vector<int>{});
  EXPECT_EQ(propose_ngram({5}, 1, 3, 4), std::vector<int>{});
}

TEST(SpeculationGate, PausesLongerWhileProposalsFailAndResetsOnAHit) {
  SpeculationGate gate;
  auto closed_steps = [&] {  // steps until it opens again
    int n = 0;
    while (gate.allowed(4) == 0) ++n;
    return n;
  };
  EXPECT_EQ(gate.allowed(4), 4);
  gate.record(4, 0);
  EXPECT_EQ(closed_steps(), 1);
  gate.record(4, 0);
  EXPECT_EQ(closed_steps(), 2);
  gate.record(4, 0);
  EXPECT_EQ(closed_steps(), 4);
  gate.record(0, 0);  // no proposal: no verdict
  EXPECT_NE(gate.allowed(4), 0);
  gate.record(4, 1);
  EXPECT_NE(gate.allowed(4), 0);
  gate.record(4, 0);
  EXPECT_EQ(closed_steps(), 1);
  for (int i = 0; i < 20; ++i) {
    gate.record(4, 0);
    closed_steps();
  }
  gate.record(4, 0);
  EXPECT_EQ(closed_steps(), SpeculationGate::kMaxPause);
  EXPECT_EQ(gate.proposed(), 4 * 26);
  EXPECT_EQ(gate.accepted(), 1);
}

TEST(SpeculationGate, FeedsOneMoreThanTheLastStepAcceptedAndDoublesWhileAllAre) {
  SpeculationGate gate;
  EXPECT_EQ(gate.allowed(8), 8);
  gate.record(8, 2);
  EXPECT_EQ(gate.allowed(8), 3);
  gate.record(3, 3);
  EXPECT_EQ(gate.allowed(8), 6);
  gate.record(6, 6);
  EXPECT_EQ(gate.allowed(8), 8);
  EXPECT_EQ(gate.allowed(2), 2) << "never more than asked";
  gate.record(8, 0);
  EXPECT_EQ(gate.allowed(8), 0) << "paused";
  EXPECT_EQ(gate.allowed(8), 1) << "then one guess";
  gate.record(1, 1);
  EXPECT_EQ(gate.allowed(8), 2);
}

// A guess row's cost, fitted from steps' times: time = fixed + per_row x
// rows, the share in tokens of a step of `rows` plain rows.
TEST(GuessCost, FitsTheStepsTimesAndPricesAGuessRowInTokens) {
  GuessCost cost;
  EXPECT_EQ(cost.share(1), GuessCost::kUnmeasured) << "no steps: a row costs a whole step";
  for (int i = 0; i < 10; ++i) cost.record(1, 0.040);
  EXPECT_EQ(cost.share(1), GuessCost::kUnmeasured) << "steps of one size: no slope";
  for (int i = 0; i < 10; ++i) cost.record(5, 0.080);  // 30 ms + 10 ms a row
  EXPECT_NEAR(cost.share(1), 0.010 / 0.040, 1e-9);
  EXPECT_NEAR(cost.share(16), 16 * 0.010 / (0.030 + 16 * 0.010), 1e-9);
  // Recent steps weigh more: a machine that became 4x faster a row.
  for (int i = 0; i < 200; ++i) cost.record(i % 2 ? 1 : 5, i % 2 ? 0.0325 : 0.0425);
  EXPECT_NEAR(cost.share(1), 0.0025 / 0.0325, 1e-3);
  // Rows that cost nothing (or less than nothing, by the noise): free.
  GuessCost flat;
  for (int i = 0; i < 20; ++i) flat.record(1 + 4 * (i % 2), i % 2 ? 0.039 : 0.040);
  EXPECT_EQ(flat.share(1), 0.0);
}

TEST(SpeculationGate, FeedsOnlyTheGuessesThatPayForTheirRows) {
  // A fresh gate's estimate: right half the time.
  SpeculationGate gate;
  EXPECT_DOUBLE_EQ(gate.acceptance(), 0.5);
  EXPECT_EQ(gate.allowed(8, 0.2), 2);  // 0.5 and 0.25 pay, 0.125 does not
  gate.record(2, 2);
  EXPECT_NEAR(gate.acceptance(), 3.0 / 4.0, 1e-12);
  EXPECT_EQ(gate.allowed(8, 0.2), 5);  // 0.75^5 = 0.237, 0.75^6 = 0.178
  EXPECT_EQ(gate.allowed(3, 0.2), 3);  // and never more than asked
  // Always right: as many as the cap allows.
  for (int i = 0; i < 6; ++i) gate.record(4, 4);
  EXPECT_EQ(gate.allowed(8, 0.2), 8);
  // Cost 0 (rows measured free, or no price given): the cap alone.
  EXPECT_EQ(gate.allowed(16, 0), 16);

  // Guesses that do not pay: one now and then, to measure again, paid from
  // the probes' budget (kProbeAllowance + kProbeShare of the steps asked).
  SpeculationGate costly;
  const double price = 0.925;
  int64_t asked = 0;
  auto closed_steps = [&] {  // steps until it opens again (that step's allowed() is a probe of one)
    int n = 0;
    int fed;
    while (++asked, (fed = costly.allowed(4, price)) == 0) ++n;
    EXPECT_EQ(fed, 1);
    return n;
  };
  EXPECT_EQ(costly.allowed(4, price), 1);  // 0.5 < 0.925: a probe of one guess
  ++asked;
  costly.record(1, 0);  // wrong: 0.925 tokens spent, over the allowance
  // Paused one step, then closed until 0.5 + 0.01 x asked covers 0.925: step 43.
  EXPECT_EQ(closed_steps(), 41);
  EXPECT_EQ(asked, 43);
  costly.record(1, 1);  // right: 1 token back, and 0.33 -> 0.51 is still under the price: the last pause again
  EXPECT_EQ(closed_steps(), 1);
  EXPECT_EQ(asked, 45);
  costly.record(1, 0);  // wrong: 0.85 + 0.925 spent; the pause doubles (2), then the budget: step 128
  EXPECT_EQ(closed_steps(), 82);
  EXPECT_EQ(asked, 128);
  // An always-wrong proposer's probes, at any price, stay inside the budget
  // (the last one may overdraw it by its own price).
  for (const double p : {0.9, 0.4, 0.1}) {
    SpeculationGate wrong;
    double spent = 0;
    int late_probes = 0;
    for (int step = 1; step <= 2000; ++step) {
      const bool pays = wrong.acceptance() > p;  // (the first steps': a fresh estimate is 0.5)
      const int n = wrong.allowed(4, p);
      if (!pays) {
        ASSERT_LE(n, 1) << "a guess that does not pay is a probe of one";
        spent += n * p;
        late_probes += step > 1800 ? n : 0;
      }
      EXPECT_LE(spent, SpeculationGate::kProbeAllowance + SpeculationGate::kProbeShare * step + p)
          << "price " << p << ", step " << step;
      wrong.record(n, 0);
    }
    // And it goes on measuring: the last 200 steps still probed; at 0.9, where
    // the budget binds before the pauses do, it was spent.
    EXPECT_GT(late_probes, 0) << "price " << p;
    if (p > 0.5) EXPECT_GE(spent, SpeculationGate::kProbeShare * 2000 - 2 * p);
  }
  // Probes right every time: the estimate climbs past a price of 0.9 (it
  // tends to 11/12), and then a guess is fed at every step.
  for (int steps = 0; steps < 1000 && costly.acceptance() <= 0.9; ++steps)
    if (const int n = costly.allowed(4, 0.9)) costly.record(n, n);
  EXPECT_GT(costly.acceptance(), 0.9);
  for (int i = 0; i < 5; ++i) {
    const int n = costly.allowed(4, 0.9);
    EXPECT_GE(n, 1) << "step " << i;
    costly.record(n, n);
  }
}

TEST(Speculation, RequestsResolveAgainstTheWorkersSettingsAndAreChecked) {
  const SpeculationParams worker{SpeculationMethod::ngram, 4, 1, 3};
  SpeculationParams r = resolve_speculation({}, worker);
  EXPECT_EQ(r.method, SpeculationMethod::ngram);
  EXPECT_EQ(r.num_tokens, 4);
  r = resolve_speculation({SpeculationMethod::off, 0, 0, 0}, worker);
  EXPECT_EQ(r.method, SpeculationMethod::off);
  r = resolve_speculation({SpeculationMethod::configured, 2, 0, 1}, worker);
  EXPECT_EQ(r.num_tokens, 2);
  EXPECT_EQ(r.lookup_max, 1);
  EXPECT_EQ(r.lookup_min, 1);
  EXPECT_EQ(resolve_speculation({SpeculationMethod::ngram, 0, 0, 0}, {SpeculationMethod::off, 4, 2, 5}).method,
            SpeculationMethod::ngram);
  EXPECT_EQ(check_speculation({}), "");
  EXPECT_NE(check_speculation({SpeculationMethod::ngram, kMaxSpeculativeTokens + 1, 0, 0}).find("num_speculative_tokens"),
            std::string::npos);
  EXPECT_NE(check_speculation({SpeculationMethod::ngram, 2, 4, 2}).find("exceeds"), std::string::npos);
  EXPECT_NE(check_speculation({SpeculationMethod(7), 2, 0, 0}).find("method"), std::string::npos);
  SamplingParams s;
  s.speculation.lookup_max = -1;
  EXPECT_NE(check_sampling(s, 10).find("prompt_lookup_max"), std::string::npos);
}

std::shared_ptr<const Checkpoint> stories() {
  static auto checkpoint = Checkpoint::open(test::shared_model());
  return checkpoint;
}

Proposer random_guesses(uint64_t seed, int vocab) {
  auto rng = std::make_shared<std::mt19937_64>(seed);
  return [rng, vocab](const std::vector<int>&, int max) {
    std::vector<int> out(size_t(std::uniform_int_distribution<int>(0, max)(*rng)));
    for (int& t : out) t = std::uniform_int_distribution<int>(0, vocab - 1)(*rng);
    return out;
  };
}

void expect_same(const GenerateResult& plain, const GenerateResult& spec) {
  EXPECT_EQ(plain.tokens, spec.tokens);
  EXPECT_EQ(plain.finish, spec.finish);
  ASSERT_EQ(plain.logprobs.size(), spec.logprobs.size());
  for (size_t i = 0; i < plain.logprobs.size(); ++i) {
    EXPECT_EQ(plain.logprobs[i].logprob, spec.logprobs[i].logprob) << i;
    EXPECT_EQ(plain.logprobs[i].top_tokens, spec.logprobs[i].top_tokens) << i;
  }
}

// Every proposer, each k, against plain decoding of the same request.
void expect_exact_under_every_proposer(Engine& engine, const std::vector<int>& prompt, int max_new,
                                       const SamplingParams& sampling, Constraints* constraints = nullptr) {
  const GenerateResult plain = generate(engine, prompt, max_new, sampling, constraints);
  ASSERT_FALSE(plain.tokens.empty());
  std::vector<int> streamed;
  generate_speculative(engine, prompt, max_new, sampling, nullptr, constraints, nullptr,
                       [&](int token) { streamed.push_back(token); });
  EXPECT_EQ(streamed, plain.tokens);
  const int vocab = engine.config().vocab_size;
  SpeculationParams ngram_params{SpeculationMethod::ngram, 4, 1, 3};
  for (int k : {1, 2, 4, 8}) {
    SCOPED_TRACE("k=" + std::to_string(k));
    struct Named {
      const char* name;
      Proposer p;
    };
    for (const Named& n : {Named{"oracle", oracle_proposer(plain.tokens, prompt.size())},
                           Named{"always wrong", wrong_proposer(plain.tokens, prompt.size(), vocab)},
                           Named{"random", random_guesses(uint64_t(k), vocab)},
                           Named{"ngram", ngram_proposer(ngram_params)}}) {
      SCOPED_TRACE(n.name);
      Speculation spec{n.p, k};
      // (the oracle's steps are counted: a guess's price, measured from the
      // steps' times, would make their number depend on the machine)
      spec.priced = std::string(n.name) != "oracle";
      SpeculationStats stats;
      std::vector<int> streamed;  // what a caller streaming the tokens was handed, in order
      const GenerateResult got = generate_speculative(engine, prompt, max_new, sampling, &spec, constraints, &stats,
                                                      [&](int token) { streamed.push_back(token); });
      expect_same(plain, got);
      EXPECT_EQ(streamed, got.tokens);
      if (std::string(n.name) == "oracle") {
        // Every guess right: k + 1 tokens a step.
        EXPECT_EQ(stats.accepted, stats.proposed);
        EXPECT_LE(stats.steps, int64_t(plain.tokens.size()) / (k + 1) + 2);
      }
      if (std::string(n.name) == "always wrong") EXPECT_EQ(stats.accepted, 0);
    }
  }
}

TEST(Speculation, GreedyTokensAreThePlainOnesWhateverIsProposed) {
  Engine engine(stories());
  for (const auto& c : test::load_all_reference_cases()) {
    SCOPED_TRACE(c.origin);
    expect_exact_under_every_proposer(engine, c.prompt_tokens, 48, SamplingParams{});
  }
}

TEST(Speculation, SampledTokensWithEveryControlAreThePlainOnes) {
  Engine engine(stories());
  const std::vector<int> prompt = test::load_all_reference_cases().front().prompt_tokens;
  SamplingParams s;
  s.temperature = 0.9f;
  s.top_p = 0.95f;
  s.top_k = 40;
  s.seed = 1234;
  s.logprobs = 3;
  expect_exact_under_every_proposer(engine, prompt, 60, s);
  s.repetition_penalty = 1.3f;
  s.frequency_penalty = 0.5f;
  s.presence_penalty = 0.4f;
  s.logit_bias = {{13, 2.5f}, {2, -1.0f}};
  s.stop.min_tokens = 20;
  expect_exact_under_every_proposer(engine, prompt, 60, s);
  s.temperature = 0.0f;  // greedy with the penalties
  expect_exact_under_every_proposer(engine, prompt, 60, s);
}

TEST(Speculation, StopTokensInsideAVerifiedRunEndItThere) {
  Engine engine(stories());
  const std::vector<int> prompt = test::load_all_reference_cases().front().prompt_tokens;
  const GenerateResult plain = generate(engine, prompt, 40, SamplingParams{});
  ASSERT_GE(plain.tokens.size(), 12u);
  SamplingParams s;
  s.stop.stop_token_ids = {plain.tokens[9]};  // its first occurrence ends the output there
  s.logprobs = 0;
  expect_exact_under_every_proposer(engine, prompt, 40, s);
  const GenerateResult cut = generate(engine, prompt, 40, s);
  EXPECT_EQ(cut.finish, FinishReason::eos);
  EXPECT_LE(cut.tokens.size(), 9u);
}

TEST(Speculation, ConstrainedTokensAreThePlainOnes) {
  Engine engine(stories());
  const Tokenizer tokenizer = Tokenizer::load(test::shared_tokenizer(), engine.config().vocab_size);
  Constraints constraints(grammar_vocabulary(tokenizer, engine.config().end_tokens));
  SamplingParams s;
  s.temperature = 1.0f;
  s.seed = 5;
  s.grammar = grammar::json_object_grammar().to_json();
  expect_exact_under_every_proposer(engine, {1}, 50, s, &constraints);
  s.temperature = 0.0f;
  expect_exact_under_every_proposer(engine, {1}, 50, s, &constraints);
}

// Quantized weights (Q4_0, Q8_0, Q4_K_M) run other matrix kernels, whose
// rows must not depend on how many rows a step has either.
TEST(Speculation, QuantizedModelsGiveThePlainTokens) {
  const ModelConfig config = {256, 512, 2, 4, 2, 512, 256, true};
  const std::string dir = test::make_temp_dir("speculation-quant");
  for (FileType type : {FileType::q4_0, FileType::q8_0, FileType::q4_k_m}) {
    const std::string path = dir + "/m.gguf";
    write_gguf(*random_weights(config, 29), byte_vocabulary(512), "s", path, type);
    Engine engine(Checkpoint::open(path));
    SCOPED_TRACE(path + " type " + std::to_string(int(type)));
    SamplingParams s;
    expect_exact_under_every_proposer(engine, {1, 300, 301, 302, 300, 301, 302, 300}, 40, s);
    s.temperature = 0.8f;
    s.seed = 9;
    expect_exact_under_every_proposer(engine, {1, 300, 301, 302, 300, 301, 302, 300}, 40, s);
  }
}

// A draft model's guesses after a sequence do not depend on what it guessed
// and fed before: its KV of the tokens it keeps is reused, the rest fed anew.
TEST(DraftModel, GuessesAfterCorrectionsAreAFreshDraftsGuesses) {
  Engine draft(stories());
  KvPool pool = kv_pool_for(draft, 16, 32);
  std::vector<int> a_blocks(16), b_blocks(16);
  std::iota(a_blocks.begin(), a_blocks.end(), 0);
  std::iota(b_blocks.begin(), b_blocks.end(), 16);
  DraftSequence running(draft, pool, a_blocks);
  std::vector<int> tokens = test::load_all_reference_cases().front().prompt_tokens;
  std::mt19937_64 rng(3);
  for (int step = 0; step < 30; ++step) {
    SCOPED_TRACE(step);
    const std::vector<int> guesses = running.propose(tokens, 4);
    ASSERT_FALSE(guesses.empty());
    DraftSequence fresh(draft, pool, b_blocks);
    EXPECT_EQ(fresh.propose(tokens, 4), guesses);
    // Accept some of the guesses, then a token of our own (a correction).
    const size_t keep = size_t(std::uniform_int_distribution<int>(0, int(guesses.size()))(rng));
    tokens.insert(tokens.end(), guesses.begin(), guesses.begin() + std::ptrdiff_t(keep));
    tokens.push_back(std::uniform_int_distribution<int>(3, 511)(rng));
  }
  // Its blocks hold 256 positions: the last guess is not fed, so 254 tokens leave room for 3 guesses, 257 for none.
  EXPECT_EQ(running.propose(std::vector<int>(254, 5), 4).size(), 3u);
  EXPECT_TRUE(running.propose(std::vector<int>(257, 5), 4).empty());
}

// A sequence far behind (a new one's prompt, a migrated one's output) is fed
// `catch_up` tokens a call, guessing nothing until the rest fits in one, so no
// step carries a whole prompt's draft prefill; its guesses then are those of
// a draft that fed it all at once (the chunks' KV is the whole prefill's).
TEST(DraftModel, AFarBehindSequenceCatchesUpOverSeveralSteps) {
  Engine draft(stories());
  KvPool pool = kv_pool_for(draft, 16, 32);
  std::vector<int> a_blocks(16), b_blocks(16);
  std::iota(a_blocks.begin(), a_blocks.end(), 0);
  std::iota(b_blocks.begin(), b_blocks.end(), 16);
  std::vector<int> tokens = test::load_all_reference_cases().front().prompt_tokens;
  while (tokens.size() < 60) tokens.insert(tokens.end(), tokens.begin() + 1, tokens.end());
  tokens.resize(60);
  DraftSequence chunked(draft, pool, a_blocks, 16);
  int empty = 0;
  std::vector<int> guesses;
  while ((guesses = chunked.propose(tokens, 4)).empty() && empty < 10) ++empty;
  ASSERT_FALSE(guesses.empty());
  EXPECT_EQ(empty, 3) << "59 tokens to feed before the last: 16, 16, 16, then 11 and the guesses";
  DraftSequence whole(draft, pool, b_blocks);
  EXPECT_EQ(guesses, whole.propose(tokens, 4));
}

// The target model as its own draft guesses right every time (greedy); a
// draft with random weights mostly wrong: the tokens are plain decoding's
// either way.
// A row whose grammar allows nothing (its mask throws): plain decoding
// makes the tokens before it, each in a step of its own, then fails there;
// a verification makes the same tokens (they were dropped with the error)
// and fails only when that row is its first.
TEST(Verification, ARowThatFailsEndsTheTokensMadeBeforeIt) {
  constexpr int kVocab = 8;
  const std::vector<int> draft = {3, 5, 1};
  std::vector<float> logits(size_t(kVocab) * (draft.size() + 1), 0.0f);
  for (size_t i = 0; i < draft.size(); ++i) logits[i * kVocab + size_t(draft[i])] = 4.0f;  // (greedy: every guess right)
  logits[draft.size() * kVocab + 6] = 4.0f;
  SamplingParams greedy;
  greedy.grammar = "(any)";
  auto all = std::make_shared<grammar::TokenMask>();
  all->bits.assign(1, (uint64_t(1) << kVocab) - 1);
  all->allowed = kVocab;
  for (const uint64_t failing : {uint64_t(12), uint64_t(10), uint64_t(99)}) {
    SCOPED_TRACE(failing);
    std::vector<int> history;
    const MaskFor mask_for = [&](const std::vector<int>&, uint64_t index) -> std::shared_ptr<const grammar::TokenMask> {
      if (index == failing) throw Error("the grammar allows no token here");
      return all;
    };
    if (failing == 10) {
      EXPECT_THROW(verify_draft(logits.data(), kVocab, draft, greedy, 10, history, {}, mask_for), Error)
          << "its first row: the step fails, as plain decoding's";
      continue;
    }
    const std::vector<Sampled> made = verify_draft(logits.data(), kVocab, draft, greedy, 10, history, {}, mask_for);
    std::vector<int> tokens;
    for (const Sampled& m : made) tokens.push_back(m.token);
    EXPECT_EQ(tokens, failing == 12 ? std::vector<int>({3, 5}) : std::vector<int>({3, 5, 1, 6}));
    EXPECT_EQ(history, tokens);
  }
}

TEST(DraftModel, AnyDraftGivesThePlainTokens) {
  Engine engine(stories());
  Engine same(stories());
  const std::string path = test::make_temp_dir("draft-model") + "/random.bin";
  ModelConfig shape = stories()->config();
  write_random_checkpoint(path, shape, 41);
  Engine other(Checkpoint::open(path));
  ASSERT_EQ(check_draft(engine.config(), other.config()), "");
  for (const auto& c : test::load_all_reference_cases()) {
    SCOPED_TRACE(c.origin);
    for (bool sampled : {false, true}) {
      SamplingParams s;
      if (sampled) {
        s.temperature = 0.8f;
        s.seed = 17;
        s.frequency_penalty = 0.3f;
      }
      const GenerateResult plain = generate(engine, c.prompt_tokens, 60, s);
      for (Engine* draft : {&same, &other}) {
        const Speculation spec{draft_proposer(*draft, int(c.prompt_tokens.size()), 60), 4};
        SpeculationStats stats;
        expect_same(plain, generate_speculative(engine, c.prompt_tokens, 60, s, &spec, nullptr, &stats));
        if (draft == &same && !sampled) EXPECT_EQ(stats.accepted, stats.proposed) << "its own draft is always right";
        if (draft == &same && !sampled) EXPECT_GT(stats.proposed, 0);
      }
    }
  }
  // Sized by the draft's context, not by what a user asks for (its pool was
  // prompt + max_new_tokens positions: terabytes, or a wrapped int, at INT_MAX).
  const Speculation unbounded{draft_proposer(other, 8, std::numeric_limits<int>::max()), 4};
  const std::vector<int> prompt = test::load_all_reference_cases().front().prompt_tokens;
  expect_same(generate(engine, prompt, 20, SamplingParams{}),
              generate_speculative(engine, prompt, 20, SamplingParams{}, &unbounded));
  ModelConfig fewer = shape;
  fewer.vocab_size = 300;
  EXPECT_NE(check_draft(engine.config(), fewer), "");
}

// disagg-generate --speculation: the same output line, the guesses' counts on stderr.
TEST(DraftModel, DisaggGenerateSpeculatesWithTheSameOutput) {
  const std::string base = test::shell_quoted(test::bin_dir() + "/disagg-generate") + " --model " +
                           test::shell_quoted(test::shared_model()) + " --tokenizer " +
                           test::shell_quoted(test::shared_tokenizer()) +
                           " --prompt 'Once upon a time' --max-new-tokens 120 --temperature 0 --json";
  const auto [plain, plain_status] = test::run_command(base + " 2>/dev/null");
  ASSERT_EQ(plain_status, 0);
  for (const std::string& flags : {std::string(" --speculation ngram --prompt-lookup-min 1"),
                                   " --speculation draft --draft-model " + test::shell_quoted(test::shared_model())}) {
    SCOPED_TRACE(flags);
    const auto [out, status] = test::run_command(base + flags + " 2>&1 >/dev/null");
    EXPECT_EQ(status, 0) << out;
    EXPECT_NE(out.find("guesses accepted"), std::string::npos) << out;
    const auto [line, line_status] = test::run_command(base + flags + " 2>/dev/null");
    EXPECT_EQ(line_status, 0);
    EXPECT_EQ(line, plain);
  }
  // Without --json the text streams as it is made: the prompt, then the same continuation.
  std::string text_mode = base.substr(0, base.size() - std::string(" --json").size());
  const auto [streamed, streamed_status] = test::run_command(text_mode + " --speculation ngram 2>/dev/null");
  EXPECT_EQ(streamed_status, 0);
  const std::string continuation = nlohmann::json::parse(plain)["text"].get<std::string>();
  ASSERT_GT(continuation.size(), 20u);
  EXPECT_EQ(streamed, "Once upon a time" + continuation + "\n");
  EXPECT_EQ(test::run_command(base + " --speculation draft 2>/dev/null").second, 2) << "draft needs --draft-model";
  EXPECT_EQ(test::run_command(base + " --speculation eagle 2>/dev/null").second, 2);
}

}  // namespace
}  // namespace disagg::gpu
