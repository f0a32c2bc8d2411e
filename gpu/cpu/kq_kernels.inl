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
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p16, w.scale[i]));
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
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p16, w.scale[i]));
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
  for (int i = 0; i < blocks; ++i) {
    __m256i s1[8], s2[8];
    alignas(32) float dw[8], dmin[8];
    const size_t at = size_t(r) * blocks + i;
    prefetch_share(w + size_t(col + 16) * row_size, 8 * row_size, i, blocks);
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
