// Weight types: the types a weight matrix may have, ggml's Q8_0 and Q4_0
// block layouts, IEEE half precision and bfloat16, and the naive references
// of the quantized kernels (the rules themselves: gpu/fixed_math.h).
//
// K-quants (ggml's superblocks of 256 values along k; layouts in
// gpu/kquant.cpp, from ggml-common.h):
// - Q4_K: half d and dmin, 12 bytes of 8 six-bit scales sc and mins mn (one
//   per 32 values), 128 bytes of 4-bit q; value d*sc*q - dmin*mn. 144 bytes
//   per 256 (0.5625 bytes a weight).
// - Q5_K: the same with a fifth bit per value (32 more bytes): 176 (0.6875).
// - Q6_K: 6-bit q - 32 in 128 + 64 bytes, 16 int8 scales (one per 16), a
//   half d: value d*scale*q. 210 bytes (0.8203).
// A "Q4_K_M" file mixes Q4_K, Q6_K and others per tensor (model/model_writer.h).
//
// 16-bit floats (f16: IEEE binary16; bf16: the top half of a binary32) are
// exact in float, so a matrix of them is multiplied by the f32 rule on the
// values they hold: the same bits as the f32 product of the widened matrix.
//
// A quantized matrix W[n][k] is n rows of k / 32 blocks (ggml's layouts):
// - Q8_0 (block_q8_0): a half-precision scale d, then 32 int8 q; values
//   d * q[j]. 34 bytes per 32 weights (1.0625 bytes a weight).
// - Q4_0 (block_q4_0): a half scale d, then 16 bytes; byte j holds value j
//   in its low nibble and value j + 16 in its high one, each q - 8 in
//   [-8, 7]; values d * (q - 8). 18 bytes per 32 weights (0.5625).
#pragma once
#include <cstddef>
#include <cstdint>

namespace disagg::gpu {

enum class WeightType { f32, f16, bf16, q8_0, q4_0, q4_k, q5_k, q6_k };
// (The small functions below are static: gpu/cpu/ compiles them once per
// instruction set, and the linker must never pick an AVX-512 copy.)
const char* to_string(WeightType type);
// f16 or bf16: 16-bit floats, multiplied by the f32 rule.
static constexpr bool is_float16(WeightType type) { return type == WeightType::f16 || type == WeightType::bf16; }
// q8_0 or q4_0: blocks multiplied by the quantized rule.
static constexpr bool is_block_quantized(WeightType type) { return type == WeightType::q8_0 || type == WeightType::q4_0; }
// q4_k, q5_k or q6_k: superblocks multiplied by the K-quant rule.
static constexpr bool is_k_quant(WeightType type) {
  return type == WeightType::q4_k || type == WeightType::q5_k || type == WeightType::q6_k;
}
// Values per block of `type`: 32 (q8_0, q4_0), 256 (K-quants), 1 (floats).
constexpr int kQ8Block = 32;  // values per block, Q8_0 and Q4_0
constexpr int kQK = 256;      // values per K-quant superblock
static constexpr int block_values(WeightType type) { return is_k_quant(type) ? kQK : is_block_quantized(type) ? kQ8Block : 1; }

constexpr size_t kQ8BlockBytes = 2 + 32;  // Q8_0: f16 scale + 32 x int8
constexpr size_t kQ4BlockBytes = 2 + 16;  // Q4_0: f16 scale + 32 x 4 bits
constexpr size_t kQ4KBlockBytes = 144;
constexpr size_t kQ5KBlockBytes = 176;
constexpr size_t kQ6KBlockBytes = 210;
// Bytes of one block of a quantized type (f32, f16, bf16: of one value).
static constexpr size_t block_bytes(WeightType type) {
  switch (type) {
    case WeightType::f32: return sizeof(float);
    case WeightType::f16:
    case WeightType::bf16: return sizeof(uint16_t);
    case WeightType::q8_0: return kQ8BlockBytes;
    case WeightType::q4_0: return kQ4BlockBytes;
    case WeightType::q4_k: return kQ4KBlockBytes;
    case WeightType::q5_k: return kQ5KBlockBytes;
    case WeightType::q6_k: return kQ6KBlockBytes;
  }
  return 0;
}
// Bytes of a k-long row in `type` (k a multiple of block_values(type)).
static constexpr size_t row_bytes(WeightType type, int k) { return size_t(k / block_values(type)) * block_bytes(type); }

// IEEE binary16 <-> binary32: half_to_float is exact; float_to_half rounds
// to nearest, ties to even (as F16C's vcvtps2ph with mode 0).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
// bfloat16 <-> binary32: bf16_to_float is exact; float_to_bf16 rounds to
// nearest, ties to even, NaN kept quiet (ggml_compute_fp32_to_bf16).
float bf16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);

// One row of k weights as Q8_0 blocks at `out` (row_bytes(q8_0, k)), as
// ggml's quantize_row_q8_0_ref: d = max|x| / 127 (stored as half), q =
// roundf(x / d) (ties away from zero; 0 when d is 0).
void quantize_row_q8_0(const float* x, uint8_t* out, int k);
// The same for Q4_0, as ggml's quantize_row_q4_0_ref: the value of largest
// magnitude m, d = m / -8 (as half), q = min(15, int8(x / d + 8.5)).
void quantize_row_q4_0(const float* x, uint8_t* out, int k);
// The K-quants' reference quantizers, as ggml's quantize_row_q{4,5,6}_K_ref
// (without an importance matrix, as llama-quantize by default): k a
// multiple of 256. gpu/kquant.cpp.
void quantize_row_q4_k(const float* x, uint8_t* out, int k);
void quantize_row_q5_k(const float* x, uint8_t* out, int k);
void quantize_row_q6_k(const float* x, uint8_t* out, int k);
// A row of k floats in `type`: the quantizers above, each value rounded to
// f16 or bf16, or copied (f32).
void quantize_row(WeightType type, const float* x, uint8_t* out, int k);

// A block's scale and its 32 values as int8 (Q4_0: q - 8), in value order.
float unpack_block(WeightType type, const uint8_t* block, int8_t* values);

// A K-quant superblock unpacked: its 256 integer quants in value order (Q4_K
// 0..15, Q5_K 0..31, Q6_K -32..31), the scale of each value's group
// (scale[e / 32] for Q4_K / Q5_K, scale[e / 16] for Q6_K) and min
// (Q4_K / Q5_K: min[e / 32]), d and dmin (Q6_K: 0) as floats.
struct KQuantBlock {
  int8_t q[kQK];
  int scale[16];
  int min[8];
  float d, dmin;
};
void unpack_superblock(WeightType type, const uint8_t* block, KQuantBlock& out);

// An activation row of k values quantized for a Q8_0 product (the rule's
// first step, fixed::quantize_q8_block for each block): k / 32 scales, k int8.
void quantize_activations(const float* a, int k, float* scales, int8_t* q);
// The same for a K-quant product (fixed::quantize_q8k_block): k / 256 d,
// k int8, k / 16 block sums.
void quantize_activations_k(const float* a, int k, float* d, int8_t* q, int16_t* bsums);

// The naive references the kernels are tested against, bit for bit:
// C[m][n] = A[m][k] W^T with W in quantized rows, by the rule of
// fixed_math.h; and a row of any type as floats (quantized: d * q, one
// multiply each; f16, bf16: widened, exact).
void matmul_quantized_reference(WeightType type, const float* a, const uint8_t* w, float* c, int m, int n, int k);
void dequantize_row(WeightType type, const uint8_t* row, float* out, int k);

namespace detail {  // the K-quant halves of the two above (gpu/kquant.cpp)
void dequantize_row_k(WeightType type, const uint8_t* row, float* out, int k);
void matmul_k_reference(WeightType type, const float* a, const uint8_t* w, float* c, int m, int n, int k);
}  // namespace detail

}  // namespace disagg::gpu
