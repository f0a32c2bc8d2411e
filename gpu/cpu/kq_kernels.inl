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

// Sub-block j's 6-bit scale and min from a Q4_K / Q5_K superblock's 12 bytes.
inline void scale_min_k(int j, const uint8_t* s, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

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
    const auto* sc = reinterpret_cast<const int8_t*>(y + 192);
    for (int i = 0; i < 8; ++i)  // values 32i .. 32i+15: scale 2i; 32i+16 ..: 2i+1 (the register's halves)
      w.scale[i] = _mm256_setr_m128i(_mm_set1_epi16(sc[2 * i]), _mm_set1_epi16(sc[2 * i + 1]));
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
    alignas(32) int16_t mins[16];
    for (int j = 0; j < 8; ++j) {
      int sc, mn;
      scale_min_k(j, y + 4, sc, mn);
      w.scale[j] = _mm256_set1_epi16(int16_t(sc));
      mins[2 * j] = mins[2 * j + 1] = int16_t(mn);
    }
    w.mins = _mm256_load_si256(reinterpret_cast<const __m256i*>(mins));
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

// C[m][n] for the columns [col_begin, col_end): activations quantized per
// superblock (d: m x k/256, qa: m x k, bsums: m x k/16). For each row block,
// column and superblock, the weights are unpacked once and every row of the
// block takes its two fmas.
template <WeightType T>
void matmul_k_columns(const float* d, const int8_t* qa, const int16_t* bsums, const uint8_t* w, float* c, int m,
                      int n, int k, int col_begin, int col_end) {
  const int blocks = k / kQK;
  const size_t row_size = size_t(blocks) * block_bytes(T);
  float acc[kQ8RowBlock];
  KWeights kw;
  for (int r0 = 0; r0 < m; r0 += kQ8RowBlock) {
    const int r1 = std::min(m, r0 + kQ8RowBlock);
    for (int col = col_begin; col < col_end; ++col) {
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
