// The shared greedy references (every case of both reference files), token for
// token: tokenizer, batched prefill + paged decode (generate), decode-only
// (generate_stepwise) and the disagg-generate app; each on the shared llama2.c
// checkpoint and on its GGUF conversion (write_gguf: F32, the vocabulary
// inside). Backend "auto": CPU here, CUDA on a GPU machine.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <tuple>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "text/tokenizer.h"
#include "support/reference_cases.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

// The shared model's GGUF conversion, written once per test binary.
const std::string& shared_gguf() {
  static const std::string path = [] {
    const std::string out = test::make_temp_dir("reference-gguf") + "/stories260K.gguf";
    const auto checkpoint = Checkpoint::open(test::shared_model());
    const Tokenizer tokenizer = Tokenizer::load(test::shared_tokenizer(), checkpoint->config().vocab_size);
    write_gguf(*checkpoint_weights(checkpoint), tokenizer.vocabulary(), "stories260K", out);
    return out;
  }();
  return path;
}

// The same conversion by a writer no one here wrote: llama.cpp's peer
// tools' llama2c-to-gguf.py (../shared/tools/peer; Python's standard
// library for F32). Empty when the script is not there.
const std::string& peer_gguf() {
  static const std::string path = []() -> std::string {
    const std::string script = test::shared_dir() + "/tools/peer/llama2c-to-gguf.py";
    if (!std::filesystem::exists(script)) return {};
    const std::string out = test::make_temp_dir("reference-peer-gguf") + "/stories260K.gguf";
    const auto [log, status] = test::run_command("/usr/bin/python3 " + test::shell_quoted(script) + " " +
                                                 test::shell_quoted(test::shared_model()) + " " +
                                                 test::shell_quoted(test::shared_tokenizer()) + " " +
                                                 test::shell_quoted(out) + " --name stories260K 2>&1");
    if (status != 0) throw std::runtime_error("llama2c-to-gguf.py failed: " + log);
    return out;
  }();
  return path;
}

// The parameter: the model file's format ("peer-gguf": written by the peer's script).
class ReferenceTest : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    cases_ = new std::vector<test::ReferenceCase>(test::load_all_reference_cases());
  }
  static void TearDownTestSuite() { delete cases_; }
  static const std::vector<test::ReferenceCase>& cases() { return *cases_; }
  void SetUp() override {
    if (GetParam() == "peer-gguf" && peer_gguf().empty())
      GTEST_SKIP() << test::shared_dir() << "/tools/peer/llama2c-to-gguf.py is not there";
  }
  bool gguf() const { return GetParam() != "llama2c"; }
  std::string model() const {
    return GetParam() == "gguf" ? shared_gguf() : GetParam() == "peer-gguf" ? peer_gguf() : test::shared_model();
  }
  std::shared_ptr<const Checkpoint> checkpoint() const {
    static std::map<std::string, std::shared_ptr<const Checkpoint>> opened;
    auto& c = opened[model()];
    if (!c) c = Checkpoint::open(model());
    return c;
  }
  // A GGUF carries its vocabulary; a llama2.c checkpoint needs the tokenizer file.
  std::string tokenizer_path() const { return gguf() ? std::string() : test::shared_tokenizer(); }

 private:
  static std::vector<test::ReferenceCase>* cases_;
};

std::vector<test::ReferenceCase>* ReferenceTest::cases_ = nullptr;

// Every reference file has cases, and each case is one the model can run:
// a BOS-first prompt, outputs within max_new_tokens and the context.
TEST_P(ReferenceTest, FilesHaveCases) {
  for (const std::string& path : test::shared_reference_files())
    EXPECT_FALSE(test::load_reference_cases(path).empty()) << path;
  const int seq_len = checkpoint()->config().seq_len;
  for (const auto& c : cases()) {
    SCOPED_TRACE(test::describe(c));
    ASSERT_FALSE(c.prompt_tokens.empty());
    EXPECT_EQ(c.prompt_tokens.front(), kBosToken);
    EXPECT_GT(c.max_new_tokens, 0);
    EXPECT_LE(int(c.output_tokens.size()), c.max_new_tokens);
    EXPECT_LE(c.prompt_tokens.size() + c.output_tokens.size(), size_t(seq_len));
  }
}

TEST_P(ReferenceTest, TokenizerEncodesPromptsAndDecodesOutputs) {
  const Tokenizer tokenizer = load_tokenizer(*checkpoint(), tokenizer_path());
  for (const auto& c : cases()) {
    EXPECT_EQ(tokenizer.encode(c.prompt), c.prompt_tokens) << test::describe(c);
    EXPECT_EQ(tokenizer.decode_all(c.prompt_tokens.back(), c.output_tokens), c.text) << test::describe(c);
  }
}

FinishReason expected_finish(const test::ReferenceCase& c) {
  return int(c.output_tokens.size()) < c.max_new_tokens ? FinishReason::eos : FinishReason::length;
}

TEST_P(ReferenceTest, GenerateReproducesGreedyOutputs) {
  Engine engine(checkpoint());
  for (const auto& c : cases()) {
    const GenerateResult r = generate(engine, c.prompt_tokens, c.max_new_tokens, SamplingParams{});
    EXPECT_EQ(r.tokens, c.output_tokens) << test::describe(c) << " on " << engine.backend_name();
    EXPECT_EQ(r.finish, expected_finish(c)) << test::describe(c);
  }
}

TEST_P(ReferenceTest, GenerateStepwiseReproducesGreedyOutputs) {
  Engine engine(checkpoint());
  for (const auto& c : cases()) {
    const GenerateResult r = generate_stepwise(engine, c.prompt_tokens, c.max_new_tokens, SamplingParams{});
    EXPECT_EQ(r.tokens, c.output_tokens) << test::describe(c) << " on " << engine.backend_name();
    EXPECT_EQ(r.finish, expected_finish(c)) << test::describe(c);
  }
}

using test::run_command;
using test::shell_quoted;

TEST_P(ReferenceTest, GenerateAppPrintsReferenceJson) {
  const std::string app = test::bin_dir() + "/disagg-generate";
  ASSERT_TRUE(std::filesystem::exists(app)) << app << " is not built";
  const std::string common = shell_quoted(app) + " --model " + shell_quoted(model()) +
                             (gguf() ? std::string() : " --tokenizer " + shell_quoted(tokenizer_path())) + " --json";
  for (const auto& c : cases()) {
    const auto [out, status] =
        run_command(common + " --prompt " + shell_quoted(c.prompt) + " --max-new-tokens " + std::to_string(c.max_new_tokens));
    ASSERT_EQ(status, 0) << test::describe(c) << ": " << out;
    const test::ReferenceCase got = test::parse_reference_case(out);
    EXPECT_EQ(got.prompt_tokens, c.prompt_tokens) << test::describe(c);
    EXPECT_EQ(got.output_tokens, c.output_tokens) << test::describe(c);
    EXPECT_EQ(got.text, c.text) << test::describe(c);
  }
  // --prompt-tokens is the same request as its text.
  const auto& c = cases().front();
  std::string ids;
  for (int t : c.prompt_tokens) ids += (ids.empty() ? "" : " ") + std::to_string(t);
  const auto [out, status] =
      run_command(common + " --prompt-tokens " + shell_quoted(ids) + " --max-new-tokens " + std::to_string(c.max_new_tokens));
  ASSERT_EQ(status, 0) << out;
  EXPECT_EQ(test::parse_reference_case(out).output_tokens, c.output_tokens);
}

TEST_P(ReferenceTest, GenerateAppRejectsBadArguments) {
  const std::string app = shell_quoted(test::bin_dir() + "/disagg-generate");
  const std::string model = " --model " + shell_quoted(test::shared_model()) + " --tokenizer " +
                            shell_quoted(test::shared_tokenizer());
  EXPECT_EQ(run_command(app + " 2>/dev/null").second, 2);
  EXPECT_EQ(run_command(app + model + " --prompt hi 2>/dev/null").second, 2);  // no --max-new-tokens
  EXPECT_EQ(run_command(app + model + " --prompt hi --prompt-tokens 1 --max-new-tokens 1 2>/dev/null").second, 2);
  EXPECT_EQ(run_command(app + model + " --prompt hi --max-new-tokens x 2>/dev/null").second, 2);
  EXPECT_EQ(run_command(app + model + " --prompt hi --max-new-tokens 1 --backend tpu 2>/dev/null").second, 2);
  EXPECT_EQ(run_command(app + " --model /nonexistent --tokenizer " + shell_quoted(test::shared_tokenizer()) +
                        " --prompt hi --max-new-tokens 1 2>/dev/null")
                .second,
            1);
  EXPECT_EQ(run_command(app + model + " --prompt-tokens '1 9999' --max-new-tokens 1 2>/dev/null").second, 1);
}

// The GGUF is the same model to the engine, and another file to the cluster.
TEST_P(ReferenceTest, TheConversionIsTheSameModelWithAFingerprintOfItsOwn) {
  const auto original = Checkpoint::open(test::shared_model());
  const auto& a = original->config();
  const auto& b = checkpoint()->config();
  EXPECT_EQ(std::tie(a.dim, a.hidden_dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size, a.seq_len, a.rope_theta),
            std::tie(b.dim, b.hidden_dim, b.n_layers, b.n_heads, b.n_kv_heads, b.vocab_size, b.seq_len, b.rope_theta));
  // (The peer's script writes output.weight, a copy of the embedding, where ours shares it.)
  EXPECT_EQ(std::memcmp(original->weights().wcls.f32(), checkpoint()->weights().wcls.f32(), sizeof(float) * size_t(a.vocab_size) * a.dim), 0);
  EXPECT_EQ(checkpoint()->name(), "stories260K");
  if (gguf()) {
    EXPECT_NE(checkpoint()->fingerprint(), original->fingerprint());
    ASSERT_TRUE(checkpoint()->vocabulary());
    const Vocabulary want = Tokenizer::load(test::shared_tokenizer(), a.vocab_size).vocabulary();
    EXPECT_EQ(checkpoint()->vocabulary()->pieces, want.pieces);
    EXPECT_EQ(checkpoint()->vocabulary()->scores, want.scores);
  } else {
    EXPECT_EQ(checkpoint()->fingerprint(), original->fingerprint());
  }
}

INSTANTIATE_TEST_SUITE_P(Format, ReferenceTest, ::testing::Values("llama2c", "gguf", "peer-gguf"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace disagg::gpu
