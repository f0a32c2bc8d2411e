// Input that would cost the cluster too much, or break it, is refused up
// front with invalid_request and a message naming the limit: a text prompt
// longer than max-prompt-bytes (encoding runs on the router's
// thread), a deadline beyond kMaxDeadlineMs, a KV transfer whose first token
// is outside the vocabulary. The node keeps serving afterwards.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>

#include "actors/actor_fixture.h"
#include "caf/all.hpp"
#include "model/checkpoint.h"
#include "engine/engine.h"
#include "engine/kv_format.h"
#include "text/tokenizer.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using Clock = std::chrono::steady_clock;

GenerateRequest text_request(std::string text, int max_new_tokens) {
  GenerateRequest r;
  r.prompt_is_text = true;
  r.prompt_text = std::move(text);
  r.max_new_tokens = max_new_tokens;
  return r;
}

std::string story_text(size_t bytes) {
  std::string text;
  while (text.size() < bytes) text += "Once upon a time there was a little girl named Lily. ";
  text.resize(bytes);
  return text;
}

TEST_F(ActorTest, TextPromptLongerThanTheCapIsRejectedWithoutEncoding) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.tokenizer = shared_tokenizer();
  options.config.max_prompt_bytes = 64;
  start(std::move(options));

  const RequestOutcome at_cap = client_->generate(text_request(story_text(64), 4));
  EXPECT_TRUE(at_cap.ok()) << to_string(at_cap.code) << ": " << at_cap.message;

  const RequestOutcome over = client_->generate(text_request(story_text(65), 4));
  EXPECT_EQ(over.code, ErrorCode::invalid_request) << over.message;
  EXPECT_NE(over.message.find("max-prompt-bytes 64"), std::string::npos) << over.message;

  // 64 KiB would take the router's thread about a minute to encode.
  const auto start = Clock::now();
  const RequestOutcome huge = client_->generate(text_request(story_text(64 * 1024), 4));
  EXPECT_EQ(huge.code, ErrorCode::invalid_request) << huge.message;
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(500));
  EXPECT_TRUE(client_->generate(text_request("Once upon a time", 4)).ok());
}

TEST(AdmissionLimits, DefaultPromptByteCapAdmitsAFullLengthPrompt) {
  // The default must not refuse what the model can serve: English text of
  // seq_len tokens (about 3.8 bytes each for tok512) fits under it.
  const DisaggConfig defaults;
  const auto tokenizer = gpu::Tokenizer::load(shared_tokenizer(), 512);
  const std::string text = story_text(size_t(defaults.max_prompt_bytes));
  EXPECT_GE(tokenizer.encode(text).size(), 512u)
      << "max-prompt-bytes " << defaults.max_prompt_bytes << " cuts off prompts the model could take";
}

TEST_F(ActorTest, DeadlineBeyondTheMaximumIsRejected) {
  start(1, 1);
  for (int64_t deadline : {kMaxDeadlineMs + 1, int64_t(10000000000000LL), int64_t(4611686018427387903LL)}) {
    auto request = make_request(kOnceUponATime, 4);
    request.deadline_ms = deadline;
    const RequestOutcome out = client_->generate(request);
    EXPECT_EQ(out.code, ErrorCode::invalid_request) << deadline << ": " << out.message;
    EXPECT_NE(out.message.find(std::to_string(kMaxDeadlineMs)), std::string::npos) << out.message;
  }
  auto longest = make_request(kOnceUponATime, 4);
  longest.deadline_ms = kMaxDeadlineMs;
  const RequestOutcome out = client_->generate(longest);
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
}

// A KvTransfer of `prompt`'s real KV (the shared model) with `first_token`.
KvTransfer transfer_with_first_token(RequestId id, const std::vector<int32_t>& prompt, int32_t first_token) {
  gpu::EngineOptions options;
  options.backend = "cpu";
  gpu::Engine engine(gpu::Checkpoint::open(shared_model()), options);
  const gpu::PrefillOutput out = engine.prefill(prompt);
  KvTransfer t;
  t.id = id;
  t.prompt_len = int32_t(prompt.size());
  t.max_new_tokens = 8;
  t.first_token = first_token;
  t.bytes = gpu::serialize_kv(engine.fingerprint(), out.shape, out.kv.data());
  return t;
}

TEST_F(ActorTest, DecodeRefusesAFirstTokenOutsideTheVocabularyAndKeepsDecodingOthers) {
  start(1, 1);
  const int max_new = 300;
  const auto local = colocated(kOnceUponATime, max_new);
  ASSERT_EQ(local.tokens.size(), size_t(max_new));
  std::promise<void> first_token;
  std::atomic<bool> seen{false};
  auto running = client_->submit(make_request(kOnceUponATime, max_new), [&](const TokenEvent&) {
    if (!seen.exchange(true)) first_token.set_value();
  });
  first_token.get_future().wait();

  // Straight to the decode worker, while the other request is in its batches.
  const decode_actor decode = cluster_->decode_workers().at(0);
  caf::scoped_actor self{*system_};
  RequestId id = 900001;
  for (int32_t bad : {512, -1}) {
    ErrorCode code = ErrorCode::none;
    std::string message;
    self->request(decode, std::chrono::seconds(5), kv_atom::value,
                  transfer_with_first_token(id++, kOnceUponATime, bad))
        .receive(
            [&](KvAck& ack) {
              code = ack.code;
              message = ack.message;
            },
            [&](caf::error& e) { message = system_->render(e); });
    EXPECT_EQ(code, ErrorCode::invalid_request) << bad << ": " << message;
    EXPECT_NE(message.find("first_token"), std::string::npos) << message;
  }
  const RequestOutcome out = running.get();
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.tokens, local.tokens);
}

}  // namespace
}  // namespace disagg::test
