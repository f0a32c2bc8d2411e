// The KV cache of a decode worker: which blocks are free and which hold a cached prefix (BlockPool) and
// their storage on the engine's backend (KvPool), laid out as gpu/kv_layout.h
// says. No arithmetic: the engine's kernels read and write the blocks.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <unordered_map>
#include <vector>

#include "engine/kv_format.h"
#include "engine/kv_stream.h"

namespace disagg::gpu {

class Backend;

// What changed in a pool's prefix cache (the KV events a decode worker
// publishes to the router's index, in order).
struct BlockEvent {
  bool stored = false;  // true: a block now holds `hash`; false: no block does any more
  uint64_t hash = 0;
};

// Bookkeeping of the pool's blocks (no storage, no arithmetic), with a prefix
// cache as vLLM's block pool: each block has a reference count; a block whose
// KV is final may carry its engine/block_hash.h hash, and a later prompt that
// starts with the same blocks shares them (take_cached). A block nobody holds
// any more keeps its KV and hash in an LRU queue and is reused for other data
// only when no block without a hash is free. free_blocks() alone answers "how
// much room": free and cached-but-unheld blocks both count.
class BlockPool {
 public:
  explicit BlockPool(int num_blocks);
  int num_blocks() const { return num_blocks_; }
  int free_blocks() const { return int(free_.size() + lru_.size()); }
  int cached_blocks() const { return int(by_hash_.size()); }  // blocks with a hash, held or not
  bool holds(uint64_t hash) const { return by_hash_.count(hash) != 0; }  // some block, held or not
  int refs(int block) const { return refs_.at(size_t(block)); }

  // n blocks, each held once, or an empty vector when fewer than n are free
  // (nothing taken). Free blocks without a hash go first; then the least
  // recently released cached blocks, whose hashes are forgotten (events).
  std::vector<int> allocate(int n);
  // The blocks holding the longest prefix of `hashes` (at most max_blocks of
  // it), each now held once more.
  std::vector<int> take_cached(const std::vector<uint64_t>& hashes, int max_blocks);
  // One reference less on each block (a block may appear once per reference
  // its caller holds); a block nobody holds is free again, cached or not.
  // Checks everything before changing anything.
  void release(const std::vector<int>& blocks);
  // Held block `block` holds, from now on unchanged, the KV of the full block
  // named `hash`: later prompts may share it. False (and nothing changes)
  // when another block already holds that hash or `block` has another.
  bool publish(int block, uint64_t hash);

  // The events since the last call, oldest first.
  std::vector<BlockEvent> take_events();
  // Every hash the pool holds now (what an index resyncs from).
  std::vector<uint64_t> cached_hashes() const;

 private:
  void forget(int block);  // drops the block's hash (an event)

  int num_blocks_;
  std::vector<int> free_;             // free, no hash; the next one handed out at the back
  std::list<int> lru_;                // free, with a hash; least recently released first
  std::vector<std::list<int>::iterator> in_lru_;  // per block: its place in lru_, or lru_.end()
  std::vector<int> refs_;             // per block
  std::vector<uint64_t> hash_;        // per block (meaningful where has_hash_)
  std::vector<char> has_hash_;
  std::unordered_map<uint64_t, int> by_hash_;
  std::vector<BlockEvent> events_;
};

// A contiguous part of a pool's memory (backend memory, floats).
struct PoolSpan {
  float* data = nullptr;
  size_t floats = 0;
};

// Positions per KV block unless configured otherwise (block-size): one key
// tile (gpu/kv_layout.h); a pool's block size must be a multiple of it.
constexpr int kDefaultBlockSize = 16;

// Paged KV storage on a backend: num_blocks blocks, each holding block_size
// positions of K and V for every layer of a model whose KV is shaped `model`
// (its n_positions: the model's context), laid out as gpu/kv_layout.h says.
// (An engine makes its own: kv_pool_for, engine/engine.h.)
class KvPool {
 public:
  KvPool(Backend& backend, const KvShape& model, int block_size, int num_blocks);
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  Backend& backend() const { return backend_; }  // holds the blocks
  const KvShape& model() const { return model_; }
  int block_size() const { return block_size_; }
  int num_blocks() const { return num_blocks_; }
  static int blocks_for(int positions, int block_size) { return (positions + block_size - 1) / block_size; }

  // Copies positions [first, view.shape.n_positions) of a received KV cache
  // into blocks (those before `first`, a whole number of blocks, are left as
  // they are: shared blocks of the prefix cache that hold the same KV).
  void write(const std::vector<int>& blocks, const KvView& view, int first = 0);

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
  Backend& backend_;
  KvShape model_;
  int block_size_;
  int num_blocks_;
  float* data_ = nullptr;
};

}  // namespace disagg::gpu
