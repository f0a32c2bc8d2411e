// Constrained decoding through the cluster: a request under a grammar gives
// gpu::generate's tokens (with the same grammar) on every topology, in a
// batch with unconstrained requests, and its text keeps to the grammar;
// requests the grammar cannot serve are refused, not run unconstrained.
#include <gtest/gtest.h>

#include <future>

#include <nlohmann/json.hpp>

#include "actors/actor_fixture.h"
#include "grammar/json_grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "model/checkpoint.h"
#include "support/test_paths.h"
#include "text/tokenizer.h"

namespace disagg::test {
namespace {

const gpu::Tokenizer& shared_tok() {
  static const gpu::Tokenizer t = gpu::Tokenizer::load(shared_tokenizer(), 512);
  return t;
}

// Even seeds: any JSON object (json_object); odd: a bounded schema, which
// this small model completes within a few dozen tokens.
grammar::Grammar grammar_of(uint64_t seed) {
  if (seed % 2 == 0) return grammar::json_object_grammar();
  return grammar::json_schema_grammar(nlohmann::json::parse(
      R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
          "additionalProperties": false})"));
}

Sampling json_sampling(uint64_t seed) {
  Sampling s;
  s.temperature = 1.0f;
  s.seed = seed;
  s.grammar = grammar_of(seed).to_json();
  return s;
}

struct Topology {
  int prefill, decode, colocated;
  const char* kv_transport;
  int prefill_chunk;  // < 0: the default
};

class ConstrainedTopology : public ActorTest, public ::testing::WithParamInterface<Topology> {};

// Eight constrained requests and eight free ones, all at once: each equals
// gpu::generate's tokens under the same grammar (or none); those that ended
// (eos) are JSON objects (the schema's: its fields), the others (length)
// are still a prefix the grammar allows.
TEST_P(ConstrainedTopology, JsonObjectRequestsAreTheColocatedTokensAndParse) {
  const Topology t = GetParam();
  LocalClusterOptions options;
  options.config = shared_model_config(t.prefill, t.decode);
  options.config.tokenizer = shared_tokenizer();
  options.config.kv_transport = t.kv_transport;
  if (t.prefill_chunk >= 0) options.config.prefill_chunk = t.prefill_chunk;
  options.colocated_workers = t.colocated;
  start(options);
  const int kSeeds = 8, kMax = 96;
  std::vector<std::future<RequestOutcome>> futures;
  std::vector<std::future<RequestOutcome>> plain;
  for (int seed = 0; seed < kSeeds; ++seed) {
    futures.push_back(client_->submit(make_request(kTomHadARedBall, kMax, json_sampling(uint64_t(seed)))));
    Sampling free_text;
    free_text.temperature = 1.0f;
    free_text.seed = uint64_t(seed);
    plain.push_back(client_->submit(make_request(kTomHadARedBall, kMax, free_text)));  // the same batches
  }
  const auto vocab = gpu::grammar_vocabulary(shared_tok(), gpu::Checkpoint::open(shared_model())->config().end_tokens);
  int parsed = 0;
  for (int seed = 0; seed < kSeeds; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const RequestOutcome out = futures[size_t(seed)].get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
    const gpu::GenerateResult local = colocated(kTomHadARedBall, kMax, json_sampling(uint64_t(seed)));
    EXPECT_EQ(out.tokens, local.tokens);
    const std::string text = shared_tok().decode_all(kTomHadARedBall.back(), out.tokens);
    grammar::Matcher m(std::make_shared<grammar::CompiledGrammar>(grammar_of(uint64_t(seed)), vocab));
    for (int32_t token : out.tokens) ASSERT_TRUE(m.accept(token)) << "token " << token << " after " << text;
    if (out.finish == FinishReason::eos) {
      const auto j = nlohmann::json::parse(text, nullptr, false);
      ASSERT_TRUE(!j.is_discarded() && j.is_object()) << text;
      if (seed % 2 == 1) {
        EXPECT_TRUE(j.size() == 2 && j["name"].is_string() && j["name"].get<std::string>().size() <= 6) << text;
        EXPECT_TRUE(j["age"].is_number_integer() && j["age"].get<int>() >= 0 && j["age"].get<int>() <= 120) << text;
        ++parsed;
      }
    } else {
      EXPECT_EQ(out.tokens.size(), size_t(kMax)) << "cut by max_tokens only";
    }
    const RequestOutcome free_out = plain[size_t(seed)].get();
    ASSERT_TRUE(free_out.ok()) << free_out.message;
    Sampling free_text;
    free_text.temperature = 1.0f;
    free_text.seed = uint64_t(seed);
    EXPECT_EQ(free_out.tokens, colocated(kTomHadARedBall, kMax, free_text).tokens) << "a neighbour's grammar leaked";
  }
  EXPECT_GE(parsed, 2) << "objects of the schema that ended within " << kMax << " tokens";
}

INSTANTIATE_TEST_SUITE_P(Topologies, ConstrainedTopology,
                         ::testing::Values(Topology{1, 1, 0, "tcp", -1}, Topology{2, 2, 0, "shm", -1},
                                           Topology{0, 0, 1, "tcp", 5}, Topology{1, 1, 1, "message", -1}),
                         [](const auto& info) {
                           const Topology& t = info.param;
                           return std::to_string(t.prefill) + "p" + std::to_string(t.decode) + "d" +
                                  std::to_string(t.colocated) + "c_" + t.kv_transport +
                                  (t.prefill_chunk >= 0 ? "_chunk" + std::to_string(t.prefill_chunk) : "");
                         });

// A grammar that is not one, and a cluster with no vocabulary to constrain
// with: refused (invalid_request), never generated unconstrained.
TEST_F(ActorTest, RequestsTheGrammarCannotServeAreRefused) {
  start(1, 1);  // (no tokenizer: the llama2.c model file has no vocabulary)
  Sampling bad;
  bad.grammar = R"({"rules": [[[0, "61-61"]]]})";  // left-recursive
  RequestOutcome out = client_->generate(make_request(kOnceUponATime, 8, bad));
  EXPECT_EQ(out.code, ErrorCode::invalid_request) << out.message;
  EXPECT_NE(out.message.find("left-recursive"), std::string::npos) << out.message;
  out = client_->generate(make_request(kOnceUponATime, 8, json_sampling(1)));
  EXPECT_EQ(out.code, ErrorCode::invalid_request) << to_string(out.code) << ": " << out.message;
  EXPECT_NE(out.message.find("vocabulary"), std::string::npos) << out.message;
  EXPECT_TRUE(out.tokens.empty());
}

}  // namespace
}  // namespace disagg::test
