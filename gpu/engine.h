// A model on a compute backend: the batched prefill of a prompt and the
// batched decode step over many sequences held in a paged KV pool.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/checkpoint.h"
#include "gpu/kv_format.h"

namespace disagg::gpu {

class Backend;
class KvPool;

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

// Bookkeeping of which pool blocks are free (no storage, no arithmetic).
class BlockAllocator {
 public:
  explicit BlockAllocator(int num_blocks);
  int num_blocks() const { return num_blocks_; }
  int free_blocks() const { return static_cast<int>(free_.size()); }
  // n blocks, or an empty vector when fewer than n are free (nothing taken).
  std::vector<int> allocate(int n);
  void release(const std::vector<int>& blocks);

 private:
  int num_blocks_;
  std::vector<int> free_;
};

// Paged KV storage on the engine's backend: num_blocks blocks, each holding
// block_size positions of K and V for every layer.
class KvPool {
 public:
  KvPool(Engine& engine, int block_size, int num_blocks);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  Engine& engine() const { return engine_; }  // whose backend holds the blocks
  int block_size() const { return block_size_; }
  int num_blocks() const { return num_blocks_; }
  static int blocks_for(int positions, int block_size) { return (positions + block_size - 1) / block_size; }

  // Copies positions [0, view.shape.n_positions) of a received KV cache into blocks.
  void write(const std::vector<int>& blocks, const KvView& view);

  float* data() { return data_; }  // backend memory, for Engine
  size_t block_stride() const;     // floats per block (all layers, K and V)

 private:
  Engine& engine_;
  int block_size_;
  int num_blocks_;
  float* data_ = nullptr;
};

}  // namespace disagg::gpu
