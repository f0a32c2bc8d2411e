// The CPU backend: "device" memory is host memory, the shared Thrust kernels
// run under OpenMP (or serially when small) and the GEMMs go to OpenBLAS.
#include <cblas.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cpp/execution_policy.h>
#include <thrust/system/omp/execution_policy.h>

#include "gpu/backend.h"
#include "gpu/error.h"

namespace disagg::gpu {

namespace cpu_kernels {
#include "gpu/kernels.inl"
}  // namespace cpu_kernels

namespace {

// Below this many (rough) float operations a kernel runs on the calling thread.
// An OpenMP parallel region costs microseconds on an idle machine, but on a
// busy one its fork/join waits for descheduled workers (milliseconds): a small
// model's decode step, ~20 kernels per layer, must not pay that.
constexpr size_t kParallelWork = size_t(1) << 18;

// Calls launch(policy) with the serial or the OpenMP Thrust policy.
template <class Launch>
void dispatch(size_t work, const Launch& launch) {
  if (work < kParallelWork) {
    launch(thrust::cpp::par);
  } else {
    launch(thrust::omp::par);
  }
}

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }

  void* alloc_bytes(size_t bytes) override {
    void* ptr = std::malloc(bytes == 0 ? 1 : bytes);
    if (!ptr) throw Error("cpu backend: cannot allocate " + std::to_string(bytes) + " bytes");
    return ptr;
  }
  void free_bytes(void* ptr) override { std::free(ptr); }
  void upload(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void download(void* dst, const void* src, size_t bytes) override { copy(dst, src, bytes); }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes) std::memcpy(dst, src, bytes);
  }
  void synchronize() override {}

  void matmul_nt(const float* a, const float* b, float* c, int m, int n, int k) override {
    if (m <= 0 || n <= 0) return;
    // Always sgemm, even for one row: sgemv would be ~2x faster at m == 1 (no
    // packing of W) but sums in another order, so a sequence's logits would
    // depend on how many others share its decode step, and so could a sampled
    // token. Each row of sgemm comes out the same whatever m is.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a, k, b, k, 0.0f, c, n);
  }
  void embedding(const float* table, const int* tokens, float* out, int rows, int dim) override {
    dispatch(size_t(rows) * dim,
             [&](const auto& p) { cpu_kernels::embedding(p, table, tokens, out, rows, dim); });
  }
  void rmsnorm(const float* x, const float* weight, float* out, int rows, int dim) override {
    dispatch(3 * size_t(rows) * dim, [&](const auto& p) { cpu_kernels::rmsnorm(p, x, weight, out, rows, dim); });
  }
  void rope(float* x, const int* positions, int rows, int n_heads, int head_size) override {
    dispatch(16 * size_t(rows) * n_heads * head_size,
             [&](const auto& p) { cpu_kernels::rope(p, x, positions, rows, n_heads, head_size); });
  }
  void swiglu(float* gate, const float* up, size_t n) override {
    dispatch(8 * n, [&](const auto& p) { cpu_kernels::swiglu(p, gate, up, n); });
  }
  void add(float* x, const float* y, size_t n) override {
    dispatch(n, [&](const auto& p) { cpu_kernels::add(p, x, y, n); });
  }
  void softmax_rows(float* x, int rows, int cols) override {
    dispatch(8 * size_t(rows) * cols, [&](const auto& p) { cpu_kernels::softmax_rows(p, x, rows, cols); });
  }
  void kv_write(const PagedKv& kv, int layer, const float* k, const float* v, const int* positions,
                int rows) override {
    dispatch(2 * size_t(rows) * kv.kv_dim,
             [&](const auto& p) { cpu_kernels::kv_write(p, kv, layer, k, v, positions, rows); });
  }
  void attention(const float* q, float* out, const PagedKv& kv, int layer, const int* positions, int rows,
                 int n_heads, int n_kv_heads, int head_size, float* scores, int max_ctx) override {
    dispatch(4 * size_t(rows) * n_heads * max_ctx * head_size, [&](const auto& p) {
      cpu_kernels::attention(p, q, out, kv, layer, positions, rows, n_heads, n_kv_heads, head_size, scores,
                             max_ctx);
    });
  }
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace disagg::gpu
