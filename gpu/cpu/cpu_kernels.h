// The CPU backend's hot kernels (matrix products, attention, SwiGLU), written
// once in gpu/cpu/simd_kernels.inl over a 16-lane vector type and compiled
// three times: portable scalar code ("generic"), AVX2 + FMA ("avx2") and
// AVX-512 ("avx512"). All three follow the fixed arithmetic of
// gpu/fixed_math.h, so they return the same bits; the backend picks the widest
// one the CPU runs (or the one DISAGG_CPU_ISA names) once, at start.
//
// Threading is not in here: each kernel computes a sub-range, and the backend
// (gpu/backend_cpu.cpp) splits the work over its OpenMP threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/backend.h"
#include "gpu/quant.h"

namespace disagg::gpu::cpu {

// Weight matrices W[n][k] ("out x in") are stored as panels of kPanel output
// columns: panel p holds W[16p .. 16p+15][kk] as k rows of 16 floats
// (zero-padded past n), so a product streams each panel front to back.
constexpr int kPanel = 16;

// The version of the layouts this header draws (panels, tiles): raised with
// any change to them, so a weight cache of the old layout (engine/
// weight_cache.h) is rebuilt rather than read.
constexpr int kLayoutVersion = 1;

// Query rows that share one block table (a prefill) are attended in groups of
// this many, so each K/V tile is read from memory once for all of them.
constexpr int kQueryRows = 128;

// Key tiles scored at once per attention step: the dot products of 4 tiles
// run as independent FMA chains.
constexpr int kSuperTiles = 4;

size_t packed_floats(int n, int k);
void pack_matrix(const float* w, float* packed, int n, int k);
// The same layout for a matrix of 16-bit floats (f16, bf16): packed_floats(n,
// k) values, padded with 0 (+0.0 in both).
void pack_matrix16(const uint16_t* w, uint16_t* packed, int n, int k);

// Quantized matrices W[n][k] (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) are re-laid once,
// at load, into tiles of kTileCols output columns, so that a product reads
// one stream and sums each column in its own vector lane (no horizontal
// sums). A tile is its blocks' (32 values along k; K-quants: superblocks of
// 256) bodies, each tile_body_bytes, 64-byte aligned, then their tails, each
// tile_tail_bytes. A body is the block's integer parts as 4-byte words,
// [word][16 columns][4 bytes]: word w of column c at 64w + 4c holds the
// block's bytes 4w .. 4w+3 of one range of the file's block, ranges in order:
// - Q8_0: q (8 words), each byte XOR 0x80 (q + 128 as unsigned);
// - Q4_0: qs (4 words: low nibbles values 4w + i, high 16 + 4w + i; q + 8);
// - Q4_K: qs (32 words), the 12 bytes of 6-bit scales and mins (3 words);
// - Q5_K: qs (32), qh (8), scales and mins (3);
// - Q6_K: ql (32), qh (16), the 16 int8 scales (4).
// A tail is the 16 columns' half d (Q4_K, Q5_K: then their half dmin). Each
// tile holds the file's bytes of its 16 rows, no more: 16 x 34, 18, 144, 176
// or 210 a block. Columns past n: zero bytes (Q8_0: 0x80), scales 0. A
// product's column ranges start at a tile (a multiple of kTileCols).
constexpr int kTileCols = 16;
size_t tile_body_bytes(WeightType type);
size_t tile_tail_bytes(WeightType type);
size_t tiled_bytes(WeightType type, int n, int k);
// Tiles [tile_begin, tile_end) of W (rows as the file stores them) into
// `tiled`; `type` quantized (not f32, f16, bf16).
void tile_quantized(WeightType type, const uint8_t* rows, uint8_t* tiled, int n, int k, int tile_begin, int tile_end);
// The inverse for one block: column c of block b of `tile` (k/block_values
// = `blocks` blocks) as the file stores it, block_bytes(type) at `block` (the
// portable kernels read the tiles through this).
void untile_block(WeightType type, const uint8_t* tile, int blocks, int b, int c, uint8_t* block);

struct AttentionArgs {
  const float* q;          // rows x (n_heads * head_size)
  float* out;              // rows x (n_heads * head_size)
  PagedKv kv;
  int layer;
  const int* positions;    // rows
  int n_heads, n_kv_heads, head_size;
};

// Floats of scratch attention_group needs for `rows` rows.
size_t attention_scratch_floats(int rows, int n_heads, int n_kv_heads, int head_size);

struct KernelTable {
  const char* isa;
  // C[m][n] = A[m][k] W^T for the columns of panels [panel_begin, panel_end).
  void (*matmul)(const float* a, const float* packed_w, float* c, int m, int n, int k, int panel_begin,
                 int panel_end);
  // Attention of rows [row_begin, row_end) (one block table unless the range
  // is one row) for the query heads of kv head `kv_head`.
  void (*attention)(const AttentionArgs& args, int row_begin, int row_end, int kv_head, float* scratch);
  // gate[i] = swiglu(gate[i], up[i]) for i in [begin, end).
  void (*swiglu)(float* gate, const float* up, long long begin, long long end);
  // y[i] = fixed_exp(x[i]) with this ISA's vector code (tests).
  void (*exp)(const float* x, float* y, long long n);
  // C[m][n] = A W^T for the columns [col_begin, col_end) (col_begin a
  // multiple of kTileCols) with W[n][k] of `type` (q8_0, q4_0) in tiles
  // (tile_quantized) and A already quantized (quantize_activations: per row
  // k/32 scales in `scales`, k int8 in `qa`); gpu/cpu/q8_tiles.inl.
  void (*matmul_quantized)(WeightType type, const float* scales, const int8_t* qa, const uint8_t* w, float* c, int m,
                           int n, int k, int col_begin, int col_end);
  // matmul for W of 16-bit floats (`type` f16 or bf16) packed by pack_matrix16:
  // each weight widened (exact), then the f32 rule.
  void (*matmul16)(WeightType type, const float* a, const uint16_t* packed_w, float* c, int m, int n, int k,
                   int panel_begin, int panel_end);
  // The same with W of a K-quant `type` in tiles and A quantized by
  // quantize_activations_k (per row k/256 d, k int8, k/16 block sums);
  // gpu/cpu/kq_tiles.inl.
  void (*matmul_kquant)(WeightType type, const float* d, const int8_t* qa, const int16_t* bsums, const uint8_t* w,
                        float* c, int m, int n, int k, int col_begin, int col_end);
  // One row of k activations quantized for matmul_quantized, bit for bit
  // quantize_activations (gpu/quant.h) with this ISA's vector code.
  void (*quantize_q8)(const float* a, int k, float* scales, int8_t* q);
  // The same for matmul_kquant: bit for bit quantize_activations_k.
  void (*quantize_q8k)(const float* a, int k, float* d, int8_t* q, int16_t* bsums);
};

const KernelTable& generic_kernels();
const KernelTable& avx2_kernels();
const KernelTable& avx512_kernels();

// ISAs this CPU runs, narrowest first: "generic", then "avx2", "avx512".
std::vector<std::string> supported_isas();

// The table of `isa` ("generic", "avx2", "avx512"); "" or "auto": the
// environment variable DISAGG_CPU_ISA if set, else the widest supported.
// Throws Error for an unknown name or one this CPU cannot run.
const KernelTable& kernels_for(const std::string& isa);

}  // namespace disagg::gpu::cpu
