// disagg-make-model end to end: the files it writes load back with the asked
// shape, and disagg-generate runs on them; bad arguments are usage errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "model/checkpoint.h"
#include "engine/engine.h"
#include "text/tokenizer.h"
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

// --format gguf: the same weights for the same seed, the vocabulary inside,
// the matrices in --type; an f32 GGUF computes the llama2.c file's logits.
TEST(MakeModelApp, WritesTheSameModelAsGgufOfAnyType) {
  const std::string dir = test::make_temp_dir("make-model-gguf");
  const std::string shape = " --dim 64 --hidden 96 --layers 2 --heads 4 --kv-heads 2 --vocab 300 --seq-len 40 --seed 5";
  ASSERT_EQ(run_command(make_model_app() + " --out " + shell_quoted(dir + "/bin") + shape).second, 0);
  std::vector<float> want;
  {
    Engine e(Checkpoint::open(dir + "/bin/model.bin"));
    want = e.prefill({1, 40, 50, 60}).logits;
  }
  for (const char* type : {"f32", "f16", "bf16", "q8_0", "q4_0"}) {
    SCOPED_TRACE(type);
    const std::string out = dir + "/" + type;
    const auto [log, status] = run_command(make_model_app() + " --out " + shell_quoted(out) + shape +
                                           " --format gguf --type " + type);
    ASSERT_EQ(status, 0) << log;
    EXPECT_EQ(log, out + "/model.gguf\n");
    const auto cp = Checkpoint::open(out + "/model.gguf");
    EXPECT_EQ(cp->config().dim, 64);
    EXPECT_EQ(cp->config().n_kv_heads, 2);
    ASSERT_TRUE(cp->vocabulary().has_value());
    EXPECT_EQ(load_tokenizer(*cp, "").vocabulary().pieces, Tokenizer::load(dir + "/bin/tokenizer.bin", 300).vocabulary().pieces);
    EXPECT_EQ(to_string(cp->weights().layers[1].w2.type), std::string(type));
    Engine e(cp);
    const std::vector<float> got = e.prefill({1, 40, 50, 60}).logits;
    ASSERT_EQ(got.size(), want.size());
    if (std::string(type) == "f32") {
      EXPECT_EQ(got, want);
    } else if (std::string(type) != "q4_0") {  // close, not equal: the weights were rounded
      // (Q4_0's 4 bits are too coarse for a random model's logits to stay close.)
      double diff = 0, norm = 0;
      for (size_t i = 0; i < got.size(); ++i) diff += std::fabs(got[i] - want[i]), norm += std::fabs(want[i]);
      EXPECT_LT(diff, 0.2 * norm);
      EXPECT_NE(got, want);
    }
  }
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
  EXPECT_EQ(run_command(make_model_app() + out + " --format onnx 2>/dev/null").second, 2);   // no such format
  EXPECT_EQ(run_command(make_model_app() + out + " --format gguf --type q3 2>/dev/null").second, 2);  // no such type
  EXPECT_EQ(run_command(make_model_app() + out + " --type q8_0 2>/dev/null").second, 2);     // llama2.c is f32
  EXPECT_EQ(run_command(make_model_app() + " --out /proc/no-such-dir 2>/dev/null").second, 1);  // cannot write
  // A head size past the limit is refused before the rope factors loop over it (4 GiB of them, an int wrapped).
  EXPECT_EQ(run_command(make_model_app() + out + " --format gguf --rope-freqs llama3 --dim 2147483647 --heads 1 2>/dev/null")
                .second,
            2);
  EXPECT_FALSE(std::filesystem::exists(dir + "/m/model.bin"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace disagg::gpu
