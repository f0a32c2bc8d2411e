// The CUDA backend: device memory from cudaMalloc, the shared Thrust kernels
// under a CUDA policy on the backend's stream, and CUDA kernels of its own for
// the matrix products and attention, in the fixed arithmetic of
// gpu/fixed_math.h (so they give the CPU backend's bits; cuBLAS picks its
// summation order by problem size and could not). Everything is queued on one
// stream; download() and synchronize() wait for it.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <thrust/for_each.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/system/cuda/execution_policy.h>
#include <thrust/system_error.h>

#include "gpu/backend.h"
#include "gpu/backend_cuda.h"
#include "gpu/quant_blocks.h"
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
// over k: the fixed rule, whatever the tiling. W is row-major F32, or F16 or
// BF16 (`W` the 16-bit type), each weight widened exactly as it is staged:
// the same chain over the same floats as the CPU's matmul16.
constexpr int kTileK = 16;

template <WeightType W>
__device__ __forceinline__ float widen(float w) { return w; }
template <WeightType W>
__device__ __forceinline__ float widen(uint16_t h) {
  static_assert(W == WeightType::f16 || W == WeightType::bf16, "a 16-bit float type");
  if constexpr (W == WeightType::f16) {
    return blocks::half_bits_to_float(h);
  } else {
    const uint32_t bits = uint32_t(h) << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
  }
}

template <int TM, WeightType W = WeightType::f32, class Elem = float>
__global__ void matmul_kernel(const float* __restrict__ a, const Elem* __restrict__ w, float* __restrict__ c, int m,
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
      ws[kk][col] = (col0 + col < n && kk < kk_n) ? widen<W>(w[(long long)(col0 + col) * k + k0 + kk]) : 0.0f;
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

// ---------------------------------------------------------------- quantized weights
// The rows as the file stores them (the Backend's default quantized_bytes
// and pack_quantized: uploaded as they are). The rule of fixed_math.h: each
// activation row quantized per block by the CPU's very functions
// (fixed::quantize_q8_block, quantize_q8k_block), then one thread an output:
// each block's integer products summed exactly, the blocks added in order
// with the rule's fmaf (two for the K-quants' mins): the CPU's bits. Plain
// and uncoalesced (a thread walks its own weight row); scripts/gpu-check
// times it.

__global__ void quantize_q8_kernel(const float* __restrict__ a, long long blocks, float* scales, int8_t* q) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;  // row r, block b: r * k/32 + b
  if (i < blocks) scales[i] = fixed::quantize_q8_block(a + i * kQ8Block, q + i * kQ8Block);
}

__global__ void quantize_q8k_kernel(const float* __restrict__ a, long long blocks, float* d, int8_t* q,
                                    int16_t* bsums) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;  // row r, superblock b
  if (i < blocks) d[i] = fixed::quantize_q8k_block(a + i * kQK, q + i * kQK, bsums + i * (kQK / 16));
}

template <WeightType T>
__global__ void matmul_q8_kernel(const float* __restrict__ scales, const int8_t* __restrict__ qa,
                                 const uint8_t* __restrict__ w, float* __restrict__ c, int m, int n, int k) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= n) return;
  constexpr int kBytes = T == WeightType::q8_0 ? 34 : 18;
  const int blocks = k / kQ8Block;
  const uint8_t* row = w + (long long)col * blocks * kBytes;
  for (int r = blockIdx.y; r < m; r += gridDim.y) {
    const int8_t* a = qa + (long long)r * k;
    float acc = 0.0f;
    for (int b = 0; b < blocks; ++b) {
      const uint8_t* y = row + (long long)b * kBytes;
      int isum = 0;
      for (int j = 0; j < kQ8Block; ++j) isum += blocks::value(T, y, j) * int(a[kQ8Block * b + j]);
      acc = fmaf(float(isum), blocks::d_of(T, y) * scales[(long long)r * blocks + b], acc);
    }
    c[(long long)r * n + col] = acc;
  }
}

template <WeightType T>
__global__ void matmul_k_kernel(const float* __restrict__ d, const int8_t* __restrict__ qa,
                                const int16_t* __restrict__ bsums, const uint8_t* __restrict__ w,
                                float* __restrict__ c, int m, int n, int k) {
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= n) return;
  constexpr int kBytes = T == WeightType::q4_k ? 144 : T == WeightType::q5_k ? 176 : 210;
  constexpr bool six = T == WeightType::q6_k;
  const int blocks = k / kQK;
  const uint8_t* row = w + (long long)col * blocks * kBytes;
  for (int r = blockIdx.y; r < m; r += gridDim.y) {
    float acc = 0.0f;
    for (int i = 0; i < blocks; ++i) {
      const uint8_t* y = row + (long long)i * kBytes;
      const long long at = (long long)r * blocks + i;
      const int8_t* a = qa + at * kQK;
      int sc[16], mn[8];
      for (int j = 0; j < (six ? 16 : 8); ++j) {
        int mj;
        blocks::scale_min(T, y, j, sc[j], mj);
        if (j < 8) mn[j] = mj;
      }
      int s1 = 0, s2 = 0;
      for (int e = 0; e < kQK; ++e) s1 += sc[six ? e / 16 : e / 32] * blocks::value(T, y, e) * int(a[e]);
      if (!six)
        for (int g = 0; g < 16; ++g) s2 += int(bsums[at * 16 + g]) * mn[g / 2];
      acc = fmaf(float(s1), blocks::d_of(T, y) * d[at], acc);
      if (!six) acc = fmaf(float(s2), -(blocks::dmin_of(T, y) * d[at]), acc);
    }
    c[(long long)r * n + col] = acc;
  }
}

// out[r][e] = value e of row tokens[r] of a table in `type`, as the CPU's
// dequantize_row computes it (d * q; Q6_K (d * scale) * q; Q4_K, Q5_K
// (d * scale) * q - dmin * min; f16, bf16 widened).
__global__ void dequantize_rows_kernel(WeightType type, const uint8_t* __restrict__ table, long long row_bytes,
                                       const int* __restrict__ tokens, float* __restrict__ out, int rows, int dim) {
  const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
  if (i >= (long long)rows * dim) return;
  const int r = int(i / dim), e = int(i % dim);
  const uint8_t* row = table + (long long)tokens[r] * row_bytes;
  float v;
  if (type == WeightType::f16 || type == WeightType::bf16) {
    const uint16_t h = uint16_t(row[2 * e] | row[2 * e + 1] << 8);
    if (type == WeightType::f16) {
      v = blocks::half_bits_to_float(h);
    } else {
      const uint32_t bits = uint32_t(h) << 16;
      memcpy(&v, &bits, 4);
    }
  } else if (type == WeightType::q8_0 || type == WeightType::q4_0) {
    const uint8_t* y = row + (long long)(e / kQ8Block) * (type == WeightType::q8_0 ? 34 : 18);
    v = blocks::d_of(type, y) * float(blocks::value(type, y, e % kQ8Block));
  } else {
    const int bytes = type == WeightType::q4_k ? 144 : type == WeightType::q5_k ? 176 : 210;
    const uint8_t* y = row + (long long)(e / kQK) * bytes;
    const int at = e % kQK;
    int sc, mn;
    blocks::scale_min(type, y, type == WeightType::q6_k ? at / 16 : at / 32, sc, mn);
    const float q = float(blocks::value(type, y, at));
    if (type == WeightType::q6_k) {
      v = blocks::d_of(type, y) * float(sc) * q;
    } else {
      const float d1 = blocks::d_of(type, y) * float(sc), m1 = blocks::dmin_of(type, y) * float(mn);
      v = d1 * q - m1;
    }
  }
  out[i] = v;
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
    for (Scratch* scratch : {&scales_, &values_, &bsums_})
      if (scratch->ptr) cudaFree(scratch->ptr);
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
    launch_matmul<WeightType::f32>(a, w, c, m, n, k);
  }
  void pack_matrix16(const uint16_t* host_w, uint16_t* packed, int n, int k) override {
    upload(packed, host_w, size_t(n) * size_t(k) * sizeof(uint16_t));  // row-major, as matmul16 reads it
  }
  void matmul16(WeightType type, const float* a, const uint16_t* w, float* c, int m, int n, int k) override {
    if (type == WeightType::f16) launch_matmul<WeightType::f16>(a, w, c, m, n, k);
    else if (type == WeightType::bf16) launch_matmul<WeightType::bf16>(a, w, c, m, n, k);
    else throw Error(std::string("matmul16: ") + to_string(type) + " is not a 16-bit float type");
  }
  void matmul_quantized(WeightType type, const float* a, const void* w, float* c, int m, int n, int k) override {
    if (m <= 0 || n <= 0) return;
    if (!is_block_quantized(type) && !is_k_quant(type))
      throw Error(name_ + ": no " + to_string(type) + " matrix kernels (the CPU backend has them)");
    const int per_block = block_values(type);
    if (k % per_block != 0)
      throw Error("matmul_quantized: k = " + std::to_string(k) + " is not a multiple of " + std::to_string(per_block));
    activate();
    const long long blocks = (long long)m * (k / per_block);
    float* scales = scales_.ensure<float>(this, size_t(blocks));
    int8_t* q = values_.ensure<int8_t>(this, size_t(m) * size_t(k));
    constexpr int kThreads = 128;
    const unsigned grid_q = unsigned((blocks + kThreads - 1) / kThreads);
    const dim3 grid(unsigned((n + kThreads - 1) / kThreads), unsigned(std::min(m, 65535)));
    const auto* wb = static_cast<const uint8_t*>(w);
    if (is_block_quantized(type)) {
      quantize_q8_kernel<<<grid_q, kThreads, 0, stream_>>>(a, blocks, scales, q);
      if (type == WeightType::q8_0)
        matmul_q8_kernel<WeightType::q8_0><<<grid, kThreads, 0, stream_>>>(scales, q, wb, c, m, n, k);
      else
        matmul_q8_kernel<WeightType::q4_0><<<grid, kThreads, 0, stream_>>>(scales, q, wb, c, m, n, k);
    } else {
      int16_t* bsums = bsums_.ensure<int16_t>(this, size_t(blocks) * 16);
      quantize_q8k_kernel<<<grid_q, kThreads, 0, stream_>>>(a, blocks, scales, q, bsums);
      if (type == WeightType::q4_k)
        matmul_k_kernel<WeightType::q4_k><<<grid, kThreads, 0, stream_>>>(scales, q, bsums, wb, c, m, n, k);
      else if (type == WeightType::q5_k)
        matmul_k_kernel<WeightType::q5_k><<<grid, kThreads, 0, stream_>>>(scales, q, bsums, wb, c, m, n, k);
      else
        matmul_k_kernel<WeightType::q6_k><<<grid, kThreads, 0, stream_>>>(scales, q, bsums, wb, c, m, n, k);
    }
    check(cudaGetLastError(), "quantized matmul kernel launch");
  }
  void embedding_quantized(WeightType type, const void* table, const int* tokens, float* out, int rows,
                           int dim) override {
    if (rows <= 0) return;
    if (dim % block_values(type) != 0)
      throw Error("embedding_quantized: dim = " + std::to_string(dim) + " is not a multiple of " +
                  std::to_string(block_values(type)));
    activate();
    const long long n = (long long)rows * dim;
    constexpr int kThreads = 256;
    dequantize_rows_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, stream_>>>(
        type, static_cast<const uint8_t*>(table), (long long)row_bytes(type, dim), tokens, out, rows, dim);
    check(cudaGetLastError(), "dequantize kernel launch");
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
  // C = A W^T for W row-major in `W` (F32, F16 or BF16).
  template <WeightType W, class Elem>
  void launch_matmul(const float* a, const Elem* w, float* c, int m, int n, int k) {
    if (m <= 0 || n <= 0) return;
    activate();
    const dim3 threads(16, 16);
    if (m <= 16) {  // decode steps: tiles of 16 rows
      matmul_kernel<1, W><<<dim3((n + 63) / 64, (m + 15) / 16), threads, 0, stream_>>>(a, w, c, m, n, k);
    } else {
      matmul_kernel<4, W><<<dim3((n + 63) / 64, (m + 63) / 64), threads, 0, stream_>>>(a, w, c, m, n, k);
    }
    check(cudaGetLastError(), "matmul kernel launch");
  }

  // The calling thread may differ from call to call (actors migrate).
  void activate() { check(cudaSetDevice(device_), "cudaSetDevice"); }

  // Frees the stream (may be null); errors are ignored.
  void release() {
    if (stream_) cudaStreamDestroy(stream_);
    stream_ = nullptr;
    cudaGetLastError();
  }

  // Device scratch that only grows (the quantized products' activations).
  struct Scratch {
    void* ptr = nullptr;
    size_t bytes = 0;
    template <class T>
    T* ensure(CudaBackend* b, size_t n) {
      if (n * sizeof(T) > bytes) {
        b->free_bytes(ptr);
        ptr = nullptr, bytes = 0;
        ptr = b->alloc_bytes(n * sizeof(T));
        bytes = n * sizeof(T);
      }
      return static_cast<T*>(ptr);
    }
  };

  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  Scratch scales_, values_, bsums_;  // per block: scales (float), per value: int8, per 16 (K-quants): int16
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
