// The transformer forward pass on a Backend, shared by the batched prefill
// (rows = prompt tokens, K/V in a contiguous per-request cache) and the
// batched decode step (rows = sequences, K/V in a paged pool).
#include "engine/engine.h"

#include <xxhash.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cmath>
#include <string>

#include "gpu/backend.h"
#include "gpu/error.h"
#include "gpu/host_memory.h"
#include "gpu/kv_layout.h"
#include "engine/weight_cache.h"

namespace disagg::gpu {

namespace {

static_assert(kPrefillRows % kv_layout::kTile == 0, "a chunk starts on a key tile (PrefillHooks::on_layer_cache)");

// A request's cache (one block of `block` positions, gpu/kv_layout.h) as the
// wire layout [layer][K then V][position][kv_dim] of its first n positions.
void cache_to_wire(const float* cache, int block, int n, int layers, int kv_dim, float* out) {
  const size_t plane = size_t(n) * kv_dim;  // one layer's K (or V) on the wire
#pragma omp parallel for schedule(static) if (size_t(layers) * plane > (size_t(1) << 20))
  for (int l = 0; l < layers; ++l) {
    const float* region = cache + size_t(l) * 2 * block * kv_dim;
    float* k_out = out + size_t(l) * 2 * plane;
    for (int p = 0; p < n; ++p)
      for (int e = 0; e < kv_dim; ++e) k_out[size_t(p) * kv_dim + e] = region[kv_layout::k_index(kv_dim, p, e)];
    std::memcpy(k_out + plane, region + kv_layout::block_floats(block, kv_dim), plane * sizeof(float));
  }
}

// One vector tensor on the backend.
DeviceArray<float> upload_tensor(Backend& backend, const float* host, size_t n) {
  DeviceArray<float> a(backend, n);
  a.upload(host, n);
  return a;
}

// One n-float vector per layer (member `field` of each), layer l at l * n.
DeviceArray<float> upload_layers(Backend& backend, const std::vector<LayerWeights>& layers,
                                 const float* LayerWeights::*field, size_t n) {
  DeviceArray<float> a(backend, layers.size() * n);
  for (size_t l = 0; l < layers.size(); ++l) backend.upload(a.get() + l * n, layers[l].*field, n * sizeof(float));
  return a;
}

// Quantized bytes as the file stores them, where the backend reads them: the
// mapping itself on a backend whose memory is the host's (no copy), else
// uploaded into `storage` at `offset`.
const void* place_quantized(Backend& backend, const void* host, size_t bytes, DeviceArray<uint8_t>& storage,
                            size_t offset) {
  if (backend.host_memory()) return host;
  backend.upload(storage.get() + offset, host, bytes);
  return storage.get() + offset;
}

// Where the weight matrices go: first each one's place in one arena of bytes
// is planned (LayerMatrices' constructors, in load order), then the arena
// is filled (each matrix packed in the backend's layout) in the backend's
// memory or in a weight cache's mapping (engine/weight_cache.h), and bound.
class WeightArena {
 public:
  static constexpr size_t kAlign = 64;  // a tile's body, a panel's row

  size_t place(WeightType type, int n, int k, size_t bytes) {
    const size_t at = (bytes_ + kAlign - 1) / kAlign * kAlign;
    bytes_ = at + bytes;
    plan_.push_back({uint64_t(type), uint64_t(n), uint64_t(k), at, bytes});
    return at;
  }
  size_t bytes() const { return bytes_; }
  // Of every matrix's (type, n, k, offset, bytes): a cache made by a build
  // that places them otherwise is not read.
  uint64_t digest() const { return XXH3_64bits(plan_.data(), plan_.size() * sizeof(plan_[0])); }

 private:
  struct Place {
    uint64_t type, n, k, offset, bytes;
  };
  size_t bytes_ = 0;
  std::vector<Place> plan_;
};

// One weight matrix per layer (n x k, "out x in"; each layer in its own
// type, as a Q4_K_M file mixes them) on the backend: f32, f16 and bf16
// packed in its matmul layout, quantized ones in the backend's layout
// (pack_quantized).
class LayerMatrices {
 public:
  // Rows a matrix is packed in at a time: whole tiles and panels of the
  // CPU's layouts (16 rows), and of any backend's that keeps the file's rows.
  static constexpr int kPackSliceRows = 1024;

  LayerMatrices(Backend& backend, WeightArena& arena, const std::vector<Matrix>& per_layer, int n, int k)
      : n_(n), k_(k) {
    for (const Matrix& m : per_layer) {
      const size_t bytes = m.type == WeightType::f32  ? backend.packed_floats(n, k) * sizeof(float)
                           : is_float16(m.type)       ? backend.packed_floats(n, k) * sizeof(uint16_t)
                                                      : backend.quantized_bytes(m.type, n, k);
      layers_.push_back(Layer{m, arena.place(m.type, n, k, bytes), nullptr});
    }
  }

  // Packs every layer's matrix at its place in `arena` (backend memory). The
  // file's pages leave memory once packed (Checkpoint::release), so a model
  // is resident once, in the engine's layout: in slices of whole tiles or
  // panels, each slice's file pages released once copied, so the load holds
  // one slice of the file beside the copy (a 128,256-row classifier is a
  // fifth of a 1B model, F16 or Q4_0).
  void pack(Backend& backend, const Checkpoint& checkpoint, uint8_t* arena) const {
    for (const Layer& L : layers_) {
      const Matrix& m = L.source;
      uint8_t* dst = arena + L.offset;
      const size_t row = row_bytes(m.type, k_);
      for (int r = 0; r < n_; r += kPackSliceRows) {
        const int rows = std::min(kPackSliceRows, n_ - r);
        const auto* src = static_cast<const uint8_t*>(m.data) + size_t(r) * row;
        if (m.type == WeightType::f32)
          backend.pack_matrix(reinterpret_cast<const float*>(src), reinterpret_cast<float*>(dst) + backend.packed_floats(r, k_),
                              rows, k_);
        else if (is_float16(m.type))
          backend.pack_matrix16(reinterpret_cast<const uint16_t*>(src),
                                reinterpret_cast<uint16_t*>(dst) + backend.packed_floats(r, k_), rows, k_);
        else
          backend.pack_quantized(m.type, src, dst + backend.quantized_bytes(m.type, r, k_), rows, k_);
        checkpoint.release(src, size_t(rows) * row);  // the slice's pages, once copied
      }
    }
    release(checkpoint);  // (the pages the slices' edges shared)
  }

  // The file's pages of every layer leave memory (packed, or read from a cache).
  void release(const Checkpoint& checkpoint) const {
    for (const Layer& L : layers_) checkpoint.release(L.source.data, size_t(n_) * row_bytes(L.source.type, k_));
  }

  // The layers' data at their places in the filled arena.
  void bind(const uint8_t* arena) {
    for (Layer& L : layers_) L.data = arena + L.offset;
  }

  // c = a W_l^T for `rows` rows of a.
  void mul(Backend& b, size_t l, const float* a, float* c, int rows) const {
    const Layer& L = layers_[l];
    const WeightType type = L.source.type;
    if (type == WeightType::f32) b.matmul(a, static_cast<const float*>(L.data), c, rows, n_, k_);
    else if (is_float16(type)) b.matmul16(type, a, static_cast<const uint16_t*>(L.data), c, rows, n_, k_);
    else b.matmul_quantized(type, a, L.data, c, rows, n_, k_);
  }

 private:
  struct Layer {
    Matrix source;      // the file's matrix (its type and rows)
    size_t offset;      // its place in the arena
    const void* data;   // in the backend's layout (bind)
  };
  int n_, k_;
  std::vector<Layer> layers_;
};

std::vector<Matrix> per_layer(const std::vector<LayerWeights>& layers, Matrix LayerWeights::*field) {
  std::vector<Matrix> out;
  for (const auto& layer : layers) out.push_back(layer.*field);
  return out;
}

// cos and sin of every (position, pair) RoPE angle, as RopeOp reads them
// (ModelConfig::rope_theta and rope_factors).
DeviceArray<float> rope_table(Backend& backend, const ModelConfig& c) {
  const int seq_len = c.seq_len, head_size = c.head_size(), half = head_size / 2;
  std::vector<float> t(size_t(seq_len) * half * 2);
  for (int pos = 0; pos < seq_len; ++pos)
    for (int pair = 0; pair < half; ++pair) {
      const float freq = 1.0f / powf(c.rope_theta, float(2 * pair) / float(head_size));
      float val = float(pos) * freq;
      if (!c.rope_factors.empty()) val /= c.rope_factors[size_t(pair)];
      t[(size_t(pos) * half + pair) * 2] = cosf(val);
      t[(size_t(pos) * half + pair) * 2 + 1] = sinf(val);
    }
  return upload_tensor(backend, t.data(), t.size());
}

}  // namespace

struct Engine::Impl {
  Impl(std::shared_ptr<const Checkpoint> ckpt, const EngineOptions& options)
      : checkpoint(std::move(ckpt)),
        cfg(checkpoint->config()),
        backend(make_backend(options.backend)),
        dim(size_t(cfg.dim)),
        kv_dim(size_t(cfg.kv_dim())),
        q_dim(size_t(cfg.q_dim())),
        head(size_t(cfg.head_size())),
        hidden(size_t(cfg.hidden_dim)),
        layers(size_t(cfg.n_layers)),
        vocab(size_t(cfg.vocab_size)),
        embedding_type(weights().token_embedding.type),
        token_embedding(*backend),
        token_blocks(*backend),
        rms_att(upload_layers(*backend, weights().layers, &LayerWeights::rms_att, dim)),
        wq(*backend, arena, per_layer(weights().layers, &LayerWeights::wq), cfg.q_dim(), cfg.dim),
        wk(*backend, arena, per_layer(weights().layers, &LayerWeights::wk), cfg.kv_dim(), cfg.dim),
        wv(*backend, arena, per_layer(weights().layers, &LayerWeights::wv), cfg.kv_dim(), cfg.dim),
        wo(*backend, arena, per_layer(weights().layers, &LayerWeights::wo), cfg.dim, cfg.q_dim()),
        bq(cfg.qkv_bias() ? upload_layers(*backend, weights().layers, &LayerWeights::bq, q_dim) : DeviceArray<float>(*backend)),
        bk(cfg.qkv_bias() ? upload_layers(*backend, weights().layers, &LayerWeights::bk, kv_dim) : DeviceArray<float>(*backend)),
        bv(cfg.qkv_bias() ? upload_layers(*backend, weights().layers, &LayerWeights::bv, kv_dim) : DeviceArray<float>(*backend)),
        q_norm(cfg.qk_norm() ? upload_layers(*backend, weights().layers, &LayerWeights::q_norm, head)
                             : DeviceArray<float>(*backend)),
        k_norm(cfg.qk_norm() ? upload_layers(*backend, weights().layers, &LayerWeights::k_norm, head)
                             : DeviceArray<float>(*backend)),
        rms_ffn(upload_layers(*backend, weights().layers, &LayerWeights::rms_ffn, dim)),
        w1(*backend, arena, per_layer(weights().layers, &LayerWeights::w1), cfg.hidden_dim, cfg.dim),
        w2(*backend, arena, per_layer(weights().layers, &LayerWeights::w2), cfg.dim, cfg.hidden_dim),
        w3(*backend, arena, per_layer(weights().layers, &LayerWeights::w3), cfg.hidden_dim, cfg.dim),
        rms_final(upload_tensor(*backend, weights().rms_final, dim)),
        wcls(*backend, arena, {weights().wcls}, cfg.vocab_size, cfg.dim),
        rope(rope_table(*backend, cfg)),
        x(*backend), xb(*backend), xb2(*backend), q(*backend), k(*backend), v(*backend), hb(*backend),
        hb2(*backend), logits(*backend), prefill_kv(*backend), tokens(*backend), positions(*backend),
        tables(*backend), weight_memory(*backend) {
    place_matrices(options);
    // The embedding table: rows placed as stored (in a host backend's memory:
    // the file's own pages, read as tokens ask for them, beside the
    // classifier packed from the same matrix when it is shared); f32 rows
    // copied into a device's memory.
    const Matrix& table = weights().token_embedding;
    if (embedding_type == WeightType::f32 && !backend->host_memory()) {
      token_embedding.upload(table.f32(), vocab * dim);
      checkpoint->release(table.data, vocab * dim * sizeof(float));
    } else {
      const size_t bytes = vocab * row_bytes(embedding_type, cfg.dim);
      if (!backend->host_memory()) token_blocks.ensure(bytes);
      token_rows = place_quantized(*backend, table.data, bytes, token_blocks, 0);
    }
    backend->synchronize();
  }

  const Weights& weights() const { return checkpoint->weights(); }

  // Fills the planned arena of matrices (`arena`) and binds each to its
  // place: read from a weight cache when options ask for one and it is valid
  // (built first when not), else packed into memory of the backend's own.
  void place_matrices(const EngineOptions& options) {
    LayerMatrices* all[] = {&wq, &wk, &wv, &wo, &w1, &w2, &w3, &wcls};
    auto fill = [&](uint8_t* data) {
      for (const LayerMatrices* m : all) m->pack(*backend, *checkpoint, data);
    };
    auto log = options.log ? options.log : [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
    const uint8_t* base = nullptr;
    if (!options.weight_cache.empty() && options.weight_cache != "off") {
      if (backend->weight_layout().empty()) {
        log("weight cache: the " + backend->name() + " backend keeps weights in memory of its own; not used");
      } else {
        const WeightCacheKey key{checkpoint->path(), checkpoint->fingerprint(), backend->weight_layout(),
                                 arena.digest(), arena.bytes()};
        weight_cache = WeightCache::open(options.weight_cache, key, fill, log);
        if (weight_cache) {
          base = weight_cache->data();
          for (const LayerMatrices* m : all) m->release(*checkpoint);
        }
      }
    }
    if (!base) {
      fill(weight_memory.ensure(arena.bytes()));
      base = weight_memory.get();
    }
    for (LayerMatrices* m : all) m->bind(base);
  }

  // Gives a hook this layer's K and V rows as host memory (a copy only when
  // the backend's memory is not the host's).
  void hand_out_layer(const PrefillHooks& hooks, int layer, int first, int rows, const float* k_dev,
                      const float* v_dev) {
    const size_t n = size_t(rows) * kv_dim;
    if (backend->host_memory()) {
      hooks.on_layer_kv(layer, first, rows, k_dev, v_dev);
      return;
    }
    host_k.resize(n);
    host_v.resize(n);
    backend->download(host_k.data(), k_dev, n * sizeof(float));
    backend->download(host_v.data(), v_dev, n * sizeof(float));
    hooks.on_layer_kv(layer, first, rows, host_k.data(), host_v.data());
  }

  void validate_token(int token, const char* where) const {
    if (token < 0 || token >= cfg.vocab_size)
      throw Error(std::string(where) + ": token id " + std::to_string(token) + " is outside the vocabulary [0, " +
                  std::to_string(cfg.vocab_size) + ")");
  }
  void validate_position(int pos, const char* where) const {
    if (pos < 0 || pos >= cfg.seq_len)
      throw Error(std::string(where) + ": position " + std::to_string(pos) + " is outside [0, seq_len " +
                  std::to_string(cfg.seq_len) + ")");
  }

  void forward(const std::vector<int>& host_tokens, const std::vector<int>& host_positions, const PagedKv& kv,
               int first_logit_row, const PrefillHooks* hooks = nullptr);

  // `blocks` hold a sequence's first `positions` positions in `pool`: enough
  // of them, all inside the pool. Throws Error naming `where` (and the slot,
  // when >= 0) otherwise; builds no string when they do.
  void validate_table(const KvPool& pool, const std::vector<int>& blocks, int positions, const char* where,
                      int slot = -1) const {
    auto who = [&] { return std::string(where) + (slot >= 0 ? ": slot " + std::to_string(slot) : ""); };
    const int needed = KvPool::blocks_for(positions, pool.block_size());
    if (int(blocks.size()) < needed)
      throw Error(who() + " needs " + std::to_string(needed) + " blocks for " + std::to_string(positions) +
                  " positions, has " + std::to_string(blocks.size()));
    for (int i = 0; i < needed; ++i)
      if (blocks[size_t(i)] < 0 || blocks[size_t(i)] >= pool.num_blocks())
        throw Error(who() + " uses block " + std::to_string(blocks[size_t(i)]) + " outside the pool of " +
                    std::to_string(pool.num_blocks()));
  }

  // The paged view of `pool` through the block tables uploaded to `tables`,
  // one row's every `table_stride` entries (0: one table for all rows).
  PagedKv pool_kv(KvPool& pool, int table_stride) {
    PagedKv kv;
    kv.data = pool.data();
    kv.block_size = pool.block_size();
    kv.num_blocks = pool.num_blocks();
    kv.kv_dim = int(kv_dim);
    kv.tables = tables.get();
    kv.table_stride = table_stride;
    return kv;
  }

  // Positions [first_pos, first_pos + tokens.size()) of one sequence through
  // `kv` (one table), in forwards of at most kPrefillRows positions, each
  // attending to the cache written so far; only the last position's logits
  // are computed.
  // Leaves the last position's logits in `logits` (row 0), or with
  // `on_logits` hands out every row's and leaves the last one's in its row.
  void forward_prompt(const std::vector<int>& prompt, int first_pos, const PagedKv& kv,
                      const PrefillHooks* hooks = nullptr,
                      const std::function<void(int, int, const float*)>* on_logits = nullptr) {
    const int n = int(prompt.size());
    const bool all = on_logits && *on_logits;
    std::vector<float> host;
    for (int c0 = 0; c0 < n; c0 += kPrefillRows) {
      const int rows = std::min(kPrefillRows, n - c0);
      const std::vector<int> chunk(prompt.begin() + c0, prompt.begin() + c0 + rows);
      std::vector<int> positions(static_cast<size_t>(rows));
      for (int i = 0; i < rows; ++i) positions[size_t(i)] = first_pos + c0 + i;
      forward(chunk, positions, kv, all ? 0 : c0 + rows == n ? rows - 1 : rows, hooks);
      if (!all) continue;
      host.resize(size_t(rows) * vocab);
      logits.download(host.data(), host.size());
      (*on_logits)(first_pos + c0, rows, host.data());
    }
    // The last position's logits where the callers read them: the first row.
    if (all && n > 0) logits.upload(host.data() + host.size() - vocab, vocab);
  }

  std::shared_ptr<const Checkpoint> checkpoint;
  ModelConfig cfg;
  std::unique_ptr<Backend> backend;
  size_t dim, kv_dim, q_dim, head, hidden, layers, vocab;  // head: floats per head (head_size)

  // Weights, all layers per tensor. Vectors row-major; the embedding table
  // as f32 rows copied to a device (token_embedding) or its rows as stored
  // (token_rows, any type); matrices per
  // layer in the backend's form (LayerMatrices). wcls is the classifier, the
  // embedding table's matrix when shared.
  WeightType embedding_type;
  DeviceArray<float> token_embedding;   // (vocab, dim), f32 on a device backend
  DeviceArray<uint8_t> token_blocks;    // other types, on a device backend
  const void* token_rows = nullptr;     // the table's rows as stored (device pointer); null: token_embedding
  DeviceArray<float> rms_att;           // (layers, dim)
  WeightArena arena;                    // where the matrices below go (place_matrices)
  LayerMatrices wq, wk, wv, wo;         // (q_dim, dim), (kv_dim, dim) x2, (dim, q_dim)
  DeviceArray<float> bq, bk, bv;        // qwen2 only: (layers, q_dim), (layers, kv_dim) x2
  DeviceArray<float> q_norm, k_norm;    // qwen3 only: (layers, head_size) each
  DeviceArray<float> rms_ffn;           // (layers, dim)
  LayerMatrices w1, w2, w3;             // (hidden, dim), (dim, hidden), (hidden, dim)
  DeviceArray<float> rms_final;         // (dim)
  LayerMatrices wcls;                   // (vocab, dim)
  DeviceArray<float> rope;  // [seq_len][head_size/2][cos, sin]

  // Scratch, grown on demand and reused across calls.
  DeviceArray<float> x, xb, xb2, q, k, v, hb, hb2, logits, prefill_kv;
  DeviceArray<int> tokens, positions, tables;
  DeviceArray<uint8_t> weight_memory;         // the matrices' arena, when no weight cache holds it
  std::unique_ptr<WeightCache> weight_cache;  // the matrices' arena, mapped from a file
  std::vector<float> host_k, host_v;  // hook staging when the backend's memory is not the host's
  std::vector<float> host_cache;      // on_layer_cache's mirror of the prefill cache, likewise
  int last_prefill_positions = 0;     // the last prefill's cache: one block of this many positions

  // Whole blocks between `pool` and a prefill's cache of cache_positions
  // positions (one block): cache positions [first_block * B, ...) and the
  // pool's `blocks`, in that order (B the pool's block size). Both are laid
  // out as gpu/kv_layout.h says, so it is one copy per (plane, block).
  void copy_blocks(KvPool& pool, const std::vector<int>& blocks, float* cache, int cache_positions,
                   int first_block, bool into_pool) {
    const size_t block = size_t(pool.block_size()) * kv_dim;
    for (size_t plane = 0; plane < 2 * layers; ++plane)
      for (size_t j = 0; j < blocks.size(); ++j) {
        float* in_pool = pool.data() + (plane * size_t(pool.num_blocks()) + size_t(blocks[j])) * block;
        float* in_cache = cache + plane * size_t(cache_positions) * kv_dim + (size_t(first_block) + j) * block;
        if (into_pool) backend->copy(in_pool, in_cache, block * sizeof(float));
        else backend->copy(in_cache, in_pool, block * sizeof(float));
      }
  }

  // Gives on_layer_cache the cache once layer `layer` of positions [first,
  // first + rows) is in it: the backend's memory itself, or the host mirror
  // after copying that layer's new K tiles and V rows into it.
  void hand_out_cache(const PrefillHooks& hooks, int layer, int first, int rows, const PagedKv& cache) {
    if (backend->host_memory()) {
      hooks.on_layer_cache(layer, first, rows, cache.data);
      return;
    }
    const int end = std::min(cache.block_size, kv_layout::padded(first + rows));
    const size_t layer_base = size_t(layer) * 2 * size_t(cache.block_size) * kv_dim;
    const size_t k_at = layer_base + size_t(first) * kv_dim;  // whole tiles from position `first`
    const size_t v_at = layer_base + kv_layout::v_index(cache, first);
    const size_t bytes = size_t(end - first) * kv_dim * sizeof(float);
    backend->download(host_cache.data() + k_at, cache.data + k_at, bytes);
    backend->download(host_cache.data() + v_at, cache.data + v_at, bytes);
    hooks.on_layer_cache(layer, first, rows, host_cache.data());
  }
};

// The forward pass of one row per (token, position), top to bottom as in
// llama2.c's run.c. Row r's K and V are written to `kv` at its position, and
// its attention reads positions [0, position] from there. Leaves the logits of
// rows [first_logit_row, rows) in `logits` (none when first_logit_row == rows).
void Engine::Impl::forward(const std::vector<int>& host_tokens, const std::vector<int>& host_positions,
                           const PagedKv& kv, int first_logit_row, const PrefillHooks* hooks) {
  Backend& b = *backend;
  const int rows = int(host_tokens.size());
  const int n_dim = cfg.dim;
  const int n_heads = cfg.n_heads, n_kv_heads = cfg.n_kv_heads, head_size = cfg.head_size();
  const float eps = cfg.rms_epsilon;
  const size_t q_floats = size_t(rows) * q_dim;  // q and the attention's output
  const size_t row_floats = size_t(rows) * dim;

  tokens.upload(host_tokens.data(), host_tokens.size());
  positions.upload(host_positions.data(), host_positions.size());
  float* x_ = x.ensure(row_floats);
  float* xb_ = xb.ensure(std::max(row_floats, q_floats));
  float* xb2_ = xb2.ensure(row_floats);
  float* q_ = q.ensure(q_floats);
  float* k_ = k.ensure(size_t(rows) * kv_dim);
  float* v_ = v.ensure(size_t(rows) * kv_dim);
  float* hb_ = hb.ensure(size_t(rows) * hidden);
  float* hb2_ = hb2.ensure(size_t(rows) * hidden);
  const int* pos_ = positions.get();

  if (token_rows) b.embedding_quantized(embedding_type, token_rows, tokens.get(), x_, rows, n_dim);
  else b.embedding(token_embedding.get(), tokens.get(), x_, rows, n_dim);

  for (size_t l = 0; l < layers; ++l) {
    // attention block
    b.rmsnorm(x_, rms_att.get() + l * dim, xb_, rows, n_dim, eps);
    wq.mul(b, l, xb_, q_, rows);
    wk.mul(b, l, xb_, k_, rows);
    wv.mul(b, l, xb_, v_, rows);
    if (cfg.qkv_bias()) {  // qwen2
      b.add_bias(q_, bq.get() + l * q_dim, rows, int(q_dim));
      b.add_bias(k_, bk.get() + l * kv_dim, rows, int(kv_dim));
      b.add_bias(v_, bv.get() + l * kv_dim, rows, int(kv_dim));
    }
    if (cfg.qk_norm()) {  // qwen3: each head of q and k RMS-normalised
      b.rmsnorm(q_, q_norm.get() + l * head, q_, rows * n_heads, head_size, eps);
      b.rmsnorm(k_, k_norm.get() + l * head, k_, rows * n_kv_heads, head_size, eps);
    }
    b.rope(q_, pos_, rope.get(), rows, n_heads, head_size, cfg.rope_neox());
    b.rope(k_, pos_, rope.get(), rows, n_kv_heads, head_size, cfg.rope_neox());
    b.kv_write(kv, int(l), k_, v_, pos_, rows);
    if (hooks && hooks->on_layer_kv) hand_out_layer(*hooks, int(l), host_positions.front(), rows, k_, v_);
    if (hooks && hooks->on_layer_cache) hand_out_cache(*hooks, int(l), host_positions.front(), rows, kv);
    b.attention(q_, xb_, kv, int(l), pos_, rows, n_heads, n_kv_heads, head_size);
    wo.mul(b, l, xb_, xb2_, rows);
    b.add(x_, xb2_, row_floats);

    // feed-forward block: w2(silu(w1 x) * w3 x)
    b.rmsnorm(x_, rms_ffn.get() + l * dim, xb_, rows, n_dim, eps);
    w1.mul(b, l, xb_, hb_, rows);
    w3.mul(b, l, xb_, hb2_, rows);
    b.swiglu(hb_, hb2_, size_t(rows) * hidden);
    w2.mul(b, l, hb_, xb_, rows);
    b.add(x_, xb_, row_floats);
  }

  const int out_rows = rows - first_logit_row;
  if (out_rows <= 0) return;
  float* x_out = x_ + size_t(first_logit_row) * dim;
  b.rmsnorm(x_out, rms_final.get(), x_out, out_rows, n_dim, eps);
  wcls.mul(b, 0, x_out, logits.ensure(size_t(out_rows) * vocab), out_rows);
}

// ---------------------------------------------------------------- Engine

Engine::Engine(std::shared_ptr<const Checkpoint> checkpoint, const EngineOptions& options) {
  if (!checkpoint) throw Error("Engine: no checkpoint");
  impl_ = std::make_unique<Impl>(std::move(checkpoint), options);
}

Engine::~Engine() = default;

const ModelConfig& Engine::config() const { return impl_->cfg; }
uint64_t Engine::fingerprint() const { return impl_->checkpoint->fingerprint(); }
std::string Engine::backend_name() const { return impl_->backend->name(); }
Backend& Engine::backend() { return *impl_->backend; }

bool Engine::holds(const KvPool& pool) {
  return &pool.backend() == &backend() && pool.model() == kv_shape(impl_->cfg.seq_len);
}

KvPool kv_pool_for(Engine& engine, int block_size, int num_blocks) {
  return KvPool(engine.backend(), engine.kv_shape(engine.config().seq_len), block_size, num_blocks);
}

KvShape Engine::kv_shape(int n_positions) const {
  const ModelConfig& c = impl_->cfg;
  return KvShape{uint32_t(c.n_layers), uint32_t(c.n_kv_heads), uint32_t(c.head_size()), uint32_t(n_positions)};
}

KvExpectation Engine::kv_expectation() const {
  const ModelConfig& c = impl_->cfg;
  return KvExpectation{fingerprint(), uint32_t(c.n_layers), uint32_t(c.n_kv_heads), uint32_t(c.head_size()),
                       uint32_t(c.seq_len)};
}

PrefillOutput Engine::prefill(const std::vector<int>& tokens, const PrefillHooks& hooks,
                              const PrefillPrefix& prefix) {
  Impl& m = *impl_;
  const int n = int(tokens.size());
  if (n == 0) throw Error("prefill: empty prompt");
  if (n > m.cfg.seq_len)
    throw Error("prefill: prompt of " + std::to_string(n) + " tokens exceeds seq_len " +
                std::to_string(m.cfg.seq_len));
  for (int t : tokens) m.validate_token(t, "prefill");
  const int skip = prefix.positions();  // positions whose KV the prefix holds
  if (prefix.pool) {
    if (!holds(*prefix.pool)) throw Error("prefill: the prefix's KV pool belongs to another engine");
    if (skip >= n)
      throw Error("prefill: a prefix of " + std::to_string(skip) + " positions leaves nothing of a prompt of " +
                  std::to_string(n) + " to compute");
    if (hooks.on_layer_kv) throw Error("prefill: on_layer_kv cannot hand out a cached prefix");
    for (int b : prefix.blocks)
      if (b < 0 || b >= prefix.pool->num_blocks())
        throw Error("prefill: prefix block " + std::to_string(b) + " outside the pool of " +
                    std::to_string(prefix.pool->num_blocks()));
  }

  // The request's cache is a pool of one block holding all n positions
  // (rounded up to whole key tiles), converted to the wire layout at the end.
  PrefillOutput out;
  out.shape = kv_shape(n);
  const int cache_positions = kv_layout::padded(n);
  const size_t cache_floats = size_t(m.layers) * 2 * size_t(cache_positions) * m.kv_dim;
  const int zero_block = 0;
  m.tables.upload(&zero_block, 1);
  PagedKv kv;
  kv.data = m.prefill_kv.ensure(cache_floats);
  kv.block_size = cache_positions;
  kv.num_blocks = 1;
  kv.kv_dim = int(m.kv_dim);
  kv.tables = m.tables.get();
  kv.table_stride = 0;
  if (hooks.on_layer_cache && !m.backend->host_memory()) m.host_cache.resize(cache_floats);

  if (skip > 0) {
    // The prefix's blocks are the cache's first positions, then handed out.
    // (The pool is only read: KvPool::data() has no const form.)
    m.copy_blocks(const_cast<KvPool&>(*prefix.pool), prefix.blocks, kv.data, cache_positions, 0, false);
    if (hooks.on_layer_cache)
      for (int l = 0; l < int(m.layers); ++l) m.hand_out_cache(hooks, l, 0, skip, kv);
  }
  m.forward_prompt(std::vector<int>(tokens.begin() + skip, tokens.end()), skip, kv, &hooks, &hooks.on_logits);
  m.last_prefill_positions = cache_positions;

  out.logits.resize(m.vocab);
  m.logits.download(out.logits.data(), m.vocab);
  if (!hooks.wire_kv) return out;

  // Wire layout (KvLayout::layer_kv_position): K de-tiled, the padding dropped.
  const float* cache = kv.data;
  std::vector<float> staged;
  if (!m.backend->host_memory()) {
    staged.resize(cache_floats);
    m.prefill_kv.download(staged.data(), cache_floats);
    cache = staged.data();
  }
  out.kv.reserve(out.shape.floats());
  advise_huge_pages(out.kv.data(), out.kv.capacity() * sizeof(float));  // before its pages are touched
  out.kv.resize(out.shape.floats());
  cache_to_wire(cache, cache_positions, n, int(m.layers), int(m.kv_dim), out.kv.data());
  return out;
}

void Engine::keep_prefill_blocks(KvPool& pool, const std::vector<int>& blocks, int first_block) {
  Impl& m = *impl_;
  if (!holds(pool)) throw Error("keep_prefill_blocks: the KV pool belongs to another engine");
  const int bs = pool.block_size();
  const int cache_positions = m.last_prefill_positions;
  if (first_block < 0 || (first_block + int(blocks.size())) * bs > cache_positions)
    throw Error("keep_prefill_blocks: blocks [" + std::to_string(first_block) + ", " +
                std::to_string(first_block + int(blocks.size())) + ") of " + std::to_string(bs) +
                " positions are not in the last prefill's " + std::to_string(cache_positions));
  for (int b : blocks)
    if (b < 0 || b >= pool.num_blocks())
      throw Error("keep_prefill_blocks: block " + std::to_string(b) + " outside the pool of " +
                  std::to_string(pool.num_blocks()));
  m.copy_blocks(pool, blocks, m.prefill_kv.get(), cache_positions, first_block, true);
}

std::vector<float> Engine::decode_step(KvPool& pool, const std::vector<DecodeSlot>& slots) {
  Impl& m = *impl_;
  if (slots.empty()) return {};
  if (!holds(pool)) throw Error("decode_step: the KV pool belongs to another engine");
  const int rows = int(slots.size());
  const int bs = pool.block_size();

  std::vector<int> tokens(rows), positions(rows);
  int table_width = 1;
  for (int r = 0; r < rows; ++r) {
    const DecodeSlot& s = slots[r];
    m.validate_token(s.token, "decode_step");
    m.validate_position(s.pos, "decode_step");
    if (!s.blocks) throw Error("decode_step: slot " + std::to_string(r) + " has no block table");
    m.validate_table(pool, *s.blocks, s.pos + 1, "decode_step", r);
    const int needed = KvPool::blocks_for(s.pos + 1, bs);
    tokens[r] = s.token;
    positions[r] = s.pos;
    table_width = std::max(table_width, needed);
  }

  // Row r's table: its first table_width blocks (padding never read).
  std::vector<int> tables(size_t(rows) * table_width, 0);
  for (int r = 0; r < rows; ++r) {
    const int needed = KvPool::blocks_for(positions[r] + 1, bs);
    std::copy_n(slots[r].blocks->begin(), needed, tables.begin() + size_t(r) * table_width);
  }
  m.tables.upload(tables.data(), tables.size());

  m.forward(tokens, positions, m.pool_kv(pool, table_width), 0);

  std::vector<float> logits(size_t(rows) * m.vocab);
  m.logits.download(logits.data(), logits.size());
  return logits;
}

std::vector<float> Engine::prefill_chunk(KvPool& pool, const std::vector<int>& tokens, int first_pos,
                                         const std::vector<int>& blocks,
                                         const std::function<void(int, int, const float*)>& on_logits) {
  Impl& m = *impl_;
  const int rows = int(tokens.size());
  if (rows == 0) throw Error("prefill_chunk: no tokens");
  if (!holds(pool)) throw Error("prefill_chunk: the KV pool belongs to another engine");
  if (first_pos < 0) throw Error("prefill_chunk: negative first position " + std::to_string(first_pos));
  m.validate_position(first_pos + rows - 1, "prefill_chunk");
  for (int t : tokens) m.validate_token(t, "prefill_chunk");
  m.validate_table(pool, blocks, first_pos + rows, "prefill_chunk");
  m.tables.upload(blocks.data(), size_t(KvPool::blocks_for(first_pos + rows, pool.block_size())));  // one table
  m.forward_prompt(tokens, first_pos, m.pool_kv(pool, 0), nullptr, &on_logits);
  std::vector<float> logits(m.vocab);
  m.logits.download(logits.data(), m.vocab);
  return logits;
}

}  // namespace disagg::gpu
