// The Q8_0 and Q4_0 matrix products of one instruction set, on weights in
// tiles of 16 columns (gpu/cpu/cpu_kernels.h tile_quantized; the rule:
// gpu/fixed_math.h, "quantized matrix product"; the reference: gpu/quant.cpp
// matmul_quantized_reference). Included by each gpu/cpu/isa_*.cpp inside its
// namespace after q8_kernels.inl.
//
// A tile's block holds its 16 columns' weights as 4-byte words, column c in
// word c of each 64 bytes, so a vector of 16 int32 lanes (AVX-512) or two of
// 8 (AVX2) sums each column in its own lane and no horizontal sum is left:
// - AVX-512 VNNI: vpdpbusd of the unsigned weights (Q8_0: q + 128; Q4_0: the
//   nibbles, q + 8) against four activations broadcast to every lane; the
//   sum starts at -(128 or 8) x the block's activation sum, so it ends at the
//   exact sum of q a.
// - AVX2: vpmaddubsw / vpmaddwd, Q8_0 by |q| against a with q's sign (no
//   pair passes int16), Q4_0 by the nibbles, 8 x the activation sum off.
// - generic: a scalar loop over the same bytes.
// Every way the block's integer sum is exact, then each column takes the
// rule's fma for the block, blocks in increasing order: the same bits on
// every kernel set, whatever the batch. Several rows (a prefill, a batch)
// share each load of a tile's weights.

// Rows a call of tile_rows computes: each weight load serves them all.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int kTileRows = 8;   // 8 int32 + 8 float accumulators of 32 zmm
#elif defined(__AVX2__)
constexpr int kTileRows = 4;   // per half tile: 4 + 4 of 16 ymm, the rest for weights
constexpr int kHalvesAtOnce = 2;  // rows that take both halves in one pass: 2 x (2 + 2) ymm
#else
constexpr int kTileRows = 1;
#endif

// Bytes of a block's body in a tile (cpu_kernels.h tile_body_bytes; the
// tile's tails, its half scales, come after all the bodies).
template <WeightType T>
constexpr size_t tile_quant_bytes() { return T == WeightType::q8_0 ? 8 * 64 : 4 * 64; }
// What the unsigned weights add to a block's sum, per unit of activation sum.
template <WeightType T>
constexpr int32_t tile_bias() { return T == WeightType::q8_0 ? 128 : 8; }

// Four bytes as one int32 (to broadcast to every lane).
inline int32_t load_word(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX2__)
// The lines 4 KB ahead of a block's quants, and of its scales, fetched while
// it is computed (AMD Zen 5, 1B-shaped decode, 1 thread: Q4_0 24 tok/s
// without, 35-41 with 4-32 KB; Q8_0 22-23 at 16 KB, 24-28 at 4 KB: the
// hardware prefetchers alone fall behind).
constexpr size_t kTilePrefetchBytes = 4096;
template <WeightType T>
inline void tile_prefetch(const uint8_t* quants, const uint8_t* scales) {
  constexpr size_t blocks_ahead = kTilePrefetchBytes / tile_quant_bytes<T>();
  for (size_t at = 0; at < tile_quant_bytes<T>(); at += 64)
    _mm_prefetch(reinterpret_cast<const char*>(quants + blocks_ahead * tile_quant_bytes<T>() + at), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales + 32 * blocks_ahead), _MM_HINT_T0);
}

// Block b of the next tile (tiles lie one after another), fetched by the
// second half's pass of a tile (rows that take a pass per half), which
// computes from the cache what the first pass fetched: memory stays busy
// through it. (AMD Zen 3, rows against 65536 x 2048 weights, 1 thread, 3
// alternating runs: Q4_0 4 rows 8.3-8.6 -> 7.2-8.0 ms, 5 rows 10.9-14.0 ->
// 9.7-11.7; Q8_0 4 rows 13.4-17.2 -> 12.5-14.1.) A prefetch past the last
// tile is harmless: it never faults.
template <WeightType T>
inline void tile_prefetch_next(const uint8_t* tile, int blocks, int b) {
  constexpr size_t kQ = tile_quant_bytes<T>();
  const uint8_t* next = tile + size_t(blocks) * (kQ + 32);
  for (size_t at = 0; at < kQ; at += 64) _mm_prefetch(reinterpret_cast<const char*>(next + size_t(b) * kQ + at), _MM_HINT_T0);
  if (b % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(next + size_t(blocks) * kQ + 32 * size_t(b)), _MM_HINT_T0);
}
#endif

// A group of R activation rows (R <= kTileRows) as tile_rows reads them, so
// that one pointer and fixed offsets reach every row: per block b, at b *
// group_block_bytes(R), the rows' 32 quantized values, then their R scales
// (float), then their R sums' starts (int32: -(128 or 8) x the block's sum of
// the values, what the unsigned weights add).
constexpr size_t group_block_bytes(int R) { return size_t(R) * (kQ8Block + 8); }

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
// Block b of halves [h0, h0 + H) of one tile (AVX2) against rows [0, R) of
// the group `grp`, added to acc: the block's exact integer sums, then each
// column's fma for the block.
template <WeightType T, int R, int H>
__attribute__((always_inline)) inline void tile_block(const uint8_t* tile, int blocks, int b, int h0, const uint8_t* grp, __m256 (&acc)[R][H]) {
  constexpr size_t kQ = tile_quant_bytes<T>(), kG = group_block_bytes(R);
  constexpr size_t kScales = size_t(R) * kQ8Block, kStarts = kScales + 4 * size_t(R);
  const uint8_t* tile_scales = tile + size_t(blocks) * kQ;  // 16 halves a block
  const __m256i low4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* tb = tile + size_t(b) * kQ + 32 * h0;
  const uint8_t* gb = grp + size_t(b) * kG;
  if (h0 == 0) tile_prefetch<T>(tb, tile_scales + 32 * size_t(b));
  else tile_prefetch_next<T>(tile, blocks, b);
  __m256i is[R][H];
  if constexpr (T == WeightType::q8_0) {
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h) is[i][h] = _mm256_setzero_si256();
    auto group = [&](int g) __attribute__((always_inline)) {
      __m256i wabs[H], w[H];
      for (int h = 0; h < H; ++h) {
        w[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 64 * g + 32 * h)), flip);
        wabs[h] = _mm256_sign_epi8(w[h], w[h]);
      }
      for (int i = 0; i < R; ++i) {
        const __m256i av = _mm256_set1_epi32(load_word(gb + 32 * i + 4 * g));
        for (int h = 0; h < H; ++h)
          is[i][h] = _mm256_add_epi32(is[i][h],
                                      _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[h], _mm256_sign_epi8(av, w[h])), ones));
      }
    };
    // A decode's row keeps the groups unrolled; more rows take them one at
    // a time, as Q4_0's below (AMD Zen 3, 2048 x 2048 Q8_0, 1 thread, three
    // alternating runs: 2 rows 167-191 -> 160-162 us, 3 rows 247-278 ->
    // 227-238, 64 rows 5165-5498 -> 4782-4923; from memory, 65536 x 2048,
    // 2 to 5 rows 1-10% faster in every pair, one row mixed).
    if constexpr (R == 1) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) group(g);
    } else {
#pragma GCC unroll 1
      for (int g = 0; g < 8; ++g) group(g);
    }
  } else {
    __m256i p16[R][H];  // 8 pairs of at most 2 x 15 x 127 a lane: no int16 saturation
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h) p16[i][h] = _mm256_setzero_si256();
    auto group = [&](int g) __attribute__((always_inline)) {
      __m256i lo[H], hi[H];
      for (int h = 0; h < H; ++h) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tb + 64 * g + 32 * h));
        lo[h] = _mm256_and_si256(x, low4), hi[h] = _mm256_and_si256(_mm256_srli_epi16(x, 4), low4);
      }
      for (int i = 0; i < R; ++i) {
        const __m256i al = _mm256_set1_epi32(load_word(gb + 32 * i + 4 * g));
        const __m256i ah = _mm256_set1_epi32(load_word(gb + 32 * i + 16 + 4 * g));
        for (int h = 0; h < H; ++h)
          p16[i][h] = _mm256_add_epi16(p16[i][h],
                                       _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], al), _mm256_maddubs_epi16(hi[h], ah)));
      }
    };
    // Three or more rows take the groups one at a time: unrolled, GCC
    // computes every group's products first and spills them to the stack
    // (53 of the 4-row loop's 177 instructions), and 4 rows from the caches took
    // 1.25x as long (AMD Zen 3, 2048 x 2048 Q4_0, 1 thread, two alternating
    // runs: 4 rows 243-256 -> 194-201 us, 5 rows 323 -> 258, 8 rows 502-627 ->
    // 392-417); one or two rows keep them unrolled (one row 83-86 -> 89-96
    // us when not).
    if constexpr (R <= kHalvesAtOnce) {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) group(g);
    } else {
#pragma GCC unroll 1
      for (int g = 0; g < 4; ++g) group(g);
    }
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h)
        is[i][h] = _mm256_add_epi32(_mm256_madd_epi16(p16[i][h], ones), _mm256_set1_epi32(load_word(gb + kStarts + 4 * i)));
  }
  for (int h = 0; h < H; ++h) {
    const __m256 dw =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tile_scales + 32 * size_t(b) + 16 * size_t(h0 + h))));
    for (int i = 0; i < R; ++i) {
      float a_scale;
      std::memcpy(&a_scale, gb + kScales + 4 * i, 4);
      acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[i][h]), _mm256_mul_ps(dw, _mm256_set1_ps(a_scale)), acc[i][h]);
    }
  }
}

// Rows [r, r + R) of H halves' sums into C from column `col` (`cols` of them
// live there).
template <int R, int H>
inline void tile_store(const __m256 (&acc)[R][H], float* c, int n, int r, int col, int cols) {
  for (int h = 0; h < H && 8 * h < cols; ++h) {
    const int live = std::min(8, cols - 8 * h);
    float* out = c + col + 8 * h;
    for (int i = 0; i < R; ++i) {
      if (live == 8) {
        _mm256_storeu_ps(out + size_t(r + i) * n, acc[i][h]);
      } else {
        alignas(32) float part[8];
        _mm256_store_ps(part, acc[i][h]);
        std::memcpy(out + size_t(r + i) * n, part, sizeof(float) * size_t(live));
      }
    }
  }
}

// A decode's row (R rows) against S whole tiles at once, block by block: S
// streams through memory instead of one. One core keeps more lines in
// flight from several streams than from one (AMD Zen 3, a 150 MB Q4_0
// matrix on huge pages, one row, 1 thread: 16.4-17.4 GB/s from one stream,
// 19.2-20.6 from two; the read probe 23-24.5 from four). Two, not four:
// four streams' accumulators and temporaries spill (from L2 Q4_0 30 -> 18-25
// GB/s), and so do two streams' when the loop over them is unrolled. Each
// column's blocks still come in order: the same sums. (QuantizedRow, 1
// thread, best of 5, 3 alternating runs: from memory Q8_0 14.2-14.8 ->
// 17.9-21.4 GB/s, Q4_0 14.1-15.6 -> 18.6-20.7; from L2 unchanged.) Q8_0,
// whose blocks need no unpacking, has the registers for a third stream
// (the 1B-shaped decode on 1 thread, 9 alternating pairs: 13.7-15.5 ->
// 14.2-17.6 tok/s, faster in each pair; Q4_0 with three: 26.3-28.9 ->
// 26.4-26.9, so it keeps two).
constexpr int kTileStreams = 2;
template <WeightType T>
constexpr int tile_streams_of = T == WeightType::q8_0 ? 3 : kTileStreams;
template <WeightType T, int R, int S>
inline void tile_streams(const uint8_t* const (&tiles)[S], int blocks, const uint8_t* grp, float* c, int n, int r,
                         const int (&cols)[S]) {
  __m256 acc[S][R][2];
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < R; ++i) acc[s][i][0] = acc[s][i][1] = _mm256_setzero_ps();
  for (int b = 0; b < blocks; ++b) {
#pragma GCC unroll 1  // (unrolled, the streams' registers spill)
    for (int s = 0; s < S; ++s) tile_block<T, R, 2>(tiles[s], blocks, b, 0, grp, acc[s]);
  }
  for (int s = 0; s < S; ++s) tile_store<R, 2>(acc[s], c, n, r, cols[s], kTileCols);
}
#endif

// Rows [r, r + R) of the columns [col, col + cols) of one tile (`tile`: its
// block 0), from their group `grp`.
template <WeightType T, int R>
inline void tile_rows(const uint8_t* tile, int blocks, const uint8_t* grp, float* c, int n, int r, int col, int cols) {
  [[maybe_unused]] constexpr size_t kQ = tile_quant_bytes<T>(), kG = group_block_bytes(R);
  [[maybe_unused]] constexpr size_t kScales = size_t(R) * kQ8Block, kStarts = kScales + 4 * size_t(R);
  [[maybe_unused]] const uint8_t* tile_scales = tile + size_t(blocks) * kQ;  // 16 halves a block
  [[maybe_unused]] auto scale = [](const uint8_t* p) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  };
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* tb = tile + size_t(b) * kQ;
    const uint8_t* gb = grp + size_t(b) * kG;  // row i's values at 32 i
    tile_prefetch<T>(tb, tile_scales + 32 * size_t(b));
    __m512i is[R];
    for (int i = 0; i < R; ++i) is[i] = _mm512_set1_epi32(load_word(gb + kStarts + 4 * i));
    if constexpr (T == WeightType::q8_0) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m512i wv = _mm512_loadu_si512(tb + 64 * g);
        for (int i = 0; i < R; ++i) is[i] = _mm512_dpbusd_epi32(is[i], wv, _mm512_set1_epi32(load_word(gb + 32 * i + 4 * g)));
      }
    } else {
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const __m512i x = _mm512_loadu_si512(tb + 64 * g);
        const __m512i lo = _mm512_and_si512(x, low4), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low4);
        for (int i = 0; i < R; ++i) {
          is[i] = _mm512_dpbusd_epi32(is[i], lo, _mm512_set1_epi32(load_word(gb + 32 * i + 4 * g)));
          is[i] = _mm512_dpbusd_epi32(is[i], hi, _mm512_set1_epi32(load_word(gb + 32 * i + 16 + 4 * g)));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile_scales + 32 * size_t(b))));
    for (int i = 0; i < R; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[i]), _mm512_mul_ps(dw, _mm512_set1_ps(scale(gb + kScales + 4 * i))),
                               acc[i]);
  }
  const __mmask16 live = __mmask16((1u << cols) - 1u);
  for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(c + size_t(r + i) * n + col, live, acc[i]);
#elif defined(__AVX2__)
  // The tile's two halves of 8 columns: a decode's row or two (kHalvesAtOnce)
  // read both in one pass over the blocks, each line once, while it is
  // fetched; more rows take a pass per half (their accumulators fill the
  // registers), the second reading what the first fetched. (A pass per half
  // left memory idle through the second: AMD Zen 3, 1B-shaped decode, 1
  // thread, Q4_0 16.8-18.6 -> 21.6-24.2 tok/s, Q8_0 9.1-10.5 -> 11.8-13.1.)
  constexpr int H = R <= kHalvesAtOnce ? 2 : 1;
  for (int h0 = 0; h0 < 2 && 8 * h0 < cols; h0 += H) {
    __m256 acc[R][H];
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < H; ++h) acc[i][h] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; ++b) tile_block<T, R, H>(tile, blocks, b, h0, grp, acc);
    tile_store<R, H>(acc, c, n, r, col + 8 * h0, cols - 8 * h0);
  }
#else
  for (int i = 0; i < R; ++i)
    for (int cc = 0; cc < cols; ++cc) {
      float acc = 0.0f;
      for (int b = 0; b < blocks; ++b) {
        uint8_t block[block_bytes(T)];  // the file's block, put back from the tile
        untile_block(T, tile, blocks, b, cc, block);
        const auto* a = reinterpret_cast<const int8_t*>(grp + size_t(b) * kG + 32 * size_t(i));
        int32_t isum = 0;
        for (int j = 0; j < kQ8Block; ++j) isum += blocks::value(T, block, j) * int32_t(a[j]);
        acc = std::fma(float(isum), blocks::d_of(T, block) * scale(grp + size_t(b) * kG + kScales + 4 * i), acc);
      }
      c[size_t(r + i) * n + col + cc] = acc;
    }
#endif
}

template <WeightType T, int R>
void tile_rows_upto(int rows, const uint8_t* tile, int blocks, const uint8_t* grp, float* c, int n, int r, int col,
                    int cols) {
  if constexpr (R > 0) {
    if (rows == R) return tile_rows<T, R>(tile, blocks, grp, c, n, r, col, cols);
    tile_rows_upto<T, R - 1>(rows, tile, blocks, grp, c, n, r, col, cols);
  }
}

// Rows per pass over a range of columns: every tile streams from memory once
// per pass, its rows' activations (up to 512 x k bytes) come from the caches.
constexpr int kQ8RowBlock = 512;

// C[m][n] for the columns [col_begin, col_end) (col_begin a multiple of 16),
// tile by tile, kTileRows rows at a time (the rows of a pass in groups of
// kTileRows, then one of the rest, each laid out for tile_rows).
template <WeightType T>
void matmul_tiled(const float* scales, const int8_t* qa, const uint8_t* w, float* c, int m, int n, int k, int col_begin,
                  int col_end) {
  const int blocks = k / kQ8Block;
  const size_t tile_bytes = size_t(blocks) * kTileCols * block_bytes(T);
  thread_local std::vector<uint8_t> groups;  // m x blocks x (32 + 8) bytes; row r's group at r x blocks x 40
  groups.resize(size_t(m) * blocks * group_block_bytes(1));
  auto group_of = [&](int r) { return groups.data() + size_t(r) * blocks * group_block_bytes(1); };
  auto lay_out = [&](int r, int rows) {
    uint8_t* g = group_of(r);
    for (int b = 0; b < blocks; ++b) {
      uint8_t* gb = g + size_t(b) * rows * group_block_bytes(1);
      for (int i = 0; i < rows; ++i) {
        const int8_t* q = qa + size_t(r + i) * k + size_t(b) * kQ8Block;
        std::memcpy(gb + 32 * size_t(i), q, kQ8Block);
        std::memcpy(gb + 32 * size_t(rows) + 4 * size_t(i), scales + size_t(r + i) * blocks + b, 4);
        int32_t sum = 0;
        for (int j = 0; j < kQ8Block; ++j) sum += q[j];
        const int32_t start = -tile_bias<T>() * sum;
        std::memcpy(gb + 36 * size_t(rows) + 4 * size_t(i), &start, 4);
      }
    }
  };
  for (int r0 = 0; r0 < m; r0 += kQ8RowBlock) {
    const int r1 = std::min(m, r0 + kQ8RowBlock);
    int full = r0;
    for (; full + kTileRows <= r1; full += kTileRows) lay_out(full, kTileRows);
    if (full < r1) lay_out(full, r1 - full);
    int col = col_begin;
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
    // A decode's row: the whole tiles in S parts read side by side. (One row only: two rows, a
    // verification step of one guess or a batch of two, compute more than they wait for memory, and read
    // from two streams were no faster: AMD Zen 3, 1B-shaped Q4_0, a step of two rows 1.36-1.48x a plain
    // step with them, 1.33-1.35x without.)
    if (r1 - r0 == 1) {
      constexpr int S = tile_streams_of<T>;
      const int part = (col_end - col_begin) / kTileCols / S;  // whole tiles a stream
      for (int t = 0; t < part; ++t) {
        const uint8_t* tiles[S];
        int cols[S];
        for (int s = 0; s < S; ++s) {
          cols[s] = col_begin + (s * part + t) * kTileCols;
          tiles[s] = w + size_t(cols[s] / kTileCols) * tile_bytes;
        }
        tile_streams<T, 1, S>(tiles, blocks, group_of(r0), c, n, r0, cols);
      }
      col = col_begin + S * part * kTileCols;
    }
#endif
    for (; col < col_end; col += kTileCols) {
      const uint8_t* tile = w + size_t(col / kTileCols) * tile_bytes;
      const int cols = std::min(kTileCols, col_end - col);
      int r = r0;
      for (; r + kTileRows <= r1; r += kTileRows) tile_rows<T, kTileRows>(tile, blocks, group_of(r), c, n, r, col, cols);
      tile_rows_upto<T, kTileRows - 1>(r1 - r, tile, blocks, group_of(r), c, n, r, col, cols);
    }
  }
}

void matmul_quantized(WeightType type, const float* scales, const int8_t* qa, const uint8_t* w, float* c, int m, int n,
                      int k, int col_begin, int col_end) {
  if (type == WeightType::q8_0) matmul_tiled<WeightType::q8_0>(scales, qa, w, c, m, n, k, col_begin, col_end);
  else matmul_tiled<WeightType::q4_0>(scales, qa, w, c, m, n, k, col_begin, col_end);
}
