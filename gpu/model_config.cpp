#include "gpu/model_config.h"

namespace disagg::gpu {

const char* to_string(Architecture a) {
  switch (a) {
    case Architecture::llama: return "llama";
    case Architecture::qwen2: return "qwen2";
    case Architecture::qwen3: return "qwen3";
  }
  return "?";
}

std::string validate(const ModelConfig& c) {
  if (c.dim <= 0 || c.hidden_dim <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.vocab_size <= 0 || c.seq_len <= 0) {
    return "dimensions must be positive (dim " + std::to_string(c.dim) + ", hidden " +
           std::to_string(c.hidden_dim) + ", layers " + std::to_string(c.n_layers) + ", heads " +
           std::to_string(c.n_heads) + ", kv heads " + std::to_string(c.n_kv_heads) + ", vocab " +
           std::to_string(c.vocab_size) + ", seq_len " + std::to_string(c.seq_len) + ")";
  }
  if (c.head_dim < 0) return "head_dim " + std::to_string(c.head_dim) + " is negative";
  if (c.head_dim == 0 && c.dim % c.n_heads != 0)
    return "dim " + std::to_string(c.dim) + " is not divisible by n_heads " + std::to_string(c.n_heads);
  if (c.n_heads % c.n_kv_heads != 0)
    return "n_heads " + std::to_string(c.n_heads) + " is not a multiple of n_kv_heads " +
           std::to_string(c.n_kv_heads);
  if (c.head_size() % 2 != 0) return "head size " + std::to_string(c.head_size()) + " is odd (RoPE needs pairs)";
  return {};
}

}  // namespace disagg::gpu
