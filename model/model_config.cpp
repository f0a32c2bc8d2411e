#include "model/model_config.h"

#include <cmath>
#include <cstdint>
#include <limits>

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
  if (c.seq_len > kMaxSeqLen)
    return "context of " + std::to_string(c.seq_len) + " positions is above " + std::to_string(kMaxSeqLen);
  if (c.head_dim < 0) return "head_dim " + std::to_string(c.head_dim) + " is negative";
  if (c.head_dim == 0 && c.dim % c.n_heads != 0)
    return "dim " + std::to_string(c.dim) + " is not divisible by n_heads " + std::to_string(c.n_heads);
  if (c.n_heads % c.n_kv_heads != 0)
    return "n_heads " + std::to_string(c.n_heads) + " is not a multiple of n_kv_heads " +
           std::to_string(c.n_kv_heads);
  if (c.head_size() > kMaxHeadSize)
    return "head size " + std::to_string(c.head_size()) + " is above " + std::to_string(kMaxHeadSize);
  if (int64_t(c.n_heads) * c.head_size() > std::numeric_limits<int32_t>::max())
    return std::to_string(c.n_heads) + " heads of " + std::to_string(c.head_size()) + " values are too wide";
  if (c.head_size() % 2 != 0) return "head size " + std::to_string(c.head_size()) + " is odd (RoPE needs pairs)";
  return {};
}


std::vector<float> llama3_rope_factors(const ModelConfig& c, float factor, float low_freq_factor, float high_freq_factor,
                                       int original_context) {
  const double low_wavelen = double(original_context) / low_freq_factor;
  const double high_wavelen = double(original_context) / high_freq_factor;
  std::vector<float> factors;
  for (int i = 0; i < c.head_size(); i += 2) {
    const double freq = 1.0 / std::pow(double(c.rope_theta), double(i) / c.head_size());
    const double wavelen = 2 * M_PI / freq;
    if (wavelen < high_wavelen) {
      factors.push_back(1.0f);
    } else if (wavelen > low_wavelen) {
      factors.push_back(factor);
    } else {
      const double smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      factors.push_back(float(1.0 / ((1 - smooth) / factor + smooth)));
    }
  }
  return factors;
}

}  // namespace disagg::gpu
