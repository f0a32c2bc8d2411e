// The CPU kernels in portable scalar code: V is 16 floats, every operation a
// loop over the lanes. It runs on any CPU and is the reference the vector
// compilations are compared with bit for bit.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "gpu/cpu/cpu_kernels.h"
#include "gpu/fixed_math.h"
#include "gpu/quant.h"
#include "gpu/quant_blocks.h"
#include "gpu/kv_layout.h"

namespace disagg::gpu::cpu::generic {

namespace {

struct V {
  float f[16];
};

inline V vzero() {
  V r;
  for (float& x : r.f) x = 0.0f;
  return r;
}
inline V vset1(float a) {
  V r;
  for (float& x : r.f) x = a;
  return r;
}
inline V viota() {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = float(i);
  return r;
}
inline V vload(const float* p) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = p[i];
  return r;
}
inline V vload_n(const float* p, int n) {
  V r = vzero();
  for (int i = 0; i < n; ++i) r.f[i] = p[i];
  return r;
}
inline V vload_f16(const uint16_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = half_to_float(p[i]);
  return r;
}
inline V vload_bf16(const uint16_t* p) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = bf16_to_float(p[i]);
  return r;
}
inline void vstore(float* p, const V& v) {
  for (int i = 0; i < 16; ++i) p[i] = v.f[i];
}
inline void vstore_n(float* p, const V& v, int n) {
  for (int i = 0; i < n; ++i) p[i] = v.f[i];
}

#define DISAGG_LANEWISE(name, expr)        \
  inline V name(const V& a, const V& b) {  \
    V r;                                   \
    for (int i = 0; i < 16; ++i) {         \
      const float x = a.f[i], y = b.f[i];  \
      r.f[i] = (expr);                     \
    }                                      \
    return r;                              \
  }
DISAGG_LANEWISE(vadd, x + y)
DISAGG_LANEWISE(vsub, x - y)
DISAGG_LANEWISE(vmul, x * y)
DISAGG_LANEWISE(vdiv, x / y)
DISAGG_LANEWISE(vmin, x < y ? x : y)
#undef DISAGG_LANEWISE

inline V vfma(const V& a, const V& b, const V& c) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = fmaf(a.f[i], b.f[i], c.f[i]);
  return r;
}
inline V vround(const V& a) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = rintf(a.f[i]);
  return r;
}
inline V vpow2i(const V& n) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = fixed::pow2i(n.f[i]);
  return r;
}
inline V vselect_lt(const V& a, const V& b, const V& x, const V& y) {
  V r;
  for (int i = 0; i < 16; ++i) r.f[i] = a.f[i] < b.f[i] ? x.f[i] : y.f[i];
  return r;
}
inline float vreduce_max(const V& v) {
  float m = v.f[0];
  for (int i = 1; i < 16; ++i) m = v.f[i] > m ? v.f[i] : m;
  return m;
}
inline float vtree_sum(const V& v) { return fixed::tree_sum16(v.f); }

constexpr const char* kIsaName = "generic";
constexpr int kMR = 4;   // rows per matrix block
constexpr int kNP = 1;   // panels per matrix block
constexpr int kNP1 = 2;  // panels per block when there is one row
constexpr int kAttnRows = 2;  // heads attended together

#include "gpu/cpu/q8_kernels.inl"
#include "gpu/cpu/q8_tiles.inl"
#include "gpu/cpu/kq_tiles.inl"
#include "gpu/cpu/simd_kernels.inl"

}  // namespace

}  // namespace disagg::gpu::cpu::generic

namespace disagg::gpu::cpu {
const KernelTable& generic_kernels() { return generic::table(); }
}  // namespace disagg::gpu::cpu
