// A prefill worker's prefix cache: the KV of recent prompts' full blocks, in
// a pool of its own with the decode pools' bookkeeping (engine/kv_cache.h
// BlockPool: chained block hashes, reference counts, an LRU of the blocks
// nobody holds). A prompt's lifecycle through it:
//
//   lookup(tokens, salt)  the longest cached prefix (all but the last
//                         position at most), its blocks held
//   engine.prefill(tokens, hooks, lookup.prefix)
//                         copies that prefix into the prompt's cache and
//                         computes only the rest (engine/engine.h)
//   keep(lookup)          after a prefill that succeeded: the prompt's full
//                         blocks not cached yet are copied in (evicting the
//                         least recently used), and every block is released
//   drop(lookup)          after one that failed: released, nothing kept
//
// Bounded by its block count; the blocks a lookup holds are never evicted.
// What it stores and evicts comes out as events (take_events), which its
// owner must take after each keep: they pile up otherwise.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/kv_cache.h"

namespace disagg::gpu {

class PrefixCache {
 public:
  PrefixCache(Engine& engine, int block_size, int num_blocks);

  struct Lookup {
    std::vector<uint64_t> hashes;  // the prompt's full blocks (engine/block_hash.h)
    PrefillPrefix prefix;          // its cached first blocks, held until keep() or drop()
  };
  Lookup lookup(const std::vector<int32_t>& tokens, const std::string& cache_salt);
  void keep(Lookup& lookup);
  void drop(Lookup& lookup);

  // What changed in the cache since the last call, oldest first, and all it
  // holds now: what the router's index of this worker follows (the KV events
  // of a decode pool, engine/kv_cache.h BlockPool).
  std::vector<BlockEvent> take_events() { return blocks_.take_events(); }
  std::vector<uint64_t> cached_hashes() const { return blocks_.cached_hashes(); }

  int block_size() const { return storage_.block_size(); }
  int num_blocks() const { return storage_.num_blocks(); }
  int cached_blocks() const { return blocks_.cached_blocks(); }

 private:
  void release(Lookup& lookup, const std::vector<int>& more);

  Engine& engine_;
  KvPool storage_;
  BlockPool blocks_;
};

}  // namespace disagg::gpu
