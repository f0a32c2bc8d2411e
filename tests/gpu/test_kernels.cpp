// Every backend operation against a naive reference written here. The suite
// runs for each backend; "cuda" is skipped on machines without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/backend.h"
#include "gpu/error.h"

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

// Naive layout helpers of the paged pool: [block][layer][K,V][pos in block][kv_dim].
struct PoolGeometry {
  int n_layers, block_size, kv_dim;
  size_t block_stride() const { return size_t(n_layers) * 2 * block_size * kv_dim; }
  size_t index(const std::vector<int>& table, int layer, int kv, int pos, int e) const {
    const int block = table[pos / block_size];
    return block * block_stride() + ((size_t(layer) * 2 + kv) * block_size + pos % block_size) * kv_dim + e;
  }
};

class KernelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (GetParam() == "cuda" && cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
    backend_ = make_backend(GetParam());
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

TEST_P(KernelTest, MatmulNtComputesXTimesWTransposed) {
  for (auto [m, n, k] : {std::tuple{1, 7, 13}, std::tuple{5, 7, 13}, std::tuple{9, 33, 64}}) {
    const auto a = random_floats(size_t(m) * k, 1);
    const auto b = random_floats(size_t(n) * k, 2);
    std::vector<float> expected(size_t(m) * n);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double s = 0;
        for (int l = 0; l < k; ++l) s += double(a[i * k + l]) * b[j * k + l];
        expected[i * n + j] = float(s);
      }
    auto da = to_device(a), db = to_device(b);
    DeviceArray<float> dc(*backend_, expected.size());
    backend_->matmul_nt(da.get(), db.get(), dc.get(), m, n, k);
    expect_near_all(to_host(dc, expected.size()), expected, 1e-5f,
                    "matmul " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k));
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
    backend_->rmsnorm(dx.get(), dw.get(), out.get(), rows, dim);
    expect_near_all(to_host(out, x.size()), expected, 1e-5f, "rmsnorm");
    backend_->rmsnorm(dx.get(), dw.get(), dx.get(), rows, dim);  // in place, as the final norm runs
    expect_near_all(to_host(dx, x.size()), expected, 1e-5f, "rmsnorm in place");
  }
}

TEST_P(KernelTest, RopeRotatesPairsPerHeadAtEachRowsPosition) {
  std::vector<int> many_positions(700);
  for (int i = 0; i < 700; ++i) many_positions[i] = (i * 7) % 512;
  for (const std::vector<int>& positions : {std::vector<int>{0, 5, 17, 511}, many_positions}) {
    const int n_heads = 3, head_size = 8;
    const int rows = int(positions.size()), width = n_heads * head_size;
    const auto x = random_floats(size_t(rows) * width, 6);
    std::vector<float> expected = x;
    for (int r = 0; r < rows; ++r)
      for (int h = 0; h < n_heads; ++h)
        for (int i = 0; i < head_size / 2; ++i) {
          const double angle = positions[r] * std::pow(10000.0, -2.0 * i / head_size);
          const size_t at = size_t(r) * width + h * head_size + 2 * i;
          expected[at] = float(x[at] * std::cos(angle) - x[at + 1] * std::sin(angle));
          expected[at + 1] = float(x[at] * std::sin(angle) + x[at + 1] * std::cos(angle));
        }
    auto dx = to_device(x);
    auto dpos = to_device(positions);
    backend_->rope(dx.get(), dpos.get(), rows, n_heads, head_size);
    // float32 angles at position 511 carry ~1e-4 absolute error.
    expect_near_all(to_host(dx, x.size()), expected, 2e-4f, "rope");
    // Position 0 is the identity.
    for (int j = 0; j < width; ++j) EXPECT_EQ(to_host(dx, x.size())[j], x[j]);
  }
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
    expect_near_all(to_host(dg, n), expected, 1e-5f, "swiglu");

    auto dx = to_device(gate);
    backend_->add(dx.get(), du.get(), n);
    expect_near_all(to_host(dx, n), sum, 1e-6f, "add");
  }
}

std::vector<float> naive_softmax_rows(const std::vector<float>& x, int rows, int cols) {
  std::vector<float> expected(x.size());
  for (int r = 0; r < rows; ++r) {
    const float* row = &x[r * cols];
    const double mx = *std::max_element(row, row + cols);
    double total = 0;
    for (int c = 0; c < cols; ++c) total += std::exp(row[c] - mx);
    for (int c = 0; c < cols; ++c) expected[r * cols + c] = float(std::exp(row[c] - mx) / total);
  }
  return expected;
}

TEST_P(KernelTest, SoftmaxRowsIsStableForLargeValues) {
  const std::vector<float> x = {1, 2, 3, 4, 5, 1000, 1001, 999, 1000, 998, -3, -3, -3, -3, -3};
  auto dx = to_device(x);
  backend_->softmax_rows(dx.get(), 3, 5);
  expect_near_all(to_host(dx, x.size()), naive_softmax_rows(x, 3, 5), 1e-6f, "softmax");

  const auto big = random_floats(100 * 400, 13, 20.0f);
  auto dbig = to_device(big);
  backend_->softmax_rows(dbig.get(), 100, 400);
  expect_near_all(to_host(dbig, big.size()), naive_softmax_rows(big, 100, 400), 1e-6f, "softmax 100x400");
}

TEST_P(KernelTest, KvWriteStoresEachRowInItsOwnBlocks) {
  const PoolGeometry g{2, 2, 6};
  const int num_blocks = 5;
  const float sentinel = -7.0f;
  std::vector<float> pool(num_blocks * g.block_stride(), sentinel);
  // Row 0 at position 3 (its second block: 4), row 1 at position 0 (block 2).
  const std::vector<std::vector<int>> tables = {{1, 4}, {2, 0}};
  const std::vector<int> positions = {3, 0};
  const auto k = random_floats(2 * size_t(g.kv_dim), 9), v = random_floats(2 * size_t(g.kv_dim), 10);

  auto dpool = to_device(pool);
  auto dtables = to_device(std::vector<int>{1, 4, 2, 0});
  auto dpos = to_device(positions);
  auto dk = to_device(k), dv = to_device(v);
  PagedKv kv{dpool.get(), g.block_size, (long long)g.block_stride(), g.kv_dim, dtables.get(), 2};
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
  // The prefill case: n rows at positions 0..n-1 into one block of n positions.
  const int n = 1100;
  const PoolGeometry g{2, n, 128};
  std::vector<int> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = i;
  const auto k = random_floats(size_t(n) * g.kv_dim, 14), v = random_floats(size_t(n) * g.kv_dim, 15);
  DeviceArray<float> dcache(*backend_, g.block_stride());
  auto dtable = to_device(std::vector<int>{0});
  auto dpos = to_device(positions);
  auto dk = to_device(k), dv = to_device(v);
  PagedKv kv{dcache.get(), n, (long long)g.block_stride(), g.kv_dim, dtable.get(), 0};
  for (int layer = 0; layer < g.n_layers; ++layer) backend_->kv_write(kv, layer, dk.get(), dv.get(), dpos.get(), n);
  std::vector<float> expected;  // [layer][K then V][pos][kv_dim]
  for (int layer = 0; layer < g.n_layers; ++layer) {
    expected.insert(expected.end(), k.begin(), k.end());
    expected.insert(expected.end(), v.begin(), v.end());
  }
  EXPECT_EQ(to_host(dcache, expected.size()), expected);
}

void KernelTest::check_attention(int n_heads, int n_kv_heads, int head_size, const PoolGeometry& g, int num_blocks,
                                 const std::vector<std::vector<int>>& tables, const std::vector<int>& positions,
                                 int layer, int table_stride_override) {
  const int rows = int(positions.size());
  const int q_width = n_heads * head_size;
  const auto pool = random_floats(num_blocks * g.block_stride(), 11);
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
          s += double(q[r * q_width + h * head_size + e]) * pool[g.index(tables[r], layer, 0, t, kvh * head_size + e)];
        scores[t] = s / std::sqrt(double(head_size));
      }
      const double mx = *std::max_element(scores.begin(), scores.end());
      double total = 0;
      for (double& s : scores) total += (s = std::exp(s - mx));
      for (int e = 0; e < head_size; ++e) {
        double acc = 0;
        for (int t = 0; t < ctx; ++t)
          acc += scores[t] / total * pool[g.index(tables[r], layer, 1, t, kvh * head_size + e)];
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
  const int max_ctx = *std::max_element(positions.begin(), positions.end()) + 3;  // slack is allowed
  DeviceArray<float> scores(*backend_, size_t(rows) * n_heads * max_ctx);
  DeviceArray<float> out(*backend_, expected.size());
  const int stride = table_stride_override >= 0 ? table_stride_override : table_width;
  PagedKv kv{dpool.get(), g.block_size, (long long)g.block_stride(), g.kv_dim, dtables.get(), stride};
  backend_->attention(dq.get(), out.get(), kv, layer, dpos.get(), rows, n_heads, n_kv_heads, head_size, scores.get(),
                      max_ctx);
  expect_near_all(to_host(out, expected.size()), expected, 1e-5f, "attention");
}

TEST_P(KernelTest, AttentionOverPagedBlocksWithGroupedQueryHeads) {
  // 4 query heads share 2 kv heads; rows of different lengths in scattered blocks.
  const int n_heads = 4, n_kv_heads = 2, head_size = 4;
  const PoolGeometry g{2, 3, n_kv_heads * head_size};
  const std::vector<std::vector<int>> tables = {{6, 0, 0}, {3, 5, 1}, {2, 4, 7}};
  const std::vector<int> positions = {0, 4, 8};
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
  const PoolGeometry g{3, n, n_kv_heads * head_size};
  std::vector<int> positions(n);
  for (int i = 0; i < n; ++i) positions[i] = i;
  // The naive side reads every row through table {0}; the backend gets it once.
  check_attention(n_heads, n_kv_heads, head_size, g, 1, std::vector<std::vector<int>>(n, {0}), positions, 2,
                  /*table_stride_override=*/0);
}

INSTANTIATE_TEST_SUITE_P(Backends, KernelTest, ::testing::Values("cpu", "cuda"),
                         [](const auto& info) { return info.param; });

// ---------------------------------------------------------------- selection

TEST(BackendSelection, NamesAndErrors) {
  EXPECT_EQ(make_backend("cpu")->name(), "cpu");
  EXPECT_THROW(make_backend("tpu"), Error);
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
    DeviceArray<float> dx(b), dn(b), d1(b), d3(b), d2(b), h1(b, size_t(rows) * hidden), h3(b, size_t(rows) * hidden),
        xb(b, x.size());
    dx.upload(x.data(), x.size());
    dn.upload(norm.data(), norm.size());
    d1.upload(w1.data(), w1.size());
    d3.upload(w3.data(), w3.size());
    d2.upload(w2.data(), w2.size());
    b.rmsnorm(dx.get(), dn.get(), xb.get(), rows, dim);
    b.matmul_nt(xb.get(), d1.get(), h1.get(), rows, hidden, dim);
    b.matmul_nt(xb.get(), d3.get(), h3.get(), rows, hidden, dim);
    b.swiglu(h1.get(), h3.get(), size_t(rows) * hidden);
    b.matmul_nt(h1.get(), d2.get(), xb.get(), rows, dim, hidden);
    b.add(dx.get(), xb.get(), x.size());
    b.softmax_rows(dx.get(), rows, dim);
    std::vector<float> result(x.size());
    dx.download(result.data(), result.size());
    return result;
  };
  expect_near_all(run(*cuda), run(*cpu), 1e-5f, "cuda vs cpu");
}

}  // namespace
}  // namespace disagg::gpu
