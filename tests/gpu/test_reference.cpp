// The shared greedy references (every case of both reference files), token for
// token: tokenizer, batched prefill + paged decode (generate), decode-only
// (generate_stepwise) and the disagg-generate app. Backend "auto": CPU here,
// CUDA on a GPU machine.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "gpu/checkpoint.h"
#include "gpu/engine.h"
#include "gpu/generate.h"
#include "gpu/tokenizer.h"
#include "support/reference_cases.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

class ReferenceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cases_ = new std::vector<test::ReferenceCase>(test::load_all_reference_cases());
    checkpoint_ = new std::shared_ptr<const Checkpoint>(Checkpoint::open(test::shared_model()));
  }
  static void TearDownTestSuite() {
    delete cases_;
    delete checkpoint_;
  }
  static const std::vector<test::ReferenceCase>& cases() { return *cases_; }
  static std::shared_ptr<const Checkpoint> checkpoint() { return *checkpoint_; }

 private:
  static std::vector<test::ReferenceCase>* cases_;
  static std::shared_ptr<const Checkpoint>* checkpoint_;
};

std::vector<test::ReferenceCase>* ReferenceTest::cases_ = nullptr;
std::shared_ptr<const Checkpoint>* ReferenceTest::checkpoint_ = nullptr;

// Every reference file has cases, and each case is one the model can run:
// a BOS-first prompt, outputs within max_new_tokens and the context.
TEST_F(ReferenceTest, FilesHaveCases) {
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

TEST_F(ReferenceTest, TokenizerEncodesPromptsAndDecodesOutputs) {
  const Tokenizer tokenizer = Tokenizer::load(test::shared_tokenizer(), checkpoint()->config().vocab_size);
  for (const auto& c : cases()) {
    EXPECT_EQ(tokenizer.encode(c.prompt), c.prompt_tokens) << test::describe(c);
    EXPECT_EQ(tokenizer.decode_all(c.prompt_tokens.back(), c.output_tokens), c.text) << test::describe(c);
  }
}

FinishReason expected_finish(const test::ReferenceCase& c) {
  return int(c.output_tokens.size()) < c.max_new_tokens ? FinishReason::eos : FinishReason::length;
}

TEST_F(ReferenceTest, GenerateReproducesGreedyOutputs) {
  Engine engine(checkpoint());
  for (const auto& c : cases()) {
    const GenerateResult r = generate(engine, c.prompt_tokens, c.max_new_tokens, SamplingParams{});
    EXPECT_EQ(r.tokens, c.output_tokens) << test::describe(c) << " on " << engine.backend_name();
    EXPECT_EQ(r.finish, expected_finish(c)) << test::describe(c);
  }
}

TEST_F(ReferenceTest, GenerateStepwiseReproducesGreedyOutputs) {
  Engine engine(checkpoint());
  for (const auto& c : cases()) {
    const GenerateResult r = generate_stepwise(engine, c.prompt_tokens, c.max_new_tokens, SamplingParams{});
    EXPECT_EQ(r.tokens, c.output_tokens) << test::describe(c) << " on " << engine.backend_name();
    EXPECT_EQ(r.finish, expected_finish(c)) << test::describe(c);
  }
}

using test::run_command;
using test::shell_quoted;

TEST_F(ReferenceTest, GenerateAppPrintsReferenceJson) {
  const std::string app = test::bin_dir() + "/disagg-generate";
  ASSERT_TRUE(std::filesystem::exists(app)) << app << " is not built";
  const std::string common = shell_quoted(app) + " --model " + shell_quoted(test::shared_model()) + " --tokenizer " +
                             shell_quoted(test::shared_tokenizer()) + " --json";
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

TEST_F(ReferenceTest, GenerateAppRejectsBadArguments) {
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

}  // namespace
}  // namespace disagg::gpu
