// ggml's quantized blocks read value by value, for host and device code: the
// CPU's reference (gpu/quant.cpp unpack_block, gpu/kquant.cpp
// unpack_superblock) and the CUDA kernels (gpu/backend_cuda.cu) take the bit
// layouts from here (the layouts themselves: gpu/quant.h). Header-only,
// CAF-free; the functions are static for the reason fixed_math.h gives.
#pragma once

#include <cstdint>
#include <cstring>

#include "gpu/fixed_math.h"  // HD
#include "gpu/quant.h"

namespace disagg::gpu::blocks {

// IEEE binary16 bits as the float they stand for (exact: zero, subnormals,
// normals, inf, NaN).
static inline HD float half_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24, exact in float
    const float v = float(mantissa) * (1.0f / 16777216.0f);
    memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | mantissa << 13;
  } else {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

static inline HD float half_at(const uint8_t* p) { return half_bits_to_float(uint16_t(p[0] | p[1] << 8)); }

// Value e of a block as the integer the rule multiplies: Q8_0, Q4_0 (e in
// 0 .. 31; Q4_0 q - 8); Q4_K (0 .. 15), Q5_K (0 .. 31), Q6_K (q - 32 in -32 ..
// 31) for e in 0 .. 255 of a superblock.
static inline HD int value(WeightType type, const uint8_t* y, int e) {
  switch (type) {
    case WeightType::q8_0: return int(int8_t(y[2 + e]));
    case WeightType::q4_0: return int(e < 16 ? y[2 + e] & 0x0f : y[2 + e - 16] >> 4) - 8;
    case WeightType::q6_k: {
      const int h = e / 128, k = (e % 128) / 32, l = e % 32;
      const uint8_t byte = y[64 * h + 32 * (k & 1) + l];  // ql
      const int low = k < 2 ? byte & 0x0f : byte >> 4;
      const int high = (y[128 + 32 * h + l] >> (2 * k)) & 3;  // qh
      return (low | high << 4) - 32;
    }
    default: {  // Q4_K, Q5_K: qs in chunks of 64 values (low nibbles, then high), Q5_K's fifth bits in qh
      const bool five = type == WeightType::q5_k;
      const uint8_t* qs = y + (five ? 48 : 16);
      const int c = e / 64, r = e % 64, l = r % 32;
      int q = r < 32 ? qs[32 * c + l] & 0x0f : qs[32 * c + l] >> 4;
      if (five && (y[16 + l] >> (2 * c + (r >= 32 ? 1 : 0))) & 1) q += 16;
      return q;
    }
  }
}

// A K-quant superblock's scale j and min j: Q4_K, Q5_K j in 0 .. 7 (6 bits
// each, packed in the 12 bytes from offset 4, ggml's get_scale_min_k4); Q6_K
// j in 0 .. 15 (int8 at 192 + j; min 0).
static inline HD void scale_min(WeightType type, const uint8_t* y, int j, int& sc, int& mn) {
  if (type == WeightType::q6_k) {
    sc = int(int8_t(y[192 + j]));
    mn = 0;
    return;
  }
  const uint8_t* s = y + 4;
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// A block's d (Q8_0, Q4_0: its scale) and dmin (Q4_K, Q5_K; else 0).
static inline HD float d_of(WeightType type, const uint8_t* y) { return half_at(type == WeightType::q6_k ? y + 208 : y); }
static inline HD float dmin_of(WeightType type, const uint8_t* y) {
  return type == WeightType::q4_k || type == WeightType::q5_k ? half_at(y + 2) : 0.0f;
}

}  // namespace disagg::gpu::blocks
