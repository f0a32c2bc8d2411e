// The elementwise and per-row kernels of the forward pass, written once as
// Thrust functors and compiled twice: by gpu/backend_cpu.cpp with an OpenMP
// policy and by gpu/backend_cuda.cu with a CUDA policy. The GEMMs are not here:
// and attention are backend-specific (gpu/cpu/ for the CPU, gpu/backend_cuda.cu).
//
// How to include: first include <cmath>, <thrust/for_each.h>,
// <thrust/iterator/counting_iterator.h>, gpu/backend.h, gpu/fixed_math.h and gpu/kv_layout.h at global scope, then
// include this file inside a namespace of its own (cpu_kernels, cuda_kernels),
// so the two instantiations never share a symbol. This file includes nothing.
//
// Each functor handles one index of a flat iteration space; the comments name
// what one index is. Float operations mirror llama2.c's run.c, with the
// fixed exp of gpu/fixed_math.h, so both backends compute the same bits.

#ifndef HD
#ifdef __CUDACC__
#define HD __host__ __device__
#else
#define HD
#endif
#endif

using Index = long long;

// Runs f(i) for i in [0, n) under `policy`.
template <class Policy, class F>
void launch(const Policy& policy, Index n, const F& f) {
  if (n <= 0) return;
  thrust::for_each(policy, thrust::counting_iterator<Index>(0), thrust::counting_iterator<Index>(n), f);
}

// ---------------------------------------------------------------- shared helpers

// ---------------------------------------------------------------- functors

struct EmbeddingOp {  // index: one output float
  const float* table;
  const int* tokens;
  float* out;
  int dim;
  HD void operator()(Index i) const {
    const Index row = i / dim;
    out[i] = table[Index(tokens[row]) * dim + i % dim];
  }
};

struct RmsNormOp {  // index: one row
  const float* x;
  const float* weight;
  float* out;
  int dim;
  float epsilon;  // ModelConfig::rms_epsilon
  HD void operator()(Index row) const {
    const float* xr = x + row * dim;
    // Sum of squares in 16 lanes (lane i: j = i mod 16, in order), then
    // fixed::tree_sum16: the order a 16-thread reduction can repeat.
    float lanes[16];
    for (int i = 0; i < 16; ++i) lanes[i] = 0.0f;
    for (int j = 0; j < dim; ++j) lanes[j % 16] += xr[j] * xr[j];
    float ss = ::disagg::gpu::fixed::tree_sum16(lanes);
    ss /= dim;
    ss += epsilon;
    ss = 1.0f / sqrtf(ss);
    float* o = out + row * dim;
    for (int j = 0; j < dim; ++j) o[j] = weight[j] * (ss * xr[j]);
  }
};

struct RopeOp {  // index: one (row, head, pair)
  float* x;
  const int* positions;
  const float* table;  // [position][pair][cos, sin]
  int n_heads;
  int head_size;
  bool neox;  // pair i is (i, i + head_size/2), else (2i, 2i + 1)
  HD void operator()(Index i) const {
    const int half = head_size / 2;
    const int pair = int(i % half);
    const Index row_head = i / half;
    const int head = int(row_head % n_heads);
    const Index row = row_head / n_heads;
    const float* cs = table + (Index(positions[row]) * half + pair) * 2;
    const float fcr = cs[0];
    const float fci = cs[1];
    float* head_x = x + (row * n_heads + head) * head_size;
    float* a = neox ? head_x + pair : head_x + 2 * pair;
    float* b = neox ? head_x + pair + half : head_x + 2 * pair + 1;
    const float v0 = *a;
    const float v1 = *b;
    *a = v0 * fcr - v1 * fci;
    *b = v0 * fci + v1 * fcr;
  }
};

struct SwiGluOp {  // index: one float
  float* gate;
  const float* up;
  HD void operator()(Index i) const { gate[i] = ::disagg::gpu::fixed::swiglu(gate[i], up[i]); }
};

struct AddOp {  // index: one float
  float* x;
  const float* y;
  HD void operator()(Index i) const { x[i] += y[i]; }
};

struct AddBiasOp {  // index: one float of a [rows][n] matrix
  float* x;
  const float* bias;  // [n]
  int n;
  HD void operator()(Index i) const { x[i] += bias[i % n]; }
};

struct KvWriteOp {  // index: one (row, element of kv_dim)
  ::disagg::gpu::PagedKv kv;
  int layer;
  const float* k;
  const float* v;
  const int* positions;
  HD void operator()(Index i) const {
    namespace kvl = ::disagg::gpu::kv_layout;
    const Index row = i / kv.kv_dim;
    const int e = int(i % kv.kv_dim);
    const int pos = positions[row];
    float* region = kvl::layer_region(kv, layer, row, pos);
    const int p = pos % kv.block_size;
    region[kvl::k_index(kv.kv_dim, p, e)] = k[i];
    region[kvl::v_index(kv, p) + e] = v[i];
  }
};

// ---------------------------------------------------------------- entry points

template <class Policy>
void embedding(const Policy& p, const float* table, const int* tokens, float* out, int rows, int dim) {
  launch(p, Index(rows) * dim, EmbeddingOp{table, tokens, out, dim});
}

template <class Policy>
void rmsnorm(const Policy& p, const float* x, const float* weight, float* out, int rows, int dim, float epsilon) {
  launch(p, rows, RmsNormOp{x, weight, out, dim, epsilon});
}

template <class Policy>
void rope(const Policy& p, float* x, const int* positions, const float* table, int rows, int n_heads,
          int head_size, bool neox) {
  launch(p, Index(rows) * n_heads * (head_size / 2), RopeOp{x, positions, table, n_heads, head_size, neox});
}

template <class Policy>
void swiglu(const Policy& p, float* gate, const float* up, size_t n) {
  launch(p, Index(n), SwiGluOp{gate, up});
}

template <class Policy>
void add(const Policy& p, float* x, const float* y, size_t n) {
  launch(p, Index(n), AddOp{x, y});
}

template <class Policy>
void add_bias(const Policy& p, float* x, const float* bias, int rows, int n) {
  launch(p, Index(rows) * n, AddBiasOp{x, bias, n});
}

template <class Policy>
void kv_write(const Policy& p, const ::disagg::gpu::PagedKv& kv, int layer, const float* k, const float* v,
              const int* positions, int rows) {
  launch(p, Index(rows) * kv.kv_dim, KvWriteOp{kv, layer, k, v, positions});
}
