// disagg-generate: colocated generation (prefill + decode in one process) from
// the command line; the single-process reference for the disaggregated cluster.
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "apps/cli/cli.h"
#include "model/checkpoint.h"
#include "engine/engine.h"
#include "gpu/error.h"
#include "engine/generate.h"
#include "text/tokenizer.h"

namespace {

using namespace disagg::cli;

const std::string kUsage = std::string(
    "usage: disagg-generate --model M [--tokenizer T] (--prompt TEXT | --prompt-tokens \"1 403 407\")\n"
    "                       --max-new-tokens N [sampling flags]\n"
    "                       [--backend auto|cpu|cuda] [--weight-cache off|model|FOLDER] [--json]\n"
    "M: a llama2.c checkpoint (then --tokenizer is required) or a GGUF file (its own vocabulary\n"
    "unless --tokenizer names another). Prints the prompt and its continuation, or with --json one line\n"
    "{\"prompt_tokens\":[...],\"output_tokens\":[...],\"text\":\"...\"} (text: the continuation).\n") + "Sampling flags:\n" + kSamplingUsage;

struct Options {
  std::string model, tokenizer, backend = "auto", weight_cache;
  GenerationFlags gen;
  bool json = false;
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
    } else {
      throw UsageError{"unknown option " + flag};
    }
  }
  if (o.model.empty()) throw UsageError{"--model M is required"};
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

  EngineOptions engine_options;
  engine_options.backend = o.backend;
  engine_options.weight_cache = o.weight_cache;
  Engine engine(checkpoint, engine_options);
  const auto start = std::chrono::steady_clock::now();
  const GenerateResult result = generate(engine, prompt, o.gen.max_new_tokens, o.gen.sampling);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::string text = tokenizer.decode_all(prompt.back(), result.tokens);

  if (o.json) {
    nlohmann::ordered_json line;
    line["prompt_tokens"] = prompt;
    line["output_tokens"] = result.tokens;
    line["text"] = text;
    std::cout << json_line(line) << std::endl;
  } else {
    std::cout << prompt_text(tokenizer, prompt) << text << std::endl;
    std::cerr << "[" << engine.backend_name() << "] " << prompt.size() << " prompt tokens, "
              << result.tokens.size() << " generated ("
              << (result.finish == FinishReason::eos ? "end of sequence" : "length") << ") in " << seconds
              << " s\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return disagg::cli::main_with_usage("disagg-generate", kUsage.c_str(), argc, argv, parse_args, run);
}
