// Where K and V of a position live in the KV cache (see PagedKv in
// gpu/backend.h). One header for every reader and writer: the CPU and CUDA
// kernels, the engine's conversion to the wire format, the streamed KV
// transfer (engine/kv_stream.h), the tests.
//
// A pool of N blocks of B positions (B a multiple of kTile) is 2 * n_layers
// planes of N * B * kv_dim floats: plane 2l holds layer l's K of every block,
// plane 2l + 1 its V, block b at b * B * kv_dim floats into the plane:
//   K of a block: B / kTile tiles, tile t = [kv_dim][kTile]: element e of
//      position t*kTile + i at (t * kv_dim + e) * kTile + i;
//   V of a block: [B][kv_dim].
// K is transposed per tile so the attention kernels read the 16 keys of a
// tile as one vector per head dimension (no gather, no transpose), and the
// CUDA lanes that score 16 positions read consecutive floats. Planes rather
// than blocks outermost: consecutive blocks of one layer are contiguous, and
// a one-block pool (a prefill's cache) has the same layout as the positions
// of consecutive blocks, so KV moves between them in a few large pieces.
#pragma once

#include "gpu/backend.h"
#include "gpu/fixed_math.h"

namespace disagg::gpu::kv_layout {

constexpr int kTile = fixed::kKeyTile;  // positions per K tile

// Floats from a layer's region to element e of K at position p of the block.
static inline HD long long k_index(int kv_dim, int p, int e) {
  return ((long long)(p / kTile) * kv_dim + e) * kTile + p % kTile;
}
// Floats of one block's K (or V) of one layer.
static inline HD long long block_floats(int block_size, int kv_dim) { return (long long)block_size * kv_dim; }
// Floats from a plane's start to block b's part of it.
static inline HD long long block_offset(int block_size, int kv_dim, long long b) {
  return b * block_floats(block_size, kv_dim);
}
// Floats from the pool's start to plane (layer, K: value 0, V: value 1).
static inline HD long long plane_offset(int num_blocks, int block_size, int kv_dim, int layer, int value) {
  return ((long long)layer * 2 + value) * num_blocks * block_floats(block_size, kv_dim);
}
// Floats from a layer's K region of a block to the V row of position p of
// that block (the V plane follows the K plane of the layer).
static inline HD long long v_index(const PagedKv& kv, int p) {
  return (long long)kv.num_blocks * block_floats(kv.block_size, kv.kv_dim) + (long long)p * kv.kv_dim;
}
// Layer `layer`'s K region of the block that holds position pos of `row`
// (its V region: + v_index).
static inline HD float* layer_region(const PagedKv& kv, int layer, long long row, int pos) {
  const long long block = kv.tables[row * kv.table_stride + pos / kv.block_size];
  return kv.data + plane_offset(kv.num_blocks, kv.block_size, kv.kv_dim, layer, 0) +
         block_offset(kv.block_size, kv.kv_dim, block);
}
// Positions a block must hold to take n positions: n rounded up to whole tiles.
static inline HD int padded(int n) { return (n + kTile - 1) / kTile * kTile; }

}  // namespace disagg::gpu::kv_layout
