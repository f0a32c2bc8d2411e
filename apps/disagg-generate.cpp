// disagg-generate: colocated generation (prefill + decode in one process) from
// the command line; the single-process reference for the disaggregated cluster.
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "apps/cli/cli.h"
#include "model/checkpoint.h"
#include "engine/engine.h"
#include "gpu/error.h"
#include "engine/draft.h"
#include "engine/generate.h"
#include "engine/speculation.h"
#include "text/tokenizer.h"

namespace {

using namespace disagg::cli;
using namespace disagg::gpu;

const std::string kUsage = std::string(
    "usage: disagg-generate --model M [--tokenizer T] (--prompt TEXT | --prompt-tokens \"1 403 407\")\n"
    "                       --max-new-tokens N [sampling flags]\n"
    "                       [--backend auto|cpu|cuda] [--weight-cache off|model|FOLDER] [--json]\n"
    "                       [--speculation off|ngram|draft] [--num-speculative-tokens 4]\n"
    "                       [--prompt-lookup-min 2] [--prompt-lookup-max 4] [--draft-model FILE]\n"
    "M: a llama2.c checkpoint (then --tokenizer is required) or a GGUF file (its own vocabulary\n"
    "unless --tokenizer names another). Prints the prompt and its continuation as it is made, or with --json one line\n"
    "{\"prompt_tokens\":[...],\"output_tokens\":[...],\"text\":\"...\"} (text: the continuation).\n"
    "--speculation: speculative decoding (README, Speculative decoding): the same tokens, the guesses'\n"
    "counts on stderr; ngram guesses by prompt lookup, draft by --draft-model's greedy tokens.\n") + "Sampling flags:\n" + kSamplingUsage;

struct Options {
  std::string model, tokenizer, backend = "auto", weight_cache;
  GenerationFlags gen;
  bool json = false;
  SpeculationParams speculation{SpeculationMethod::off, 4, 2, 4};
  std::string draft_model;
};

Options parse_args(int argc, char** argv) {
  Options o;
  for (Flags flags(argc, argv, {"--json"}); flags.next();) {
    const std::string& flag = flags.flag();
    const std::string& value = flags.value();
    if (flag == "--json") {
      o.json = true;
      continue;
    }
    if (o.gen.take(flag, value)) continue;
    if (flag == "--model") {
      o.model = value;
    } else if (flag == "--tokenizer") {
      o.tokenizer = value;
    } else if (flag == "--backend") {
      if (value != "auto" && value != "cpu" && value != "cuda")
        throw UsageError{"--backend expects auto, cpu or cuda, got '" + value + "'"};
      o.backend = value;
    } else if (flag == "--weight-cache") {
      o.weight_cache = value;
    } else if (flag == "--speculation") {
      if (!parse_speculation_method(value, o.speculation.method))
        throw UsageError{"--speculation expects off, ngram or draft, got '" + value + "'"};
    } else if (flag == "--num-speculative-tokens") {
      o.speculation.num_tokens = int(parse_integer(flag, value, 1, kMaxSpeculativeTokens));
    } else if (flag == "--prompt-lookup-min") {
      o.speculation.lookup_min = int(parse_integer(flag, value, 1, kMaxLookupTokens));
    } else if (flag == "--prompt-lookup-max") {
      o.speculation.lookup_max = int(parse_integer(flag, value, 1, kMaxLookupTokens));
    } else if (flag == "--draft-model") {
      o.draft_model = value;
    } else {
      throw UsageError{"unknown option " + flag};
    }
  }
  if (o.model.empty()) throw UsageError{"--model M is required"};
  if (o.speculation.method == SpeculationMethod::draft && o.draft_model.empty())
    throw UsageError{"--speculation draft needs --draft-model FILE"};
  if (const std::string why = check_speculation(o.speculation); !why.empty()) throw UsageError{why};
  o.gen.require_complete();
  return o;
}

// The prompt as text: every piece after its predecessor, BOS itself printing nothing.
std::string prompt_text(const disagg::gpu::Tokenizer& tokenizer, const std::vector<int>& prompt) {
  std::string text;
  int previous = disagg::gpu::kBosToken;
  for (int token : prompt) {
    if (token != disagg::gpu::kBosToken) text += tokenizer.decode(previous, token);
    previous = token;
  }
  return text;
}

int run(const Options& o) {
  using namespace disagg::gpu;
  auto checkpoint = Checkpoint::open(o.model, o.weight_cache);
  const Tokenizer tokenizer = load_tokenizer(*checkpoint, o.tokenizer);
  const std::vector<int> prompt = o.gen.has_prompt ? tokenizer.encode(o.gen.prompt) : o.gen.prompt_tokens;
  // (a tokenizer that adds no BOS encodes "" to nothing: there is no last token to go on from)
  if (prompt.empty()) throw Error("the prompt is empty (no tokens): give --prompt some text or --prompt-tokens");

  EngineOptions engine_options;
  engine_options.backend = o.backend;
  engine_options.weight_cache = o.weight_cache;
  Engine engine(checkpoint, engine_options);
  // Speculation: the draft model's engine (draft) or the lookup (ngram); the same tokens either way.
  std::unique_ptr<Engine> draft;
  std::optional<Speculation> spec;
  if (o.speculation.method == SpeculationMethod::ngram) {
    spec = Speculation{ngram_proposer(o.speculation), o.speculation.num_tokens};
  } else if (o.speculation.method == SpeculationMethod::draft) {
    draft = std::make_unique<Engine>(Checkpoint::open(o.draft_model, o.weight_cache), engine_options);
    if (const std::string why = check_draft(engine.config(), draft->config()); !why.empty())
      throw Error("--draft-model: " + why);
    spec = Speculation{draft_proposer(*draft, int(prompt.size()), o.gen.max_new_tokens), o.speculation.num_tokens};
  }
  SpeculationStats stats;
  // Without --json the text streams: the prompt, then each token's piece as
  // it is made (a piece may end inside a UTF-8 character; the next ends it).
  TokenSink print_piece;
  int previous = prompt.back();
  if (!o.json) {
    std::cout << prompt_text(tokenizer, prompt) << std::flush;
    print_piece = [&](int token) {
      std::cout << tokenizer.decode(previous, token) << std::flush;
      previous = token;
    };
  }
  const auto start = std::chrono::steady_clock::now();
  const GenerateResult result = generate_speculative(engine, prompt, o.gen.max_new_tokens, o.gen.sampling,
                                                     spec ? &*spec : nullptr, nullptr, &stats, print_piece);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  if (o.json) {
    nlohmann::ordered_json line;
    line["prompt_tokens"] = prompt;
    line["output_tokens"] = result.tokens;
    line["text"] = tokenizer.decode_all(prompt.back(), result.tokens);
    std::cout << json_line(line) << std::endl;
  } else {
    std::cout << std::endl;
    std::cerr << "[" << engine.backend_name() << "] " << prompt.size() << " prompt tokens, "
              << result.tokens.size() << " generated ("
              << (result.finish == FinishReason::eos ? "end of sequence" : "length") << ") in " << seconds
              << " s\n";
  }
  if (spec)
    std::cerr << "speculation " << to_string(o.speculation.method) << ": " << stats.steps << " steps, "
              << stats.accepted << " of " << stats.proposed << " guesses accepted\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return disagg::cli::main_with_usage("disagg-generate", kUsage.c_str(), argc, argv, parse_args, run);
}
