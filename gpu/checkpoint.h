// A memory-mapped model file: a llama2.c checkpoint (format:
// ../shared/models/README.md) or a GGUF file of the llama architecture with
// F32 tensors (gpu/gguf.h; its vocabulary too). open() tells them apart by
// the GGUF magic.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpu/model_config.h"
#include "gpu/tokenizer.h"

namespace disagg::gpu {

// One layer's tensors: pointers into the mapped file; matrices are
// row-major "out x in".
struct LayerWeights {
  const float* rms_att = nullptr;  // (dim)
  const float* wq = nullptr;       // (n_heads*head_size, dim)
  const float* wk = nullptr;       // (kv_dim, dim)
  const float* wv = nullptr;       // (kv_dim, dim)
  const float* wo = nullptr;       // (dim, n_heads*head_size)
  const float* rms_ffn = nullptr;  // (dim)
  const float* w1 = nullptr;       // (hidden, dim): the gate
  const float* w2 = nullptr;       // (dim, hidden): down
  const float* w3 = nullptr;       // (hidden, dim): up
};

struct Weights {
  const float* token_embedding = nullptr;  // (vocab, dim)
  std::vector<LayerWeights> layers;        // n_layers
  const float* rms_final = nullptr;        // (dim)
  const float* wcls = nullptr;             // (vocab, dim); == token_embedding when shared
};

class Checkpoint {
 public:
  // Maps and validates the file and computes its fingerprint (reading every
  // byte once). Throws Error("<path>: <problem>") for a missing, truncated or
  // oversized file, non-positive or inconsistent dimensions; for a GGUF file
  // also a missing key or tensor, a shape that disagrees with the metadata, a
  // tensor type the engine does not compute with (F32 only so far).
  static std::shared_ptr<const Checkpoint> open(const std::string& path);

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

 private:
  Checkpoint() = default;
  void load_gguf(size_t file_size);
  std::string path_;
  ModelConfig config_;
  Weights weights_;
  uint64_t fingerprint_ = 0;
  std::optional<Vocabulary> vocabulary_;
  std::string name_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
};

// The tokenizer of a model: the file `tokenizer_path` names (its vocabulary
// size checked against the model's), else the vocabulary the model file
// carries (GGUF); throws Error when there is neither. Every role that needs
// text (disagg-generate, the router, the frontend) takes it from here.
Tokenizer load_tokenizer(const Checkpoint& checkpoint, const std::string& tokenizer_path);

// Writes `checkpoint`'s weights (F32) and `vocabulary` as a GGUF v3 file of
// the llama architecture (tensor names and metadata as llama.cpp's
// converter writes them; general.name `name`). Throws Error.
void write_gguf(const Checkpoint& checkpoint, const Vocabulary& vocabulary, const std::string& name,
                const std::string& path);

// Writes a llama2.c checkpoint with weights drawn from a seeded generator
// (used by disagg-make-model, tests and benchmarks). Throws Error on failure.
void write_random_checkpoint(const std::string& path, const ModelConfig& config, uint64_t seed);

}  // namespace disagg::gpu
