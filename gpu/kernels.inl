// The elementwise and per-row kernels of the forward pass, written once as
// Thrust functors and compiled twice: by gpu/backend_cpu.cpp with an OpenMP
// policy and by gpu/backend_cuda.cu with a CUDA policy. The GEMMs are not here:
// they go to OpenBLAS / cuBLAS.
//
// How to include: first include <cmath>, <thrust/for_each.h>,
// <thrust/iterator/counting_iterator.h> and gpu/backend.h at global scope, then
// include this file inside a namespace of its own (cpu_kernels, cuda_kernels),
// so the two instantiations never share a symbol. This file includes nothing.
//
// Each functor handles one index of a flat iteration space; the comments name
// what one index is. Float operations mirror llama2.c's run.c so that the
// reference outputs are reproduced token for token.

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

HD inline void softmax_inplace(float* x, int n) {
  float max_val = x[0];
  for (int i = 1; i < n; ++i) max_val = x[i] > max_val ? x[i] : max_val;
  float sum = 0.0f;
  for (int i = 0; i < n; ++i) {
    x[i] = expf(x[i] - max_val);
    sum += x[i];
  }
  for (int i = 0; i < n; ++i) x[i] /= sum;
}

// K of `layer` at position `pos` of row `row` (kv_dim floats); V follows
// block_size * kv_dim floats later.
HD inline float* paged_k(const ::disagg::gpu::PagedKv& kv, int layer, Index row, int pos) {
  const Index block = kv.tables[row * kv.table_stride + pos / kv.block_size];
  return kv.data + block * kv.block_stride +
         (Index(layer) * 2 * kv.block_size + pos % kv.block_size) * Index(kv.kv_dim);
}
HD inline Index paged_v_offset(const ::disagg::gpu::PagedKv& kv) { return Index(kv.block_size) * kv.kv_dim; }

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
  HD void operator()(Index row) const {
    const float* xr = x + row * dim;
    float ss = 0.0f;
    for (int j = 0; j < dim; ++j) ss += xr[j] * xr[j];
    ss /= dim;
    ss += 1e-5f;
    ss = 1.0f / sqrtf(ss);
    float* o = out + row * dim;
    for (int j = 0; j < dim; ++j) o[j] = weight[j] * (ss * xr[j]);
  }
};

struct RopeOp {  // index: one (row, head, pair)
  float* x;
  const int* positions;
  int n_heads;
  int head_size;
  HD void operator()(Index i) const {
    const int half = head_size / 2;
    const int pair = int(i % half);
    const Index row_head = i / half;
    const int head = int(row_head % n_heads);
    const Index row = row_head / n_heads;
    const int head_dim = 2 * pair;
    const float freq = 1.0f / powf(10000.0f, head_dim / float(head_size));
    const float val = positions[row] * freq;
    const float fcr = cosf(val);
    const float fci = sinf(val);
    float* v = x + (row * n_heads + head) * head_size + head_dim;
    const float v0 = v[0];
    const float v1 = v[1];
    v[0] = v0 * fcr - v1 * fci;
    v[1] = v0 * fci + v1 * fcr;
  }
};

struct SwiGluOp {  // index: one float
  float* gate;
  const float* up;
  HD void operator()(Index i) const {
    float g = gate[i];
    g *= 1.0f / (1.0f + expf(-g));
    gate[i] = g * up[i];
  }
};

struct AddOp {  // index: one float
  float* x;
  const float* y;
  HD void operator()(Index i) const { x[i] += y[i]; }
};

struct SoftmaxRowsOp {  // index: one row
  float* x;
  int cols;
  HD void operator()(Index row) const { softmax_inplace(x + row * cols, cols); }
};

struct KvWriteOp {  // index: one (row, element of kv_dim)
  ::disagg::gpu::PagedKv kv;
  int layer;
  const float* k;
  const float* v;
  const int* positions;
  HD void operator()(Index i) const {
    const Index row = i / kv.kv_dim;
    const int e = int(i % kv.kv_dim);
    float* dst = paged_k(kv, layer, row, positions[row]);
    dst[e] = k[i];
    dst[paged_v_offset(kv) + e] = v[i];
  }
};

struct AttentionScoresOp {  // index: one (row, query head, position < max_ctx)
  const float* q;
  ::disagg::gpu::PagedKv kv;
  int layer;
  const int* positions;
  int n_heads;
  int kv_group;
  int head_size;
  float* scores;
  int max_ctx;
  HD void operator()(Index i) const {
    const int t = int(i % max_ctx);
    const Index row_head = i / max_ctx;
    const Index row = row_head / n_heads;
    const int head = int(row_head % n_heads);
    if (t > positions[row]) {  // beyond this row's context: never read
      scores[i] = 0.0f;
      return;
    }
    const float* qh = q + row_head * head_size;
    const float* kh = paged_k(kv, layer, row, t) + (head / kv_group) * head_size;
    float score = 0.0f;
    for (int j = 0; j < head_size; ++j) score += qh[j] * kh[j];
    scores[i] = score / sqrtf(float(head_size));
  }
};

struct AttentionSoftmaxOp {  // index: one (row, query head)
  const int* positions;
  int n_heads;
  float* scores;
  int max_ctx;
  HD void operator()(Index row_head) const {
    softmax_inplace(scores + row_head * max_ctx, positions[row_head / n_heads] + 1);
  }
};

struct AttentionValuesOp {  // index: one (row, query head, element of head)
  float* out;
  ::disagg::gpu::PagedKv kv;
  int layer;
  const int* positions;
  int n_heads;
  int kv_group;
  int head_size;
  const float* scores;
  int max_ctx;
  HD void operator()(Index i) const {
    const int e = int(i % head_size);
    const Index row_head = i / head_size;
    const Index row = row_head / n_heads;
    const int head = int(row_head % n_heads);
    const float* att = scores + row_head * max_ctx;
    const Index v_offset = paged_v_offset(kv) + (head / kv_group) * head_size + e;
    float acc = 0.0f;
    const int ctx = positions[row] + 1;
    for (int t = 0; t < ctx; ++t) acc += att[t] * paged_k(kv, layer, row, t)[v_offset];
    out[i] = acc;
  }
};

// ---------------------------------------------------------------- entry points

template <class Policy>
void embedding(const Policy& p, const float* table, const int* tokens, float* out, int rows, int dim) {
  launch(p, Index(rows) * dim, EmbeddingOp{table, tokens, out, dim});
}

template <class Policy>
void rmsnorm(const Policy& p, const float* x, const float* weight, float* out, int rows, int dim) {
  launch(p, rows, RmsNormOp{x, weight, out, dim});
}

template <class Policy>
void rope(const Policy& p, float* x, const int* positions, int rows, int n_heads, int head_size) {
  launch(p, Index(rows) * n_heads * (head_size / 2), RopeOp{x, positions, n_heads, head_size});
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
void softmax_rows(const Policy& p, float* x, int rows, int cols) {
  if (cols <= 0) return;
  launch(p, rows, SoftmaxRowsOp{x, cols});
}

template <class Policy>
void kv_write(const Policy& p, const ::disagg::gpu::PagedKv& kv, int layer, const float* k, const float* v,
              const int* positions, int rows) {
  launch(p, Index(rows) * kv.kv_dim, KvWriteOp{kv, layer, k, v, positions});
}

// Three passes (scores, softmax, weighted values) so every pass has
// rows * heads * (positions or head elements) independent indices.
template <class Policy>
void attention(const Policy& p, const float* q, float* out, const ::disagg::gpu::PagedKv& kv, int layer,
               const int* positions, int rows, int n_heads, int n_kv_heads, int head_size, float* scores,
               int max_ctx) {
  const int kv_group = n_heads / n_kv_heads;
  const Index row_heads = Index(rows) * n_heads;
  launch(p, row_heads * max_ctx,
         AttentionScoresOp{q, kv, layer, positions, n_heads, kv_group, head_size, scores, max_ctx});
  launch(p, row_heads, AttentionSoftmaxOp{positions, n_heads, scores, max_ctx});
  launch(p, row_heads * head_size,
         AttentionValuesOp{out, kv, layer, positions, n_heads, kv_group, head_size, scores, max_ctx});
}
