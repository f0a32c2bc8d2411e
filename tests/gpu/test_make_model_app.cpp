// disagg-make-model end to end: the files it writes load back with the asked
// shape, and disagg-generate runs on them; bad arguments are usage errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "gpu/checkpoint.h"
#include "gpu/tokenizer.h"
#include "support/reference_cases.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

using test::run_command;
using test::shell_quoted;

std::string make_model_app() { return shell_quoted(test::bin_dir() + "/disagg-make-model"); }

TEST(MakeModelApp, WritesALoadableModelAndTokenizerThatGenerate) {
  const std::string dir = test::make_temp_dir("make-model-app");
  const auto [out, status] = run_command(make_model_app() + " --out " + shell_quoted(dir) +
                                         " --dim 32 --hidden 48 --layers 2 --heads 4 --kv-heads 2"
                                         " --vocab 300 --seq-len 40 --seed 9");
  ASSERT_EQ(status, 0) << out;

  auto checkpoint = Checkpoint::open(dir + "/model.bin");
  const ModelConfig& c = checkpoint->config();
  EXPECT_EQ(c.dim, 32);
  EXPECT_EQ(c.hidden_dim, 48);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 4);
  EXPECT_EQ(c.n_kv_heads, 2);
  EXPECT_EQ(c.vocab_size, 300);
  EXPECT_EQ(c.seq_len, 40);
  const Tokenizer tokenizer = Tokenizer::load(dir + "/tokenizer.bin", c.vocab_size);
  EXPECT_EQ(tokenizer.vocab_size(), 300);

  // The prompt takes 1 + a few positions; generation stops at seq_len at the latest.
  const auto [json, gen_status] =
      run_command(shell_quoted(test::bin_dir() + "/disagg-generate") + " --model " + shell_quoted(dir + "/model.bin") +
                  " --tokenizer " + shell_quoted(dir + "/tokenizer.bin") + " --prompt hi --max-new-tokens 100 --json");
  ASSERT_EQ(gen_status, 0) << json;
  const auto result = test::parse_reference_case(json);
  EXPECT_FALSE(result.output_tokens.empty());
  EXPECT_LE(result.prompt_tokens.size() + result.output_tokens.size(), size_t(c.seq_len));
  std::filesystem::remove_all(dir);
}

TEST(MakeModelApp, RejectsBadArguments) {
  const std::string dir = test::make_temp_dir("make-model-bad");
  const std::string out = " --out " + shell_quoted(dir + "/m");
  EXPECT_EQ(run_command(make_model_app() + " 2>/dev/null").second, 2);                      // no --out
  EXPECT_EQ(run_command(make_model_app() + out + " --vocab 100 2>/dev/null").second, 2);    // below 259 pieces
  EXPECT_EQ(run_command(make_model_app() + out + " --dim x 2>/dev/null").second, 2);        // not a number
  EXPECT_EQ(run_command(make_model_app() + out + " --frobnicate 1 2>/dev/null").second, 2); // unknown flag
  EXPECT_EQ(run_command(make_model_app() + out + " --heads 3 2>/dev/null").second, 2);      // 64 % 3 != 0
  EXPECT_EQ(run_command(make_model_app() + " --out /proc/no-such-dir 2>/dev/null").second, 1);  // cannot write
  EXPECT_FALSE(std::filesystem::exists(dir + "/m/model.bin"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace disagg::gpu
