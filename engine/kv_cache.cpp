// The KV cache's block bookkeeping and storage (engine/kv_cache.h).
#include "engine/kv_cache.h"

#include <algorithm>
#include <string>

#include "gpu/backend.h"
#include "gpu/error.h"
#include "gpu/kv_layout.h"

namespace disagg::gpu {

// ---------------------------------------------------------------- BlockPool

BlockPool::BlockPool(int num_blocks) : num_blocks_(num_blocks) {
  if (num_blocks < 0) throw Error("BlockPool: negative block count " + std::to_string(num_blocks));
  // Highest id at the back, so allocate() hands out low ids first.
  for (int b = num_blocks - 1; b >= 0; --b) free_.push_back(b);
  in_lru_.assign(size_t(num_blocks), lru_.end());
  refs_.assign(size_t(num_blocks), 0);
  hash_.assign(size_t(num_blocks), 0);
  has_hash_.assign(size_t(num_blocks), 0);
}

void BlockPool::forget(int block) {
  if (!has_hash_[size_t(block)]) return;
  by_hash_.erase(hash_[size_t(block)]);
  events_.push_back({false, hash_[size_t(block)]});
  has_hash_[size_t(block)] = 0;
}

std::vector<int> BlockPool::allocate(int n) {
  if (n < 0 || n > free_blocks()) return {};
  std::vector<int> blocks;
  blocks.reserve(size_t(n));
  const int plain = std::min(n, int(free_.size()));
  blocks.assign(free_.end() - plain, free_.end());
  std::reverse(blocks.begin(), blocks.end());
  free_.resize(free_.size() - size_t(plain));
  while (int(blocks.size()) < n) {  // evict: the least recently released cached block
    const int b = lru_.front();
    lru_.pop_front();
    in_lru_[size_t(b)] = lru_.end();
    forget(b);
    blocks.push_back(b);
  }
  for (int b : blocks) refs_[size_t(b)] = 1;
  return blocks;
}

std::vector<int> BlockPool::take_cached(const std::vector<uint64_t>& hashes, int max_blocks) {
  std::vector<int> blocks;
  for (size_t i = 0; i < hashes.size() && int(i) < max_blocks; ++i) {
    auto it = by_hash_.find(hashes[i]);
    if (it == by_hash_.end()) break;
    const int b = it->second;
    if (refs_[size_t(b)]++ == 0) {
      lru_.erase(in_lru_[size_t(b)]);
      in_lru_[size_t(b)] = lru_.end();
    }
    blocks.push_back(b);
  }
  return blocks;
}

// Checks everything before releasing anything, so a bad call changes nothing.
void BlockPool::release(const std::vector<int>& blocks) {
  std::unordered_map<int, int> count;
  for (int b : blocks) {
    if (b < 0 || b >= num_blocks_) throw Error("BlockPool: release of unknown block " + std::to_string(b));
    if (++count[b] > refs_[size_t(b)])
      throw Error("BlockPool: block " + std::to_string(b) + " released more often than it is held (" +
                  std::to_string(refs_[size_t(b)]) + ")");
  }
  // In reverse, so that allocating as many again hands back the same run in
  // the same (ascending) order: consecutive blocks are one contiguous piece
  // per layer of a streamed KV (gpu/kv_layout.h). Cached blocks join the LRU
  // queue the same way, a sequence's last block first: the longest prefixes,
  // the least likely to be shared, are evicted first (as vLLM does).
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int b = *it;
    if (--refs_[size_t(b)] > 0) continue;
    if (has_hash_[size_t(b)]) in_lru_[size_t(b)] = lru_.insert(lru_.end(), b);
    else free_.push_back(b);
  }
}

bool BlockPool::publish(int block, uint64_t hash) {
  if (block < 0 || block >= num_blocks_ || refs_[size_t(block)] == 0)
    throw Error("BlockPool: publish of block " + std::to_string(block) + ", which nobody holds");
  if (has_hash_[size_t(block)]) return hash_[size_t(block)] == hash;
  if (!by_hash_.emplace(hash, block).second) return false;
  hash_[size_t(block)] = hash;
  has_hash_[size_t(block)] = 1;
  events_.push_back({true, hash});
  return true;
}

std::vector<BlockEvent> BlockPool::take_events() {
  std::vector<BlockEvent> out;
  out.swap(events_);
  return out;
}

std::vector<uint64_t> BlockPool::cached_hashes() const {
  std::vector<uint64_t> out;
  out.reserve(by_hash_.size());
  for (const auto& kv : by_hash_) out.push_back(kv.first);
  return out;
}

// ---------------------------------------------------------------- KvPool

KvPool::KvPool(Backend& backend, const KvShape& model, int block_size, int num_blocks)
    : backend_(backend), model_(model), block_size_(block_size), num_blocks_(num_blocks) {
  if (block_size <= 0 || block_size % kv_layout::kTile != 0)
    throw Error("KvPool: block size must be a positive multiple of " + std::to_string(kv_layout::kTile) + ", got " +
                std::to_string(block_size));
  if (num_blocks <= 0) throw Error("KvPool: block count must be positive, got " + std::to_string(num_blocks));
  data_ = static_cast<float*>(backend_.alloc_bytes(floats() * sizeof(float)));
}

KvPool::~KvPool() { backend_.free_bytes(data_); }

size_t KvPool::floats() const {
  return size_t(model_.n_layers) * 2 * size_t(num_blocks_) * size_t(block_size_) * model_.kv_dim();
}

void KvPool::write(const std::vector<int>& blocks, const KvView& view, int first) {
  const KvShape& shape = view.header.shape;
  const KvShape expected{model_.n_layers, model_.n_kv_heads, model_.head_dim, shape.n_positions};
  if (!(shape == expected))
    throw Error("KvPool::write: KV shape (layers " + std::to_string(shape.n_layers) + ", kv heads " +
                std::to_string(shape.n_kv_heads) + ", head dim " + std::to_string(shape.head_dim) +
                ") does not match the model (layers " + std::to_string(expected.n_layers) + ", kv heads " +
                std::to_string(expected.n_kv_heads) + ", head dim " + std::to_string(expected.head_dim) + ")");
  const int n = int(shape.n_positions);
  if (n == 0) return;
  if (uint32_t(n) > model_.n_positions)
    throw Error("KvPool::write: " + std::to_string(n) + " positions exceed seq_len " +
                std::to_string(model_.n_positions));
  if (!view.payload) throw Error("KvPool::write: KV view without payload");
  if (first < 0 || first > n || first % block_size_ != 0)
    throw Error("KvPool::write: first position " + std::to_string(first) + " is not a block's start within " +
                std::to_string(n) + " positions");
  if (first == n) return;
  const int needed = blocks_for(n, block_size_);
  if (int(blocks.size()) < needed)
    throw Error("KvPool::write: " + std::to_string(n) + " positions need " + std::to_string(needed) +
                " blocks, got " + std::to_string(blocks.size()));
  for (int i = 0; i < needed; ++i)
    if (blocks[i] < 0 || blocks[i] >= num_blocks_)
      throw Error("KvPool::write: block " + std::to_string(blocks[i]) + " outside the pool of " +
                  std::to_string(num_blocks_));

  // Stage the contiguous cache on the backend, then scatter each layer's
  // positions first..n-1 into the blocks with the decode step's own kv_write.
  Backend& b = backend_;
  DeviceArray<float> staged(b);
  staged.upload(view.payload, shape.floats());
  std::vector<int> host_ints(size_t(n) + size_t(needed));
  for (int p = 0; p < n; ++p) host_ints[size_t(p)] = p;
  std::copy_n(blocks.begin(), needed, host_ints.begin() + n);
  DeviceArray<int> ints(b);
  ints.upload(host_ints.data(), host_ints.size());

  PagedKv kv;
  kv.data = data_;
  kv.block_size = block_size_;
  kv.num_blocks = num_blocks_;
  kv.kv_dim = int(shape.kv_dim());
  kv.tables = ints.get() + n;
  kv.table_stride = 0;
  const size_t plane = size_t(n) * shape.kv_dim();  // one layer's K (or V)
  const size_t skipped = size_t(first) * shape.kv_dim();
  for (uint32_t l = 0; l < shape.n_layers; ++l) {
    const float* k = staged.get() + 2 * l * plane;
    b.kv_write(kv, int(l), k + skipped, k + plane + skipped, ints.get() + first, n - first);
  }
  b.synchronize();
}

std::vector<PoolSpan> KvPool::stream_spans(const KvStreamPlan& plan, const std::vector<int>& blocks) {
  if (plan.block_size() != block_size_)
    throw Error("KvPool: a stream plan of " + std::to_string(plan.block_size()) + "-position blocks for a pool of " +
                std::to_string(block_size_));
  if (int(blocks.size()) < plan.blocks())
    throw Error("KvPool: " + std::to_string(plan.positions()) + " streamed positions need " +
                std::to_string(plan.blocks()) + " blocks, got " + std::to_string(blocks.size()));
  const int kv_dim = int(model_.kv_dim());
  std::vector<PoolSpan> spans;
  plan.for_each_region([&](int layer, bool value, int first_block, size_t floats) {
    const int block = blocks[size_t(first_block)];
    const auto run_blocks = (floats + size_t(block_size_) * size_t(kv_dim) - 1) / (size_t(block_size_) * size_t(kv_dim));
    if (block < 0 || size_t(block) + run_blocks > size_t(num_blocks_))
      throw Error("KvPool: blocks " + std::to_string(block) + ".." + std::to_string(block + int(run_blocks) - 1) +
                  " are not all in the pool of " + std::to_string(num_blocks_));
    for (size_t i = 1; i < run_blocks; ++i)
      if (size_t(first_block) + i >= blocks.size() || blocks[size_t(first_block) + i] != block + int(i))
        throw Error("KvPool: the plan's runs do not match the blocks (block " + std::to_string(first_block + int(i)) +
                    " of the prompt is not consecutive)");
    spans.push_back({data_ + kv_layout::plane_offset(num_blocks_, block_size_, kv_dim, layer, value ? 1 : 0) +
                         kv_layout::block_offset(block_size_, kv_dim, block),
                     floats});
  });
  return spans;
}

}  // namespace disagg::gpu
