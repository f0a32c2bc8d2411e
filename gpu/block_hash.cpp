#include "gpu/block_hash.h"

#include <xxhash.h>

#include <cstring>
#include <stdexcept>

namespace disagg::gpu {

uint64_t block_hash_seed(uint64_t fingerprint, int block_size, const std::string& cache_salt) {
  const uint64_t size = uint64_t(block_size);
  uint64_t seed = XXH3_64bits_withSeed(&size, sizeof size, fingerprint);
  return XXH3_64bits_withSeed(cache_salt.data(), cache_salt.size(), seed);
}

std::vector<uint64_t> block_hashes(const std::vector<int32_t>& tokens, int block_size, uint64_t seed) {
  if (block_size <= 0) throw std::invalid_argument("block_hashes: block size must be positive");
  const size_t full = tokens.size() / size_t(block_size);
  std::vector<uint64_t> hashes(full);
  uint64_t parent = seed;
  for (size_t i = 0; i < full; ++i) {
    parent = XXH3_64bits_withSeed(tokens.data() + i * size_t(block_size), sizeof(int32_t) * size_t(block_size),
                                  parent);
    hashes[i] = parent;
  }
  return hashes;
}

}  // namespace disagg::gpu
