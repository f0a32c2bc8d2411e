// The tensors of a llama model, named once for both file formats: their
// names in a GGUF file (as llama.cpp's converter writes them), their shapes,
// and their places in a llama2.c checkpoint (format: ../shared/models/README.md).
// The loader (model/checkpoint.cpp) and the writers (model/model_writer.cpp) read
// the layouts from here.
#pragma once
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "model/model_config.h"

namespace disagg::gpu {

// In llama2.c file order (the GGUF order is per layer: tensors()), then the
// vectors only other architectures have (qwen2's Q/K/V biases), which a
// llama2.c file never holds.
enum class Tensor {
  token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, wcls,
  bq, bk, bv,      // qwen2: Q/K/V biases
  q_norm, k_norm,  // qwen3: per-head RMSNorm weights of Q and K
};
constexpr int kLlama2cTensorKinds = 12;
constexpr int kTensorKinds = 17;

// True for the tensors each layer has one of.
bool per_layer(Tensor t);
// True for the weight matrices (the rest are vectors: norms, biases).
bool is_matrix(Tensor t);
// "token_embd.weight", "blk.<layer>.attn_q.weight", ...
std::string gguf_name(Tensor t, int layer);
// The same tensor in a Hugging Face checkpoint: "model.embed_tokens.weight",
// "model.layers.<layer>.self_attn.q_proj.weight", ...
std::string hf_name(Tensor t, int layer);

// A tensor's shape, "out x in": `rows` rows of `cols` values (a vector: one
// row). GGUF lists the dimensions the other way: {cols, rows}, or {cols}.
struct TensorShape {
  int64_t rows, cols;
};
TensorShape shape_of(Tensor t, const ModelConfig& c);

// The tensors of a model in GGUF file order: the embedding, each layer's
// (attention norm, q, k, v, [qwen2: their biases; qwen3: Q and K norms], output, FFN norm, gate,
// down, up), the final norm, the classifier unless it is shared. f(tensor,
// layer) for each (layer 0 outside the layers).
template <class F>
void for_each_tensor(const ModelConfig& c, F f) {
  f(Tensor::token_embedding, 0);
  for (int l = 0; l < c.n_layers; ++l) {
    for (Tensor t : {Tensor::rms_att, Tensor::wq, Tensor::wk, Tensor::wv}) f(t, l);
    if (c.qkv_bias())
      for (Tensor t : {Tensor::bq, Tensor::bk, Tensor::bv}) f(t, l);
    if (c.qk_norm())
      for (Tensor t : {Tensor::q_norm, Tensor::k_norm}) f(t, l);
    for (Tensor t : {Tensor::wo, Tensor::rms_ffn, Tensor::w1, Tensor::w2, Tensor::w3}) f(t, l);
  }
  f(Tensor::rms_final, 0);
  if (!c.shared_classifier) f(Tensor::wcls, 0);
}

// Saturating arithmetic: a header with absurd dimensions must yield an absurd
// expected size (reported as "truncated"), never a wrapped-around small one.
inline size_t mul_sat(size_t a, size_t b) {
  size_t r;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<size_t>::max() : r;
}
inline size_t add_sat(size_t a, size_t b) {
  size_t r;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<size_t>::max() : r;
}

// The llama2.c checkpoint: a header of 7 int32 (dim, hidden, layers, heads,
// kv heads, vocab (negative: a classifier of its own), seq len), then f32
// tensors in Tensor order, each holding every layer's one after the other,
// with two unused RoPE tables before the classifier.
struct Llama2cLayout {
  static constexpr size_t kHeaderInts = 7;
  static constexpr size_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

  explicit Llama2cLayout(const ModelConfig& c);
  // Floats of tensor t over all layers (0: the shared classifier), saturated.
  size_t floats(Tensor t) const { return floats_[int(t)]; }
  // Floats of the legacy RoPE tables (freq_cis_real, freq_cis_imag) nobody reads.
  size_t rope_unused() const { return rope_unused_; }
  // Float offset (after the header) of layer `layer`'s tensor t.
  size_t offset(Tensor t, int layer) const;
  size_t file_bytes() const;
  // Floats after the header (saturated).
  size_t values() const { return (file_bytes() - kHeaderBytes) / sizeof(float); }

 private:
  size_t floats_[kLlama2cTensorKinds];
  size_t rope_unused_;
  size_t layers_;
};

}  // namespace disagg::gpu
