// The arithmetic every backend performs in one fixed order, so that a value
// never depends on the batch it was computed in, on the CPU's vector width, or
// on the device (scalar CPU, AVX2, AVX-512 and CUDA give the same bits).
//
// The rules (each implementation follows them; tests compare them bit for bit):
// - A matrix product C = A W^T sums each element in increasing k, one fused
//   multiply-add per term, from 0: c = fma(a[k-1], w[k-1], ... fma(a[0], w[0], 0)).
//   Rows and columns never mix, so a row's result does not depend on the others.
// - Attention of a query row at position p reads key tiles [16i, 16i + 16)
//   (kKeyTile) in increasing order, online softmax:
//     s_t  = dot(q, k_t) / sqrt(head_size)       dot as the matrix rule, over j
//     m'   = max(m, max_t s_t)                    (m starts at -inf)
//     c    = fixed_exp(m - m')
//     p_t  = fixed_exp(s_t - m')                  positions > p: p_t = 0
//     l    = l * c + tree_sum16(p)                (l starts at 0)
//     o[j] = o[j] * c, then o[j] = fma(p_t, v_t[j], o[j]) for t in order
//   and out[j] = o[j] / l at the end. Tiles start at 0 whatever rows are
//   computed together, so a prefill row equals the decode step at its position.
// - A quantized matrix product (W in ggml's Q8_0 blocks of 32 along k, scale
//   d_w as half, gpu/quant.h) quantizes each activation row per block b of
//   32 (quantize_q8_block): d = max|a| / 127, q_a = rint(a * (1 / d)), ties
//   to even (q_a = 0 when d = 0), s_b = d rounded to half precision (as
//   llama.cpp stores an activation block's scale); then
//     c = fma(float(isum_b), d_w(b) * s_b, c)   for b in increasing order, from 0
//   with isum_b = sum_j q_w[j] * q_a[j] in int32: exact, so in any order
//   (|isum_b| <= 32 * 128 * 127 < 2^24: float(isum_b) is exact too). A row's
//   result depends on its own values only, as in the float rule.
// - A K-quant matrix product (W in ggml's Q4_K, Q5_K or Q6_K superblocks of
//   256 along k, gpu/quant.h) quantizes each activation row per superblock
//   i of 256 as llama.cpp's quantize_row_q8_K_ref does (quantize_q8k_block):
//   the value of largest magnitude m (the first one on ties), s = -127 / m,
//   q_a = min(127, rint(s * a)), d_i = 1 / s (a float, signed), and the 16
//   sums of 16 q_a each (bsum_g). Then, with the weights' integer quants q_w,
//   their 6-bit scales sc and mins mn (Q4_K, Q5_K: one of each per 32 values)
//   or int8 scales (Q6_K: one per 16 values, q_w in [-32, 31]):
//     S1_i = sum_e sc(e) * q_w[e] * q_a[e]          int32, exact, any order
//     S2_i = sum_g bsum_g * mn(g / 2)                int32, exact (Q4_K, Q5_K)
//     c = fma(float(S1_i), d_w(i) * d_i, c)
//     c = fma(float(S2_i), -(dmin_w(i) * d_i), c)   (Q4_K, Q5_K)
//   for i in increasing order, from 0 (|S1| < 2^27: float(S1) rounds once,
//   the same way whatever computed S1).
// - No other contraction: a * b + c is two roundings unless written as fma
//   (-ffp-contract=off on the CPU, --fmad=false for CUDA).
//
// So rows fed together are rows fed apart. Speculative decoding
// (engine/speculation.h) rests on it: a step that feeds a sequence's last
// token and k guesses at positions p .. p + k (each row attending to
// positions [0, its own]) gives each row the logits k + 1 plain steps would
// give after the same tokens, bit for bit; a token is kept only where it is
// the one plain decoding samples from those logits, so the output is plain
// decoding's, greedy or seeded.
//
// Header-only, CAF-free, usable from host and device code. The functions are
// static: gpu/cpu/ compiles them once per instruction set, and the linker must
// never pick an AVX-512 copy for a caller on another CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef HD
#ifdef __CUDACC__
#define HD __host__ __device__
#else
#define HD
#endif
#endif

namespace disagg::gpu::fixed {

constexpr int kKeyTile = 16;  // key positions per attention tile (and lanes of tree_sum16)
// RMSNorm's epsilon is the model's (ModelConfig::rms_epsilon): out = w * x /
// sqrt(mean(x^2) + epsilon), the mean as RmsNormOp orders it.

// fixed_exp's constants: range, ln(2) split in a high part exact in float and
// the rest, and the Cephes expf polynomial for e^r - 1 - r on [-ln2/2, ln2/2].
constexpr float kExpLo = -87.0f;  // below: 0 (e^-87 ~ 1.6e-38; 2^n stays normal)
constexpr float kExpHi = 88.0f;   // above: clamped (2^127 * 1.5 < FLT_MAX)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpC0 = 1.9875691500e-4f;
constexpr float kExpC1 = 1.3981999507e-3f;
constexpr float kExpC2 = 8.3334519073e-3f;
constexpr float kExpC3 = 4.1665795894e-2f;
constexpr float kExpC4 = 1.6666665459e-1f;
constexpr float kExpC5 = 5.0000001201e-1f;

// 2^n for an integral n in [-126, 127].
static inline HD float pow2i(float n) {
  const int32_t bits = (int32_t(n) + 127) << 23;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

// e^x within ~2 ulp by one sequence of IEEE operations; 0 below kExpLo
// (-inf included). The vector versions (gpu/cpu/) repeat it lane by lane.
static inline HD float fixed_exp(float x) {
  if (x < kExpLo) return 0.0f;
  x = x < kExpHi ? x : kExpHi;
  const float n = rintf(x * kLog2e);
  float r = fmaf(n, -kLn2Hi, x);
  r = fmaf(n, -kLn2Lo, r);
  float p = kExpC0;
  p = fmaf(p, r, kExpC1);
  p = fmaf(p, r, kExpC2);
  p = fmaf(p, r, kExpC3);
  p = fmaf(p, r, kExpC4);
  p = fmaf(p, r, kExpC5);
  const float z = r * r;
  const float y = fmaf(p, z, r) + 1.0f;
  return y * pow2i(n);
}

// silu(g) * u, the SwiGLU gate, with fixed_exp.
static inline HD float swiglu(float g, float u) {
  const float s = g * (1.0f / (1.0f + fixed_exp(-g)));
  return s * u;
}

// Sum of 16 values as the tree (i, i+8), then (i, i+4), (i, i+2), (i, i+1):
// what a butterfly of xor-shuffles over 16 lanes computes.
static inline HD float tree_sum16(const float* v) {
  float h8[8], h4[4];
  for (int i = 0; i < 8; ++i) h8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) h4[i] = h8[i] + h8[i + 4];
  const float h2a = h4[0] + h4[2];
  const float h2b = h4[1] + h4[3];
  return h2a + h2b;
}

// x rounded to IEEE half precision (to nearest, ties to even) and back: the
// float a half stores. gpu/quant.cpp float_to_half is the same rounding.
static inline HD float round_to_half(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u || abs < 0x38800000u) {
    // inf, NaN, and below the smallest normal half (2^-14): units of 2^-24, to nearest even.
    if (abs >= 0x7f800000u) return x;
    const float units = rintf(fabsf(x) * 16777216.0f);
    const float r = units * (1.0f / 16777216.0f);
    return (u >> 31) ? -r : r;
  }
  if (abs >= 0x477ff000u) {  // rounds beyond 65504: inf
    const uint32_t inf = (u & 0x80000000u) | 0x7f800000u;
    float f;
    memcpy(&f, &inf, sizeof f);
    return f;
  }
  // Normal: keep 10 mantissa bits, rounding the 13 dropped ones to nearest even.
  const uint32_t rest = u & 0x1fffu;
  uint32_t r = u & ~0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (u & 0x2000u))) r += 0x2000u;
  float f;
  memcpy(&f, &r, sizeof f);
  return f;
}

// One block of kQ8Values activations quantized for a Q8_0 product, as
// llama.cpp quantizes activations for its Q8_0 and Q4_0 products: d =
// max|a| / 127, q = rint(a * (1 / d)) (ties to even), and the scale returned
// is d as a half stores it (round_to_half), which the product multiplies by.
constexpr int kQ8Values = 32;
static inline HD float quantize_q8_block(const float* a, int8_t* q) {
  float amax = 0.0f;
  for (int j = 0; j < kQ8Values; ++j) amax = fmaxf(amax, fabsf(a[j]));
  const float d = amax / 127.0f;
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  for (int j = 0; j < kQ8Values; ++j) q[j] = int8_t(rintf(a[j] * inv));
  return round_to_half(d);
}

// One superblock of kQ8KValues activations quantized for a K-quant product,
// as llama.cpp's quantize_row_q8_K_ref: returns d (0 for an all-zero block),
// writes the 256 q and the 16 sums of 16 q each.
constexpr int kQ8KValues = 256;
static inline HD float quantize_q8k_block(const float* a, int8_t* q, int16_t* bsums) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < kQ8KValues; ++j)
    if (fabsf(a[j]) > amax) {
      amax = fabsf(a[j]);
      max = a[j];
    }
  if (amax == 0.0f) {
    for (int j = 0; j < kQ8KValues; ++j) q[j] = 0;
    for (int g = 0; g < kQ8KValues / 16; ++g) bsums[g] = 0;
    return 0.0f;
  }
  const float iscale = -127.0f / max;
  for (int j = 0; j < kQ8KValues; ++j) {
    const float v = rintf(iscale * a[j]);
    q[j] = int8_t(v < 127.0f ? v : 127.0f);
  }
  for (int g = 0; g < kQ8KValues / 16; ++g) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += q[16 * g + j];
    bsums[g] = int16_t(sum);
  }
  return 1.0f / iscale;
}

}  // namespace disagg::gpu::fixed
