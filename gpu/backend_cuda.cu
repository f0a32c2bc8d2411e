// The CUDA backend: device memory from cudaMalloc, the shared Thrust kernels
// under a CUDA policy on the backend's stream, and CUDA kernels of its own for
// the matrix products and attention, in the fixed arithmetic of
// gpu/fixed_math.h (so they give the CPU backend's bits; cuBLAS picks its
// summation order by problem size and could not). Everything is queued on one
// stream; download() and synchronize() wait for it.
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
#include "gpu/fixed_math.h"
#include "gpu/kv_layout.h"

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

// ---------------------------------------------------------------- fixed-order kernels

// Matrix product tiles: a block of 16 x 16 threads computes kTileRows x 64
// outputs of C (each thread TM rows x 4 columns), staging kTileK columns of A
// and W in shared memory. Every output is one thread's sequential fmaf chain
// over k: the fixed rule, whatever the tiling.
constexpr int kTileK = 16;

template <int TM>
__global__ void matmul_kernel(const float* __restrict__ a, const float* __restrict__ w, float* __restrict__ c, int m,
                              int n, int k) {
  constexpr int kRows = 16 * TM, kCols = 64;
  __shared__ float as[kTileK][kRows + 1];
  __shared__ float ws[kTileK][kCols + 1];
  const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 16 + tx;
  const int row0 = blockIdx.y * kRows, col0 = blockIdx.x * kCols;
  float acc[TM][4];
  for (int r = 0; r < TM; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = 0.0f;
  for (int k0 = 0; k0 < k; k0 += kTileK) {
    const int kk_n = min(kTileK, k - k0);
    for (int i = tid; i < kRows * kTileK; i += 256) {
      const int r = i / kTileK, kk = i % kTileK;
      as[kk][r] = (row0 + r < m && kk < kk_n) ? a[(long long)(row0 + r) * k + k0 + kk] : 0.0f;
    }
    for (int i = tid; i < kCols * kTileK; i += 256) {
      const int col = i / kTileK, kk = i % kTileK;
      ws[kk][col] = (col0 + col < n && kk < kk_n) ? w[(long long)(col0 + col) * k + k0 + kk] : 0.0f;
    }
    __syncthreads();
    for (int kk = 0; kk < kk_n; ++kk)
      for (int r = 0; r < TM; ++r)
        for (int q = 0; q < 4; ++q) acc[r][q] = fmaf(as[kk][ty * TM + r], ws[kk][tx * 4 + q], acc[r][q]);
    __syncthreads();
  }
  for (int r = 0; r < TM; ++r)
    for (int q = 0; q < 4; ++q) {
      const int row = row0 + ty * TM + r, col = col0 + tx * 4 + q;
      if (row < m && col < n) c[(long long)row * n + col] = acc[r][q];
    }
}

// RMSNorm with 16 threads per row: lane i sums x[j]^2 for j = i mod 16 in
// order, the xor butterfly adds the lanes as fixed::tree_sum16 does; the same
// bits as the CPU's RmsNormOp, without one thread walking a whole row.
constexpr int kNormLanes = 16;

__global__ void rmsnorm_kernel(const float* __restrict__ x, const float* __restrict__ weight, float* out, int rows,
                               int dim, float epsilon) {
  const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long row = thread / kNormLanes;
  const int lane = int(thread % kNormLanes);
  if (row >= rows) return;  // whole 16-lane groups leave together (blockDim is a multiple of 16)
  const float* xr = x + row * dim;
  float ss = 0.0f;
  for (int j = lane; j < dim; j += kNormLanes) ss += xr[j] * xr[j];
  const unsigned group = 0xffffu << (threadIdx.x & 16);  // this half-warp
  for (int off = 8; off >= 1; off /= 2) ss = ss + __shfl_xor_sync(group, ss, off, kNormLanes);
  ss /= dim;
  ss += epsilon;
  ss = 1.0f / sqrtf(ss);
  float* o = out + row * dim;
  // A lane reads and writes only its own indices j, so out may equal x.
  for (int j = lane; j < dim; j += kNormLanes) o[j] = weight[j] * (ss * xr[j]);
}

// Head elements per lane of attention_kernel: head_size <= 32 * kMaxPerLane.
constexpr int kMaxPerLane = 8;

// One warp per (row, query head). Lanes 0-15 score the 16 positions of a key
// tile (each a sequential fmaf chain over the head), the tile's sum is the
// xor-butterfly over those 16 lanes (fixed::tree_sum16's tree), and lane L
// accumulates the outputs j = L + 32i, positions in order: fixed_math.h's rule.
__global__ void attention_kernel(const float* __restrict__ q, float* __restrict__ out, PagedKv kv, int layer,
                                 const int* __restrict__ positions, int rows, int n_heads, int group, int hs) {
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= (long long)rows * n_heads) return;
  const int row = int(warp / n_heads), h = int(warp % n_heads), kvh = h / group;
  const int pos = positions[row];
  const float* qh = q + (long long)row * n_heads * hs + (long long)h * hs;
  const float sqrt_hs = sqrtf(float(hs));
  constexpr int T = fixed::kKeyTile;
  float o[kMaxPerLane];
  for (int i = 0; i < kMaxPerLane; ++i) o[i] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (int t0 = 0; t0 <= pos; t0 += T) {
    const int valid = min(T, pos - t0 + 1);
    const bool scores = lane < valid;
    float s = -INFINITY;
    // The tile's K, [kv_dim][16] (gpu/kv_layout.h): lane t reads position
    // t0 + t, the 16 lanes 64 consecutive bytes per dimension.
    const float* kt = kv_layout::layer_region(kv, layer, row, t0) +
                      kv_layout::k_index(kv.kv_dim, t0 % kv.block_size, kvh * hs);
    if (scores) {
      float acc = 0.0f;
      for (int j = 0; j < hs; ++j) acc = fmaf(qh[j], kt[j * T + lane], acc);
      s = acc / sqrt_hs;
    }
    float tile_max = s;
    for (int off = 16; off >= 1; off /= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
    const float m_new = m > tile_max ? m : tile_max;
    const float corr = fixed::fixed_exp(m - m_new);
    const float p = scores ? fixed::fixed_exp(s - m_new) : 0.0f;
    float sum = p;
    for (int off = 8; off >= 1; off /= 2) sum = sum + __shfl_xor_sync(0xffffffffu, sum, off);
    sum = __shfl_sync(0xffffffffu, sum, 0);
    l = l * corr;
    l = l + sum;
    for (int i = 0; i < kMaxPerLane; ++i) o[i] = o[i] * corr;
    for (int t = 0; t < valid; ++t) {
      const float pt = __shfl_sync(0xffffffffu, p, t);
      const int pos_t = t0 + t;
      const float* vr = kv_layout::layer_region(kv, layer, row, pos_t) +
                        kv_layout::v_index(kv, pos_t % kv.block_size) + (long long)kvh * hs;
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int j = lane + 32 * i;
        if (j < hs) o[i] = fmaf(pt, vr[j], o[i]);
      }
    }
    m = m_new;
  }
  float* dst = out + (long long)row * n_heads * hs + (long long)h * hs;
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int j = lane + 32 * i;
    if (j < hs) dst[j] = o[i] / l;
  }
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    check(cudaSetDevice(device_), "cudaSetDevice");
    cudaDeviceProp prop{};
    check(cudaGetDeviceProperties(&prop, device_), "cudaGetDeviceProperties");
    name_ = std::string("cuda:") + prop.name;
    check(cudaStreamCreate(&stream_), "cudaStreamCreate");
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

  size_t packed_floats(int n, int k) const override { return size_t(n) * size_t(k); }  // row-major
  void pack_matrix(const float* host_w, float* packed, int n, int k) override {
    upload(packed, host_w, size_t(n) * size_t(k) * sizeof(float));
  }
  void matmul(const float* a, const float* w, float* c, int m, int n, int k) override {
    if (m <= 0 || n <= 0) return;
    activate();
    const dim3 threads(16, 16);
    if (m <= 16) {  // decode steps: tiles of 16 rows
      matmul_kernel<1><<<dim3((n + 63) / 64, (m + 15) / 16), threads, 0, stream_>>>(a, w, c, m, n, k);
    } else {
      matmul_kernel<4><<<dim3((n + 63) / 64, (m + 63) / 64), threads, 0, stream_>>>(a, w, c, m, n, k);
    }
    check(cudaGetLastError(), "matmul kernel launch");
  }
  void embedding(const float* table, const int* tokens, float* out, int rows, int dim) override {
    activate();
    run_thrust("embedding", [&] { cuda_kernels::embedding(stream_policy(stream_), table, tokens, out, rows, dim); });
  }
  void rmsnorm(const float* x, const float* weight, float* out, int rows, int dim, float epsilon) override {
    if (rows <= 0) return;
    activate();
    constexpr int kThreads = 128;
    const long long threads = (long long)rows * kNormLanes;
    rmsnorm_kernel<<<unsigned((threads + kThreads - 1) / kThreads), kThreads, 0, stream_>>>(x, weight, out, rows,
                                                                                               dim, epsilon);
    check(cudaGetLastError(), "rmsnorm kernel launch");
  }
  void rope(float* x, const int* positions, const float* table, int rows, int n_heads, int head_size,
            bool neox) override {
    activate();
    run_thrust("rope", [&] {
      cuda_kernels::rope(stream_policy(stream_), x, positions, table, rows, n_heads, head_size, neox);
    });
  }
  void swiglu(float* gate, const float* up, size_t n) override {
    activate();
    run_thrust("swiglu", [&] { cuda_kernels::swiglu(stream_policy(stream_), gate, up, n); });
  }
  void add(float* x, const float* y, size_t n) override {
    activate();
    run_thrust("add", [&] { cuda_kernels::add(stream_policy(stream_), x, y, n); });
  }
  void add_bias(float* x, const float* bias, int rows, int n) override {
    activate();
    run_thrust("add_bias", [&] { cuda_kernels::add_bias(stream_policy(stream_), x, bias, rows, n); });
  }
  void kv_write(const PagedKv& kv, int layer, const float* k, const float* v, const int* positions,
                int rows) override {
    activate();
    run_thrust("kv_write", [&] { cuda_kernels::kv_write(stream_policy(stream_), kv, layer, k, v, positions, rows); });
  }
  void attention(const float* q, float* out, const PagedKv& kv, int layer, const int* positions, int rows,
                 int n_heads, int n_kv_heads, int head_size) override {
    if (rows <= 0) return;
    if (head_size > 32 * kMaxPerLane)
      throw Error("cuda backend: attention supports head_size <= " + std::to_string(32 * kMaxPerLane) + ", got " +
                  std::to_string(head_size));
    activate();
    const long long warps = (long long)rows * n_heads;
    constexpr int kThreads = 128;
    attention_kernel<<<unsigned((warps * 32 + kThreads - 1) / kThreads), kThreads, 0, stream_>>>(
        q, out, kv, layer, positions, rows, n_heads, n_heads / n_kv_heads, head_size);
    check(cudaGetLastError(), "attention kernel launch");
  }

 private:
  // The calling thread may differ from call to call (actors migrate).
  void activate() { check(cudaSetDevice(device_), "cudaSetDevice"); }

  // Frees the stream (may be null); errors are ignored.
  void release() {
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
    cudaGetLastError();
  }

  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
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
