// The KV cache of a decode worker: which blocks are free (BlockAllocator) and
// their storage on the engine's backend (KvPool), laid out as gpu/kv_layout.h
// says. No arithmetic: the engine's kernels read and write the blocks.
#pragma once
#include <cstddef>
#include <vector>

#include "gpu/kv_format.h"
#include "gpu/kv_stream.h"

namespace disagg::gpu {

class Engine;

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

// A contiguous part of a pool's memory (backend memory, floats).
struct PoolSpan {
  float* data = nullptr;
  size_t floats = 0;
};

// Paged KV storage on the engine's backend: num_blocks blocks, each holding
// block_size positions of K and V for every layer (layout: gpu/kv_layout.h).
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

  // Where a prompt's KV streamed by `plan` goes when its blocks are `blocks`
  // (the first plan.blocks() of them, with the runs the plan was made with):
  // one span per (layer, K or V, run), in the order of the transfer's byte
  // space (KvStreamPlan::for_each_region). What a KV receiver registers (and
  // what a colocated prefill checks its target against). Throws Error for a
  // plan of another block size, too few blocks, or a block outside the pool.
  std::vector<PoolSpan> stream_spans(const KvStreamPlan& plan, const std::vector<int>& blocks);

  float* data() { return data_; }  // backend memory (gpu/kv_layout.h), for Engine and the KV receiver
  size_t floats() const;           // the pool's size: n_layers * 2 planes of num_blocks blocks

 private:
  Engine& engine_;
  int block_size_;
  int num_blocks_;
  float* data_ = nullptr;
};

}  // namespace disagg::gpu
