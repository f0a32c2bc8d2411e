#include "model/model_writer.h"

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "gpu/error.h"
#include "gpu/file_check.h"
#include "model/safetensors.h"
#include "gpu/fixed_math.h"
#include "model/gguf.h"

namespace disagg::gpu {

namespace {

struct FileTypeInfo {
  FileType type;
  const char* name;
  WeightType matrices;
  uint32_t llama_ftype;  // general.file_type: llama.cpp's llama_ftype number
};
// llama_ftype: ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q4_0 2, MOSTLY_Q8_0 7,
// MOSTLY_Q4_K_M 15, MOSTLY_Q5_K_M 17, MOSTLY_BF16 32.
constexpr FileTypeInfo kFileTypes[] = {
    {FileType::f32, "f32", WeightType::f32, 0},     {FileType::f16, "f16", WeightType::f16, 1},
    {FileType::bf16, "bf16", WeightType::bf16, 32}, {FileType::q8_0, "q8_0", WeightType::q8_0, 7},
    {FileType::q4_0, "q4_0", WeightType::q4_0, 2},  {FileType::q4_k_m, "q4_k_m", WeightType::q4_k, 15},
    {FileType::q5_k_m, "q5_k_m", WeightType::q5_k, 17},
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

const char* file_type_names() {
  static const std::string names = [] {
    std::string all;
    for (const FileTypeInfo& i : kFileTypes) all += (all.empty() ? "" : "|") + std::string(i.name);
    return all;
  }();
  return names.c_str();
}

WeightType matrix_type(FileType type, Tensor t, int layer, const ModelConfig& config) {
  const WeightType want = info(type).matrices;
  if (!is_matrix(t)) return WeightType::f32;
  if (type == FileType::q4_k_m || type == FileType::q5_k_m) {
    const bool more = t == Tensor::wcls || (t == Tensor::token_embedding && config.shared_classifier) ||
                      ((t == Tensor::wv || t == Tensor::w2) && use_more_bits(layer, config.n_layers));
    return fitting(more ? WeightType::q6_k : want, shape_of(t, config).cols);
  }
  if (is_block_quantized(want) && shape_of(t, config).cols % kQ8Block != 0) return WeightType::f32;
  return want;
}

// ---------------------------------------------------------------- sources

namespace {

// Rows in GGUF order: a Hugging Face Llama's q/k rows (rotate_half order)
// are read through the converter's permutation, so its config says none.
class CheckpointSource final : public WeightSource {
 public:
  explicit CheckpointSource(std::shared_ptr<const Checkpoint> c) : c_(std::move(c)), config_(c_->config()) {
    config_.rotate_half = false;
  }
  const ModelConfig& config() const override { return config_; }
  void row(Tensor t, int layer, int64_t r, float* out) const override {
    const Weights& w = c_->weights();
    const int64_t cols = shape_of(t, config()).cols;
    if (c_->config().rotate_half && (t == Tensor::wq || t == Tensor::wk)) {
      // GGUF row (head, 2i + j) is Hugging Face's (head, j * half + i).
      const int64_t hd = config_.head_size(), half = hd / 2, head = r / hd, within = r % hd;
      r = head * hd + (within % 2) * half + within / 2;
    }
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
  ModelConfig config_;
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

}  // namespace

std::unique_ptr<WeightSource> checkpoint_weights(std::shared_ptr<const Checkpoint> checkpoint) {
  return std::make_unique<CheckpointSource>(std::move(checkpoint));
}

std::unique_ptr<WeightSource> random_weights(const ModelConfig& config, uint64_t seed) {
  if (std::string problem = validate(config); !problem.empty()) throw Error(problem);
  return std::make_unique<RandomSource>(config, seed);
}

// ---------------------------------------------------------------- Hugging Face

void write_hf_directory(const WeightSource& weights, const std::string& dir, FileType type, int shards) {
  const ModelConfig& c = weights.config();
  const WeightType wt = info(type).matrices;
  if (wt != WeightType::f32 && wt != WeightType::f16 && wt != WeightType::bf16)
    throw Error(dir + ": a Hugging Face directory is written in f32, f16 or bf16");
  if (!c.rope_factors.empty()) throw Error(dir + ": RoPE factors are not written to a Hugging Face config");
  if (shards < 1) throw Error(dir + ": at least one shard");
  std::filesystem::create_directories(dir);
  const char* arch = c.arch == Architecture::qwen2 ? "Qwen2ForCausalLM"
                     : c.arch == Architecture::qwen3 ? "Qwen3ForCausalLM" : "LlamaForCausalLM";
  nlohmann::json config{{"architectures", {arch}},
                        {"hidden_size", c.dim},
                        {"intermediate_size", c.hidden_dim},
                        {"num_hidden_layers", c.n_layers},
                        {"num_attention_heads", c.n_heads},
                        {"num_key_value_heads", c.n_kv_heads},
                        {"vocab_size", c.vocab_size},
                        {"max_position_embeddings", c.seq_len},
                        {"rope_theta", c.rope_theta},
                        {"rms_norm_eps", c.rms_epsilon},
                        {"tie_word_embeddings", c.shared_classifier},
                        {"head_dim", c.head_size()},
                        {"torch_dtype", type == FileType::f32 ? "float32" : type == FileType::f16 ? "float16" : "bfloat16"}};
  write_regular_file((std::filesystem::path(dir) / "config.json").string(), config.dump(2));

  // Each tensor's bytes, rows in Hugging Face's order.
  std::vector<std::pair<std::string, safetensors::Input>> all;
  for_each_tensor(c, [&](Tensor t, int layer) {
    const TensorShape shape = shape_of(t, c);
    const WeightType tt = is_matrix(t) ? wt : WeightType::f32;
    safetensors::Input in;
    in.dtype = tt == WeightType::f32 ? "F32" : tt == WeightType::f16 ? "F16" : "BF16";
    in.shape = is_matrix(t) ? std::vector<int64_t>{shape.rows, shape.cols} : std::vector<int64_t>{shape.cols};
    const size_t bytes = row_bytes(tt, int(shape.cols));
    in.data.resize(size_t(shape.rows) * bytes);
    const bool permute = c.arch == Architecture::llama && (t == Tensor::wq || t == Tensor::wk);
    const int hd = c.head_size(), half = hd / 2;
    std::vector<float> values(size_t(shape.cols));
    for (int64_t r = 0; r < shape.rows; ++r) {
      // HF row (head, j, i) holds GGUF row (head, 2i + j).
      int64_t from = r;
      if (permute) {
        const int64_t head = r / hd, within = r % hd, j = within / half, i = within % half;
        from = head * hd + 2 * i + j;
      }
      weights.row(t, layer, from, values.data());
      quantize_row(tt, values.data(), in.data.data() + size_t(r) * bytes, int(shape.cols));
    }
    all.emplace_back(hf_name(t, layer), std::move(in));
  });
  nlohmann::json index{{"metadata", nlohmann::json::object()}, {"weight_map", nlohmann::json::object()}};
  for (int s = 0; s < shards; ++s) {
    std::map<std::string, safetensors::Input> part;
    const std::string file = shards == 1 ? "model.safetensors"
                                         : "model-" + std::to_string(s + 1) + "-of-" + std::to_string(shards) + ".safetensors";
    for (size_t i = size_t(s); i < all.size(); i += size_t(shards)) {
      index["weight_map"][all[i].first] = file;
      part.emplace(all[i].first, std::move(all[i].second));
    }
    safetensors::write((std::filesystem::path(dir) / file).string(), part);
  }
  if (shards > 1)
    write_regular_file((std::filesystem::path(dir) / "model.safetensors.index.json").string(), index.dump(2));
}

// ---------------------------------------------------------------- GGUF


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
    // has no types: <unk>, <s> and </s>, then the bytes, then the rest.
    tokens.push_back(spm ? sentencepiece_spelling(v.pieces[i]) : v.pieces[i]);
    const int id = int(i);
    const TokenType by_position = id == 0                        ? TokenType::unknown
                                  : id < kByteTokenOffset        ? TokenType::control
                                  : id < kByteTokenOffset + 256  ? TokenType::byte
                                                                 : TokenType::normal;
    types.push_back(int32_t(v.types.empty() ? by_position : v.types[i]));
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
  if (!v.tool_use_template.empty())
    w.add("tokenizer.chat_template.tool_use", gguf::Writer::str(v.tool_use_template));

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
  const ModelConfig llama2c;  // (its constants are ModelConfig's defaults)
  if (config.arch != Architecture::llama || config.rms_epsilon != llama2c.rms_epsilon || !config.rope_factors.empty() ||
      config.rope_theta != llama2c.rope_theta || config.head_dim != 0)
    throw Error(path + ": a llama2.c checkpoint holds the llama architecture with llama2.c's constants only");
  const Llama2cLayout layout(config);
  if (layout.file_bytes() == std::numeric_limits<size_t>::max()) throw Error(path + ": model too large to write");
  const RandomSource weights(config, seed);

  // (written whole or not at all: a half-written checkpoint must never be
  // left behind looking like a model)
  OutputFile file = OutputFile::create(path);
  std::FILE* f = file.stream();
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
  file.commit();
}

}  // namespace disagg::gpu
