// Loading (mmap + validation + fingerprint) and writing of llama2.c checkpoints.
#include "gpu/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>  // Debian's libxxhash picks AVX2/AVX-512 at run time: ~2x SSE2
#endif

#include "gpu/error.h"
#include "gpu/gguf.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "llama2.c checkpoints are little-endian and are mapped as-is");

namespace disagg::gpu {
namespace {

constexpr size_t kHeaderInts = 7;
constexpr size_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

// Saturating arithmetic: a header with absurd dimensions must yield an absurd
// expected size (reported as "truncated"), never a wrapped-around small one.
size_t mul_sat(size_t a, size_t b) {
  size_t r;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<size_t>::max() : r;
}
size_t add_sat(size_t a, size_t b) {
  size_t r;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<size_t>::max() : r;
}

// Float counts of the tensors, in file order.
struct TensorSizes {
  size_t token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, rope_unused, wcls;

  explicit TensorSizes(const ModelConfig& c) {
    const size_t dim = size_t(c.dim), hidden = size_t(c.hidden_dim), layers = size_t(c.n_layers);
    const size_t q_dim = mul_sat(size_t(c.n_heads), size_t(c.head_size()));
    const size_t kv_dim = mul_sat(size_t(c.n_kv_heads), size_t(c.head_size()));
    token_embedding = mul_sat(size_t(c.vocab_size), dim);
    rms_att = mul_sat(layers, dim);
    wq = mul_sat(layers, mul_sat(q_dim, dim));
    wk = mul_sat(layers, mul_sat(kv_dim, dim));
    wv = wk;
    wo = mul_sat(layers, mul_sat(dim, q_dim));
    rms_ffn = rms_att;
    w1 = mul_sat(layers, mul_sat(hidden, dim));
    w2 = w1;
    w3 = w1;
    rms_final = dim;
    // Two legacy RoPE tables (freq_cis_real, freq_cis_imag) that nobody reads.
    rope_unused = mul_sat(2, mul_sat(size_t(c.seq_len), size_t(c.head_size() / 2)));
    wcls = c.shared_classifier ? 0 : token_embedding;
  }

  size_t total_floats() const {
    size_t n = 0;
    for (size_t s : {token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, rope_unused, wcls})
      n = add_sat(n, s);
    return n;
  }
  size_t file_bytes() const { return add_sat(kHeaderBytes, mul_sat(total_floats(), sizeof(float))); }
};

// splitmix64's finalizer: a cheap, well-mixing 64-bit permutation.
uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// XXH3-64 (libxxhash, seed 0) of every byte of the checkpoint file. A model
// not yet in the page cache is read ahead (asynchronously) while it is hashed.
// Cost on a 211 MB model (2 cores): ~8 ms of hashing (AVX2) on top of faulting
// the pages in, which the engine's load does anyway.
//
// Hashed in chunks, each dropped from the process's memory once hashed
// (MADV_DONTNEED on a read-only private file mapping: the next access reads
// the page cache or the file again), so the hash does not make the whole
// file resident: a model's peak RSS is what the engine keeps (README).
uint64_t fingerprint_bytes(void* mapping, size_t size) {
  constexpr size_t kChunk = size_t(32) << 20;
  XXH3_state_t* state = XXH3_createState();
  if (!state) throw Error("cannot allocate a hash state");
  XXH3_64bits_reset(state);
  auto* base = static_cast<char*>(mapping);
  for (size_t at = 0; at < size; at += kChunk) {
    const size_t n = std::min(kChunk, size - at);
    if (at + n < size) ::madvise(base + at + n, std::min(kChunk, size - at - n), MADV_WILLNEED);  // advice only
    XXH3_64bits_update(state, base + at, n);
    ::madvise(base + at, n, MADV_DONTNEED);
  }
  const uint64_t hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return hash;
}

struct FileCloser {
  int fd;
  ~FileCloser() {
    if (fd >= 0) ::close(fd);
  }
};

std::string errno_text() { return std::strerror(errno); }

// The file's name without its directory and extension.
std::string stem_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  const size_t dot = name.find_last_of('.');
  return dot == std::string::npos || dot == 0 ? name : name.substr(0, dot);
}

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF", little-endian
// The engine's RMSNorm epsilon (backend.h rmsnorm, kernels.inl): a GGUF
// that asks for another is refused until the kernels take it.
constexpr double kRmsEpsilon = 1e-5;
// SentencePiece's word boundary (U+2581), which llama2.c's pieces spell ' '.
constexpr const char* kSentencePieceSpace = "\xe2\x96\x81";

// `s` with every `from` replaced by `to`.
std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
  return s;
}

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

}  // namespace

// A GGUF file of the llama architecture (tensor names and shapes as
// llama.cpp writes them; dims[0] is a matrix's row length).
void Checkpoint::load_gguf(size_t file_size) {
  const auto* bytes = static_cast<const uint8_t*>(mapping_);
  const gguf::File f = gguf::File::parse(bytes, file_size, path_);
  const std::string& arch = f.string("general.architecture");
  if (arch != "llama") throw Error(path_ + ": architecture " + arch + " is not supported (llama is)");
  auto dimension = [&](const std::string& key) {
    const uint64_t v = f.uint(key);
    if (v == 0 || v > uint64_t(std::numeric_limits<int32_t>::max()))
      throw Error(path_ + ": metadata " + key + " = " + std::to_string(v) + " is out of range");
    return int(v);
  };
  ModelConfig& c = config_;
  c.dim = dimension("llama.embedding_length");
  c.hidden_dim = dimension("llama.feed_forward_length");
  c.n_layers = dimension("llama.block_count");
  c.n_heads = dimension("llama.attention.head_count");
  c.n_kv_heads = f.find("llama.attention.head_count_kv") ? dimension("llama.attention.head_count_kv") : c.n_heads;
  c.seq_len = dimension("llama.context_length");
  const gguf::TensorInfo& embedding = f.require_tensor("token_embd.weight");
  if (embedding.dims.size() != 2 || embedding.dims[1] > std::numeric_limits<int32_t>::max())
    throw Error(path_ + ": tensor token_embd.weight: shape " + shape_text(embedding.dims) + " is no [dim, vocab] matrix");
  c.vocab_size = int(embedding.dims[1]);
  c.shared_classifier = f.tensor("output.weight") == nullptr;
  c.rope_theta = float(f.number("llama.rope.freq_base", 10000.0));
  if (!(c.rope_theta > 1.0f) || !std::isfinite(c.rope_theta))
    throw Error(path_ + ": metadata llama.rope.freq_base = " + std::to_string(c.rope_theta) + " is out of range");
  if (std::string problem = validate(c); !problem.empty()) throw Error(path_ + ": " + problem);
  const uint64_t rotary = f.uint("llama.rope.dimension_count", uint64_t(c.head_size()));
  if (rotary != uint64_t(c.head_size()))
    throw Error(path_ + ": metadata llama.rope.dimension_count = " + std::to_string(rotary) +
                ": only whole heads (" + std::to_string(c.head_size()) + ") are rotated so far");
  const double eps = f.number("llama.attention.layer_norm_rms_epsilon", kRmsEpsilon);
  if (std::fabs(eps - kRmsEpsilon) > 1e-9)
    throw Error(path_ + ": metadata llama.attention.layer_norm_rms_epsilon = " + std::to_string(eps) +
                ": the engine computes with 1e-05 only so far");

  auto find = [&](const std::string& name, const std::vector<int64_t>& dims) -> const gguf::TensorInfo& {
    const gguf::TensorInfo& t = f.require_tensor(name);
    if (t.dims != dims)
      throw Error(path_ + ": tensor " + name + ": shape " + shape_text(t.dims) + ", the metadata says " + shape_text(dims));
    return t;
  };
  // A norm's weights: f32.
  auto vector = [&](const std::string& name, int64_t n) {
    const gguf::TensorInfo& t = find(name, {n});
    if (t.type != uint32_t(gguf::TensorType::f32) || t.offset % alignof(float) != 0)
      throw Error(path_ + ": tensor " + name + ": type " + gguf::ggml_type_name(t.type) + " (a norm must be f32)");
    return reinterpret_cast<const float*>(bytes + t.offset);
  };
  // A matrix, "out x in" (dims {in, out}): f32, q8_0 or q4_0, as stored.
  auto matrix = [&](const std::string& name, int64_t in, int64_t out) {
    const gguf::TensorInfo& t = find(name, {in, out});
    Matrix m;
    m.data = bytes + t.offset;
    if (t.type == uint32_t(gguf::TensorType::f32) && t.offset % alignof(float) == 0) m.type = WeightType::f32;
    else if (t.type == uint32_t(gguf::TensorType::q8_0)) m.type = WeightType::q8_0;
    else if (t.type == uint32_t(gguf::TensorType::q4_0)) m.type = WeightType::q4_0;
    else
      throw Error(path_ + ": tensor " + name + ": type " + gguf::ggml_type_name(t.type) +
                  " (the engine computes with f32, q8_0 and q4_0 matrices so far)");
    return m;
  };
  const int64_t dim = c.dim, hidden = c.hidden_dim, q_dim = int64_t(c.n_heads) * c.head_size(), kv_dim = c.kv_dim();
  Weights& w = weights_;
  w.token_embedding = matrix("token_embd.weight", dim, c.vocab_size);
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string blk = "blk." + std::to_string(l) + ".";
    LayerWeights L;
    L.rms_att = vector(blk + "attn_norm.weight", dim);
    L.wq = matrix(blk + "attn_q.weight", dim, q_dim);
    L.wk = matrix(blk + "attn_k.weight", dim, kv_dim);
    L.wv = matrix(blk + "attn_v.weight", dim, kv_dim);
    L.wo = matrix(blk + "attn_output.weight", q_dim, dim);
    L.rms_ffn = vector(blk + "ffn_norm.weight", dim);
    L.w1 = matrix(blk + "ffn_gate.weight", dim, hidden);
    L.w2 = matrix(blk + "ffn_down.weight", hidden, dim);
    L.w3 = matrix(blk + "ffn_up.weight", dim, hidden);
    w.layers.push_back(L);
  }
  w.rms_final = vector("output_norm.weight", dim);
  w.wcls = c.shared_classifier ? w.token_embedding : matrix("output.weight", dim, c.vocab_size);

  if (f.find("tokenizer.ggml.model")) {
    const std::string& model = f.string("tokenizer.ggml.model");
    if (model != "llama")
      throw Error(path_ + ": tokenizer.ggml.model " + model + " is not supported yet (llama, SentencePiece, is)");
    const auto& tokens = f.array("tokenizer.ggml.tokens", gguf::ValueType::string).array;
    const auto& scores = f.array("tokenizer.ggml.scores", gguf::ValueType::f32).array;
    if (tokens.size() != size_t(c.vocab_size) || scores.size() != tokens.size())
      throw Error(path_ + ": the vocabulary has " + std::to_string(tokens.size()) + " tokens and " +
                  std::to_string(scores.size()) + " scores; token_embd.weight has " + std::to_string(c.vocab_size) + " rows");
    // The llama2.c ids the engine and the API use (kBosToken, http's kEosToken).
    for (const auto& [key, want] : {std::pair<const char*, uint64_t>{"tokenizer.ggml.bos_token_id", 1},
                                    {"tokenizer.ggml.eos_token_id", 2}}) {
      if (f.find(key) && f.uint(key) != want)
        throw Error(path_ + ": metadata " + key + " = " + std::to_string(f.uint(key)) + " (only " +
                    std::to_string(want) + " is supported so far)");
    }
    Vocabulary v;
    v.pieces.reserve(tokens.size());
    for (const auto& t : tokens) v.pieces.push_back(replace_all(t.s, kSentencePieceSpace, " "));
    for (const auto& s : scores) v.scores.push_back(float(s.f));
    vocabulary_ = std::move(v);
  }
  name_ = f.find("general.name") ? f.string("general.name") : stem_of(path_);
}

std::shared_ptr<const Checkpoint> Checkpoint::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(path + ": cannot open: " + errno_text());
  FileCloser closer{fd};

  struct stat st {};
  if (::fstat(fd, &st) != 0) throw Error(path + ": cannot stat: " + errno_text());
  if (!S_ISREG(st.st_mode)) throw Error(path + ": not a regular file");
  const size_t file_size = size_t(st.st_size);
  if (file_size < kHeaderBytes)
    throw Error(path + ": truncated header: expected at least " + std::to_string(kHeaderBytes) +
                " bytes, found " + std::to_string(file_size));

  int32_t header[kHeaderInts];
  if (::pread(fd, header, sizeof header, 0) != ssize_t(sizeof header))
    throw Error(path + ": cannot read header: " + errno_text());
  // The whole file, read-only, owned by the Checkpoint from here on.
  auto mapped = [&] {
    void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapping == MAP_FAILED) throw Error(path + ": cannot mmap: " + errno_text());
    std::shared_ptr<Checkpoint> cp(new Checkpoint());
    cp->path_ = path;
    cp->mapping_ = mapping;
    cp->mapping_size_ = file_size;
    return cp;
  };
  if (uint32_t(header[0]) == kGgufMagic) {
    std::shared_ptr<Checkpoint> cp = mapped();
    cp->load_gguf(file_size);
    cp->fingerprint_ = fingerprint_bytes(cp->mapping_, file_size);  // every byte of the file, as for llama2.c
    return cp;
  }

  ModelConfig config;
  config.dim = header[0];
  config.hidden_dim = header[1];
  config.n_layers = header[2];
  config.n_heads = header[3];
  config.n_kv_heads = header[4];
  // llama2.c convention: a negative vocab size flags a separately stored classifier.
  // INT32_MIN has no positive counterpart; leave it negative so validate() rejects it.
  const int32_t raw_vocab = header[5];
  config.shared_classifier = raw_vocab > 0;
  config.vocab_size = (raw_vocab < 0 && raw_vocab != std::numeric_limits<int32_t>::min()) ? -raw_vocab : raw_vocab;
  config.seq_len = header[6];
  if (std::string problem = validate(config); !problem.empty()) throw Error(path + ": " + problem);

  const TensorSizes sizes(config);
  const size_t expected = sizes.file_bytes();
  if (file_size < expected)
    throw Error(path + ": truncated: expected " + std::to_string(expected) + " bytes, found " +
                std::to_string(file_size));
  if (file_size > expected)
    throw Error(path + ": too long: expected " + std::to_string(expected) + " bytes, found " +
                std::to_string(file_size) + " (trailing data or wrong dimensions)");

  std::shared_ptr<Checkpoint> cp = mapped();
  cp->config_ = config;
  void* mapping = cp->mapping_;

  const float* p = reinterpret_cast<const float*>(static_cast<const char*>(mapping) + kHeaderBytes);
  auto take = [&p](size_t n) {
    const float* t = p;
    p += n;
    return t;
  };
  Weights& w = cp->weights_;
  const auto f32 = [](const float* p) { return Matrix{p, WeightType::f32}; };
  w.token_embedding = f32(take(sizes.token_embedding));
  // Each tensor holds every layer's, one after the other.
  w.layers.resize(size_t(config.n_layers));
  const size_t layers = size_t(config.n_layers);
  auto split_vectors = [&](const float* LayerWeights::*field, size_t size) {
    const float* all = take(size);
    for (size_t l = 0; l < layers; ++l) w.layers[l].*field = all + l * (size / layers);
  };
  auto split_matrices = [&](Matrix LayerWeights::*field, size_t size) {
    const float* all = take(size);
    for (size_t l = 0; l < layers; ++l) w.layers[l].*field = f32(all + l * (size / layers));
  };
  split_vectors(&LayerWeights::rms_att, sizes.rms_att);
  split_matrices(&LayerWeights::wq, sizes.wq);
  split_matrices(&LayerWeights::wk, sizes.wk);
  split_matrices(&LayerWeights::wv, sizes.wv);
  split_matrices(&LayerWeights::wo, sizes.wo);
  split_vectors(&LayerWeights::rms_ffn, sizes.rms_ffn);
  split_matrices(&LayerWeights::w1, sizes.w1);
  split_matrices(&LayerWeights::w2, sizes.w2);
  split_matrices(&LayerWeights::w3, sizes.w3);
  w.rms_final = take(sizes.rms_final);
  take(sizes.rope_unused);
  w.wcls = config.shared_classifier ? w.token_embedding : f32(take(sizes.wcls));
  cp->name_ = stem_of(path);

  // Every byte of the file (header and all tensors, the unused RoPE tables
  // too): any changed, swapped or shuffled weight changes the fingerprint.
  cp->fingerprint_ = fingerprint_bytes(mapping, file_size);
  return cp;
}

Tokenizer load_tokenizer(const Checkpoint& checkpoint, const std::string& tokenizer_path) {
  if (!tokenizer_path.empty()) return Tokenizer::load(tokenizer_path, checkpoint.config().vocab_size);
  if (checkpoint.vocabulary()) return Tokenizer::from_vocabulary(*checkpoint.vocabulary(), checkpoint.path());
  throw Error(checkpoint.path() + ": the model file has no vocabulary: name a tokenizer file");
}

void write_gguf(const Checkpoint& checkpoint, const Vocabulary& vocabulary, const std::string& name,
                const std::string& path, WeightType type) {
  const ModelConfig& c = checkpoint.config();
  if (int(vocabulary.pieces.size()) != c.vocab_size || vocabulary.scores.size() != vocabulary.pieces.size())
    throw Error(path + ": a vocabulary of " + std::to_string(vocabulary.pieces.size()) + " pieces for a model of " +
                std::to_string(c.vocab_size));
  gguf::Writer w;
  w.add("general.architecture", gguf::Writer::str("llama"));
  w.add("general.name", gguf::Writer::str(name));
  // llama_ftype: ALL_F32 0, MOSTLY_Q4_0 2, MOSTLY_Q8_0 7.
  w.add("general.file_type", gguf::Writer::u32(type == WeightType::q8_0 ? 7 : type == WeightType::q4_0 ? 2 : 0));
  w.add("llama.context_length", gguf::Writer::u32(uint32_t(c.seq_len)));
  w.add("llama.embedding_length", gguf::Writer::u32(uint32_t(c.dim)));
  w.add("llama.block_count", gguf::Writer::u32(uint32_t(c.n_layers)));
  w.add("llama.feed_forward_length", gguf::Writer::u32(uint32_t(c.hidden_dim)));
  w.add("llama.attention.head_count", gguf::Writer::u32(uint32_t(c.n_heads)));
  w.add("llama.attention.head_count_kv", gguf::Writer::u32(uint32_t(c.n_kv_heads)));
  w.add("llama.rope.dimension_count", gguf::Writer::u32(uint32_t(c.head_size())));
  w.add("llama.rope.freq_base", gguf::Writer::f32(c.rope_theta));
  w.add("llama.attention.layer_norm_rms_epsilon", gguf::Writer::f32(float(kRmsEpsilon)));
  // SentencePiece's conventions: U+2581 for spaces; types 2 unknown, 3 control, 6 byte, 1 normal.
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (size_t i = 0; i < vocabulary.pieces.size(); ++i) {
    tokens.push_back(replace_all(vocabulary.pieces[i], " ", kSentencePieceSpace));
    types.push_back(i == 0 ? 2 : i < 3 ? 3 : i < 3 + 256 ? 6 : 1);
  }
  w.add("tokenizer.ggml.model", gguf::Writer::str("llama"));
  w.add("tokenizer.ggml.tokens", gguf::Writer::strings(std::move(tokens)));
  w.add("tokenizer.ggml.scores", gguf::Writer::f32s(vocabulary.scores));
  w.add("tokenizer.ggml.token_type", gguf::Writer::i32s(types));
  w.add("tokenizer.ggml.bos_token_id", gguf::Writer::u32(uint32_t(kBosToken)));
  w.add("tokenizer.ggml.eos_token_id", gguf::Writer::u32(2));
  w.add("tokenizer.ggml.unknown_token_id", gguf::Writer::u32(0));

  for (const Matrix* m : {&checkpoint.weights().token_embedding, &checkpoint.weights().wcls})
    if (m->type != WeightType::f32) throw Error(path + ": write_gguf reads f32 weights only");
  const uint32_t f32 = uint32_t(gguf::TensorType::f32);
  auto add = [&](const std::string& tensor, const float* data, std::vector<int64_t> dims) {
    size_t n = 1;
    for (int64_t d : dims) n *= size_t(d);
    w.add_tensor(tensor, std::move(dims), f32, [data, n, &path](std::FILE* f) {
      if (std::fwrite(data, sizeof(float), n, f) != n) throw Error(path + ": write failed");
    });
  };
  // A matrix in the file's type, quantized a row at a time (no copy of the whole).
  auto add_matrix = [&](const std::string& tensor, const Matrix& m, int64_t in, int64_t out) {
    if (!m.f32()) throw Error(path + ": write_gguf reads f32 weights only");
    if (type == WeightType::f32 || in % kQ8Block != 0) return add(tensor, m.f32(), {in, out});
    const float* data = m.f32();
    const uint32_t ggml_type = uint32_t(type == WeightType::q8_0 ? gguf::TensorType::q8_0 : gguf::TensorType::q4_0);
    w.add_tensor(tensor, {in, out}, ggml_type, [data, in, out, type, &path](std::FILE* f) {
      std::vector<uint8_t> row(row_bytes(type, int(in)));
      for (int64_t r = 0; r < out; ++r) {
        quantize_row(type, data + size_t(r) * size_t(in), row.data(), int(in));
        if (std::fwrite(row.data(), 1, row.size(), f) != row.size()) throw Error(path + ": write failed");
      }
    });
  };
  const int64_t dim = c.dim, hidden = c.hidden_dim, q_dim = int64_t(c.n_heads) * c.head_size(), kv_dim = c.kv_dim();
  const Weights& wt = checkpoint.weights();
  add_matrix("token_embd.weight", wt.token_embedding, dim, c.vocab_size);
  for (size_t l = 0; l < wt.layers.size(); ++l) {
    const std::string blk = "blk." + std::to_string(l) + ".";
    const LayerWeights& L = wt.layers[l];
    add(blk + "attn_norm.weight", L.rms_att, {dim});
    add_matrix(blk + "attn_q.weight", L.wq, dim, q_dim);
    add_matrix(blk + "attn_k.weight", L.wk, dim, kv_dim);
    add_matrix(blk + "attn_v.weight", L.wv, dim, kv_dim);
    add_matrix(blk + "attn_output.weight", L.wo, q_dim, dim);
    add(blk + "ffn_norm.weight", L.rms_ffn, {dim});
    add_matrix(blk + "ffn_gate.weight", L.w1, dim, hidden);
    add_matrix(blk + "ffn_down.weight", L.w2, hidden, dim);
    add_matrix(blk + "ffn_up.weight", L.w3, dim, hidden);
  }
  add("output_norm.weight", wt.rms_final, {dim});
  if (!c.shared_classifier) add_matrix("output.weight", wt.wcls, dim, c.vocab_size);
  w.write(path);
}

void Checkpoint::release(const void* ptr, size_t bytes) const {
  const auto page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (uintptr_t(ptr) + page - 1) / page * page, end = (uintptr_t(ptr) + bytes) / page * page;
  const auto lo = uintptr_t(mapping_), hi = lo + mapping_size_;
  if (begin < end && begin >= lo && end <= hi) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

Checkpoint::~Checkpoint() {
  if (mapping_) ::munmap(mapping_, mapping_size_);
}

// ---------------------------------------------------------------- writing

namespace {

// Deterministic on every platform (std::uniform_real_distribution is not):
// a splitmix64 stream, 24 random bits per float.
class WeightStream {
 public:
  explicit WeightStream(uint64_t seed) : state_(mix64(seed ^ 0x5eed5eed5eed5eedULL)) {}
  float uniform(float center, float half_width) {
    state_ += 0x9e3779b97f4a7c15ULL;
    const float u = float(mix64(state_) >> 40) * (1.0f / 16777216.0f);  // [0, 1)
    return center + half_width * (2.0f * u - 1.0f);
  }

 private:
  uint64_t state_;
};

class CheckpointWriter {
 public:
  CheckpointWriter(const std::string& path, uint64_t seed) : path_(path), rng_(seed) {
    file_ = std::fopen(path.c_str(), "wb");
    if (!file_) throw Error(path + ": cannot create: " + errno_text());
  }
  // Unless close() succeeded, the partial file is removed: a half-written
  // checkpoint must never be left behind looking like a model.
  ~CheckpointWriter() {
    if (file_) {
      std::fclose(file_);
      std::remove(path_.c_str());
    }
  }

  void bytes(const void* data, size_t n) {
    if (std::fwrite(data, 1, n, file_) != n) throw Error(path_ + ": write failed: " + errno_text());
  }
  // Uniform in [center - half_width, center + half_width], streamed in chunks.
  void random(size_t count, float center, float half_width) {
    fill(count, [&] { return rng_.uniform(center, half_width); });
  }
  void zeros(size_t count) {
    fill(count, [] { return 0.0f; });
  }
  void close() {
    FILE* f = file_;
    file_ = nullptr;
    if (std::fclose(f) != 0) {
      const std::string reason = errno_text();
      std::remove(path_.c_str());
      throw Error(path_ + ": write failed: " + reason);
    }
  }

 private:
  template <class Gen>
  void fill(size_t count, Gen gen) {
    std::vector<float> chunk;
    while (count > 0) {
      const size_t n = std::min<size_t>(count, 1 << 16);
      chunk.resize(n);
      for (float& v : chunk) v = gen();
      bytes(chunk.data(), n * sizeof(float));
      count -= n;
    }
  }

  std::string path_;
  WeightStream rng_;
  FILE* file_ = nullptr;
};

}  // namespace

void write_random_checkpoint(const std::string& path, const ModelConfig& config, uint64_t seed) {
  if (std::string problem = validate(config); !problem.empty()) throw Error(path + ": " + problem);
  const TensorSizes sizes(config);
  if (sizes.file_bytes() == std::numeric_limits<size_t>::max())
    throw Error(path + ": model too large to write");

  CheckpointWriter out(path, seed);
  const int32_t header[kHeaderInts] = {config.dim, config.hidden_dim, config.n_layers, config.n_heads,
                                       config.n_kv_heads,
                                       config.shared_classifier ? config.vocab_size : -config.vocab_size,
                                       config.seq_len};
  out.bytes(header, sizeof header);

  // Projections are uniform with half-width 3/sqrt(fan_in): an rms gain of sqrt(3)
  // per matrix, so attention and FFN outputs outweigh the token embedding in the
  // residual stream and the next token depends on the context. (With 1/sqrt(fan_in)
  // a random model just echoes its input token forever, which would hide KV-cache
  // bugs.) RMSNorm keeps every layer's input at unit scale, so activations stay
  // finite at any depth; norm gains are near 1.
  const float q_dim = float(config.n_heads * config.head_size());
  auto half_width = [](float fan_in) { return 3.0f / std::sqrt(fan_in); };
  out.random(sizes.token_embedding, 0.0f, 1.0f);
  out.random(sizes.rms_att, 1.0f, 0.1f);
  out.random(sizes.wq, 0.0f, half_width(float(config.dim)));
  out.random(sizes.wk, 0.0f, half_width(float(config.dim)));
  out.random(sizes.wv, 0.0f, half_width(float(config.dim)));
  out.random(sizes.wo, 0.0f, half_width(q_dim));
  out.random(sizes.rms_ffn, 1.0f, 0.1f);
  out.random(sizes.w1, 0.0f, half_width(float(config.dim)));
  out.random(sizes.w2, 0.0f, half_width(float(config.hidden_dim)));
  out.random(sizes.w3, 0.0f, half_width(float(config.dim)));
  out.random(sizes.rms_final, 1.0f, 0.1f);
  out.zeros(sizes.rope_unused);
  if (!config.shared_classifier) out.random(sizes.wcls, 0.0f, half_width(float(config.dim)));
  out.close();
}

}  // namespace disagg::gpu
