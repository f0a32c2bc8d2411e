// Writing model files: a llama model's weights, read a row at a time from a
// WeightSource (a loaded checkpoint, or a seeded generator), as a llama2.c
// checkpoint or as a GGUF v3 file whose matrices are in the types a FileType
// names (quantized row by row with ggml's reference rounding). Nothing holds
// a whole tensor in F32, so an 8B-shaped Q4_0 file is written in a few MB.
// Used by disagg-make-model, disagg-convert, tests and benchmarks.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "model/checkpoint.h"
#include "model/llama_tensors.h"
#include "model/model_config.h"
#include "gpu/quant.h"
#include "text/tokenizer.h"

namespace disagg::gpu {

// The weights' types of a GGUF file, as llama.cpp's file types name them;
// the norms stay f32.
// - f32, f16, bf16, q8_0, q4_0: every matrix in that type (q8_0 / q4_0 keep
//   f32 for a matrix whose rows are not whole blocks of 32, as llama.cpp).
// - q4_k_m: llama-quantize's Q4_K_M mixture (llama-quant.cpp): Q4_K, with
//   Q6_K for the classifier (the embedding when it is shared) and for
//   attn_v and ffn_down on the layers use_more_bits picks. Where rows are
//   not whole superblocks of 256, llama.cpp falls back to Q5_0 / Q8_0; this
//   engine has no Q5_0, so Q8_0 takes its place (f16 where rows are not
//   whole blocks of 32 either).
// - q5_k_m: the same mixture with Q5_K in place of Q4_K (llama.cpp's Q5_K_M).
enum class FileType { f32, f16, bf16, q8_0, q4_0, q4_k_m, q5_k_m };
const char* to_string(FileType type);
// "f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m"; nullopt for any other name.
std::optional<FileType> parse_file_type(const std::string& name);
// "f32|f16|bf16|q8_0|q4_0|q4_k_m|q5_k_m", for usage texts.
const char* file_type_names();
// The type matrix `t` of layer `layer` is stored in within a file of `type`.
WeightType matrix_type(FileType type, Tensor t, int layer, const ModelConfig& config);

// A model's values as floats, a row at a time.
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual const ModelConfig& config() const = 0;
  // Row `row` of layer `layer`'s tensor t (shape_of(t).cols floats) into out.
  virtual void row(Tensor t, int layer, int64_t row, float* out) const = 0;
};

// The weights of a loaded model file (any type, widened or dequantized).
std::unique_ptr<WeightSource> checkpoint_weights(std::shared_ptr<const Checkpoint> checkpoint);
// Weights drawn from a seeded generator: value i of the llama2.c file that
// write_random_checkpoint(config, seed) writes, at any position, so the same
// seed gives the same model in either format.
std::unique_ptr<WeightSource> random_weights(const ModelConfig& config, uint64_t seed);

// A Hugging Face model directory of `weights`: config.json and
// model.safetensors (or `shards` files and model.safetensors.index.json),
// matrices in `type` (f32, f16 or bf16; vectors f32), a llama model's q/k
// rows in Hugging Face's rotate_half order (the inverse of llama.cpp's
// converter's permutation). No tokenizer files. Throws Error (RoPE factors,
// other types are not written).
void write_hf_directory(const WeightSource& weights, const std::string& dir, FileType type, int shards = 1);

// A GGUF v3 file of the llama architecture (tensor names and metadata as
// llama.cpp's converter writes them, general.name `name`) with `vocabulary`
// (SentencePiece as `llama`, byte-level BPE as `gpt2`, with its chat
// template) and the config's rope_factors as rope_freqs.weight. Throws
// Error. Every writer here writes a file whole or not at all
// (gpu::OutputFile): the file it replaces stays whole until the new one is
// renamed over it, so `weights` may be read from that very file.
void write_gguf(const WeightSource& weights, const Vocabulary& vocabulary, const std::string& name,
                const std::string& path, FileType type = FileType::f32);

// A llama2.c checkpoint of random_weights(config, seed). Throws Error.
void write_random_checkpoint(const std::string& path, const ModelConfig& config, uint64_t seed);

}  // namespace disagg::gpu
