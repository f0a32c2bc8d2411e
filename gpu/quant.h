// Quantized weights: the types a weight matrix may have, ggml's Q8_0 block
// layout, IEEE half precision, and the naive references of the quantized
// kernels (the rule itself: gpu/fixed_math.h, "quantized matrix product").
//
// Q8_0 (ggml's block_q8_0): a matrix W[n][k] is n rows of k / 32 blocks;
// a block is a half-precision scale d followed by 32 int8 q, and stands for
// the values d * q[j]. 34 bytes per 32 weights (1.0625 bytes a weight).
#pragma once
#include <cstddef>
#include <cstdint>

namespace disagg::gpu {

enum class WeightType { f32, q8_0 };
const char* to_string(WeightType type);

constexpr int kQ8Block = 32;             // values per Q8_0 block
constexpr size_t kQ8BlockBytes = 2 + 32;  // f16 scale + 32 x int8
// Bytes of a k-long row in `type` (k a multiple of kQ8Block for q8_0).
size_t row_bytes(WeightType type, int k);

// IEEE binary16 <-> binary32: half_to_float is exact; float_to_half rounds
// to nearest, ties to even (as F16C's vcvtps2ph with mode 0).
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

// One row of k weights as Q8_0 blocks at `out` (row_bytes(q8_0, k)), as
// ggml's quantize_row_q8_0_ref: d = max|x| / 127 (stored as half), q =
// roundf(x / d) (ties away from zero; 0 when d is 0).
void quantize_row_q8_0(const float* x, uint8_t* out, int k);

// An activation row of k values quantized for a Q8_0 product (the rule's
// first step, fixed::quantize_q8_block for each block): k / 32 scales, k int8.
void quantize_activations(const float* a, int k, float* scales, int8_t* q);

// The naive references the kernels are tested against, bit for bit:
// C[m][n] = A[m][k] W^T with W in Q8_0 rows, by the rule of fixed_math.h;
// and a Q8_0 row dequantized (d * q[j], one multiply each).
void matmul_q8_0_reference(const float* a, const uint8_t* w, float* c, int m, int n, int k);
void dequantize_row_q8_0(const uint8_t* row, float* out, int k);

}  // namespace disagg::gpu
