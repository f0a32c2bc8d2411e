#include "gpu/quant.h"
#include "gpu/quant_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gpu/error.h"
#include "gpu/fixed_math.h"

namespace disagg::gpu {

static_assert(kQ8Block == fixed::kQ8Values, "one Q8_0 block size");

const char* to_string(WeightType type) {
  switch (type) {
    case WeightType::f32: return "f32";
    case WeightType::f16: return "f16";
    case WeightType::bf16: return "bf16";
    case WeightType::q8_0: return "q8_0";
    case WeightType::q4_0: return "q4_0";
    case WeightType::q4_k: return "q4_k";
    case WeightType::q5_k: return "q5_k";
    case WeightType::q6_k: return "q6_k";
  }
  return "unknown";
}


float half_to_float(uint16_t h) { return blocks::half_bits_to_float(h); }

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return uint16_t(sign | 0x7c00 | (abs > 0x7f800000u ? 0x200 : 0));  // inf, NaN (quiet)
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00);  // rounds to beyond 65504: inf
  if (abs < 0x38800000u) {
    // Below the smallest normal half (2^-14): a subnormal half, value * 2^24 rounded to an integer.
    if (abs < 0x33000000u) return sign;  // below 2^-25: rounds to 0 (2^-25 itself is a tie, to 0)
    // value * 2^24 = m * 2^(e - 126) with m the 24-bit significand, e the biased exponent (102..112).
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffff) | 0x800000;
    const uint32_t shift = 126 - e;  // 14..24
    const uint32_t q = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    uint32_t r = q;
    if (rest > half || (rest == half && (q & 1))) ++r;
    return uint16_t(sign | r);
  }
  // Normal: rebias the exponent, round the mantissa's 13 dropped bits to nearest even.
  const uint32_t rebased = abs - ((127 - 15) << 23);
  uint32_t h = rebased >> 13;
  const uint32_t rest = rebased & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;  // a carry into the exponent is right, also to inf
  return uint16_t(sign | h);
}

float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40);  // NaN: keep it, quiet
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1)) >> 16);                 // to nearest, ties to even
}

void quantize_row_q8_0(const float* x, uint8_t* out, int k) {
  if (k % kQ8Block != 0) throw Error("quantize_row_q8_0: " + std::to_string(k) + " is not a multiple of 32");
  for (int b = 0; b < k / kQ8Block; ++b) {
    const float* v = x + size_t(b) * kQ8Block;
    float amax = 0.0f;
    for (int j = 0; j < kQ8Block; ++j) amax = std::fmax(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t* block = out + size_t(b) * kQ8BlockBytes;
    const uint16_t dh = float_to_half(d);
    std::memcpy(block, &dh, 2);
    for (int j = 0; j < kQ8Block; ++j) block[2 + j] = uint8_t(int8_t(std::round(v[j] * id)));
  }
}

void quantize_row_q4_0(const float* x, uint8_t* out, int k) {
  if (k % kQ8Block != 0) throw Error("quantize_row_q4_0: " + std::to_string(k) + " is not a multiple of 32");
  for (int b = 0; b < k / kQ8Block; ++b) {
    const float* v = x + size_t(b) * kQ8Block;
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < kQ8Block; ++j)
      if (amax < std::fabs(v[j])) {
        amax = std::fabs(v[j]);
        max = v[j];
      }
    const float d = max / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t* block = out + size_t(b) * kQ4BlockBytes;
    const uint16_t dh = float_to_half(d);
    std::memcpy(block, &dh, 2);
    for (int j = 0; j < kQ8Block / 2; ++j) {
      const int lo = std::min(15, int(int8_t(v[j] * id + 8.5f)));
      const int hi = std::min(15, int(int8_t(v[j + kQ8Block / 2] * id + 8.5f)));
      block[2 + j] = uint8_t(lo | (hi << 4));
    }
  }
}

void quantize_row(WeightType type, const float* x, uint8_t* out, int k) {
  if (type == WeightType::q8_0) quantize_row_q8_0(x, out, k);
  else if (type == WeightType::q4_0) quantize_row_q4_0(x, out, k);
  else if (type == WeightType::q4_k) quantize_row_q4_k(x, out, k);
  else if (type == WeightType::q5_k) quantize_row_q5_k(x, out, k);
  else if (type == WeightType::q6_k) quantize_row_q6_k(x, out, k);
  else if (type == WeightType::f32) std::memcpy(out, x, size_t(k) * sizeof(float));
  else
    for (int j = 0; j < k; ++j) {
      const uint16_t h = type == WeightType::f16 ? float_to_half(x[j]) : float_to_bf16(x[j]);
      std::memcpy(out + size_t(j) * 2, &h, 2);
    }
}

float unpack_block(WeightType type, const uint8_t* block, int8_t* values) {
  for (int j = 0; j < kQ8Block; ++j) values[j] = int8_t(blocks::value(type, block, j));
  return blocks::d_of(type, block);
}

void quantize_activations(const float* a, int k, float* scales, int8_t* q) {
  for (int b = 0; b < k / kQ8Block; ++b)
    scales[b] = fixed::quantize_q8_block(a + size_t(b) * kQ8Block, q + size_t(b) * kQ8Block);
}

void dequantize_row(WeightType type, const uint8_t* row, float* out, int k) {
  if (is_k_quant(type)) {
    detail::dequantize_row_k(type, row, out, k);
    return;
  }
  if (!is_block_quantized(type)) {
    if (type == WeightType::f32) {
      std::memcpy(out, row, size_t(k) * sizeof(float));
      return;
    }
    for (int j = 0; j < k; ++j) {
      uint16_t h;
      std::memcpy(&h, row + size_t(j) * 2, 2);
      out[j] = type == WeightType::f16 ? half_to_float(h) : bf16_to_float(h);
    }
    return;
  }
  int8_t values[kQ8Block];
  for (int b = 0; b < k / kQ8Block; ++b) {
    const float d = unpack_block(type, row + size_t(b) * block_bytes(type), values);
    for (int j = 0; j < kQ8Block; ++j) out[size_t(b) * kQ8Block + j] = d * float(values[j]);
  }
}

void quantize_activations_k(const float* a, int k, float* d, int8_t* q, int16_t* bsums) {
  for (int b = 0; b < k / kQK; ++b)
    d[b] = fixed::quantize_q8k_block(a + size_t(b) * kQK, q + size_t(b) * kQK, bsums + size_t(b) * (kQK / 16));
}

void matmul_quantized_reference(WeightType type, const float* a, const uint8_t* w, float* c, int m, int n, int k) {
  if (is_k_quant(type)) {
    detail::matmul_k_reference(type, a, w, c, m, n, k);
    return;
  }
  const int blocks = k / kQ8Block;
  std::vector<float> scales(static_cast<size_t>(blocks));
  std::vector<int8_t> q(static_cast<size_t>(k));
  for (int r = 0; r < m; ++r) {
    quantize_activations(a + size_t(r) * k, k, scales.data(), q.data());
    for (int col = 0; col < n; ++col) {
      const uint8_t* row = w + size_t(col) * row_bytes(type, k);
      float acc = 0.0f;
      for (int b = 0; b < blocks; ++b) {
        int8_t values[kQ8Block];
        const float d = unpack_block(type, row + size_t(b) * block_bytes(type), values);
        int32_t isum = 0;
        for (int j = 0; j < kQ8Block; ++j) isum += int32_t(values[j]) * int32_t(q[size_t(b) * kQ8Block + j]);
        acc = std::fma(float(isum), d * scales[size_t(b)], acc);
      }
      c[size_t(r) * n + col] = acc;
    }
  }
}

}  // namespace disagg::gpu
