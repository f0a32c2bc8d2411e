// Where K and V of a position live inside a block of the KV cache (see
// PagedKv in gpu/backend.h). One header for every reader and writer: the CPU
// and CUDA kernels, the engine's conversion to the wire format, the tests.
//
// A block of B positions (B a multiple of kTile) holds, for each layer l, at
// l * 2 * B * kv_dim floats from its start:
//   K: B / kTile tiles, tile t = [kv_dim][kTile]: element e of position
//      t*kTile + i at (t * kv_dim + e) * kTile + i;
//   V: [B][kv_dim], from B * kv_dim floats on.
// K is transposed per tile so the attention kernels read the 16 keys of a
// tile as one vector per head dimension (no gather, no transpose), and the
// CUDA lanes that score 16 positions read consecutive floats.
#pragma once

#include "gpu/backend.h"
#include "gpu/fixed_math.h"

namespace disagg::gpu::kv_layout {

constexpr int kTile = fixed::kKeyTile;  // positions per K tile

// Floats from a layer's region to element e of K at position p of the block.
static inline HD long long k_index(int kv_dim, int p, int e) {
  return ((long long)(p / kTile) * kv_dim + e) * kTile + p % kTile;
}
// Floats from a layer's region to the V row of position p of the block.
static inline HD long long v_index(int block_size, int kv_dim, int p) {
  return ((long long)block_size + p) * kv_dim;
}
// Layer `layer`'s region in the block that holds position pos of `row`.
static inline HD float* layer_region(const PagedKv& kv, int layer, long long row, int pos) {
  const long long block = kv.tables[row * kv.table_stride + pos / kv.block_size];
  return kv.data + block * kv.block_stride + (long long)layer * 2 * kv.block_size * kv.kv_dim;
}
// Positions a block must hold to take n positions: n rounded up to whole tiles.
static inline HD int padded(int n) { return (n + kTile - 1) / kTile * kTile; }

}  // namespace disagg::gpu::kv_layout
