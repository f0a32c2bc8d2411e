// A model on a compute backend: the batched prefill of a prompt and the
// batched decode step over many sequences held in a paged KV pool.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/checkpoint.h"
#include "gpu/kv_cache.h"
#include "gpu/kv_format.h"

namespace disagg::gpu {

class Backend;

// "auto": CUDA when built with it and a GPU is present, else CPU; "cpu"; "cuda".
struct EngineOptions {
  std::string backend = "auto";
};

struct PrefillOutput {
  KvShape shape;             // n_positions == number of prompt tokens
  std::vector<float> kv;     // KvLayout::layer_kv_position, shape.floats() values
  std::vector<float> logits; // last position, vocab_size values
};

// One sequence in a decode step: feed `token` at position `pos`; its KV for
// positions [0, pos) already lives in `blocks` of the pool, and the step
// writes position `pos` there too.
struct DecodeSlot {
  int token = 0;
  int pos = 0;
  const std::vector<int>* blocks = nullptr;
};

class Engine {
 public:
  Engine(std::shared_ptr<const Checkpoint> checkpoint, const EngineOptions& options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ModelConfig& config() const;
  uint64_t fingerprint() const;
  std::string backend_name() const;  // "cpu" or "cuda:<device name>"
  Backend& backend();
  KvShape kv_shape(int n_positions) const;
  KvExpectation kv_expectation() const;

  // All prompt tokens in one pass: GEMMs over the token dimension, causal attention.
  PrefillOutput prefill(const std::vector<int>& tokens);

  // One token for each slot; returns logits, slots.size() x vocab_size.
  std::vector<float> decode_step(KvPool& pool, const std::vector<DecodeSlot>& slots);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace disagg::gpu
