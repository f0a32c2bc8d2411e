// The Q8_0 matrix product of one instruction set (the rule: gpu/fixed_math.h,
// "quantized matrix product"; the reference: gpu/quant.cpp
// matmul_q8_0_reference). Included by each gpu/cpu/isa_*.cpp inside its
// namespace: with AVX2 (the avx2 and avx512 compilations) a block's 32
// products are summed by vpmaddubsw / vpmaddwd, otherwise by a scalar loop;
// the sums are exact integers either way, so every compilation returns the
// same bits.

// A Q8_0 block's half-precision scale as a float (exact).
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

// sum_j w[j] * a[j] over one block of 32, exactly.
inline int32_t q8_dot32(const int8_t* w, const int8_t* a) {
#if defined(__AVX2__)
  const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  // |w| (as unsigned) times a with w's sign: pairs of products in int16
  // (at most 2 * 128 * 127: no saturation, as |a| <= 127), then in int32.
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
  const __m256i p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p32), _mm256_extracti128_si256(p32, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
#else
  int32_t sum = 0;
  for (int j = 0; j < kQ8Block; ++j) sum += int32_t(w[j]) * int32_t(a[j]);
  return sum;
#endif
}

// C[m][n] for the columns [col_begin, col_end): per column, its weight row
// against every activation row (quantized: `scales` m x k/32, `qa` m x k).
void matmul_q8_0_columns(const float* scales, const int8_t* qa, const uint8_t* w, float* c, int m, int n, int k,
                         int col_begin, int col_end) {
  const int blocks = k / kQ8Block;
  const size_t row_size = size_t(blocks) * kQ8BlockBytes;
  for (int col = col_begin; col < col_end; ++col) {
    const uint8_t* wrow = w + size_t(col) * row_size;
    for (int r = 0; r < m; ++r) {
      const float* s = scales + size_t(r) * blocks;
      const int8_t* q = qa + size_t(r) * k;
      float acc = 0.0f;
      for (int b = 0; b < blocks; ++b) {
        const uint8_t* block = wrow + size_t(b) * kQ8BlockBytes;
        const int32_t isum = q8_dot32(reinterpret_cast<const int8_t*>(block + 2), q + size_t(b) * kQ8Block);
        acc = std::fma(float(isum), q8_scale(block) * s[b], acc);
      }
      c[size_t(r) * n + col] = acc;
    }
  }
}
