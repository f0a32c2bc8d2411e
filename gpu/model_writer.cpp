#include "gpu/model_writer.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "gpu/error.h"
#include "gpu/fixed_math.h"
#include "gpu/gguf.h"

namespace disagg::gpu {

namespace {

struct FileTypeInfo {
  FileType type;
  const char* name;
  WeightType matrices;
  uint32_t llama_ftype;  // general.file_type: llama.cpp's llama_ftype number
};
// llama_ftype: ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q4_0 2, MOSTLY_Q8_0 7,
// MOSTLY_Q4_K_M 15, MOSTLY_BF16 32.
constexpr FileTypeInfo kFileTypes[] = {
    {FileType::f32, "f32", WeightType::f32, 0},     {FileType::f16, "f16", WeightType::f16, 1},
    {FileType::bf16, "bf16", WeightType::bf16, 32}, {FileType::q8_0, "q8_0", WeightType::q8_0, 7},
    {FileType::q4_0, "q4_0", WeightType::q4_0, 2},  {FileType::q4_k_m, "q4_k_m", WeightType::q4_k, 15},
};

// llama.cpp's choice of the layers whose attn_v and ffn_down get more bits:
// the first and last eighth, and every third one between.
bool use_more_bits(int layer, int layers) {
  return layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2;
}

// `want`, or what takes its place where a row of `cols` is not whole blocks of it.
WeightType fitting(WeightType want, int64_t cols) {
  if (cols % block_values(want) == 0) return want;
  if (is_k_quant(want) && cols % kQ8Block == 0) return WeightType::q8_0;
  return WeightType::f16;
}

const FileTypeInfo& info(FileType type) {
  for (const FileTypeInfo& i : kFileTypes)
    if (i.type == type) return i;
  throw Error("unknown file type");
}

}  // namespace

const char* to_string(FileType type) { return info(type).name; }

std::optional<FileType> parse_file_type(const std::string& name) {
  for (const FileTypeInfo& i : kFileTypes)
    if (name == i.name) return i.type;
  return std::nullopt;
}

const char* file_type_names() { return "f32|f16|bf16|q8_0|q4_0|q4_k_m"; }

WeightType matrix_type(FileType type, Tensor t, int layer, const ModelConfig& config) {
  const WeightType want = info(type).matrices;
  if (!is_matrix(t)) return WeightType::f32;
  if (type == FileType::q4_k_m) {
    const bool more = t == Tensor::wcls || (t == Tensor::token_embedding && config.shared_classifier) ||
                      ((t == Tensor::wv || t == Tensor::w2) && use_more_bits(layer, config.n_layers));
    return fitting(more ? WeightType::q6_k : WeightType::q4_k, shape_of(t, config).cols);
  }
  if (is_block_quantized(want) && shape_of(t, config).cols % kQ8Block != 0) return WeightType::f32;
  return want;
}

// ---------------------------------------------------------------- sources

namespace {

class CheckpointSource final : public WeightSource {
 public:
  explicit CheckpointSource(std::shared_ptr<const Checkpoint> c) : c_(std::move(c)) {}
  const ModelConfig& config() const override { return c_->config(); }
  void row(Tensor t, int layer, int64_t r, float* out) const override {
    const Weights& w = c_->weights();
    const int64_t cols = shape_of(t, config()).cols;
    if (!is_matrix(t)) {
      std::memcpy(out, w.norm(t, layer), size_t(cols) * sizeof(float));
      return;
    }
    const Matrix& m = w.matrix(t, layer);
    const size_t bytes = row_bytes(m.type, int(cols));
    dequantize_row(m.type, static_cast<const uint8_t*>(m.data) + size_t(r) * bytes, out, int(cols));
  }

 private:
  std::shared_ptr<const Checkpoint> c_;
};

// splitmix64's finalizer: a cheap, well-mixing 64-bit permutation.
uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Deterministic on every platform (std::uniform_real_distribution is not): a
// splitmix64 stream whose i-th value comes from state s0 + (i + 1) * gamma,
// so any value is computed without the ones before it; 24 random bits a float.
class RandomSource final : public WeightSource {
 public:
  RandomSource(const ModelConfig& c, uint64_t seed)
      : c_(c), layout_(c), state0_(mix64(seed ^ 0x5eed5eed5eed5eedULL)) {}
  const ModelConfig& config() const override { return c_; }

  // Projections are uniform with half-width 3/sqrt(fan_in): an rms gain of
  // sqrt(3) per matrix, so attention and FFN outputs outweigh the token
  // embedding in the residual stream and the next token depends on the
  // context. (With 1/sqrt(fan_in) a random model just echoes its input token
  // forever, which would hide KV-cache bugs.) RMSNorm keeps every layer's input
  // at unit scale, so activations stay finite at any depth; norm gains are near 1.
  void row(Tensor t, int layer, int64_t r, float* out) const override {
    float center = 0.0f, half_width = 0.0f;
    switch (t) {
      case Tensor::token_embedding: half_width = 1.0f; break;
      case Tensor::rms_att:
      case Tensor::rms_ffn:
      case Tensor::rms_final: center = 1.0f, half_width = 0.1f; break;
      default: half_width = 3.0f / std::sqrt(float(shape_of(t, c_).cols)); break;
    }
    const int64_t cols = shape_of(t, c_).cols;
    // The value's index among the file's random values (the RoPE tables are
    // zeros); the tensors a llama2.c file lacks (biases) come after them all.
    uint64_t index;
    if (int(t) < kLlama2cTensorKinds) {
      index = layout_.offset(t, layer) + uint64_t(r) * uint64_t(cols);
      if (t == Tensor::wcls) index -= layout_.rope_unused();
    } else {
      const uint64_t stride = uint64_t(shape_of(Tensor::bq, c_).cols);  // the longest of them
      index = layout_.values() + (uint64_t(int(t) - kLlama2cTensorKinds) * uint64_t(c_.n_layers) + uint64_t(layer)) * stride;
      if (t == Tensor::q_norm || t == Tensor::k_norm) center = 1.0f, half_width = 0.1f;  // gains, as the norms'
      else half_width = 0.5f;                                                          // biases
    }
    uint64_t state = state0_ + (index + 1) * kGamma;
    for (int64_t j = 0; j < cols; ++j, state += kGamma) {
      const float u = float(mix64(state) >> 40) * (1.0f / 16777216.0f);  // [0, 1)
      out[j] = center + half_width * (2.0f * u - 1.0f);
    }
  }

 private:
  static constexpr uint64_t kGamma = 0x9e3779b97f4a7c15ULL;
  ModelConfig c_;
  Llama2cLayout layout_;
  uint64_t state0_;
};

std::string errno_text() { return std::strerror(errno); }

}  // namespace

std::unique_ptr<WeightSource> checkpoint_weights(std::shared_ptr<const Checkpoint> checkpoint) {
  return std::make_unique<CheckpointSource>(std::move(checkpoint));
}

std::unique_ptr<WeightSource> random_weights(const ModelConfig& config, uint64_t seed) {
  if (std::string problem = validate(config); !problem.empty()) throw Error(problem);
  return std::make_unique<RandomSource>(config, seed);
}

// ---------------------------------------------------------------- GGUF

std::vector<float> llama3_rope_factors(const ModelConfig& c, float factor, float low_freq_factor, float high_freq_factor,
                                       int original_context) {
  const double low_wavelen = double(original_context) / low_freq_factor;
  const double high_wavelen = double(original_context) / high_freq_factor;
  std::vector<float> factors;
  for (int i = 0; i < c.head_size(); i += 2) {
    const double freq = 1.0 / std::pow(double(c.rope_theta), double(i) / c.head_size());
    const double wavelen = 2 * M_PI / freq;
    if (wavelen < high_wavelen) {
      factors.push_back(1.0f);
    } else if (wavelen > low_wavelen) {
      factors.push_back(factor);
    } else {
      const double smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      factors.push_back(float(1.0 / ((1 - smooth) / factor + smooth)));
    }
  }
  return factors;
}

void write_gguf(const WeightSource& weights, const Vocabulary& vocabulary, const std::string& name,
                const std::string& path, FileType type) {
  const ModelConfig& c = weights.config();
  const Vocabulary& v = vocabulary;
  const bool spm = v.model == TokenizerModel::sentencepiece;
  if (int(v.pieces.size()) != c.vocab_size || (spm && v.scores.size() != v.pieces.size()) ||
      (!v.types.empty() && v.types.size() != v.pieces.size()))
    throw Error(path + ": a vocabulary of " + std::to_string(v.pieces.size()) + " pieces for a model of " +
                std::to_string(c.vocab_size));
  gguf::Writer w;
  const std::string arch = to_string(c.arch), p = arch + ".";  // the metadata keys' prefix
  w.add("general.architecture", gguf::Writer::str(arch));
  w.add("general.name", gguf::Writer::str(name));
  w.add("general.file_type", gguf::Writer::u32(info(type).llama_ftype));
  w.add(p + "context_length", gguf::Writer::u32(uint32_t(c.seq_len)));
  w.add(p + "embedding_length", gguf::Writer::u32(uint32_t(c.dim)));
  w.add(p + "block_count", gguf::Writer::u32(uint32_t(c.n_layers)));
  w.add(p + "feed_forward_length", gguf::Writer::u32(uint32_t(c.hidden_dim)));
  w.add(p + "attention.head_count", gguf::Writer::u32(uint32_t(c.n_heads)));
  w.add(p + "attention.head_count_kv", gguf::Writer::u32(uint32_t(c.n_kv_heads)));
  w.add(p + "rope.dimension_count", gguf::Writer::u32(uint32_t(c.head_size())));
  if (c.head_dim > 0) {
    w.add(p + "attention.key_length", gguf::Writer::u32(uint32_t(c.head_dim)));
    w.add(p + "attention.value_length", gguf::Writer::u32(uint32_t(c.head_dim)));
  }
  w.add(p + "rope.freq_base", gguf::Writer::f32(c.rope_theta));
  w.add(p + "attention.layer_norm_rms_epsilon", gguf::Writer::f32(c.rms_epsilon));
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  for (size_t i = 0; i < v.pieces.size(); ++i) {
    // SentencePiece's spelling has U+2581 for spaces; a llama2.c vocabulary
    // has no types: 2 unknown, 3 control, 6 byte, 1 normal by position.
    tokens.push_back(spm ? sentencepiece_spelling(v.pieces[i]) : v.pieces[i]);
    types.push_back(!v.types.empty() ? int32_t(v.types[i]) : i == 0 ? 2 : i < 3 ? 3 : i < 3 + 256 ? 6 : 1);
  }
  w.add("tokenizer.ggml.model", gguf::Writer::str(spm ? "llama" : "gpt2"));
  if (!spm) w.add("tokenizer.ggml.pre", gguf::Writer::str(v.pre));
  w.add("tokenizer.ggml.tokens", gguf::Writer::strings(std::move(tokens)));
  if (spm) w.add("tokenizer.ggml.scores", gguf::Writer::f32s(v.scores));
  w.add("tokenizer.ggml.token_type", gguf::Writer::i32s(types));
  if (!spm) w.add("tokenizer.ggml.merges", gguf::Writer::strings(v.merges));
  if (v.bos >= 0) w.add("tokenizer.ggml.bos_token_id", gguf::Writer::u32(uint32_t(v.bos)));
  if (v.eos >= 0) w.add("tokenizer.ggml.eos_token_id", gguf::Writer::u32(uint32_t(v.eos)));
  if (spm) w.add("tokenizer.ggml.unknown_token_id", gguf::Writer::u32(0));
  w.add("tokenizer.ggml.add_bos_token", gguf::Writer::boolean(v.add_bos));
  if (!v.chat_template.empty()) w.add("tokenizer.chat_template", gguf::Writer::str(v.chat_template));

  if (!c.rope_factors.empty()) {
    if (c.rope_factors.size() != size_t(c.head_size() / 2))
      throw Error(path + ": " + std::to_string(c.rope_factors.size()) + " rope factors for a head of " +
                  std::to_string(c.head_size()));
    w.add_tensor("rope_freqs.weight", {int64_t(c.rope_factors.size())}, uint32_t(gguf::TensorType::f32),
                 [&c, &path](std::FILE* f) {
                   if (std::fwrite(c.rope_factors.data(), sizeof(float), c.rope_factors.size(), f) != c.rope_factors.size())
                     throw Error(path + ": write failed: " + errno_text());
                 });
  }
  // Each tensor in its type, converted a row at a time (no copy of the whole).
  for_each_tensor(c, [&](Tensor t, int layer) {
    const TensorShape shape = shape_of(t, c);
    const WeightType wt = matrix_type(type, t, layer, c);
    std::vector<int64_t> dims{shape.cols};
    if (is_matrix(t)) dims.push_back(shape.rows);
    w.add_tensor(gguf_name(t, layer), std::move(dims), uint32_t(gguf::tensor_type_of(wt)),
                 [&weights, &path, t, layer, shape, wt](std::FILE* f) {
                   std::vector<float> values(size_t(shape.cols));
                   std::vector<uint8_t> row(row_bytes(wt, int(shape.cols)));
                   for (int64_t r = 0; r < shape.rows; ++r) {
                     weights.row(t, layer, r, values.data());
                     quantize_row(wt, values.data(), row.data(), int(shape.cols));
                     if (std::fwrite(row.data(), 1, row.size(), f) != row.size())
                       throw Error(path + ": write failed: " + errno_text());
                   }
                 });
  });
  w.write(path);
}

// ---------------------------------------------------------------- llama2.c

void write_random_checkpoint(const std::string& path, const ModelConfig& config, uint64_t seed) {
  if (std::string problem = validate(config); !problem.empty()) throw Error(path + ": " + problem);
  if (config.arch != Architecture::llama || config.rms_epsilon != 1e-5f || !config.rope_factors.empty() ||
      config.rope_theta != 10000.0f || config.head_dim != 0)
    throw Error(path + ": a llama2.c checkpoint holds the llama architecture with llama2.c's constants only");
  const Llama2cLayout layout(config);
  if (layout.file_bytes() == std::numeric_limits<size_t>::max()) throw Error(path + ": model too large to write");
  const RandomSource weights(config, seed);

  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) throw Error(path + ": cannot create: " + errno_text());
  // Unless the file was written whole, it is removed: a half-written
  // checkpoint must never be left behind looking like a model.
  bool done = false;
  struct Closer {
    std::FILE* f;
    const std::string& path;
    bool& done;
    ~Closer() {
      if (!done) {
        std::fclose(f);
        std::remove(path.c_str());
      }
    }
  } closer{f, path, done};
  auto bytes = [&](const void* data, size_t n) {
    if (std::fwrite(data, 1, n, f) != n) throw Error(path + ": write failed: " + errno_text());
  };
  const int32_t header[Llama2cLayout::kHeaderInts] = {
      config.dim,        config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads,
      config.shared_classifier ? config.vocab_size : -config.vocab_size, config.seq_len};
  bytes(header, sizeof header);
  // Tensor order, each tensor's layers one after the other.
  std::vector<float> values;
  for (int i = 0; i < kLlama2cTensorKinds; ++i) {
    const auto t = Tensor(i);
    if (t == Tensor::wcls) {
      values.assign(layout.rope_unused(), 0.0f);
      bytes(values.data(), values.size() * sizeof(float));
      if (config.shared_classifier) break;
    }
    const TensorShape shape = shape_of(t, config);
    values.resize(size_t(shape.cols));
    for (int l = 0; l < (per_layer(t) ? config.n_layers : 1); ++l)
      for (int64_t r = 0; r < shape.rows; ++r) {
        weights.row(t, l, r, values.data());
        bytes(values.data(), values.size() * sizeof(float));
      }
  }
  done = true;
  if (std::fclose(f) != 0) {
    std::remove(path.c_str());
    throw Error(path + ": write failed: " + errno_text());
  }
}

}  // namespace disagg::gpu
