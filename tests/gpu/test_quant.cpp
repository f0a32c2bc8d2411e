// Weight types (gpu/quant.h): half precision against the CPU's own F16C
// instructions, bfloat16 rounding, Q8_0 quantization as ggml's reference does
// it, the Q8_0 / Q4_0 matrix product of every kernel set bit for bit against
// its naive reference (gpu/quant.cpp) and independent of the batch and the
// threads, the f16 / bf16 product equal to the f32 one of the widened
// weights, and models of every type: prefill equals stepwise decode, byte
// for byte the peer converter's files, and how closely they follow F32.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <map>
#include <filesystem>
#include <fstream>
#include <random>

#include "gpu/backend.h"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "gpu/cpu/cpu_kernels.h"
#include "engine/engine.h"
#include "gpu/fixed_math.h"
#include "engine/generate.h"
#include "gpu/error.h"
#include "model/gguf.h"
#include "gpu/quant.h"
#include "text/tokenizer.h"
#include "support/reference_cases.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

__attribute__((target("f16c"))) float hw_half_to_float(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) uint16_t hw_float_to_half(float f) { return _cvtss_sh(f, 0); }
bool has_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
}

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

TEST(Half, EveryHalfConvertsExactlyAndRoundsAsF16c) {
  if (!has_f16c()) GTEST_SKIP() << "no F16C on this CPU to compare with";
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(uint16_t(h));
    const float hw = hw_half_to_float(uint16_t(h));
    if (std::isnan(hw)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      continue;
    }
    ASSERT_EQ(bits_of(f), bits_of(hw)) << "half " << h;
    ASSERT_EQ(float_to_half(f), uint16_t(h)) << "half " << h << " does not round-trip";
  }
  // Floats between halves (ties included), subnormal halves, overflow: as vcvtps2ph.
  std::mt19937 rng(3);
  for (int i = 0; i < 2000000; ++i) {
    uint32_t b = rng();
    if (i % 4 == 0) b = (b & 0x80000000u) | (0x33000000u + (b % (0x47800000u - 0x33000000u)));  // the half range
    if (i % 8 == 1) b = (b & ~0x0fffu) | 0x1000u;  // a tie for the normal halves
    float f;
    std::memcpy(&f, &b, sizeof f);
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), hw_float_to_half(f)) << "float bits " << std::hex << b;
    // fixed::round_to_half (the activations' scales) is the same rounding, as a float.
    ASSERT_EQ(bits_of(fixed::round_to_half(f)), bits_of(half_to_float(hw_float_to_half(f)))) << std::hex << b;
  }
}

TEST(Quant, QuantizeRowQ8_0IsGgmlsReference) {
  // One block by hand: d = max|x| / 127 as half, q = roundf(x / d).
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = float(j - 16) * 0.25f;  // max |x| = 4
  x[5] = 2.5f * (4.0f / 127.0f);  // a tie: roundf takes it away from zero (3), rint would give 2
  uint8_t block[34];
  quantize_row_q8_0(x, block, 32);
  uint16_t dh;
  std::memcpy(&dh, block, 2);
  EXPECT_EQ(dh, float_to_half(4.0f / 127.0f));
  const float id = 1.0f / (4.0f / 127.0f);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(int8_t(block[2 + j]), int8_t(std::round(x[j] * id))) << j;
  EXPECT_EQ(int8_t(block[2 + 0]), -127);
  EXPECT_EQ(int8_t(block[2 + 5]), int8_t(std::round(x[5] * id)));
  // An all-zero block: d = 0, q = 0.
  float zeros[32] = {};
  quantize_row_q8_0(zeros, block, 32);
  for (uint8_t b : block) EXPECT_EQ(b, 0);
  std::vector<float> back(32);
  dequantize_row(WeightType::q8_0, block, back.data(), 32);
  for (float v : back) EXPECT_EQ(v, 0.0f);
}

TEST(Quant, QuantizeRowQ4_0IsGgmlsReference) {
  // The value of largest magnitude sets d = m / -8; q = min(15, int8(x / d + 8.5)).
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = float(j) * 0.05f - 1.0f;  // in [-1, 0.55]
  x[20] = 2.0f;  // now the largest, positive: d = -0.25, so 2.0 -> q = 0 (value -8 * d = 2)
  uint8_t block[18];
  quantize_row_q4_0(x, block, 32);
  uint16_t dh;
  std::memcpy(&dh, block, 2);
  EXPECT_EQ(dh, float_to_half(-0.25f));
  int8_t values[32];
  EXPECT_EQ(unpack_block(WeightType::q4_0, block, values), -0.25f);
  EXPECT_EQ(values[20], -8);  // 2.0 / -0.25 + 8.5 = 0.5 -> 0 -> -8
  for (int j = 0; j < 32; ++j) {
    const int want = std::min(15, int(int8_t(x[j] * (1.0f / -0.25f) + 8.5f))) - 8;
    EXPECT_EQ(values[j], want) << j;
  }
  // Byte j: value j low, value j + 16 high.
  EXPECT_EQ(block[2 + 4] & 0x0f, values[4] + 8);
  EXPECT_EQ(block[2 + 4] >> 4, values[20] + 8);
  std::vector<float> back(32);
  dequantize_row(WeightType::q4_0, block, back.data(), 32);
  EXPECT_EQ(back[20], 2.0f);
}

// Rows of n x k in `type` from seeded values, with the blocks that test the
// edges: a zero block, the most negative weight (Q8_0 -128, Q4_0 -8), a
// subnormal scale.
std::vector<uint8_t> quantized_matrix(WeightType type, int n, int k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> w(size_t(n) * k);
  for (float& v : w) v = u(rng);
  const size_t row = row_bytes(type, k), block = block_bytes(type);
  std::vector<uint8_t> q(size_t(n) * row);
  for (int r = 0; r < n; ++r) quantize_row(type, w.data() + size_t(r) * k, q.data() + size_t(r) * row, k);
  std::memset(q.data() + 2, type == WeightType::q4_0 ? 0x88 : 0, block - 2);  // row 0, block 0: all zero weights
  if (k > 32) q[block + 2 + 7] = type == WeightType::q4_0 ? 0x00 : 0x80;     // row 0, block 1: the most negative
  const uint16_t subnormal = 0x0003;
  if (n > 1) std::memcpy(q.data() + row, &subnormal, 2);  // row 1, block 0
  return q;
}

const WeightType kQuantized[] = {WeightType::q8_0, WeightType::q4_0};

std::vector<float> activations(int m, int k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> a(size_t(m) * k);
  for (float& v : a) v = u(rng);
  for (int j = 0; j < 32 && m > 1; ++j) a[size_t(k) + j] = 0.0f;  // row 1, block 0: all zero
  return a;
}

TEST(Quant, EveryKernelSetsQuantizedProductIsItsReferenceBitForBit) {
  for (const WeightType type : kQuantized)
  for (const std::string& isa : cpu::supported_isas()) {
    const auto& kt = cpu::kernels_for(isa);
    // Tiles of 16 columns with partial last tiles (and halves of 8 under AVX2), rows kTileRows at a time
    // (8 AVX-512, 4 AVX2) and each count of rows left, more than one row block (64); a decode's row against
    // ranges of several whole tiles (AVX2 reads them as 2 or 3 streams side by side) and the tiles left (264
    // columns: 8 whole tiles a range, 2 left past three streams), and two rows.
    for (const auto& [m, n, k] : {std::tuple{1, 7, 32}, {1, 37, 96}, {3, 33, 64}, {17, 40, 320}, {5, 3, 4096},
                                  {130, 13, 64}, {8, 16, 32}, {23, 50, 128}, {15, 64, 64}, {6, 90, 160},
                                  {1, 200, 64}, {1, 264, 64}, {2, 150, 96}}) {
      SCOPED_TRACE(std::string(to_string(type)) + " " + isa + " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                   " k=" + std::to_string(k));
      const auto w = quantized_matrix(type, n, k, uint32_t(n + k));
      const auto a = activations(m, k, uint32_t(m * 7 + k));
      std::vector<float> want(size_t(m) * n), got(size_t(m) * n, -1.0f);
      matmul_quantized_reference(type, a.data(), w.data(), want.data(), m, n, k);
      std::vector<float> scales(size_t(m) * k / 32);
      std::vector<int8_t> q(size_t(m) * k);
      for (int r = 0; r < m; ++r)
        quantize_activations(a.data() + size_t(r) * k, k, scales.data() + size_t(r) * k / 32, q.data() + size_t(r) * k);
      std::vector<uint8_t> tiled(cpu::tiled_bytes(type, n, k), 0xee);
      const int tiles = (n + cpu::kTileCols - 1) / cpu::kTileCols;
      cpu::tile_quantized(type, w.data(), tiled.data(), n, k, 0, tiles / 2);  // in two parts, as two threads would
      cpu::tile_quantized(type, w.data(), tiled.data(), n, k, tiles / 2, tiles);
      // Two column ranges, split at a tile, as two threads would.
      const int split = std::min(n, tiles / 2 * cpu::kTileCols);
      kt.matmul_quantized(type, scales.data(), q.data(), tiled.data(), got.data(), m, n, k, 0, split);
      kt.matmul_quantized(type, scales.data(), q.data(), tiled.data(), got.data(), m, n, k, split, n);
      ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
      // The reference is a Q8_0 product at all: close to the float product of the dequantized weights.
      std::vector<float> deq(static_cast<size_t>(k));
      dequantize_row(type, w.data() + row_bytes(type, k) * size_t(n - 1), deq.data(), k);
      double exact = 0, scale = 0;
      for (int j = 0; j < k; ++j) exact += double(a[size_t(m - 1) * k + j]) * deq[size_t(j)], scale += std::fabs(a[size_t(m - 1) * k + j] * deq[size_t(j)]);
      EXPECT_NEAR(want[size_t(m - 1) * n + n - 1], exact, 0.02 * scale + 1e-6);
    }
  }
}

TEST(Quant, EveryKernelSetQuantizesActivationsAsTheRule) {
  // Random rows, an all-zero block, exact ties (q = n + 1/2 must round to
  // even), negative zero and a block whose largest magnitude is negative.
  const int k = 8 * 32;
  std::vector<float> a = activations(1, k, 11);
  for (int j = 0; j < 32; ++j) a[size_t(32 + j)] = 0.0f;
  for (int j = 0; j < 31; ++j) a[size_t(64 + j)] = (j % 2 ? -1.0f : 1.0f) * (float(j) + 0.5f);  // d = 1: q = a
  a[64 + 31] = 127.0f;
  a[96] = -0.0f;
  a[128] = -5.0f;
  std::vector<float> want_scales(k / 32);
  std::vector<int8_t> want(static_cast<size_t>(k));
  quantize_activations(a.data(), k, want_scales.data(), want.data());
  for (const std::string& isa : cpu::supported_isas()) {
    SCOPED_TRACE(isa);
    std::vector<float> scales(k / 32, -1.0f);
    std::vector<int8_t> q(static_cast<size_t>(k), 99);
    cpu::kernels_for(isa).quantize_q8(a.data(), k, scales.data(), q.data());
    EXPECT_EQ(std::memcmp(scales.data(), want_scales.data(), scales.size() * sizeof(float)), 0);
    EXPECT_EQ(q, want);
  }
  EXPECT_EQ(want[32], 0);
  EXPECT_EQ(want[64 + 2], 2);   // 2.5
  EXPECT_EQ(want[64 + 3], -4);  // -3.5
  EXPECT_EQ(want[128], -127);
}

// Through the backend (threads, its own activation scratch): the reference's
// bits, and a row's result does not depend on the other rows of the batch.
void expect_backend_product_is_batch_independent(WeightType type, const std::vector<uint8_t>& w, int m, int n,
                                                 int k, uint32_t seed) {
  SCOPED_TRACE(to_string(type));
  const auto a = activations(m, k, seed);
  auto b = make_cpu_backend();
  DeviceArray<float> da(*b), dc(*b, size_t(m) * n);
  da.upload(a.data(), a.size());
  // The backend's layout (tiles).
  DeviceArray<uint8_t> packed(*b, b->quantized_bytes(type, n, k));
  const void* weights = w.data();
  if (b->quantized_bytes(type, n, k) > 0) b->pack_quantized(type, w.data(), packed.get(), n, k), weights = packed.get();
  b->matmul_quantized(type, da.get(), weights, dc.get(), m, n, k);
  std::vector<float> all(size_t(m) * n), want(size_t(m) * n);
  dc.download(all.data(), all.size());
  matmul_quantized_reference(type, a.data(), w.data(), want.data(), m, n, k);
  EXPECT_EQ(std::memcmp(all.data(), want.data(), all.size() * sizeof(float)), 0);
  for (int r = 0; r < m; ++r) {
    DeviceArray<float> one(*b), out(*b, size_t(n));
    one.upload(a.data() + size_t(r) * k, size_t(k));
    b->matmul_quantized(type, one.get(), weights, out.get(), 1, n, k);
    std::vector<float> row(static_cast<size_t>(n));
    out.download(row.data(), row.size());
    ASSERT_EQ(std::memcmp(row.data(), all.data() + size_t(r) * n, row.size() * sizeof(float)), 0) << "row " << r;
  }
}

TEST(Quant, TheBackendsQuantizedProductDoesNotDependOnTheBatch) {
  for (const WeightType type : kQuantized)
    expect_backend_product_is_batch_independent(type, quantized_matrix(type, 300, 512, 11), 9, 300, 512, 12);
}

// bfloat16: the top half of a float, rounded to nearest even; NaN stays NaN.
TEST(Quant, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  uint32_t bits = 0x3f808000u;  // halfway between 0x3f80 and 0x3f81: to the even one
  float f;
  std::memcpy(&f, &bits, 4);
  EXPECT_EQ(float_to_bf16(f), 0x3f80);
  bits = 0x3f818000u;  // halfway between 0x3f81 and 0x3f82: to the even one
  std::memcpy(&f, &bits, 4);
  EXPECT_EQ(float_to_bf16(f), 0x3f82);
  bits = 0x3f808001u;  // above halfway
  std::memcpy(&f, &bits, 4);
  EXPECT_EQ(float_to_bf16(f), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_TRUE(std::isinf(bf16_to_float(float_to_bf16(3.4e38f))));  // rounds up past the largest bf16
  // Every bf16 value comes back exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float v = bf16_to_float(uint16_t(h));
    if (!std::isnan(v)) ASSERT_EQ(float_to_bf16(v), h) << h;
  }
}

// n x k weights in [-2, 2) from `rng` in a 16-bit `type`: the rows as a file
// stores them (narrow) and widened back to floats (wide). Weight 0 is a
// subnormal half, weight 1 beyond the largest half (inf in f16; one a row,
// so no product sums inf - inf).
struct Weights16 {
  std::vector<uint16_t> narrow;
  std::vector<float> wide;
};
Weights16 weights16(WeightType type, int n, int k, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  std::vector<float> w(size_t(n) * k);
  for (float& v : w) v = u(rng);
  w[0] = 3.0e-6f;
  w[1] = 70000.0f;
  Weights16 out{std::vector<uint16_t>(w.size()), std::vector<float>(w.size())};
  for (int r = 0; r < n; ++r) {
    auto* row = reinterpret_cast<uint8_t*>(out.narrow.data() + size_t(r) * k);
    quantize_row(type, w.data() + size_t(r) * k, row, k);
    dequantize_row(type, row, out.wide.data() + size_t(r) * k, k);
  }
  return out;
}

// The f16 / bf16 product of every kernel set is the f32 product of the
// widened weights, bit for bit (the same kernels' f32 path, itself checked
// against the fixed order in test_kernels), and a row's result does not
// depend on its batch or on how the columns are split.
TEST(Quant, EveryKernelSets16BitProductIsTheF32ProductOfTheWidenedWeights) {
  for (const WeightType type : {WeightType::f16, WeightType::bf16})
    for (const std::string& isa : cpu::supported_isas()) {
      const auto& kt = cpu::kernels_for(isa);
      const auto& generic = cpu::kernels_for("generic");
      for (const auto& [m, n, k] : {std::tuple{1, 7, 5}, {1, 50, 96}, {3, 33, 64}, {17, 40, 37}, {13, 16, 300}}) {
        SCOPED_TRACE(std::string(to_string(type)) + " " + isa + " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                     " k=" + std::to_string(k));
        std::mt19937 rng(uint32_t(m * 131 + n * 7 + k));
        std::uniform_real_distribution<float> u(-2.0f, 2.0f);
        std::vector<float> a(size_t(m) * k);
        for (float& v : a) v = u(rng);
        const auto [narrow, wide] = weights16(type, n, k, rng);
        std::vector<float> packed(cpu::packed_floats(n, k));
        cpu::pack_matrix(wide.data(), packed.data(), n, k);
        std::vector<uint16_t> packed16(cpu::packed_floats(n, k));
        cpu::pack_matrix16(narrow.data(), packed16.data(), n, k);
        const int panels = (n + cpu::kPanel - 1) / cpu::kPanel;
        std::vector<float> want(size_t(m) * n), got(size_t(m) * n, -1.0f);
        generic.matmul(a.data(), packed.data(), want.data(), m, n, k, 0, panels);
        kt.matmul16(type, a.data(), packed16.data(), got.data(), m, n, k, 0, panels / 2);
        kt.matmul16(type, a.data(), packed16.data(), got.data(), m, n, k, panels / 2, panels);
        ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
        for (int r = 0; r < m; ++r) {
          std::vector<float> one(static_cast<size_t>(n));
          kt.matmul16(type, a.data() + size_t(r) * k, packed16.data(), one.data(), 1, n, k, 0, panels);
          ASSERT_EQ(std::memcmp(one.data(), want.data() + size_t(r) * n, one.size() * sizeof(float)), 0) << "row " << r;
        }
      }
    }
}

// ---------------------------------------------------------------- K-quants

const WeightType kKQuants[] = {WeightType::q4_k, WeightType::q5_k, WeightType::q6_k};

// Rows of n x k (k a multiple of 256) in a K-quant type, from seeded values
// with the superblocks that test the edges: row 0's first all zero, row 1's
// first mostly zero with one outlier, row 2's first all positive.
std::vector<uint8_t> kquant_matrix(WeightType type, int n, int k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 0.05f);
  std::vector<float> w(size_t(n) * k);
  for (float& v : w) v = g(rng);
  for (int j = 0; j < 256; ++j) w[size_t(j)] = 0.0f;
  if (n > 1)
    for (int j = 0; j < 256; ++j) w[size_t(k) + j] = j == 77 ? 3.0f : (j % 5 ? 0.0f : g(rng));
  if (n > 2)
    for (int j = 0; j < 256; ++j) w[size_t(2) * k + j] = std::fabs(w[size_t(2) * k + j]);
  const size_t row = row_bytes(type, k);
  std::vector<uint8_t> q(size_t(n) * row);
  for (int r = 0; r < n; ++r) quantize_row(type, w.data() + size_t(r) * k, q.data() + size_t(r) * row, k);
  return q;
}

// Rows of m x k activations quantized per superblock (quantize_activations_k),
// as matmul_kquant reads them.
struct KActivations {
  std::vector<float> d;
  std::vector<int8_t> q;
  std::vector<int16_t> bsums;
  KActivations(const std::vector<float>& a, int m, int k)
      : d(size_t(m) * (k / kQK)), q(size_t(m) * k), bsums(size_t(m) * k / 16) {
    for (int r = 0; r < m; ++r)
      quantize_activations_k(a.data() + size_t(r) * k, k, d.data() + size_t(r) * (k / kQK), q.data() + size_t(r) * k,
                             bsums.data() + size_t(r) * k / 16);
  }
};

// The reference quantizers approximate: the error of the dequantized row
// falls with the bits (Q4_K > Q5_K > Q6_K) and stays small. (Their bytes
// equal ggml's quantize_row_q{4,5,6}_K_ref on 400 varied superblocks, in a
// one-off comparison against ggml built from source; README.)
TEST(KQuant, TheQuantizersApproximateTheirRowsBetterWithMoreBits) {
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 1.0f);
  const int k = 4096;
  std::vector<float> x(static_cast<size_t>(k)), back(static_cast<size_t>(k));
  for (float& v : x) v = g(rng);
  double norm = 0;
  for (float v : x) norm += double(v) * v;
  double last = 1.0;
  for (const WeightType type : kKQuants) {
    std::vector<uint8_t> q(row_bytes(type, k));
    quantize_row(type, x.data(), q.data(), k);
    dequantize_row(type, q.data(), back.data(), k);
    double err = 0;
    for (int j = 0; j < k; ++j) err += double(back[size_t(j)] - x[size_t(j)]) * (back[size_t(j)] - x[size_t(j)]);
    const double rel = std::sqrt(err / norm);
    std::cout << to_string(type) << ": relative rms error " << rel << "\n";
    EXPECT_LT(rel, last) << to_string(type);
    EXPECT_LT(rel, type == WeightType::q4_k ? 0.12 : type == WeightType::q5_k ? 0.06 : 0.03) << to_string(type);
    last = rel;
  }
  // An all-zero row stays zero; rows that are not whole superblocks are refused.
  std::vector<float> zeros(256, 0.0f);
  for (const WeightType type : kKQuants) {
    std::vector<uint8_t> q(row_bytes(type, 256), 0xff);
    quantize_row(type, zeros.data(), q.data(), 256);
    dequantize_row(type, q.data(), back.data(), 256);
    for (int j = 0; j < 256; ++j) ASSERT_EQ(back[size_t(j)], 0.0f) << to_string(type);
    EXPECT_THROW(quantize_row(type, zeros.data(), q.data(), 128), Error);
  }
}

// Q8_K activations as llama.cpp's quantize_row_q8_K_ref: the value of
// largest magnitude maps to -127, d carries its sign, the sums of 16.
TEST(KQuant, ActivationsQuantizeAsLlamaCppsQ8K) {
  std::vector<float> a(256);
  for (int j = 0; j < 256; ++j) a[size_t(j)] = float(j % 17) * 0.25f - 1.0f;
  a[40] = 6.0f;
  int8_t q[256];
  int16_t bsums[16];
  const float d = fixed::quantize_q8k_block(a.data(), q, bsums);
  EXPECT_EQ(q[40], -127);
  EXPECT_LT(d, 0.0f);
  EXPECT_FLOAT_EQ(d, 1.0f / (-127.0f / 6.0f));
  for (int g = 0; g < 16; ++g) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += q[16 * g + j];
    EXPECT_EQ(bsums[g], sum);
  }
  for (int j = 0; j < 256; ++j) EXPECT_NEAR(d * q[j], a[size_t(j)], std::fabs(d) * 0.5f + 1e-6f) << j;
}

TEST(KQuant, EveryKernelSetQuantizesActivationsAsTheRule) {
  // Random superblocks, an all-zero one, one whose largest magnitude comes
  // twice with both signs (the first decides d's sign), ties of rint.
  const int k = 5 * kQK;
  std::vector<float> a = activations(1, k, 13);
  for (int j = 0; j < kQK; ++j) a[size_t(kQK + j)] = 0.0f;
  a[2 * kQK + 7] = -9.0f;
  a[2 * kQK + 200] = 9.0f;
  for (int j = 0; j < kQK; ++j) a[size_t(3 * kQK + j)] = float(j % 64) - 31.5f;  // iscale * a: many halves
  a[3 * kQK + 5] = -127.0f;
  const int blocks = k / kQK;
  std::vector<float> want_d(static_cast<size_t>(blocks));
  std::vector<int8_t> want(static_cast<size_t>(k));
  std::vector<int16_t> want_sums(static_cast<size_t>(k / 16));
  quantize_activations_k(a.data(), k, want_d.data(), want.data(), want_sums.data());
  for (const std::string& isa : cpu::supported_isas()) {
    SCOPED_TRACE(isa);
    std::vector<float> d(static_cast<size_t>(blocks), -1.0f);
    std::vector<int8_t> q(static_cast<size_t>(k), 99);
    std::vector<int16_t> sums(static_cast<size_t>(k / 16), 999);
    cpu::kernels_for(isa).quantize_q8k(a.data(), k, d.data(), q.data(), sums.data());
    EXPECT_EQ(std::memcmp(d.data(), want_d.data(), d.size() * sizeof(float)), 0);
    EXPECT_EQ(q, want);
    EXPECT_EQ(sums, want_sums);
  }
  EXPECT_EQ(want_d[1], 0.0f);
  EXPECT_GT(want_d[2], 0.0f);  // -9 comes first: iscale = -127 / -9, d = 1 / iscale
  EXPECT_EQ(want[2 * kQK + 7], -127);
}

TEST(KQuant, EveryKernelSetsProductIsItsReferenceBitForBit) {
  for (const WeightType type : kKQuants)
    for (const std::string& isa : cpu::supported_isas()) {
      const auto& kt = cpu::kernels_for(isa);
      // One row (decode), a few, more than one row block (64); one and several superblocks; tiles of 16
      // columns with partial last tiles (AVX2: halves of 8), rows kKRows at a time and the rows left; a
      // decode's row against ranges of several whole tiles (AVX2: streams side by side) and the rest;
      // AVX2's rows from the tile three at a time, a pass per half, the second half partial (3 x 12, 9 x 25).
      for (const auto& [m, n, k] : {std::tuple{1, 7, 256}, {1, 33, 1024}, {3, 5, 512}, {17, 9, 768}, {70, 4, 256},
                                    {23, 37, 512}, {7, 48, 256}, {2, 20, 512}, {1, 200, 512}, {2, 150, 256},
                                    {3, 12, 256}, {9, 25, 512}}) {
        SCOPED_TRACE(std::string(to_string(type)) + " " + isa + " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                     " k=" + std::to_string(k));
        const auto w = kquant_matrix(type, n, k, uint32_t(n * 3 + k));
        auto a = activations(m, k, uint32_t(m * 5 + k));
        if (m > 2)
          for (int j = 0; j < 256; ++j) a[size_t(2) * k + j] = 0.0f;  // row 2, superblock 0: all zero
        std::vector<float> want(size_t(m) * n), got(size_t(m) * n, -1.0f);
        matmul_quantized_reference(type, a.data(), w.data(), want.data(), m, n, k);
        const KActivations qa(a, m, k);
        std::vector<uint8_t> tiled(cpu::tiled_bytes(type, n, k), 0xee);
        const int tiles = (n + cpu::kTileCols - 1) / cpu::kTileCols;
        cpu::tile_quantized(type, w.data(), tiled.data(), n, k, 0, tiles / 2);
        cpu::tile_quantized(type, w.data(), tiled.data(), n, k, tiles / 2, tiles);
        const int split = std::min(n, tiles / 2 * cpu::kTileCols);  // two column ranges, split at a tile
        kt.matmul_kquant(type, qa.d.data(), qa.q.data(), qa.bsums.data(), tiled.data(), got.data(), m, n, k, 0, split);
        kt.matmul_kquant(type, qa.d.data(), qa.q.data(), qa.bsums.data(), tiled.data(), got.data(), m, n, k, split, n);
        ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
        // The reference is the product at all: close to the float product of the dequantized weights.
        std::vector<float> deq(static_cast<size_t>(k));
        dequantize_row(type, w.data() + row_bytes(type, k) * size_t(n - 1), deq.data(), k);
        double exact = 0, scale = 0;
        for (int j = 0; j < k; ++j)
          exact += double(a[size_t(m - 1) * k + j]) * deq[size_t(j)], scale += std::fabs(a[size_t(m - 1) * k + j] * deq[size_t(j)]);
        EXPECT_NEAR(want[size_t(m - 1) * n + n - 1], exact, 0.02 * scale + 1e-6);
      }
    }
}

// The largest sums a K-quant kernel meets: every quant at its top (Q4_K 15,
// Q5_K 31, Q6_K 63 before the - 32), the largest scales (Q6_K: 127 and -128),
// against activations all at the largest magnitude (-127): the kernels that sum products
// in int16 before scaling them (AVX2's decode) must neither saturate nor
// wrap, on every kernel set and row count.
TEST(KQuant, TheLargestQuantsAgainstTheLargestActivationsSumExactly) {
  const int n = 16, k = 512;
  for (const WeightType type : kKQuants) {
    std::vector<uint8_t> w(size_t(n) * row_bytes(type, k), 0xff);
    const size_t block = block_bytes(type);
    for (size_t at = 0; at < w.size(); at += block) {
      uint8_t* b = w.data() + at;
      if (type == WeightType::q6_k) {
        for (int j = 0; j < 16; ++j) b[192 + j] = j % 2 ? 0x80 : 0x7f;  // scales 127, -128
        b[208] = 0x00, b[209] = 0x3c;                                  // d = 1.0
      } else {
        b[0] = 0x00, b[1] = 0x3c, b[2] = 0x00, b[3] = 0x00;  // d = 1.0, dmin = 0 (scales and mins 63)
      }
    }
    for (const int m : {1, 2, 3, 5}) {
      const std::vector<float> a(size_t(m) * k, 1.0f);  // all quantize to -127 (iscale = -127 / max)
      std::vector<float> want(size_t(m) * n);
      matmul_quantized_reference(type, a.data(), w.data(), want.data(), m, n, k);
      const KActivations qa(a, m, k);
      ASSERT_EQ(std::count(qa.q.begin(), qa.q.end(), int8_t(-127)), long(qa.q.size()));
      std::vector<uint8_t> tiled(cpu::tiled_bytes(type, n, k));
      cpu::tile_quantized(type, w.data(), tiled.data(), n, k, 0, 1);
      for (const std::string& isa : cpu::supported_isas()) {
        SCOPED_TRACE(std::string(to_string(type)) + " " + isa + " m=" + std::to_string(m));
        std::vector<float> got(size_t(m) * n, -1.0f);
        cpu::kernels_for(isa).matmul_kquant(type, qa.d.data(), qa.q.data(), qa.bsums.data(), tiled.data(), got.data(),
                                            m, n, k, 0, n);
        EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
      }
    }
  }
}

TEST(KQuant, TheBackendsProductDoesNotDependOnTheBatch) {
  for (const WeightType type : kKQuants)
    expect_backend_product_is_batch_independent(type, kquant_matrix(type, 300, 1024, 21), 9, 300, 1024, 22);
}

// A synthetic model whose rows are whole superblocks (dim 256, hidden 512)
// as llama.cpp's Q4_K_M mixture: the types per tensor and layer, prefill
// equal to stepwise decode, batched decode equal to single, and greedy
// tokens near the f32 model's.
class KQuantModel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    config_ = {256, 512, 4, 4, 2, 512, 128, true};
    const std::string dir = test::make_temp_dir("kquant-model");
    write_gguf(*random_weights(config_, 17), byte_vocabulary(512), "k", dir + "/f32.gguf");
    write_gguf(*random_weights(config_, 17), byte_vocabulary(512), "k", dir + "/q4_k_m.gguf", FileType::q4_k_m);
    write_gguf(*random_weights(config_, 17), byte_vocabulary(512), "k", dir + "/q5_k_m.gguf", FileType::q5_k_m);
    f32_ = Checkpoint::open(dir + "/f32.gguf");
    q4km_ = Checkpoint::open(dir + "/q4_k_m.gguf");
    q5km_ = Checkpoint::open(dir + "/q5_k_m.gguf");
  }
  static void TearDownTestSuite() { f32_.reset(), q4km_.reset(), q5km_.reset(); }
  // The types of a Q4_K_M or Q5_K_M file (`base`: Q4_K or Q5_K).
  static void expect_mixture(const Checkpoint& cp, WeightType base) {
    const Weights& w = cp.weights();
    EXPECT_EQ(w.token_embedding.type, WeightType::q6_k);  // shared with the classifier
    for (int l = 0; l < 4; ++l) {
      SCOPED_TRACE(l);
      const bool more = l >= 2;  // use_more_bits(l, 4): l >= 3, or (l - 0) % 3 == 2
      EXPECT_EQ(w.layers[size_t(l)].wv.type, more ? WeightType::q6_k : base);
      EXPECT_EQ(w.layers[size_t(l)].w2.type, more ? WeightType::q6_k : base);
      EXPECT_EQ(w.layers[size_t(l)].wq.type, base);
      EXPECT_EQ(w.layers[size_t(l)].w1.type, base);
    }
  }
  static void expect_prefill_equals_stepwise_and_batched_decode(std::shared_ptr<const Checkpoint> cp);
  static ModelConfig config_;
  static std::shared_ptr<const Checkpoint> f32_, q4km_, q5km_;
};
ModelConfig KQuantModel::config_;
std::shared_ptr<const Checkpoint> KQuantModel::f32_, KQuantModel::q4km_, KQuantModel::q5km_;

TEST_F(KQuantModel, MixesTypesAsLlamaCppsQ4KM) { expect_mixture(*q4km_, WeightType::q4_k); }
TEST_F(KQuantModel, MixesTypesAsLlamaCppsQ5KM) { expect_mixture(*q5km_, WeightType::q5_k); }

TEST_F(KQuantModel, PrefillEqualsStepwiseAndBatchedDecode) { expect_prefill_equals_stepwise_and_batched_decode(q4km_); }
TEST_F(KQuantModel, Q5KMPrefillEqualsStepwiseAndBatchedDecode) {
  expect_prefill_equals_stepwise_and_batched_decode(q5km_);
}

void KQuantModel::expect_prefill_equals_stepwise_and_batched_decode(std::shared_ptr<const Checkpoint> cp) {
  Engine engine(cp);
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311};
  const PrefillOutput prefilled = engine.prefill(prompt);
  KvPool pool = kv_pool_for(engine, 16, 8);
  std::vector<int> blocks = {3, 1}, other = {5, 6};
  std::vector<float> logits;
  for (size_t pos = 0; pos < prompt.size(); ++pos) {
    // The second sequence rides along in the same batch: the first's logits do not change.
    const auto both = engine.decode_step(pool, {DecodeSlot{prompt[pos], int(pos), &blocks},
                                               DecodeSlot{prompt[prompt.size() - 1 - pos], int(pos), &other}});
    logits.assign(both.begin(), both.begin() + long(both.size() / 2));
  }
  ASSERT_EQ(logits.size(), prefilled.logits.size());
  EXPECT_EQ(std::memcmp(logits.data(), prefilled.logits.data(), logits.size() * sizeof(float)), 0);
}

// A matrix is packed a slice of 1,024 rows at a time, the file's pages of
// each let go once copied (engine.cpp LayerMatrices::pack): a classifier of
// 1,300 rows whose rows from 1,024 on repeat rows 0..275 gives a token and
// its twin in the other slice the same logit, bit for bit, in every float
// type and Q8_0 (the last slice ends inside a panel of 16 rows).
class TwinClassifierRows : public WeightSource {
 public:
  explicit TwinClassifierRows(std::unique_ptr<WeightSource> inner) : inner_(std::move(inner)) {}
  const ModelConfig& config() const override { return inner_->config(); }
  void row(Tensor t, int layer, int64_t row, float* out) const override {
    inner_->row(t, layer, t == Tensor::wcls && row >= kSlice ? row - kSlice : row, out);
  }
  static constexpr int64_t kSlice = 1024;

 private:
  std::unique_ptr<WeightSource> inner_;
};

TEST(QuantModels, AClassifierPackedInSlicesKeepsEachRowInItsPlace) {
  const ModelConfig config{64, 96, 1, 4, 2, 1300, 32, false};
  const std::string dir = test::make_temp_dir("twin-rows");
  for (FileType type : {FileType::f32, FileType::f16, FileType::bf16, FileType::q8_0}) {
    SCOPED_TRACE(to_string(type));
    const std::string path = dir + "/" + to_string(type) + ".gguf";
    write_gguf(TwinClassifierRows(random_weights(config, 3)), byte_vocabulary(config.vocab_size), "twins", path, type);
    Engine engine(Checkpoint::open(path));
    const std::vector<float> logits = engine.prefill({1, 5, 9}).logits;
    ASSERT_EQ(logits.size(), size_t(config.vocab_size));
    size_t differ = 0;
    for (int r = int(TwinClassifierRows::kSlice); r < config.vocab_size; ++r)
      differ += std::memcmp(&logits[size_t(r)], &logits[size_t(r - TwinClassifierRows::kSlice)], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0u);
    EXPECT_NE(logits[0], logits[1]);  // (rows drawn apart: the twins' equality says something)
  }
}

TEST_F(KQuantModel, GreedyTokensFollowTheF32Model) {
  Engine a(f32_), b(q4km_);
  size_t agreed = 0, total = 0;
  for (const std::vector<int>& prompt : {std::vector<int>{1, 300, 301}, {1, 400, 20, 30}, {1, 5}, {1, 260, 261, 262, 263}}) {
    const auto want = generate(a, prompt, 40, SamplingParams{}).tokens;
    const auto got = generate(b, prompt, 40, SamplingParams{}).tokens;
    size_t same = 0;
    while (same < want.size() && same < got.size() && want[same] == got[same]) ++same;
    agreed += same;
    total += want.size();
  }
  std::cout << "q4_k_m (dim 256): " << agreed << " of " << total << " tokens agree with f32 before the first difference\n";
  EXPECT_GT(agreed, 0u);
}

// The shared model in a quantized type (write_gguf, ggml's reference
// quantizer), written once per type.
std::shared_ptr<const Checkpoint> quantized_model(WeightType type) {
  static std::map<WeightType, std::shared_ptr<const Checkpoint>> models;
  auto& cp = models[type];
  if (!cp) {
    const std::string out = test::make_temp_dir("quantized-model") + "/stories260K-" + to_string(type) + ".gguf";
    const auto f32 = Checkpoint::open(test::shared_model());
    write_gguf(*checkpoint_weights(f32), Tokenizer::load(test::shared_tokenizer(), f32->config().vocab_size).vocabulary(),
               "stories260K", out, *parse_file_type(to_string(type)));
    cp = Checkpoint::open(out);
  }
  return cp;
}

class QuantModel : public ::testing::TestWithParam<WeightType> {};

TEST_P(QuantModel, KeepsItsWeightsInTheirType) {
  const auto cp = quantized_model(GetParam());
  EXPECT_EQ(cp->weights().token_embedding.type, GetParam());
  EXPECT_EQ(cp->weights().layers[0].wq.type, GetParam());
  EXPECT_EQ(cp->weights().layers[4].w1.type, GetParam());
  // Rows of 172 (hidden) are no whole blocks: w2 stays f32, as ggml's quantizer leaves them.
  EXPECT_EQ(cp->weights().layers[0].w2.type, is_block_quantized(GetParam()) ? WeightType::f32 : GetParam());
  EXPECT_TRUE(cp->weights().wcls == cp->weights().token_embedding);
  EXPECT_NE(cp->weights().layers[0].rms_att, nullptr);
}

// Prefill rows run the same arithmetic as decode steps: logits agree bit for
// bit, under whichever kernel set runs (the ISA invariants rerun it).
TEST_P(QuantModel, PrefillEqualsStepwiseDecode) {
  Engine engine(quantized_model(GetParam()));
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312};
  const PrefillOutput prefilled = engine.prefill(prompt);
  const int block = 16;
  KvPool pool = kv_pool_for(engine, block, 4);
  std::vector<int> blocks = {3, 1};
  std::vector<float> logits;
  for (size_t pos = 0; pos < prompt.size(); ++pos)
    logits = engine.decode_step(pool, {DecodeSlot{prompt[pos], int(pos), &blocks}});
  ASSERT_EQ(logits.size(), prefilled.logits.size());
  EXPECT_EQ(std::memcmp(logits.data(), prefilled.logits.data(), logits.size() * sizeof(float)), 0);
}

// Greedy tokens of the quantized model against the F32 model's (the shared
// reference) over every reference case: how many agree before the first
// difference. Quantization changes the logits, so the share is a figure, not
// identity (on this 64-wide model, 2 blocks a row: Q8_0 34.2%, its weights
// alone dequantized into an F32 model 50.5%; Q4_0 5.1%, as llama.cpp's 5% on
// its own Q4_0 file in the peer tools' README; against llama.cpp on the same
// files, peer-match.sh: 360 of 360 tokens for both); printed for the README.
// A broken Q8_0 product (near 0%) fails.
TEST_P(QuantModel, GreedyTokensFollowTheF32Model) {
  Engine engine(quantized_model(GetParam()));
  size_t agreed = 0, total = 0;
  for (const auto& c : test::load_all_reference_cases()) {
    const GenerateResult r = generate(engine, c.prompt_tokens, c.max_new_tokens, SamplingParams{});
    size_t same = 0;
    while (same < r.tokens.size() && same < c.output_tokens.size() && r.tokens[same] == c.output_tokens[same]) ++same;
    agreed += same;
    total += c.output_tokens.size();
    // The same request twice: the same tokens (nothing carried over).
    EXPECT_EQ(generate(engine, c.prompt_tokens, c.max_new_tokens, SamplingParams{}).tokens, r.tokens);
  }
  std::cout << to_string(GetParam()) << " stories260K: " << agreed << " of " << total << " reference tokens ("
            << (100.0 * double(agreed) / double(total)) << "%) agree before the first difference\n";
  if (GetParam() == WeightType::q8_0) EXPECT_GT(double(agreed), 0.25 * double(total));
  if (GetParam() == WeightType::f16) EXPECT_GT(double(agreed), 0.9 * double(total));
}

// The peer tools' converter (../shared/tools/peer/llama2c-to-gguf.py --type
// q8_0 / q4_0, numpy; written by no one here) quantizes as ggml's reference
// does too: every tensor both files have holds the same bytes, and its file
// gives our tokens.
TEST_P(QuantModel, OurTensorsAreThoseOfThePeersConverter) {
  const std::string script = test::shared_dir() + "/tools/peer/llama2c-to-gguf.py";
  if (!std::filesystem::exists(script)) GTEST_SKIP() << script << " is not there";
  if (GetParam() == WeightType::bf16) GTEST_SKIP() << "the peer converter writes no bf16";
  if (test::run_command("/usr/bin/python3 -c 'import numpy' 2>/dev/null").second != 0)
    GTEST_SKIP() << "numpy (Debian python3-numpy) is not installed";
  const std::string type = to_string(GetParam());
  const std::string peer = test::make_temp_dir("peer-quantized") + "/peer-" + type + ".gguf";
  const auto [log, status] = test::run_command("/usr/bin/python3 " + test::shell_quoted(script) + " " +
                                               test::shell_quoted(test::shared_model()) + " " +
                                               test::shell_quoted(test::shared_tokenizer()) + " " + test::shell_quoted(peer) +
                                               " --type " + type + " --name stories260K 2>&1");
  ASSERT_EQ(status, 0) << log;
  const auto theirs = Checkpoint::open(peer);
  const auto ours = quantized_model(GetParam());
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
  };
  const auto their_bytes = read(peer), our_bytes = read(ours->path());
  const auto their_file = gguf::File::parse(their_bytes.data(), their_bytes.size(), peer);
  const auto our_file = gguf::File::parse(our_bytes.data(), our_bytes.size(), ours->path());
  const uint32_t ggml_type = uint32_t(gguf::tensor_type_of(GetParam()));
  int compared = 0, quantized = 0;
  for (const auto& t : our_file.tensors()) {
    const gguf::TensorInfo* u = their_file.tensor(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    EXPECT_EQ(u->type, t.type) << t.name;
    ASSERT_EQ(u->bytes, t.bytes) << t.name;
    EXPECT_EQ(std::memcmp(their_bytes.data() + u->offset, our_bytes.data() + t.offset, t.bytes), 0) << t.name;
    ++compared;
    quantized += t.type == ggml_type;
  }
  EXPECT_GT(quantized, 10);
  std::cout << compared << " tensors compared, " << quantized << " of them " << type << "\n";
  Engine a(ours), b(theirs);
  const auto c = test::load_all_reference_cases().front();
  EXPECT_EQ(generate(a, c.prompt_tokens, c.max_new_tokens, SamplingParams{}).tokens,
            generate(b, c.prompt_tokens, c.max_new_tokens, SamplingParams{}).tokens);
}

// A 16-bit float model computes what the f32 model of the values it holds
// computes, bit for bit (the f32 rule on widened weights): against a
// GGUF of the shared model's weights rounded to that type but stored as f32.
class Float16Model : public ::testing::TestWithParam<WeightType> {};

TEST_P(Float16Model, IsTheF32ModelOfItsValues) {
  // The shared model with each matrix value rounded to the type, as floats.
  class Rounded final : public WeightSource {
   public:
    Rounded(std::unique_ptr<WeightSource> inner, WeightType type) : inner_(std::move(inner)), type_(type) {}
    const ModelConfig& config() const override { return inner_->config(); }
    void row(Tensor t, int layer, int64_t r, float* out) const override {
      inner_->row(t, layer, r, out);
      if (!is_matrix(t)) return;
      const int cols = int(shape_of(t, config()).cols);
      std::vector<uint8_t> packed(row_bytes(type_, cols));
      quantize_row(type_, out, packed.data(), cols);
      dequantize_row(type_, packed.data(), out, cols);
    }

   private:
    std::unique_ptr<WeightSource> inner_;
    WeightType type_;
  };
  const auto f32 = Checkpoint::open(test::shared_model());
  const std::string out = test::make_temp_dir("rounded-model") + "/rounded-" + to_string(GetParam()) + ".gguf";
  write_gguf(Rounded(checkpoint_weights(f32), GetParam()),
             Tokenizer::load(test::shared_tokenizer(), f32->config().vocab_size).vocabulary(), "rounded", out);
  Engine wide(Checkpoint::open(out)), narrow(quantized_model(GetParam()));
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 300, 301, 302, 303};
  const PrefillOutput a = wide.prefill(prompt), b = narrow.prefill(prompt);
  ASSERT_EQ(a.logits.size(), b.logits.size());
  EXPECT_EQ(std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float)), 0);
  for (const auto& c : test::load_all_reference_cases())
    EXPECT_EQ(generate(wide, c.prompt_tokens, c.max_new_tokens, SamplingParams{}).tokens,
              generate(narrow, c.prompt_tokens, c.max_new_tokens, SamplingParams{}).tokens);
}

INSTANTIATE_TEST_SUITE_P(Types, Float16Model, ::testing::Values(WeightType::f16, WeightType::bf16),
                         [](const auto& info) { return std::string(to_string(info.param)); });
INSTANTIATE_TEST_SUITE_P(Types, QuantModel,
                         ::testing::Values(WeightType::f16, WeightType::bf16, WeightType::q8_0, WeightType::q4_0),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// The CUDA backend's quantized products and table rows (GPU machines only):
// the reference's bits for every quantized type, rows as the file stores them.
TEST(CudaVersusCpu, QuantizedProductsAndTableRowsAreTheReferences) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  auto cuda = make_backend("cuda");
  const int m = 5, n = 37, k = 512;
  for (const WeightType type : {WeightType::q8_0, WeightType::q4_0, WeightType::q4_k, WeightType::q5_k, WeightType::q6_k}) {
    SCOPED_TRACE(to_string(type));
    const auto w = is_k_quant(type) ? kquant_matrix(type, n, k, 31) : quantized_matrix(type, n, k, 31);
    const auto a = activations(m, k, 32);
    std::vector<float> want(size_t(m) * n), got(size_t(m) * n);
    matmul_quantized_reference(type, a.data(), w.data(), want.data(), m, n, k);
    DeviceArray<uint8_t> dw(*cuda, cuda->quantized_bytes(type, n, k));
    cuda->pack_quantized(type, w.data(), dw.get(), n, k);
    DeviceArray<float> da(*cuda), dc(*cuda, got.size());
    da.upload(a.data(), a.size());
    cuda->matmul_quantized(type, da.get(), dw.get(), dc.get(), m, n, k);
    dc.download(got.data(), got.size());
    EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
    const std::vector<int> tokens = {3, 0, n - 1};
    std::vector<float> rows(tokens.size() * k), want_rows(tokens.size() * k);
    for (size_t r = 0; r < tokens.size(); ++r)
      dequantize_row(type, w.data() + size_t(tokens[r]) * row_bytes(type, k), want_rows.data() + r * k, k);
    DeviceArray<int> dt(*cuda, tokens.size());
    dt.upload(tokens.data(), tokens.size());
    DeviceArray<float> dr(*cuda, rows.size());
    cuda->embedding_quantized(type, dw.get(), dt.get(), dr.get(), int(tokens.size()), k);
    dr.download(rows.data(), rows.size());
    EXPECT_EQ(std::memcmp(rows.data(), want_rows.data(), rows.size() * sizeof(float)), 0);
  }
}

// The CUDA backend's 16-bit products (GPU machines only): the CPU backend's
// bits, row-major F16 and BF16 weights widened as they are staged; a
// decode's rows (its kernel of 16-row tiles) and a prefill's (64-row tiles),
// sizes that leave partial tiles of k and of columns; a subnormal half and an
// infinite F16 among the weights.
TEST(CudaVersusCpu, SixteenBitProductsAreTheCpus) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  auto cuda = make_backend("cuda");
  auto cpu = make_cpu_backend();
  const int n = 77, k = 100;
  for (const WeightType type : {WeightType::f16, WeightType::bf16})
    for (const int m : {1, 5, 70}) {
      SCOPED_TRACE(std::string(to_string(type)) + " m=" + std::to_string(m));
      std::mt19937 rng(uint32_t(m * 31 + int(type)));
      const auto [narrow, wide] = weights16(type, n, k, rng);
      const auto a = activations(m, k, 33);
      std::vector<float> want(size_t(m) * n), got(size_t(m) * n, -1.0f);
      {
        DeviceArray<float> pw(*cpu, cpu->packed_floats(n, k)), da(*cpu), dc(*cpu, want.size());
        cpu->pack_matrix(wide.data(), pw.get(), n, k);
        da.upload(a.data(), a.size());
        cpu->matmul(da.get(), pw.get(), dc.get(), m, n, k);
        dc.download(want.data(), want.size());
      }
      DeviceArray<uint16_t> pw(*cuda, cuda->packed_floats(n, k));
      cuda->pack_matrix16(narrow.data(), pw.get(), n, k);
      DeviceArray<float> da(*cuda), dc(*cuda, got.size());
      da.upload(a.data(), a.size());
      cuda->matmul16(type, da.get(), pw.get(), dc.get(), m, n, k);
      dc.download(got.data(), got.size());
      EXPECT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
    }
}

// Resident bytes of this process's mappings of `path` (/proc/self/smaps).
size_t resident_bytes_of_mapping(const std::string& path) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  size_t kb = 0;
  while (std::getline(smaps, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) && line.find('-') < line.find(' '))
      inside = line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0;
    else if (inside && line.rfind("Rss:", 0) == 0)
      kb += std::stoul(line.substr(4));
  }
  return kb * 1024;
}

// The matrices are copied into the kernels' tiles or panels and the file's
// pages released as they go: after the load, the process holds (almost)
// none of the file, so the model is resident once (not as file + copy; the
// embedding's rows are read from the file as tokens ask for them). (That it
// holds one slice at a time while loading, not a whole matrix, is measured
// by bench_compute --model: peak_rss_over_file.)
TEST(QuantModelMemory, ALoadedModelKeepsNoneOfItsFilesPages) {
  const ModelConfig config{256, 1024, 4, 4, 4, 8192, 128, true};
  const std::string dir = test::make_temp_dir("quant-memory");
  for (const FileType type : {FileType::q4_0, FileType::q8_0, FileType::q4_k_m, FileType::f16, FileType::f32}) {
    SCOPED_TRACE(to_string(type));
    const std::string path = dir + "/" + to_string(type) + ".gguf";
    write_gguf(*random_weights(config, 5), byte_vocabulary(8192), "m", path, type);
    const size_t file = std::filesystem::file_size(path);
    auto checkpoint = Checkpoint::open(path);
    // Reading every weight makes the file resident (what an engine that kept the mapping would hold).
    uint64_t sum = 0;
    for (const Matrix* m : {&checkpoint->weights().token_embedding, &checkpoint->weights().layers[3].w2})
      for (size_t at = 0; at < 4096; ++at) sum += static_cast<const uint8_t*>(m->data)[at];
    EXPECT_GT(resident_bytes_of_mapping(path), 0u) << sum;
    Engine engine(checkpoint);
    const size_t resident = resident_bytes_of_mapping(path);
    EXPECT_LT(resident, file / 20) << resident << " of " << file << " bytes of the file still resident";
    (void)engine.prefill({1, 5, 9});  // and it computes from the copy
  }
}

}  // namespace
}  // namespace disagg::gpu
