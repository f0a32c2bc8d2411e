// Shape of a Llama-architecture transformer (a llama2.c header, or GGUF metadata).
#pragma once
#include <cstdint>
#include <algorithm>
#include <string>
#include <vector>

namespace disagg::gpu {

constexpr int kBosToken = 1;  // llama2.c's <s>, which ends a llama2.c generation

struct ModelConfig {
  int dim = 0;          // residual stream width
  int hidden_dim = 0;   // SwiGLU inner width
  int n_layers = 0;
  int n_heads = 0;      // query heads
  int n_kv_heads = 0;   // key/value heads (grouped-query attention)
  int vocab_size = 0;
  int seq_len = 0;      // maximum positions
  bool shared_classifier = true;  // wcls == token_embedding
  float rope_theta = 10000.0f;    // RoPE base: pair i of a head turns by pos * theta^(-2i/head_size)
  // Llama 3.1's frequency factors (GGUF tensor rope_freqs.weight, [head_size/2]):
  // pair i turns by pos * theta^(-2i/head_size) / rope_factors[i]; empty: none.
  std::vector<float> rope_factors{};
  // The ids that end a generation, from the model file's vocabulary
  // (gpu::end_tokens_of); a llama2.c checkpoint ends at BOS, as run.c does.
  std::vector<int> end_tokens{kBosToken};

  int head_size() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_size(); }
  int kv_group() const { return n_heads / n_kv_heads; }  // query heads per kv head
};

// The stop rule's token test, the one place every path (gpu::generate, the
// decode worker, a migrated sequence) asks: does `token` end the generation?
inline bool ends_generation(const std::vector<int>& end_tokens, int token) {
  return std::find(end_tokens.begin(), end_tokens.end(), token) != end_tokens.end();
}

// Empty string when the config is usable, else what is wrong with it.
std::string validate(const ModelConfig& config);

}  // namespace disagg::gpu
