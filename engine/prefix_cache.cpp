#include "engine/prefix_cache.h"

#include <algorithm>

#include "engine/block_hash.h"

namespace disagg::gpu {

PrefixCache::PrefixCache(Engine& engine, int block_size, int num_blocks)
    : engine_(engine), storage_(kv_pool_for(engine, block_size, num_blocks)), blocks_(num_blocks) {}

PrefixCache::Lookup PrefixCache::lookup(const std::vector<int32_t>& tokens, const std::string& cache_salt) {
  const int bs = block_size();
  Lookup l;
  l.hashes = block_hashes(tokens, bs, block_hash_seed(engine_.fingerprint(), bs, cache_salt));
  // (the last position is always computed: its logits give the first token)
  const int usable = tokens.empty() ? 0 : int(tokens.size() - 1) / bs;
  l.prefix.blocks = blocks_.take_cached(l.hashes, usable);
  l.prefix.pool = &storage_;
  return l;
}

void PrefixCache::keep(Lookup& l) {
  // (past the blocks the lookup took, those the pool holds already: the last
  // block of a prompt of whole blocks, never taken, is the usual one; making
  // it again would evict another prompt's block for nothing)
  int have = int(l.prefix.blocks.size());
  while (have < int(l.hashes.size()) && blocks_.holds(l.hashes[size_t(have)])) ++have;
  const int want = std::min(int(l.hashes.size()) - have, blocks_.free_blocks());
  std::vector<int> fresh;
  if (want > 0) fresh = blocks_.allocate(want);
  try {
    if (!fresh.empty()) engine_.keep_prefill_blocks(storage_, fresh, have);
  } catch (...) {
    release(l, fresh);
    throw;
  }
  for (size_t j = 0; j < fresh.size(); ++j) blocks_.publish(fresh[j], l.hashes[size_t(have) + j]);
  release(l, fresh);
}

void PrefixCache::drop(Lookup& l) { release(l, {}); }

void PrefixCache::release(Lookup& l, const std::vector<int>& more) {
  std::vector<int> held = l.prefix.blocks;
  held.insert(held.end(), more.begin(), more.end());
  blocks_.release(held);
  l.prefix = {};
}

}  // namespace disagg::gpu
