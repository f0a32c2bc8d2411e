// A memory-mapped model file: a llama2.c checkpoint (format:
// ../shared/models/README.md) or a GGUF file of the llama architecture with
// F32, F16, BF16, Q8_0 or Q4_0 matrices (model/gguf.h; its vocabulary too).
// open() tells them apart by the GGUF magic. Weights stay in the mapping, in
// their type; the tensors' names and places: model/llama_tensors.h.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/llama_tensors.h"
#include "model/model_config.h"
#include "gpu/quant.h"
#include "text/tokenizer.h"

namespace disagg::gpu {

// A weight matrix in the mapped file, "out x in": rows of `type`
// (gpu/quant.h), as stored.
struct Matrix {
  const void* data = nullptr;
  WeightType type = WeightType::f32;
  const float* f32() const { return type == WeightType::f32 ? static_cast<const float*>(data) : nullptr; }
  bool operator==(const Matrix& o) const { return data == o.data && type == o.type; }
};

// One layer's tensors: pointers into the mapped file.
struct LayerWeights {
  const float* rms_att = nullptr;  // (dim)
  Matrix wq;                       // (n_heads*head_size, dim)
  Matrix wk;                       // (kv_dim, dim)
  Matrix wv;                       // (kv_dim, dim)
  Matrix wo;                       // (dim, n_heads*head_size)
  const float* rms_ffn = nullptr;  // (dim)
  Matrix w1;                       // (hidden, dim): the gate
  Matrix w2;                       // (dim, hidden): down
  Matrix w3;                       // (hidden, dim): up
  const float* bq = nullptr;       // qwen2: (n_heads*head_size) added to q
  const float* bk = nullptr;       // qwen2: (kv_dim) added to k
  const float* bv = nullptr;       // qwen2: (kv_dim) added to v
  const float* q_norm = nullptr;   // qwen3: (head_size), RMSNorm of each query head
  const float* k_norm = nullptr;   // qwen3: (head_size), RMSNorm of each key head
};

struct Weights {
  Matrix token_embedding;             // (vocab, dim)
  std::vector<LayerWeights> layers;   // n_layers
  const float* rms_final = nullptr;   // (dim)
  Matrix wcls;                        // (vocab, dim); == token_embedding when shared

  // Matrix t (is_matrix(t)) or norm t of layer `layer` (0 outside the layers).
  Matrix& matrix(Tensor t, int layer);
  const Matrix& matrix(Tensor t, int layer) const { return const_cast<Weights*>(this)->matrix(t, layer); }
  const float*& norm(Tensor t, int layer);
  const float* norm(Tensor t, int layer) const { return const_cast<Weights*>(this)->norm(t, layer); }
};

class Checkpoint {
 public:
  // Maps and validates the file and computes its fingerprint (reading every
  // byte once). Throws Error("<path>: <problem>") for a missing, truncated or
  // oversized file, non-positive or inconsistent dimensions; `path` may also
  // be a Hugging Face model directory (gpu/hf_model.cpp); for a GGUF file
  // also a missing key or tensor, a shape that disagrees with the metadata, a
  // tensor type the engine does not compute with (matrices: F32, F16, BF16,
  // Q8_0, Q4_0; norms: F32).
  //
  // `fingerprint_memo` (a file model: GGUF or llama2.c): where the
  // fingerprint is remembered, as the weight cache's folder is named (""
  // or "off": nowhere; "model": `<path>.fingerprint` beside the file; else
  // `<folder>/<file name>.fingerprint`). A memo is used only when it names
  // this very file unchanged (device, inode, size, modification and status
  // change times, the last of which no user can set): then the file is not
  // read to hash it; otherwise it is hashed and the memo (re)written.
  static std::shared_ptr<const Checkpoint> open(const std::string& path, const std::string& fingerprint_memo = "");

  ~Checkpoint();
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const std::string& path() const { return path_; }
  const ModelConfig& config() const { return config_; }
  const Weights& weights() const { return weights_; }
  // XXH3-64 of every byte of the file (header, i.e. the config, and all the
  // weights): two checkpoints with equal fingerprints produce interchangeable
  // KV caches; any changed, swapped or shuffled weight changes it. Computed by
  // open(), which thereby reads the whole file once.
  uint64_t fingerprint() const { return fingerprint_; }
  // The vocabulary the file carries (GGUF), or nullopt (llama2.c: a separate tokenizer file).
  const std::optional<Vocabulary>& vocabulary() const { return vocabulary_; }
  // The model's name: GGUF's general.name, else the file name without its extension.
  const std::string& name() const { return name_; }
  // The whole pages of [ptr, ptr + bytes) within the mapping leave the
  // process's memory (a copy was made of them: the engine's packed weights);
  // reading them again reads the file again, so it is safe with other users.
  void release(const void* ptr, size_t bytes) const;

 private:
  Checkpoint() = default;
  void load_gguf(size_t file_size);
  void load_hf(const std::string& dir);  // gpu/hf_model.cpp
  std::string path_;
  ModelConfig config_;
  Weights weights_;
  uint64_t fingerprint_ = 0;
  std::optional<Vocabulary> vocabulary_;
  std::string name_;
  void* mapping_ = nullptr;  // the file (a Hugging Face directory: its first shard)
  size_t mapping_size_ = 0;
  std::vector<std::pair<void*, size_t>> shards_;  // a Hugging Face directory's other files' mappings
  std::vector<std::vector<float>> widened_;       // vectors stored in 16 bits, as f32 (Hugging Face BF16 norms)
};

// The tokenizer of a model: the file `tokenizer_path` names (its vocabulary
// size checked against the model's), else the vocabulary the model file
// carries (GGUF); throws Error when there is neither. Every role that needs
// text (disagg-generate, the router, the frontend) takes it from here.
Tokenizer load_tokenizer(const Checkpoint& checkpoint, const std::string& tokenizer_path);

// Where a file kept for a model goes, as the weight-cache setting names it
// (EngineOptions::weight_cache, Checkpoint::open's fingerprint memo): ""
// for "" or "off"; for "model", `<model's folder>/<model's name><suffix>`
// (a Hugging Face model: inside its directory); else `<folder>/<model's
// name><suffix>`.
std::string model_side_file(const std::string& model_path, const std::string& folder, const std::string& suffix);

// Writing model files: model/model_writer.h.

}  // namespace disagg::gpu
