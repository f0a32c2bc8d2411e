// The CUDA backend: device memory from cudaMalloc, the shared Thrust kernels
// under a CUDA policy on the backend's stream, the GEMMs on cuBLAS.
// Everything is queued on one stream; download() and synchronize() wait for it.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cuda/execution_policy.h>

#include "gpu/backend.h"
#include "gpu/backend_cuda.h"
#include "gpu/error.h"

namespace disagg::gpu {

namespace cuda_kernels {
#include "gpu/kernels.inl"
}  // namespace cuda_kernels

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("cuda backend: ") + what + ": " + cudaGetErrorString(status));
  }
}

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw Error(std::string("cuda backend: ") + what + ": cuBLAS status " + std::to_string(int(status)));
  }
}

// The Thrust policy of the backend's stream; no synchronisation after each
// kernel: the stream orders them, download() and synchronize() wait.
auto stream_policy(cudaStream_t stream) { return thrust::cuda::par_nosync.on(stream); }

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties");
    name_ = std::string("cuda:") + prop.name;
    check(cudaStreamCreate(&stream_), "cudaStreamCreate");
    check(cublasCreate(&blas_), "cublasCreate");
    check(cublasSetStream(blas_, stream_), "cublasSetStream");
    // Plain FP32 GEMMs (no TF32) so the CPU and GPU results agree closely.
    check(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  }
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);
    cublasDestroy(blas_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return name_; }

  void* alloc_bytes(size_t bytes) override {
    activate();
    void* ptr = nullptr;
    check(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes), ("cudaMalloc of " + std::to_string(bytes) + " bytes").c_str());
    return ptr;
  }
  void free_bytes(void* ptr) override {
    if (!ptr) return;
    activate();
    cudaStreamSynchronize(stream_);  // kernels queued on the stream may still use it
    cudaFree(ptr);
  }
  void upload(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    activate();
    // From pageable memory this returns once the source has been staged, so
    // the caller may reuse `src` immediately.
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "upload");
  }
  void download(void* dst, const void* src, size_t bytes) override {
    activate();
    if (bytes) check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "download");
    check(cudaStreamSynchronize(stream_), "download (kernel failure)");
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    if (!bytes) return;
    activate();
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "copy");
  }
  void synchronize() override {
    activate();
    check(cudaStreamSynchronize(stream_), "synchronize");
  }

  void matmul_nt(const float* a, const float* b, float* c, int m, int n, int k) override {
    if (m <= 0 || n <= 0) return;
    activate();
    // cuBLAS is column-major: the row-major C[m,n] is the column-major C^T[n,m]
    // = B[n,k] * A^T, where the row-major B[n,k] reads as column-major [k,n]
    // (hence OP_T) and the row-major A[m,k] as column-major [k,m] (OP_N).
    const float one = 1.0f;
    const float zero = 0.0f;
    check(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, b, k, a, k, &zero, c, n), "cublasSgemm");
  }
  void embedding(const float* table, const int* tokens, float* out, int rows, int dim) override {
    activate();
    cuda_kernels::embedding(stream_policy(stream_), table, tokens, out, rows, dim);
  }
  void rmsnorm(const float* x, const float* weight, float* out, int rows, int dim) override {
    activate();
    cuda_kernels::rmsnorm(stream_policy(stream_), x, weight, out, rows, dim);
  }
  void rope(float* x, const int* positions, int rows, int n_heads, int head_size) override {
    activate();
    cuda_kernels::rope(stream_policy(stream_), x, positions, rows, n_heads, head_size);
  }
  void swiglu(float* gate, const float* up, size_t n) override {
    activate();
    cuda_kernels::swiglu(stream_policy(stream_), gate, up, n);
  }
  void add(float* x, const float* y, size_t n) override {
    activate();
    cuda_kernels::add(stream_policy(stream_), x, y, n);
  }
  void softmax_rows(float* x, int rows, int cols) override {
    activate();
    cuda_kernels::softmax_rows(stream_policy(stream_), x, rows, cols);
  }
  void kv_write(const PagedKv& kv, int layer, const float* k, const float* v, const int* positions,
                int rows) override {
    activate();
    cuda_kernels::kv_write(stream_policy(stream_), kv, layer, k, v, positions, rows);
  }
  void attention(const float* q, float* out, const PagedKv& kv, int layer, const int* positions, int rows,
                 int n_heads, int n_kv_heads, int head_size, float* scores, int max_ctx) override {
    activate();
    cuda_kernels::attention(stream_policy(stream_), q, out, kv, layer, positions, rows, n_heads, n_kv_heads, head_size, scores,
                            max_ctx);
  }

 private:
  // The calling thread may differ from call to call (actors migrate).
  void activate() { check(cudaSetDevice(device_), "cudaSetDevice"); }

  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
};

}  // namespace

int cuda_runtime_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" status
    return 0;
  }
  return count;
}

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::make_unique<CudaBackend>(device); }

}  // namespace disagg::gpu
