// Memory-mapped llama2.c checkpoint (format: ../shared/models/README.md).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "gpu/model_config.h"

namespace disagg::gpu {

// Pointers into the mapped file; matrices are row-major "out x in".
struct Weights {
  const float* token_embedding = nullptr;  // (vocab, dim)
  const float* rms_att = nullptr;          // (layers, dim)
  const float* wq = nullptr;               // (layers, n_heads*head_size, dim)
  const float* wk = nullptr;               // (layers, kv_dim, dim)
  const float* wv = nullptr;               // (layers, kv_dim, dim)
  const float* wo = nullptr;               // (layers, dim, n_heads*head_size)
  const float* rms_ffn = nullptr;          // (layers, dim)
  const float* w1 = nullptr;               // (layers, hidden, dim)
  const float* w2 = nullptr;               // (layers, dim, hidden)
  const float* w3 = nullptr;               // (layers, hidden, dim)
  const float* rms_final = nullptr;        // (dim)
  const float* wcls = nullptr;             // (vocab, dim); == token_embedding when shared
};

class Checkpoint {
 public:
  // Maps and validates the file and computes its fingerprint (reading every
  // byte once). Throws Error("<path>: <problem>") for a missing, truncated or
  // oversized file, non-positive or inconsistent dimensions.
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

 private:
  Checkpoint() = default;
  std::string path_;
  ModelConfig config_;
  Weights weights_;
  uint64_t fingerprint_ = 0;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
};

// Writes a llama2.c checkpoint with weights drawn from a seeded generator
// (used by disagg-make-model, tests and benchmarks). Throws Error on failure.
void write_random_checkpoint(const std::string& path, const ModelConfig& config, uint64_t seed);

}  // namespace disagg::gpu
