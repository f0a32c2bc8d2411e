// Every backend operation against a naive reference written here. The suite
// runs for each backend: the CPU one with each kernel set this CPU runs
// (generic, avx2, avx512; the others are skipped with a message), and "cuda"
// (skipped on machines without a GPU). The fixed-order operations
// (gpu/fixed_math.h) are also compared bit for bit with a scalar reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/backend.h"
#include "gpu/cpu/cpu_kernels.h"
#include "gpu/error.h"
#include "gpu/fixed_math.h"

namespace disagg::gpu {
namespace {

std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void expect_near_all(const std::vector<float>& actual, const std::vector<float>& expected, float tol,
                     const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    ASSERT_NEAR(actual[i], expected[i], tol * std::max(1.0f, std::fabs(expected[i])))
        << what << " differs at index " << i;
  }
}

// The pool's layout, written out here as gpu/kv_layout.h defines it: one
// plane per (layer, K or V) holding that part of every block in block order;
// K of a block in tiles of 16 positions ([tile][kv_dim][16]), V as
// [position][kv_dim]. block_size is a multiple of 16.
struct PoolGeometry {
  int n_layers, block_size, kv_dim;
  int num_blocks = 1;
  size_t floats() const { return size_t(n_layers) * 2 * num_blocks * block_size * kv_dim; }
  // kv: 0 for K, 1 for V.
  size_t index(const std::vector<int>& table, int layer, int kv, int pos, int e) const {
    const size_t block = size_t(table[pos / block_size]);
    const size_t region = ((size_t(layer) * 2 + kv) * num_blocks + block) * block_size * kv_dim;
    const int p = pos % block_size;
    if (kv == 0) return region + (size_t(p / 16) * kv_dim + e) * 16 + p % 16;
    return region + size_t(p) * kv_dim + e;
  }
};

bool cpu_runs(const std::string& isa) {
  const auto isas = cpu::supported_isas();
  return std::find(isas.begin(), isas.end(), isa) != isas.end();
}

// "cpu-<isa>" or "cuda"; nullptr when this machine cannot run it.
std::unique_ptr<Backend> backend_named(const std::string& name) {
  if (name == "cuda") return cuda_device_count() > 0 ? make_backend("cuda") : nullptr;
  const std::string isa = name.substr(4);
  return cpu_runs(isa) ? make_cpu_backend(isa) : nullptr;
}

// The matrix rule of fixed_math.h on a row-major W: per element, k in order,
// one fma per term, from 0.
std::vector<float> fixed_order_matmul(const std::vector<float>& a, const std::vector<float>& w, int m, int n,
                                      int k) {
  std::vector<float> c(size_t(m) * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (int l = 0; l < k; ++l) acc = std::fma(a[size_t(i) * k + l], w[size_t(j) * k + l], acc);
      c[size_t(i) * n + j] = acc;
    }
  return c;
}

class KernelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    backend_ = backend_named(GetParam());
    if (!backend_) GTEST_SKIP() << GetParam() << ": this machine cannot run it";
  }

  // W (n x k, row-major) in the backend's matmul layout.
  DeviceArray<float> packed(const std::vector<float>& w, int n, int k) {
    DeviceArray<float> a(*backend_, backend_->packed_floats(n, k));
    backend_->pack_matrix(w.data(), a.get(), n, k);
    return a;
  }

  template <class T>
  DeviceArray<T> to_device(const std::vector<T>& host) {
    DeviceArray<T> a(*backend_, host.size());
    a.upload(host.data(), host.size());
    return a;
  }
  template <class T>
  std::vector<T> to_host(const DeviceArray<T>& a, size_t n) {
    std::vector<T> host(n);
    a.download(host.data(), n);
    return host;
  }

  // The attention operation on a pool filled with random values, against the
  // naive formula over each row's logical positions.
  void check_attention(int n_heads, int n_kv_heads, int head_size, const PoolGeometry& g, int num_blocks,
                       const std::vector<std::vector<int>>& tables, const std::vector<int>& positions, int layer,
                       int table_stride_override = -1);

  std::unique_ptr<Backend> backend_;
};

TEST_P(KernelTest, MatmulComputesXTimesWTransposedInTheFixedOrder) {
  // Row counts over every block tail of the kernels (1..30), column counts
  // that are and are not multiples of a panel, and one case large enough to
  // run on several threads.
  std::vector<std::tuple<int, int, int>> sizes = {{1, 7, 13}, {5, 7, 13}, {9, 33, 64}, {64, 512, 288}};
  for (int m = 1; m <= 30; ++m) sizes.emplace_back(m, 37, 21);
  for (auto [m, n, k] : sizes) {
    const auto a = random_floats(size_t(m) * k, 1);
    const auto w = random_floats(size_t(n) * k, 2);
    std::vector<float> expected(size_t(m) * n);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double s = 0;
        for (int l = 0; l < k; ++l) s += double(a[i * k + l]) * w[j * k + l];
        expected[i * n + j] = float(s);
      }
    auto da = to_device(a);
    auto dw = packed(w, n, k);
    DeviceArray<float> dc(*backend_, expected.size());
    backend_->matmul(da.get(), dw.get(), dc.get(), m, n, k);
    const std::string what = "matmul " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k);
    const auto got = to_host(dc, expected.size());
    expect_near_all(got, expected, 1e-5f, what);
    EXPECT_EQ(got, fixed_order_matmul(a, w, m, n, k)) << what << ": not the fixed summation order";
  }
}

TEST_P(KernelTest, MatmulRowsDoNotDependOnTheBatch) {
  // Each row alone equals the same row inside batches of every size up to 70.
  const int n = 100, k = 96, max_m = 70;
  const auto a = random_floats(size_t(max_m) * k, 16);
  const auto w = random_floats(size_t(n) * k, 17);
  auto dw = packed(w, n, k);
  auto da = to_device(a);
  DeviceArray<float> dc(*backend_, size_t(max_m) * n);
  std::vector<std::vector<float>> alone(max_m);
  for (int i = 0; i < max_m; ++i) {
    backend_->matmul(da.get() + size_t(i) * k, dw.get(), dc.get(), 1, n, k);
    alone[i] = to_host(dc, n);
  }
  for (int m = 2; m <= max_m; ++m) {
    backend_->matmul(da.get(), dw.get(), dc.get(), m, n, k);
    const auto batch = to_host(dc, size_t(m) * n);
    for (int i = 0; i < m; ++i)
      ASSERT_TRUE(std::equal(alone[i].begin(), alone[i].end(), batch.begin() + size_t(i) * n))
          << "row " << i << " differs in a batch of " << m;
  }
}

TEST_P(KernelTest, EmbeddingCopiesTableRows) {
  const int vocab = 11, dim = 6;
  const auto table = random_floats(size_t(vocab) * dim, 3);
  const std::vector<int> tokens = {4, 0, 10, 4};
  auto dt = to_device(table);
  auto dtok = to_device(tokens);
  DeviceArray<float> out(*backend_, tokens.size() * dim);
  backend_->embedding(dt.get(), dtok.get(), out.get(), int(tokens.size()), dim);
  std::vector<float> expected;
  for (int t : tokens) expected.insert(expected.end(), table.begin() + t * dim, table.begin() + (t + 1) * dim);
  EXPECT_EQ(to_host(out, expected.size()), expected);
}

// Sizes: a small case (the CPU backend runs it serially) and a large one, over
// 2^18 operations (the CPU backend then runs it under OpenMP).
TEST_P(KernelTest, RmsNormNormalisesEachRow) {
  for (const int rows : {3, 1500}) {
    const int dim = 64;
    const auto x = random_floats(size_t(rows) * dim, 4, 3.0f);
    const auto w = random_floats(dim, 5);
    std::vector<float> expected(x.size());
    for (int r = 0; r < rows; ++r) {
      double ss = 0;
      for (int j = 0; j < dim; ++j) ss += double(x[r * dim + j]) * x[r * dim + j];
      const double scale = 1.0 / std::sqrt(ss / dim + 1e-5);
      for (int j = 0; j < dim; ++j) expected[r * dim + j] = float(w[j] * x[r * dim + j] * scale);
    }
    auto dx = to_device(x), dw = to_device(w);
    DeviceArray<float> out(*backend_, x.size());
    backend_->rmsnorm(dx.get(), dw.get(), out.get(), rows, dim, 1e-5f);
    expect_near_all(to_host(out, x.size()), expected, 1e-5f, "rmsnorm");
    backend_->rmsnorm(dx.get(), dw.get(), dx.get(), rows, dim, 1e-5f);  // in place, as the final norm runs
    expect_near_all(to_host(dx, x.size()), expected, 1e-5f, "rmsnorm in place");
  }
}

// Llama's RoPE turns adjacent pairs (2i, 2i+1); NeoX's (Qwen2) pairs i with
// i + head_size/2. The same table (pair i's angle) for both.
TEST_P(KernelTest, RopeRotatesPairsPerHeadAtEachRowsPosition) {
  std::vector<int> many_positions(700);
  for (int i = 0; i < 700; ++i) many_positions[i] = (i * 7) % 512;
  for (const bool neox : {false, true})
  for (const std::vector<int>& positions : {std::vector<int>{0, 5, 17, 511}, many_positions}) {
    const int n_heads = 3, head_size = 8, half = head_size / 2;
    const int rows = int(positions.size()), width = n_heads * head_size;
    const auto x = random_floats(size_t(rows) * width, 6);
    std::vector<float> expected = x;
    for (int r = 0; r < rows; ++r)
      for (int h = 0; h < n_heads; ++h)
        for (int i = 0; i < half; ++i) {
          const double angle = positions[r] * std::pow(10000.0, -2.0 * i / head_size);
          const size_t head = size_t(r) * width + h * head_size;
          const size_t a = neox ? head + i : head + 2 * i, b = neox ? head + i + half : head + 2 * i + 1;
          expected[a] = float(x[a] * std::cos(angle) - x[b] * std::sin(angle));
          expected[b] = float(x[a] * std::sin(angle) + x[b] * std::cos(angle));
        }
    std::vector<float> table(size_t(512) * half * 2);  // as the engine builds it
    for (int pos = 0; pos < 512; ++pos)
      for (int i = 0; i < half; ++i) {
        const float angle = float(pos) * (1.0f / powf(10000.0f, float(2 * i) / float(head_size)));
        table[(size_t(pos) * half + i) * 2] = cosf(angle);
        table[(size_t(pos) * half + i) * 2 + 1] = sinf(angle);
      }
    auto dx = to_device(x);
    auto dpos = to_device(positions);
    auto dtable = to_device(table);
    backend_->rope(dx.get(), dpos.get(), dtable.get(), rows, n_heads, head_size, neox);
    // float32 angles at position 511 carry ~1e-4 absolute error.
    expect_near_all(to_host(dx, x.size()), expected, 2e-4f, neox ? "rope (neox)" : "rope");
    // Position 0 is the identity.
    for (int j = 0; j < width; ++j) EXPECT_EQ(to_host(dx, x.size())[j], x[j]);
  }
}

TEST_P(KernelTest, AddBiasAddsTheVectorToEveryRow) {
  const int rows = 37, n = 48;
  const auto x = random_floats(size_t(rows) * n, 21), bias = random_floats(n, 22);
  auto dx = to_device(x);
  auto db = to_device(bias);
  backend_->add_bias(dx.get(), db.get(), rows, n);
  const std::vector<float> got = to_host(dx, x.size());
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < n; ++j) ASSERT_EQ(got[size_t(r) * n + j], x[size_t(r) * n + j] + bias[size_t(j)]) << r << "," << j;
}

TEST_P(KernelTest, SwigluAndAdd) {
  for (const size_t n : {size_t(1000), size_t(300000)}) {
    const auto gate = random_floats(n, 7, 6.0f);
    const auto up = random_floats(n, 8);
    std::vector<float> expected(n), sum(n);
    for (size_t i = 0; i < n; ++i) {
      expected[i] = float(gate[i] / (1.0 + std::exp(-double(gate[i]))) * up[i]);
      sum[i] = gate[i] + up[i];
    }
    auto dg = to_device(gate), du = to_device(up);
    backend_->swiglu(dg.get(), du.get(), n);
    const auto got = to_host(dg, n);
    expect_near_all(got, expected, 1e-5f, "swiglu");
    for (size_t i = 0; i < n; ++i)
      ASSERT_EQ(got[i], fixed::swiglu(gate[i], up[i])) << "swiglu is not fixed::swiglu at " << i;

    auto dx = to_device(gate);
    backend_->add(dx.get(), du.get(), n);
    expect_near_all(to_host(dx, n), sum, 1e-6f, "add");
  }
}

TEST_P(KernelTest, KvWriteStoresEachRowInItsOwnBlocks) {
  const PoolGeometry g{2, 16, 6, 5};
  const float sentinel = -7.0f;
  std::vector<float> pool(g.floats(), sentinel);
  // Row 0 at position 19 (its second block: 4), row 1 at position 0 (block 2).
  const std::vector<std::vector<int>> tables = {{1, 4}, {2, 0}};
  const std::vector<int> positions = {19, 0};
  const auto k = random_floats(2 * size_t(g.kv_dim), 9), v = random_floats(2 * size_t(g.kv_dim), 10);

  auto dpool = to_device(pool);
  auto dtables = to_device(std::vector<int>{1, 4, 2, 0});
  auto dpos = to_device(positions);
  auto dk = to_device(k), dv = to_device(v);
  PagedKv kv{dpool.get(), g.block_size, g.num_blocks, g.kv_dim, dtables.get(), 2};
  const int layer = 1;
  backend_->kv_write(kv, layer, dk.get(), dv.get(), dpos.get(), 2);

  std::vector<float> expected = pool;
  for (int r = 0; r < 2; ++r)
    for (int e = 0; e < g.kv_dim; ++e) {
      expected[g.index(tables[r], layer, 0, positions[r], e)] = k[r * g.kv_dim + e];
      expected[g.index(tables[r], layer, 1, positions[r], e)] = v[r * g.kv_dim + e];
    }
  EXPECT_EQ(to_host(dpool, pool.size()), expected);
}

TEST_P(KernelTest, KvWriteFillsAContiguousCache) {
  // The prefill case: n rows at positions 0..n-1 into one block of n positions
  // rounded up to whole tiles; the padding is left as it was.
  const int n = 1100, padded = 1104;
  const PoolGeometry g{2, padded, 128};
  std::vector<int> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = i;
  const auto k = random_floats(size_t(n) * g.kv_dim, 14), v = random_floats(size_t(n) * g.kv_dim, 15);
  const std::vector<float> before(g.floats(), -3.0f);
  auto dcache = to_device(before);
  auto dtable = to_device(std::vector<int>{0});
  auto dpos = to_device(positions);
  auto dk = to_device(k), dv = to_device(v);
  PagedKv kv{dcache.get(), padded, 1, g.kv_dim, dtable.get(), 0};
  for (int layer = 0; layer < g.n_layers; ++layer) backend_->kv_write(kv, layer, dk.get(), dv.get(), dpos.get(), n);
  std::vector<float> expected = before;
  for (int layer = 0; layer < g.n_layers; ++layer)
    for (int p = 0; p < n; ++p)
      for (int e = 0; e < g.kv_dim; ++e) {
        expected[g.index({0}, layer, 0, p, e)] = k[size_t(p) * g.kv_dim + e];
        expected[g.index({0}, layer, 1, p, e)] = v[size_t(p) * g.kv_dim + e];
      }
  EXPECT_EQ(to_host(dcache, expected.size()), expected);
}

void KernelTest::check_attention(int n_heads, int n_kv_heads, int head_size, const PoolGeometry& g, int num_blocks,
                                 const std::vector<std::vector<int>>& tables, const std::vector<int>& positions,
                                 int layer, int table_stride_override) {
  const int rows = int(positions.size());
  const int q_width = n_heads * head_size;
  PoolGeometry pg = g;
  pg.num_blocks = num_blocks;
  const auto pool = random_floats(pg.floats(), 11);
  const auto q = random_floats(size_t(rows) * q_width, 12);
  const int group = n_heads / n_kv_heads;

  std::vector<float> expected(size_t(rows) * q_width, 0.0f);
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < n_heads; ++h) {
      const int kvh = h / group;
      const int ctx = positions[r] + 1;
      std::vector<double> scores(ctx);
      for (int t = 0; t < ctx; ++t) {
        double s = 0;
        for (int e = 0; e < head_size; ++e)
          s += double(q[r * q_width + h * head_size + e]) * pool[pg.index(tables[r], layer, 0, t, kvh * head_size + e)];
        scores[t] = s / std::sqrt(double(head_size));
      }
      const double mx = *std::max_element(scores.begin(), scores.end());
      double total = 0;
      for (double& s : scores) total += (s = std::exp(s - mx));
      for (int e = 0; e < head_size; ++e) {
        double acc = 0;
        for (int t = 0; t < ctx; ++t)
          acc += scores[t] / total * pool[pg.index(tables[r], layer, 1, t, kvh * head_size + e)];
        expected[r * q_width + h * head_size + e] = float(acc);
      }
    }

  const int table_width = int(tables[0].size());
  std::vector<int> flat;
  for (const auto& t : tables) flat.insert(flat.end(), t.begin(), t.end());
  auto dpool = to_device(pool);
  auto dq = to_device(q);
  auto dtables = to_device(flat);
  auto dpos = to_device(positions);
  DeviceArray<float> out(*backend_, expected.size());
  const int stride = table_stride_override >= 0 ? table_stride_override : table_width;
  PagedKv kv{dpool.get(), g.block_size, num_blocks, g.kv_dim, dtables.get(), stride};
  backend_->attention(dq.get(), out.get(), kv, layer, dpos.get(), rows, n_heads, n_kv_heads, head_size);
  expect_near_all(to_host(out, expected.size()), expected, 1e-5f, "attention");
}

TEST_P(KernelTest, AttentionOverPagedBlocksWithGroupedQueryHeads) {
  // 4 query heads share 2 kv heads; rows of different lengths in scattered blocks.
  const int n_heads = 4, n_kv_heads = 2, head_size = 4;
  const PoolGeometry g{2, 16, n_kv_heads * head_size};
  const std::vector<std::vector<int>> tables = {{6, 0, 0}, {3, 5, 1}, {2, 4, 7}};
  const std::vector<int> positions = {0, 20, 40};
  check_attention(n_heads, n_kv_heads, head_size, g, 8, tables, positions, 1);
}

TEST_P(KernelTest, AttentionOverLongPagedContexts) {
  const int n_heads = 8, n_kv_heads = 4, head_size = 16;
  const PoolGeometry g{1, 16, n_kv_heads * head_size};
  std::vector<std::vector<int>> tables(3);
  for (int i = 0; i < 20; ++i) {  // 60 blocks dealt to 3 rows in turn
    tables[0].push_back(3 * i);
    tables[1].push_back(3 * i + 1);
    tables[2].push_back(3 * i + 2);
  }
  check_attention(n_heads, n_kv_heads, head_size, g, 60, tables, {300, 3, 257}, 0);
}

TEST_P(KernelTest, AttentionIsCausalOverAContiguousCache) {
  // The prefill case: one block of all positions, shared by every row (stride 0);
  // row r must ignore positions after r.
  const int n_heads = 2, n_kv_heads = 2, head_size = 8, n = 6;
  const PoolGeometry g{3, 16, n_kv_heads * head_size};
  std::vector<int> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = i;
  // The naive side reads every row through table {0}; the backend gets it once.
  check_attention(n_heads, n_kv_heads, head_size, g, 1, std::vector<std::vector<int>>(n, {0}), positions, 2,
                  /*table_stride_override=*/0);
}

TEST_P(KernelTest, AttentionOfAPrefillRowEqualsTheDecodeStepAtItsPosition) {
  // A 150-position prompt in a contiguous cache (all rows at once, one shared
  // table), then each position alone as a decode step over a paged copy of the
  // same K/V (blocks of 16, scattered): bit for bit the same output.
  const int n_heads = 4, n_kv_heads = 2, head_size = 24, n = 150, padded = 160, layers = 2, layer = 1;
  const int kv_dim = n_kv_heads * head_size, width = n_heads * head_size;
  const PoolGeometry contiguous{layers, padded, kv_dim};
  const auto cache = random_floats(contiguous.floats(), 18);
  const auto q = random_floats(size_t(n) * width, 19);
  std::vector<int> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = i;
  auto dcache = to_device(cache);
  auto dq = to_device(q);
  auto dpos = to_device(positions);
  auto dzero = to_device(std::vector<int>{0});
  DeviceArray<float> prefill_out(*backend_, size_t(n) * width);
  backend_->attention(dq.get(), prefill_out.get(), PagedKv{dcache.get(), padded, 1, kv_dim, dzero.get(), 0},
                      layer, dpos.get(), n, n_heads, n_kv_heads, head_size);
  const auto prefill = to_host(prefill_out, size_t(n) * width);

  const int blocks = padded / 16;
  const PoolGeometry paged{layers, 16, kv_dim, blocks};
  std::vector<int> table(blocks);
  for (int i = 0; i < blocks; ++i) table[i] = (i * 7) % blocks;  // 7 and 10 coprime: a permutation
  std::vector<float> pool(paged.floats());
  for (int l = 0; l < layers; ++l)
    for (int kvk = 0; kvk < 2; ++kvk)
      for (int p = 0; p < n; ++p)
        for (int e = 0; e < kv_dim; ++e)
          pool[paged.index(table, l, kvk, p, e)] = cache[contiguous.index({0}, l, kvk, p, e)];
  auto dpool = to_device(pool);
  auto dtable = to_device(table);
  DeviceArray<float> step_out(*backend_, width);
  for (int p = 0; p < n; ++p) {
    auto dp = to_device(std::vector<int>{p});
    backend_->attention(dq.get() + size_t(p) * width, step_out.get(),
                        PagedKv{dpool.get(), 16, blocks, kv_dim, dtable.get(), blocks},
                        layer, dp.get(), 1, n_heads, n_kv_heads, head_size);
    const auto step = to_host(step_out, width);
    ASSERT_TRUE(std::equal(step.begin(), step.end(), prefill.begin() + size_t(p) * width))
        << "position " << p << ": decode step differs from the prefill row";
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, KernelTest,
                         ::testing::Values("cpu-generic", "cpu-avx2", "cpu-avx512", "cuda"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---------------------------------------------------------------- fixed arithmetic

// Inputs over fixed_exp's whole range, its edges and the special values.
std::vector<float> exp_inputs() {
  std::vector<float> x = {0.0f, -0.0f, 1.0f, -1.0f, fixed::kExpLo, std::nextafter(fixed::kExpLo, 0.0f),
                          std::nextafter(fixed::kExpLo, -100.0f), fixed::kExpHi, 100.0f, -100.0f,
                          -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::infinity(),
                          0.34657359f, -0.34657359f, 1e-8f, -1e-8f};
  const auto r = random_floats(100000, 30, 90.0f);
  x.insert(x.end(), r.begin(), r.end());
  const auto small = random_floats(10000, 31, 2.0f);
  x.insert(x.end(), small.begin(), small.end());
  return x;
}

TEST(FixedMath, ExpIsAccurateAndEveryKernelSetAgreesBitForBit) {
  const auto x = exp_inputs();
  std::vector<float> scalar(x.size());
  for (size_t i = 0; i < x.size(); ++i) scalar[i] = fixed::fixed_exp(x[i]);
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] < fixed::kExpLo) {
      ASSERT_EQ(scalar[i], 0.0f) << x[i];
    } else if (x[i] <= fixed::kExpHi) {
      const double e = std::exp(double(x[i]));
      ASSERT_NEAR(scalar[i], e, 3e-7 * e) << "exp(" << x[i] << ")";
    }
  }
  for (const std::string& isa : cpu::supported_isas()) {
    std::vector<float> vec(x.size());
    cpu::kernels_for(isa).exp(x.data(), vec.data(), (long long)x.size());
    for (size_t i = 0; i < x.size(); ++i)
      ASSERT_EQ(std::memcmp(&vec[i], &scalar[i], sizeof(float)), 0)
          << isa << ": exp(" << x[i] << ") = " << vec[i] << ", scalar " << scalar[i];
  }
}

TEST(FixedMath, TreeSumFollowsItsTree) {
  // Values whose sum depends on the order: the tree's order is a specific one.
  float v[16];
  for (int i = 0; i < 16; ++i) v[i] = (i % 2 ? 1e8f : 1.0f) * (i % 3 ? 1.0f : -1.0f) + float(i);
  float h8[8], h4[4];
  for (int i = 0; i < 8; ++i) h8[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; ++i) h4[i] = h8[i] + h8[i + 4];
  EXPECT_EQ(fixed::tree_sum16(v), (h4[0] + h4[2]) + (h4[1] + h4[3]));
}

// The same operations on every kernel set this CPU runs give the same bits:
// a request's tokens do not depend on which machine of a cluster runs it.
TEST(FixedMath, EveryKernelSetComputesTheSameBits) {
  const auto isas = cpu::supported_isas();
  if (isas.size() < 2) GTEST_SKIP() << "this CPU runs only the generic kernels";
  const int m = 13, n = 70, k = 45;
  const auto a = random_floats(size_t(m) * k, 40), w = random_floats(size_t(n) * k, 41);
  const int n_heads = 6, n_kv_heads = 2, hs = 20, ctx = 77, kv_dim = n_kv_heads * hs;
  const PoolGeometry g{1, 80, kv_dim};
  const auto cache = random_floats(g.floats(), 42), q = random_floats(size_t(ctx) * n_heads * hs, 43);
  std::vector<int> positions(ctx);
  for (int i = 0; i < ctx; ++i) positions[i] = i;
  const int zero = 0;
  std::vector<std::vector<float>> results;
  for (const std::string& isa : isas) {
    auto b = make_cpu_backend(isa);
    DeviceArray<float> dw(*b, b->packed_floats(n, k)), da(*b), dc(*b, size_t(m) * n), dq(*b), dcache(*b),
        dout(*b, q.size());
    DeviceArray<int> dpos(*b), dtable(*b);
    b->pack_matrix(w.data(), dw.get(), n, k);
    da.upload(a.data(), a.size());
    dq.upload(q.data(), q.size());
    dcache.upload(cache.data(), cache.size());
    dpos.upload(positions.data(), positions.size());
    dtable.upload(&zero, 1);
    b->matmul(da.get(), dw.get(), dc.get(), m, n, k);
    b->attention(dq.get(), dout.get(), PagedKv{dcache.get(), 80, 1, kv_dim, dtable.get(), 0},
                 0, dpos.get(), ctx, n_heads, n_kv_heads, hs);
    std::vector<float> r(size_t(m) * n + q.size());
    dc.download(r.data(), size_t(m) * n);
    dout.download(r.data() + size_t(m) * n, q.size());
    results.push_back(std::move(r));
  }
  for (size_t i = 1; i < isas.size(); ++i)
    EXPECT_EQ(std::memcmp(results[i].data(), results[0].data(), results[0].size() * sizeof(float)), 0)
        << isas[i] << " and " << isas[0] << " differ";
}

// ---------------------------------------------------------------- selection

TEST(BackendSelection, NamesAndErrors) {
  EXPECT_EQ(make_backend("cpu")->name(), "cpu");
  EXPECT_THROW(make_backend("tpu"), Error);
  EXPECT_THROW(make_cpu_backend("sse9"), Error);
  if (!cpu_runs("avx512")) EXPECT_THROW(make_cpu_backend("avx512"), Error);
  // By default the set DISAGG_CPU_ISA names, else the widest; "generic" always.
  const char* forced = std::getenv("DISAGG_CPU_ISA");
  const std::string expected = forced && *forced ? forced : cpu::supported_isas().back();
  EXPECT_NE(make_cpu_backend()->describe().find(expected + " kernels"), std::string::npos);
  EXPECT_NE(make_cpu_backend("generic")->describe().find("generic kernels"), std::string::npos);
  if (cuda_device_count() == 0) {
    EXPECT_EQ(make_backend("auto")->name(), "cpu");
    try {
      make_backend("cuda");
      FAIL() << "backend \"cuda\" without a GPU must throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("no CUDA device"), std::string::npos) << e.what();
    }
  } else {
    EXPECT_EQ(make_backend("auto")->name().rfind("cuda:", 0), 0u);
    EXPECT_EQ(make_backend("cuda")->name().rfind("cuda:", 0), 0u);
  }
}

// The CUDA backend against the CPU one on the same random inputs (GPU machines only).
TEST(CudaVersusCpu, LayerOfOperationsAgrees) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  auto cpu = make_backend("cpu");
  auto cuda = make_backend("cuda");
  const int rows = 7, dim = 48, hidden = 96;
  const auto x = random_floats(size_t(rows) * dim, 20);
  const auto w1 = random_floats(size_t(hidden) * dim, 21, 0.2f);
  const auto w3 = random_floats(size_t(hidden) * dim, 22, 0.2f);
  const auto w2 = random_floats(size_t(dim) * hidden, 23, 0.2f);
  const auto norm = random_floats(dim, 24);
  auto run = [&](Backend& b) {
    DeviceArray<float> dx(b), dn(b), d1(b, b.packed_floats(hidden, dim)), d3(b, b.packed_floats(hidden, dim)),
        d2(b, b.packed_floats(dim, hidden)), h1(b, size_t(rows) * hidden), h3(b, size_t(rows) * hidden),
        xb(b, x.size());
    dx.upload(x.data(), x.size());
    dn.upload(norm.data(), norm.size());
    b.pack_matrix(w1.data(), d1.get(), hidden, dim);
    b.pack_matrix(w3.data(), d3.get(), hidden, dim);
    b.pack_matrix(w2.data(), d2.get(), dim, hidden);
    b.rmsnorm(dx.get(), dn.get(), xb.get(), rows, dim, 1e-5f);
    b.matmul(xb.get(), d1.get(), h1.get(), rows, hidden, dim);
    b.matmul(xb.get(), d3.get(), h3.get(), rows, hidden, dim);
    b.swiglu(h1.get(), h3.get(), size_t(rows) * hidden);
    b.matmul(h1.get(), d2.get(), xb.get(), rows, dim, hidden);
    b.add(dx.get(), xb.get(), x.size());
    std::vector<float> result(x.size());
    dx.download(result.data(), result.size());
    return result;
  };
  // The same fixed arithmetic on both: the same bits.
  EXPECT_EQ(run(*cuda), run(*cpu)) << "cuda and cpu differ";
}

}  // namespace
}  // namespace disagg::gpu
