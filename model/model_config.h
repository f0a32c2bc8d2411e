// Shape of a Llama-architecture transformer (a llama2.c header, or GGUF metadata).
#pragma once
#include <cstdint>
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "text/tokenizer.h"  // kBosToken

namespace disagg::gpu {

// The transformer variants computed (GGUF general.architecture).
enum class Architecture {
  llama,  // Llama 2/3, Mistral, TinyLlama, llama2.c: RoPE on adjacent pairs
  qwen2,  // Qwen2, Qwen2.5: Q/K/V biases, NeoX RoPE (pair i with i + head_size/2)
  qwen3,  // Qwen3: per-head RMSNorm of Q and K before RoPE (no biases), NeoX RoPE, a head size of its own
};
const char* to_string(Architecture a);  // the GGUF name: "llama", "qwen2", "qwen3"

struct ModelConfig {
  int dim = 0;          // residual stream width
  int hidden_dim = 0;   // SwiGLU inner width
  int n_layers = 0;
  int n_heads = 0;      // query heads
  int n_kv_heads = 0;   // key/value heads (grouped-query attention)
  int vocab_size = 0;
  int seq_len = 0;      // maximum positions
  bool shared_classifier = true;  // wcls == token_embedding
  Architecture arch = Architecture::llama;
  float rms_epsilon = 1e-5f;      // RMSNorm: w * x / sqrt(mean(x^2) + rms_epsilon) (llama2.c's 1e-5; Qwen 1e-6): rms_epsilon_in_range
  int head_dim = 0;               // per head (GGUF attention.key_length); 0: dim / n_heads
  float rope_theta = 10000.0f;    // RoPE base: pair i of a head turns by pos * theta^(-2i/head_size): rope_theta_in_range
  // Llama 3.1's frequency factors (GGUF tensor rope_freqs.weight, [head_size/2]):
  // pair i turns by pos * theta^(-2i/head_size) / rope_factors[i]; empty: none.
  std::vector<float> rope_factors{};
  // The ids that end a generation, from the model file's vocabulary
  // (gpu::end_tokens_of); a llama2.c checkpoint ends at BOS, as run.c does.
  std::vector<int> end_tokens{kBosToken};

  int head_size() const { return head_dim > 0 ? head_dim : dim / n_heads; }
  int q_dim() const { return n_heads * head_size(); }  // the query projection's width (dim, but Qwen3's)
  int kv_dim() const { return n_kv_heads * head_size(); }
  int kv_group() const { return n_heads / n_kv_heads; }  // query heads per kv head
  // Hugging Face's Llama q/k rows: each head's pairs are (i, i + head_size/2)
  // (its rotate_half), where a GGUF's converter permuted them to (2i, 2i+1).
  bool rotate_half = false;
  bool rope_neox() const { return rotate_half || arch == Architecture::qwen2 || arch == Architecture::qwen3; }
  bool qk_norm() const { return arch == Architecture::qwen3; }
  bool qkv_bias() const { return arch == Architecture::qwen2; }
};

// Llama 3.1's RoPE frequency factors for `config`'s head size and theta, as
// llama.cpp's converter computes them from rope_scaling {factor,
// low_freq_factor, high_freq_factor, original_max_position_embeddings}
// (Llama 3.2 1B: 32, 1, 4, 8192): 1 for short wavelengths, `factor` for
// long ones, interpolated between.
std::vector<float> llama3_rope_factors(const ModelConfig& config, float factor, float low_freq_factor,
                                       float high_freq_factor, int original_context);

// The widest head a config may have: no model's heads are over 1024 wide,
// and a file's head size sizes buffers (RoPE's factors, the attention's
// widths) before its tensors' shapes are checked.
constexpr int kMaxHeadSize = 1 << 14;

// The longest context a config may have (2,097,152 positions): the engine
// computes RoPE's angles for every position at load (seq_len x head size
// floats: 1 GiB at 2^21 x 128), so a file's context_length must not size
// that table unchecked. Longer than any model this CPU engine could serve.
constexpr int kMaxSeqLen = 1 << 21;

// Empty string when the config is usable, else what is wrong with it.
std::string validate(const ModelConfig& config);

// The ranges a model file's RoPE base and RMSNorm epsilon must be in,
// checked on the file's number (a double) before its float conversion,
// which is undefined past a float's range.
inline bool rope_theta_in_range(double theta) { return theta > 1.0 && theta <= double(std::numeric_limits<float>::max()); }
inline bool rms_epsilon_in_range(double epsilon) { return epsilon > 0.0 && epsilon <= 1e-2; }

}  // namespace disagg::gpu
