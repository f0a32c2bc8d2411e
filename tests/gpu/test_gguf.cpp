// model/gguf.h: GGUF files written and read back (every metadata type, every
// tensor type, alignment), and bad files: each gets gpu::Error naming the
// file and the key or tensor, and nothing is allocated from a count or
// length the file announces before it is checked (every prefix of a valid
// file and thousands of damaged copies parse or fail cleanly).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "text/byte_bpe.h"
#include "model/checkpoint.h"
#include "gpu/open_error.h"
#include "gpu/error.h"
#include "model/gguf.h"
#include "support/test_paths.h"

namespace disagg::gpu::gguf {
namespace {

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

// Bytes of a GGUF file made by hand, for files the Writer would not write.
struct Bytes {
  std::vector<uint8_t> b;
  template <class T>
  Bytes& put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof v);
    return *this;
  }
  Bytes& str(const std::string& s) {
    put<uint64_t>(s.size());
    b.insert(b.end(), s.begin(), s.end());
    return *this;
  }
  Bytes& header(uint64_t tensors, uint64_t kvs, uint32_t version = 3) {
    return put<uint32_t>(0x46554747).put<uint32_t>(version).put<uint64_t>(tensors).put<uint64_t>(kvs);
  }
  Bytes& tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type, uint64_t offset) {
    str(name).put<uint32_t>(uint32_t(dims.size()));
    for (auto d : dims) put<uint64_t>(d);
    return put<uint32_t>(type).put<uint64_t>(offset);
  }
  Bytes& pad_to(size_t alignment) {
    while (b.size() % alignment) b.push_back(0);
    return *this;
  }
  Bytes& zeros(size_t n) {
    b.insert(b.end(), n, 0);
    return *this;
  }
};

std::string error_of(const std::vector<uint8_t>& bytes) {
  try {
    File::parse(bytes.data(), bytes.size(), "bad.gguf");
  } catch (const Error& e) {
    return e.what();
  }
  return "(parsed)";
}

// A file with metadata of every type and one tensor of each supported type.
std::string write_sample(const std::string& dir, uint64_t alignment) {
  Writer w(alignment);
  w.add("general.architecture", Writer::str("llama"));
  w.add("llama.block_count", Writer::u32(2));
  w.add("llama.rope.freq_base", Writer::f32(10000.0f));
  w.add("flag", Writer::boolean(true));
  w.add("tokenizer.ggml.tokens", Writer::strings({"<unk>", "<s>", "</s>", "a"}));
  w.add("tokenizer.ggml.scores", Writer::f32s({0.0f, -1.5f, 2.25f, 3.0f}));
  w.add("tokenizer.ggml.token_type", Writer::i32s({2, 3, 3, 1}));
  Value i64;
  i64.type = ValueType::i64;
  i64.i = -5;
  w.add("signed", i64);
  Value f64;
  f64.type = ValueType::f64;
  f64.f = 0.125;
  w.add("double", f64);
  const struct {
    const char* name;
    TensorType type;
    int64_t row;
  } kinds[] = {{"f32", TensorType::f32, 3},   {"f16", TensorType::f16, 5},   {"bf16", TensorType::bf16, 7},
               {"q4_0", TensorType::q4_0, 64}, {"q8_0", TensorType::q8_0, 32}, {"q4_k", TensorType::q4_k, 256},
               {"q5_k", TensorType::q5_k, 512}, {"q6_k", TensorType::q6_k, 256}};
  for (const auto& k : kinds) {
    const auto traits = *traits_of(uint32_t(k.type));
    const size_t bytes = size_t(k.row / traits.block_elems * traits.block_bytes * 2);
    const uint8_t fill = uint8_t(k.type);
    w.add_tensor(k.name, {k.row, 2}, uint32_t(k.type), [bytes, fill](std::FILE* f) {
      std::vector<uint8_t> data(bytes, fill);
      std::fwrite(data.data(), 1, data.size(), f);
    });
  }
  const std::string path = dir + "/sample-" + std::to_string(alignment) + ".gguf";
  w.write(path);
  return path;
}

TEST(Gguf, WrittenFilesReadBackWithEveryTypeAndAlignment) {
  const std::string dir = test::make_temp_dir("gguf");
  for (uint64_t alignment : {32u, 64u, 4096u}) {
    SCOPED_TRACE(alignment);
    const auto bytes = read_all(write_sample(dir, alignment));
    const File f = File::parse(bytes.data(), bytes.size(), "sample.gguf");
    EXPECT_EQ(f.version(), 3u);
    EXPECT_EQ(f.alignment(), alignment);
    EXPECT_EQ(f.data_offset() % alignment, 0u);
    EXPECT_EQ(f.string("general.architecture"), "llama");
    EXPECT_EQ(f.uint("llama.block_count"), 2u);
    EXPECT_EQ(f.number("llama.rope.freq_base"), 10000.0);
    EXPECT_EQ(f.number("double"), 0.125);
    EXPECT_EQ(f.find("signed")->i, -5);
    EXPECT_EQ(f.find("flag")->u, 1u);
    EXPECT_EQ(f.uint("absent", 7), 7u);
    const Value& tokens = f.array("tokenizer.ggml.tokens", ValueType::string);
    ASSERT_EQ(tokens.array.size(), 4u);
    EXPECT_EQ(tokens.array[3].s, "a");
    EXPECT_EQ(f.array("tokenizer.ggml.scores", ValueType::f32).array[2].f, 2.25);
    EXPECT_EQ(f.array("tokenizer.ggml.token_type", ValueType::i32).array[0].i, 2);
    ASSERT_EQ(f.tensors().size(), 8u);
    for (const auto& t : f.tensors()) {
      SCOPED_TRACE(t.name);
      EXPECT_EQ(t.offset % alignment, 0u);
      EXPECT_EQ(ggml_type_name(t.type), t.name);
      EXPECT_EQ(t.dims[1], 2);
      ASSERT_LE(t.offset + t.bytes, bytes.size());
      for (uint64_t k = 0; k < t.bytes; ++k) ASSERT_EQ(bytes[t.offset + k], uint8_t(t.type)) << "byte " << k;
    }
    EXPECT_EQ(f.require_tensor("q4_k").bytes, 2u * 144u);
    EXPECT_EQ(f.require_tensor("q5_k").bytes, 2u * 2u * 176u);
    EXPECT_EQ(f.require_tensor("q6_k").bytes, 2u * 210u);
    EXPECT_EQ(f.require_tensor("q4_0").bytes, 2u * 2u * 18u);
    EXPECT_EQ(f.require_tensor("q8_0").bytes, 2u * 34u);
  }
}

TEST(Gguf, MissingKeysTensorsAndWrongTypesNameThem) {
  const std::string dir = test::make_temp_dir("gguf-keys");
  const auto bytes = read_all(write_sample(dir, 32));
  const File f = File::parse(bytes.data(), bytes.size(), "sample.gguf");
  auto message = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(message([&] { f.uint("llama.context_length"); }), "sample.gguf: metadata llama.context_length is missing");
  EXPECT_EQ(message([&] { f.uint("general.architecture"); }),
            "sample.gguf: metadata general.architecture must be a non-negative integer, not string");
  EXPECT_EQ(message([&] { f.uint("signed"); }), "sample.gguf: metadata signed must be a non-negative integer, not i64");
  EXPECT_EQ(message([&] { f.string("llama.block_count"); }), "sample.gguf: metadata llama.block_count must be a string, not u32");
  EXPECT_EQ(message([&] { f.array("tokenizer.ggml.scores", ValueType::string); }),
            "sample.gguf: metadata tokenizer.ggml.scores must be an array of string");
  EXPECT_EQ(message([&] { f.require_tensor("output.weight"); }), "sample.gguf: tensor output.weight is missing");
}

TEST(Gguf, BadFilesGetAnErrorNamingTheProblem) {
  const struct {
    const char* what;
    std::vector<uint8_t> bytes;
    const char* expected;
  } cases[] = {
      {"empty", {}, "truncated: magic"},
      {"magic", Bytes().put<uint32_t>(0x67676d6c).put<uint32_t>(3).b, "not a GGUF file"},
      {"version 1", Bytes().header(0, 0, 1).b, "GGUF version 1"},
      {"version 4", Bytes().header(0, 0, 4).b, "GGUF version 4"},
      {"tensor count", Bytes().header(40000, 0).b, "tensors cannot fit in the file"},
      {"metadata count", Bytes().header(0, 40000).b, "metadata entries cannot fit in the file"},
      {"tensors in all", Bytes().header(uint64_t(1) << 60, 0).b, "1152921504606846976 tensors are more than the 65536 read"},
      {"metadata in all", Bytes().header(0, 65537).zeros(65537 * 13).b, "65537 metadata entries are more than the 65536 read"},
      {"key length", Bytes().header(0, 1).put<uint64_t>(uint64_t(1) << 62).zeros(16).b,
       "metadata key of 4611686018427387904 bytes runs past the end"},
      {"value type", Bytes().header(0, 1).str("k").put<uint32_t>(13).zeros(8).b, "metadata k: unknown value type 13"},
      {"array count", Bytes().header(0, 1).str("k").put<uint32_t>(9).put<uint32_t>(6).put<uint64_t>(uint64_t(1) << 40).zeros(8).b,
       "metadata k: an array of 1099511627776 f32 values cannot fit"},
      {"string array count",
       Bytes().header(0, 1).str("k").put<uint32_t>(9).put<uint32_t>(8).put<uint64_t>(1000000).zeros(64).b,
       "an array of 1000000 string values cannot fit"},
      {"array values in all",  // 6 MB of u8 would fit, but as ~600 MB of values: refused
       Bytes().header(0, 2).str("k").put<uint32_t>(9).put<uint32_t>(0).put<uint64_t>(3000000).zeros(3000000)
           .str("l").put<uint32_t>(9).put<uint32_t>(0).put<uint64_t>(3000000).zeros(3000000).b,
       "metadata l: an array of 3000000 values makes more than 4194304 array values in all"},
      {"nested arrays", [] {
         Bytes b;
         b.header(0, 1).str("k").put<uint32_t>(9);
         for (int i = 0; i < 6; ++i) b.put<uint32_t>(9).put<uint64_t>(1);
         b.put<uint32_t>(4).put<uint64_t>(1).put<uint32_t>(1);
         return b.b;
       }(), "arrays nested deeper than 4"},
      {"bool", Bytes().header(0, 1).str("k").put<uint32_t>(7).put<uint8_t>(2).zeros(8).b, "metadata k: a boolean of 2"},
      {"duplicate key", Bytes().header(0, 2).str("k").put<uint32_t>(4).put<uint32_t>(1).str("k").put<uint32_t>(4).put<uint32_t>(2).b,
       "metadata k appears twice"},
      {"alignment", Bytes().header(0, 1).str("general.alignment").put<uint32_t>(4).put<uint32_t>(48).b,
       "general.alignment must be a power of two"},
      {"negative alignment", Bytes().header(0, 1).str("general.alignment").put<uint32_t>(5).put<int32_t>(-32).b,
       "general.alignment must be a power of two"},
      {"no dims", Bytes().header(1, 0).tensor("w", {}, 0, 0).zeros(64).b, "tensor w: 0 dimensions"},
      {"five dims", Bytes().header(1, 0).tensor("w", {1, 1, 1, 1, 1}, 0, 0).zeros(64).b, "tensor w: 5 dimensions"},
      {"zero dim", Bytes().header(1, 0).tensor("w", {4, 0}, 0, 0).zeros(64).b, "tensor w: dimension 0 is zero"},
      {"huge dims", Bytes().header(1, 0).tensor("w", {uint64_t(1) << 40, uint64_t(1) << 40}, 0, 0).zeros(64).b,
       "makes the tensor too large"},
      {"q5_1", Bytes().header(1, 0).tensor("blk.0.attn_q.weight", {32, 2}, 7, 0).zeros(64).b,
       "tensor blk.0.attn_q.weight: type q5_1 is not supported"},
      {"unknown type", Bytes().header(1, 0).tensor("w", {32}, 99, 0).zeros(64).b, "tensor w: type 99 is not supported"},
      {"partial block", Bytes().header(1, 0).tensor("w", {48, 2}, 8, 0).zeros(64).b,
       "tensor w: rows of 48 values are not whole q8_0 blocks of 32"},
      {"unaligned offset", Bytes().header(1, 0).tensor("w", {4}, 0, 8).zeros(64).b,
       "tensor w: offset 8 is not a multiple of the alignment 32"},
      {"duplicate tensor", Bytes().header(2, 0).tensor("w", {4}, 0, 0).tensor("w", {4}, 0, 32).zeros(128).b,
       "tensor w: appears twice"},
      {"past the end", Bytes().header(1, 0).tensor("w", {1024}, 0, 0).pad_to(32).zeros(100).b,
       "tensor w: its 4096 bytes at offset 0 end past the file's"},
      {"offset past the end", Bytes().header(1, 0).tensor("w", {4}, 0, ~uint64_t(0) - 31).zeros(64).b,
       "end past the file's"},
  };
  for (const auto& c : cases) {
    const std::string e = error_of(c.bytes);
    EXPECT_EQ(e.rfind("bad.gguf: ", 0), 0u) << c.what << ": " << e;
    EXPECT_NE(e.find(c.expected), std::string::npos) << c.what << ": " << e;
  }
}

// general.alignment as any integer type, as every other integer of the file
// (a signed one was refused as "not a power of two").
TEST(Gguf, TheAlignmentMayBeASignedInteger) {
  for (const uint32_t type : {4u, 5u}) {  // u32, i32
    const auto bytes = Bytes().header(0, 1).str("general.alignment").put<uint32_t>(type).put<uint32_t>(64).b;
    EXPECT_EQ(File::parse(bytes.data(), bytes.size(), "a.gguf").alignment(), 64u) << "type " << type;
  }
}

// No two tensors' bytes overlap (issue 44: token_embd's type changed so that
// its bytes ran into the next tensor was accepted, each byte then read as
// two tensors' weights); the error names both. Adjacent tensors are fine.
TEST(Gguf, OverlappingTensorsAreRefusedNamingBoth) {
  const struct {
    const char* what;
    std::vector<uint8_t> bytes;
    const char* expected;
  } cases[] = {
      {"runs into the next", Bytes().header(2, 0).tensor("a", {32}, 0, 0).tensor("b", {8}, 0, 64).pad_to(32).zeros(256).b,
       "bad.gguf: tensors a and b overlap: a's 128 bytes at offset 0 run into b at offset 64"},
      {"listed in another order", Bytes().header(2, 0).tensor("b", {8}, 0, 64).tensor("a", {32}, 0, 0).pad_to(32).zeros(256).b,
       "bad.gguf: tensors a and b overlap: a's 128 bytes at offset 0 run into b at offset 64"},
      {"a type with more bytes", Bytes().header(2, 0).tensor("a", {32}, 0 /* f32: 128 bytes */, 0).tensor("b", {32}, 8, 96)
                                     .pad_to(32).zeros(256).b,
       "bad.gguf: tensors a and b overlap: a's 128 bytes at offset 0 run into b at offset 96"},
      {"one inside another", Bytes().header(3, 0).tensor("a", {64}, 0, 0).tensor("b", {8}, 0, 256).tensor("c", {8}, 0, 32)
                                 .pad_to(32).zeros(512).b,
       "bad.gguf: tensors a and c overlap: a's 256 bytes at offset 0 run into c at offset 32"},
  };
  for (const auto& c : cases) EXPECT_EQ(error_of(c.bytes), c.expected) << c.what;
  const std::string e = error_of(Bytes().header(2, 0).tensor("a", {8}, 0, 32).tensor("b", {8}, 0, 32).pad_to(32).zeros(128).b);
  EXPECT_TRUE(e == "bad.gguf: tensors a and b overlap: a's 32 bytes at offset 32 run into b at offset 32" ||
              e == "bad.gguf: tensors b and a overlap: b's 32 bytes at offset 32 run into a at offset 32")
      << "the same offset: " << e;
  EXPECT_EQ(error_of(Bytes().header(2, 0).tensor("a", {8}, 0, 0).tensor("b", {8}, 0, 32).pad_to(32).zeros(64).b), "(parsed)");
}

// Every prefix of a valid file and thousands of copies with damaged bytes:
// each parses or throws gpu::Error (under ASan-free Release, a wild length
// would show as std::bad_alloc or a crash).
TEST(Gguf, EveryPrefixAndDamagedCopiesParseOrFailCleanly) {
  const std::string dir = test::make_temp_dir("gguf-damage");
  const auto good = read_all(write_sample(dir, 32));
  const size_t header_end = File::parse(good.data(), good.size(), "x").data_offset();
  for (size_t n = 0; n < good.size(); ++n) {
    const std::vector<uint8_t> prefix(good.begin(), good.begin() + long(n));
    const std::string e = error_of(prefix);
    ASSERT_EQ(e.rfind("bad.gguf: ", 0), 0u) << "prefix of " << n << " bytes: " << e;
  }
  std::mt19937_64 rng(5);
  int parsed = 0;
  for (int k = 0; k < 5000; ++k) {
    auto bytes = good;
    for (int edits = 1 + int(rng() % 3); edits > 0; --edits) {
      const size_t at = rng() % header_end;  // the metadata and tensor infos, where lengths live
      bytes[at] = rng() % 4 == 0 ? 0xff : uint8_t(rng());
    }
    try {
      File::parse(bytes.data(), bytes.size(), "bad.gguf");
      ++parsed;
    } catch (const Error&) {
    }
  }
  EXPECT_LT(parsed, 5000);
}

}  // namespace
}  // namespace disagg::gpu::gguf

// ---------------------------------------------------------------- GGUF models (model/checkpoint.h)

namespace disagg::gpu {
namespace {

// A small llama-architecture GGUF with zero F32 weights, the parts of which a
// test may change before it is written.
struct ModelFile {
  struct Tensor {
    std::string name;
    std::vector<int64_t> dims;
    uint32_t type = uint32_t(gguf::TensorType::f32);
  };
  std::vector<std::pair<std::string, gguf::Value>> metadata;
  std::vector<Tensor> tensors;

  ModelFile() {
    const int64_t dim = 64, hidden = 96, layers = 2, vocab = 300, kv = 32;
    metadata = {{"general.architecture", gguf::Writer::str("llama")},
                {"general.name", gguf::Writer::str("tiny")},
                {"llama.context_length", gguf::Writer::u32(128)},
                {"llama.embedding_length", gguf::Writer::u32(uint32_t(dim))},
                {"llama.block_count", gguf::Writer::u32(uint32_t(layers))},
                {"llama.feed_forward_length", gguf::Writer::u32(uint32_t(hidden))},
                {"llama.attention.head_count", gguf::Writer::u32(4)},
                {"llama.attention.head_count_kv", gguf::Writer::u32(2)},
                {"llama.attention.layer_norm_rms_epsilon", gguf::Writer::f32(1e-5f)}};
    tensors.push_back({"token_embd.weight", {dim, vocab}});
    for (int l = 0; l < layers; ++l) {
      const std::string b = "blk." + std::to_string(l) + ".";
      for (auto& t : std::vector<Tensor>{{b + "attn_norm.weight", {dim}},       {b + "attn_q.weight", {dim, dim}},
                                         {b + "attn_k.weight", {dim, kv}},      {b + "attn_v.weight", {dim, kv}},
                                         {b + "attn_output.weight", {dim, dim}}, {b + "ffn_norm.weight", {dim}},
                                         {b + "ffn_gate.weight", {dim, hidden}}, {b + "ffn_down.weight", {hidden, dim}},
                                         {b + "ffn_up.weight", {dim, hidden}}})
        tensors.push_back(t);
    }
    tensors.push_back({"output_norm.weight", {dim}});
  }
  void set(const std::string& key, gguf::Value v) {
    for (auto& [k, value] : metadata)
      if (k == key) {
        value = std::move(v);
        return;
      }
    metadata.emplace_back(key, std::move(v));
  }
  void drop_key(const std::string& key) {
    metadata.erase(std::remove_if(metadata.begin(), metadata.end(), [&](const auto& m) { return m.first == key; }),
                   metadata.end());
  }
  Tensor& tensor(const std::string& name) {
    for (auto& t : tensors)
      if (t.name == name) return t;
    throw std::runtime_error("no tensor " + name);
  }
  void drop_tensor(const std::string& name) {
    tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const Tensor& t) { return t.name == name; }),
                  tensors.end());
  }
  std::string write(const std::string& path) const {
    gguf::Writer w;
    for (const auto& [k, v] : metadata) w.add(k, v);
    for (const auto& t : tensors) {
      const auto traits = *gguf::traits_of(t.type);
      int64_t n = 1;
      for (int64_t d : t.dims) n *= d;
      const size_t bytes = size_t(n / traits.block_elems * traits.block_bytes);
      w.add_tensor(t.name, t.dims, t.type, [bytes](std::FILE* f) {
        const std::vector<char> zeros(bytes, 0);
        std::fwrite(zeros.data(), 1, zeros.size(), f);
      });
    }
    w.write(path);
    return path;
  }
};

// A byte-level BPE vocabulary of the model's 300 rows: the 256 byte pieces,
// one merge ("a" "b" -> "ab"), fillers.
void byte_level_vocabulary(ModelFile& m) {
  std::vector<std::string> pieces;
  for (int b = 0; b < 256; ++b) pieces.push_back(byte_level_spelling(std::string(1, char(b))));
  pieces.push_back("ab");
  while (pieces.size() < 300) pieces.push_back("[PAD" + std::to_string(pieces.size()) + "]");
  m.set("tokenizer.ggml.model", gguf::Writer::str("gpt2"));
  m.set("tokenizer.ggml.pre", gguf::Writer::str("llama-bpe"));
  m.set("tokenizer.ggml.tokens", gguf::Writer::strings(pieces));
  m.set("tokenizer.ggml.merges", gguf::Writer::strings({"a b"}));
}

using test::open_error;

TEST(GgufModel, ASmallModelLoadsWithItsShapeFromTheMetadata) {
  const std::string dir = test::make_temp_dir("gguf-model");
  ModelFile m;
  m.set("llama.rope.freq_base", gguf::Writer::f32(500000.0f));
  const auto cp = Checkpoint::open(m.write(dir + "/tiny.gguf"));
  const ModelConfig& c = cp->config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 96);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.vocab_size, 300);
  EXPECT_EQ(c.seq_len, 128);
  EXPECT_TRUE(c.shared_classifier);
  EXPECT_EQ(c.rope_theta, 500000.0f);
  EXPECT_EQ(cp->name(), "tiny");
  EXPECT_FALSE(cp->vocabulary());  // none in the file
  EXPECT_EQ(cp->weights().layers.size(), 2u);
  EXPECT_EQ(cp->weights().wcls, cp->weights().token_embedding);
  // head_count_kv absent: as many as the query heads; general.name absent: the file's name.
  m.drop_key("llama.attention.head_count_kv");
  m.drop_key("general.name");
  m.tensor("blk.0.attn_k.weight").dims = {64, 64};
  m.tensor("blk.0.attn_v.weight").dims = {64, 64};
  m.tensor("blk.1.attn_k.weight").dims = {64, 64};
  m.tensor("blk.1.attn_v.weight").dims = {64, 64};
  const auto mha = Checkpoint::open(m.write(dir + "/mha.gguf"));
  EXPECT_EQ(mha->config().n_kv_heads, 4);
  EXPECT_EQ(mha->name(), "mha");
  EXPECT_NE(open_error(dir + "/absent.gguf").find("cannot open"), std::string::npos);
  // No vocabulary and no tokenizer file: a clear error where a tokenizer is needed.
  try {
    load_tokenizer(*cp, "");
    ADD_FAILURE() << "a tokenizer without a vocabulary";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the model file has no vocabulary"), std::string::npos) << e.what();
  }
}

// A model whose tensors overlap: blk.0.attn_q.weight's offset made
// token_embd.weight's (both aligned, both inside the file).
TEST(GgufModel, AModelWithOverlappingTensorsIsRefused) {
  const std::string dir = test::make_temp_dir("gguf-overlap");
  const std::string path = ModelFile().write(dir + "/overlap.gguf");
  std::vector<uint8_t> bytes = gguf::read_all(path);
  // The u64 offset that ends a tensor's info: after its name, n_dims, dims and type.
  auto offset_at = [&](const std::string& name) {
    const std::vector<uint8_t> key = gguf::Bytes().str(name).b;
    const auto it = std::search(bytes.begin(), bytes.end(), key.begin(), key.end());
    if (it == bytes.end()) throw std::runtime_error("no tensor info " + name);
    size_t at = size_t(it - bytes.begin()) + key.size();
    uint32_t n_dims = 0;
    std::memcpy(&n_dims, &bytes[at], 4);
    return at + 4 + 8 * n_dims + 4;
  };
  const size_t embedding = offset_at("token_embd.weight"), wq = offset_at("blk.0.attn_q.weight");
  std::memcpy(&bytes[wq], &bytes[embedding], 8);
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  const std::string e = open_error(path);
  EXPECT_EQ(e.rfind(path + ": tensors ", 0), 0u) << e;
  EXPECT_NE(e.find(" overlap: "), std::string::npos) << e;
  EXPECT_NE(e.find("token_embd.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("blk.0.attn_q.weight"), std::string::npos) << e;
  std::filesystem::remove_all(dir);
}

// A FIFO named as the model is refused at once, naming it (issue 44:
// `mkfifo m.gguf; disagg-generate --model m.gguf` blocked in open()).
TEST(GgufModel, AFifoIsRefusedWithoutBlocking) {
  const std::string dir = test::make_temp_dir("gguf-fifo");
  const std::string fifo = dir + "/m.gguf";
  test::make_fifo(fifo);
  EXPECT_EQ(test::error_beside_fifo(fifo, [&] { Checkpoint::open(fifo); }),
            fifo + ": not a regular file or a directory (a FIFO)");
  std::filesystem::remove_all(dir);
}

TEST(GgufModel, BadModelsGetAnErrorNamingTheKeyOrTensor) {
  const std::string dir = test::make_temp_dir("gguf-bad-model");
  const struct {
    const char* what;
    std::function<void(ModelFile&)> change;
    const char* expected;
  } cases[] = {
      {"architecture", [](ModelFile& m) { m.set("general.architecture", gguf::Writer::str("gemma")); },
       "architecture gemma is not supported (llama, qwen2 and qwen3 are)"},
      {"qwen2 keys", [](ModelFile& m) { m.set("general.architecture", gguf::Writer::str("qwen2")); },
       "metadata qwen2.embedding_length is missing"},
      {"no block count", [](ModelFile& m) { m.drop_key("llama.block_count"); }, "metadata llama.block_count is missing"},
      {"zero heads", [](ModelFile& m) { m.set("llama.attention.head_count", gguf::Writer::u32(0)); },
       "metadata llama.attention.head_count = 0 is out of range"},
      {"missing tensor", [](ModelFile& m) { m.drop_tensor("blk.1.ffn_up.weight"); }, "tensor blk.1.ffn_up.weight is missing"},
      {"layers past the tensors", [](ModelFile& m) { m.set("llama.block_count", gguf::Writer::u32(2000000000)); },
       "tensor blk.2.attn_norm.weight is missing"},
      {"rope base past a float", [](ModelFile& m) {
         gguf::Value huge;
         huge.type = gguf::ValueType::f64;
         huge.f = 1e300;
         m.set("llama.rope.freq_base", huge);
       }, "metadata llama.rope.freq_base = 1e+300 is out of range"},
      {"wide heads", [](ModelFile& m) { m.set("llama.attention.key_length", gguf::Writer::u32(1u << 30)); },
       "head size 1073741824 is above 16384"},
      {"long context", [](ModelFile& m) { m.set("llama.context_length", gguf::Writer::u32(2147483647u)); },
       "context of 2147483647 positions is above 2097152"},
      {"shape", [](ModelFile& m) { m.tensor("blk.0.attn_q.weight").dims = {64, 32}; },
       "tensor blk.0.attn_q.weight: shape [64, 32], the metadata says [64, 64]"},
      {"quantized norm", [](ModelFile& m) { m.tensor("blk.1.ffn_norm.weight").type = uint32_t(gguf::TensorType::q8_0); },
       "tensor blk.1.ffn_norm.weight: type q8_0 (a norm must be f32)"},
      {"epsilon", [](ModelFile& m) { m.set("llama.attention.layer_norm_rms_epsilon", gguf::Writer::f32(0.5f)); },
       "metadata llama.attention.layer_norm_rms_epsilon = 0.500000 is out of range (0, 0.01]"},
      {"partial rotary", [](ModelFile& m) { m.set("llama.rope.dimension_count", gguf::Writer::u32(8)); },
       "llama.rope.dimension_count = 8"},
      {"vocabulary size", [](ModelFile& m) {
         m.set("tokenizer.ggml.model", gguf::Writer::str("llama"));
         m.set("tokenizer.ggml.tokens", gguf::Writer::strings(std::vector<std::string>(299, "a")));
         m.set("tokenizer.ggml.scores", gguf::Writer::f32s(std::vector<float>(299, 0.0f)));
       }, "the vocabulary has 299 tokens; token_embd.weight has 300 rows"},
      {"score count", [](ModelFile& m) {
         m.set("tokenizer.ggml.model", gguf::Writer::str("llama"));
         m.set("tokenizer.ggml.tokens", gguf::Writer::strings(std::vector<std::string>(300, "a")));
         m.set("tokenizer.ggml.scores", gguf::Writer::f32s(std::vector<float>(299, 0.0f)));
       }, "299 scores for 300 tokens"},
      {"rope factors shape", [](ModelFile& m) { m.tensors.push_back({"rope_freqs.weight", {4}}); },
       "tensor rope_freqs.weight: shape [4] type f32, an f32 [8] is expected"},
      {"rope factors zero", [](ModelFile& m) { m.tensors.push_back({"rope_freqs.weight", {8}}); },
       "tensor rope_freqs.weight: factor 0 = 0.000000 is not a positive number"},
      {"rope scaling", [](ModelFile& m) { m.set("llama.rope.scaling.type", gguf::Writer::str("yarn")); },
       "metadata llama.rope.scaling.type = yarn (only none is computed so far"},
      {"tokenizer model", [](ModelFile& m) { m.set("tokenizer.ggml.model", gguf::Writer::str("t5")); },
       "tokenizer.ggml.model \"t5\" is not supported (llama: SentencePiece, gpt2: byte-level BPE)"},
      {"bpe without merges", [](ModelFile& m) { byte_level_vocabulary(m); m.drop_key("tokenizer.ggml.merges"); },
       "metadata tokenizer.ggml.merges is missing"},
      {"unknown pre-tokenizer", [](ModelFile& m) {
         byte_level_vocabulary(m);
         m.set("tokenizer.ggml.pre", gguf::Writer::str("klingon"));
       }, "tokenizer.ggml.pre \"klingon\" is not supported (supported: default, gpt-2, llama-bpe"},
      {"token types", [](ModelFile& m) {
         byte_level_vocabulary(m);
         m.set("tokenizer.ggml.token_type", gguf::Writer::i32s(std::vector<int32_t>(12, 1)));
       }, "12 token types for 300 tokens"},
      {"token type value", [](ModelFile& m) {
         byte_level_vocabulary(m);
         std::vector<int32_t> types(300, 1);
         types[7] = 9;
         m.set("tokenizer.ggml.token_type", gguf::Writer::i32s(types));
       }, "token 7 has type 9 (GGUF's are 1..6)"},
      {"eos beyond the vocabulary", [](ModelFile& m) {
         byte_level_vocabulary(m);
         m.set("tokenizer.ggml.eos_token_id", gguf::Writer::u32(300));
       }, "metadata tokenizer.ggml.eos_token_id = 300 is outside the vocabulary of 300"},
      {"eot beyond the vocabulary", [](ModelFile& m) {
         byte_level_vocabulary(m);
         m.set("tokenizer.ggml.eot_token_id", gguf::Writer::u32(1u << 31));
       }, "metadata tokenizer.ggml.eot_token_id = 2147483648 is outside the vocabulary of 300"},
  };
  int k = 0;
  for (const auto& c : cases) {
    ModelFile m;
    c.change(m);
    const std::string path = m.write(dir + "/bad-" + std::to_string(k++) + ".gguf");
    const std::string e = open_error(path);
    EXPECT_EQ(e.rfind(path + ": ", 0), 0u) << c.what << ": " << e;
    EXPECT_NE(e.find(c.expected), std::string::npos) << c.what << ": " << e;
  }
}

}  // namespace
}  // namespace disagg::gpu
