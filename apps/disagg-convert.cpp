// disagg-convert: a model file (a llama2.c checkpoint and its tokenizer, or
// a GGUF file) as one GGUF file of the type asked for (the llama
// architecture, the vocabulary inside), which every role then loads without
// --tokenizer.
#include <iostream>
#include <string>

#include "apps/cli/cli.h"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "text/tokenizer.h"

namespace {

using namespace disagg::cli;

const char* kUsage =
    "usage: disagg-convert --model M --out OUT.gguf [--tokenizer T.bin] [--name NAME]\n"
    "                      [--type f32|f16|bf16|q8_0|q4_0|q4_k_m|q5_k_m]\n"
    "Writes M (a llama2.c checkpoint with its tokenizer T, or a GGUF file, whose vocabulary is\n"
    "used unless T is named) as a GGUF v3 file of the llama architecture: F32 tensors, or with\n"
    "--type every matrix in that type (q8_0 / q4_0: those whose rows are whole blocks of 32),\n"
    "or llama.cpp's Q4_K_M mixture of Q4_K and Q6_K, quantized as ggml's reference quantizers\n"
    "do; norms stay F32. NAME (default: M's name)\n"
    "becomes general.name, the model's name in the HTTP API.\n";

struct Options {
  std::string model, tokenizer, out, name;
  disagg::gpu::FileType type = disagg::gpu::FileType::f32;
};

disagg::gpu::FileType parse_type(const std::string& value) {
  if (auto t = disagg::gpu::parse_file_type(value)) return *t;
  throw UsageError{std::string("--type must be one of ") + disagg::gpu::file_type_names()};
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (Flags flags(argc, argv); flags.next();) {
    const std::string& flag = flags.flag();
    const std::string& value = flags.value();
    if (flag == "--model") o.model = value;
    else if (flag == "--tokenizer") o.tokenizer = value;
    else if (flag == "--out") o.out = value;
    else if (flag == "--name") o.name = value;
    else if (flag == "--type") o.type = parse_type(value);
    else throw UsageError{"unknown option " + flag};
  }
  if (o.model.empty() || o.out.empty()) throw UsageError{"--model and --out are required"};
  return o;
}

int run(const Options& o) {
  using namespace disagg::gpu;
  const auto checkpoint = Checkpoint::open(o.model);
  const Tokenizer tokenizer = load_tokenizer(*checkpoint, o.tokenizer);
  write_gguf(*checkpoint_weights(checkpoint), tokenizer.vocabulary(), o.name.empty() ? checkpoint->name() : o.name,
             o.out, o.type);
  std::cout << o.out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return disagg::cli::main_with_usage("disagg-convert", kUsage, argc, argv, parse_args, run);
}
