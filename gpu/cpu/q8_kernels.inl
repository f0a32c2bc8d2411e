// The quantized matrix products (Q8_0, Q4_0) of one instruction set (the
// rule: gpu/fixed_math.h, "quantized matrix product"; the reference:
// gpu/quant.cpp matmul_quantized_reference). Included by each
// gpu/cpu/isa_*.cpp inside its namespace: with AVX2 (the avx2 and avx512
// compilations) a block's 32 products are summed by vpmaddubsw / vpmaddwd,
// otherwise by a scalar loop; the sums are exact integers either way, so
// every compilation returns the same bits. T is the weights' type.

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
  const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
  const __m256i p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(p32), _mm256_extracti128_si256(p32, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
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

// R rows x C columns (R * C = 8 outputs, one a lane) from (r0, c0): each
// block's 8 exact sums at once, then each lane's fma of the rule, in block
// order, as q8_one computes it.
template <WeightType T, int R, int C>
inline void q8_tile(const float* scales, const int8_t* qa, const uint8_t* w, float* c, int n, int k, int blocks,
                    size_t row_size, int r0, int c0) {
  static_assert(R * C == 8, "one output a lane");
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
    __m256i sums[8];
    alignas(32) float scale[8];
    for (int ci = 0; ci < C; ++ci) {
      const uint8_t* block = w + size_t(c0 + ci) * row_size + size_t(b) * block_bytes(T);
      const float dw = q8_scale(block);
      const __m256i qw = q8_weights<T>(block);
      const __m256i wabs = _mm256_sign_epi8(qw, qw);
      for (int ri = 0; ri < R; ++ri) {
        const __m256i qv = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(qa + size_t(r0 + ri) * k + size_t(b) * kQ8Block));
        sums[ri * C + ci] = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(qv, qw)), ones);
        scale[ri * C + ci] = dw * scales[size_t(r0 + ri) * blocks + b];
      }
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_hsum8(sums)), _mm256_load_ps(scale), acc);
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, acc);
  for (int ri = 0; ri < R; ++ri)
    for (int ci = 0; ci < C; ++ci) c[size_t(r0 + ri) * n + c0 + ci] = out[ri * C + ci];
}
#endif

// Rows per pass over a range of columns: their quantized activations stay
// in L2 while every column's weights stream by once.
constexpr int kQ8RowBlock = 64;
// Outputs a tile computes (AVX2): 8 rows of one column, so each weight block
// is loaded once for 8 rows (measured on the 50M model, 1,000-token prefill,
// 1 thread, Zen 3: 8 x 1 3.13 s, 4 x 2 3.84 s, 2 x 4 3.86 s, single outputs 5.2 s).
constexpr int kQ8TileRows = 8;
constexpr int kQ8TileCols = 1;

// C[m][n] for the columns [col_begin, col_end) (activations quantized:
// `scales` m x k/32, `qa` m x k): tiles of 8 rows x 1 column under AVX2 (a
// prefill, a batch of 8 or more); single outputs at the edges, for fewer
// rows (a decode step: one weight row streamed at a time) and otherwise.
template <WeightType T>
void matmul_quantized_columns(const float* scales, const int8_t* qa, const uint8_t* w, float* c, int m, int n, int k,
                              int col_begin, int col_end) {
  const int blocks = k / kQ8Block;
  const size_t row_size = size_t(blocks) * block_bytes(T);
  for (int r0 = 0; r0 < m; r0 += kQ8RowBlock) {
    const int r1 = std::min(m, r0 + kQ8RowBlock);
    int col = col_begin;
#if defined(__AVX2__)
    if (r1 - r0 >= kQ8TileRows) {
      for (; col + kQ8TileCols <= col_end; col += kQ8TileCols) {
        int r = r0;
        for (; r + kQ8TileRows <= r1; r += kQ8TileRows) q8_tile<T, kQ8TileRows, kQ8TileCols>(scales, qa, w, c, n, k, blocks, row_size, r, col);
        for (; r < r1; ++r)
          for (int ci = 0; ci < kQ8TileCols; ++ci) c[size_t(r) * n + col + ci] = q8_one<T>(scales, qa, w, k, blocks, row_size, r, col + ci);
      }
    }
#endif
    // Q4_0: four columns at once (m50 decode, 1 thread, Zen 3: 2.85-3.0 s
    // against 3.6 s for 333 tokens); Q8_0 ran slower so (4.7-5.9 s against 3.7-3.9 s for 400).
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
