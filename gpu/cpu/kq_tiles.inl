// The K-quant matrix products (Q4_K, Q5_K, Q6_K against Q8_K activations)
// of one instruction set, on weights in tiles of 16 columns (gpu/cpu/
// cpu_kernels.h tile_quantized; the rule: gpu/fixed_math.h, "K-quant matrix
// product"; the reference: gpu/kquant.cpp matmul_k_reference). Included by
// each gpu/cpu/isa_*.cpp inside its namespace after q8_tiles.inl.
//
// Per output and superblock the rule wants two exact integers, S1 (each
// scale times its values' products) and S2 (the mins against the block sums
// of the activations), then two fmas. A tile's superblock holds its 16
// columns' quants as 4-byte words, column c in word c of each 64 bytes, so
// the vector code below (one 16-lane register under AVX-512 VNNI, two halves
// of 8 under AVX2) sums each column in its own lane:
// - the quants are rebuilt from their bit planes as unsigned bytes (Q4_K
//   0..15, Q5_K 0..31, Q6_K q + 32 in 0..63) and summed against four
//   activations broadcast to every lane (vpdpbusd, or vpmaddubsw + vpmaddwd:
//   no pair passes int16 at these ranges);
// - each scale (and min) is taken out of the columns' packed bytes by one
//   byte shuffle, so S1 += t * scale by vpmulld, and S2 by vpdpwssd over the
//   mins paired against pairs of the activations' sums of 32; Q6_K's + 32
//   comes off as 32 x the sum of 16 activations before its scale.
// Every way the integers are exact, and the fmas run in superblock order as
// the reference's: the same bits on every kernel set, whatever the batch.

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// Integer and float lanes of one tile: 16 columns.
struct KLanes {
  using I = __m512i;
  using F = __m512;
  static constexpr int kHalves = 1;  // one register covers the tile
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I zero() { return _mm512_setzero_si512(); }
  static I band(I a, I b) { return _mm512_and_si512(a, b); }
  static I bor(I a, I b) { return _mm512_or_si512(a, b); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I shl16(I a, int n) { return _mm512_sll_epi16(a, _mm_cvtsi32_si128(n)); }
  static I shr16(I a, int n) { return _mm512_srl_epi16(a, _mm_cvtsi32_si128(n)); }
  static I sar32(I a, int n) { return _mm512_sra_epi32(a, _mm_cvtsi32_si128(n)); }
  static I shuffle(I a, I idx) { return _mm512_shuffle_epi8(a, idx); }
  // A pattern for shuffle: the dword `pattern` in every lane plus the lane's
  // offset within its 128 bits (0, 4, 8, 12) times `times` (its index bytes).
  static I lanes_pattern(uint32_t pattern, uint32_t times) {
    return _mm512_add_epi32(_mm512_set1_epi32(int(pattern)),
                            _mm512_mullo_epi32(_mm512_set4_epi32(12, 8, 4, 0), _mm512_set1_epi32(int(times))));
  }
  static I dot4(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static I dot2(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset1(float v) { return _mm512_set1_ps(v); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fneg(F a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(int(0x80000000u)))); }
  static F fma(I i, F b, F acc) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), b, acc); }
  static void store(float* c, F v, int live) { _mm512_mask_storeu_ps(c, __mmask16((1u << live) - 1u), v); }
};
constexpr int kKTileRows = 8;  // per row: a sum, S1 and the output: 3 x 8 of 32 zmm, the rest for the weights
#else
// Integer and float lanes of half a tile: 8 columns.
struct KLanes {
  using I = __m256i;
  using F = __m256;
  static constexpr int kHalves = 2;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I zero() { return _mm256_setzero_si256(); }
  static I band(I a, I b) { return _mm256_and_si256(a, b); }
  static I bor(I a, I b) { return _mm256_or_si256(a, b); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I shl16(I a, int n) { return _mm256_sll_epi16(a, _mm_cvtsi32_si128(n)); }
  static I shr16(I a, int n) { return _mm256_srl_epi16(a, _mm_cvtsi32_si128(n)); }
  static I sar32(I a, int n) { return _mm256_sra_epi32(a, _mm_cvtsi32_si128(n)); }
  static I shuffle(I a, I idx) { return _mm256_shuffle_epi8(a, idx); }
  static I lanes_pattern(uint32_t pattern, uint32_t times) {
    return _mm256_add_epi32(_mm256_set1_epi32(int(pattern)), _mm256_mullo_epi32(_mm256_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12),
                                                                                _mm256_set1_epi32(int(times))));
  }
  static I dot4(I acc, I u, I s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static I dot2(I acc, I a, I b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  // The int16 steps of dot4, for sums kept in int16 (kdecode_rows).
  static I maddubs(I u, I s) { return _mm256_maddubs_epi16(u, s); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I sar16(I a, int n) { return _mm256_sra_epi16(a, _mm_cvtsi32_si128(n)); }
  static I shl32(I a, int n) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset1(float v) { return _mm256_set1_ps(v); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fneg(F a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static F fma(I i, F b, F acc) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), b, acc); }
  static void store(float* c, F v, int live) {
    if (live == 8) return _mm256_storeu_ps(c, v);
    alignas(32) float out[8];
    _mm256_store_ps(out, v);
    std::memcpy(c, out, sizeof(float) * size_t(live));
  }
};
constexpr int kKTileRows = 4;  // 16 ymm: 3 x 4 for the rows, the rest for the weights
#endif

constexpr uint32_t kZ = 0x80u;  // a shuffle index that writes zero
// Shuffle patterns over each column's 4 packed bytes: byte j alone as an
// int32; byte j in the top byte (then >> 24, signed); bytes x and y as two
// int16 (a pair for dot2).
inline KLanes::I byte_lane(uint32_t j) { return KLanes::lanes_pattern(kZ << 24 | kZ << 16 | kZ << 8 | j, 1); }
inline KLanes::I top_byte_lane(uint32_t j) { return KLanes::lanes_pattern(j << 24 | kZ << 16 | kZ << 8 | kZ, 1u << 24); }
inline KLanes::I pair_lane(uint32_t x, uint32_t y) {
  return KLanes::lanes_pattern(kZ << 24 | y << 16 | kZ << 8 | x, 1u | 1u << 16);
}
// Bytes x and y in the high bytes of two int16 (then >> 8, signed: a pair
// of int8 widened).
inline KLanes::I high_pair_lane(uint32_t x, uint32_t y) {
  return KLanes::lanes_pattern(y << 24 | kZ << 16 | x << 8 | kZ, 1u << 8 | 1u << 24);
}
#endif

// Rows a call of ktile_rows computes.
#if defined(__AVX2__)
constexpr int kKRows = kKTileRows;
#else
constexpr int kKRows = 1;
#endif

template <WeightType T>
constexpr size_t ktile_body_bytes() { return T == WeightType::q4_k ? 35 * 64 : T == WeightType::q5_k ? 43 * 64 : 52 * 64; }
template <WeightType T>
constexpr size_t ktile_tail_bytes() { return T == WeightType::q6_k ? 32 : 64; }
// Scales a superblock has (one per 32 values; Q6_K: per 16).
template <WeightType T>
constexpr int kscales() { return T == WeightType::q6_k ? 16 : 8; }

#if defined(__AVX2__)
// A tile's superblocks read where they lie: each group of 4 values rebuilt
// from its bit planes when asked for (a decode step: every weight is used once).
template <WeightType T>
struct KTileSource {
  using L = KLanes;
  using I = L::I;
  const uint8_t* tile;
  int blocks;
  size_t half;  // bytes into each 64 (AVX2: the second 8 columns)
  // Whether the caller fetches the lines ahead itself, a line or two a step
  // (fetch_ahead: AVX2's decode), rather than begin() all of a superblock's
  // at once. (A burst of 36-53 prefetches fills the core's miss buffers and
  // stalls it: AMD Zen 3, one 65536 x 2048 matrix from memory, 1 thread,
  // Q4_K 11.2-12.1 -> 12.9-14.2 GB/s, Q6_K 9.0-9.7 -> 10.6-12.1; the
  // 1B-shaped Q4_K_M decode 11.8-12.8 -> 12.9-13.9 tok/s. 2 or 4
  // superblocks ahead, non-temporal or into L2: no better.)
  bool fetch_spread = false;
  I low4 = L::set1(0x0f0f0f0f), bytes[4] = {byte_lane(0), byte_lane(1), byte_lane(2), byte_lane(3)},
    top[4] = {top_byte_lane(0), top_byte_lane(1), top_byte_lane(2), top_byte_lane(3)},
    pairs[2] = {pair_lane(0, 1), pair_lane(2, 3)};
  // Per superblock: its scales (and mins), unpacked by begin().
  I sc_lo, sc_hi, mn_lo, mn_hi, sc6[4];
  const uint8_t* body;
  const uint8_t* tail;

  I word(int w) const { return L::load(body + 64 * size_t(w)); }
  // Line `line` of the next superblock's body (kBodyLines: its tail's line).
  static constexpr int kBodyLines = int(ktile_body_bytes<T>() / 64);
  void fetch_ahead(int line) const {
    const uint8_t* at = line < kBodyLines ? body - half + ktile_body_bytes<T>() + 64 * size_t(line)
                                          : tail - half / 2 + ktile_tail_bytes<T>();
    _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T0);
  }
  void begin(int b) {
    body = tile + size_t(b) * ktile_body_bytes<T>() + half;
    tail = tile + size_t(blocks) * ktile_body_bytes<T>() + size_t(b) * ktile_tail_bytes<T>() + half / 2;
    if (half == 0 && !fetch_spread)  // (AVX2's second half reads the lines the first one fetched)
      for (size_t at = 0; at < ktile_body_bytes<T>() + 64; at += 64)  // 4 superblocks ahead
        _mm_prefetch(reinterpret_cast<const char*>(body + 4 * ktile_body_bytes<T>() + at), _MM_HINT_T0);
    if constexpr (T == WeightType::q6_k) {
      for (int j = 0; j < 4; ++j) sc6[j] = word(48 + j);
    } else {
      constexpr int kScaleWord = T == WeightType::q5_k ? 40 : 32;
      const I u0 = word(kScaleWord), u1 = word(kScaleWord + 1), u2 = word(kScaleWord + 2);
      const I m6 = L::set1(0x3f3f3f3f), m2 = L::set1(0x03030303);
      // Scales 0-3 and mins 0-3 are the low 6 bits of the first two words;
      // 4-7 take 4 bits from the third word and 2 from the top of the first two.
      sc_lo = L::band(u0, m6);
      mn_lo = L::band(u1, m6);
      sc_hi = L::bor(L::band(u2, low4), L::shl16(L::band(L::shr16(u0, 6), m2), 4));
      mn_hi = L::bor(L::band(L::shr16(u2, 4), low4), L::shl16(L::band(L::shr16(u1, 6), m2), 4));
    }
  }
  // Values 4g .. 4g + 3 of each column, unsigned (Q4_K q, Q5_K q, Q6_K q + 32).
  I values(int g) const {
    if constexpr (T == WeightType::q6_k) {
      const int hh = g / 32, qq = (g % 32) / 8, l = g % 8;  // value 128 hh + 32 qq + 4 l
      const I x = word(16 * hh + 8 * (qq % 2) + l), c = word(32 + 8 * hh + l);
      const I nibble = qq < 2 ? L::band(x, low4) : L::band(L::shr16(x, 4), low4);
      const I high = qq == 0 ? L::shl16(c, 4) : qq == 1 ? L::shl16(c, 2) : qq == 2 ? c : L::shr16(c, 2);
      return L::bor(nibble, L::band(high, L::set1(0x30303030)));
    } else {
      const int c4 = g / 16, up = (g % 16) / 8, l = g % 8;  // value 64 c4 + 32 up + 4 l
      const I x = word(8 * c4 + l);
      I q = up ? L::band(L::shr16(x, 4), low4) : L::band(x, low4);
      if constexpr (T == WeightType::q5_k) {  // the fifth bit: bit 2 c4 + up of each qh byte, to bit 4
        const I qh = word(32 + l);
        const int bit = 2 * c4 + up;
        q = L::bor(q, L::band(bit <= 4 ? L::shl16(qh, 4 - bit) : L::shr16(qh, bit - 4), L::set1(0x10101010)));
      }
      return q;
    }
  }
  // Scale j as int32 lanes (Q6_K signed).
  I scale(int j) const {
    if constexpr (T == WeightType::q6_k) return L::sar32(L::shuffle(sc6[j / 4], top[j % 4]), 24);
    else return L::shuffle(j < 4 ? sc_lo : sc_hi, bytes[j % 4]);
  }
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
  // Patterns for scale_pair: (j, j) for j % 4, and (0, 1), (2, 3).
  static I pair16(uint32_t x, uint32_t y) { return T == WeightType::q6_k ? high_pair_lane(x, y) : pair_lane(x, y); }
  I same16[4] = {pair16(0, 0), pair16(1, 1), pair16(2, 2), pair16(3, 3)}, next16[2] = {pair16(0, 1), pair16(2, 3)};
  // Scale j twice as an int16 pair in each lane, or (next) scales j and j +
  // 1 for an even j (Q6_K signed).
  I scale_pair(int j, bool next = false) const {
    const I pattern = next ? next16[(j % 4) / 2] : same16[j % 4];
    if constexpr (T == WeightType::q6_k) return L::sar16(L::shuffle(sc6[j / 4], pattern), 8);
    else return L::shuffle(j < 4 ? sc_lo : sc_hi, pattern);
  }
#endif
  // Mins 2p and 2p + 1 as an int16 pair (Q4_K, Q5_K).
  I min_pair(int p) const { return L::shuffle(p < 2 ? mn_lo : mn_hi, pairs[p % 2]); }
  L::F d() const { return L::halves(tail); }
  L::F dmin() const { return L::halves(tail + 32); }
};

// The same superblocks unpacked once into a panel that many rows then read
// (a prefill, a batch): per superblock the 64 value groups, the scales as
// int32 lanes, the min pairs, d and dmin, each a register's width.
template <WeightType T>
struct KPanelSource {
  using L = KLanes;
  using I = L::I;
  static constexpr int kGroups = 64, kPairs = 4, kRegs = kGroups + kscales<T>() + kPairs;
  static constexpr size_t kLanes = sizeof(I) / 4;
  struct alignas(64) Block {
    I r[kRegs];
    float d[kLanes], dmin[kLanes];
  };
  const Block* panel;
  const Block* at = nullptr;
  void begin(int b) { at = panel + b; }
  I values(int g) const { return at->r[g]; }
  I scale(int j) const { return at->r[kGroups + j]; }
  I min_pair(int p) const { return at->r[kGroups + kscales<T>() + p]; }
  L::F d() const { return L::fload(at->d); }
  L::F dmin() const { return L::fload(at->dmin); }
  // Fills `blocks` panel blocks from a tile's half.
  static void fill(KTileSource<T>& src, Block* out) {
    for (int b = 0; b < src.blocks; ++b) {
      src.begin(b);
      Block& o = out[b];
      for (int g = 0; g < kGroups; ++g) o.r[g] = src.values(g);
      for (int j = 0; j < kscales<T>(); ++j) o.r[kGroups + j] = src.scale(j);
      if constexpr (T != WeightType::q6_k)
        for (int p = 0; p < kPairs; ++p) o.r[kGroups + kscales<T>() + p] = src.min_pair(p);
      L::F dv = src.d();
      std::memcpy(o.d, &dv, sizeof dv);
      if constexpr (T != WeightType::q6_k) {
        dv = src.dmin();
        std::memcpy(o.dmin, &dv, sizeof dv);
      }
    }
  }
};
#endif

// Rows [r, r + R) of `cols` columns from `col` (this source's lanes, AVX2:
// one half of a tile). Per row: `d` the superblocks' scales (stride
// `blocks`), `qa` the values (stride k), `bsums` the sums of 16 (stride
// k / 16), `apairs` (Q4_K, Q5_K) the sums of 32 paired for min_pair (4 a
// superblock, stride 4 * blocks).
#if defined(__AVX2__)
template <WeightType T, int R, class Source>
inline void ksource_rows(Source& src, int blocks, const float* d, const int8_t* qa, const int16_t* bsums,
                         const int32_t* apairs, int k, float* c, int n, int r, int col, int cols) {
  using L = KLanes;
  using I = L::I;
  using F = L::F;
  constexpr int kPerScale = 64 / kscales<T>();  // groups of 4 values a scale
  F acc[R];
  for (int i = 0; i < R; ++i) acc[i] = L::fzero();
  for (int b = 0; b < blocks; ++b) {
    src.begin(b);
    const int8_t* a0 = qa + size_t(r) * k + size_t(b) * kQK;
    I s1[R];
    for (int i = 0; i < R; ++i) s1[i] = L::zero();
    // Unrolled whole under AVX-512: each group's planes and shifts are then
    // constants (at run time they were a third of a decode). GCC declines
    // it for the AVX2 body, twice the size; a fold over the indices, or the
    // body as a lambda, lost a quarter of the AVX-512 prefill.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#pragma GCC unroll 16
#endif
    for (int j = 0; j < kscales<T>(); ++j) {
      I t[R];
      for (int i = 0; i < R; ++i) t[i] = L::zero();
#pragma GCC unroll 8
      for (int gg = 0; gg < kPerScale; ++gg) {
        const int g = kPerScale * j + gg;
        const I q = src.values(g);
        for (int i = 0; i < R; ++i) t[i] = L::dot4(t[i], q, L::set1(load_word(a0 + size_t(i) * k + 4 * size_t(g))));
      }
      const I scale = src.scale(j);
      for (int i = 0; i < R; ++i) {
        if constexpr (T == WeightType::q6_k)  // the values came as q + 32
          t[i] = L::sub(t[i], L::set1(32 * int32_t(bsums[(size_t(r + i) * blocks + b) * 16 + size_t(j)])));
        s1[i] = L::add(s1[i], L::mullo(t[i], scale));
      }
    }
    const F dw = src.d();
    for (int i = 0; i < R; ++i) {
      const F da = L::fset1(d[size_t(r + i) * blocks + b]);
      acc[i] = L::fma(s1[i], L::fmul(dw, da), acc[i]);
    }
    if constexpr (T != WeightType::q6_k) {
      const F dmin = src.dmin();
      for (int i = 0; i < R; ++i) {
        I s2 = L::zero();
        for (int p = 0; p < 4; ++p) s2 = L::dot2(s2, src.min_pair(p), L::set1(apairs[(size_t(r + i) * blocks + b) * 4 + p]));
        acc[i] = L::fma(s2, L::fneg(L::fmul(dmin, L::fset1(d[size_t(r + i) * blocks + b]))), acc[i]);
      }
    }
  }
  for (int i = 0; i < R; ++i) L::store(c + size_t(r + i) * n + col, acc[i], cols);
}

template <WeightType T, int R, class Source>
void ksource_rows_upto(int rows, Source& src, int blocks, const float* d, const int8_t* qa, const int16_t* bsums,
                       const int32_t* apairs, int k, float* c, int n, int r, int col, int cols) {
  if constexpr (R > 0) {
    if (rows == R) return ksource_rows<T, R>(src, blocks, d, qa, bsums, apairs, k, c, n, r, col, cols);
    ksource_rows_upto<T, R - 1>(rows, src, blocks, d, qa, bsums, apairs, k, c, n, r, col, cols);
  }
}
#endif

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// AVX2's decode: rows [r, r + R) (R < kKPanelRows) straight from the tile,
// the same integers as ksource_rows with the loops laid out for AVX2, where
// GCC does not unroll ksource_rows' scales loop (so each group's word, plane
// and shift were picked at run time: 17 instructions a group, 1.2-1.6 per
// weight byte under callgrind): each word is loaded once for both scales
// whose values it holds (Q4_K, Q5_K: its low and high nibbles), the planes
// and shifts are constants of the unrolled code, and a scale's products are
// summed in int16 and scaled by one vpmaddwd (no vpmulld, no widening of
// each group).
//
// kdecode_block adds superblock b of the H halves `src` read (src[0] the
// tile's first: it fetches the next superblock's lines) to acc.
template <WeightType T, int R, int H>
__attribute__((always_inline)) inline void kdecode_block(KTileSource<T>* src, int b, int blocks, const float* d,
                                                         const int8_t* qa, const int16_t* bsums, const int32_t* apairs,
                                                         int k, int r, KLanes::F (&acc)[R][H]) {
  using L = KLanes;
  using I = L::I;
  using F = L::F;
  const I low4 = L::set1(0x0f0f0f0f);
  for (int h = 0; h < H; ++h) src[h].begin(b);
  const int8_t* a0 = qa + size_t(r) * k + size_t(b) * kQK;
  auto act = [&](int i, int g) { return L::set1(load_word(a0 + size_t(i) * k + 4 * size_t(g))); };
  I s1[R][H];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) s1[i][h] = L::zero();
  // A scale's products are summed in int16 (vpmaddubsw, vpaddw) as far as
  // no sum can pass 32,767, then times the scale in one vpmaddwd against
  // the scale as an int16 pair: the same integers as t x scale.
  if constexpr (T == WeightType::q6_k) {
    // Value 128 hh + 32 qq + 4 l (l < 8: group 32 hh + 8 qq + l) has scale
    // 8 hh + 2 qq + l / 4. Word 16 hh + 8 a + l (a = qq % 2) holds the low
    // 4 bits of quarters a (low nibbles) and a + 2 (high), word 32 + 8 hh
    // + l the top 2 bits of all four: each word is read once for the two
    // quarters it serves, and each pair's products go straight into S1.
    // (Read a quarter at a time, with a sum per quarter, GCC kept the words
    // and sums of four quarters alive and spilled them: 2,080 instructions
    // a superblock of a tile, 543 of them on the stack; now ~810, ~125.
    // AMD Zen 3, QuantizedRow, 1 thread: from L2 15 -> 20-22 GB/s, from
    // memory 11.3-12.6 -> 12.2-14.0.) |q + 32| <= 63, |a| <= 128: a pair's
    // sum 16,128, two of them in an int16. The + 32 comes off at the end.
    const I top2 = L::set1(0x30303030);
    auto pair = [&](auto a_c, int hh) {
      constexpr int a = decltype(a_c)::value;
      I sc[2][H][2];  // scales of quarters a and a + 2, for l < 4 and l >= 4
      for (int e = 0; e < 2; ++e)
        for (int h = 0; h < H; ++h)
          for (int half_l = 0; half_l < 2; ++half_l) sc[e][h][half_l] = src[h].scale_pair(8 * hh + 2 * (a + 2 * e) + half_l);
      I first[R][H][2];  // an even l's products, summed with the odd l's
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        // The next superblock's 52 body lines and its tail, two a step.
        const int step = 16 * hh + 8 * a + l;
        if (2 * step <= KTileSource<T>::kBodyLines) src[0].fetch_ahead(2 * step);
        if (2 * step + 1 <= KTileSource<T>::kBodyLines) src[0].fetch_ahead(2 * step + 1);
        I q[2][H];
        for (int h = 0; h < H; ++h) {
          const I x = src[h].word(16 * hh + 8 * a + l), hb = src[h].word(32 + 8 * hh + l);
          q[0][h] = L::bor(L::band(x, low4), L::band(a == 0 ? L::shl16(hb, 4) : L::shl16(hb, 2), top2));
          q[1][h] = L::bor(L::band(L::shr16(x, 4), low4), L::band(a == 0 ? hb : L::shr16(hb, 2), top2));
        }
        for (int i = 0; i < R; ++i)
          for (int e = 0; e < 2; ++e) {
            const I act_q = act(i, 32 * hh + 8 * (a + 2 * e) + l);  // one broadcast for both halves
            for (int h = 0; h < H; ++h) {
              const I products = L::maddubs(q[e][h], act_q);
              if (l % 2 == 0) first[i][h][e] = products;
              else s1[i][h] = L::dot2(s1[i][h], L::add16(first[i][h][e], products), sc[e][h][l / 4]);
            }
          }
        // Each step's sums stay one chain in a register: GCC would otherwise reassociate the
        // unrolled adds into a tree and keep (spill) every product until its end.
        for (int i = 0; i < R; ++i)
          for (int h = 0; h < H; ++h) asm("" : "+x"(s1[i][h]));
      }
    };
    pair(std::integral_constant<int, 0>{}, 0);
    pair(std::integral_constant<int, 1>{}, 0);
    pair(std::integral_constant<int, 0>{}, 1);
    pair(std::integral_constant<int, 1>{}, 1);
    // The values came as q + 32: less 32 x (bsum_j sc_j + bsum_j+1 sc_j+1) for each even j.
    for (int h = 0; h < H; ++h)
      for (int j = 0; j < 16; j += 2) {
        const I both = src[h].scale_pair(j, true);
        for (int i = 0; i < R; ++i) {
          const int16_t* bs = bsums + (size_t(r + i) * blocks + b) * 16;
          const I bsums_pair = L::set1(int32_t(uint32_t(uint16_t(bs[j])) | uint32_t(uint16_t(bs[j + 1])) << 16));
          s1[i][h] = L::sub(s1[i][h], L::shl32(L::dot2(L::zero(), both, bsums_pair), 5));
        }
      }
  } else {
    // Word 8 c4 + l holds group 16 c4 + l (scale 2 c4) in its low nibbles
    // and group 16 c4 + 8 + l (scale 2 c4 + 1) in its high ones; Q5_K's
    // fifth bits are bits 2 c4 and 2 c4 + 1 of qh's word l. A pair's sum
    // is at most 2 x 15 x 128 = 3,840 (Q4_K: 8 in an int16) or 7,936
    // (Q5_K: 4).
    constexpr int kParts = T == WeightType::q5_k ? 2 : 1;
    for (int c4 = 0; c4 < 4; ++c4) {
      I u0[R][H][kParts], u1[R][H][kParts];
      for (int i = 0; i < R; ++i)
        for (int h = 0; h < H; ++h)
          for (int p = 0; p < kParts; ++p) u0[i][h][p] = u1[i][h][p] = L::zero();
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        // The next superblock's lines, one a step, and alongside the
        // first steps' the lines after its values (Q5_K's qh, the scale
        // words, the tail).
        src[0].fetch_ahead(8 * c4 + l);
        if (32 + 8 * c4 + l <= KTileSource<T>::kBodyLines) src[0].fetch_ahead(32 + 8 * c4 + l);
        I lo[H], hi[H];
        for (int h = 0; h < H; ++h) {
          const I x = src[h].word(8 * c4 + l);
          lo[h] = L::band(x, low4), hi[h] = L::band(L::shr16(x, 4), low4);
          if constexpr (T == WeightType::q5_k) {
            const I qh = L::shr16(src[h].word(32 + l), 2 * c4), bit4 = L::set1(0x10101010);
            lo[h] = L::bor(lo[h], L::band(L::shl16(qh, 4), bit4));
            hi[h] = L::bor(hi[h], L::band(L::shl16(qh, 3), bit4));
          }
        }
        const int p = kParts == 2 ? l / 4 : 0;
        for (int i = 0; i < R; ++i) {
          const I a_lo = act(i, 16 * c4 + l), a_hi = act(i, 16 * c4 + 8 + l);  // one broadcast for both halves
          for (int h = 0; h < H; ++h) {
            u0[i][h][p] = L::add16(u0[i][h][p], L::maddubs(lo[h], a_lo));
            u1[i][h][p] = L::add16(u1[i][h][p], L::maddubs(hi[h], a_hi));
          }
        }
        for (int i = 0; i < R; ++i)  // (one chain each in a register, as Q6_K's)
          for (int h = 0; h < H; ++h) asm("" : "+x"(u0[i][h][p]), "+x"(u1[i][h][p]));
      }
      for (int h = 0; h < H; ++h) {
        const I sc0 = src[h].scale_pair(2 * c4), sc1 = src[h].scale_pair(2 * c4 + 1);
        for (int i = 0; i < R; ++i)
          for (int p = 0; p < kParts; ++p) s1[i][h] = L::dot2(L::dot2(s1[i][h], u0[i][h][p], sc0), u1[i][h][p], sc1);
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const F dw = src[h].d();
    for (int i = 0; i < R; ++i) {
      const F da = L::fset1(d[size_t(r + i) * blocks + b]);
      acc[i][h] = L::fma(s1[i][h], L::fmul(dw, da), acc[i][h]);
    }
    if constexpr (T != WeightType::q6_k) {
      const F dmin = src[h].dmin();
      for (int i = 0; i < R; ++i) {
        I s2 = L::zero();
        for (int p = 0; p < 4; ++p)
          s2 = L::dot2(s2, src[h].min_pair(p), L::set1(apairs[(size_t(r + i) * blocks + b) * 4 + p]));
        acc[i][h] = L::fma(s2, L::fneg(L::fmul(dmin, L::fset1(d[size_t(r + i) * blocks + b]))), acc[i][h]);
      }
    }
  }
}

template <WeightType T, int R, int H>
inline void kdecode_rows(KTileSource<T>* src, int blocks, const float* d, const int8_t* qa, const int16_t* bsums,
                         const int32_t* apairs, int k, float* c, int n, int r, int col, int cols) {
  using L = KLanes;
  L::F acc[R][H];
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) acc[i][h] = L::fzero();
  for (int b = 0; b < blocks; ++b) kdecode_block<T, R, H>(src, b, blocks, d, qa, bsums, apairs, k, r, acc);
  for (int i = 0; i < R; ++i)
    for (int h = 0; h < H; ++h) L::store(c + size_t(r + i) * n + col + 8 * h, acc[i][h], std::min(8, cols - 8 * h));
}

// A decode's row (R rows) against kTileStreams whole tiles at once, superblock
// by superblock: two streams through memory instead of one (as tile_streams).
// Each column's superblocks still come in order: the same sums. (AMD Zen 3,
// QuantizedRow, 1 thread, best of 5, alternating runs: from memory Q4_K
// 13.1-14.9 -> 17.2-19.5 GB/s, Q5_K 13.2-14.3 -> 15.1-17.2, Q6_K 10.2-11.7
// -> 12.0-12.6; from L2 Q6_K 21-23 -> 15, the others unchanged, and the
// 1B-shaped Q4_K_M decode 14.7-16.1 -> 16.5-18.7 tok/s. Q6_K read from
// one stream decodes no faster.)
template <WeightType T, int R, int S>
inline void kdecode_streams(const uint8_t* const (&tiles)[S], int blocks, const float* d, const int8_t* qa,
                            const int16_t* bsums, const int32_t* apairs, int k, float* c, int n, int r,
                            const int (&cols)[S]) {
  using L = KLanes;
  KTileSource<T> src[S][2];
  L::F acc[S][R][2];
  for (int s = 0; s < S; ++s) {
    for (int h = 0; h < 2; ++h)
      src[s][h].tile = tiles[s], src[s][h].blocks = blocks, src[s][h].half = 32 * size_t(h), src[s][h].fetch_spread = true;
    for (int i = 0; i < R; ++i) acc[s][i][0] = acc[s][i][1] = L::fzero();
  }
  for (int b = 0; b < blocks; ++b) {
#pragma GCC unroll 1  // (as tile_streams)
    for (int s = 0; s < S; ++s) kdecode_block<T, R, 2>(src[s], b, blocks, d, qa, bsums, apairs, k, r, acc[s]);
  }
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < 2; ++h) L::store(c + size_t(r + i) * n + cols[s] + 8 * h, acc[s][i][h], 8);
}

// Rows [r, r + rows) (rows <= kKDecodeRows) of the tile's columns [col, col +
// cols): both halves in one pass over the tile when there are more than 8
// and one row (or Q4_K's rows), else a pass per half: Q5_K's and Q6_K's
// sums of two or three rows and both halves spill (AMD Zen 3, 2048 x 2048
// from the caches, 1 thread, the best of 15 in 3 alternating rounds: Q6_K 2
// rows 230 -> 182 us, 3 rows 384 -> 241; Q5_K 3 rows 284 -> 231).
template <WeightType T, int R>
void kdecode_rows_upto(int rows, KTileSource<T>* src, int blocks, const float* d, const int8_t* qa,
                       const int16_t* bsums, const int32_t* apairs, int k, float* c, int n, int r, int col, int cols) {
  if constexpr (R > 0) {
    if (rows == R) {
      if (cols > 8 && (R == 1 || T == WeightType::q4_k))
        return kdecode_rows<T, R, 2>(src, blocks, d, qa, bsums, apairs, k, c, n, r, col, cols);
      kdecode_rows<T, R, 1>(src, blocks, d, qa, bsums, apairs, k, c, n, r, col, std::min(8, cols));
      if (cols > 8) kdecode_rows<T, R, 1>(src + 1, blocks, d, qa, bsums, apairs, k, c, n, r, col + 8, cols - 8);
      return;
    }
    kdecode_rows_upto<T, R - 1>(rows, src, blocks, d, qa, bsums, apairs, k, c, n, r, col, cols);
  }
}
#endif

// Rows [r0, r1) of the columns [col, col + cols) of one tile (`tile`: its
// superblock 0): from the tile itself for fewer than kKPanelRows rows, else
// from a panel unpacked once for them all; with AVX2, fewer than
// kdecode_rows_below<T> from the tile, kKDecodeRows at a time.
constexpr int kKPanelRows = 4;
constexpr int kKDecodeRows = 3;
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// The rows from which AVX2 takes a tile's rows through a panel: Q4_K's
// decode body, three rows at a time, beats the panel at every count (AMD
// Zen 3, rows against 2048 x 2048 weights from the caches, 1 thread, two
// alternating runs: 4 rows 413-435 -> 276-279 us, 5 rows 509-550 -> 306-319,
// 8 rows 683-718 -> 478-528, 64 rows 4510-4712 -> 4057-4226); Q5_K's and
// Q6_K's (a pass per half, kdecode_rows_upto) up to 9 rows (the best of 15
// as below: Q6_K 5 rows 632 -> 419 us, 9 rows 883 -> 686; Q5_K 5 rows 569 ->
// 404, 9 rows 803 -> 660), the panel from 16 (Q6_K 16 rows 1302 -> 1348,
// 64 rows 4489-4987 -> 5089-5150 in two runs): the line drawn between, at 12.
template <WeightType T>
constexpr int kdecode_rows_below = T == WeightType::q4_k ? std::numeric_limits<int>::max() : 12;
#endif
template <WeightType T>
inline void ktile_rows(const uint8_t* tile, int blocks, const float* d, const int8_t* qa, const int16_t* bsums,
                       const int32_t* apairs, int k, float* c, int n, int r0, int r1, int col, int cols) {
#if defined(__AVX2__)
  using L = KLanes;
#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
  if (r1 - r0 < kdecode_rows_below<T>) {  // AVX2: straight from the tile
    KTileSource<T> src[2];
    for (int h = 0; h < 2; ++h)
      src[h].tile = tile, src[h].blocks = blocks, src[h].half = 32 * size_t(h), src[h].fetch_spread = true;
    for (int r = r0; r < r1; r += kKDecodeRows)
      kdecode_rows_upto<T, kKDecodeRows>(std::min(kKDecodeRows, r1 - r), src, blocks, d, qa, bsums, apairs, k, c, n, r, col, cols);
    return;
  }
#endif
  for (int h = 0; h < L::kHalves && 8 * h < cols; ++h) {
    KTileSource<T> src;
    src.tile = tile;
    src.blocks = blocks;
    src.half = 32 * size_t(h);
    const int live = std::min(16 / L::kHalves, cols - 8 * h), at = col + 8 * h;
    int r = r0;
    if (r1 - r0 >= kKPanelRows) {
      using P = KPanelSource<T>;
      thread_local std::vector<typename P::Block> panel;
      panel.resize(size_t(blocks));
      P::fill(src, panel.data());
      P psrc{panel.data()};
      for (; r + kKRows <= r1; r += kKRows)
        ksource_rows<T, kKRows>(psrc, blocks, d, qa, bsums, apairs, k, c, n, r, at, live);
      ksource_rows_upto<T, kKRows - 1>(r1 - r, psrc, blocks, d, qa, bsums, apairs, k, c, n, r, at, live);
    } else {
      for (; r + kKRows <= r1; r += kKRows)
        ksource_rows<T, kKRows>(src, blocks, d, qa, bsums, apairs, k, c, n, r, at, live);
      ksource_rows_upto<T, kKRows - 1>(r1 - r, src, blocks, d, qa, bsums, apairs, k, c, n, r, at, live);
    }
  }
#else
  // Each column's superblock put back as the file stores it, then the reference's sums.
  constexpr size_t kBytes = block_bytes(T);
  for (int cc = 0; cc < cols; ++cc) {
    for (int row = r0; row < r1; ++row) {
      float acc = 0.0f;
      for (int b = 0; b < blocks; ++b) {
        uint8_t block[kBytes];
        untile_block(T, tile, blocks, b, cc, block);
        KQuantBlock kb;
        unpack_superblock(T, block, kb);
        const size_t at = size_t(row) * blocks + b;
        const int8_t* a = qa + at * kQK;
        int32_t s1 = 0, s2 = 0;
        for (int e = 0; e < kQK; ++e)
          s1 += (T == WeightType::q6_k ? kb.scale[e / 16] : kb.scale[e / 32]) * int32_t(kb.q[e]) * int32_t(a[e]);
        if constexpr (T != WeightType::q6_k)
          for (int g = 0; g < 16; ++g) s2 += int32_t(bsums[at * 16 + size_t(g)]) * kb.min[g / 2];
        acc = std::fma(float(s1), kb.d * d[at], acc);
        if constexpr (T != WeightType::q6_k) acc = std::fma(float(s2), -(kb.dmin * d[at]), acc);
      }
      c[size_t(row) * n + col + cc] = acc;
    }
  }
  (void)apairs;
  (void)k;
#endif
}

// C[m][n] for the columns [col_begin, col_end) (col_begin a multiple of 16):
// activations quantized per superblock (d: m x k/256, qa: m x k, bsums: m x
// k/16), tile by tile, kKRows rows at a time.
template <WeightType T>
void matmul_ktiled(const float* d, const int8_t* qa, const int16_t* bsums, const uint8_t* w, float* c, int m, int n,
                   int k, int col_begin, int col_end) {
  const int blocks = k / kQK;
  const size_t tile_bytes = size_t(blocks) * kTileCols * block_bytes(T);
  thread_local std::vector<int32_t> apairs;  // m x blocks x 4: sums of 32, (2p, 2p + 1) as two int16
  apairs.resize(size_t(m) * blocks * 4);
  for (size_t rb = 0; rb < size_t(m) * blocks; ++rb)
    for (int p = 0; p < 4; ++p) {
      const int16_t* s = bsums + rb * 16 + 4 * size_t(p);
      const auto even = uint16_t(int16_t(s[0] + s[1])), odd = uint16_t(int16_t(s[2] + s[3]));  // |sum| <= 32 x 127
      apairs[rb * 4 + size_t(p)] = int32_t(uint32_t(even) | uint32_t(odd) << 16);
    }
  for (int r0 = 0; r0 < m; r0 += kQ8RowBlock) {
    const int r1 = std::min(m, r0 + kQ8RowBlock);
    int col = col_begin;
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
    // A decode's row: the whole tiles in S parts read side by side. (One row only: two rows, a
    // verification step of one guess or a batch of two, compute more than they wait for memory, and read
    // from two streams were no faster: AMD Zen 3, 1B-shaped Q4_0, a step of two rows 1.36-1.48x a plain
    // step with them, 1.33-1.35x without.)
    if (r1 - r0 == 1) {
      constexpr int S = kTileStreams;
      const int part = (col_end - col_begin) / kTileCols / S;  // whole tiles a stream
      for (int t = 0; t < part; ++t) {
        const uint8_t* tiles[S];
        int cols[S];
        for (int s = 0; s < S; ++s) {
          cols[s] = col_begin + (s * part + t) * kTileCols;
          tiles[s] = w + size_t(cols[s] / kTileCols) * tile_bytes;
        }
        kdecode_streams<T, 1, S>(tiles, blocks, d, qa, bsums, apairs.data(), k, c, n, r0, cols);
      }
      col = col_begin + S * part * kTileCols;
    }
#endif
    for (; col < col_end; col += kTileCols) {
      const uint8_t* tile = w + size_t(col / kTileCols) * tile_bytes;
      const int cols = std::min(kTileCols, col_end - col);
      ktile_rows<T>(tile, blocks, d, qa, bsums, apairs.data(), k, c, n, r0, r1, col, cols);
    }
  }
}

void matmul_kquant(WeightType type, const float* d, const int8_t* qa, const int16_t* bsums, const uint8_t* w, float* c,
                   int m, int n, int k, int col_begin, int col_end) {
  if (type == WeightType::q4_k) matmul_ktiled<WeightType::q4_k>(d, qa, bsums, w, c, m, n, k, col_begin, col_end);
  else if (type == WeightType::q5_k) matmul_ktiled<WeightType::q5_k>(d, qa, bsums, w, c, m, n, k, col_begin, col_end);
  else matmul_ktiled<WeightType::q6_k>(d, qa, bsums, w, c, m, n, k, col_begin, col_end);
}
