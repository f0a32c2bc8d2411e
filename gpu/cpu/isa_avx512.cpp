// The CPU kernels with AVX-512 (F, BW, VL, VNNI): V is one 16-float register. Compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mavx2 -mfma (CMakeLists.txt) and called only when the CPU has them.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "gpu/cpu/cpu_kernels.h"
#include "gpu/fixed_math.h"
#include "gpu/quant.h"
#include "gpu/quant_blocks.h"
#include "gpu/kv_layout.h"

namespace disagg::gpu::cpu::avx512 {

namespace {

struct V {
  __m512 v;
};

inline __mmask16 mask16(int n) { return __mmask16((1u << n) - 1u); }  // lanes [0, n), n in [0, 16]

inline V vzero() { return {_mm512_setzero_ps()}; }
inline V vset1(float a) { return {_mm512_set1_ps(a)}; }
inline V viota() { return {_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)}; }
inline V vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V vload_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(mask16(n), p)}; }
inline V vload_f16(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline V vload_bf16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline void vstore(float* p, const V& v) { _mm512_storeu_ps(p, v.v); }
inline void vstore_n(float* p, const V& v, int n) { _mm512_mask_storeu_ps(p, mask16(n), v.v); }
inline V vadd(const V& a, const V& b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V vsub(const V& a, const V& b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V vmul(const V& a, const V& b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V vdiv(const V& a, const V& b) { return {_mm512_div_ps(a.v, b.v)}; }
// _mm512_min_ps(a, b) is a < b ? a : b, lane by lane (b when either is NaN).
inline V vmin(const V& a, const V& b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V vfma(const V& a, const V& b, const V& c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V vround(const V& a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline V vpow2i(const V& n) {
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
  return {_mm512_castsi512_ps(e)};
}
inline V vselect_lt(const V& a, const V& b, const V& x, const V& y) {
  return {_mm512_mask_blend_ps(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), y.v, x.v)};
}
inline float vreduce_max(const V& v) { return _mm512_reduce_max_ps(v.v); }
// fixed::tree_sum16: (i, i+8), (i, i+4), (i, i+2), (i, i+1).
inline float vtree_sum(const V& v) {
  const __m256 lo = _mm512_castps512_ps256(v.v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v.v), 1));
  const __m256 h8 = _mm256_add_ps(lo, hi);
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  const __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
  return _mm_cvtss_f32(h1);
}

constexpr const char* kIsaName = "avx512";
constexpr int kMR = 12;  // 12 rows x 2 panels: 24 zmm accumulators
constexpr int kNP = 2;
constexpr int kNP1 = 4;  // one row: 4 panels
constexpr int kAttnRows = 4;  // heads attended together: 4 x 4 tiles = 16 zmm of scores

#include "gpu/cpu/q8_kernels.inl"
#include "gpu/cpu/q8_tiles.inl"
#include "gpu/cpu/kq_tiles.inl"
#include "gpu/cpu/simd_kernels.inl"

}  // namespace

}  // namespace disagg::gpu::cpu::avx512

namespace disagg::gpu::cpu {
const KernelTable& avx512_kernels() { return avx512::table(); }
}  // namespace disagg::gpu::cpu
