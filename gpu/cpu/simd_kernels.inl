// The CPU kernels over a 16-lane float vector V, included by
// gpu/cpu/isa_{generic,avx2,avx512}.cpp inside a namespace of their own after
// they define V, its operations and the block sizes kMR, kNP, kNP1:
//
//   vzero() vset1(f) viota() vload(p) vload_n(p, n) vstore(p, v) vstore_n(p, v, n)
//   vload_f16(p) vload_bf16(p) (16 halves / bfloat16s at p, widened: exact)
//   vfma(a, b, c) vadd vsub vmul vdiv vmin(a, b) = a < b ? a : b
//   vround(v) (to nearest even) vpow2i(n) (2^n, integral n) vselect_lt(a, b, x, y)
//   vreduce_max(v) vtree_sum(v) (fixed::tree_sum16's tree)
//
// Every value is computed as gpu/fixed_math.h says, lane by lane, so the three
// compilations agree bit for bit. No std:: templates in here: an out-of-line
// copy compiled for AVX-512 could be picked by the linker for other callers.

using Index = long long;

inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }

// The first w (<= 16) floats at p, the other lanes 0: a whole load when all
// 16 are wanted.
inline V vload_upto(const float* p, int w) { return w == 16 ? vload(p) : vload_n(p, w); }

// The first w (<= 16) lanes of v to p: a whole store when all 16 are wanted.
inline void vstore_upto(float* p, const V& v, int w) {
  if (w == 16) {
    vstore(p, v);
  } else if (w > 0) {
    vstore_n(p, v, w);
  }
}

// ---------------------------------------------------------------- exp

// fixed::fixed_exp on every lane; lanes below kExpLo compute garbage that the
// last select replaces by 0.
inline V vexp(V x) {
  const V xc = vmin(x, vset1(fixed::kExpHi));
  const V n = vround(vmul(xc, vset1(fixed::kLog2e)));
  V r = vfma(n, vset1(-fixed::kLn2Hi), xc);
  r = vfma(n, vset1(-fixed::kLn2Lo), r);
  V p = vset1(fixed::kExpC0);
  p = vfma(p, r, vset1(fixed::kExpC1));
  p = vfma(p, r, vset1(fixed::kExpC2));
  p = vfma(p, r, vset1(fixed::kExpC3));
  p = vfma(p, r, vset1(fixed::kExpC4));
  p = vfma(p, r, vset1(fixed::kExpC5));
  const V z = vmul(r, r);
  V y = vadd(vfma(p, z, r), vset1(1.0f));
  y = vmul(y, vpow2i(vselect_lt(x, vset1(fixed::kExpLo), vzero(), n)));
  return vselect_lt(x, vset1(fixed::kExpLo), vzero(), y);
}

void exp_array(const float* x, float* y, long long n) {
  long long i = 0;
  for (; i + 16 <= n; i += 16) vstore(y + i, vexp(vload(x + i)));
  if (i < n) vstore_n(y + i, vexp(vload_n(x + i, int(n - i))), int(n - i));
}

// ---------------------------------------------------------------- SwiGLU

void swiglu_range(float* gate, const float* up, long long begin, long long end) {
  const V one = vset1(1.0f);
  long long i = begin;
  for (; i < end; i += 16) {
    const int w = int(end - i < 16 ? end - i : 16);
    const V g = vload_upto(gate + i, w);
    const V u = vload_upto(up + i, w);
    const V s = vmul(g, vdiv(one, vadd(one, vexp(vsub(vzero(), g)))));
    vstore_upto(gate + i, vmul(s, u), w);
  }
}

// ---------------------------------------------------------------- matrix product

// The weights' element in a panel: f32, or a 16-bit float widened on load
// (exactly, so the product is the f32 rule's on the values it holds).
struct Half16 {
  uint16_t bits;
};
struct Brain16 {
  uint16_t bits;
};
inline V wload(const float* p) { return vload(p); }
inline V wload(const Half16* p) { return vload_f16(&p->bits); }
inline V wload(const Brain16* p) { return vload_bf16(&p->bits); }

// Rows [0, MR) of C against NP consecutive panels: acc[r][j] holds C[r][16j ..
// 16j+15]; k runs in order, one FMA per term, from 0 (the fixed rule).
template <int MR, int NP, class W>
inline void mm_block(const float* a, int lda, const W* panel, Index panel_floats, float* c, int ldc, int k,
                     int cols) {
  V acc[MR][NP];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) acc[r][j] = vzero();
  for (int kk = 0; kk < k; ++kk) {
    V b[NP];
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) b[j] = wload(panel + j * panel_floats + Index(kk) * 16);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const V av = vset1(a[Index(r) * lda + kk]);
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) acc[r][j] = vfma(av, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP; ++j) vstore_upto(c + Index(r) * ldc + 16 * j, acc[r][j], imin(16, cols - 16 * j));
}

// mm_block<rows, np> for rows <= MR, np <= NP chosen at run time.
template <int MR, int NP, class W>
inline void mm_call(int rows, int np, const float* a, int lda, const W* panel, Index panel_floats, float* c,
                    int ldc, int k, int cols) {
  if constexpr (MR > 1) {
    if (rows < MR) return mm_call<MR - 1, NP>(rows, np, a, lda, panel, panel_floats, c, ldc, k, cols);
  }
  if constexpr (NP > 1) {
    if (np < NP) return mm_call<MR, NP - 1>(rows, np, a, lda, panel, panel_floats, c, ldc, k, cols);
  }
  mm_block<MR, NP>(a, lda, panel, panel_floats, c, ldc, k, cols);
}

// A's rows are taken in blocks of about this many bytes, so a block stays in
// L2 while every panel streams past it.
constexpr Index kRowBlockBytes = 192 * 1024;

template <class W>
void matmul_panels_of(const float* a, const W* w, float* c, int m, int n, int k, int p0, int p1) {
  const Index panel_floats = Index(16) * k;
  if (m == 1) {  // one row (a decode step alone): stream kNP1 panels at once
    for (int p = p0; p < p1; p += kNP1) {
      const int np = imin(kNP1, p1 - p);
      mm_call<1, kNP1>(1, np, a, k, w + p * panel_floats, panel_floats, c + 16 * p, n, k, n - 16 * p);
    }
    return;
  }
  int mc = int(kRowBlockBytes / (Index(4) * k)) / kMR * kMR;
  mc = imax(mc, kMR);
  for (int i0 = 0; i0 < m; i0 += mc) {
    const int mi = imin(mc, m - i0);
    for (int p = p0; p < p1; p += kNP) {
      const int np = imin(kNP, p1 - p);
      for (int i = i0; i < i0 + mi; i += kMR) {
        const int rows = imin(kMR, i0 + mi - i);
        mm_call<kMR, kNP>(rows, np, a + Index(i) * k, k, w + p * panel_floats, panel_floats,
                          c + Index(i) * n + 16 * p, n, k, n - 16 * p);
      }
    }
  }
}

void matmul_panels(const float* a, const float* w, float* c, int m, int n, int k, int p0, int p1) {
  matmul_panels_of(a, w, c, m, n, k, p0, p1);
}

void matmul_panels16(WeightType type, const float* a, const uint16_t* w, float* c, int m, int n, int k, int p0,
                     int p1) {
  if (type == WeightType::f16) matmul_panels_of(a, reinterpret_cast<const Half16*>(w), c, m, n, k, p0, p1);
  else matmul_panels_of(a, reinterpret_cast<const Brain16*>(w), c, m, n, k, p0, p1);
}

// ---------------------------------------------------------------- attention

// How raw scores become q.k / sqrt(head_size): dividing by the root, or, when
// the root is a power of two, multiplying by its inverse (which rounds the
// same, and is faster). Worked out once per attention call.
struct ScoreScale {
  V factor;
  bool multiply;
  explicit ScoreScale(int head_size) {
    const float root = sqrtf(float(head_size));
    int exponent = 0;
    multiply = frexpf(root, &exponent) == 0.5f;
    factor = vset1(multiply ? 1.0f / root : root);
  }
  V apply(const V& raw) const { return multiply ? vmul(raw, factor) : vdiv(raw, factor); }
};

// One query head of one row while its group is attended: its query, running
// output, max and sum, and its position (it attends keys [0, pos]).
struct HeadState {
  const float* q;  // head_size floats
  float* o;        // hv * 16 floats
  float* m;
  float* l;
  int pos;
};

// s[r][q]: the raw scores of heads h[0..NR) against NT key tiles (kt[q]:
// the tile's K of this head, [j][16] as the cache stores it), each lane a
// sequential fma chain over j.
template <int NR, int NT>
inline void scores_rows(const HeadState* h, const float* const* kt, int hs, V (*s)[kSuperTiles]) {
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < NT; ++q) s[r][q] = vzero();
  for (int j = 0; j < hs; ++j) {
    V kj[NT];
#pragma GCC unroll 4
    for (int q = 0; q < NT; ++q) kj[q] = vload(kt[q] + Index(j) * 16);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const V qj = vset1(h[r].q[j]);
#pragma GCC unroll 4
      for (int q = 0; q < NT; ++q) s[r][q] = vfma(qj, kj[q], s[r][q]);
    }
  }
}

// scores_rows<NR, nt> for nt <= NT chosen at run time.
template <int NR, int NT>
inline void scores_call(int nt, const HeadState* h, const float* const* kt, int hs, V (*s)[kSuperTiles]) {
  if constexpr (NT > 1) {
    if (nt < NT) return scores_call<NR, NT - 1>(nt, h, kt, hs, s);
  }
  scores_rows<NR, NT>(h, kt, hs, s);
}

// o = o * corr, then o = fma(p[i], v_i, o) for i in order, for NR heads of HV
// whole vectors; the rows' chains advance together over the positions all of
// them cover, then each finishes its own.
template <int NR, int HV>
inline void values_rows(const HeadState* const* h, const float* corr, const float (*p)[16], const int* valid,
                        const float* const* vrows) {
  V acc[NR][HV];
  int common = valid[0];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r) {
    common = imin(common, valid[r]);
    const V cv = vset1(corr[r]);
#pragma GCC unroll 8
    for (int c = 0; c < HV; ++c) acc[r][c] = vmul(vload(h[r]->o + 16 * c), cv);
  }
  for (int i = 0; i < common; ++i) {
    V vi[HV];
#pragma GCC unroll 8
    for (int c = 0; c < HV; ++c) vi[c] = vload(vrows[i] + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      const V pi = vset1(p[r][i]);
#pragma GCC unroll 8
      for (int c = 0; c < HV; ++c) acc[r][c] = vfma(pi, vi[c], acc[r][c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = common; i < valid[r]; ++i)
      for (int c = 0; c < HV; ++c) acc[r][c] = vfma(vset1(p[r][i]), vload(vrows[i] + 16 * c), acc[r][c]);
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < HV; ++c) vstore(h[r]->o + 16 * c, acc[r][c]);
}

// The same for any head size (a partial last vector), one head at a time.
inline void values_any(const HeadState& h, float corr, const float* p, int valid, const float* const* vrows, int hs) {
  const V cv = vset1(corr);
  for (int c = 0; 16 * c < hs; ++c) {
    const int w = imin(16, hs - 16 * c);
    V acc = vmul(vload(h.o + 16 * c), cv);
    for (int i = 0; i < valid; ++i) acc = vfma(vset1(p[i]), vload_n(vrows[i] + 16 * c, w), acc);
    vstore(h.o + 16 * c, acc);
  }
}

// NR heads through the ntiles key tiles starting at s0. Each step is written
// for all NR heads at once (independent chains the CPU overlaps); a head whose
// position ends before a tile computes it but keeps nothing of it.
template <int NR>
void attend_heads(const HeadState* hb, int s0, int ntiles, const float* const* kt, const float* const* vrow,
                  int hs, const ScoreScale& scale) {
  constexpr int T = fixed::kKeyTile;
  int max_pos = 0;
  for (int r = 0; r < NR; ++r) max_pos = imax(max_pos, hb[r].pos);
  const int nt = imin(ntiles, (max_pos - s0) / T + 1);
  V s[NR][kSuperTiles];
  scores_call<NR, kSuperTiles>(nt, hb, kt, hs, s);
  const V iota = viota();
  const int hv = (hs + 15) / 16;
  const bool whole = hs == 16 * hv && (hv == 1 || hv == 2 || hv == 4 || hv == 8);
  // Softmax of every (head, tile) first: the exps of all of them are
  // independent once each tile's running max is known, so the CPU overlaps
  // them; then the value sums, tile by tile in order (the fixed recurrence).
  int valid[kSuperTiles][NR];
  float m_new[kSuperTiles][NR], corr[kSuperTiles][NR];
  float pl[kSuperTiles][NR][16];
  float l[NR];
  V sc[kSuperTiles][NR];
  for (int q = 0; q < nt; ++q)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      valid[q][r] = imin(T, hb[r].pos - (s0 + q * T) + 1);
      sc[q][r] = vselect_lt(iota, vset1(float(valid[q][r])), scale.apply(s[r][q]), vset1(-INFINITY));
    }
  // The running max through the tiles a head covers; the correction
  // exponents of all (tile, head) pairs go through one vector exp.
  float corr_arg[kSuperTiles * NR];
  for (int r = 0; r < NR; ++r) {
    float m = *hb[r].m;
    for (int q = 0; q < nt; ++q) {
      const float tile_max = vreduce_max(sc[q][r]);
      const float mn = m > tile_max ? m : tile_max;
      corr_arg[q * NR + r] = m - mn;
      m_new[q][r] = mn;
      if (valid[q][r] > 0) m = mn;
    }
    *hb[r].m = m;
  }
  for (int i = 0; i < nt * NR; i += 16) {
    const int w = imin(16, nt * NR - i);
    float e[16];
    vstore(e, vexp(vload_n(corr_arg + i, w)));
    for (int k = 0; k < w; ++k) corr[(i + k) / NR][(i + k) % NR] = e[k];
  }
  for (int q = 0; q < nt; ++q)
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) vstore(pl[q][r], vexp(vsub(sc[q][r], vset1(m_new[q][r]))));
  for (int r = 0; r < NR; ++r) {
    l[r] = *hb[r].l;
    for (int q = 0; q < nt && valid[q][r] > 0; ++q) {
      l[r] = l[r] * corr[q][r];
      l[r] = l[r] + vtree_sum(vload(pl[q][r]));
    }
    *hb[r].l = l[r];
  }
  for (int q = 0; q < nt; ++q) {
    const float* const* vrows = vrow + q * T;
    bool all = true;
    for (int r = 0; r < NR; ++r) all = all && valid[q][r] > 0;
    if (all && whole) {
      const HeadState* act[NR];
      for (int r = 0; r < NR; ++r) act[r] = &hb[r];
      switch (hv) {
        case 1: values_rows<NR, 1>(act, corr[q], pl[q], valid[q], vrows); break;
        case 2: values_rows<NR, 2>(act, corr[q], pl[q], valid[q], vrows); break;
        case 4: values_rows<NR, 4>(act, corr[q], pl[q], valid[q], vrows); break;
        default: values_rows<NR, 8>(act, corr[q], pl[q], valid[q], vrows); break;
      }
    } else {
      for (int r = 0; r < NR; ++r)
        if (valid[q][r] > 0) values_any(hb[r], corr[q][r], pl[q][r], valid[q][r], vrows, hs);
    }
  }
}

// Up to kAttnRows heads: attend_heads<nb>.
template <int NR>
void attend_batch(const HeadState* hb, int nb, int s0, int ntiles, const float* const* kt,
                  const float* const* vrow, int hs, const ScoreScale& scale) {
  if constexpr (NR > 1) {
    if (nb < NR) return attend_batch<NR - 1>(hb, nb, s0, ntiles, kt, vrow, hs, scale);
  }
  attend_heads<NR>(hb, s0, ntiles, kt, vrow, hs, scale);
}

void attention_group(const AttentionArgs& a, int r0, int r1, int kvh, float* scratch) {
  constexpr int T = fixed::kKeyTile;
  namespace kvl = kv_layout;
  const int hs = a.head_size, group = a.n_heads / a.n_kv_heads, nrows = r1 - r0;
  const int hv = (hs + 15) / 16;  // vectors per head
  const Index qw = Index(a.n_heads) * hs;

  float* o = scratch;                                   // [nrows * group][hv * 16]: running outputs
  float* mrun = o + Index(nrows) * group * hv * T;      // [nrows * group]: running max
  float* lrun = mrun + Index(nrows) * group;            // [nrows * group]: running sum
  int max_pos = 0;
  for (int r = r0; r < r1; ++r) max_pos = imax(max_pos, a.positions[r]);
  for (Index i = 0; i < Index(nrows) * group * hv * T; ++i) o[i] = 0.0f;
  for (int i = 0; i < nrows * group; ++i) {
    mrun[i] = -INFINITY;
    lrun[i] = 0.0f;
  }
  auto state = [&](int rr, int g) {
    const int i = rr * group + g;
    return HeadState{a.q + Index(r0 + rr) * qw + Index(kvh * group + g) * hs, o + Index(i) * hv * T, mrun + i,
                     lrun + i, a.positions[r0 + rr]};
  };
  const ScoreScale scale(hs);
  const float* kt[kSuperTiles];
  const float* vrow[kSuperTiles * T];

  for (int s0 = 0; s0 <= max_pos; s0 += kSuperTiles * T) {
    const int ntiles = imin(kSuperTiles, (max_pos - s0) / T + 1);
    // The tiles' K as stored ([j][16] per tile: no transpose) and their V
    // rows; keys past max_pos in the last tile are never kept (masked).
    for (int q = 0; q < ntiles; ++q) {
      const int t0 = s0 + q * T;
      const float* region = kvl::layer_region(a.kv, a.layer, r0, t0);
      kt[q] = region + kvl::k_index(a.kv.kv_dim, t0 % a.kv.block_size, kvh * hs);
      for (int i = 0; i < T; ++i)
        vrow[q * T + i] = region + kvl::v_index(a.kv, (t0 + i) % a.kv.block_size) +
                          Index(kvh) * hs;
    }
    // The heads that attend these tiles, kAttnRows at a time.
    HeadState hb[kAttnRows];
    int nb = 0;
    for (int rr = 0; rr < nrows; ++rr) {
      if (a.positions[r0 + rr] < s0) continue;
      for (int g = 0; g < group; ++g) {
        hb[nb++] = state(rr, g);
        if (nb == kAttnRows) {
          attend_batch<kAttnRows>(hb, nb, s0, ntiles, kt, vrow, hs, scale);
          nb = 0;
        }
      }
    }
    if (nb > 0) attend_batch<kAttnRows>(hb, nb, s0, ntiles, kt, vrow, hs, scale);
  }
  for (int rr = 0; rr < nrows; ++rr)
    for (int g = 0; g < group; ++g) {
      const int i = rr * group + g;
      const V lv = vset1(lrun[i]);
      float* dst = a.out + Index(r0 + rr) * qw + Index(kvh * group + g) * hs;
      for (int c = 0; c < hv; ++c) {
        const int w = imin(16, hs - 16 * c);
        vstore_upto(dst + 16 * c, vdiv(vload(o + Index(i) * hv * T + 16 * c), lv), w);
      }
    }
}

const KernelTable& table() {
  static const KernelTable t{kIsaName, &matmul_panels, &attention_group, &swiglu_range, &exp_array,
                             &matmul_quantized, &matmul_panels16, &matmul_kquant, &quantize_q8, &quantize_q8k};
  return t;
}
