// The K-quant matrix products (Q4_K, Q5_K, Q6_K against Q8_K activations)
// of one instruction set (the rule: gpu/fixed_math.h, "K-quant matrix
// product"; the reference: gpu/kquant.cpp matmul_k_reference). Included by
// each gpu/cpu/isa_*.cpp inside its namespace after q8_kernels.inl. Per
// output and superblock the kernel finds two exact integers, S1 (the scaled
// quant products) and S2 (the mins against the activation block sums), by
// vpmaddubsw / vpmaddwd under AVX2 or by scalar loops otherwise, then adds
// them to the output with the rule's two fmas: every compilation returns the
// same bits. A column's superblock is unpacked once for all the rows of a
// row block (a prefill), so the unpacking is paid once per weight read.

// A superblock's weights unpacked for the products: 256 quants in value
// order (Q6_K: signed), each 32 values' scale as int16 lanes (Q6_K: two
// scales, one per 16), the mins (Q4_K, Q5_K) spread over the 16 block sums'
// lanes, d and dmin.
struct KWeights {
#if defined(__AVX2__)
  __m256i q[8];       // values 32i .. 32i + 31
  __m256i scale[8];   // int16 lanes: the scale of each pair of products vpmaddubsw forms
  __m256i mins;       // int16 lane g: mn(g / 2)
#else
  int8_t q[kQK];
  int scale[16];      // Q4_K, Q5_K: per 32 values (8 used); Q6_K: per 16
  int mins[8];
#endif
  float d, dmin;
};

template <WeightType T>
inline void k_unpack(const uint8_t* y, KWeights& w) {
#if defined(__AVX2__)
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  if constexpr (T == WeightType::q6_k) {
    const __m256i three = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 128 + 32 * h));
      const __m256i lows[4] = {_mm256_and_si256(ql0, low4), _mm256_and_si256(ql1, low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4)};
      for (int k = 0; k < 4; ++k) {
        const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), three);
        w.q[4 * h + k] = _mm256_sub_epi8(_mm256_or_si256(lows[k], _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
      }
    }
    // Values 32i .. 32i+15 take scale 2i, 32i+16 .. scale 2i+1 (the register's
    // halves): each int8 moved into the high byte of every int16 of its half,
    // then shifted down with its sign.
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y + 192)));
    for (int i = 0; i < 8; ++i) {
      const __m256i pick = _mm256_setr_m128i(_mm_set1_epi16(short((2 * i) << 8 | 0x80)),
                                             _mm_set1_epi16(short((2 * i + 1) << 8 | 0x80)));
      w.scale[i] = _mm256_srai_epi16(_mm256_shuffle_epi8(sc, pick), 8);
    }
    w.d = q8_scale(y + 208);
    w.dmin = 0.0f;
    return;
  } else {
    const bool five = T == WeightType::q5_k;
    const uint8_t* qs = y + (five ? 48 : 16);
    __m256i qh = five ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 16)) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      if constexpr (T == WeightType::q5_k) {
        const __m256i bit_lo = _mm256_set1_epi8(char(1 << (2 * c))), bit_hi = _mm256_set1_epi8(char(2 << (2 * c)));
        const __m256i sixteen = _mm256_set1_epi8(16);
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_lo), bit_lo), sixteen));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit_hi), bit_hi), sixteen));
      }
      w.q[2 * c] = lo;
      w.q[2 * c + 1] = hi;
    }
    (void)qh;
    // The 12 bytes as three words: scales 0-3 and mins 0-3 are their low 6
    // bits; 4-7 take 4 bits from the third word and 2 from the top of the first two.
    uint32_t u[3];
    std::memcpy(u, y + 4, 12);
    const uint32_t sc_lo = u[0] & 0x3f3f3f3fu, mn_lo = u[1] & 0x3f3f3f3fu;
    const uint32_t sc_hi = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const __m128i sc8 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, int(sc_hi), int(sc_lo)));  // 8 x int16
    const __m128i mn8 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, int(mn_hi), int(mn_lo)));
    // Each scale over a whole register: its int16 (bytes 2j, 2j+1) repeated.
    const __m256i sc16 = _mm256_broadcastsi128_si256(sc8);
    for (int j = 0; j < 8; ++j) w.scale[j] = _mm256_shuffle_epi8(sc16, _mm256_set1_epi16(short(0x0100 + 0x0202 * j)));
    w.mins = _mm256_set_m128i(_mm_unpackhi_epi16(mn8, mn8), _mm_unpacklo_epi16(mn8, mn8));
    w.d = q8_scale(y);
    w.dmin = q8_scale(y + 2);
  }
#else
  KQuantBlock b;
  unpack_superblock(T, y, b);
  std::memcpy(w.q, b.q, sizeof w.q);
  for (int i = 0; i < 16; ++i) w.scale[i] = b.scale[i];
  for (int j = 0; j < 8; ++j) w.mins[j] = b.min[j];
  w.d = b.d;
  w.dmin = b.dmin;
#endif
}

#if defined(__AVX2__)
// acc + the pairs of p16 times their scales (int16 products summed in pairs,
// exact): one vpdpwssd under AVX-512 VNNI.
inline __m256i k_scaled_add(__m256i acc, __m256i p16, __m256i scale) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p16, scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p16, scale));
#endif
}
#endif

// S1 and S2 of one superblock against one activation row's (exact).
#if defined(__AVX2__)
// S1 and S2 of one superblock as 8 int32 lanes each (their sums are S1, S2).
template <WeightType T>
inline void k_lanes(const KWeights& w, const int8_t* a, const int16_t* bsums, __m256i& s1, __m256i& s2) {
  __m256i acc = _mm256_setzero_si256();
  for (int i = 0; i < 8; ++i) {
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * i));
    __m256i p16;
    if constexpr (T == WeightType::q6_k)
      p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w.q[i], w.q[i]), _mm256_sign_epi8(qa, w.q[i]));
    else
      p16 = _mm256_maddubs_epi16(w.q[i], qa);
    acc = k_scaled_add(acc, p16, w.scale[i]);
  }
  s1 = acc;
  s2 = T == WeightType::q6_k ? _mm256_setzero_si256()
                             : _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), w.mins);
}
#endif

template <WeightType T>
inline void k_sums(const KWeights& w, const int8_t* a, const int16_t* bsums, int32_t& s1, int32_t& s2) {
#if defined(__AVX2__)
  __m256i acc = _mm256_setzero_si256();
  for (int i = 0; i < 8; ++i) {
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * i));
    __m256i p16;
    if constexpr (T == WeightType::q6_k)  // |q| (as unsigned) times a with q's sign: at most 2 * 32 * 127 a pair
      p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w.q[i], w.q[i]), _mm256_sign_epi8(qa, w.q[i]));
    else  // q in [0, 31]: at most 2 * 31 * 127 a pair
      p16 = _mm256_maddubs_epi16(w.q[i], qa);
    acc = k_scaled_add(acc, p16, w.scale[i]);
  }
  const __m256i m32 = T == WeightType::q6_k
                          ? _mm256_setzero_si256()
                          : _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsums)), w.mins);
  // Lanes of both, summed pairwise: s1 in the low result, s2 in the high.
  __m256i h = _mm256_hadd_epi32(acc, m32);  // [a01 a23 m01 m23 | a45 a67 m45 m67]
  h = _mm256_hadd_epi32(h, h);              // [a0-3 m0-3 a0-3 m0-3 | a4-7 m4-7 ...]
  const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  s1 = _mm_cvtsi128_si32(t);
  s2 = _mm_extract_epi32(t, 1);
#else
  int32_t sum1 = 0, sum2 = 0;
  for (int e = 0; e < kQK; ++e)
    sum1 += (T == WeightType::q6_k ? w.scale[e / 16] : w.scale[e / 32]) * int32_t(w.q[e]) * int32_t(a[e]);
  if constexpr (T != WeightType::q6_k)
    for (int g = 0; g < 16; ++g) sum2 += int32_t(bsums[g]) * w.mins[g / 2];
  s1 = sum1;
  s2 = sum2;
#endif
}

#if defined(__AVX2__)
// Eight columns of one row (a decode step): each superblock's eight S1 and
// eight S2 at once, then each lane's two fmas of the rule, as the single
// output's path computes them.
template <WeightType T>
inline void k_row8(const float* d, const int8_t* qa, const int16_t* bsums, const uint8_t* w, float* c, int n,
                   int blocks, size_t row_size, int r, int col) {
  __m256 acc = _mm256_setzero_ps();
  KWeights kw;
  const PrefetchShares ahead(w + size_t(col + 16) * row_size, 8 * row_size, blocks);
  for (int i = 0; i < blocks; ++i) {
    __m256i s1[8], s2[8];
    alignas(32) float dw[8], dmin[8];
    const size_t at = size_t(r) * blocks + i;
    ahead.fetch(i);
    for (int ci = 0; ci < 8; ++ci) {
      k_unpack<T>(w + size_t(col + ci) * row_size + size_t(i) * block_bytes(T), kw);
      k_lanes<T>(kw, qa + at * kQK, bsums + at * 16, s1[ci], s2[ci]);
      dw[ci] = kw.d;
      dmin[ci] = kw.dmin;
    }
    const __m256 da = _mm256_set1_ps(d[at]);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_hsum8(s1)), _mm256_mul_ps(_mm256_load_ps(dw), da), acc);
    if constexpr (T != WeightType::q6_k) {
      const __m256 neg = _mm256_xor_ps(_mm256_mul_ps(_mm256_load_ps(dmin), da), _mm256_set1_ps(-0.0f));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_hsum8(s2)), neg, acc);
    }
  }
  _mm256_storeu_ps(c + size_t(r) * n + col, acc);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// A prefill (or a batch) under AVX-512 VNNI, as q8_kernels.inl's: a tile of
// 16 columns, one per lane. Each column's superblocks are unpacked
// (k_unpack) and re-laid once per call into a panel; a row's S1 comes from
// vpdpbusd over each scale's values (the quants as the unsigned operand:
// Q4_K, Q5_K as they are, Q6_K as q + 32) times the scale, and S2 (Q4_K,
// Q5_K: the mins against the block sums; Q6_K: the 32 x sum of scale x
// block sum that q + 32 added) from vpdpwssd over pairs of block sums:
// exact integers, then the rule's fmas.
// One superblock of a panel: [64 groups][16 columns][4 quants] uint8, the
// scales [16 (Q6_K) or 8][16 columns] int32, the pairs [8][16 columns][2]
// int16 (Q4_K, Q5_K: (mn_t, mn_t); Q6_K: (sc_2t, sc_2t+1)) met by block
// sums 2t, 2t + 1, then d and dmin [16] float.
constexpr size_t kVnniKQuants = 64 * 64, kVnniKScales = kVnniKQuants, kVnniKPairs = kVnniKScales + 16 * 64,
                 kVnniKD = kVnniKPairs + 8 * 64, kVnniKDmin = kVnniKD + 64, kVnniKBlock = kVnniKDmin + 64;

// The pack of a tile reads its 16 rows superblock by superblock: 16 streams
// the hardware prefetchers fed too late (the pack stalled on each
// superblock's first load). So each row's superblock `ahead` on is fetched
// (past the row's end: the next tile's rows from their start). Intel Xeon,
// 1B-shaped Q4_K_M, batch of 16, 1 thread: 47-48 -> 53-57 tok/s with 2 ahead
// (4: 52). (The Q8_0 / Q4_0 pack gained nothing from the same.)
inline void prefetch_tile_ahead(const uint8_t* w, size_t row_size, int blocks, size_t bytes, int col, int b,
                                int ahead) {
  int at_block = b + ahead, at_col = col;
  if (at_block >= blocks) at_block -= blocks, at_col += kVnniCols;
  if (at_block >= blocks) return;
  const uint8_t* first = w + size_t(at_col) * row_size + size_t(at_block) * bytes;
  for (int c = 0; c < kVnniCols; ++c)
    for (size_t at = 0; at < bytes; at += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first + size_t(c) * row_size + at), _MM_HINT_T0);
}

template <WeightType T>
inline void vnni_pack_k(const uint8_t* w, size_t row_size, int blocks, int col, int cols, uint8_t* panel) {
  constexpr bool six = T == WeightType::q6_k;
  KWeights kws[kVnniCols];
  for (int i = 0; i < blocks; ++i) {
    uint8_t* out = panel + size_t(i) * kVnniKBlock;
    auto* scales = reinterpret_cast<int32_t*>(out + kVnniKScales);
    auto* pairs = reinterpret_cast<int16_t*>(out + kVnniKPairs);
    auto* dw = reinterpret_cast<float*>(out + kVnniKD);
    auto* dmin = reinterpret_cast<float*>(out + kVnniKDmin);
    prefetch_tile_ahead(w, row_size, blocks, block_bytes(T), col, i, 2);
    for (int c = 0; c < kVnniCols; ++c) {
      KWeights& kw = kws[c];
      if (c >= cols) {
        for (int g = 0; g < 8; ++g) kw.q[g] = _mm256_set1_epi8(six ? -32 : 0);
        for (int j = 0; j < 16; ++j) scales[16 * j + c] = 0;
        for (int t = 0; t < 8; ++t) pairs[32 * t + 2 * c] = pairs[32 * t + 2 * c + 1] = 0;
        dw[c] = dmin[c] = 0.0f;
        continue;
      }
      k_unpack<T>(w + size_t(col + c) * row_size + size_t(i) * block_bytes(T), kw);
      alignas(32) int16_t lanes[16];
      for (int g = 0; g < 8; ++g) {  // k_unpack's int16 lanes: one scale a register (Q6_K: one a half)
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), kw.scale[g]);
        if constexpr (six) {
          scales[16 * (2 * g) + c] = lanes[0];
          scales[16 * (2 * g + 1) + c] = lanes[8];
        } else {
          scales[16 * g + c] = lanes[0];
        }
      }
      if constexpr (six) {
        for (int t = 0; t < 8; ++t) {
          pairs[32 * t + 2 * c] = int16_t(scales[16 * (2 * t) + c]);
          pairs[32 * t + 2 * c + 1] = int16_t(scales[16 * (2 * t + 1) + c]);
        }
      } else {
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), kw.mins);  // lane g: mn(g / 2)
        for (int t = 0; t < 8; ++t) pairs[32 * t + 2 * c] = pairs[32 * t + 2 * c + 1] = lanes[2 * t];
      }
      dw[c] = kw.d;
      dmin[c] = kw.dmin;
    }
    for (int g = 0; g < 8; ++g) {  // values 32g .. 32g + 31 of the 16 columns: words 8g .. 8g + 7
      __m256i values[kVnniCols];
      for (int c = 0; c < kVnniCols; ++c) values[c] = six ? _mm256_add_epi8(kws[c].q[g], _mm256_set1_epi8(32)) : kws[c].q[g];
      __m512i words[8];
      vnni_transpose(values, words);
      for (int j = 0; j < 8; ++j) _mm512_store_si512(reinterpret_cast<__m512i*>(out + 64 * (8 * g + j)), words[j]);
    }
  }
}

// Rows [r, r + R) of the tile (d: row stride `blocks`, qa: k, bsums: k / 16).
template <WeightType T, int R>
inline void vnni_k_rows(const uint8_t* panel, int blocks, const float* d, const int8_t* qa, const int16_t* bsums,
                        int k, float* c, int n, int r, int col, int cols) {
  constexpr bool six = T == WeightType::q6_k;
  constexpr int kScales = six ? 16 : 8, kGroups = 64 / kScales;  // groups of 4 values per scale
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* pb = panel + size_t(b) * kVnniKBlock;
    __m512i s1[R], t[R];
    for (int i = 0; i < R; ++i) s1[i] = _mm512_setzero_si512();
    for (int j = 0; j < kScales; ++j) {
      for (int i = 0; i < R; ++i) t[i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int g = 0; g < kGroups; ++g) {
        const int group = j * kGroups + g;
        const __m512i wv = _mm512_load_si512(reinterpret_cast<const __m512i*>(pb + 64 * group));
        for (int i = 0; i < R; ++i) {
          int32_t four;
          std::memcpy(&four, qa + size_t(r + i) * k + size_t(b) * kQK + 4 * group, 4);
          t[i] = _mm512_dpbusd_epi32(t[i], wv, _mm512_set1_epi32(four));
        }
      }
      const __m512i sc = _mm512_load_si512(reinterpret_cast<const __m512i*>(pb + kVnniKScales + 64 * j));
      for (int i = 0; i < R; ++i) s1[i] = _mm512_add_epi32(s1[i], _mm512_mullo_epi32(t[i], sc));
    }
    for (int i = 0; i < R; ++i) t[i] = _mm512_setzero_si512();  // now S2 (Q6_K: the q + 32 correction)
    for (int p = 0; p < 8; ++p) {
      const __m512i pv = _mm512_load_si512(reinterpret_cast<const __m512i*>(pb + kVnniKPairs + 64 * p));
      for (int i = 0; i < R; ++i) {
        int32_t two;
        std::memcpy(&two, bsums + (size_t(r + i) * blocks + b) * 16 + 2 * p, 4);
        t[i] = _mm512_dpwssd_epi32(t[i], pv, _mm512_set1_epi32(two));
      }
    }
    const __m512 dw = _mm512_load_ps(reinterpret_cast<const float*>(pb + kVnniKD));
    const __m512 dmin = _mm512_load_ps(reinterpret_cast<const float*>(pb + kVnniKDmin));
    for (int i = 0; i < R; ++i) {
      const __m512 da = _mm512_set1_ps(d[size_t(r + i) * blocks + b]);
      if constexpr (six) {
        s1[i] = _mm512_sub_epi32(s1[i], _mm512_slli_epi32(t[i], 5));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[i]), _mm512_mul_ps(dw, da), acc[i]);
      } else {
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[i]), _mm512_mul_ps(dw, da), acc[i]);
        const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(dmin, da)),
                                                                _mm512_set1_epi32(int(0x80000000u))));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[i]), neg, acc[i]);
      }
    }
  }
  const __mmask16 live = __mmask16((1u << cols) - 1u);
  for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(c + size_t(r + i) * n + col, live, acc[i]);
}

template <WeightType T, int R>
void vnni_k_rows_upto(int rows, const uint8_t* panel, int blocks, const float* d, const int8_t* qa,
                      const int16_t* bsums, int k, float* c, int n, int r, int col, int cols) {
  if constexpr (R > 0) {
    if (rows == R) return vnni_k_rows<T, R>(panel, blocks, d, qa, bsums, k, c, n, r, col, cols);
    vnni_k_rows_upto<T, R - 1>(rows, panel, blocks, d, qa, bsums, k, c, n, r, col, cols);
  }
}

template <WeightType T>
void matmul_k_vnni_columns(const float* d, const int8_t* qa, const int16_t* bsums, const uint8_t* w, float* c, int m,
                           int n, int k, int col_begin, int col_end) {
  const int blocks = k / kQK;
  const size_t row_size = size_t(blocks) * block_bytes(T);
  struct alignas(64) Line { uint8_t bytes[64]; };
  thread_local std::vector<Line> panel;  // one tile's panel
  panel.resize(size_t(blocks) * kVnniKBlock / 64);
  auto* pb = reinterpret_cast<uint8_t*>(panel.data());
  for (int col = col_begin; col < col_end; col += kVnniCols) {
    const int cols = std::min(kVnniCols, col_end - col);
    vnni_pack_k<T>(w, row_size, blocks, col, cols, pb);
    int r = 0;
    for (; r + kVnniRows <= m; r += kVnniRows)
      vnni_k_rows<T, kVnniRows>(pb, blocks, d, qa, bsums, k, c, n, r, col, cols);
    vnni_k_rows_upto<T, kVnniRows - 1>(m - r, pb, blocks, d, qa, bsums, k, c, n, r, col, cols);
  }
}
#endif

// C[m][n] for the columns [col_begin, col_end): activations quantized per
// superblock (d: m x k/256, qa: m x k, bsums: m x k/16). For each row block,
// column and superblock, the weights are unpacked once and every row of the
// block takes its two fmas.
// Rows below which a column's superblock is unpacked per row (k_row8) rather
// than once for all the rows.
constexpr int kKRowsPerUnpack = 4;

template <WeightType T>
void matmul_k_columns(const float* d, const int8_t* qa, const int16_t* bsums, const uint8_t* w, float* c, int m,
                      int n, int k, int col_begin, int col_end) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (m >= kQ8TileRows) return matmul_k_vnni_columns<T>(d, qa, bsums, w, c, m, n, k, col_begin, col_end);
#endif
  const int blocks = k / kQK;
  const size_t row_size = size_t(blocks) * block_bytes(T);
  float acc[kQ8RowBlock];
  KWeights kw;
  for (int r0 = 0; r0 < m; r0 += kQ8RowBlock) {
    const int r1 = std::min(m, r0 + kQ8RowBlock);
    int col = col_begin;
#if defined(__AVX2__)
    if (r1 - r0 < kKRowsPerUnpack)  // few rows: eight columns at a time
      for (; col + 8 <= col_end; col += 8)
        for (int r = r0; r < r1; ++r) k_row8<T>(d, qa, bsums, w, c, n, blocks, row_size, r, col);
#endif
    for (; col < col_end; ++col) {
      for (int r = r0; r < r1; ++r) acc[r - r0] = 0.0f;
      const uint8_t* wrow = w + size_t(col) * row_size;
      for (int i = 0; i < blocks; ++i) {
        k_unpack<T>(wrow + size_t(i) * block_bytes(T), kw);
        for (int r = r0; r < r1; ++r) {
          int32_t s1, s2;
          const size_t at = size_t(r) * blocks + i;
          k_sums<T>(kw, qa + at * kQK, bsums + at * 16, s1, s2);
          float a = std::fma(float(s1), kw.d * d[at], acc[r - r0]);
          if constexpr (T != WeightType::q6_k) a = std::fma(float(s2), -(kw.dmin * d[at]), a);
          acc[r - r0] = a;
        }
      }
      for (int r = r0; r < r1; ++r) c[size_t(r) * n + col] = acc[r - r0];
    }
  }
}

void matmul_kquant(WeightType type, const float* d, const int8_t* qa, const int16_t* bsums, const uint8_t* w, float* c,
                   int m, int n, int k, int col_begin, int col_end) {
  if (type == WeightType::q4_k) matmul_k_columns<WeightType::q4_k>(d, qa, bsums, w, c, m, n, k, col_begin, col_end);
  else if (type == WeightType::q5_k) matmul_k_columns<WeightType::q5_k>(d, qa, bsums, w, c, m, n, k, col_begin, col_end);
  else matmul_k_columns<WeightType::q6_k>(d, qa, bsums, w, c, m, n, k, col_begin, col_end);
}
