// The activation quantizers of the quantized matrix products, one
// instruction set's (the rule: gpu/fixed_math.h, "quantized matrix
// product"), and their helpers. Included by each gpu/cpu/isa_*.cpp inside its
// namespace, before q8_tiles.inl (Q8_0, Q4_0) and kq_tiles.inl (K-quants).

#if defined(__AVX2__)
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
