// The quantized matrix products (Q8_0, Q4_0) of one instruction set (the
// rule: gpu/fixed_math.h, "quantized matrix product"; the reference:
// gpu/quant.cpp matmul_quantized_reference). Included by each
// gpu/cpu/isa_*.cpp inside its namespace: with AVX2 (the avx2 and avx512
// compilations) a block's 32 products are summed by vpmaddubsw / vpmaddwd,
// under AVX-512 VNNI a prefill's by vpdpbusd, otherwise by a scalar loop;
// the sums are exact integers every way, so every compilation returns the
// same bits. T is the weights' type.

// A block's half-precision scale as a float (exact).
inline float q8_scale(const uint8_t* block) {
  uint16_t h;
  std::memcpy(&h, block, 2);
  const uint32_t exponent = (h >> 10) & 0x1f;
  if (exponent == 0 || exponent == 0x1f) return half_to_float(h);  // zero, subnormal, inf, NaN
  const uint32_t bits = uint32_t(h & 0x8000) << 16 | (exponent + 112) << 23 | uint32_t(h & 0x3ff) << 13;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX2__)
// The `bytes` at `next` fetched into the caches in `shares` shares: a
// tile of eight weight rows reads them as eight interleaved streams, which
// the hardware prefetchers follow badly (Zen 3: a third of the bandwidth), so
// the tile fetches the tile after next (contiguous rows) while it computes,
// into L2: into L1 the prefetches took the fill buffers the demand loads
// needed (Intel Xeon, 1B-shaped Q8_0 decode: 69% -> 78% of the read
// bandwidth). The lines of each share are counted once per tile.
struct PrefetchShares {
  PrefetchShares(const uint8_t* next, size_t bytes, int shares)
      : base(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(next) & ~uintptr_t(63))),
        lines((reinterpret_cast<uintptr_t>(next) + bytes - reinterpret_cast<uintptr_t>(base) + 63) / 64),
        per((lines + size_t(shares) - 1) / size_t(shares)) {}
  void fetch(int i) const {
    for (size_t l = size_t(i) * per, end = std::min(lines, l + per); l < end; ++l) _mm_prefetch(base + 64 * l, _MM_HINT_T1);
  }
  const char* base;
  size_t lines, per;
};

// Lane i: u[4i] s[4i] + .. + u[4i + 3] s[4i + 3] (u unsigned, s signed
// bytes; no pair may pass int16, which the callers' ranges keep): one
// vpdpbusd under AVX-512 VNNI, else vpmaddubsw then vpmaddwd. Exact both ways.
inline __m256i q8_dot4(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The largest of m's 8 lanes (none NaN), and the sum of v's 8 int32 lanes.
inline float q8_hmax(__m256 m) {
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
inline int32_t q8_hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// A block's 32 weights as int8, in value order.
template <WeightType T>
inline __m256i q8_weights(const uint8_t* block) {
  if constexpr (T == WeightType::q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i nibble = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, nibble), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble);
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
  }
}
#endif

// sum_j w[j] * a[j] over one block of 32, exactly.
template <WeightType T>
inline int32_t q8_dot32(const uint8_t* block, const int8_t* a) {
#if defined(__AVX2__)
  const __m256i qw = q8_weights<T>(block);
  const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  // |w| (as unsigned) times a with w's sign: pairs of products in int16
  // (at most 2 * 128 * 127: no saturation, as |a| <= 127), then in int32.
  const __m256i p32 = q8_dot4(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
  return q8_hsum(p32);
#else
  int8_t w[kQ8Block];
  unpack_block(T, block, w);
  int32_t sum = 0;
  for (int j = 0; j < kQ8Block; ++j) sum += int32_t(w[j]) * int32_t(a[j]);
  return sum;
#endif
}

// One output: row r of the activations against column `col`'s weights.
template <WeightType T>
inline float q8_one(const float* scales, const int8_t* qa, const uint8_t* w, int k, int blocks, size_t row_size,
                    int r, int col) {
  const uint8_t* wrow = w + size_t(col) * row_size;
  const float* s = scales + size_t(r) * blocks;
  const int8_t* q = qa + size_t(r) * k;
  float acc = 0.0f;
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* block = wrow + size_t(b) * block_bytes(T);
    const int32_t isum = q8_dot32<T>(block, q + size_t(b) * kQ8Block);
    acc = std::fma(float(isum), q8_scale(block) * s[b], acc);
  }
  return acc;
}

// Four outputs of one row (a decode step): columns col .. col + 3, each its
// own chain of the rule's fmas, interleaved so that the four run at once.
template <WeightType T>
inline void q8_four(const float* scales, const int8_t* qa, const uint8_t* w, float* c, int n, int k, int blocks,
                    size_t row_size, int r, int col) {
  const float* s = scales + size_t(r) * blocks;
  const int8_t* q = qa + size_t(r) * k;
  const uint8_t* wrow = w + size_t(col) * row_size;
  float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* block = wrow + size_t(b) * block_bytes(T);
    const int8_t* a = q + size_t(b) * kQ8Block;
    const int32_t i0 = q8_dot32<T>(block, a), i1 = q8_dot32<T>(block + row_size, a),
                  i2 = q8_dot32<T>(block + 2 * row_size, a), i3 = q8_dot32<T>(block + 3 * row_size, a);
    acc0 = std::fma(float(i0), q8_scale(block) * s[b], acc0);
    acc1 = std::fma(float(i1), q8_scale(block + row_size) * s[b], acc1);
    acc2 = std::fma(float(i2), q8_scale(block + 2 * row_size) * s[b], acc2);
    acc3 = std::fma(float(i3), q8_scale(block + 3 * row_size) * s[b], acc3);
  }
  float* out = c + size_t(r) * n + col;
  out[0] = acc0;
  out[1] = acc1;
  out[2] = acc2;
  out[3] = acc3;
}

#if defined(__AVX2__)
// Lane i: the sum of v[i]'s 8 lanes (exact: int32).
inline __m256i q8_hsum8(const __m256i* v) {
  const __m256i b0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

// Eight rows (r0 .. r0 + 7) of one column: each block's eight exact sums at
// once, then each lane's fma of the rule, in block order, as q8_one computes
// it. `st` holds the eight rows' activation scales block by block (st[8b +
// i]: row r0 + i's), `a8` (Q4_0) 8 x their block sums likewise, laid out so
// by the caller once for every column: Q4_0's nibbles enter unsigned and
// 8 * sum(a) comes off, as in q8_row8.
template <WeightType T>
inline void q8_col8(const float* st, const int32_t* a8, const int8_t* qa, const uint8_t* w, float* c, int n, int k,
                    int blocks, size_t row_size, int r0, int col) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const uint8_t* wrow = w + size_t(col) * row_size;
  __m256 acc = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* block = wrow + size_t(b) * block_bytes(T);
    __m256i sums[8];
    __m256i qw, wabs;
    if constexpr (T == WeightType::q8_0) {
      qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
      wabs = _mm256_sign_epi8(qw, qw);
    } else {
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
      qw = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), nibble);  // q, unsigned
      wabs = qw;
    }
#pragma GCC unroll 8
    for (int ri = 0; ri < 8; ++ri) {
      const __m256i qv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + size_t(r0 + ri) * k + size_t(b) * kQ8Block));
      const __m256i signed_a = T == WeightType::q8_0 ? _mm256_sign_epi8(qv, qw) : qv;
      sums[ri] = q8_dot4(wabs, signed_a);
    }
    __m256i isum = q8_hsum8(sums);
    if constexpr (T == WeightType::q4_0)
      isum = _mm256_sub_epi32(isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a8 + size_t(b) * 8)));
    const __m256 scale = _mm256_mul_ps(_mm256_set1_ps(q8_scale(block)), _mm256_loadu_ps(st + size_t(b) * 8));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, acc);
  for (int ri = 0; ri < 8; ++ri) c[size_t(r0 + ri) * n + col] = out[ri];
}

// 8 x the sum of a block's 32 activations (Q4_0's nibbles enter unsigned:
// this comes off their sums to give sum (q - 8) a).
inline int32_t q8_block_sum8(const int8_t* q) {
  int32_t sum = 0;
  for (int j = 0; j < kQ8Block; ++j) sum += q[j];
  return 8 * sum;
}

// For each tile of eight rows from r0 (up to r1), its rows' activation
// scales and (Q4_0) 8 x block sums in q8_col8's layout: tile t's at
// [t * blocks * 8, ...).
inline void q8_tile_scales(const float* scales, const int8_t* qa, int k, int blocks, int r0, int r1, float* st,
                           int32_t* a8) {
  for (int t = 0; r0 + 8 * t + 8 <= r1; ++t)
    for (int b = 0; b < blocks; ++b)
      for (int i = 0; i < 8; ++i) {
        const int r = r0 + 8 * t + i;
        st[(size_t(t) * blocks + b) * 8 + i] = scales[size_t(r) * blocks + b];
        a8[(size_t(t) * blocks + b) * 8 + i] = q8_block_sum8(qa + size_t(r) * k + size_t(b) * kQ8Block);
      }
}

// The half-precision scales of block `b` of eight weight rows from `wrow`
// as floats (exact).
inline __m256 q8_scales8(const uint8_t* wrow, size_t row_size, size_t at) {
#if defined(__AVX512VL__)
  const __m256i rows = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int(row_size)));
  const __m256i words = _mm256_i32gather_epi32(reinterpret_cast<const int*>(wrow + at), rows, 1);
  return _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
#else
  // (Inserted one by one: a 16-byte load of eight 2-byte stores would wait for them.)
  uint16_t dh[8];
  for (int ci = 0; ci < 8; ++ci) std::memcpy(&dh[ci], wrow + size_t(ci) * row_size + at, 2);
  return _mm256_cvtph_ps(_mm_set_epi16(short(dh[7]), short(dh[6]), short(dh[5]), short(dh[4]), short(dh[3]),
                                       short(dh[2]), short(dh[1]), short(dh[0])));
#endif
}

// Eight columns of one row (a decode step, a small batch) of Q8_0: each
// block's eight exact sums at once, then each lane's fma of the rule, as
// q8_one computes it.
inline void q8_row8(const float* scales, const int8_t* qa, const uint8_t* w, float* c, int n, int k, int blocks,
                    size_t row_size, int r, int col) {
  constexpr size_t kBytes = block_bytes(WeightType::q8_0);
  const float* s = scales + size_t(r) * blocks;
  const int8_t* q = qa + size_t(r) * k;
  const uint8_t* wrow = w + size_t(col) * row_size;
  __m256 acc = _mm256_setzero_ps();
  const PrefetchShares ahead(wrow + 16 * row_size, 8 * row_size, blocks);
  for (int b = 0; b < blocks; ++b) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + size_t(b) * kQ8Block));
    ahead.fetch(b);
    __m256i sums[8];
#pragma GCC unroll 8
    for (int ci = 0; ci < 8; ++ci) {
      const uint8_t* block = wrow + size_t(ci) * row_size + size_t(b) * kBytes;
      const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
      sums[ci] = q8_dot4(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qv, qw));
    }
    const __m256i isum = q8_hsum8(sums);
    const __m256 dw = q8_scales8(wrow, row_size, size_t(b) * kBytes);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(s[b])), acc);
  }
  _mm256_storeu_ps(c + size_t(r) * n + col, acc);
}

// The same for Q4_0, two columns a register (AVX-512: four): the columns'
// packed nibbles side by side, low nibbles (values 0 .. 15) against the
// block's first 16 activations in every part, high ones against the last 16;
// the four lanes of a part sum to its column's integer sum of q a (q
// unsigned), and `a8` (8 x each block's activation sum, per block) comes off:
// sum (q - 8) a, exactly. (Intel Xeon, m50 from L3: 417 -> 548 tok/s
// against 8 columns of one register each.)
inline void q4_row8(const float* scales, const int8_t* qa, const int32_t* a8, const uint8_t* w, float* c, int n,
                    int k, int blocks, size_t row_size, int r, int col) {
  constexpr size_t kBytes = block_bytes(WeightType::q4_0);
  const float* s = scales + size_t(r) * blocks;
  const int8_t* q = qa + size_t(r) * k;
  const uint8_t* wrow = w + size_t(col) * row_size;
  __m256 acc = _mm256_setzero_ps();
  const PrefetchShares ahead(wrow + 16 * row_size, 8 * row_size, blocks);
  for (int b = 0; b < blocks; ++b) {
    const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + size_t(b) * kQ8Block));
    ahead.fetch(b);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    // Four columns a register (one per 128-bit quarter): quarter i of
    // sums4[h] sums column 4h + i.
    const __m512i alo4 = _mm512_broadcast_i32x4(_mm256_castsi256_si128(qv));
    const __m512i ahi4 = _mm512_broadcast_i32x4(_mm256_extracti128_si256(qv, 1));
    const __m512i nibble4 = _mm512_set1_epi8(0x0f);
    __m512i sums4[2];
    for (int h = 0; h < 2; ++h) {
      const uint8_t* block = wrow + size_t(4 * h) * row_size + size_t(b) * kBytes + 2;
      __m512i packed = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
      packed = _mm512_inserti32x4(packed, _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + row_size)), 1);
      packed = _mm512_inserti32x4(packed, _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 * row_size)), 2);
      packed = _mm512_inserti32x4(packed, _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 3 * row_size)), 3);
      const __m512i lo = _mm512_and_si512(packed, nibble4);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble4);
      sums4[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, alo4), hi, ahi4);
    }
    // Each quarter's four lanes summed: (x0 + x2, y0 + y2, x1 + x3, y1 + y3),
    // then the two pairs: quarter i holds (column i, column 4 + i, ...).
    const __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi32(sums4[0], sums4[1]), _mm512_unpackhi_epi32(sums4[0], sums4[1]));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t, t), _mm512_unpackhi_epi64(t, t));
    const __m256i isum = _mm256_sub_epi32(
        _mm512_castsi512_si256(_mm512_permutexvar_epi32(
            _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0), u)),
        _mm256_set1_epi32(a8[b]));
#else
    const __m256i alo = _mm256_permute2x128_si256(qv, qv, 0x00), ahi = _mm256_permute2x128_si256(qv, qv, 0x11);
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    __m256i sums[4];
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const uint8_t* block = wrow + size_t(2 * p) * row_size + size_t(b) * kBytes + 2;
      const __m256i packed =
          _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block))),
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + row_size)), 1);
      const __m256i lo = _mm256_and_si256(packed, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
      sums[p] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, alo), hi, ahi);
#else  // pairs of at most 2 * 15 * 128, two of them: no int16 saturation
      sums[p] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi)),
                                  _mm256_set1_epi16(1));
#endif
    }
    // Lane j of the three hadds' result holds column (0, 2, 4, 6, 1, 3, 5, 7)[j].
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(sums[0], sums[1]), _mm256_hadd_epi32(sums[2], sums[3]));
    const __m256i isum = _mm256_sub_epi32(_mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
                                          _mm256_set1_epi32(a8[b]));
#endif
    const __m256 dw = q8_scales8(wrow, row_size, size_t(b) * kBytes);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw, _mm256_set1_ps(s[b])), acc);
  }
  _mm256_storeu_ps(c + size_t(r) * n + col, acc);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// A prefill (or a batch) under AVX-512 VNNI: a tile of 16 columns, one per
// lane, so a block's 32 products of a row and a column are summed in the
// column's own lane by eight vpdpbusd and no horizontal sum is needed. The
// tile's weights are re-laid once per call into a panel (below) that every
// row then reads; vpdpbusd multiplies unsigned by signed bytes, so the
// activations enter as a + 128 (a XOR 0x80) and 128 x the block's weight sum
// comes off (the panel's bias, where each lane's sum starts): the exact
// integer sum of w a, as q8_one's, then the same fma of the rule.
constexpr int kVnniCols = 16;
constexpr int kVnniRows = 8;  // rows of one micro-kernel call: 8 + 8 accumulators
// One block of a panel: [8 groups][16 columns][4 weights] int8 (values 4g ..
// 4g + 3 of column c at 64g + 4c; Q4_0 as q - 8), then the 16 columns' bias
// (-128 x sum of the block's weights, int32), then their scales (float).
constexpr size_t kVnniPanelBlock = 8 * 64 + 64 + 64;

// 16 rows of 8 words (4 bytes each) transposed: lane c of out[w] is row c's
// word w. Row i sits beside row i + 8 in one register; per 256-bit half an
// 8 x 8 transpose: t pairs rows, u[4h + j] takes four rows' words j and
// j + 4 (one per 128-bit lane), vpermt2q joins rows 0-3 with 4-7.
inline void vnni_transpose(const __m256i (&rows)[16], __m512i (&out)[8]) {
  __m512i z[8], t[8], u[8];
  for (int i = 0; i < 8; ++i) z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(rows[i]), rows[i + 8], 1);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h)
    for (int e = 0; e < 2; ++e) {
      u[4 * h + 2 * e] = _mm512_unpacklo_epi64(t[4 * h + e], t[4 * h + 2 + e]);
      u[4 * h + 2 * e + 1] = _mm512_unpackhi_epi64(t[4 * h + e], t[4 * h + 2 + e]);
    }
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13), second = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int j = 0; j < 4; ++j) {
    out[j] = _mm512_permutex2var_epi64(u[j], first, u[4 + j]);
    out[j + 4] = _mm512_permutex2var_epi64(u[j], second, u[4 + j]);
  }
}

// Columns [col, col + cols) (cols <= 16; the others zero) of W as a panel:
// per block the 16 rows' values loaded as they lie and transposed
// (vnni_transpose): a third of the instructions of a gather per word (Intel Xeon,
// 1B-shaped Q8_0, batch of 16: 63 -> 66 tok/s; the pack, bound by reading
// the weights, is still a third of that step's time). Software prefetch of
// the next tile's rows made it slower (62 tok/s).
template <WeightType T>
inline void vnni_pack(const uint8_t* w, size_t row_size, int blocks, int col, int cols, uint8_t* panel) {
  const __mmask16 live = __mmask16((1u << cols) - 1u);
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(int(row_size)));
  const __m512i ones = _mm512_set1_epi8(1);
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* base = w + size_t(col) * row_size + size_t(b) * block_bytes(T);
    uint8_t* out = panel + size_t(b) * kVnniPanelBlock;
    __m256i values[kVnniCols];
    for (int i = 0; i < kVnniCols; ++i)
      values[i] = i < cols ? q8_weights<T>(base + size_t(i) * row_size) : _mm256_setzero_si256();
    __m512i words[8];
    vnni_transpose(values, words);
    __m512i sum = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g) {
      _mm512_store_si512(reinterpret_cast<__m512i*>(out + 64 * g), words[g]);
      sum = _mm512_dpbusd_epi32(sum, ones, words[g]);
    }
    _mm512_store_si512(reinterpret_cast<__m512i*>(out + 512), _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
    const __m512i halves = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, rows, base, 1);
    _mm512_store_ps(out + 576, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(halves)));
  }
}

// Rows [r, r + R) of the tile: `au` their activations + 128 (row stride k),
// `s` their scales (row stride `blocks`); `cols` lanes stored at c[.][col].
template <int R>
inline void vnni_rows(const uint8_t* panel, int blocks, const uint8_t* au, int k, const float* s, float* c, int n,
                      int r, int col, int cols) {
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* pb = panel + size_t(b) * kVnniPanelBlock;
    const __m512i bias = _mm512_load_si512(reinterpret_cast<const __m512i*>(pb + 512));
    __m512i isum[R];
    for (int i = 0; i < R; ++i) isum[i] = bias;
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      const __m512i wv = _mm512_load_si512(reinterpret_cast<const __m512i*>(pb + 64 * g));
      for (int i = 0; i < R; ++i) {
        int32_t four;
        std::memcpy(&four, au + size_t(r + i) * k + size_t(b) * kQ8Block + 4 * g, 4);
        isum[i] = _mm512_dpbusd_epi32(isum[i], _mm512_set1_epi32(four), wv);
      }
    }
    const __m512 dw = _mm512_load_ps(pb + 576);
    for (int i = 0; i < R; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]),
                               _mm512_mul_ps(dw, _mm512_set1_ps(s[size_t(r + i) * blocks + b])), acc[i]);
  }
  const __mmask16 live = __mmask16((1u << cols) - 1u);
  for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(c + size_t(r + i) * n + col, live, acc[i]);
}

template <int R>
void vnni_rows_upto(int rows, const uint8_t* panel, int blocks, const uint8_t* au, int k, const float* s, float* c,
                    int n, int r, int col, int cols) {
  if constexpr (R > 0) {
    if (rows == R) return vnni_rows<R>(panel, blocks, au, k, s, c, n, r, col, cols);
    vnni_rows_upto<R - 1>(rows, panel, blocks, au, k, s, c, n, r, col, cols);
  }
}

// C[m][n] for the columns [col_begin, col_end), tile by tile.
template <WeightType T>
void matmul_vnni_columns(const float* scales, const int8_t* qa, const uint8_t* w, float* c, int m, int n, int k,
                         int col_begin, int col_end) {
  const int blocks = k / kQ8Block;
  const size_t row_size = size_t(blocks) * block_bytes(T);
  thread_local std::vector<uint8_t> au;  // the activations + 128, m x k
  struct alignas(64) Line { uint8_t bytes[64]; };
  thread_local std::vector<Line> panel;  // one tile's panel
  au.resize(size_t(m) * k);
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (size_t i = 0; i < au.size(); i += kQ8Block)  // m x k: whole blocks of 32
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(au.data() + i),
                        _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + i)), flip));
  panel.resize(size_t(blocks) * kVnniPanelBlock / 64);
  auto* pb = reinterpret_cast<uint8_t*>(panel.data());
  for (int col = col_begin; col < col_end; col += kVnniCols) {
    const int cols = std::min(kVnniCols, col_end - col);
    vnni_pack<T>(w, row_size, blocks, col, cols, pb);
    int r = 0;
    for (; r + kVnniRows <= m; r += kVnniRows)
      vnni_rows<kVnniRows>(pb, blocks, au.data(), k, scales, c, n, r, col, cols);
    vnni_rows_upto<kVnniRows - 1>(m - r, pb, blocks, au.data(), k, scales, c, n, r, col, cols);
  }
}
#endif

// Row a (k values) quantized per block for the products above, bit for bit
// fixed::quantize_q8_block: max |a| lane by lane (max is exact and order-free;
// _mm256_max_ps(x, m) keeps m when x is NaN, as fmaxf(m, x)), the same
// scalar scale, and each q the low byte of rint(a * inv) as an int32, as the
// scalar conversion takes it.
void quantize_q8(const float* a, int k, float* scales, int8_t* q) {
#if defined(__AVX2__)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256i low_bytes = _mm256_set1_epi32(0xff);
  for (int b = 0; b < k / kQ8Block; ++b) {
    const float* x = a + size_t(b) * kQ8Block;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      m = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), m);
    }
    const float d = q8_hmax(m) / 127.0f;
    const __m256 inv = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i)
      i32[i] = _mm256_and_si256(
          _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
          low_bytes);
    // packus keeps 0 .. 255 as they are; the lanes come out in 128-bit halves, put back in order.
    const __m256i p16 = _mm256_packus_epi32(i32[0], i32[1]), p16b = _mm256_packus_epi32(i32[2], i32[3]);
    const __m256i p8 = _mm256_packus_epi16(p16, p16b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + size_t(b) * kQ8Block),
                        _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    scales[b] = fixed::round_to_half(d);
  }
#else
  for (int b = 0; b < k / kQ8Block; ++b)
    scales[b] = fixed::quantize_q8_block(a + size_t(b) * kQ8Block, q + size_t(b) * kQ8Block);
#endif
}

// Row a (k values) quantized per superblock for the K-quant products, bit for
// bit fixed::quantize_q8k_block: max |a| lane by lane (NaN kept out as
// there), the first value of that magnitude found by a compare, then each q
// as min(127, rint(iscale * a)) (_mm256_min_ps(v, 127) is 127 for NaN, as
// the scalar test) and the block sums from the int32 lanes.
void quantize_q8k(const float* a, int k, float* d, int8_t* q, int16_t* bsums) {
#if defined(__AVX2__)
  constexpr int kVectors = kQK / 8;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int b = 0; b < k / kQK; ++b) {
    const float* x = a + size_t(b) * kQK;
    int8_t* out = q + size_t(b) * kQK;
    int16_t* sums = bsums + size_t(b) * (kQK / 16);
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < kVectors; ++i) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + 8 * i), magnitude), m);
    const float amax = q8_hmax(m);
    if (amax == 0.0f) {
      std::memset(out, 0, kQK);
      for (int g = 0; g < kQK / 16; ++g) sums[g] = 0;
      d[b] = 0.0f;
      continue;
    }
    const __m256 target = _mm256_set1_ps(amax);
    int first = 0;
    for (int i = 0; i < kVectors; ++i) {
      const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + 8 * i), magnitude), target, _CMP_EQ_OQ));
      if (hits) {
        first = 8 * i + __builtin_ctz(unsigned(hits));
        break;
      }
    }
    const float iscale = -127.0f / x[first];
    const __m256 vs = _mm256_set1_ps(iscale), top = _mm256_set1_ps(127.0f);
    for (int g = 0; g < kQK / 16; ++g) {
      __m256i i32[2];
      for (int h2 = 0; h2 < 2; ++h2) {
        const __m256 v = _mm256_round_ps(_mm256_mul_ps(vs, _mm256_loadu_ps(x + 16 * g + 8 * h2)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        i32[h2] = _mm256_cvtps_epi32(_mm256_min_ps(v, top));
      }
      // q in [-127, 127]: the packs do not saturate; their 128-bit halves put back in order.
      const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[0], i32[1]), 0xd8);  // 16 x int16, in order
      const __m128i p8 = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * g), p8);
      sums[g] = int16_t(q8_hsum(_mm256_add_epi32(i32[0], i32[1])));
    }
    d[b] = 1.0f / iscale;
  }
#else
  for (int b = 0; b < k / kQK; ++b)
    d[b] = fixed::quantize_q8k_block(a + size_t(b) * kQK, q + size_t(b) * kQK, bsums + size_t(b) * (kQK / 16));
#endif
}

// Rows per pass over a range of columns: their quantized activations stay
// in L2 while every column's weights stream by once.
constexpr int kQ8RowBlock = 64;
// Rows a prefill tile computes (AVX2): 8 rows of one column, so each weight
// block is loaded once for 8 rows (measured on the 50M model, 1,000-token
// prefill, 1 thread, Zen 3: 8 x 1 3.13 s, 4 x 2 3.84 s, 2 x 4 3.86 s, single
// outputs 5.2 s).
constexpr int kQ8TileRows = 8;

// C[m][n] for the columns [col_begin, col_end) (activations quantized:
// `scales` m x k/32, `qa` m x k): under AVX2 tiles of 8 rows x 1 column (a
// prefill, a batch of 8 or more), else of 1 row x 8 columns (a decode step:
// eight weight rows streamed at once); single outputs at the edges and
// without AVX2.
template <WeightType T>
void matmul_quantized_columns(const float* scales, const int8_t* qa, const uint8_t* w, float* c, int m, int n, int k,
                              int col_begin, int col_end) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (m >= kQ8TileRows) return matmul_vnni_columns<T>(scales, qa, w, c, m, n, k, col_begin, col_end);
#endif
  const int blocks = k / kQ8Block;
  const size_t row_size = size_t(blocks) * block_bytes(T);
  for (int r0 = 0; r0 < m; r0 += kQ8RowBlock) {
    const int r1 = std::min(m, r0 + kQ8RowBlock);
    int col = col_begin;
#if defined(__AVX2__)
    if (r1 - r0 >= kQ8TileRows) {
      const int tiles = (r1 - r0) / kQ8TileRows;
      float* st = new float[size_t(tiles) * blocks * 8];
      int32_t* a8 = new int32_t[size_t(tiles) * blocks * 8];
      q8_tile_scales(scales, qa, k, blocks, r0, r1, st, a8);
      for (; col < col_end; ++col) {
        int r = r0;
        for (int t = 0; t < tiles; ++t, r += kQ8TileRows)
          q8_col8<T>(st + size_t(t) * blocks * 8, a8 + size_t(t) * blocks * 8, qa, w, c, n, k, blocks, row_size, r, col);
        for (; r < r1; ++r) c[size_t(r) * n + col] = q8_one<T>(scales, qa, w, k, blocks, row_size, r, col);
      }
      delete[] st;
      delete[] a8;
    } else if constexpr (T == WeightType::q8_0) {
      for (; col + 8 <= col_end; col += 8)
        for (int r = r0; r < r1; ++r) q8_row8(scales, qa, w, c, n, k, blocks, row_size, r, col);
    } else {
      thread_local std::vector<int32_t> a8;  // rows r0 .. r1: 8 x each block's activation sum
      a8.resize(size_t(r1 - r0) * blocks);
      for (int r = r0; r < r1; ++r)
        for (int b = 0; b < blocks; ++b)
          a8[size_t(r - r0) * blocks + b] = q8_block_sum8(qa + size_t(r) * k + size_t(b) * kQ8Block);
      for (; col + 8 <= col_end; col += 8)
        for (int r = r0; r < r1; ++r)
          q4_row8(scales, qa, a8.data() + size_t(r - r0) * blocks, w, c, n, k, blocks, row_size, r, col);
    }
#endif
    // Q4_0 without AVX2: four columns at once (m50 decode, 1 thread, Zen 3:
    // 2.85-3.0 s against 3.6 s for 333 tokens).
    if constexpr (T == WeightType::q4_0)
      for (; col + 4 <= col_end; col += 4)
        for (int r = r0; r < r1; ++r) q8_four<T>(scales, qa, w, c, n, k, blocks, row_size, r, col);
    for (; col < col_end; ++col)
      for (int r = r0; r < r1; ++r) c[size_t(r) * n + col] = q8_one<T>(scales, qa, w, k, blocks, row_size, r, col);
  }
}

void matmul_quantized(WeightType type, const float* scales, const int8_t* qa, const uint8_t* w, float* c, int m, int n,
                      int k, int col_begin, int col_end) {
  if (type == WeightType::q8_0) matmul_quantized_columns<WeightType::q8_0>(scales, qa, w, c, m, n, k, col_begin, col_end);
  else matmul_quantized_columns<WeightType::q4_0>(scales, qa, w, c, m, n, k, col_begin, col_end);
}
