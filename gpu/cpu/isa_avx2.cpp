// The CPU kernels with AVX2 + FMA: V is two 8-float registers. Compiled with
// -mavx2 -mfma -mf16c (CMakeLists.txt) and called only when the CPU has all three.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "gpu/cpu/cpu_kernels.h"
#include "gpu/fixed_math.h"
#include "gpu/quant.h"
#include "gpu/quant_blocks.h"
#include "gpu/kv_layout.h"

namespace disagg::gpu::cpu::avx2 {

namespace {

struct V {
  __m256 lo, hi;
};

inline __m256i mask8(int n) {  // lanes [0, n) set, n in [0, 8]
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}

inline V vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V vset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V viota() {
  return {_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)};
}
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V vload_n(const float* p, int n) {
  const int nl = n < 8 ? n : 8, nh = n > 8 ? n - 8 : 0;
  return {_mm256_maskload_ps(p, mask8(nl)), _mm256_maskload_ps(p + 8, mask8(nh))};
}
inline V vload_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256 bf16x8(const uint16_t* p) {  // 8 bfloat16s: each the top half of a float
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline V vload_bf16(const uint16_t* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline void vstore(float* p, const V& v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline void vstore_n(float* p, const V& v, int n) {
  const int nl = n < 8 ? n : 8, nh = n > 8 ? n - 8 : 0;
  _mm256_maskstore_ps(p, mask8(nl), v.lo);
  _mm256_maskstore_ps(p + 8, mask8(nh), v.hi);
}
inline V vadd(const V& a, const V& b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V vsub(const V& a, const V& b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V vmul(const V& a, const V& b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vdiv(const V& a, const V& b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
// _mm256_min_ps(a, b) is a < b ? a : b, lane by lane (b when either is NaN).
inline V vmin(const V& a, const V& b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V vfma(const V& a, const V& b, const V& c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V vround(const V& a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline __m256 pow2i8(__m256 n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(e);
}
inline V vpow2i(const V& n) { return {pow2i8(n.lo), pow2i8(n.hi)}; }
inline V vselect_lt(const V& a, const V& b, const V& x, const V& y) {
  const __m256 ml = _mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ), mh = _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ);
  return {_mm256_blendv_ps(y.lo, x.lo, ml), _mm256_blendv_ps(y.hi, x.hi, mh)};
}
inline float vreduce_max(const V& v) {
  __m256 m = _mm256_max_ps(v.lo, v.hi);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
// fixed::tree_sum16: (i, i+8), (i, i+4), (i, i+2), (i, i+1).
inline float vtree_sum(const V& v) {
  const __m256 h8 = _mm256_add_ps(v.lo, v.hi);
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  const __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
  return _mm_cvtss_f32(h1);
}

constexpr const char* kIsaName = "avx2";
constexpr int kMR = 6;   // 6 rows x 1 panel: 12 ymm accumulators
constexpr int kNP = 1;
constexpr int kNP1 = 3;  // one row: 3 panels (6 independent chains)
constexpr int kAttnRows = 2;  // heads attended together: 2 x 4 tiles = 16 ymm of scores

#include "gpu/cpu/q8_kernels.inl"
#include "gpu/cpu/q8_tiles.inl"
#include "gpu/cpu/kq_tiles.inl"
#include "gpu/cpu/simd_kernels.inl"

}  // namespace

}  // namespace disagg::gpu::cpu::avx2

namespace disagg::gpu::cpu {
const KernelTable& avx2_kernels() { return avx2::table(); }
}  // namespace disagg::gpu::cpu
