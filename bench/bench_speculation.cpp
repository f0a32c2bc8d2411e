// bench_speculation (scripts/bench speculation): what speculative decoding
// (engine/speculation.h) costs and gives, timed inside the process, ratios
// from one run.
//
//   step:    a verification step of k guesses (k + 1 rows of one sequence)
//            against a plain decode step, k = 1, 2, 4, 8, at a context of
//            --context positions (the median of --reps steps each);
//   bounds:  single-stream greedy decode of --tokens tokens, plain against
//            speculative at k = 4 with a proposer that is always right (an
//            oracle replaying the plain run: the ceiling) and one that is
//            always wrong (the floor), with the gate (engine/speculation.h)
//            and without it (every step verifies four wrong guesses), the
//            four taking turns for --rounds rounds (the median of each);
//   ngram:   with --reference FILE.jsonl (the shared reference prompts):
//            n-gram lookup on each prompt and on a repetitive task made of
//            it (the prompt, its plain continuation, the prompt again, so
//            that the model's next words repeat a passage), acceptance and
//            speedup against plain decoding, per case (those of fewer
//            than 16 tokens not timed) and summed per set.
// Every speculative run's tokens are checked equal to the plain run's; a
// difference exits 1.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/generate.h"
#include "engine/speculation.h"
#include "model/checkpoint.h"
#include "model_report.h"

namespace {

using namespace disagg::gpu;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

const char* kUsage =
    "usage: bench_speculation --model FILE [--threads 1,2] [--context 128] [--tokens 64] [--reps 15] [--rounds 3]\n"
    "                         [--reference FILE.jsonl] [--ngram-max-tokens 200]\n"
    "Prints JSON lines: per thread count the verification step's cost against a plain step\n"
    "(k = 1, 2, 4, 8), single-stream decode with an always-right and an always-wrong proposer\n"
    "against plain decoding, and with --reference n-gram lookup's acceptance and speedup.\n";

struct Options {
  std::string model, reference;
  std::vector<int> threads = {1, 2};
  int context = 128, tokens = 64, reps = 15, rounds = 3, ngram_max_tokens = 200;
};

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoi(item));
  return out;
}

// Deterministic prompt tokens of a model's vocabulary.
std::vector<int> prompt_of(int n, int vocab) {
  std::vector<int> p(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) p[size_t(i)] = 1 + int((uint64_t(i) * 2654435761u) % uint64_t(vocab - 1));
  return p;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Per entry of `rows`, the median time of a decode step of one sequence at
// `context` feeding that many rows (its last token and rows - 1 guesses).
// The sizes take turns within each repetition, so a neighbour's load on the
// machine falls on all of them alike.
std::vector<double> step_seconds(Engine& engine, KvPool& pool, const std::vector<int>& blocks, int context,
                                 const std::vector<int>& rows, int reps) {
  std::vector<std::vector<double>> times(rows.size());
  for (int i = 0; i <= reps; ++i)
    for (size_t n = 0; n < rows.size(); ++n) {
      std::vector<DecodeSlot> slots;
      for (int r = 0; r < rows[n]; ++r) slots.push_back(DecodeSlot{1 + r, context + r, &blocks});
      const auto t0 = Clock::now();
      engine.decode_step(pool, slots);
      if (i > 0) times[n].push_back(seconds_since(t0));  // (the first round warms)
    }
  std::vector<double> out;
  for (auto& t : times) out.push_back(median(t));
  return out;
}

// Decode time of a greedy generation of `tokens` tokens: from its first
// token, the prefill's, streamed, to its end, so the prompt's prefill is not
// counted (subtracting a run of one token's time left the noise of a long
// prompt's prefill in a short decode's).
struct Run {
  GenerateResult result;
  SpeculationStats stats;
  double decode_s = 0;
};
Run timed(Engine& engine, const std::vector<int>& prompt, int tokens, const Speculation* spec) {
  Run run;
  Clock::time_point first{};
  const TokenSink on_token = [&](int) {
    if (first == Clock::time_point{}) first = Clock::now();
  };
  run.result = generate_speculative(engine, prompt, tokens, SamplingParams{}, spec, nullptr, &run.stats, on_token);
  run.decode_s = first == Clock::time_point{} ? 1e-9 : std::max(1e-9, seconds_since(first));
  return run;
}

bool same_tokens(const Run& plain, const Run& spec, const char* what) {
  if (plain.result.tokens == spec.result.tokens) return true;
  std::fprintf(stderr, "bench_speculation: %s made other tokens than plain decoding\n", what);
  return false;
}

int run(const Options& o) {
  auto checkpoint = Checkpoint::open(o.model);
  EngineOptions cpu;
  cpu.backend = "cpu";
  Engine engine(checkpoint, cpu);
  const ModelConfig& c = engine.config();
  const int vocab = c.vocab_size;
  const int context = std::min(o.context, c.seq_len - 16);
  std::printf("{\"model\":\"%s\",\"cpu\":\"%s\",\"dim\":%d,\"layers\":%d,\"vocab\":%d}\n", o.model.c_str(),
              disagg::bench::cpu_name().c_str(), c.dim, c.n_layers, vocab);
  bool exact = true;
  for (const int t : o.threads) {
    omp_set_num_threads(t);
    // The step: one sequence whose first `context` positions are in the pool.
    const int bs = kDefaultBlockSize;
    const int n_blocks = KvPool::blocks_for(context + 16, bs);
    KvPool pool = kv_pool_for(engine, bs, n_blocks);
    std::vector<int> blocks(static_cast<size_t>(n_blocks));
    for (int i = 0; i < n_blocks; ++i) blocks[size_t(i)] = i;
    engine.prefill_chunk(pool, prompt_of(context, vocab), 0, blocks);
    const std::vector<int> ks = {1, 2, 4, 8};
    const std::vector<double> steps = step_seconds(engine, pool, blocks, context, {1, 2, 3, 5, 9}, o.reps);
    std::printf("{\"threads\":%d,\"context\":%d,\"plain_step_ms\":%.3f", t, context, steps[0] * 1e3);
    for (size_t i = 0; i < ks.size(); ++i) std::printf(",\"verify_k%d\":%.3f", ks[i], steps[i + 1] / steps[0]);
    std::printf("}\n");
    std::fflush(stdout);

    // The bounds: plain, the oracle at k = 4, the always-wrong proposer with
    // and without the gate; the four take turns for --rounds rounds, and
    // each one's median decode time counts.
    const std::vector<int> prompt = prompt_of(16, vocab);
    const Run base = timed(engine, prompt, o.tokens, nullptr);
    const Speculation oracle{oracle_proposer(base.result.tokens, prompt.size()), 4};
    const Speculation wrong{wrong_proposer(base.result.tokens, prompt.size(), vocab), 4};
    Speculation wrong_ungated = wrong;
    wrong_ungated.gated = false;
    const std::vector<const Speculation*> kinds = {nullptr, &oracle, &wrong, &wrong_ungated};
    std::vector<std::vector<double>> seconds(kinds.size());
    int64_t oracle_steps = 0, wrong_proposed = 0;
    for (int round = 0; round < o.rounds; ++round)
      for (size_t i = 0; i < kinds.size(); ++i) {
        const Run r = timed(engine, prompt, o.tokens, kinds[i]);
        exact = same_tokens(base, r, i == 0 ? "plain decoding again" : "a speculative run") && exact;
        seconds[i].push_back(r.decode_s);
        if (i == 1) oracle_steps = r.stats.steps;
        if (i == 2) wrong_proposed = r.stats.proposed;
      }
    const double plain_s = median(seconds[0]);
    const double tokens = double(base.result.tokens.size() - 1);  // (the first one is the prefill's)
    std::printf("{\"threads\":%d,\"tokens\":%d,\"rounds\":%d,\"plain_tok_s\":%.2f,\"oracle_k4\":%.3f,"
                "\"oracle_steps\":%lld,\"wrong_k4_gated\":%.3f,\"wrong_gated_guesses\":%lld,\"wrong_k4_every_step\":%.3f}\n",
                t, int(base.result.tokens.size()), o.rounds, tokens / plain_s, plain_s / median(seconds[1]),
                (long long)oracle_steps, plain_s / median(seconds[2]), (long long)wrong_proposed,
                plain_s / median(seconds[3]));
    std::fflush(stdout);
  }

  if (!o.reference.empty()) {
    omp_set_num_threads(o.threads.back());
    std::ifstream in(o.reference);
    if (!in) throw std::runtime_error("cannot read " + o.reference);
    std::string line;
    int index = 0;
    SpeculationParams params{SpeculationMethod::ngram, 4, 1, 4};
    const Speculation ngram{ngram_proposer(params), params.num_tokens};
    // Per set (the prompts, the repetitive tasks): guesses, accepted, and the
    // decode time plain and speculative, summed over its cases.
    struct Totals {
      int64_t cases = 0, proposed = 0, accepted = 0, tokens = 0, steps = 0;
      double plain_s = 0, spec_s = 0;
    } totals[2];
    auto report = [&](const std::string& name, const std::vector<int>& prompt, int tokens) {
      const Run base = timed(engine, prompt, tokens, nullptr);
      const Run spec = timed(engine, prompt, tokens, &ngram);
      exact = same_tokens(base, spec, name.c_str()) && exact;
      if (base.result.tokens.size() < 16) return base.result.tokens;  // (too short to time: an early end)
      Totals& t = totals[name.find("-repeat") != std::string::npos ? 1 : 0];
      t.cases += 1;
      t.proposed += spec.stats.proposed;
      t.accepted += spec.stats.accepted;
      t.tokens += int64_t(spec.result.tokens.size());
      t.steps += spec.stats.steps;
      t.plain_s += base.decode_s;
      t.spec_s += spec.decode_s;
      std::printf("{\"case\":\"%s\",\"prompt\":%zu,\"tokens\":%zu,\"proposed\":%lld,\"accepted\":%lld,"
                  "\"acceptance\":%.3f,\"tokens_per_step\":%.3f,\"speedup\":%.3f}\n",
                  name.c_str(), prompt.size(), base.result.tokens.size(), (long long)spec.stats.proposed,
                  (long long)spec.stats.accepted,
                  spec.stats.proposed ? double(spec.stats.accepted) / double(spec.stats.proposed) : 0.0,
                  double(spec.result.tokens.size()) / double(std::max<int64_t>(1, spec.stats.steps)),
                  base.decode_s / spec.decode_s);
      std::fflush(stdout);
      return base.result.tokens;
    };
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      const auto j = nlohmann::json::parse(line);
      std::vector<int> prompt = j.at("prompt_tokens").get<std::vector<int>>();
      const int tokens = std::min(o.ngram_max_tokens, c.seq_len - int(prompt.size()) - 1);
      const std::string name = "ref" + std::to_string(index++);
      const std::vector<int> continuation = report(name, prompt, tokens);
      // The repetitive task: the passage, then its start again.
      std::vector<int> again = prompt;
      again.insert(again.end(), continuation.begin(), continuation.end());
      again.insert(again.end(), prompt.begin() + 1, prompt.end());  // (without its BOS)
      if (int(again.size()) + 8 < c.seq_len)
        report(name + "-repeat", again, std::min(int(continuation.size()), c.seq_len - int(again.size()) - 1));
    }
    for (int set = 0; set < 2; ++set) {
      const Totals& t = totals[set];
      std::printf("{\"set\":\"%s\",\"cases\":%lld,\"proposed\":%lld,\"accepted\":%lld,\"acceptance\":%.3f,"
                  "\"tokens_per_step\":%.3f,\"speedup\":%.3f}\n",
                  set ? "repeat" : "prompts", (long long)t.cases, (long long)t.proposed, (long long)t.accepted,
                  t.proposed ? double(t.accepted) / double(t.proposed) : 0.0,
                  double(t.tokens) / double(std::max<int64_t>(1, t.steps)), t.plain_s / std::max(1e-9, t.spec_s));
    }
  }
  return exact ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string flag = argv[i];
      if (flag == "--help" || flag == "-h") {
        std::fputs(kUsage, stdout);
        return 0;
      }
      if (i + 1 >= argc) throw std::invalid_argument(flag + " needs a value");
      const std::string value = argv[++i];
      if (flag == "--model") o.model = value;
      else if (flag == "--threads") o.threads = parse_list(value);
      else if (flag == "--context") o.context = std::stoi(value);
      else if (flag == "--tokens") o.tokens = std::stoi(value);
      else if (flag == "--reps") o.reps = std::max(1, std::stoi(value));
      else if (flag == "--rounds") o.rounds = std::max(1, std::stoi(value));
      else if (flag == "--reference") o.reference = value;
      else if (flag == "--ngram-max-tokens") o.ngram_max_tokens = std::stoi(value);
      else throw std::invalid_argument("unknown option " + flag);
    }
    if (o.model.empty() || o.threads.empty()) throw std::invalid_argument("--model is needed");
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_speculation: %s\n%s", e.what(), kUsage);
    return 2;
  }
}
