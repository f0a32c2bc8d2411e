// Loading (mmap + validation + fingerprint) and writing of llama2.c checkpoints.
#include "model/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
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

#include "text/byte_bpe.h"
#include "text/hf_tokenizer.h"
#include "model/safetensors.h"
#include "gpu/error.h"
#include "gpu/file_check.h"
#include "gpu/fixed_math.h"
#include "model/gguf.h"
#include "gpu/json_fields.h"
#include "model/llama_tensors.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "llama2.c checkpoints are little-endian and are mapped as-is");

namespace disagg::gpu {
namespace {

constexpr size_t kHeaderInts = Llama2cLayout::kHeaderInts;
constexpr size_t kHeaderBytes = Llama2cLayout::kHeaderBytes;

// XXH3-64 (libxxhash, seed 0) of every byte of the checkpoint file. A model
// not yet in the page cache is read ahead (asynchronously) while it is hashed.
// Cost on a 211 MB model (2 cores): ~8 ms of hashing (AVX2) on top of faulting
// the pages in, which the engine's load does anyway.
//
// Hashed in chunks, each dropped from the process's memory once hashed
// (MADV_DONTNEED on a read-only private file mapping: the next access reads
// the page cache or the file again), so the hash does not make the whole
// file resident: a model's peak RSS is what the engine keeps (README).
// Several buffers (a Hugging Face directory's files) are hashed one after
// the other into one digest.
uint64_t fingerprint_bytes(const std::vector<std::pair<const void*, size_t>>& buffers) {
  constexpr size_t kChunk = size_t(32) << 20;
  XXH3_state_t* state = XXH3_createState();
  if (!state) throw Error("cannot allocate a hash state");
  XXH3_64bits_reset(state);
  for (const auto& [mapping, size] : buffers) {
    auto* base = static_cast<char*>(const_cast<void*>(mapping));
    for (size_t at = 0; at < size; at += kChunk) {
      const size_t n = std::min(kChunk, size - at);
      if (at + n < size) ::madvise(base + at + n, std::min(kChunk, size - at - n), MADV_WILLNEED);  // advice only
      XXH3_64bits_update(state, base + at, n);
      ::madvise(base + at, n, MADV_DONTNEED);
    }
  }
  const uint64_t hash = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return hash;
}
uint64_t fingerprint_bytes(void* mapping, size_t size) { return fingerprint_bytes({{mapping, size}}); }


// The file's name without its directory and extension.
std::string stem_of(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  const size_t dot = name.find_last_of('.');
  return dot == std::string::npos || dot == 0 ? name : name.substr(0, dot);
}

std::string shape_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

}  // namespace

// A GGUF file of the llama architecture (tensor names and shapes as
// llama.cpp writes them; dims[0] is a matrix's row length).
namespace {

// A token id the metadata names, checked against the vocabulary.
int token_id(const gguf::File& f, const std::string& path, const std::string& key, int vocab_size) {
  const uint64_t id = f.uint(key);
  if (id >= uint64_t(vocab_size))
    throw Error(path + ": metadata " + key + " = " + std::to_string(id) + " is outside the vocabulary of " +
                std::to_string(vocab_size));
  return int(id);
}

bool flag(const gguf::File& f, const std::string& path, const std::string& key, bool fallback) {
  const gguf::Value* v = f.find(key);
  if (!v) return fallback;
  if (v->type != gguf::ValueType::boolean) throw Error(path + ": metadata " + key + " must be a bool");
  return v->u != 0;
}

// The vocabulary of `tokenizer.ggml.*`: the `llama` (SentencePiece) and
// `gpt2` (byte-level BPE) models, one piece per row of token_embd.
Vocabulary read_vocabulary(const gguf::File& f, const std::string& path, int vocab_size) {
  const std::string& model = f.string("tokenizer.ggml.model");
  Vocabulary v;
  if (model == "llama") v.model = TokenizerModel::sentencepiece;
  else if (model == "gpt2") v.model = TokenizerModel::byte_bpe;
  else throw Error(path + ": tokenizer.ggml.model \"" + model + "\" is not supported (llama: SentencePiece, gpt2: byte-level BPE)");
  const auto& tokens = f.array("tokenizer.ggml.tokens", gguf::ValueType::string).array;
  if (tokens.size() != size_t(vocab_size))
    throw Error(path + ": the vocabulary has " + std::to_string(tokens.size()) + " tokens; token_embd.weight has " +
                std::to_string(vocab_size) + " rows");
  v.pieces.reserve(tokens.size());
  if (f.find("tokenizer.ggml.token_type")) {
    const auto& types = f.array("tokenizer.ggml.token_type", gguf::ValueType::i32).array;
    if (types.size() != tokens.size())
      throw Error(path + ": " + std::to_string(types.size()) + " token types for " + std::to_string(tokens.size()) + " tokens");
    for (size_t i = 0; i < types.size(); ++i) {
      if (types[i].i < 1 || types[i].i > 6)
        throw Error(path + ": token " + std::to_string(i) + " has type " + std::to_string(types[i].i) + " (GGUF's are 1..6)");
      v.types.push_back(TokenType(types[i].i));
    }
  }
  if (v.model == TokenizerModel::sentencepiece) {
    const auto& scores = f.array("tokenizer.ggml.scores", gguf::ValueType::f32).array;
    if (scores.size() != tokens.size())
      throw Error(path + ": " + std::to_string(scores.size()) + " scores for " + std::to_string(tokens.size()) + " tokens");
    for (const auto& t : tokens) v.pieces.push_back(llama2c_spelling(t.s));
    for (const auto& s : scores) v.scores.push_back(float(s.f));
  } else {
    for (const auto& t : tokens) v.pieces.push_back(t.s);
    for (const auto& m : f.array("tokenizer.ggml.merges", gguf::ValueType::string).array) v.merges.push_back(m.s);
    v.pre = f.find("tokenizer.ggml.pre") ? f.string("tokenizer.ggml.pre") : "default";
    try {
      pre_tokenizer(v.pre);  // an unknown one is an error at start, naming it
    } catch (const Error& e) {
      throw Error(path + ": " + e.what());
    }
  }
  // llama.cpp's defaults: SentencePiece has BOS 1 and adds it; byte-level BPE
  // has none unless the file names one (Llama 3 adds it, Qwen does not).
  v.bos = f.find("tokenizer.ggml.bos_token_id") ? token_id(f, path, "tokenizer.ggml.bos_token_id", vocab_size)
          : v.model == TokenizerModel::sentencepiece ? kBosToken : -1;
  v.eos = f.find("tokenizer.ggml.eos_token_id") ? token_id(f, path, "tokenizer.ggml.eos_token_id", vocab_size)
          : v.model == TokenizerModel::sentencepiece ? kEosToken : -1;
  if (f.find("tokenizer.chat_template")) v.chat_template = f.string("tokenizer.chat_template");
  if (f.find("tokenizer.chat_template.tool_use")) v.tool_use_template = f.string("tokenizer.chat_template.tool_use");
  v.add_bos = flag(f, path, "tokenizer.ggml.add_bos_token", v.model == TokenizerModel::sentencepiece) && v.bos >= 0;
  if (v.model == TokenizerModel::sentencepiece && v.bos != kBosToken)
    throw Error(path + ": metadata tokenizer.ggml.bos_token_id = " + std::to_string(v.bos) +
                " (a SentencePiece vocabulary has BOS 1 here so far)");
  return v;
}

}  // namespace

namespace {

// The layers' table grows as their tensors are found: a file's layer count
// sizes nothing before its tensors are there (a GGUF that claimed
// 2,000,000,000 layers asked for 336 GB here before the first lookup).
void grow_layers(Weights& w, int layer) {
  if (size_t(layer) >= w.layers.size()) w.layers.resize(size_t(layer) + 1);
}

// A GGUF file's model config: its architecture's metadata (every dimension
// and factor range-checked), the vocabulary size from token_embd's shape,
// Llama 3.1's rope_freqs tensor.
ModelConfig read_gguf_config(const gguf::File& f, const uint8_t* bytes, const std::string& path) {
  const std::string& arch = f.string("general.architecture");
  ModelConfig c;
  if (arch == "llama") c.arch = Architecture::llama;
  else if (arch == "qwen2") c.arch = Architecture::qwen2;
  else if (arch == "qwen3") c.arch = Architecture::qwen3;
  else throw Error(path + ": architecture " + arch + " is not supported (llama, qwen2 and qwen3 are)");
  const std::string p = arch + ".";  // the metadata keys' prefix
  auto dimension = [&](const std::string& key) {
    const uint64_t v = f.uint(key);
    if (v == 0 || v > uint64_t(std::numeric_limits<int32_t>::max()))
      throw Error(path + ": metadata " + key + " = " + std::to_string(v) + " is out of range");
    return int(v);
  };
  c.dim = dimension(p + "embedding_length");
  c.hidden_dim = dimension(p + "feed_forward_length");
  c.n_layers = dimension(p + "block_count");
  c.n_heads = dimension(p + "attention.head_count");
  c.n_kv_heads = f.find(p + "attention.head_count_kv") ? dimension(p + "attention.head_count_kv") : c.n_heads;
  c.seq_len = dimension(p + "context_length");
  if (f.find(p + "attention.key_length")) {  // a head size other than dim / heads (Qwen3)
    c.head_dim = dimension(p + "attention.key_length");
    if (f.find(p + "attention.value_length") && dimension(p + "attention.value_length") != c.head_dim)
      throw Error(path + ": metadata " + p + "attention.value_length differs from key_length (" +
                  std::to_string(c.head_dim) + ")");
  }
  const gguf::TensorInfo& embedding = f.require_tensor("token_embd.weight");
  if (embedding.dims.size() != 2 || embedding.dims[1] > std::numeric_limits<int32_t>::max())
    throw Error(path + ": tensor token_embd.weight: shape " + shape_text(embedding.dims) + " is no [dim, vocab] matrix");
  c.vocab_size = int(embedding.dims[1]);
  c.shared_classifier = f.tensor("output.weight") == nullptr;
  // Range-checked as a double: a float conversion of an f64 past float's range is undefined.
  const double rope_theta = f.number(p + "rope.freq_base", double(ModelConfig{}.rope_theta));
  if (!rope_theta_in_range(rope_theta)) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", rope_theta);
    throw Error(path + ": metadata " + p + "rope.freq_base = " + text + " is out of range");
  }
  c.rope_theta = float(rope_theta);
  if (std::string problem = validate(c); !problem.empty()) throw Error(path + ": " + problem);
  if (f.find(p + "rope.scaling.type") && f.string(p + "rope.scaling.type") != "none")
    throw Error(path + ": metadata " + p + "rope.scaling.type = " + f.string(p + "rope.scaling.type") +
                " (only none is computed so far; Llama 3.1's scaling is the rope_freqs tensor)");
  if (const gguf::TensorInfo* factors = f.tensor("rope_freqs.weight")) {
    const std::vector<int64_t> want{c.head_size() / 2};
    if (factors->dims != want || factors->type != uint32_t(gguf::TensorType::f32))
      throw Error(path + ": tensor rope_freqs.weight: shape " + shape_text(factors->dims) + " type " +
                  gguf::ggml_type_name(factors->type) + ", an f32 " + shape_text(want) + " is expected");
    if (factors->offset % sizeof(float) != 0)
      throw Error(path + ": tensor rope_freqs.weight: offset " + std::to_string(factors->offset) + " is not aligned");
    const auto* values = reinterpret_cast<const float*>(bytes + factors->offset);
    c.rope_factors.assign(values, values + want[0]);
    for (size_t i = 0; i < c.rope_factors.size(); ++i)
      if (!(c.rope_factors[i] > 0.0f) || !std::isfinite(c.rope_factors[i]))
        throw Error(path + ": tensor rope_freqs.weight: factor " + std::to_string(i) + " = " +
                    std::to_string(c.rope_factors[i]) + " is not a positive number");
  }
  const uint64_t rotary = f.uint(p + "rope.dimension_count", uint64_t(c.head_size()));
  if (rotary != uint64_t(c.head_size()))
    throw Error(path + ": metadata " + p + "rope.dimension_count = " + std::to_string(rotary) +
                ": only whole heads (" + std::to_string(c.head_size()) + ") are rotated so far");
  const double eps = f.number(p + "attention.layer_norm_rms_epsilon", double(c.rms_epsilon));
  if (!rms_epsilon_in_range(eps))
    throw Error(path + ": metadata " + p + "attention.layer_norm_rms_epsilon = " + std::to_string(eps) +
                " is out of range (0, 0.01]");
  c.rms_epsilon = float(eps);
  return c;
}

}  // namespace

void Checkpoint::load_gguf(size_t file_size) {
  const auto* bytes = static_cast<const uint8_t*>(mapping_);
  const gguf::File f = gguf::File::parse(bytes, file_size, path_);
  config_ = read_gguf_config(f, bytes, path_);
  ModelConfig& c = config_;

  // Each tensor by its name, with the shape the metadata gives it ({in, out}
  // as GGUF lists a matrix's dimensions, {n} a vector's): norms in f32,
  // matrices in any type the engine computes with, as stored.
  auto load = [&](Tensor which, int layer) -> Matrix {
    const std::string name = gguf_name(which, layer);
    const TensorShape shape = shape_of(which, c);
    const std::vector<int64_t> dims = is_matrix(which) ? std::vector<int64_t>{shape.cols, shape.rows}
                                                       : std::vector<int64_t>{shape.cols};
    const gguf::TensorInfo& t = f.require_tensor(name);
    if (t.dims != dims)
      throw Error(path_ + ": tensor " + name + ": shape " + shape_text(t.dims) + ", the metadata says " + shape_text(dims));
    const std::optional<WeightType> type = weight_type_of(gguf::TensorType(t.type));
    if (!is_matrix(which) && type != WeightType::f32)
      throw Error(path_ + ": tensor " + name + ": type " + gguf::ggml_type_name(t.type) + " (a norm must be f32)");
    if (!type)
      throw Error(path_ + ": tensor " + name + ": type " + gguf::ggml_type_name(t.type) +
                  " (the engine computes with f32, f16, bf16, q8_0, q4_0, q4_k, q5_k and q6_k matrices)");
    if (block_values(*type) == 1 && t.offset % block_bytes(*type) != 0)
      throw Error(path_ + ": tensor " + name + ": offset " + std::to_string(t.offset) + " is not aligned to its values");
    return Matrix{bytes + t.offset, *type};
  };
  Weights& w = weights_;
  for_each_tensor(c, [&](Tensor which, int layer) {
    const Matrix m = load(which, layer);
    grow_layers(w, layer);
    if (is_matrix(which)) w.matrix(which, layer) = m;
    else w.norm(which, layer) = static_cast<const float*>(m.data);
  });
  if (c.shared_classifier) w.wcls = w.token_embedding;

  if (f.find("tokenizer.ggml.model")) {
    vocabulary_ = read_vocabulary(f, path_, c.vocab_size);
    std::vector<int> named;
    for (const char* key : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"})
      if (f.find(key)) named.push_back(token_id(f, path_, key, c.vocab_size));
    c.end_tokens = end_tokens_of(*vocabulary_, named);
  }
  name_ = f.find("general.name") ? f.string("general.name") : stem_of(path_);
}

namespace {

// What identifies the bytes of the open file `fd` without reading them.
nlohmann::json file_identity(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return nullptr;
  auto ns = [](const timespec& t) { return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec; };
  return {{"device", uint64_t(st.st_dev)}, {"inode", uint64_t(st.st_ino)}, {"size", int64_t(st.st_size)},
          {"mtime_ns", ns(st.st_mtim)}, {"ctime_ns", ns(st.st_ctim)}};
}

// How old a file's last change must be before its fingerprint is remembered:
// far more than the kernel's timestamp tick (a few milliseconds).
constexpr int64_t kRacyNs = 1000000000;

// The fingerprint of the file model at `path` (open as `fd`, mapped at
// `mapping`): from its memo when the memo is of this file unchanged, else
// hashed, and the memo written (a temporary file renamed; failures ignored:
// the memo only saves time).
uint64_t file_fingerprint(const std::string& path, int fd, void* mapping, size_t size, const std::string& folder) {
  const std::string memo = model_side_file(path, folder, ".fingerprint");
  // (the time the identity is read at: the racy rule below compares the last change with it)
  timespec read_at {};
  ::clock_gettime(CLOCK_REALTIME, &read_at);
  const nlohmann::json identity = file_identity(fd);
  if (memo.empty() || identity.is_null()) return fingerprint_bytes(mapping, size);
  constexpr size_t kMemoBytes = 4096;  // a memo is ~150 bytes; anything larger is not one
  if (file_problem(memo).empty()) {
    try {
      const InputFile file = InputFile::open(memo);
      if (file.size() <= kMemoBytes) {
        const nlohmann::json j = nlohmann::json::parse(file.read_all());
        if (j.at("file") == identity) return std::stoull(j.at("fingerprint").get<std::string>(), nullptr, 16);
      }
    } catch (const std::exception&) {  // not a memo of ours: hashed and rewritten
    }
  }
  const uint64_t fingerprint = fingerprint_bytes(mapping, size);
  // A file changed within the clock's tick of its last change keeps its
  // times: no memo of one changed this recently before its identity was read
  // (git's "racy" rule; a change while it was hashed would leave the same
  // identity beside other bytes).
  if (int64_t(read_at.tv_sec) * 1000000000 + read_at.tv_nsec - identity.at("ctime_ns").get<int64_t>() < kRacyNs)
    return fingerprint;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fingerprint));
  const std::string text = nlohmann::json{{"file", identity}, {"fingerprint", hex}}.dump() + "\n";
  if (folder != "model") ::mkdir(std::filesystem::path(memo).parent_path().c_str(), 0755);  // (perhaps not made yet)
  try {
    write_regular_file(memo, text);
  } catch (const Error&) {  // (no memo: the next start hashes again)
  }
  return fingerprint;
}

}  // namespace

std::string model_side_file(const std::string& model_path, const std::string& folder, const std::string& suffix) {
  if (folder.empty() || folder == "off") return "";
  std::string name = model_path;
  while (name.size() > 1 && name.back() == '/') name.pop_back();
  const size_t slash = name.find_last_of('/');
  std::string dir = folder;
  if (folder == "model") {
    struct stat st {};
    if (::stat(model_path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) dir = name;
    else dir = slash == std::string::npos ? "." : slash == 0 ? "/" : name.substr(0, slash);
  }
  if (slash != std::string::npos) name = name.substr(slash + 1);
  return dir + "/" + name + suffix;
}

std::shared_ptr<const Checkpoint> Checkpoint::open(const std::string& path, const std::string& fingerprint_memo) {
  // A FIFO, socket or device is refused before anything blocks (gpu/file_check.h).
  const InputFile file = InputFile::open(path, Accept::regular_file_or_directory);
  const int fd = file.fd();
  if (file.is_directory()) {
    std::shared_ptr<Checkpoint> cp(new Checkpoint());
    cp->path_ = path;
    cp->load_hf(path);
    return cp;
  }
  const size_t file_size = file.size();
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
  if (uint32_t(header[0]) == gguf::kMagic) {
    std::shared_ptr<Checkpoint> cp = mapped();
    cp->load_gguf(file_size);
    cp->fingerprint_ = file_fingerprint(path, fd, cp->mapping_, file_size, fingerprint_memo);  // as for llama2.c
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

  const Llama2cLayout layout(config);
  const size_t expected = layout.file_bytes();
  if (file_size < expected)
    throw Error(path + ": truncated: expected " + std::to_string(expected) + " bytes, found " +
                std::to_string(file_size));
  if (file_size > expected)
    throw Error(path + ": too long: expected " + std::to_string(expected) + " bytes, found " +
                std::to_string(file_size) + " (trailing data or wrong dimensions)");

  std::shared_ptr<Checkpoint> cp = mapped();
  cp->config_ = config;
  void* mapping = cp->mapping_;
  const float* floats = reinterpret_cast<const float*>(static_cast<const char*>(mapping) + kHeaderBytes);
  Weights& w = cp->weights_;
  w.layers.resize(size_t(config.n_layers));
  for_each_tensor(config, [&](Tensor which, int layer) {
    const float* at = floats + layout.offset(which, layer);
    if (is_matrix(which)) w.matrix(which, layer) = Matrix{at, WeightType::f32};
    else w.norm(which, layer) = at;
  });
  if (config.shared_classifier) w.wcls = w.token_embedding;
  cp->name_ = stem_of(path);

  // Every byte of the file (header and all tensors, the unused RoPE tables
  // too): any changed, swapped or shuffled weight changes the fingerprint.
  cp->fingerprint_ = file_fingerprint(path, fd, mapping, file_size, fingerprint_memo);
  return cp;
}

// ---------------------------------------------------------------- Hugging Face directories

namespace {

// A whole regular file mapped read-only (a FIFO or device refused before
// anything blocks: gpu/file_check.h).
std::pair<void*, size_t> map_file(const std::string& path) {
  const InputFile file = InputFile::open(path);
  if (file.size() == 0) throw Error(path + ": empty");
  void* m = ::mmap(nullptr, file.size(), PROT_READ, MAP_PRIVATE, file.fd(), 0);
  if (m == MAP_FAILED) throw Error(path + ": cannot mmap: " + errno_text());
  return {m, file.size()};
}

// The token ids a config names (eos_token_id, an id or a list of them;
// bos_token_id, pad_token_id), each checked against the vocabulary as the
// GGUF path checks tokenizer.ggml.*_token_id: an id beyond it would index
// past the classifier's rows. Returns the end-of-generation ones.
std::vector<int> named_token_ids(const JsonFields& config, int vocab_size) {
  config.token_ids("bos_token_id", vocab_size);
  config.token_ids("pad_token_id", vocab_size);
  return config.token_ids("eos_token_id", vocab_size);
}

}  // namespace

// config.json (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM), model.safetensors or the shards its index names (F32,
// F16, BF16: mapped, not copied), tokenizer.json and tokenizer_config.json.
// Hugging Face's Llama keeps q/k rows in rotate_half order, which the engine
// rotates as it is (ModelConfig::rotate_half) instead of permuting a copy.
namespace {

// A Hugging Face directory's model: config.json (every value type- and
// range-checked), and the end ids it and generation_config.json name.
struct HfConfig {
  ModelConfig config;
  std::vector<int> end_ids;
};
HfConfig read_hf_config(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const nlohmann::json j = read_json_file(config_path);
  const JsonFields cfg(j, config_path);  // every value type- and range-checked (gpu/json_fields.h)
  HfConfig out;
  ModelConfig& c = out.config;
  const nlohmann::json& architectures = cfg.array("architectures");
  if (architectures.empty() || !architectures[0].is_string())
    wrong_json_value(config_path, "architectures", architectures, "a list of architecture names");
  const std::string arch = architectures[0].get<std::string>();
  if (arch == "LlamaForCausalLM" || arch == "MistralForCausalLM") c.arch = Architecture::llama, c.rotate_half = true;
  else if (arch == "Qwen2ForCausalLM") c.arch = Architecture::qwen2;
  else if (arch == "Qwen3ForCausalLM") c.arch = Architecture::qwen3;
  else throw Error(config_path + ": architectures[0] " + arch +
                   " is not supported (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM are)");
  constexpr int64_t kMaxDimension = std::numeric_limits<int32_t>::max();
  auto positive = [&](const char* key) { return int(cfg.integer(key, 1, kMaxDimension)); };
  c.dim = positive("hidden_size");
  c.hidden_dim = positive("intermediate_size");
  c.n_layers = positive("num_hidden_layers");
  c.n_heads = positive("num_attention_heads");
  c.n_kv_heads = cfg.has("num_key_value_heads") ? positive("num_key_value_heads") : c.n_heads;
  c.vocab_size = positive("vocab_size");
  c.seq_len = positive("max_position_embeddings");
  // Sliding-window attention (Mistral 7B v0.1; Qwen with use_sliding_window)
  // equals full attention up to the window: the context stops there.
  const bool windowed = arch == "MistralForCausalLM" || cfg.boolean("use_sliding_window", false);
  if (windowed && cfg.has("sliding_window")) c.seq_len = std::min(c.seq_len, positive("sliding_window"));
  if (cfg.has("head_dim")) {
    const int head_dim = positive("head_dim");
    if (int64_t(head_dim) * c.n_heads != c.dim) c.head_dim = head_dim;
  }
  // Range-checked as doubles: a float conversion of 1e300 is undefined.
  const double rope_theta = cfg.number("rope_theta", double(ModelConfig{}.rope_theta));
  const double rms_epsilon = cfg.number("rms_norm_eps", double(ModelConfig{}.rms_epsilon));
  if (!rope_theta_in_range(rope_theta)) cfg.wrong("rope_theta", "a number above 1 that fits a float");
  if (!rms_epsilon_in_range(rms_epsilon)) cfg.wrong("rms_norm_eps", "a number above 0 and at most 0.01");
  c.rope_theta = float(rope_theta);
  c.rms_epsilon = float(rms_epsilon);
  c.shared_classifier = cfg.boolean("tie_word_embeddings", false);
  if (cfg.has("rope_scaling")) {
    const JsonFields r = cfg.object("rope_scaling");
    const std::string type = r.has("rope_type") ? r.string("rope_type") : r.string("type", "");
    if (type != "llama3")
      throw Error(config_path + ": rope_scaling type \"" + type + "\" is not supported (llama3 is)");
    if (std::string problem = validate(c); !problem.empty()) throw Error(config_path + ": " + problem);
    auto factor = [&](const char* key) {
      const double v = r.number(key);
      if (!(v > 0.0 && v <= 1e6)) r.wrong(key, "a number above 0 and at most 1e6");
      return float(v);
    };
    const float scale = factor("factor"), low = factor("low_freq_factor"), high = factor("high_freq_factor");
    if (!(high > low)) r.wrong("high_freq_factor", "a number above low_freq_factor");
    c.rope_factors = llama3_rope_factors(c, scale, low, high,
                                         int(r.integer("original_max_position_embeddings", 1, kMaxDimension)));
  }
  if (std::string problem = validate(c); !problem.empty()) throw Error(config_path + ": " + problem);
  // The ids config.json and generation_config.json name, checked whether or
  // not the directory has a tokenizer (their eos ids end generation with one).
  out.end_ids = named_token_ids(cfg, c.vocab_size);
  const std::string generation = (fs::path(dir) / "generation_config.json").string();
  if (fs::exists(generation)) {
    const nlohmann::json g = read_json_file(generation);
    for (int id : named_token_ids(JsonFields(g, generation), c.vocab_size)) out.end_ids.push_back(id);
  }
  return out;
}

// The most shards a Hugging Face index may name (each is a file mapped and
// held open; Llama 3.1 405B has 191).
constexpr size_t kMaxShards = 4096;

// The weight files of a Hugging Face directory: model.safetensors, or the
// shards its index names (sorted, each once, each a file of the directory).
std::vector<std::string> hf_weight_files(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  const std::string single = (fs::path(dir) / "model.safetensors").string();
  const std::string index = (fs::path(dir) / "model.safetensors.index.json").string();
  if (fs::exists(single)) {
    files.push_back(single);
  } else if (fs::exists(index)) {
    const nlohmann::json ix = read_json_file(index);
    if (!ix.contains("weight_map") || !ix["weight_map"].is_object()) throw Error(index + ": no weight_map");
    std::set<std::string> shards;  // (sorted, each once)
    for (const auto& [name, file] : ix["weight_map"].items()) {
      if (!file.is_string()) throw Error(index + ": weight_map[" + name + "] is not a file name");
      const std::string f = file.get<std::string>();
      if (f.find('/') != std::string::npos || f == "..") throw Error(index + ": shard \"" + f + "\" is not a file of the directory");
      shards.insert((fs::path(dir) / f).string());
      if (shards.size() > kMaxShards)
        throw Error(index + ": more than " + std::to_string(kMaxShards) + " shards (each a file held open)");
    }
    files.assign(shards.begin(), shards.end());
  } else {
    throw Error(dir + ": neither model.safetensors nor model.safetensors.index.json");
  }
  return files;
}

}  // namespace

void Checkpoint::load_hf(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string config_path = (fs::path(dir) / "config.json").string();
  HfConfig hf = read_hf_config(dir);
  config_ = std::move(hf.config);
  const ModelConfig& c = config_;
  const std::vector<std::string> files = hf_weight_files(dir);
  std::map<std::string, std::pair<safetensors::Tensor, const uint8_t*>> tensors;  // name -> (info, file base)
  for (size_t i = 0; i < files.size(); ++i) {
    const auto mapped = map_file(files[i]);
    if (i == 0) mapping_ = mapped.first, mapping_size_ = mapped.second;
    else shards_.push_back(mapped);
    const auto* base = static_cast<const uint8_t*>(mapped.first);
    for (auto& [name, t] : safetensors::parse(base, mapped.second, files[i]))
      if (!tensors.emplace(name, std::pair{t, base}).second) throw Error(files[i] + ": tensor " + name + " is in two files");
  }

  Weights& w = weights_;
  for_each_tensor(c, [&](Tensor which, int layer) {
    const std::string name = hf_name(which, layer);
    auto it = tensors.find(name);
    if (it == tensors.end()) throw Error(dir + ": tensor " + name + " is missing");
    const safetensors::Tensor& t = it->second.first;
    const TensorShape shape = shape_of(which, c);
    const std::vector<int64_t> want = is_matrix(which) ? std::vector<int64_t>{shape.rows, shape.cols}
                                                       : std::vector<int64_t>{shape.cols};
    if (t.shape != want)
      throw Error(dir + ": tensor " + name + ": shape " + shape_text(t.shape) + ", the config says " + shape_text(want));
    const WeightType type = t.dtype == "F32" ? WeightType::f32 : t.dtype == "F16" ? WeightType::f16
                            : t.dtype == "BF16" ? WeightType::bf16
                                                : throw Error(dir + ": tensor " + name + ": dtype " + t.dtype +
                                                              " (F32, F16 and BF16 are read)");
    const uint8_t* data = it->second.second + t.offset;
    if (t.offset % block_bytes(type) != 0) throw Error(dir + ": tensor " + name + ": offset not aligned to its values");
    grow_layers(w, layer);
    if (is_matrix(which)) {
      w.matrix(which, layer) = Matrix{data, type};
    } else if (type == WeightType::f32) {
      w.norm(which, layer) = reinterpret_cast<const float*>(data);
    } else {  // a vector in 16 bits: widened once (a few KB)
      std::vector<float>& wide = widened_.emplace_back(size_t(shape.cols));
      dequantize_row(type, data, wide.data(), int(shape.cols));
      w.norm(which, layer) = wide.data();
    }
  });
  if (c.shared_classifier) w.wcls = w.token_embedding;

  // The vocabulary, its end tokens and chat template.
  const std::string tokenizer = (fs::path(dir) / "tokenizer.json").string();
  const std::string tokenizer_config = (fs::path(dir) / "tokenizer_config.json").string();
  const std::string chat_template = (fs::path(dir) / "chat_template.jinja").string();
  if (fs::exists(tokenizer)) {
    vocabulary_ = read_hf_tokenizer(tokenizer, fs::exists(tokenizer_config) ? tokenizer_config : "", c.vocab_size,
                                    fs::exists(chat_template) ? chat_template : "");
    std::vector<int> named = hf.end_ids;
    if (vocabulary_->eos >= 0) named.push_back(vocabulary_->eos);
    config_.end_tokens = end_tokens_of(*vocabulary_, named);
  }
  name_ = fs::path(dir).filename().string().empty() ? fs::path(dir).parent_path().filename().string()
                                                    : fs::path(dir).filename().string();

  // Every byte of config.json and the weight files.
  std::vector<std::pair<const void*, size_t>> buffers;
  const auto config_bytes = map_file(config_path);
  buffers.emplace_back(config_bytes.first, config_bytes.second);
  buffers.emplace_back(mapping_, mapping_size_);
  for (const auto& [m, n] : shards_) buffers.emplace_back(m, n);
  fingerprint_ = fingerprint_bytes(buffers);
  ::munmap(config_bytes.first, config_bytes.second);
}

Tokenizer load_tokenizer(const Checkpoint& checkpoint, const std::string& tokenizer_path) {
  if (!tokenizer_path.empty()) return Tokenizer::load(tokenizer_path, checkpoint.config().vocab_size);
  if (checkpoint.vocabulary()) return Tokenizer::from_vocabulary(*checkpoint.vocabulary(), checkpoint.path());
  throw Error(checkpoint.path() + ": the model file has no vocabulary: name a tokenizer file");
}

Matrix& Weights::matrix(Tensor t, int layer) {
  switch (t) {
    case Tensor::token_embedding: return token_embedding;
    case Tensor::wcls: return wcls;
    case Tensor::wq: return layers[size_t(layer)].wq;
    case Tensor::wk: return layers[size_t(layer)].wk;
    case Tensor::wv: return layers[size_t(layer)].wv;
    case Tensor::wo: return layers[size_t(layer)].wo;
    case Tensor::w1: return layers[size_t(layer)].w1;
    case Tensor::w2: return layers[size_t(layer)].w2;
    case Tensor::w3: return layers[size_t(layer)].w3;
    default: throw Error(gguf_name(t, layer) + " is a norm, not a matrix");
  }
}

const float*& Weights::norm(Tensor t, int layer) {
  switch (t) {
    case Tensor::rms_att: return layers[size_t(layer)].rms_att;
    case Tensor::rms_ffn: return layers[size_t(layer)].rms_ffn;
    case Tensor::rms_final: return rms_final;
    case Tensor::bq: return layers[size_t(layer)].bq;
    case Tensor::bk: return layers[size_t(layer)].bk;
    case Tensor::bv: return layers[size_t(layer)].bv;
    case Tensor::q_norm: return layers[size_t(layer)].q_norm;
    case Tensor::k_norm: return layers[size_t(layer)].k_norm;
    default: throw Error(gguf_name(t, layer) + " is a matrix, not a norm");
  }
}

void Checkpoint::release(const void* ptr, size_t bytes) const {
  const auto page = uintptr_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (uintptr_t(ptr) + page - 1) / page * page, end = (uintptr_t(ptr) + bytes) / page * page;
  auto inside = [&](void* m, size_t n) { return begin >= uintptr_t(m) && end <= uintptr_t(m) + n; };
  bool ours = inside(mapping_, mapping_size_);
  for (const auto& [m, n] : shards_) ours = ours || inside(m, n);
  if (begin < end && ours) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

Checkpoint::~Checkpoint() {
  if (mapping_) ::munmap(mapping_, mapping_size_);
  for (const auto& [m, n] : shards_) ::munmap(m, n);
}

}  // namespace disagg::gpu
