// The prefix cache's key of a KV block (vLLM's chained block hashes): block i
// of a sequence, positions [i*B, (i+1)*B), is named by the hash of its B
// tokens chained over the hash of block i-1, so one hash stands for the whole
// prefix up to the block's end, and equal hashes mean equal KV (the fixed
// arithmetic makes a position's K and V a function of the tokens up to it
// alone: gpu/fixed_math.h). The chain starts from a seed over what else
// changes the KV or must keep caches apart: the model's fingerprint, the
// block size and the request's cache salt (tenants who must not share).
// Only full blocks have hashes; a partial block is never shared.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace disagg::gpu {

// The chain's start for one model, block size and salt ("" for none).
uint64_t block_hash_seed(uint64_t fingerprint, int block_size, const std::string& cache_salt);

// The hashes of the full blocks of `tokens` (tokens.size() / block_size of
// them), in order.
std::vector<uint64_t> block_hashes(const std::vector<int32_t>& tokens, int block_size, uint64_t seed);

// `hashes`, those of the first hashes.size() full blocks of `tokens`, made
// those of all its full blocks: only the new blocks are hashed (a sequence
// that grew since).
void extend_block_hashes(std::vector<uint64_t>& hashes, const std::vector<int32_t>& tokens, int block_size,
                         uint64_t seed);

}  // namespace disagg::gpu
