#include "engine/block_hash.h"

#include <xxhash.h>

#include <cstring>
#include <stdexcept>

namespace disagg::gpu {

uint64_t block_hash_seed(uint64_t fingerprint, int block_size, const std::string& cache_salt) {
  const uint64_t size = uint64_t(block_size);
  uint64_t seed = XXH3_64bits_withSeed(&size, sizeof size, fingerprint);
  return XXH3_64bits_withSeed(cache_salt.data(), cache_salt.size(), seed);
}

void extend_block_hashes(std::vector<uint64_t>& hashes, const std::vector<int32_t>& tokens, int block_size,
                         uint64_t seed) {
  if (block_size <= 0) throw std::invalid_argument("block_hashes: block size must be positive");
  const size_t full = tokens.size() / size_t(block_size);
  if (hashes.size() > full) throw std::invalid_argument("block_hashes: more hashes than full blocks");
  uint64_t parent = hashes.empty() ? seed : hashes.back();
  for (size_t i = hashes.size(); i < full; ++i) {
    parent = XXH3_64bits_withSeed(tokens.data() + i * size_t(block_size), sizeof(int32_t) * size_t(block_size),
                                  parent);
    hashes.push_back(parent);
  }
}

std::vector<uint64_t> block_hashes(const std::vector<int32_t>& tokens, int block_size, uint64_t seed) {
  std::vector<uint64_t> hashes;
  extend_block_hashes(hashes, tokens, block_size, seed);
  return hashes;
}

}  // namespace disagg::gpu
