// disagg-make-model: writes a random model of any shape, so tests and
// benchmarks can run one: a llama2.c checkpoint with a matching byte
// tokenizer, or a GGUF file of any type with that vocabulary inside (the
// same weights for the same seed, quantized as ggml's reference does).
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>

#include "apps/cli/cli.h"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "gpu/error.h"
#include "text/hf_tokenizer.h"
#include "text/tokenizer.h"

namespace {

using namespace disagg::cli;

const char* kUsage =
    "usage: disagg-make-model --out DIR [--dim 64] [--hidden 172] [--layers 5] [--heads 8]\n"
    "                         [--kv-heads 4] [--vocab 512] [--seq-len 512] [--seed 42]\n"
    "                         [--format llama2c|gguf] [--type f32|f16|bf16|q8_0|q4_0|q4_k_m|q5_k_m]\n"
    "                         [--hf-tokenizer DIR] [--rope-theta 10000] [--rope-freqs llama3]\n"
    "                         [--arch llama|qwen2|qwen3] [--rms-epsilon 1e-5] [--head-dim N]\n"
    "Writes DIR/model.bin (random weights from --seed) and DIR/tokenizer.bin\n"
    "(a byte tokenizer with the same vocabulary), creating DIR; with --format gguf\n"
    "DIR/model.gguf instead: the same weights, the vocabulary inside, the matrices in\n"
    "--type (default f32), written a row at a time (any size fits in memory).\n"
    "--hf-tokenizer DIR (with --format gguf): the vocabulary of DIR/tokenizer.json and\n"
    "DIR/tokenizer_config.json (a Hugging Face byte-level BPE: Llama 3, Qwen) instead,\n"
    "padded to --vocab rows, with its special tokens and chat template: a file laid\n"
    "out like a real model of that family, with random weights. --rope-freqs llama3\n"
    "(GGUF): Llama 3.2's RoPE frequency factors (rope_freqs.weight). --arch qwen2 (GGUF):\n"
    "Qwen2's layout (Q/K/V biases, NeoX rotary); qwen3: Qwen3's (Q/K norms, NeoX rotary);\n"
    "--rms-epsilon: RMSNorm's (Qwen: 1e-6); --head-dim (GGUF): a head size other than dim/heads.\n";

struct Options {
  std::string out_dir;
  disagg::gpu::ModelConfig config;
  unsigned long long seed = 42;
  bool gguf = false;
  disagg::gpu::FileType type = disagg::gpu::FileType::f32;
  bool type_named = false;
  std::string hf_tokenizer;  // a directory with tokenizer.json, or empty
  bool rope_freqs = false;   // Llama 3.2's frequency factors
};

Options parse_args(int argc, char** argv) {
  Options o;
  o.config = {64, 172, 5, 8, 4, 512, 512, true};
  std::map<std::string, int*> dims = {
      {"--dim", &o.config.dim},           {"--hidden", &o.config.hidden_dim}, {"--layers", &o.config.n_layers},
      {"--heads", &o.config.n_heads},     {"--kv-heads", &o.config.n_kv_heads}, {"--vocab", &o.config.vocab_size},
      {"--seq-len", &o.config.seq_len}};
  for (Flags flags(argc, argv); flags.next();) {
    const std::string& flag = flags.flag();
    const std::string& value = flags.value();
    if (flag == "--out") {
      o.out_dir = value;
    } else if (flag == "--format") {
      if (value != "llama2c" && value != "gguf") throw UsageError{"--format must be llama2c or gguf"};
      o.gguf = value == "gguf";
    } else if (flag == "--type") {
      const auto type = disagg::gpu::parse_file_type(value);
      if (!type) throw UsageError{std::string("--type must be one of ") + disagg::gpu::file_type_names()};
      o.type = *type;
      o.type_named = true;
    } else if (flag == "--hf-tokenizer") {
      o.hf_tokenizer = value;
    } else if (flag == "--rope-theta") {
      char* end = nullptr;
      o.config.rope_theta = std::strtof(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(o.config.rope_theta > 1.0f)) throw UsageError{"--rope-theta must be > 1"};
    } else if (flag == "--arch") {
      if (value == "llama") o.config.arch = disagg::gpu::Architecture::llama;
      else if (value == "qwen2") o.config.arch = disagg::gpu::Architecture::qwen2;
      else if (value == "qwen3") o.config.arch = disagg::gpu::Architecture::qwen3;
      else throw UsageError{"--arch must be llama, qwen2 or qwen3"};
    } else if (flag == "--head-dim") {
      o.config.head_dim = static_cast<int>(parse_integer(flag, value, 2, 1024));
    } else if (flag == "--rms-epsilon") {
      char* end = nullptr;
      o.config.rms_epsilon = std::strtof(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(o.config.rms_epsilon > 0.0f && o.config.rms_epsilon <= 1e-2f))
        throw UsageError{"--rms-epsilon must be in (0, 0.01]"};
    } else if (flag == "--rope-freqs") {
      if (value != "llama3") throw UsageError{"--rope-freqs must be llama3"};
      o.rope_freqs = true;
    } else if (flag == "--seed") {
      o.seed = static_cast<unsigned long long>(parse_integer(flag, value, 0, LLONG_MAX));
    } else if (auto it = dims.find(flag); it != dims.end()) {
      *it->second = static_cast<int>(parse_integer(flag, value, 1, INT_MAX));
    } else {
      throw UsageError{"unknown option " + flag};
    }
  }
  if (o.out_dir.empty()) throw UsageError{"--out DIR is required"};
  if (o.type_named && !o.gguf && o.type != disagg::gpu::FileType::f32)
    throw UsageError{"--type needs --format gguf (a llama2.c checkpoint is f32)"};
  if (!o.hf_tokenizer.empty() && !o.gguf) throw UsageError{"--hf-tokenizer needs --format gguf"};
  if (o.rope_freqs && !o.gguf) throw UsageError{"--rope-freqs needs --format gguf"};
  if (o.config.rope_theta != 10000.0f && !o.gguf) throw UsageError{"--rope-theta needs --format gguf (llama2.c's is 10000)"};
  if ((o.config.arch != disagg::gpu::Architecture::llama || o.config.rms_epsilon != 1e-5f || o.config.head_dim != 0) &&
      !o.gguf)
    throw UsageError{"--arch, --rms-epsilon and --head-dim need --format gguf (a llama2.c checkpoint is llama2.c's)"};
  // (validated before the factors are made: they loop over the head size)
  if (std::string problem = disagg::gpu::validate(o.config); !problem.empty()) throw UsageError{problem};
  if (o.rope_freqs) o.config.rope_factors = disagg::gpu::llama3_rope_factors(o.config, 32.0f, 1.0f, 4.0f, 8192);
  if (std::string problem = disagg::gpu::validate(o.config); !problem.empty()) throw UsageError{problem};
  // Checked here so that a bad vocabulary leaves no model without its tokenizer.
  if (o.config.vocab_size < 259)
    throw UsageError{"--vocab must be at least 259 (3 special pieces and 256 byte pieces)"};
  return o;
}

// Writes DIR/model.bin and DIR/tokenizer.bin (or DIR/model.gguf) and prints their paths.
int run(const Options& options) {
  namespace fs = std::filesystem;
  fs::create_directories(options.out_dir);
  if (options.gguf) {
    const std::string model = (fs::path(options.out_dir) / "model.gguf").string();
    const fs::path hf(options.hf_tokenizer);
    const fs::path hf_config = hf / "tokenizer_config.json";
    disagg::gpu::write_gguf(*disagg::gpu::random_weights(options.config, options.seed),
                            options.hf_tokenizer.empty()
                                ? disagg::gpu::byte_vocabulary(options.config.vocab_size)
                                : disagg::gpu::read_hf_tokenizer((hf / "tokenizer.json").string(),
                                                                 fs::exists(hf_config) ? hf_config.string() : "",
                                                                 options.config.vocab_size),
                            fs::path(options.out_dir).filename().string(), model, options.type);
    std::cout << model << "\n";
    return 0;
  }
  const std::string model = (fs::path(options.out_dir) / "model.bin").string();
  const std::string tokenizer = (fs::path(options.out_dir) / "tokenizer.bin").string();
  disagg::gpu::write_random_checkpoint(model, options.config, options.seed);
  disagg::gpu::write_byte_tokenizer(tokenizer, options.config.vocab_size);
  std::cout << model << "\n" << tokenizer << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return disagg::cli::main_with_usage("disagg-make-model", kUsage, argc, argv, parse_args, run);
}
