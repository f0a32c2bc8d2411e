#include "model/llama_tensors.h"

namespace disagg::gpu {

bool per_layer(Tensor t) { return t != Tensor::token_embedding && t != Tensor::rms_final && t != Tensor::wcls; }

bool is_matrix(Tensor t) {
  return t != Tensor::rms_att && t != Tensor::rms_ffn && t != Tensor::rms_final && t != Tensor::bq && t != Tensor::bk &&
         t != Tensor::bv && t != Tensor::q_norm && t != Tensor::k_norm;
}

std::string gguf_name(Tensor t, int layer) {
  const std::string blk = "blk." + std::to_string(layer) + ".";
  switch (t) {
    case Tensor::token_embedding: return "token_embd.weight";
    case Tensor::rms_att: return blk + "attn_norm.weight";
    case Tensor::wq: return blk + "attn_q.weight";
    case Tensor::wk: return blk + "attn_k.weight";
    case Tensor::wv: return blk + "attn_v.weight";
    case Tensor::wo: return blk + "attn_output.weight";
    case Tensor::rms_ffn: return blk + "ffn_norm.weight";
    case Tensor::w1: return blk + "ffn_gate.weight";
    case Tensor::w2: return blk + "ffn_down.weight";
    case Tensor::w3: return blk + "ffn_up.weight";
    case Tensor::rms_final: return "output_norm.weight";
    case Tensor::wcls: return "output.weight";
    case Tensor::bq: return blk + "attn_q.bias";
    case Tensor::bk: return blk + "attn_k.bias";
    case Tensor::bv: return blk + "attn_v.bias";
    case Tensor::q_norm: return blk + "attn_q_norm.weight";
    case Tensor::k_norm: return blk + "attn_k_norm.weight";
  }
  return "?";
}

std::string hf_name(Tensor t, int layer) {
  const std::string blk = "model.layers." + std::to_string(layer) + ".";
  switch (t) {
    case Tensor::token_embedding: return "model.embed_tokens.weight";
    case Tensor::rms_att: return blk + "input_layernorm.weight";
    case Tensor::wq: return blk + "self_attn.q_proj.weight";
    case Tensor::wk: return blk + "self_attn.k_proj.weight";
    case Tensor::wv: return blk + "self_attn.v_proj.weight";
    case Tensor::wo: return blk + "self_attn.o_proj.weight";
    case Tensor::rms_ffn: return blk + "post_attention_layernorm.weight";
    case Tensor::w1: return blk + "mlp.gate_proj.weight";
    case Tensor::w2: return blk + "mlp.down_proj.weight";
    case Tensor::w3: return blk + "mlp.up_proj.weight";
    case Tensor::rms_final: return "model.norm.weight";
    case Tensor::wcls: return "lm_head.weight";
    case Tensor::bq: return blk + "self_attn.q_proj.bias";
    case Tensor::bk: return blk + "self_attn.k_proj.bias";
    case Tensor::bv: return blk + "self_attn.v_proj.bias";
    case Tensor::q_norm: return blk + "self_attn.q_norm.weight";
    case Tensor::k_norm: return blk + "self_attn.k_norm.weight";
  }
  return "?";
}

TensorShape shape_of(Tensor t, const ModelConfig& c) {
  const int64_t dim = c.dim, hidden = c.hidden_dim, vocab = c.vocab_size;
  const int64_t q_dim = int64_t(c.n_heads) * c.head_size(), kv_dim = c.kv_dim();
  switch (t) {
    case Tensor::token_embedding:
    case Tensor::wcls: return {vocab, dim};
    case Tensor::rms_att:
    case Tensor::rms_ffn:
    case Tensor::rms_final: return {1, dim};
    case Tensor::wq: return {q_dim, dim};
    case Tensor::wk:
    case Tensor::wv: return {kv_dim, dim};
    case Tensor::wo: return {dim, q_dim};
    case Tensor::w1:
    case Tensor::w3: return {hidden, dim};
    case Tensor::w2: return {dim, hidden};
    case Tensor::bq: return {1, q_dim};
    case Tensor::bk:
    case Tensor::bv: return {1, kv_dim};
    case Tensor::q_norm:
    case Tensor::k_norm: return {1, c.head_size()};
  }
  return {0, 0};
}

Llama2cLayout::Llama2cLayout(const ModelConfig& c) : layers_(size_t(c.n_layers)) {
  for (int i = 0; i < kLlama2cTensorKinds; ++i) {
    const auto t = Tensor(i);
    const TensorShape s = shape_of(t, c);
    // The shape's product in size_t, saturated (negative dimensions: invalid, as large).
    const size_t one = mul_sat(size_t(s.rows), size_t(s.cols));
    floats_[i] = per_layer(t) ? mul_sat(layers_, one) : one;
  }
  if (c.shared_classifier) floats_[int(Tensor::wcls)] = 0;
  rope_unused_ = mul_sat(2, mul_sat(size_t(c.seq_len), size_t(c.head_size() / 2)));
}

size_t Llama2cLayout::offset(Tensor t, int layer) const {
  if (int(t) >= kLlama2cTensorKinds) return file_bytes() - kHeaderBytes;  // never in the file
  size_t at = 0;
  for (int i = 0; i < int(t); ++i) at += floats_[i];
  if (t == Tensor::wcls) at += rope_unused_;
  if (per_layer(t)) at += size_t(layer) * (floats_[int(t)] / layers_);
  return at;
}

size_t Llama2cLayout::file_bytes() const {
  size_t n = rope_unused_;
  for (size_t f : floats_) n = add_sat(n, f);
  return add_sat(kHeaderBytes, mul_sat(n, sizeof(float)));
}

}  // namespace disagg::gpu
