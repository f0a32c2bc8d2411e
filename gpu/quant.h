// Quantized weights: the types a weight matrix may have, ggml's Q8_0 and
// Q4_0 block layouts, IEEE half precision, and the naive references of the
// quantized kernels (the rule itself: gpu/fixed_math.h, "quantized matrix
// product").
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

enum class WeightType { f32, q8_0, q4_0 };
const char* to_string(WeightType type);

constexpr int kQ8Block = 32;             // values per block, Q8_0 and Q4_0
constexpr size_t kQ8BlockBytes = 2 + 32;  // Q8_0: f16 scale + 32 x int8
constexpr size_t kQ4BlockBytes = 2 + 16;  // Q4_0: f16 scale + 32 x 4 bits
// Bytes of one block of a quantized type.
size_t block_bytes(WeightType type);
// Bytes of a k-long row in `type` (k a multiple of kQ8Block when quantized).
size_t row_bytes(WeightType type, int k);

// IEEE binary16 <-> binary32: half_to_float is exact; float_to_half rounds
// to nearest, ties to even (as F16C's vcvtps2ph with mode 0).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

// One row of k weights as Q8_0 blocks at `out` (row_bytes(q8_0, k)), as
// ggml's quantize_row_q8_0_ref: d = max|x| / 127 (stored as half), q =
// roundf(x / d) (ties away from zero; 0 when d is 0).
void quantize_row_q8_0(const float* x, uint8_t* out, int k);
// The same for Q4_0, as ggml's quantize_row_q4_0_ref: the value of largest
// magnitude m, d = m / -8 (as half), q = min(15, int8(x / d + 8.5)).
void quantize_row_q4_0(const float* x, uint8_t* out, int k);
// quantize_row_q8_0 or quantize_row_q4_0.
void quantize_row(WeightType type, const float* x, uint8_t* out, int k);

// A block's scale and its 32 values as int8 (Q4_0: q - 8), in value order.
float unpack_block(WeightType type, const uint8_t* block, int8_t* values);

// An activation row of k values quantized for a Q8_0 product (the rule's
// first step, fixed::quantize_q8_block for each block): k / 32 scales, k int8.
void quantize_activations(const float* a, int k, float* scales, int8_t* q);

// The naive references the kernels are tested against, bit for bit:
// C[m][n] = A[m][k] W^T with W in quantized rows, by the rule of
// fixed_math.h; and a quantized row dequantized (d * q, one multiply each).
void matmul_quantized_reference(WeightType type, const float* a, const uint8_t* w, float* c, int m, int n, int k);
void dequantize_row(WeightType type, const uint8_t* row, float* out, int k);

}  // namespace disagg::gpu
