// The CPU backend: "device" memory is host memory; the elementwise kernels are
// the shared Thrust functors under OpenMP (or serial when small); the matrix
// products, attention and SwiGLU are the vector kernels of gpu/cpu/, split
// over the same OpenMP threads. One thread pool: no BLAS library runs here.
#include <omp.h>

#include <cmath>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/system/omp/execution_policy.h>
#include <vector>

#include "gpu/backend.h"
#include "gpu/cpu/cpu_kernels.h"
#include "gpu/error.h"
#include "gpu/quant.h"
#include "gpu/fixed_math.h"
#include "gpu/host_memory.h"
#include "gpu/kv_layout.h"

namespace disagg::gpu {

namespace cpu_kernels {
#include "gpu/kernels.inl"
}  // namespace cpu_kernels

namespace {

// Below this many (rough) float operations a kernel runs on the calling thread.
// An OpenMP parallel region costs microseconds on an idle machine, but on a
// busy one its fork/join waits for descheduled workers (milliseconds): a small
// model's decode step, ~20 kernels per layer, must not pay that.
constexpr size_t kParallelWork = size_t(1) << 16;

// Calls launch(policy) with the serial or the OpenMP Thrust policy.
template <class Launch>
void dispatch(size_t work, const Launch& launch) {
  if (work < kParallelWork) {
    launch(thrust::cpp::par);
  } else {
    launch(thrust::omp::par);
  }
}

// [begin, end) of `n` items for thread `t` of `threads`.
std::pair<int, int> share(int n, int t, int threads) {
  return {int((long long)n * t / threads), int((long long)n * (t + 1) / threads)};
}

// f(i) for i in [0, n), on the calling thread when `work` (rough float
// operations) is small, else split statically over the OpenMP threads.
template <class F>
void for_each_index(size_t work, long long n, const F& f) {
  if (work < kParallelWork) {
    for (long long i = 0; i < n; ++i) f(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (long long i = 0; i < n; ++i) f(i);
}

// f(u0, u1) over [0, units) of a product's column units (panels, tiles):
// on the calling thread when `work` is small, else each OpenMP thread its
// own units. Every element is computed by one thread in the fixed order, so
// the result does not depend on the thread count.
template <class F>
void for_each_unit_share(int units, size_t work, const F& f) {
  if (work < kParallelWork) {
    f(0, units);
    return;
  }
#pragma omp parallel
  {
    const auto [u0, u1] = share(units, omp_get_thread_num(), omp_get_num_threads());
    if (u0 < u1) f(u0, u1);
  }
}

// The same over a quantized product's tiles, as column ranges [c0, c1).
template <class F>
void for_each_tile_share(int n, size_t work, const F& f) {
  for_each_unit_share((n + cpu::kTileCols - 1) / cpu::kTileCols, work,
                      [&](int t0, int t1) { f(t0 * cpu::kTileCols, std::min(n, t1 * cpu::kTileCols)); });
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const cpu::KernelTable& kernels) : k_(kernels) {}

  std::string name() const override { return "cpu"; }
  bool host_memory() const override { return true; }
  std::string weight_layout() const override { return "cpu-tiles-" + std::to_string(cpu::kLayoutVersion); }
  std::string describe() const override {
    return std::string("cpu (") + k_.isa + " kernels, " + std::to_string(omp_get_max_threads()) + " threads)";
  }

  // Large buffers (weights, KV, prefill scratch) on 2 MiB boundaries, in
  // transparent huge pages (gpu/host_memory.h).
  void* alloc_bytes(size_t bytes) override {
    const size_t align = bytes >= kHugePage ? kHugePage : kAlign;
    const size_t size = (bytes + align - 1) / align * align + align;
    void* ptr = std::aligned_alloc(align, size);
    if (!ptr) throw Error("cpu backend: cannot allocate " + std::to_string(bytes) + " bytes");
    if (align == kHugePage) advise_huge_pages(ptr, size);
    return ptr;
  }
  void free_bytes(void* ptr) override { std::free(ptr); }
  void upload(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  // Large copies (a batch's logits: 64 x 32,000 floats) on every thread: one
  // thread alone moves less than the memory system can.
  void copy(void* dst, const void* src, size_t bytes) override {
    constexpr size_t kChunk = size_t(1) << 20;
    if (bytes < 2 * kChunk) {
      if (bytes) std::memcpy(dst, src, bytes);
      return;
    }
    const long long chunks = (long long)((bytes + kChunk - 1) / kChunk);
#pragma omp parallel for schedule(static)
    for (long long c = 0; c < chunks; ++c) {
      const size_t at = size_t(c) * kChunk;
      std::memcpy(static_cast<char*>(dst) + at, static_cast<const char*>(src) + at, std::min(kChunk, bytes - at));
    }
  }
  void synchronize() override {}

  size_t packed_floats(int n, int k) const override { return cpu::packed_floats(n, k); }
  void pack_matrix(const float* host_w, float* packed, int n, int k) override {
    cpu::pack_matrix(host_w, packed, n, k);
  }

  void matmul(const float* a, const float* w, float* c, int m, int n, int k) override {
    if (m <= 0 || n <= 0) return;
    const int panels = (n + cpu::kPanel - 1) / cpu::kPanel;
    for_each_unit_share(panels, size_t(m) * n * k, [&](int p0, int p1) { k_.matmul(a, w, c, m, n, k, p0, p1); });
  }
  void pack_matrix16(const uint16_t* host_w, uint16_t* packed, int n, int k) override {
    cpu::pack_matrix16(host_w, packed, n, k);
  }
  void matmul16(WeightType type, const float* a, const uint16_t* w, float* c, int m, int n, int k) override {
    if (m <= 0 || n <= 0) return;
    if (!is_float16(type)) throw Error(std::string("matmul16: ") + to_string(type) + " is not a 16-bit float type");
    const int panels = (n + cpu::kPanel - 1) / cpu::kPanel;
    for_each_unit_share(panels, size_t(m) * n * k,
                        [&](int p0, int p1) { k_.matmul16(type, a, w, c, m, n, k, p0, p1); });
  }
  // Quantized weights in tiles (cpu_kernels.h).
  size_t quantized_bytes(WeightType type, int n, int k) const override { return cpu::tiled_bytes(type, n, k); }
  void pack_quantized(WeightType type, const void* host_rows, void* dst, int n, int k) override {
    if (k % block_values(type) != 0)
      throw Error("pack_quantized: k = " + std::to_string(k) + " is not a multiple of " +
                  std::to_string(block_values(type)));
    const int tiles = (n + cpu::kTileCols - 1) / cpu::kTileCols;
#pragma omp parallel
    {
      const auto [t0, t1] = share(tiles, omp_get_thread_num(), omp_get_num_threads());
      cpu::tile_quantized(type, static_cast<const uint8_t*>(host_rows), static_cast<uint8_t*>(dst), n, k, t0, t1);
    }
  }
  void matmul_quantized(WeightType type, const float* a, const void* w, float* c, int m, int n, int k) override {
    if (m <= 0 || n <= 0) return;
    if (is_k_quant(type)) return matmul_kquant(type, a, static_cast<const uint8_t*>(w), c, m, n, k);
    if (k % kQ8Block != 0) throw Error("matmul_quantized: k = " + std::to_string(k) + " is not a multiple of 32");
    // The rule's first step, once per row for every column: the activations per block.
    const size_t blocks = size_t(k / kQ8Block);
    if (q8_scales_.size() < size_t(m) * blocks) q8_scales_.resize(size_t(m) * blocks);
    if (q8_values_.size() < size_t(m) * k) q8_values_.resize(size_t(m) * k);
    // (Rows on every thread: a prefill's quantization alone on one would not scale.)
    for_each_index(4 * size_t(m) * k, m, [&](long long r) {
      k_.quantize_q8(a + size_t(r) * k, k, q8_scales_.data() + size_t(r) * blocks, q8_values_.data() + size_t(r) * k);
    });
    const auto* wb = static_cast<const uint8_t*>(w);
    for_each_tile_share(n, size_t(m) * n * k, [&](int c0, int c1) {
      k_.matmul_quantized(type, q8_scales_.data(), q8_values_.data(), wb, c, m, n, k, c0, c1);
    });
  }
  // The K-quant rule: activations per superblock (Q8_K), then the kernels.
  void matmul_kquant(WeightType type, const float* a, const uint8_t* w, float* c, int m, int n, int k) {
    if (k % kQK != 0) throw Error("matmul_quantized: k = " + std::to_string(k) + " is not a multiple of 256");
    const size_t blocks = size_t(k / kQK);
    if (k_d_.size() < size_t(m) * blocks) k_d_.resize(size_t(m) * blocks);
    if (q8_values_.size() < size_t(m) * k) q8_values_.resize(size_t(m) * k);
    if (k_bsums_.size() < size_t(m) * k / 16) k_bsums_.resize(size_t(m) * k / 16);
    for_each_index(4 * size_t(m) * k, m, [&](long long r) {
      k_.quantize_q8k(a + size_t(r) * k, k, k_d_.data() + size_t(r) * blocks, q8_values_.data() + size_t(r) * k,
                      k_bsums_.data() + size_t(r) * k / 16);
    });
    for_each_tile_share(n, size_t(m) * n * k, [&](int c0, int c1) {
      k_.matmul_kquant(type, k_d_.data(), q8_values_.data(), k_bsums_.data(), w, c, m, n, k, c0, c1);
    });
  }
  void embedding_quantized(WeightType type, const void* table, const int* tokens, float* out, int rows,
                           int dim) override {
    const size_t row = row_bytes(type, dim);
    for_each_index(size_t(rows) * dim, rows, [&](long long r) {
      dequantize_row(type, static_cast<const uint8_t*>(table) + size_t(tokens[r]) * row, out + size_t(r) * dim, dim);
    });
  }
  void embedding(const float* table, const int* tokens, float* out, int rows, int dim) override {
    dispatch(size_t(rows) * dim,
             [&](const auto& p) { cpu_kernels::embedding(p, table, tokens, out, rows, dim); });
  }
  void rmsnorm(const float* x, const float* weight, float* out, int rows, int dim, float epsilon) override {
    dispatch(3 * size_t(rows) * dim, [&](const auto& p) { cpu_kernels::rmsnorm(p, x, weight, out, rows, dim, epsilon); });
  }
  void rope(float* x, const int* positions, const float* table, int rows, int n_heads, int head_size,
            bool neox) override {
    dispatch(8 * size_t(rows) * n_heads * head_size,
             [&](const auto& p) { cpu_kernels::rope(p, x, positions, table, rows, n_heads, head_size, neox); });
  }
  void swiglu(float* gate, const float* up, size_t n) override {
    constexpr long long kChunk = 4096;  // floats per parallel piece (a multiple of 16)
    const long long total = (long long)n;
    for_each_index(16 * n, (total + kChunk - 1) / kChunk, [&](long long c) {
      k_.swiglu(gate, up, c * kChunk, std::min(total, (c + 1) * kChunk));
    });
  }
  void add(float* x, const float* y, size_t n) override {
    dispatch(n, [&](const auto& p) { cpu_kernels::add(p, x, y, n); });
  }
  void add_bias(float* x, const float* bias, int rows, int n) override {
    dispatch(size_t(rows) * n, [&](const auto& p) { cpu_kernels::add_bias(p, x, bias, rows, n); });
  }
  // Row by row, not the per-float Thrust functor (its index arithmetic cost
  // more than the copy): K scattered into its tile, V one copy.
  void kv_write(const PagedKv& kv, int layer, const float* k, const float* v, const int* positions,
                int rows) override {
    for_each_index(2 * size_t(rows) * kv.kv_dim, rows, [&](long long r) {
      const int pos = positions[r];
      float* region = kv_layout::layer_region(kv, layer, r, pos);
      const int p = pos % kv.block_size;
      const float* kr = k + r * kv.kv_dim;
      float* kdst = region + kv_layout::k_index(kv.kv_dim, p, 0);
      for (int e = 0; e < kv.kv_dim; ++e) kdst[(long long)e * kv_layout::kTile] = kr[e];
      std::memcpy(region + kv_layout::v_index(kv, p), v + r * kv.kv_dim,
                  size_t(kv.kv_dim) * sizeof(float));
    });
  }
  void attention(const float* q, float* out, const PagedKv& kv, int layer, const int* positions, int rows,
                 int n_heads, int n_kv_heads, int head_size) override {
    if (rows <= 0) return;
    // Rows that share one block table (a prefill) go in groups; others alone.
    const int group_rows = kv.table_stride == 0 ? cpu::kQueryRows : 1;
    const int groups = (rows + group_rows - 1) / group_rows;
    const int items = groups * n_kv_heads;
    const cpu::AttentionArgs args{q, out, kv, layer, positions, n_heads, n_kv_heads, head_size};
    const size_t scratch = cpu::attention_scratch_floats(group_rows, n_heads, n_kv_heads, head_size);
    long long work = 0;
    for (int r = 0; r < rows; ++r) work += positions[r] + 1;
    work *= 4LL * n_heads * head_size;
    const bool parallel = size_t(work) >= kParallelWork && items > 1;
    const int threads = parallel ? omp_get_max_threads() : 1;
    if (scratch_.size() < size_t(threads)) scratch_.resize(size_t(threads));
    for (int t = 0; t < threads; ++t)
      if (scratch_[size_t(t)].size() < scratch) scratch_[size_t(t)].resize(scratch);
    auto item = [&](int i, int thread) {
      const int g = i / n_kv_heads, kvh = i % n_kv_heads;
      const int r0 = g * group_rows, r1 = std::min(rows, r0 + group_rows);
      k_.attention(args, r0, r1, kvh, scratch_[size_t(thread)].data());
    };
    if (!parallel) {
      for (int i = 0; i < items; ++i) item(i, 0);
      return;
    }
    // Later prefill groups attend more positions: hand items out dynamically,
    // the most expensive (last) first.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int i = items - 1; i >= 0; --i) item(i, omp_get_thread_num());
  }

 private:
  static constexpr size_t kAlign = 64;  // cache line: vector loads never split one
  const cpu::KernelTable& k_;
  std::vector<std::vector<float>> scratch_;  // per OpenMP thread: attention's running outputs, maxima, sums
  std::vector<float> q8_scales_;   // matmul_quantized: the activations' block scales (m x k/32)
  std::vector<float> k_d_;         // K-quants: the activations' superblock scales (m x k/256)
  std::vector<int16_t> k_bsums_;   // K-quants: the activations' sums of 16 (m x k/16)
  std::vector<int8_t> q8_values_;  // and values (m x k)
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const std::string& isa) {
  return std::make_unique<CpuBackend>(cpu::kernels_for(isa));
}

}  // namespace disagg::gpu
