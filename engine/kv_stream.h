// How a prompt's KV moves from a prefill cache into a decode worker's pool
// blocks as contiguous pieces, with no copy or reshuffle on either side: the
// index arithmetic of the streamed KV transfer (docs/kv-transfer.md), shared
// by the sender (which range of its cache is which piece) and the receiver
// (which pool memory takes which bytes).
//
// Both sides keep the KV in the layout of gpu/kv_layout.h: a plane per
// (layer, K or V), blocks in order within it. The prefill cache is a pool of
// one block of P = padded(prompt_len) positions; the decode pool has blocks
// of B positions (B a multiple of kTile), and the prompt goes into the first
// ceil(P / B) blocks of its reservation. In either, positions [p0, p1)
// (multiples of kTile) of a plane are contiguous as long as they stay in one
// block, or in consecutive blocks: the receiver's blocks fall into *runs* of
// consecutive ids (the allocator hands out runs), and a piece never crosses a
// run.
//
// Positions [0, S) may be in the blocks already (S = first_position, a
// multiple of B: the decode worker holds that prefix in its prefix cache,
// engine/kv_cache.h BlockPool): they are not sent. The transfer's byte space is
// the prefill cache's planes from S on, N = P - S positions each:
//   offset of (layer l, K or V, position p) = 4 * kv_dim * (2*l*N + (V ? N : 0) + p - S)
// and a piece's source is (l, V, p)'s own offset in the cache (the same
// formula with P for N and 0 for S: equal when nothing is skipped). The
// receiver registers one region per (layer, K or V, run from S on), in that
// order.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/kv_layout.h"

namespace disagg::gpu {

class KvStreamPlan {
 public:
  // Largest piece: large enough that the per-piece costs vanish at wire
  // speed (bench_kv_transfer: 4-16 MiB best over TCP), small enough to
  // pipeline a layer's K and V of a 512-position chunk.
  static constexpr size_t kMaxPieceBytes = size_t(4) << 20;

  // runs: how many consecutive block ids each run of the destination blocks
  // has, in order (runs_of); they must cover blocks(). Empty: every block is
  // a run of its own (always safe).
  // first_position: positions already in the destination blocks (S above;
  // a multiple of block_size, less than prompt_len).
  KvStreamPlan(int n_layers, int kv_dim, int prompt_len, int block_size, std::vector<int32_t> runs = {},
               int first_position = 0)
      : layers_(n_layers), kv_dim_(kv_dim), positions_(kv_layout::padded(prompt_len)), block_size_(block_size),
        skip_(first_position) {
    if (n_layers <= 0 || kv_dim <= 0 || prompt_len <= 0)
      throw std::invalid_argument("KvStreamPlan: layers, kv_dim and prompt_len must be positive");
    if (block_size <= 0 || block_size % kv_layout::kTile != 0)
      throw std::invalid_argument("KvStreamPlan: block size " + std::to_string(block_size) +
                                  " is not a positive multiple of " + std::to_string(kv_layout::kTile));
    if (first_position < 0 || first_position % block_size != 0 || first_position >= prompt_len)
      throw std::invalid_argument("KvStreamPlan: first position " + std::to_string(first_position) +
                                  " is not a whole number of blocks before the prompt's end");
    if (runs.empty()) runs.assign(size_t(blocks()), 1);
    int64_t covered = 0;  // (in 64 bits: a peer's runs and block size may be anything)
    for (int32_t r : runs) {
      if (r <= 0) throw std::invalid_argument("KvStreamPlan: a run of " + std::to_string(r) + " blocks");
      if (covered >= blocks()) break;
      covered += r;
      run_ends_.push_back(int(std::min<int64_t>(positions_, covered * block_size_)));
    }
    if (covered < blocks())
      throw std::invalid_argument("KvStreamPlan: runs cover " + std::to_string(covered) + " of " +
                                  std::to_string(blocks()) + " blocks");
    const size_t row_bytes = sizeof(float) * size_t(kv_dim_);
    max_piece_positions_ = std::max<int>(kv_layout::kTile, int(kMaxPieceBytes / row_bytes) / kv_layout::kTile *
                                                              kv_layout::kTile);
  }

  // The runs of consecutive ids among the first `count` of `blocks`.
  static std::vector<int32_t> runs_of(const std::vector<int32_t>& blocks, int count) {
    std::vector<int32_t> runs;
    for (int j = 0; j < count && j < int(blocks.size()); ++j) {
      if (j > 0 && blocks[size_t(j)] == blocks[size_t(j) - 1] + 1) ++runs.back();
      else runs.push_back(1);
    }
    return runs;
  }

  int block_size() const { return block_size_; }  // B: the destination pool's positions per block
  int positions() const { return positions_; }  // P: the prompt padded to whole tiles
  int blocks() const { return int((int64_t(positions_) + block_size_ - 1) / block_size_); }
  int first_position() const { return skip_; }  // S: what the destination holds already
  size_t total_bytes() const {
    return sizeof(float) * 2 * size_t(layers_) * size_t(positions_ - skip_) * size_t(kv_dim_);
  }

  // The destination regions in byte-space order: f(layer, is_value, index of
  // the run's first block among the prompt's blocks, floats). The region
  // starts at that block in plane (layer, K or V) of the pool.
  template <class F>
  void for_each_region(F&& f) const {
    for (int l = 0; l < layers_; ++l)
      for (int value = 0; value < 2; ++value) {
        int start = 0;
        for (int end : run_ends_) {
          start = std::max(start, skip_);  // (S is a block boundary)
          if (end > start) f(l, value == 1, start / block_size_, size_t(end - start) * size_t(kv_dim_));
          start = end;
        }
      }
  }

  // The pieces that carry cache positions [first, first + count) of layer
  // `layer`, first a multiple of kTile (a prefill chunk's start), less those
  // before S: f(byte offset in the transfer, byte offset of the source in
  // the cache, bytes). The range's end is rounded up to whole tiles (the
  // cache's padding goes along; decode overwrites those positions before
  // reading them).
  template <class F>
  void for_each_piece(int layer, int first, int count, F&& f) const {
    if (layer < 0 || layer >= layers_ || first < 0 || count <= 0 || first % kv_layout::kTile != 0 ||
        first + count > positions_)
      throw std::invalid_argument("KvStreamPlan: positions [" + std::to_string(first) + ", " +
                                  std::to_string(first + count) + ") of layer " + std::to_string(layer) +
                                  " are not a tile-aligned range of the prompt");
    const int end = std::min(positions_, kv_layout::padded(first + count));
    const int begin = std::max(first, skip_);
    const size_t row_bytes = sizeof(float) * size_t(kv_dim_);
    for (int value = 0; value < 2; ++value) {
      const size_t plane = size_t(layer) * 2 + size_t(value);
      const size_t source_plane = plane * size_t(positions_) * row_bytes;
      const size_t transfer_plane = plane * size_t(positions_ - skip_) * row_bytes;
      auto run = std::upper_bound(run_ends_.begin(), run_ends_.end(), begin);
      for (int p0 = begin; p0 < end;) {
        while (*run <= p0) ++run;
        const int p1 = std::min({end, *run, p0 + max_piece_positions_});
        f(transfer_plane + size_t(p0 - skip_) * row_bytes, source_plane + size_t(p0) * row_bytes,
          size_t(p1 - p0) * row_bytes);
        p0 = p1;
      }
    }
  }

 private:
  int layers_, kv_dim_, positions_, block_size_;
  int skip_ = 0;  // S
  int max_piece_positions_ = 0;
  std::vector<int> run_ends_;  // each run's end, in positions (the last one: P)
};

}  // namespace disagg::gpu
