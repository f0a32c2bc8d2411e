// How a prompt's KV moves from a prefill cache into a decode worker's pool
// blocks as contiguous pieces, with no copy or reshuffle on either side: the
// index arithmetic of the streamed KV transfer (docs/kv-transfer.md), shared
// by the sender (which piece of its cache goes where) and the receiver (which
// block memory takes which bytes).
//
// Both sides keep the KV in the block layout of gpu/kv_layout.h. The prefill
// cache is one block of P = padded(prompt_len) positions; the decode pool has
// blocks of B positions (B a multiple of kTile), and the prompt occupies the
// first ceil(P / B) blocks of its reservation. Since K is stored in whole
// tiles and V in whole rows, positions [p0, p1) (multiples of kTile) of one
// layer are one contiguous K range and one contiguous V range on both sides.
//
// The transfer's byte space (what kv::KvReceiver::expect registers, region by
// region) is the pool layout cut to the prompt's blocks:
//   for each layer l, for each block j of the prompt (n_j = its positions):
//     K of block j, layer l: n_j * kv_dim floats (tiles)
//     V of block j, layer l: n_j * kv_dim floats (rows)
// so byte offset of (l, j, K|V, position r within the block) is
//   4 * kv_dim * (2*l*P + 2*j*B + (V ? n_j : 0) + r).
// A piece never crosses a (layer, block, K|V) region.
#pragma once
#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>

#include "gpu/kv_layout.h"

namespace disagg::gpu {

class KvStreamPlan {
 public:
  KvStreamPlan(int n_layers, int kv_dim, int prompt_len, int block_size)
      : layers_(n_layers), kv_dim_(kv_dim), positions_(kv_layout::padded(prompt_len)), block_size_(block_size) {
    if (n_layers <= 0 || kv_dim <= 0 || prompt_len <= 0)
      throw std::invalid_argument("KvStreamPlan: layers, kv_dim and prompt_len must be positive");
    if (block_size <= 0 || block_size % kv_layout::kTile != 0)
      throw std::invalid_argument("KvStreamPlan: block size " + std::to_string(block_size) +
                                  " is not a positive multiple of " + std::to_string(kv_layout::kTile));
  }

  int positions() const { return positions_; }  // P: the prompt padded to whole tiles
  int blocks() const { return (positions_ + block_size_ - 1) / block_size_; }
  size_t total_bytes() const { return sizeof(float) * 2 * size_t(layers_) * size_t(positions_) * size_t(kv_dim_); }

  // The destination regions in byte-space order: f(layer, block index j,
  // is_value, float offset inside block j's memory, floats).
  template <class F>
  void for_each_region(F&& f) const {
    for (int l = 0; l < layers_; ++l)
      for (int j = 0; j < blocks(); ++j) {
        const size_t layer_base = size_t(l) * 2 * size_t(block_size_) * size_t(kv_dim_);
        const size_t floats = size_t(block_positions(j)) * size_t(kv_dim_);
        f(l, j, false, layer_base, floats);
        f(l, j, true, layer_base + size_t(block_size_) * size_t(kv_dim_), floats);
      }
  }

  // The pieces that carry cache positions [first, first + count) of layer
  // `layer`, first a multiple of kTile (a prefill chunk's start): f(byte
  // offset in the transfer, float offset in the prefill cache, bytes). The
  // range's end is rounded up to whole tiles (the cache's padding goes along;
  // decode overwrites those positions before reading them).
  template <class F>
  void for_each_piece(int layer, int first, int count, F&& f) const {
    if (layer < 0 || layer >= layers_ || first < 0 || count <= 0 || first % kv_layout::kTile != 0 ||
        first + count > positions_)
      throw std::invalid_argument("KvStreamPlan: positions [" + std::to_string(first) + ", " +
                                  std::to_string(first + count) + ") of layer " + std::to_string(layer) +
                                  " are not a tile-aligned range of the prompt");
    const int end = std::min(positions_, kv_layout::padded(first + count));
    const size_t kv = size_t(kv_dim_);
    const size_t cache_layer = size_t(layer) * 2 * size_t(positions_) * kv;  // floats
    for (int p0 = first; p0 < end;) {
      const int j = p0 / block_size_;
      const int p1 = std::min(end, (j + 1) * block_size_);
      const size_t r = size_t(p0 - j * block_size_);
      const size_t bytes = sizeof(float) * size_t(p1 - p0) * kv;
      const size_t block_base = 2 * (size_t(layer) * size_t(positions_) + size_t(j) * size_t(block_size_));
      f(sizeof(float) * kv * (block_base + r), cache_layer + size_t(p0) * kv, bytes);
      f(sizeof(float) * kv * (block_base + size_t(block_positions(j)) + r),
        cache_layer + (size_t(positions_) + size_t(p0)) * kv, bytes);
      p0 = p1;
    }
  }

 private:
  int block_positions(int j) const { return std::min(block_size_, positions_ - j * block_size_); }

  int layers_, kv_dim_, positions_, block_size_;
};

}  // namespace disagg::gpu
