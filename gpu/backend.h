// A compute backend: device memory plus the operations of the transformer
// forward pass. Two implementations share one Thrust kernel source
// (gpu/kernels.inl): the CPU backend (OpenMP + OpenBLAS) and the CUDA backend
// (CUDA + cuBLAS). All pointers passed to the operations are device pointers
// of the same backend; all matrices are row-major.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <utility>

#include "gpu/error.h"
#include "gpu/quant.h"

namespace disagg::gpu {

// Where attention reads and kv_write stores K and V: a paged pool whose blocks
// each hold `block_size` positions (a multiple of kv_layout::kTile) of every
// layer. The memory is one plane per (layer, K or V), each holding that part
// of every block in block order (gpu/kv_layout.h): K in tiles of 16
// positions, each tile [kv_dim][16] (a key tile's values of one dimension
// side by side, as attention reads them), V as [position][kv_dim]. So a run
// of consecutive blocks is one contiguous range per plane (one piece of a
// streamed KV transfer). Row r's blocks are tables[r * table_stride + i] for
// its positions [i*block_size, (i+1)*block_size). A per-request cache (a
// prefill's) is the special case of one block of block_size >= n_positions
// and table {0}.
struct PagedKv {
  float* data = nullptr;       // start of the pool (device)
  int block_size = 0;          // positions per block, a multiple of kv_layout::kTile
  int num_blocks = 0;          // blocks in the pool: each plane holds this many
  int kv_dim = 0;              // n_kv_heads * head_size
  const int* tables = nullptr; // block ids (device)
  int table_stride = 0;        // ints between rows' tables; 0 = all rows share one table
};

class Backend {
 public:
  // Defined inline so the CUDA library, linked after disagg_gpu, needs nothing from it.
  virtual ~Backend() = default;

  // "cpu" or "cuda:<device name>".
  virtual std::string name() const = 0;
  // True when device pointers are host pointers (the CPU backend): a caller
  // may then read and write them directly instead of copying.
  virtual bool host_memory() const { return false; }
  // The name and version of the layout pack_matrix, pack_matrix16 and
  // pack_quantized write, for a host-memory backend whose packed weights may
  // be kept in a file (engine/weight_cache.h): e.g. "cpu-tiles-1". "": none.
  virtual std::string weight_layout() const { return ""; }

  // ---- memory (bytes; throws Error when an allocation fails)
  virtual void* alloc_bytes(size_t bytes) = 0;
  virtual void free_bytes(void* ptr) = 0;  // nullptr is ignored
  virtual void upload(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual void download(void* host_dst, const void* device_src, size_t bytes) = 0;  // waits for pending work
  virtual void copy(void* device_dst, const void* device_src, size_t bytes) = 0;
  virtual void synchronize() = 0;

  // ---- weights
  // Floats a weight matrix W[n][k] ("out x in") takes in this backend's own
  // layout (the CPU packs it in panels; CUDA keeps it row-major).
  virtual size_t packed_floats(int n, int k) const = 0;
  // Stores the row-major host matrix W[n][k] at `packed` (packed_floats(n, k) floats).
  virtual void pack_matrix(const float* host_w, float* packed, int n, int k) = 0;
  // The same for a matrix of 16-bit floats (f16, bf16): packed_floats(n, k)
  // 16-bit values, for matmul16. A backend without these kernels says so.
  virtual void pack_matrix16(const uint16_t* host_w, uint16_t* packed, int n, int k) {
    (void)host_w, (void)packed, (void)n, (void)k;
    throw Error(name() + ": no f16 / bf16 kernels (the CPU backend has them)");
  }

  // ---- operations (the arithmetic of each is fixed: gpu/fixed_math.h)
  // C[m,n] = A[m,k] W^T with W from pack_matrix: y = x W^T for a batch of rows.
  // Each element sums over k in order with one FMA per term, so a row's result
  // does not depend on m or on the other rows.
  virtual void matmul(const float* a, const float* packed_w, float* c, int m, int n, int k) = 0;
  // matmul for W of 16-bit floats (`type` f16 or bf16) from pack_matrix16:
  // each weight widened (exact), then the same fixed order as matmul.
  virtual void matmul16(WeightType type, const float* a, const uint16_t* packed_w, float* c, int m, int n, int k) {
    (void)a, (void)packed_w, (void)c, (void)m, (void)n, (void)k;
    throw Error(name() + ": no " + to_string(type) + " kernels (the CPU backend has them)");
  }
  // out[r] = table[tokens[r]] (rows of dim floats).
  virtual void embedding(const float* table, const int* tokens, float* out, int rows, int dim) = 0;

  // ---- quantized weights (gpu/quant.h; the rule: fixed_math.h). W[n][k] in
  // ggml's blocks of `type`, kept in its type, in the backend's layout
  // (pack_quantized: the CPU's tiles, cpu/cpu_kernels.h; CUDA's the rows as
  // stored). A backend without these kernels says so. C[m,n] = A[m,k] W^T.
  // Bytes of W in this backend's layout (default: the rows as stored).
  virtual size_t quantized_bytes(WeightType type, int n, int k) const { return size_t(n) * row_bytes(type, k); }
  // W's rows as the file stores them (host memory) into `dst` (quantized_bytes, device memory).
  virtual void pack_quantized(WeightType type, const void* host_rows, void* dst, int n, int k) {
    upload(dst, host_rows, quantized_bytes(type, n, k));
  }
  virtual void matmul_quantized(WeightType type, const float* a, const void* w, float* c, int m, int n, int k) {
    (void)a, (void)w, (void)c, (void)m, (void)n, (void)k;
    throw Error(name() + ": no " + to_string(type) + " kernels (the CPU backend has them)");
  }
  // out[r] = row tokens[r] of a table stored in `type` (not f32) as floats
  // (dequantize_row: d * q, one multiply a value; f16, bf16 widened).
  virtual void embedding_quantized(WeightType type, const void* table, const int* tokens, float* out, int rows, int dim) {
    (void)table, (void)tokens, (void)out, (void)rows, (void)dim;
    throw Error(name() + ": no " + to_string(type) + " kernels (the CPU backend has them)");
  }
  // out[r] = weight * x[r] / sqrt(mean(x[r]^2) + epsilon) (ModelConfig::rms_epsilon); out may equal x.
  virtual void rmsnorm(const float* x, const float* weight, float* out, int rows, int dim, float epsilon) = 0;
  // Rotary embedding in place, row r at position positions[r]: pair i within
  // each head ((2i, 2i+1), or with `neox` (i, i + head_size/2)) rotated by the
  // angle pos * theta^(-2i/head_size) (ModelConfig::rope_theta, rope_factors),
  // whose cosine and sine are rope_table[(pos * head_size/2 + i) * 2 + {0, 1}].
  virtual void rope(float* x, const int* positions, const float* rope_table, int rows, int n_heads,
                    int head_size, bool neox) = 0;
  // gate[i] = silu(gate[i]) * up[i] (fixed::swiglu).
  virtual void swiglu(float* gate, const float* up, size_t n) = 0;
  // x[i] += y[i].
  virtual void add(float* x, const float* y, size_t n) = 0;
  // x[r][j] += bias[j] for each of `rows` rows of n.
  virtual void add_bias(float* x, const float* bias, int rows, int n) = 0;
  // Stores row r of k and v (kv_dim floats each) at position positions[r] of
  // `layer` in row r's blocks.
  virtual void kv_write(const PagedKv& kv, int layer, const float* k, const float* v, const int* positions,
                        int rows) = 0;
  // Causal attention of `layer`: for row r and query head h, softmax of
  // q.k / sqrt(head_size) over positions [0, positions[r]] against kv head
  // h / (n_heads / n_kv_heads), then the weighted sum of V into out; tiled
  // with an online softmax (fixed_math.h), scratch bounded by threads x tile.
  // q, out: rows x (n_heads*head_size).
  virtual void attention(const float* q, float* out, const PagedKv& kv, int layer, const int* positions, int rows,
                         int n_heads, int n_kv_heads, int head_size) = 0;

  // "cpu (avx512 kernels, 2 threads)", "cuda:<device name>": for logs and benchmarks.
  virtual std::string describe() const { return name(); }
};

// A typed, growable allocation on a backend (scratch buffers of the engine).
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(Backend& backend, size_t n = 0) : backend_(&backend) { ensure(n); }
  ~DeviceArray() { backend_->free_bytes(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept
      : backend_(o.backend_), ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}

  // Grows to at least n elements; the contents are lost when it grows.
  T* ensure(size_t n) {
    if (n > size_) {
      backend_->free_bytes(ptr_);
      ptr_ = nullptr;
      size_ = 0;
      ptr_ = static_cast<T*>(backend_->alloc_bytes(n * sizeof(T)));
      size_ = n;
    }
    return ptr_;
  }
  T* get() const { return ptr_; }
  size_t size() const { return size_; }
  void upload(const T* host, size_t n) { backend_->upload(ensure(n), host, n * sizeof(T)); }
  void download(T* host, size_t n) const { backend_->download(host, ptr_, n * sizeof(T)); }

 private:
  Backend* backend_;
  T* ptr_ = nullptr;
  size_t size_ = 0;
};

// Number of usable CUDA devices; 0 when built without CUDA or none is present.
int cuda_device_count();

// The CPU backend with the kernels of `isa` ("generic", "avx2", "avx512"; ""
// = DISAGG_CPU_ISA or the widest this CPU runs). Throws Error if it cannot.
std::unique_ptr<Backend> make_cpu_backend(const std::string& isa = "");

// "auto": CUDA device 0 when cuda_device_count() > 0, else CPU; "cpu"; "cuda"
// (throws Error when there is no CUDA device). Throws Error on any other name.
std::unique_ptr<Backend> make_backend(const std::string& name);

}  // namespace disagg::gpu
