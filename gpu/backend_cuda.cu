// The CUDA backend: device memory from cudaMalloc, the shared Thrust kernels
// under a CUDA policy on the backend's stream, the GEMMs on cuBLAS.
// Everything is queued on one stream; download() and synchronize() wait for it.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cmath>
#include <exception>
#include <string>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>

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
    // Reset the runtime's last-error slot, so a later, unrelated
    // cudaGetLastError()/cudaPeekAtLastError() does not report this failure again.
    cudaGetLastError();
    throw Error(std::string("cuda backend: ") + what + ": " + cudaGetErrorName(status) + ": " +
                cudaGetErrorString(status));
  }
}

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    cudaGetLastError();  // a failed cuBLAS launch may have left a CUDA error behind
    throw Error(std::string("cuda backend: ") + what + ": " + cublasGetStatusString(status) + " (cuBLAS status " +
                std::to_string(int(status)) + ")");
  }
}

// Runs a Thrust algorithm and turns what Thrust throws (thrust::system_error on
// a failed launch or synchronisation, std::bad_alloc-derived errors for its
// temporary storage) into the library's Error, so callers need catch one type.
template <class F>
void run_thrust(const char* what, F&& kernel) {
  try {
    kernel();
  } catch (const thrust::system_error& e) {
    cudaGetLastError();
    throw Error(std::string("cuda backend: ") + what + " (Thrust): " + e.what());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    cudaGetLastError();
    throw Error(std::string("cuda backend: ") + what + " (Thrust): " + e.what());
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
    try {
      check(cublasCreate(&blas_), "cublasCreate");
      check(cublasSetStream(blas_, stream_), "cublasSetStream");
      // Plain FP32 GEMMs (no TF32) so the CPU and GPU results agree closely.
      check(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
    } catch (...) {
      // The destructor does not run for a constructor that throws.
      release();
      throw;
    }
  }
  ~CudaBackend() override {
    cudaSetDevice(device_);
    cudaStreamSynchronize(stream_);  // a destructor cannot report a kernel failure
    release();
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
    // Freeing cannot report; clear any error so that Thrust, which checks the
    // last error after each launch, does not blame the next kernel for it.
    cudaGetLastError();
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
    run_thrust("embedding", [&] { cuda_kernels::embedding(stream_policy(stream_), table, tokens, out, rows, dim); });
  }
  void rmsnorm(const float* x, const float* weight, float* out, int rows, int dim) override {
    activate();
    run_thrust("rmsnorm", [&] { cuda_kernels::rmsnorm(stream_policy(stream_), x, weight, out, rows, dim); });
  }
  void rope(float* x, const int* positions, int rows, int n_heads, int head_size) override {
    activate();
    run_thrust("rope", [&] { cuda_kernels::rope(stream_policy(stream_), x, positions, rows, n_heads, head_size); });
  }
  void swiglu(float* gate, const float* up, size_t n) override {
    activate();
    run_thrust("swiglu", [&] { cuda_kernels::swiglu(stream_policy(stream_), gate, up, n); });
  }
  void add(float* x, const float* y, size_t n) override {
    activate();
    run_thrust("add", [&] { cuda_kernels::add(stream_policy(stream_), x, y, n); });
  }
  void softmax_rows(float* x, int rows, int cols) override {
    activate();
    run_thrust("softmax_rows", [&] { cuda_kernels::softmax_rows(stream_policy(stream_), x, rows, cols); });
  }
  void kv_write(const PagedKv& kv, int layer, const float* k, const float* v, const int* positions,
                int rows) override {
    activate();
    run_thrust("kv_write", [&] { cuda_kernels::kv_write(stream_policy(stream_), kv, layer, k, v, positions, rows); });
  }
  void attention(const float* q, float* out, const PagedKv& kv, int layer, const int* positions, int rows,
                 int n_heads, int n_kv_heads, int head_size, float* scores, int max_ctx) override {
    activate();
    run_thrust("attention", [&] {
      cuda_kernels::attention(stream_policy(stream_), q, out, kv, layer, positions, rows, n_heads, n_kv_heads,
                              head_size, scores, max_ctx);
    });
  }

 private:
  // The calling thread may differ from call to call (actors migrate).
  void activate() { check(cudaSetDevice(device_), "cudaSetDevice"); }

  // Frees the cuBLAS handle and the stream (either may be null); errors are ignored.
  void release() {
    if (blas_) cublasDestroy(blas_);
    if (stream_) cudaStreamDestroy(stream_);
    blas_ = nullptr;
    stream_ = nullptr;
    cudaGetLastError();
  }

  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
};

}  // namespace

int cuda_runtime_device_count(std::string* why_none) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the "no device / no driver" status
    if (why_none) *why_none = std::string("cudaGetDeviceCount: ") + cudaGetErrorName(status) + ": " + cudaGetErrorString(status);
    return 0;
  }
  if (count == 0 && why_none) *why_none = "cudaGetDeviceCount reported 0 devices";
  return count;
}

std::unique_ptr<Backend> make_cuda_backend(int device) { return std::make_unique<CudaBackend>(device); }

}  // namespace disagg::gpu
