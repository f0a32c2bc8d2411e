// disagg-convert: a llama2.c checkpoint and its tokenizer as one GGUF file
// (F32, the llama architecture, the vocabulary inside), which every role
// then loads without --tokenizer.
#include <iostream>
#include <string>

#include "apps/cli/cli.h"
#include "gpu/checkpoint.h"
#include "gpu/tokenizer.h"

namespace {

using namespace disagg::cli;

const char* kUsage =
    "usage: disagg-convert --model M.bin --tokenizer T.bin --out OUT.gguf [--name NAME] [--type f32|q8_0|q4_0]\n"
    "Writes M (a llama2.c checkpoint) and T (its tokenizer) as a GGUF v3 file of the llama\n"
    "architecture: F32 tensors, or with --type q8_0 / q4_0 every matrix whose rows are whole blocks of 32\n"
    "quantized as ggml's reference quantizer does (norms stay F32). NAME (default: M's file name\n"
    "without extension) becomes general.name, the model's name in the HTTP API.\n";

struct Options {
  std::string model, tokenizer, out, name;
  disagg::gpu::WeightType type = disagg::gpu::WeightType::f32;
};

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") throw UsageError{};
    if (i + 1 >= argc) throw UsageError{flag + " needs a value"};
    const std::string value = argv[++i];
    if (flag == "--model") o.model = value;
    else if (flag == "--tokenizer") o.tokenizer = value;
    else if (flag == "--out") o.out = value;
    else if (flag == "--name") o.name = value;
    else if (flag == "--type" && value == "f32") o.type = disagg::gpu::WeightType::f32;
    else if (flag == "--type" && value == "q8_0") o.type = disagg::gpu::WeightType::q8_0;
    else if (flag == "--type" && value == "q4_0") o.type = disagg::gpu::WeightType::q4_0;
    else if (flag == "--type") throw UsageError{"--type must be f32, q8_0 or q4_0"};
    else throw UsageError{"unknown option " + flag};
  }
  if (o.model.empty() || o.tokenizer.empty() || o.out.empty())
    throw UsageError{"--model, --tokenizer and --out are required"};
  return o;
}

int run(const Options& o) {
  using namespace disagg::gpu;
  const auto checkpoint = Checkpoint::open(o.model);
  const Tokenizer tokenizer = Tokenizer::load(o.tokenizer, checkpoint->config().vocab_size);
  write_gguf(*checkpoint, tokenizer.vocabulary(), o.name.empty() ? checkpoint->name() : o.name, o.out, o.type);
  std::cout << o.out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return disagg::cli::main_with_usage("disagg-convert", kUsage, argc, argv, parse_args, run);
}
