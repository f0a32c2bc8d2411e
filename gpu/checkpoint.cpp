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
uint64_t fingerprint_bytes(void* mapping, size_t size) {
  ::madvise(mapping, size, MADV_WILLNEED);  // advice only: a failure changes nothing
  return XXH3_64bits(mapping, size);
}

struct FileCloser {
  int fd;
  ~FileCloser() {
    if (fd >= 0) ::close(fd);
  }
};

std::string errno_text() { return std::strerror(errno); }

}  // namespace

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

  void* mapping = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (mapping == MAP_FAILED) throw Error(path + ": cannot mmap: " + errno_text());

  std::shared_ptr<Checkpoint> cp(new Checkpoint());
  cp->path_ = path;
  cp->config_ = config;
  cp->mapping_ = mapping;
  cp->mapping_size_ = file_size;

  const float* p = reinterpret_cast<const float*>(static_cast<const char*>(mapping) + kHeaderBytes);
  auto take = [&p](size_t n) {
    const float* t = p;
    p += n;
    return t;
  };
  Weights& w = cp->weights_;
  w.token_embedding = take(sizes.token_embedding);
  w.rms_att = take(sizes.rms_att);
  w.wq = take(sizes.wq);
  w.wk = take(sizes.wk);
  w.wv = take(sizes.wv);
  w.wo = take(sizes.wo);
  w.rms_ffn = take(sizes.rms_ffn);
  w.w1 = take(sizes.w1);
  w.w2 = take(sizes.w2);
  w.w3 = take(sizes.w3);
  w.rms_final = take(sizes.rms_final);
  take(sizes.rope_unused);
  w.wcls = config.shared_classifier ? w.token_embedding : take(sizes.wcls);

  // Every byte of the file (header and all tensors, the unused RoPE tables
  // too): any changed, swapped or shuffled weight changes the fingerprint.
  cp->fingerprint_ = fingerprint_bytes(mapping, file_size);
  return cp;
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
