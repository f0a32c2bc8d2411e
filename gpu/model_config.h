// Shape of a Llama-architecture transformer (a llama2.c header, or GGUF metadata).
#pragma once
#include <cstdint>
#include <string>

namespace disagg::gpu {

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

  int head_size() const { return dim / n_heads; }
  int kv_dim() const { return n_kv_heads * head_size(); }
  int kv_group() const { return n_heads / n_kv_heads; }  // query heads per kv head
};

// Empty string when the config is usable, else what is wrong with it.
std::string validate(const ModelConfig& config);

}  // namespace disagg::gpu
