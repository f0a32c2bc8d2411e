// ggml's K-quants: the superblock layouts (ggml-common.h's block_q4_K,
// block_q5_K, block_q6_K), their reference quantizers (ggml-quants.c's
// quantize_row_q{4,5,6}_K_ref with make_qkx2_quants and make_qx_quants,
// without an importance matrix), dequantization, and the naive reference of
// the K-quant matrix product (the rule: gpu/fixed_math.h). Written from a
// description of ggml's code, not copied; every float operation in the
// quantizers is in ggml's order (no contraction: -ffp-contract=off), so the
// bytes are ggml's.
//
// Layouts (little-endian, no padding), value index e in [0, 256):
//   Q4_K (144): d f16 | dmin f16 | scales[12] | qs[128]
//     scales: 8 six-bit scales sc[j] and mins mn[j] (j = e / 32): for j < 4
//     sc = s[j] & 63, mn = s[j+4] & 63; else sc = (s[j+4] & 15) | (s[j-4] >> 6) << 4,
//     mn = (s[j+4] >> 4) | (s[j] >> 6) << 4.
//     qs[32c + l]: value 64c + l in its low nibble, 64c + 32 + l in its high one.
//   Q5_K (176): d | dmin | scales[12] | qh[32] | qs[128]: as Q4_K, plus the
//     fifth bit of value 64c + l (64c + 32 + l) in bit 2c (2c + 1) of qh[l].
//   Q6_K (210): ql[128] | qh[64] | scales[16] int8 | d f16. Value 128h + 32k + l
//     (k < 4, l < 32): low 4 bits from ql[64h + 32(k & 1) + l] (low nibble for
//     k < 2, else high), high 2 bits (qh[32h + l] >> 2k) & 3; q - 32; scale[e / 16].
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gpu/error.h"
#include "gpu/fixed_math.h"
#include "gpu/quant.h"
#include "gpu/quant_blocks.h"

namespace disagg::gpu {

namespace {

static_assert(kQK == fixed::kQ8KValues, "one superblock size");

// ggml's nearest_int: round to nearest, ties to even, by the float trick
// (equal to rintf for |f| < 2^22, where the quantizers stay).
int nearest_int(float f) {
  const float v = f + 12582912.0f;
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return int(bits & 0x007fffff) - 0x00400000;
}

void store_half(uint8_t* p, float f) {
  const uint16_t h = float_to_half(f);
  std::memcpy(p, &h, 2);
}


// Fits x ~ scale * L + min (L in [0, nmax], min <= 0) by weighted least
// squares over nstep + 1 trial scales (ggml's make_qkx2_quants, squared
// error); returns the scale, *the_min = -min.
float make_qkx2_quants(int n, int nmax, const float* x, const float* weights, uint8_t* L, float* the_min,
                       uint8_t* Laux, float rmin, float rdelta, int nstep) {
  float mn = x[0], mx = x[0];
  float sum_w = weights[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < mn) mn = x[i];
    if (x[i] > mx) mx = x[i];
    const float w = weights[i];
    sum_w += w;
    sum_x += w * x[i];
  }
  if (mn > 0) mn = 0;
  if (mx == mn) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -mn;
    return 0.0f;
  }
  float iscale = float(nmax) / (mx - mn);
  float scale = 1.0f / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = std::clamp(nearest_int(iscale * (x[i] - mn)), 0, nmax);
    L[i] = uint8_t(l);
    const float diff = scale * float(l) + mn - x[i];
    best_error += weights[i] * (diff * diff);
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * float(is) + float(nmax)) / (mx - mn);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest_int(iscale * (x[i] - mn)), 0, nmax);
      Laux[i] = uint8_t(l);
      const float w = weights[i];
      sum_l += w * float(l);
      sum_l2 += w * float(l) * float(l);
      sum_xl += w * float(l) * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        const float diff = this_scale * float(Laux[i]) + this_min - x[i];
        cur_error += weights[i] * (diff * diff);
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        mn = this_min;
      }
    }
  }
  *the_min = -mn;
  return scale;
}

// A signed scale for x ~ scale * (L - nmax), L in [0, 2 nmax), weights x^2,
// from 19 trial scales (ggml's make_qx_quants with rmse_type 1, no weights).
float make_qx_quants(int n, int nmax, const float* x, int8_t* L) {
  float amax = 0, max = 0;
  for (int i = 0; i < n; ++i)
    if (std::fabs(x[i]) > amax) {
      amax = std::fabs(x[i]);
      max = x[i];
    }
  if (amax < 1e-15f) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.0f;
  }
  auto fit = [&](float iscale, float& sumlx, float& suml2, bool store) {
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      const int l = std::clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1);
      if (store) L[i] = int8_t(l + nmax);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * float(l);
      suml2 += w * float(l) * float(l);
    }
  };
  float sumlx, suml2;
  fit(float(-nmax) / max, sumlx, suml2, true);
  float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    const float iscale = -(float(nmax) + 0.1f * float(is)) / max;
    fit(iscale, sumlx, suml2, false);
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      fit(iscale, sumlx, suml2, true);
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// Q4_K and Q5_K (nmax 15 or 31): one superblock.
void quantize_superblock_q45(const float* x, uint8_t* y, bool five) {
  const int nmax = five ? 31 : 15;
  uint8_t L[kQK], Laux[32];
  float weights[32], mins[8], scales[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    const float* xs = x + 32 * j;
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += xs[l] * xs[l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) weights[l] = av_x + std::fabs(xs[l]);
    scales[j] = make_qkx2_quants(32, nmax, xs, weights, L + 32 * j, &mins[j], Laux, five ? -0.5f : -1.0f, 0.1f,
                                 five ? 15 : 20);
    if (scales[j] > max_scale) max_scale = scales[j];
    if (mins[j] > max_min) max_min = mins[j];
  }
  const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
  const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
  uint8_t* s = y + 4;
  std::memset(s, 0, 12);
  for (int j = 0; j < 8; ++j) {
    const uint8_t ls = std::min<uint8_t>(63, uint8_t(nearest_int(inv_scale * scales[j])));
    const uint8_t lm = std::min<uint8_t>(63, uint8_t(nearest_int(inv_min * mins[j])));
    if (j < 4) {
      s[j] = ls;
      s[j + 4] = lm;
    } else {
      s[j + 4] = uint8_t((ls & 0x0f) | ((lm & 0x0f) << 4));
      s[j - 4] |= uint8_t((ls >> 4) << 6);
      s[j] |= uint8_t((lm >> 4) << 6);
    }
  }
  store_half(y, max_scale / 63.0f);
  store_half(y + 2, max_min / 63.0f);
  const float d = blocks::half_at(y), dmin = blocks::half_at(y + 2);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    blocks::scale_min(WeightType::q4_k, y, j, sc, m);  // (Q5_K's scales lie where Q4_K's do)
    const float dq = d * float(sc);
    if (dq == 0) continue;  // L keeps the fit's values
    const float dm = dmin * float(m);
    for (int ii = 0; ii < 32; ++ii) L[32 * j + ii] = uint8_t(std::clamp(nearest_int((x[32 * j + ii] + dm) / dq), 0, nmax));
  }
  uint8_t* qs = y + (five ? 48 : 16);
  uint8_t* qh = y + 16;
  if (five) std::memset(qh, 0, 32);
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) {
      int l1 = L[64 * c + l], l2 = L[64 * c + 32 + l];
      if (five) {
        if (l1 > 15) l1 -= 16, qh[l] |= uint8_t(1 << (2 * c));
        if (l2 > 15) l2 -= 16, qh[l] |= uint8_t(1 << (2 * c + 1));
      }
      qs[32 * c + l] = uint8_t(l1 | (l2 << 4));
    }
}

void quantize_superblock_q6(const float* x, uint8_t* y) {
  int8_t L[kQK];
  float scales[16];
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < 16; ++ib) {
    scales[ib] = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
    if (std::fabs(scales[ib]) > max_abs_scale) {
      max_abs_scale = std::fabs(scales[ib]);
      max_scale = scales[ib];
    }
  }
  if (max_abs_scale < 1e-15f) {
    std::memset(y, 0, kQ6KBlockBytes);
    return;
  }
  const float iscale = -128.0f / max_scale;
  store_half(y + 208, 1.0f / iscale);
  auto* sc = reinterpret_cast<int8_t*>(y + 192);
  for (int ib = 0; ib < 16; ++ib) sc[ib] = int8_t(std::min(127, nearest_int(iscale * scales[ib])));
  const float d = blocks::half_at(y + 208);
  for (int j = 0; j < 16; ++j) {
    const float dq = d * float(sc[j]);
    if (dq == 0) continue;  // L keeps the fit's values
    for (int ii = 0; ii < 16; ++ii) L[16 * j + ii] = int8_t(std::clamp(nearest_int(x[16 * j + ii] / dq), -32, 31) + 32);
  }
  uint8_t* ql = y;
  uint8_t* qh = y + 128;
  for (int h = 0; h < 2; ++h) {
    const int8_t* Lh = L + 128 * h;
    for (int l = 0; l < 32; ++l) {
      ql[64 * h + l] = uint8_t((Lh[l] & 0xf) | ((Lh[l + 64] & 0xf) << 4));
      ql[64 * h + 32 + l] = uint8_t((Lh[l + 32] & 0xf) | ((Lh[l + 96] & 0xf) << 4));
      qh[32 * h + l] = uint8_t((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) | ((Lh[l + 64] >> 4) << 4) | ((Lh[l + 96] >> 4) << 6));
    }
  }
}

void check_row(const char* what, int k) {
  if (k % kQK != 0) throw Error(std::string(what) + ": " + std::to_string(k) + " is not a multiple of 256");
}

}  // namespace

void quantize_row_q4_k(const float* x, uint8_t* out, int k) {
  check_row("quantize_row_q4_k", k);
  for (int b = 0; b < k / kQK; ++b) quantize_superblock_q45(x + size_t(b) * kQK, out + size_t(b) * kQ4KBlockBytes, false);
}

void quantize_row_q5_k(const float* x, uint8_t* out, int k) {
  check_row("quantize_row_q5_k", k);
  for (int b = 0; b < k / kQK; ++b) quantize_superblock_q45(x + size_t(b) * kQK, out + size_t(b) * kQ5KBlockBytes, true);
}

void quantize_row_q6_k(const float* x, uint8_t* out, int k) {
  check_row("quantize_row_q6_k", k);
  for (int b = 0; b < k / kQK; ++b) quantize_superblock_q6(x + size_t(b) * kQK, out + size_t(b) * kQ6KBlockBytes);
}

void unpack_superblock(WeightType type, const uint8_t* y, KQuantBlock& out) {
  for (int e = 0; e < kQK; ++e) out.q[e] = int8_t(blocks::value(type, y, e));
  const int scales = type == WeightType::q6_k ? 16 : 8;
  for (int j = 0; j < 16; ++j) out.scale[j] = 0;
  for (int j = 0; j < 8; ++j) out.min[j] = 0;
  for (int j = 0; j < scales; ++j) {
    int mn;
    blocks::scale_min(type, y, j, out.scale[j], mn);
    if (j < 8) out.min[j] = mn;
  }
  out.d = blocks::d_of(type, y);
  out.dmin = blocks::dmin_of(type, y);
}

namespace detail {

void dequantize_row_k(WeightType type, const uint8_t* row, float* out, int k) {
  KQuantBlock b;
  for (int i = 0; i < k / kQK; ++i) {
    unpack_superblock(type, row + size_t(i) * block_bytes(type), b);
    float* y = out + size_t(i) * kQK;
    if (type == WeightType::q6_k) {
      for (int e = 0; e < kQK; ++e) y[e] = b.d * float(b.scale[e / 16]) * float(b.q[e]);
    } else {
      for (int j = 0; j < 8; ++j) {
        const float d1 = b.d * float(b.scale[j]), m1 = b.dmin * float(b.min[j]);
        for (int e = 32 * j; e < 32 * j + 32; ++e) y[e] = d1 * float(b.q[e]) - m1;
      }
    }
  }
}

void matmul_k_reference(WeightType type, const float* a, const uint8_t* w, float* c, int m, int n, int k) {
  if (k % kQK != 0) throw Error("matmul_k_reference: k = " + std::to_string(k) + " is not a multiple of 256");
  const int blocks = k / kQK;
  std::vector<float> d(static_cast<size_t>(blocks));
  std::vector<int8_t> q(static_cast<size_t>(k));
  std::vector<int16_t> bsums(size_t(blocks) * 16);
  KQuantBlock b;
  for (int r = 0; r < m; ++r) {
    quantize_activations_k(a + size_t(r) * k, k, d.data(), q.data(), bsums.data());
    for (int col = 0; col < n; ++col) {
      const uint8_t* row = w + size_t(col) * row_bytes(type, k);
      float acc = 0.0f;
      for (int i = 0; i < blocks; ++i) {
        unpack_superblock(type, row + size_t(i) * block_bytes(type), b);
        const int8_t* qa = q.data() + size_t(i) * kQK;
        int32_t s1 = 0, s2 = 0;
        for (int e = 0; e < kQK; ++e)
          s1 += (type == WeightType::q6_k ? b.scale[e / 16] : b.scale[e / 32]) * int32_t(b.q[e]) * int32_t(qa[e]);
        for (int g = 0; g < 16; ++g) s2 += int32_t(bsums[size_t(i) * 16 + g]) * b.min[g / 2];
        acc = std::fma(float(s1), b.d * d[size_t(i)], acc);
        if (type != WeightType::q6_k) acc = std::fma(float(s2), -(b.dmin * d[size_t(i)]), acc);
      }
      c[size_t(r) * n + col] = acc;
    }
  }
}

}  // namespace detail

}  // namespace disagg::gpu
