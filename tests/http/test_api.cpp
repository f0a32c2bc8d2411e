// http/api.h: request validation (each error names its parameter), the chat
// template, stop strings and text assembly, response shapes, error mapping.
#include <gtest/gtest.h>

#include <chrono>
#include <random>

#include "grammar/grammar_texts.h"
#include "grammar/json_grammar.h"
#include "grammar/json_schema.h"
#include "grammar/matcher.h"
#include "http/api.h"
#include "http/generation.h"
#include "http/target.h"
#include "caf/all.hpp"
#include "metrics/disagg_metrics.h"
#include "support/adversarial_json.h"
#include "text/jinja.h"

namespace disagg::http {
namespace {

const char* kWeatherTool =
    R"({"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": false}}})";

using test::adversarial_bodies;
using test::nested_arrays;
using test::nested_objects;

const gpu::Tokenizer& tokenizer() {
  static const gpu::Tokenizer t = gpu::Tokenizer::load(std::string(DISAGG_SOURCE_DIR) + "/models/tok512.bin", 512);
  return t;
}

ServedModel model() {
  ServedModel m;
  m.name = "stories260K";
  m.vocab_size = 512;
  m.seq_len = 512;
  m.max_prompt_bytes = 2048;
  return m;
}

std::vector<int32_t> encode(const std::string& text) {
  const auto v = tokenizer().encode(text);
  return std::vector<int32_t>(v.begin(), v.end());
}

ApiRequest parse(Endpoint e, const std::string& body, ChatTemplate tmpl = ChatTemplate::llama2) {
  return parse_request(e, body, model(), tokenizer(), tmpl, [] { return uint64_t(42); });
}

ApiError error_of(Endpoint e, const std::string& body) {
  try {
    parse(e, body);
  } catch (const ApiError& err) {
    return err;
  }
  ADD_FAILURE() << "no error for " << body;
  return {};
}

// An empty text with a tokenizer that adds no BOS (Qwen's) is no tokens: a
// 400, not a request whose last prompt token is read from nothing.
TEST(HttpApi, APromptOfNoTokensIsRefused) {
  gpu::Vocabulary v = tokenizer().vocabulary();
  v.add_bos = false;
  const gpu::Tokenizer no_bos = gpu::Tokenizer::from_vocabulary(v, "no-bos");
  for (const char* body : {R"({"prompt":""})", R"({"prompt":[""]})"}) {
    try {
      parse_request(Endpoint::completions, body, model(), no_bos, ChatTemplate::llama2, [] { return uint64_t(42); });
      ADD_FAILURE() << "no error for " << body;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400) << body;
      EXPECT_EQ(e.param, "prompt") << body;
      EXPECT_EQ(e.message, "'prompt' encodes to no tokens") << body;
    }
  }
  // With BOS, the empty text is that one token.
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":""})").prompt_tokens, encode(""));
}

// JSON inside a string (a tool call's arguments, guided_json's text) has
// the body's nesting bound too: what walks it recurses (nested 300,000 deep
// in a 600 KB body it overflowed the stack and ended the server).
TEST(HttpApi, JsonInsideAStringIsNestedNoDeeperThanTheBody) {
  auto nested = [](int depth) {
    return "{\"a\":" + std::string(size_t(depth), '[') + std::string(size_t(depth), ']') + "}";
  };
  auto chat = [&](int depth) {
    json call = {{"id", "c1"}, {"type", "function"}, {"function", {{"name", "f"}, {"arguments", nested(depth)}}}};
    json messages = json::array({{{"role", "user"}, {"content", "hi"}},
                                 {{"role", "assistant"}, {"content", ""}, {"tool_calls", json::array({call})}}});
    return json{{"messages", messages}}.dump();
  };
  EXPECT_NO_THROW(parse(Endpoint::chat, chat(kMaxJsonDepth - 2)));
  ApiError e = error_of(Endpoint::chat, chat(kMaxJsonDepth + 36));
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.message, "messages[1].tool_calls: function.arguments nests deeper than 64 levels");
  auto guided = [&](int depth) { return json{{"prompt", "x"}, {"guided_json", "{\"const\":" + nested(depth) + "}"}}.dump(); };
  EXPECT_NO_THROW(parse(Endpoint::completions, guided(kMaxJsonDepth - 3)));
  e = error_of(Endpoint::completions, guided(kMaxJsonDepth + 36));
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "guided_json");
  EXPECT_EQ(e.message, "'guided_json' nests deeper than 64 levels");
}

// An object of a request's JSON has at most kMaxJsonMembers members (a
// key-ordered parse, which schemas, tools and templates need, is quadratic in
// them: an object of 100,000 keys held the I/O thread for seconds), in the
// body and in JSON inside a string; OpenAI's most (a schema's properties) fit.
TEST(HttpApi, AnObjectHasAtMostSoManyMembers) {
  auto object = [](size_t members) {
    json o = json::object();
    for (size_t i = 0; i < members; ++i) o[std::to_string(i)] = 0;
    return o;
  };
  EXPECT_NO_THROW(parse(Endpoint::completions, json{{"prompt", "x"}, {"metadata", object(kMaxJsonMembers)}}.dump()));
  ApiError e = error_of(Endpoint::completions, json{{"prompt", "x"}, {"metadata", object(kMaxJsonMembers + 1)}}.dump());
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.code, "invalid_json");
  EXPECT_EQ(e.message, "the request's JSON holds an object of more than 5000 members");
  // (an array's elements are no members)
  EXPECT_NO_THROW(parse(Endpoint::completions, json{{"prompt", json::array({1, 2})}, {"x", json::array({object(2), object(2), object(2)})}}.dump()));
  e = error_of(Endpoint::completions,
               json{{"prompt", "x"}, {"guided_json", json{{"properties", object(kMaxJsonMembers + 1)}}.dump()}}.dump());
  EXPECT_EQ(e.param, "guided_json");
  EXPECT_EQ(e.message, "'guided_json' holds an object of more than 5000 members");
}

TEST(HttpApi, CompletionDefaultsAndFields) {
  const ApiRequest r = parse(Endpoint::completions, R"({"model":"stories260K","prompt":"Once upon a time"})");
  EXPECT_EQ(r.prompt_tokens, encode("Once upon a time"));
  EXPECT_EQ(r.max_tokens, kDefaultCompletionMaxTokens);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_EQ(r.sampling.seed, 42u);  // none given: the random one
  EXPECT_FALSE(r.stream);

  const ApiRequest s = parse(Endpoint::completions,
                             R"({"prompt":[1,403,407],"max_tokens":7,"temperature":0,"top_p":0.5,"seed":9,
                                 "stop":"x","stream":true,"stream_options":{"include_usage":true},"user":"u1",
                                 "unknown_field":{"ignored":true},"n":1,"logprobs":null})");
  EXPECT_EQ(s.prompt_tokens, (std::vector<int32_t>{1, 403, 407}));
  EXPECT_EQ(s.max_tokens, 7);
  EXPECT_FLOAT_EQ(s.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(s.sampling.top_p, 0.5f);
  EXPECT_EQ(s.sampling.seed, 9u);
  EXPECT_EQ(s.stop, std::vector<std::string>{"x"});
  EXPECT_TRUE(s.stream);
  EXPECT_TRUE(s.include_usage);
  EXPECT_EQ(s.user, "u1");
  // a batch of one is that prompt
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":["Hi"]})").prompt_tokens, encode("Hi"));
}

TEST(HttpApi, EveryBadFieldIsA400NamingIt) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"prompt":"x","max_tokens":"a"})", "max_tokens"},
      {R"({"prompt":"x","max_tokens":0})", "max_tokens"},
      {R"({"prompt":"x","max_tokens":1.5})", "max_tokens"},
      {R"({"prompt":"x","max_tokens":600})", "max_tokens"},
      {R"({"prompt":"x","temperature":-0.1})", "temperature"},
      {R"({"prompt":"x","temperature":"hot"})", "temperature"},
      {R"({"prompt":"x","top_p":0})", "top_p"},
      {R"({"prompt":"x","top_p":1.5})", "top_p"},
      {R"({"prompt":"x","seed":"s"})", "seed"},
      {R"({"prompt":"x","stop":[1]})", "stop"},
      {R"({"prompt":"x","stream":"yes"})", "stream"},
      {R"({"prompt":"x","stream_options":{"include_usage":true}})", "stream_options"},
      {R"({"prompt":"x","user":5})", "user"},
      {R"({"prompt":"x","n":17})", "n"},
      {R"({"prompt":"x","n":0})", "n"},
      {R"({"prompt":"x","n":2,"best_of":1})", "best_of"},
      {R"({"prompt":"x","best_of":17})", "best_of"},
      {R"({"prompt":"x","best_of":2,"stream":true})", "best_of"},
      {R"({"prompt":"x","logprobs":21})", "logprobs"},
      {R"({"prompt":"x","logprobs":true})", "logprobs"},
      {R"({"prompt":"x","echo":true,"logprobs":1,"stream":true})", "echo"},
      {R"({"prompt":"x","echo":1})", "echo"},
      {R"({"prompt":"x","presence_penalty":2.5})", "presence_penalty"},
      {R"({"prompt":"x","frequency_penalty":-3})", "frequency_penalty"},
      {R"({"prompt":"x","repetition_penalty":0})", "repetition_penalty"},
      {R"({"prompt":"x","top_k":-2})", "top_k"},
      {R"({"prompt":"x","top_k":1.5})", "top_k"},
      {R"({"prompt":"x","min_p":1.1})", "min_p"},
      {R"({"prompt":"x","min_tokens":17})", "min_tokens"},
      {R"({"prompt":"x","ignore_eos":1})", "ignore_eos"},
      {R"({"prompt":"x","stop_token_ids":[512]})", "stop_token_ids"},
      {R"({"prompt":"x","stop_token_ids":"2"})", "stop_token_ids"},
      {R"({"prompt":"x","logit_bias":{"512":1}})", "logit_bias"},
      {R"({"prompt":"x","logit_bias":{"a":1}})", "logit_bias"},
      {R"({"prompt":"x","logit_bias":{"5":101}})", "logit_bias"},
      {R"({"prompt":"x","logit_bias":{"5":"1"}})", "logit_bias"},
      {R"({"prompt":"x","logit_bias":{"5":1,"05":2}})", "logit_bias"},
      {R"({"prompt":"x","logit_bias":[1]})", "logit_bias"},
      {R"({"prompt":"x","model":7})", "model"},
      {R"({"prompt":"x","speculation":"eagle"})", "speculation"},
      {R"({"prompt":"x","speculation":4})", "speculation"},
      {R"({"prompt":"x","speculation":{"method":"ngram","k":4}})", "speculation"},
      {R"({"prompt":"x","speculation":{"num_speculative_tokens":17}})", "num_speculative_tokens"},
      {R"({"prompt":"x","speculation":{"num_speculative_tokens":0}})", "num_speculative_tokens"},
      {R"({"prompt":"x","speculation":{"prompt_lookup_max":17}})", "prompt_lookup_max"},
      {R"({"prompt":"x","speculation":{"prompt_lookup_min":3,"prompt_lookup_max":2}})", ""},
      {R"({})", "prompt"},
      {R"({"prompt":[]})", "prompt"},
      {R"({"prompt":["a","b"]})", "prompt"},
      {R"({"prompt":[1,512]})", "prompt"},
      {R"({"prompt":[1,-1]})", "prompt"},
      {R"({"prompt":3})", "prompt"},
  };
  for (const auto& [body, param] : cases) {
    const ApiError e = error_of(Endpoint::completions, body);
    EXPECT_EQ(e.status, 400) << body;
    EXPECT_EQ(e.param, param) << body << ": " << e.message;
  }
  const std::string long_prompt(3000, 'a');
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":")" + long_prompt + R"("})").param, "prompt");
  // a malformed body names no parameter
  for (const char* body : {"{bad", "[1,2]", "\"text\""}) {
    const ApiError e = error_of(Endpoint::completions, body);
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "");
    EXPECT_EQ(e.code, "invalid_json");
  }
  const ApiError unknown = error_of(Endpoint::completions, R"({"prompt":"x","model":"gpt-4"})");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(unknown.code, "model_not_found");
  const json body = error_body(unknown);
  EXPECT_EQ(body["error"]["param"], "model");
  EXPECT_TRUE(body["error"].contains("type"));
  EXPECT_TRUE(body["error"]["message"].is_string());
}

TEST(HttpApi, SamplingControlsAndLogprobs) {
  const ApiRequest r = parse(Endpoint::completions, R"({"prompt":"x","max_tokens":20,"top_k":-1,"min_p":0.1,
      "presence_penalty":0.5,"frequency_penalty":-0.25,"repetition_penalty":1.1,"logit_bias":{"7":-100,"400":2.5},
      "min_tokens":3,"ignore_eos":true,"stop_token_ids":[2,13],"logprobs":5})");
  const Sampling& s = r.sampling;
  EXPECT_EQ(s.top_k, 0) << "-1: every token";
  EXPECT_FLOAT_EQ(s.min_p, 0.1f);
  EXPECT_FLOAT_EQ(s.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(s.frequency_penalty, -0.25f);
  EXPECT_FLOAT_EQ(s.repetition_penalty, 1.1f);
  ASSERT_EQ(s.logit_bias.size(), 2u);
  EXPECT_EQ(s.logit_bias[0].token, 400);  // (nlohmann orders an object's keys)
  EXPECT_FLOAT_EQ(s.logit_bias[0].bias, 2.5f);
  EXPECT_EQ(s.logit_bias[1].token, 7);
  EXPECT_EQ(s.stop.min_tokens, 3);
  EXPECT_TRUE(s.stop.ignore_eos);
  EXPECT_EQ(s.stop.stop_token_ids, (std::vector<int32_t>{2, 13}));
  EXPECT_EQ(s.logprobs, 5);
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x"})").sampling.logprobs, -1) << "none asked";
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x","logprobs":0})").sampling.logprobs, 0);
  // chat: logprobs true, top_logprobs N
  EXPECT_EQ(parse(Endpoint::chat, R"({"messages":[{"role":"user","content":"hi"}],"logprobs":true,"top_logprobs":3})")
                .sampling.logprobs, 3);
  EXPECT_EQ(parse(Endpoint::chat, R"({"messages":[{"role":"user","content":"hi"}],"logprobs":true})").sampling.logprobs, 0);
  EXPECT_EQ(parse(Endpoint::chat, R"({"messages":[{"role":"user","content":"hi"}],"logprobs":false})").sampling.logprobs, -1);
  EXPECT_EQ(error_of(Endpoint::chat, R"({"messages":[{"role":"user","content":"hi"}],"top_logprobs":2})").param,
            "top_logprobs");
  EXPECT_EQ(error_of(Endpoint::chat, R"({"messages":[{"role":"user","content":"hi"}],"logprobs":3})").param, "logprobs");
}

// Our extra field: speculative decoding per request (engine/speculation.h).
TEST(HttpApi, SpeculationPerRequest) {
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x"})").sampling.speculation.method,
            gpu::SpeculationMethod::configured);
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x","speculation":"off"})").sampling.speculation.method,
            gpu::SpeculationMethod::off);
  const gpu::SpeculationParams p = parse(Endpoint::chat, R"({"messages":[{"role":"user","content":"hi"}],
      "speculation":{"method":"ngram","num_speculative_tokens":6,"prompt_lookup_min":2,"prompt_lookup_max":5}})")
                                       .sampling.speculation;
  EXPECT_EQ(p.method, gpu::SpeculationMethod::ngram);
  EXPECT_EQ(p.num_tokens, 6);
  EXPECT_EQ(p.lookup_min, 2);
  EXPECT_EQ(p.lookup_max, 5);
  const gpu::SpeculationParams partial =
      parse(Endpoint::completions, R"({"prompt":"x","speculation":{"num_speculative_tokens":2}})").sampling.speculation;
  EXPECT_EQ(partial.method, gpu::SpeculationMethod::configured);
  EXPECT_EQ(partial.num_tokens, 2);
  EXPECT_EQ(partial.lookup_max, 0) << "the worker's";
}

TEST(HttpApi, LogprobsShapes) {
  const std::vector<int32_t> ids = encode("Once upon");  // BOS, then the words
  const std::vector<int32_t> tokens(ids.begin() + 1, ids.end());
  std::vector<TokenLogprobs> lp;
  for (size_t i = 0; i < tokens.size(); ++i) lp.push_back({-0.5f * float(i + 1), {tokens[i], 3}, {-0.5f * float(i + 1), -4.0f}});
  int64_t offset = 0;
  const json c = logprobs_json(Endpoint::completions, tokenizer(), ids[0], tokens, lp, 0, offset);
  std::string text;
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(c["text_offset"][i], int64_t(text.size()));
    const std::string piece = tokenizer().decode(i ? tokens[i - 1] : ids[0], tokens[i]);
    EXPECT_EQ(c["tokens"][i], piece);
    EXPECT_FLOAT_EQ(c["token_logprobs"][i].get<float>(), lp[i].logprob);
    EXPECT_EQ(c["top_logprobs"][i].size(), 2u) << "the alternative and the sampled token (one of the top here)";
    text += piece;
  }
  EXPECT_EQ(text, "Once upon");
  EXPECT_EQ(offset, int64_t(text.size())) << "the offset advances past the tokens";
  int64_t unused = 0;
  const json tail = logprobs_json(Endpoint::chat, tokenizer(), ids[0], tokens,
                                  std::vector<TokenLogprobs>(lp.begin() + 1, lp.end()), 1, unused);
  ASSERT_EQ(tail["content"].size(), tokens.size() - 1) << "from: the tokens no chunk carried";
  const json& first = tail["content"][0];
  const std::string piece = tokenizer().decode(tokens[0], tokens[1]);
  EXPECT_EQ(first["token"], piece);
  EXPECT_EQ(first["bytes"].size(), piece.size());
  EXPECT_EQ(first["top_logprobs"].size(), 2u);
  EXPECT_EQ(first["top_logprobs"][1]["logprob"], -4.0f);
}

// A whole reply is built in memory: n x tokens x (alternatives + 1) log
// probabilities at most kMaxReplyLogprobs (16 x 3120 x 21 fit, 3121 do not;
// an echoed prompt counts); streamed, the same request is taken.
TEST(HttpApi, AWholeReplysLogProbabilitiesAreBounded) {
  ServedModel m = model();
  m.seq_len = 65536;
  auto parse_long = [&](Endpoint e, const std::string& body) {
    return parse_request(e, body, m, tokenizer(), ChatTemplate::llama2, [] { return uint64_t(42); });
  };
  const int64_t fit = kMaxReplyLogprobs / (16 * 21);
  auto chat = [](int64_t max_tokens, const char* more = "") {
    return R"({"messages": [{"role": "user", "content": "hi"}], "n": 16, "logprobs": true, "top_logprobs": 20, "max_tokens": )" +
           std::to_string(max_tokens) + more + "}";
  };
  EXPECT_EQ(parse_long(Endpoint::chat, chat(fit)).max_tokens, fit);
  try {
    parse_long(Endpoint::chat, chat(fit + 1));
    ADD_FAILURE() << "no error past the bound";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "top_logprobs");
    EXPECT_NE(e.message.find("stream it"), std::string::npos) << e.message;
  }
  ApiRequest streamed = parse_long(Endpoint::chat, chat(fit + 1, R"(, "stream": true)"));
  EXPECT_TRUE(streamed.stream);
  // A stream whose log probabilities are kept whole all the same (/v1/responses') is bounded on demand.
  try {
    fit_reply_logprobs(streamed);
    ADD_FAILURE() << "no error past the bound for a stream kept whole";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.message.find("stream it"), std::string::npos) << e.message;
  }
  // Chat without max_tokens (the rest of the context): as many as fit.
  const ApiRequest defaulted = parse_long(
      Endpoint::chat, R"({"messages": [{"role": "user", "content": "hi"}], "n": 16, "logprobs": true, "top_logprobs": 20})");
  EXPECT_TRUE(defaulted.max_tokens_defaulted);
  EXPECT_EQ(defaulted.max_tokens, fit);
  EXPECT_NO_THROW(parse_long(Endpoint::chat, chat(60000, R"(, "logprobs": false, "top_logprobs": null)")));
  // Held whole all the same: best_of's samples (each is kept until the best are
  // known: all of them count) and a stream under tools (the calls come at the end).
  auto best_of = [](int64_t max_tokens) {
    return R"({"prompt": "Once", "best_of": 16, "logprobs": 20, "max_tokens": )" + std::to_string(max_tokens) + "}";
  };
  EXPECT_NO_THROW(parse_long(Endpoint::completions, best_of(fit)));
  try {
    parse_long(Endpoint::completions, best_of(fit + 1));
    ADD_FAILURE() << "no error past the bound for best_of's samples";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "logprobs");
    EXPECT_EQ(e.message.find("stream it"), std::string::npos) << "best_of cannot be streamed: " << e.message;
  }
  const std::string tools = std::string(R"(, "stream": true, "tools": [)") + kWeatherTool + "]";
  const std::string one = R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 20, "max_tokens": )";
  EXPECT_NO_THROW(parse_long(Endpoint::chat, one + std::to_string(kMaxReplyLogprobs / 21) + tools + "}"));
  EXPECT_THROW(parse_long(Endpoint::chat, one + std::to_string(kMaxReplyLogprobs / 21 + 1) + tools + "}"), ApiError);
  EXPECT_NO_THROW(parse_long(Endpoint::chat, one + std::to_string(kMaxReplyLogprobs / 21 + 1) + R"(, "stream": true})"))
      << "a stream without tools lets them go";
  // completions: the echoed prompt's tokens count too.
  const ApiRequest alone = parse_long(Endpoint::completions, R"({"prompt": "Once upon a time", "logprobs": 20, "max_tokens": 10})");
  const int64_t room = kMaxReplyLogprobs / 21 - int64_t(alone.prompt_tokens.size());
  auto completion = [](int64_t max_tokens) {
    return R"({"prompt": "Once upon a time", "logprobs": 20, "echo": true, "max_tokens": )" + std::to_string(max_tokens) + "}";
  };
  EXPECT_NO_THROW(parse_long(Endpoint::completions, completion(room)));
  try {
    parse_long(Endpoint::completions, completion(room + 1));
    ADD_FAILURE() << "no error past the bound with the echoed prompt";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param, "logprobs");
  }
}

// GET /v1/models/{id}: the served model's object, another id a 404; the id
// is read from the target percent-decoded (an "org/name" comes encoded).
TEST(HttpApi, RetrievingAModel) {
  const ServedModel m = model();
  EXPECT_EQ(model_response(m, m.name), models_response(m)["data"][0]);
  try {
    model_response(m, "org/other");
    ADD_FAILURE() << "no error for another model";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 404);
    EXPECT_EQ(e.code, "model_not_found");
    EXPECT_NE(e.message.find("\"org/other\""), std::string::npos) << e.message;
  }
  EXPECT_EQ(decoded_path("/v1/models/org%2Fname?x=%2F"), "/v1/models/org/name");
  EXPECT_EQ(decoded_path("/v1/models/plain"), "/v1/models/plain");
  EXPECT_EQ(decoded_path("no target"), std::nullopt);
}

TEST(HttpApi, TokenizeAndDetokenizeRoundTrip) {
  const json t = json::parse(dump(tokenize_response(R"({"prompt":"Once upon a time","return_token_strs":true})", model(),
                                                    tokenizer(), ChatTemplate::llama2)));
  EXPECT_EQ(t["tokens"].get<std::vector<int32_t>>(), encode("Once upon a time"));
  EXPECT_EQ(t["count"], t["tokens"].size());
  EXPECT_EQ(t["max_model_len"], 512);
  ASSERT_EQ(t["token_strs"].size(), t["tokens"].size());
  EXPECT_EQ(t["token_strs"][1], tokenizer().vocabulary().pieces[size_t(t["tokens"][1].get<int>())]);
  const json plain = tokenize_response(R"({"prompt":"Once","add_special_tokens":false})", model(), tokenizer(),
                                       ChatTemplate::llama2);
  EXPECT_EQ(plain["tokens"].get<std::vector<int>>(), tokenizer().encode("Once", false)) << "no BOS";
  EXPECT_TRUE(plain["token_strs"].is_null());
  const json chat = tokenize_response(R"({"messages":[{"role":"user","content":"hi"}]})", model(), tokenizer(),
                                      ChatTemplate::llama2);
  EXPECT_EQ(chat["tokens"].get<std::vector<int32_t>>(),
            parse(Endpoint::chat, R"({"messages":[{"role":"user","content":"hi"}]})").prompt_tokens)
      << "as a chat request renders its messages";
  const json d = detokenize_response(dump(json{{"tokens", t["tokens"]}}), model(), tokenizer());
  EXPECT_EQ(d["prompt"], "Once upon a time");
  auto status_of = [](auto call) {
    try {
      call();
    } catch (const ApiError& e) {
      return e.param + " " + std::to_string(e.status);
    }
    return std::string("no error");
  };
  EXPECT_EQ(status_of([] { detokenize_response(R"({"tokens":[1,512]})", model(), tokenizer()); }), "tokens 400");
  EXPECT_EQ(status_of([] { detokenize_response(R"({"tokens":"1"})", model(), tokenizer()); }), "tokens 400");
  EXPECT_EQ(status_of([] { detokenize_response(R"({})", model(), tokenizer()); }), "tokens 400");
  EXPECT_EQ(status_of([] { tokenize_response(R"({})", model(), tokenizer(), ChatTemplate::llama2); }), "prompt 400");
  EXPECT_EQ(status_of([] { tokenize_response(R"({"prompt":"x","model":"other"})", model(), tokenizer(), ChatTemplate::llama2); }),
            "model 404");
  EXPECT_EQ(status_of([] { tokenize_response(R"({"prompt":5})", model(), tokenizer(), ChatTemplate::llama2); }),
            "prompt 400");
}

// A model file's special piece need not be UTF-8 (a GGUF's pieces are bytes):
// its template still renders (the piece's bytes as U+FFFD, as JSON text must
// have them), where the context's JSON threw past every handler of
// /tokenize and ended the frontend.
TEST(HttpApi, AModelTemplateRendersWhenABosPieceIsNotUtf8) {
  gpu::Vocabulary v = tokenizer().vocabulary();
  ASSERT_GE(v.bos, 0);
  v.pieces[size_t(v.bos)] = "\xff";
  const gpu::Tokenizer bad_bos = gpu::Tokenizer::from_vocabulary(v, "bad-bos");
  ChatFormat format(ChatTemplate::llama2);
  format.jinja = std::make_shared<const gpu::JinjaTemplate>("[{{ bos_token }}]{{ messages[0].content }}");
  json out;
  EXPECT_NO_THROW(out = tokenize_response(R"({"messages":[{"role":"user","content":"hi"}]})", model(), bad_bos, format));
  ChatFormat literal(ChatTemplate::llama2);
  literal.jinja = std::make_shared<const gpu::JinjaTemplate>("[\xEF\xBF\xBD]{{ messages[0].content }}");
  const json expected =
      tokenize_response(R"({"messages":[{"role":"user","content":"hi"}]})", model(), bad_bos, literal);
  EXPECT_EQ(out["tokens"], expected["tokens"]);
}

// A model file's tool_use template (Hermes-2-Pro's, transformers' rule)
// renders the requests that pass tools, an empty list too; its default the
// others; a request's own template (where trusted) all of them.
TEST(HttpApi, AModelsToolUseTemplateRendersTheRequestsWithTools) {
  gpu::Vocabulary v = tokenizer().vocabulary();
  v.chat_template = "D{{ messages[0].content }}";
  v.tool_use_template = "T{{ tools | length }}{{ messages[0].content }}";
  const gpu::ChosenTemplate chosen = gpu::choose_chat_template("auto", v);
  ASSERT_TRUE(chosen.error.empty()) << chosen.error;
  ASSERT_TRUE(chosen.format.tool_use);
  ChatFormat format = chosen.format;
  format.trusts_request_templates = true;
  auto prompt = [&](const std::string& body) {
    return parse_request(Endpoint::chat, body, model(), tokenizer(), format, [] { return uint64_t(42); }).prompt_tokens;
  };
  auto literal = [&](const std::string& text) {  // the same request rendered by a template that is that text
    ChatFormat fixed(ChatTemplate::llama2);
    fixed.jinja = std::make_shared<const gpu::JinjaTemplate>(text);
    return parse_request(Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}]})", model(), tokenizer(),
                         fixed, [] { return uint64_t(42); })
        .prompt_tokens;
  };
  const std::string tool = R"({"type":"function","function":{"name":"f","parameters":{"type":"object"}}})";
  EXPECT_EQ(prompt(R"({"messages":[{"role":"user","content":"hi"}]})"), literal("Dhi"));
  EXPECT_EQ(prompt(R"({"messages":[{"role":"user","content":"hi"}],"tools":[)" + tool + "]}"), literal("T1hi"));
  EXPECT_EQ(prompt(R"({"messages":[{"role":"user","content":"hi"}],"tools":[]})"), literal("T0hi"));
  EXPECT_EQ(prompt(R"({"messages":[{"role":"user","content":"hi"}],"tools":null})"), literal("Dhi"));
  EXPECT_EQ(prompt(R"({"messages":[{"role":"user","content":"hi"}],"tools":[)" + tool +
                   R"(],"chat_template":"R{{ messages[0].content }}"})"),
            literal("Rhi"));
  // A tool_use template jinja2 cannot compile is the model file's error.
  v.tool_use_template = "{% if %}";
  EXPECT_FALSE(gpu::choose_chat_template("auto", v).error.empty());
}

// The probes of issue 18: each ended the frontend (an exception other than
// parse_error, a quadratic copy per nesting level, a recursive dump of a
// deep value); each is a bounded 400 now.
TEST(HttpApi, NumbersBeyondADoubleAndDeepNestingAre400s) {
  for (const std::string& body : std::vector<std::string>{R"({"prompt":"x","max_tokens":1e400})", R"({"foo":-1e400})", R"({"prompt":"x","seed":1e400})",
                                 "{\"prompt\":\"x\",\"foo\":[" + std::string(100000, '9') + "]}"}) {
    const ApiError e = error_of(Endpoint::completions, body);
    EXPECT_EQ(e.status, 400) << body.substr(0, 80);
    EXPECT_EQ(e.code, "invalid_json") << e.message;
    EXPECT_LT(e.message.size(), 300u) << e.message;
  }
  // A 40 KB body nesting 20,000 deep, logit_bias 100,000 deep, 400,000 deep.
  for (const std::string& body : std::vector<std::string>{"{\"prompt\":" + nested_arrays(20000, "\"x\"") + "}",
                                 "{\"prompt\":\"x\",\"logit_bias\":" + nested_objects(100000) + "}",
                                 "{\"prompt\":" + nested_arrays(400000) + "}"}) {
    const ApiError e = error_of(Endpoint::completions, body);
    EXPECT_EQ(e.code, "invalid_json") << e.message;
    EXPECT_NE(e.message.find(std::to_string(kMaxJsonDepth)), std::string::npos) << e.message;
  }
  // The limit is where it says: the body's object is level 1.
  const std::string at_limit = "{\"prompt\":\"x\",\"extra\":" + nested_arrays(size_t(kMaxJsonDepth) - 1) + "}";
  EXPECT_EQ(parse(Endpoint::completions, at_limit).prompt_tokens, encode("x"));
  EXPECT_EQ(error_of(Endpoint::completions, "{\"prompt\":\"x\",\"extra\":" + nested_arrays(kMaxJsonDepth) + "}").code,
            "invalid_json");
  // A batch of one is unwrapped once; deeper is no prompt.
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":[[1,403]]})").prompt_tokens, (std::vector<int32_t>{1, 403}));
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":[[[1]]]})").param, "prompt");
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":[["x"]]]})").code, "invalid_json");
}

TEST(HttpApi, ExtremeIntegersAndWrongShapesAre400sThatQuoteABoundedPrefix) {
  // max_tokens beyond int64, or so large that prompt + max_tokens overflowed.
  for (const char* m : {"18446744073709551615", "9223372036854775807", "4294967297", "2147483648"}) {
    const ApiError e = error_of(Endpoint::completions, std::string(R"({"prompt":"x","max_tokens":)") + m + "}");
    EXPECT_EQ(e.param, "max_tokens") << m;
    EXPECT_EQ(e.code, "context_length_exceeded") << m << ": " << e.message;
  }
  // Beyond int64 into a field whose lower bound is negative: read as int64,
  // 2^64 - 1 would be -1 (top_k's "every token"), so it must be refused first.
  for (const char* k : {"18446744073709551615", "9223372036854775808"}) {
    const ApiError e = error_of(Endpoint::completions, std::string(R"({"prompt":"x","top_k":)") + k + "}");
    EXPECT_EQ(e.status, 400) << k;
    EXPECT_EQ(e.param, "top_k") << k;
  }
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":[18446744073709551615]})").param, "prompt");
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":[9223372036854775807]})").param, "prompt");
  // A content part whose type is no string threw json::type_error out of the parser.
  for (const char* messages : {R"([{"role":"user","content":[{"type":5}]}])",
                               R"([{"role":"user","content":[{"type":"text","text":5}]}])",
                               R"([{"role":"user","content":[{"type":"text"}]}])", R"([{"role":"user","content":[7]}])"}) {
    const ApiError e = error_of(Endpoint::chat, std::string(R"({"messages":)") + messages + "}");
    EXPECT_EQ(e.status, 400) << messages;
    EXPECT_EQ(e.param, "messages") << messages;
  }
  // response_format: text (no grammar), json_object (JSON's object grammar),
  // json_schema not yet (unsupported), anything else a bad request.
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x","response_format":{"type":"text"}})").sampling.grammar, "");
  EXPECT_EQ(parse(Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"}})")
                .sampling.grammar,
            grammar::json_object_grammar().to_json());
  EXPECT_EQ(parse(Endpoint::completions,
                  R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"name":"n","schema":{"type":"integer"}}}})")
                .sampling.grammar,
            grammar::json_schema_grammar(json{{"type", "integer"}}).to_json());
  const ApiError unknown = error_of(
      Endpoint::completions,
      R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"schema":{"type":"string","contentMediaType":"x"}}}})");
  EXPECT_EQ(unknown.code, "unsupported");
  EXPECT_NE(unknown.message.find("contentMediaType"), std::string::npos) << unknown.message;
  const ApiError loose = error_of(
      Endpoint::completions,
      R"({"prompt":"x","response_format":{"type":"json_schema","json_schema":{"strict":true,"schema":{"type":"object","properties":{"a":{"type":"string"}}}}}})");
  EXPECT_NE(loose.message.find("strict"), std::string::npos) << loose.message;
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","response_format":{"type":"grammar"}})").code, "unsupported");
  // vLLM's guided_json (an object or its text) and guided_choice.
  const std::string schema_grammar = grammar::json_schema_grammar(json{{"type", "boolean"}}).to_json();
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x","guided_json":{"type":"boolean"}})").sampling.grammar, schema_grammar);
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x","guided_json":"{\"type\":\"boolean\"}"})").sampling.grammar,
            schema_grammar);
  const std::string choice = parse(Endpoint::completions, R"({"prompt":"x","guided_choice":["yes","no"]})").sampling.grammar;
  EXPECT_NE(choice.find("\"79-79\""), std::string::npos) << choice;  // 'y'
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","guided_choice":[]})").param, "guided_choice");
  // guided_regex: the whole output matches (grammar/regex.h).
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x","guided_regex":"yes|no"})").sampling.grammar, choice);
  const ApiError regex = error_of(Endpoint::completions, R"({"prompt":"x","guided_regex":"(a)\\1"})");
  EXPECT_EQ(regex.param, "guided_regex");
  EXPECT_NE(regex.message.find("backreference"), std::string::npos) << regex.message;
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","guided_regex":"a","guided_grammar":"root ::= \"a\""})")
                .status,
            400);
  // guided_grammar: GBNF (grammar/gbnf.h); its errors name the line and column.
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x","guided_grammar":"root ::= \"yes\" | \"no\""})").sampling.grammar,
            choice);
  const ApiError gbnf = error_of(Endpoint::completions, R"({"prompt":"x","guided_grammar":"root ::= answer"})");
  EXPECT_EQ(gbnf.param, "guided_grammar");
  EXPECT_NE(gbnf.message.find("'answer' is used but never defined"), std::string::npos) << gbnf.message;
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","guided_grammar":7})").param, "guided_grammar");
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","guided_grammar":"root ::= \"a\"","guided_choice":["a"]})")
                .status,
            400);
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","guided_json":{"type":"boolean"},"guided_choice":["a"]})").status, 400);
  EXPECT_EQ(error_of(Endpoint::completions,
                     R"({"prompt":"x","guided_json":{"type":"boolean"},"response_format":{"type":"json_object"}})").status,
            400);
  // A stop would cut a structured output before it is complete: refused
  // beside a grammar, taken without one.
  for (const char* stop : {R"("stop":"}")", R"("stop":["}"])", R"("stop_token_ids":[5])"}) {
    const ApiError cut = error_of(
        Endpoint::completions, std::string(R"({"prompt":"x","response_format":{"type":"json_object"},)") + stop + "}");
    EXPECT_EQ(cut.code, "unsupported") << stop;
    EXPECT_EQ(cut.param, std::string(stop).find("ids") != std::string::npos ? "stop_token_ids" : "stop") << stop;
    EXPECT_NO_THROW(parse(Endpoint::completions, std::string(R"({"prompt":"x",)") + stop + "}")) << stop;
  }
  EXPECT_NO_THROW(parse(Endpoint::completions, R"({"prompt":"x","response_format":{"type":"json_object"},"stop":[]})"));
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","response_format":"text"})").param, "response_format");
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","response_format":{"kind":"text"}})").param, "response_format");
  // Stop strings: how many and how long.
  const std::string long_stop(kMaxStopBytes + 1, 's');
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","stop":")" + long_stop + "\"}").param, "stop");
  EXPECT_EQ(parse(Endpoint::completions, R"({"prompt":"x","stop":")" + long_stop.substr(1) + "\"}").stop.size(), 1u);
  std::string many = "[";
  for (size_t i = 0; i <= kMaxStopStrings; ++i) many += (i ? ",\"s" : "\"s") + std::to_string(i) + "\"";
  EXPECT_EQ(error_of(Endpoint::completions, R"({"prompt":"x","stop":)" + many + "]}").param, "stop");
  // Every message quotes at most a bounded prefix of what it was sent.
  const std::string huge(500000, 'q');
  for (const std::string& body : std::vector<std::string>{R"({"prompt":"x","model":")" + huge + "\"}", R"({"prompt":"x","temperature":")" + huge + "\"}",
                                 R"({"prompt":"x","n":")" + huge + "\"}", R"({"prompt":"x","logit_bias":{")" + huge + "\":1}}",
                                 R"({"messages":[{"role":")" + huge + "\"}]}", R"({"prompt":"x","echo":[)" +
                                     std::string(200000, '1') + "]}"}) {
    const bool chat = body.compare(0, 12, R"({"messages":)") == 0;
    const ApiError e = error_of(chat ? Endpoint::chat : Endpoint::completions, body);
    EXPECT_GE(e.status, 400);
    EXPECT_LT(dump(error_body(e)).size(), 400u) << e.message.substr(0, 200);
  }
}

// Thousands of generated bodies (tests/support/adversarial_json.h): each is
// an ApiError with a 4xx status and a bounded message, never another
// exception; the same bodies go to a running frontend in
// tests/cluster/test_http_fuzz.cpp.
TEST(HttpApi, GeneratedAdversarialBodiesAreBounded4xxErrors) {
  const auto bodies = adversarial_bodies(1, 4000, 1 << 20);
  size_t worst = 0;
  for (const auto& b : bodies) {
    try {
      parse(b.chat ? Endpoint::chat : Endpoint::completions, b.body);
      ADD_FAILURE() << "accepted: " << b.what;
    } catch (const ApiError& e) {
      EXPECT_GE(e.status, 400) << b.what;
      EXPECT_LT(e.status, 500) << b.what;
      worst = std::max(worst, dump(error_body(e)).size());
    } catch (const std::exception& e) {
      ADD_FAILURE() << b.what << ": " << e.what();
    }
  }
  EXPECT_LT(worst, 600u);
}

TEST(HttpApi, ChatLlama2Template) {
  const ApiRequest r = parse(Endpoint::chat, R"({"messages":[{"role":"system","content":"Be kind."},
      {"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":[{"type":"text","text":"More"}]}]})");
  std::vector<int32_t> want = encode("[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\nHi [/INST] Hello ");
  want.push_back(2);  // </s> of the llama2.c vocabulary
  const auto second = encode("[INST] More [/INST]");
  want.insert(want.end(), second.begin(), second.end());
  EXPECT_EQ(r.prompt_tokens, want);
  EXPECT_EQ(r.max_tokens, 512 - int(want.size()));  // chat default: the rest of the context
  EXPECT_TRUE(r.max_tokens_defaulted);  // the router lowers it to what a pool holds

  const ApiRequest plain = parse(Endpoint::chat, R"({"messages":[{"role":"user","content":"Hi"}]})", ChatTemplate::plain);
  EXPECT_EQ(plain.prompt_tokens, encode("user: Hi\nassistant:"));

  for (const char* body : {R"({"messages":[]})", R"({"messages":"hi"})", R"({"messages":[{"role":"user"},{"role":"user","content":"x"}]})",
                           R"({"messages":[{"role":"assistant","content":"x"}]})", R"({"messages":[{"role":"robot","content":"x"}]})",
                           R"({"messages":[{"content":"x"}]})"}) {
    const ApiError e = error_of(Endpoint::chat, body);
    EXPECT_EQ(e.status, 400) << body;
    EXPECT_EQ(e.param, "messages") << body;
  }
  EXPECT_EQ(error_of(Endpoint::chat, R"({"messages":[{"role":"user","content":"x"}],"max_completion_tokens":0})").param,
            "max_completion_tokens");
  EXPECT_EQ(gpu::parse_chat_template("llama2"), ChatTemplate::llama2);
  EXPECT_EQ(gpu::parse_chat_template("chatml"), ChatTemplate::chatml);
  EXPECT_EQ(gpu::parse_chat_template("vicuna"), std::nullopt);
}

TEST(HttpApi, TextAssemblerEqualsDecodeAllWithoutStops) {
  const auto prompt = encode("Once upon a time");
  const std::vector<int> tokens = {432, 383, 286, 261, 376, 298, 315, 421, 395, 317};
  TextAssembler text(tokenizer(), {}, prompt.back());
  std::string streamed;
  for (int t : tokens) streamed += text.add(t);
  streamed += text.flush();
  EXPECT_EQ(streamed, tokenizer().decode_all(prompt.back(), tokens));
  EXPECT_EQ(text.text(), streamed);
  EXPECT_EQ(text.tokens(), int(tokens.size()));
  EXPECT_FALSE(text.stopped());
}

TEST(HttpApi, StopStringsAcrossTokensAreCutAndNeverSent) {
  const auto prompt = encode("Once upon a time");
  const std::vector<int> tokens = {432, 383, 286, 261, 376, 298, 315, 421, 395, 317};
  const std::string full = tokenizer().decode_all(prompt.back(), tokens);  // ", there was a little girl named Lily..."
  const std::string stop = "girl na";  // spans tokens
  const size_t at = full.find(stop);
  ASSERT_NE(at, std::string::npos) << full;
  TextAssembler text(tokenizer(), {"zzz", stop}, prompt.back());
  std::string streamed;
  for (int t : tokens) {
    const std::string piece = text.add(t);
    streamed += piece;
    EXPECT_EQ(streamed.find("girl n"), std::string::npos) << "a stop string's start was sent early";
    if (text.stopped()) break;
  }
  EXPECT_TRUE(text.stopped());
  EXPECT_EQ(streamed, full.substr(0, at));
  EXPECT_EQ(text.flush(), "");
}

TEST(HttpApi, IncompleteUtf8IsHeldBack) {
  // Byte tokens <0xE2><0x82><0xAC> (U+20AC) arrive one by one: nothing is sent until the character is whole.
  const int byte0 = 3;  // <0x00> is token 3 in llama2.c tokenizers
  TextAssembler text(tokenizer(), {}, 1);
  EXPECT_EQ(text.add(byte0 + 0xE2), "");
  EXPECT_EQ(text.add(byte0 + 0x82), "");
  EXPECT_EQ(text.add(byte0 + 0xAC), "\xE2\x82\xAC");
  EXPECT_EQ(text.add(byte0 + 0xE2), "");
  EXPECT_EQ(text.flush(), "\xE2");  // at the end it goes out (dump() replaces it with U+FFFD)
  EXPECT_EQ(dump(json("\xE2")), "\"\xEF\xBF\xBD\"");
}

TEST(HttpApi, OutcomeErrorsMapToStatuses) {
  EXPECT_EQ(error_for_outcome(ErrorCode::invalid_request, "").status, 400);
  EXPECT_EQ(error_for_outcome(ErrorCode::kv_too_large, "").status, 400);
  const ApiError overloaded = error_for_outcome(ErrorCode::overloaded, "full");
  EXPECT_EQ(overloaded.status, 503);
  EXPECT_EQ(overloaded.retry_after_s, kOverloadedRetryAfterS);
  EXPECT_EQ(overloaded.code, "overloaded");
  EXPECT_EQ(error_for_outcome(ErrorCode::timeout, "").status, 504);
  EXPECT_EQ(error_for_outcome(ErrorCode::worker_lost, "").status, 500);
  EXPECT_EQ(error_for_outcome(ErrorCode::internal, "").status, 500);
  EXPECT_EQ(error_for_outcome(ErrorCode::incompatible_kv, "").status, 500);
  // The metrics' error labels follow the protocol's codes (actors/request_metrics.h indexes them).
  for (size_t i = 0; i < metrics::kErrorCodes.size(); ++i)
    EXPECT_EQ(metrics::kErrorCodes[i], to_string(ErrorCode(i + 1)));
}

TEST(HttpApi, ResponseShapes) {
  const json c = response_json(Endpoint::completions, "cmpl-1", 5, "m",
                               {choice_json(Endpoint::completions, 0, "hi", "length")}, 3, 2);
  EXPECT_EQ(c["object"], "text_completion");
  EXPECT_EQ(c["choices"][0]["text"], "hi");
  EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(c["usage"]["total_tokens"], 5);
  const json chat = response_json(Endpoint::chat, "chatcmpl-1", 5, "m",
                                  {choice_json(Endpoint::chat, 0, "hi", "stop"), choice_json(Endpoint::chat, 1, "ho", "length")},
                                  3, 2);
  EXPECT_EQ(chat["object"], "chat.completion");
  EXPECT_EQ(chat["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(chat["choices"][0]["message"]["content"], "hi");
  EXPECT_EQ(chat["choices"][1]["index"], 1);
  EXPECT_EQ(chat["choices"][1]["finish_reason"], "length");
  const json first = stream_chunk(Endpoint::chat, "x", 1, "m", 0, "", "", true, true);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_TRUE(first["usage"].is_null());
  const json piece = stream_chunk(Endpoint::completions, "x", 1, "m", 2, "a", "", false, false);
  EXPECT_EQ(piece["choices"][0]["text"], "a");
  EXPECT_EQ(piece["choices"][0]["index"], 2);
  EXPECT_TRUE(piece["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(piece.contains("usage"));
  const json usage = usage_chunk(Endpoint::completions, "x", 1, "m", 4, 6);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 6);
  EXPECT_EQ(sse_event(json{{"a", 1}}), "data: {\"a\":1}\n\n");
  const json models = models_response(model());
  EXPECT_EQ(models["data"][0]["id"], "stories260K");
  EXPECT_EQ(models["data"][0]["max_model_len"], 512);
}

}  // namespace
}  // namespace disagg::http

namespace disagg::http {
namespace {

std::string chat_with_tools(const std::string& extra) {
  return std::string(R"({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [)") + kWeatherTool +
         R"(, {"type": "function", "function": {"name": "now"}}])" + extra + "}";
}

TEST(HttpTools, ToolChoiceSetsTheGrammarOfTheCall) {
  const ApiRequest automatic = parse(Endpoint::chat, chat_with_tools(""));
  EXPECT_EQ(automatic.tools.choice, ToolUse::Choice::automatic);
  EXPECT_EQ(automatic.sampling.grammar, "") << "auto: the model decides, its text is parsed";
  EXPECT_EQ(parse(Endpoint::chat, chat_with_tools(R"(, "tool_choice": "none")")).tools.choice, ToolUse::Choice::none);
  const ApiRequest named =
      parse(Endpoint::chat, chat_with_tools(R"(, "tool_choice": {"type": "function", "function": {"name": "get_weather"}})"));
  EXPECT_EQ(named.tools.choice, ToolUse::Choice::named);
  EXPECT_EQ(named.tools.name, "get_weather");
  EXPECT_EQ(named.sampling.grammar,
            grammar::json_schema_grammar(json::parse(kWeatherTool)["function"]["parameters"]).to_json());
  const ApiRequest required = parse(Endpoint::chat, chat_with_tools(R"(, "tool_choice": "required", "parallel_tool_calls": false)"));
  EXPECT_EQ(required.tools.choice, ToolUse::Choice::required);
  EXPECT_FALSE(required.sampling.grammar.empty());
  // With a response_format too, the forced call rules this turn (the format is for an answer in text).
  const ApiRequest both =
      parse(Endpoint::chat, chat_with_tools(R"(, "tool_choice": "required", "response_format": {"type": "json_object"})"));
  EXPECT_EQ(both.tools.choice, ToolUse::Choice::required);
  EXPECT_EQ(both.sampling.grammar,
            parse(Endpoint::chat, chat_with_tools(R"(, "tool_choice": "required")")).sampling.grammar);
  // Refused: a name no tool has, a malformed tool, two tools of one name.
  EXPECT_EQ(error_of(Endpoint::chat, chat_with_tools(R"(, "tool_choice": {"type": "function", "function": {"name": "x"}})")).param,
            "tool_choice");
  EXPECT_EQ(error_of(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "f"}]})").param, "tools");
  // A "type" that is not a string: a 400 too (it was a type_error's 500).
  EXPECT_EQ(error_of(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": 1}]})").param, "tools");
  EXPECT_EQ(error_of(Endpoint::chat, chat_with_tools(R"(, "tool_choice": {"type": 1, "function": {"name": "x"}})")).param,
            "tool_choice");
  EXPECT_EQ(error_of(Endpoint::chat, std::string(R"({"messages": [{"role": "user", "content": "x"}], "tools": [)") + kWeatherTool +
                                         "," + kWeatherTool + "]}").param,
            "tools");
  EXPECT_EQ(error_of(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"})").param,
            "tool_choice");
}

// tool_choice "required" puts every tool's parameters in one schema: their
// own references ("#/$defs/X" as pydantic writes them, "#" for recursion)
// still name what they named.
TEST(HttpTools, ARequiredCallKeepsEachToolsReferencesToItself) {
  const std::string tools = R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required", "tools": [
      {"type": "function", "function": {"name": "city", "parameters": {"$defs": {"City": {"type": "string", "maxLength": 5}},
        "type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"], "additionalProperties": false}}},
      {"type": "function", "function": {"name": "tree", "parameters": {"type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "additionalProperties": false}}},
      {"type": "function", "function": {"name": "named", "parameters": {"$defs": {"E": {"type": "integer"}},
        "type": "object", "properties": {"enum": {"$ref": "#/$defs/E"}, "const": {"$ref": "#/$defs/E"}},
        "required": ["enum", "const"], "additionalProperties": false}}}]})";
  const ApiRequest r = parse(Endpoint::chat, tools);
  grammar::CompiledGrammar c(grammar::Grammar::from_json(r.sampling.grammar), grammar::stories_vocabulary());
  for (const char* t : {R"([{"name": "city", "arguments": {"city": "Paris"}}])",
                        R"([{"name": "tree", "arguments": {"kids": [{"kids": []}, {}]}}])",
                        // (properties named as keywords whose values are data: theirs are schemas all the same)
                        R"([{"name": "named", "arguments": {"enum": 1, "const": 2}}])"})
    EXPECT_TRUE(grammar::takes(c, t)) << t;
  for (const char* t : {R"([{"name": "city", "arguments": {"city": "Berlin"}}])",
                        R"([{"name": "tree", "arguments": {"kids": [{"name": "tree", "arguments": {}}]}}])",
                        R"([{"arguments": {"city": "Paris"}, "name": "city"}])"})  // the name comes first
    EXPECT_FALSE(grammar::takes(c, t)) << t;
}

// A schema's properties are written in the order the request lists them
// (as OpenAI's structured outputs write them), not by name.
TEST(HttpTools, PropertiesAreWrittenInTheSchemasOrder) {
  const std::string schema = R"({"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
                                 "required": ["zeta", "alpha"], "additionalProperties": false})";
  const std::string in_order = R"({"zeta": 1, "alpha": 2})", by_name = R"({"alpha": 2, "zeta": 1})";
  for (const std::string& body :
       {R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": )" +
            schema + "}}}",
        R"({"messages": [{"role": "user", "content": "x"}], "guided_json": )" + schema + "}",
        R"({"messages": [{"role": "user", "content": "x"}], "guided_json": )" + json(schema).dump() + "}",
        R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": "f"}},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": )" + schema + "}}]}",
        // (required: the calls' schema holds each tool's, objects inside arrays too)
        R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
            {"v": {"anyOf": [)" + schema + R"(]}}, "required": ["v"], "additionalProperties": false}}}]})"}) {
    const ApiRequest r = parse(Endpoint::chat, body);
    grammar::CompiledGrammar c(grammar::Grammar::from_json(r.sampling.grammar), grammar::stories_vocabulary());
    const bool call = body.find("\"required\"") != std::string::npos && body.find("tool_choice\": \"required") != std::string::npos;
    auto as_output = [&](const std::string& v) {
      return call ? R"([{"name": "f", "arguments": {"v": )" + v + "}}]" : v;
    };
    EXPECT_TRUE(grammar::takes(c, as_output(in_order))) << body;
    EXPECT_FALSE(grammar::takes(c, as_output(by_name))) << body;
  }
}

TEST(HttpTools, RepliesCarryTheCallsInOpenAisShape) {
  ToolUse named{ToolUse::Choice::named, "get_weather", gpu::ToolSyntax::none};
  ToolReply r = read_tool_calls(named, R"({"city": "Paris"})", "stop");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.finish_reason, "tool_calls");
  const json choice = tool_choice_json(0, r, "call_7_");
  EXPECT_TRUE(choice["message"]["content"].is_null());
  EXPECT_EQ(choice["message"]["tool_calls"][0]["id"], "call_7_0");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["type"], "function");
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(choice["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()), json({{"city", "Paris"}}));
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  // Cut by max_tokens: the call cut short (what a stream sent), finish "length".
  r = read_tool_calls(named, R"({"city": "Pa)", "length");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments, R"({"city": "Pa)");
  EXPECT_EQ(r.finish_reason, "length");
  // required: an array of calls.
  ToolUse required{ToolUse::Choice::required, "", gpu::ToolSyntax::none};
  r = read_tool_calls(required, R"([{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}])", "stop");
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[1].name, "get_weather");
  // A text that parses but is not calls (a stop string cut it): content.
  for (const char* text : {"[1, 2]", "{\"name\": \"now\"}", "[{\"name\": 5, \"arguments\": {}}]"}) {
    r = read_tool_calls(required, text, "stop");
    EXPECT_TRUE(r.calls.empty()) << text;
    EXPECT_EQ(r.content, text);
    EXPECT_EQ(r.finish_reason, "stop");
  }
  // auto: the family's syntax, content around it.
  ToolUse automatic{ToolUse::Choice::automatic, "", gpu::ToolSyntax::hermes};
  r = read_tool_calls(automatic, "Sure.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>", "stop");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.content, "Sure.");
  EXPECT_EQ(read_tool_calls(automatic, "No tools needed.", "stop").finish_reason, "stop");
  // A delta as a chunk: a call's head with its index, id, type and name
  // (arguments ""), then its arguments without the id.
  const json head = tool_delta_chunk("chatcmpl-1", 1, "m", 0, {ToolStream::Delta::Kind::call, "now", 1}, "call_1_",
                                     false)["choices"][0]["delta"]["tool_calls"][0];
  EXPECT_EQ(head["index"], 1);
  EXPECT_EQ(head["id"], "call_1_1");
  EXPECT_EQ(head["type"], "function");
  EXPECT_EQ(head["function"]["name"], "now");
  EXPECT_EQ(head["function"]["arguments"], "");
  const json args = tool_delta_chunk("chatcmpl-1", 1, "m", 0, {ToolStream::Delta::Kind::arguments, "{}", 1}, "call_1_",
                                     false)["choices"][0]["delta"]["tool_calls"][0];
  EXPECT_EQ(args["index"], 1);
  EXPECT_EQ(args["function"]["arguments"], "{}");
  EXPECT_FALSE(args.contains("id"));
}

// A text streamed in pieces (one byte at a time, and in random cuts): the
// deltas say what the reply says (the calls' names and arguments, the
// content), each call's head before its arguments, and they come as soon
// as they are sure: the named call's head with the first byte, each of
// `required`'s calls as its element ends, auto's content before the markup.
TEST(HttpTools, StreamedDeltasComeEarlyAndSayWhatTheReplySays) {
  struct Case {
    ToolUse tools;
    std::string text, finish;
    size_t first;  // fed a byte at a time: the bytes in when the first delta came (npos: only at the end)
  };
  const ToolUse named{ToolUse::Choice::named, "get_weather", gpu::ToolSyntax::none};
  const ToolUse required{ToolUse::Choice::required, "", gpu::ToolSyntax::none};
  const ToolUse hermes{ToolUse::Choice::automatic, "", gpu::ToolSyntax::hermes};
  const ToolUse llama3{ToolUse::Choice::automatic, "", gpu::ToolSyntax::llama3};
  const ToolUse mistral{ToolUse::Choice::automatic, "", gpu::ToolSyntax::mistral};
  constexpr size_t npos = std::string::npos;
  const std::string two_calls = R"([{"name": "now", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "O\"slo]}"}}])";
  const std::vector<Case> cases = {
      {named, R"({"city": "Paris"})", "stop", 1},
      {named, R"({"city": "Pa)", "length", 1},
      {required, two_calls, "stop", two_calls.find("},") + 1},
      {required, R"([{"name": "now", "arguments": {}}, {"name": "get_w)", "length", 33},
      {required, "[1, 2]", "stop", npos},
      {hermes, "Sure.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>", "stop", 1},
      {hermes, "No <tool tags> here, <tool_cal", "stop", 1},
      {hermes, "Cut <tool_call>{\"name\": \"now\", \"argu", "length", 1},
      {llama3, " {\"name\": \"now\", \"parameters\": {}}", "stop", npos},
      {llama3, "Let me check.<|python_tag|>{\"name\": \"now\", \"parameters\": {}}", "stop", 1},
      {llama3, "Plain text { with braces }", "stop", 1},
      {mistral, "[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": {}}]", "stop", npos},
  };
  std::mt19937 rng(5);
  for (const Case& k : cases) {
    SCOPED_TRACE(k.text);
    const ToolReply whole = read_tool_calls(k.tools, k.text, k.finish);
    for (int split = 0; split < 20; ++split) {
      ToolStream stream(k.tools);
      std::vector<ToolStream::Delta> deltas;
      size_t first_delta_at = std::string::npos;
      for (size_t at = 0; at < k.text.size();) {
        const size_t len = split == 0 ? 1 : std::min(k.text.size() - at, size_t(1 + rng() % 7));
        for (auto& d : stream.add(k.text.substr(at, len))) deltas.push_back(std::move(d));
        at += len;
        if (first_delta_at == std::string::npos && !deltas.empty()) first_delta_at = at;
      }
      const ToolReply reply = stream.finish(k.finish, deltas);
      if (split == 0) EXPECT_EQ(first_delta_at, k.first) << "when the first delta came";
      EXPECT_EQ(reply.finish_reason, whole.finish_reason);
      EXPECT_EQ(reply.content, whole.content);
      ASSERT_EQ(reply.calls.size(), whole.calls.size());
      std::string content;
      std::vector<gpu::ToolCall> calls;
      for (const auto& d : deltas) {
        if (d.kind == ToolStream::Delta::Kind::content) {
          content += d.text;
        } else if (d.kind == ToolStream::Delta::Kind::call) {
          ASSERT_EQ(d.index, calls.size()) << "heads in order, each once";
          calls.push_back({d.text, ""});
        } else {
          ASSERT_LT(d.index, calls.size()) << "arguments after their head";
          calls[d.index].arguments += d.text;
        }
      }
      ASSERT_EQ(calls.size(), whole.calls.size());
      for (size_t i = 0; i < calls.size(); ++i) {
        EXPECT_EQ(calls[i].name, whole.calls[i].name);
        EXPECT_EQ(calls[i].arguments, whole.calls[i].arguments);
      }
      // The content streamed is the reply's (calls: the text before them, trimmed there).
      if (whole.calls.empty()) EXPECT_EQ(content, k.text);
      else EXPECT_EQ(content.substr(0, content.find_last_not_of(" \t\r\n") + 1), whole.content);
    }
  }
  // What they say: the named call cut short keeps its arguments; required
  // cut short keeps the calls whose element ended; auto's call markup in
  // the text with a call that does not parse is content.
  EXPECT_EQ(read_tool_calls(required, two_calls, "stop").calls.at(1).arguments, R"({"city":"O\"slo]}"})");
  EXPECT_EQ(read_tool_calls(required, two_calls, "stop").finish_reason, "tool_calls");
  const ToolReply cut = read_tool_calls(required, R"([{"name": "now", "arguments": {}}, {"name": "get_w)", "length");
  ASSERT_EQ(cut.calls.size(), 1u);
  EXPECT_EQ(cut.finish_reason, "length");
  EXPECT_TRUE(read_tool_calls(hermes, "Cut <tool_call>{\"name\": \"now\", \"argu", "length").calls.empty());
  EXPECT_EQ(read_tool_calls(llama3, "Let me check.<|python_tag|>{\"name\": \"now\", \"parameters\": {}}", "stop").content,
            "Let me check.");
}

// A conversation with a call and its result renders: the call as the
// family writes it, the result as a tool message.
TEST(HttpTools, HistoryWithToolCallsAndResultsRenders) {
  const std::string body = R"({"messages": [
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
      {"role": "user", "content": "Thanks"}], "tools": [)" + std::string(kWeatherTool) + "]}";
  const ApiRequest r = parse(Endpoint::chat, body, ChatTemplate::qwen25);
  const std::string prompt = tokenizer().decode_all(1, std::vector<int>(r.prompt_tokens.begin(), r.prompt_tokens.end()));
  EXPECT_NE(prompt.find("<tool_call>\n{\"arguments\":{\"city\":\"Paris\"},\"name\":\"get_weather\"}\n</tool_call>"), std::string::npos)
      << prompt;
  EXPECT_NE(prompt.find("<tool_response>\n18 C, sunny\n</tool_response>"), std::string::npos) << prompt;
  EXPECT_EQ(error_of(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x", "tool_calls": []}]})").param, "messages");
}

}  // namespace
}  // namespace disagg::http

namespace disagg::http {
namespace {

// A reply's events and whole response, as the frontend's connection gets them.
class RecordingSink : public ReplySink {
 public:
  void reply_json(int, const json& body) override { whole = body; }
  void reply_error(const ApiError& e) override { error = e.message; }
  void open_events() override {}
  void event(std::string data) override { events.push_back(std::move(data)); }
  void end_events() override { ended = true; }
  json whole;
  std::string error;
  std::vector<std::string> events;
  bool ended = false;
};

// What a reply said, whole or streamed: its reasoning, content, calls' names.
struct Said {
  std::string reasoning, content, finish;
  std::vector<std::string> names;
  size_t logprobs = 0;  // tokens with log probabilities (chat's logprobs.content)
  json usage;           // the whole reply's, or the stream's usage chunk's (include_usage)
};

// Drives a Generation of `request` with scripted `tokens` (ending in EOS)
// and reads its reply as a client would; `after_token` looks at it after each.
Said generate_scripted(const gpu::Tokenizer& t, const ApiRequest& request, const std::vector<int>& tokens,
                       const std::function<void(const Generation&)>& after_token = {}) {
  caf::actor_system_config config;
  caf::actor_system system{config};
  RecordingSink sink;
  ServedModel served = model();
  served.vocab_size = t.vocab_size();
  const GenerationContext context{served, t, metrics::disagg_metrics()};
  RequestId id = 0;
  Generation generation(context, sink, std::make_shared<Client>(system, router_actor{}), request, "chatcmpl-t",
                        [&](GenerateRequest r) { id = r.id; });
  generation.start();
  EXPECT_NE(id, RequestId{0});
  for (size_t i = 0; i < tokens.size(); ++i) {
    TokenEvent e;
    e.id = id;
    e.index = int32_t(i);
    e.token = tokens[i];
    if (request.logprobs >= 0) e.logprobs = {-0.25f, {tokens[i]}, {-0.25f}};
    generation.on_token(id, e);
    if (after_token) after_token(generation);
  }
  RequestOutcome outcome;
  outcome.id = id;
  outcome.tokens.assign(tokens.begin(), tokens.end());
  outcome.finish = FinishReason::eos;
  generation.on_outcome(id, outcome);
  EXPECT_TRUE(generation.done()) << sink.error;
  EXPECT_EQ(sink.error, "");
  // (a string field, or "" where it is null or absent)
  auto text_of = [](const json& j, const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
  };
  Said said;
  if (!request.stream) {
    const json& message = sink.whole["choices"][0]["message"];
    said.reasoning = text_of(message, "reasoning_content");
    said.content = text_of(message, "content");
    said.finish = text_of(sink.whole["choices"][0], "finish_reason");
    said.usage = sink.whole["usage"];
    if (sink.whole["choices"][0]["logprobs"].is_object())
      said.logprobs = sink.whole["choices"][0]["logprobs"]["content"].size();
    for (const json& call : message.value("tool_calls", json::array())) said.names.push_back(call["function"]["name"]);
    return said;
  }
  for (const std::string& event : sink.events) {
    if (event.find("data: {") != 0) continue;
    const json chunk = json::parse(event.substr(6));
    if (chunk.contains("usage") && chunk["usage"].is_object()) said.usage = chunk["usage"];
    if (chunk["choices"].empty()) continue;
    const json choice = chunk["choices"][0];
    const json& delta = choice["delta"];
    said.reasoning += text_of(delta, "reasoning_content");
    said.content += text_of(delta, "content");
    for (const json& call : delta.value("tool_calls", json::array()))
      if (call.contains("function") && call["function"].contains("name")) said.names.push_back(call["function"]["name"]);
    if (choice["finish_reason"].is_string()) said.finish = text_of(choice, "finish_reason");
    if (choice.contains("logprobs") && choice["logprobs"].is_object())
      said.logprobs += choice["logprobs"]["content"].size();
  }
  return said;
}

// A thinking family's usage counts its thought's tokens (the markup and the
// newlines before the answer included), whole and streamed alike; all of
// them when it is cut inside the thought; other families report none.
TEST(HttpReasoning, UsageCountsTheThoughtsTokens) {
  std::vector<int> thought = tokenizer().encode("<think>\nLet me see: two and two.\n</think>\n\n", false);
  ASSERT_EQ(tokenizer().decode(100, thought[0]), " ") << "precondition: the first token is the space alone";
  thought.erase(thought.begin());
  const std::vector<int> answer = tokenizer().encode("Four.", false);
  std::vector<int> tokens = thought;
  tokens.insert(tokens.end(), answer.begin(), answer.end());
  auto reasoning_tokens = [](const json& usage) {
    return usage.contains("completion_tokens_details") ? usage["completion_tokens_details"].value("reasoning_tokens", -2)
                                                       : -1;
  };
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    const std::string body = std::string(R"({"messages": [{"role": "user", "content": "2+2?"}])") +
                             (stream ? R"(, "stream": true, "stream_options": {"include_usage": true})" : "") + "}";
    const Said said = generate_scripted(tokenizer(), parse(Endpoint::chat, body, ChatTemplate::qwen3), tokens);
    EXPECT_NE(said.content.find("Four."), std::string::npos) << said.content;
    EXPECT_EQ(said.usage["completion_tokens"], int64_t(tokens.size()));
    EXPECT_EQ(reasoning_tokens(said.usage), int64_t(thought.size())) << said.usage.dump();
    const std::vector<int> cut(thought.begin(), thought.end() - 3);  // (before </think>)
    const Said inside = generate_scripted(tokenizer(), parse(Endpoint::chat, body, ChatTemplate::qwen3), cut);
    EXPECT_EQ(reasoning_tokens(inside.usage), int64_t(cut.size())) << inside.usage.dump();
    const Said plain = generate_scripted(tokenizer(), parse(Endpoint::chat, body), tokens);
    EXPECT_EQ(reasoning_tokens(plain.usage), -1) << "not a thinking family: " << plain.usage.dump();
  }
}

// A stream's chunks carry their tokens' log probabilities and let them go,
// so a long stream holds a token's or two at a time (those whose text is
// held back); a whole reply holds every token's until it is built.
TEST(HttpLogprobs, AStreamLetsGoOfThoseItCarried) {
  const std::string text = "Once upon a time there was a little girl named Lily. She liked to play in the park.";
  const std::vector<int> tokens = tokenizer().encode(text, false);
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    const ApiRequest request =
        parse(Endpoint::chat, std::string(R"({"messages": [{"role": "user", "content": "A story"}], "logprobs": true)") +
                                  (stream ? R"(, "stream": true)" : "") + "}");
    size_t most = 0, last = 0;
    const Said said = generate_scripted(tokenizer(), request, tokens, [&](const Generation& g) {
      last = g.held_logprobs();
      most = std::max(most, last);
    });
    EXPECT_NE(said.content.find(text), std::string::npos) << said.content;
    EXPECT_EQ(said.logprobs, tokens.size()) << "every token's, once";
    if (stream) EXPECT_LE(most, 2u) << "held after they were sent";
    else EXPECT_EQ(last, tokens.size());
  }
  // Not asked for: none held (best_of sums what it ranks by as it goes).
  size_t held = 0;
  generate_scripted(tokenizer(), parse(Endpoint::chat, R"({"messages": [{"role": "user", "content": "A story"}]})"),
                    tokens, [&](const Generation& g) { held = std::max(held, g.held_logprobs()); });
  EXPECT_EQ(held, 0u);
}

// Tokens with no text to carry their log probabilities (a control token a
// logit_bias forces, text held back) keep them in a stream: at most the
// choice's share of what a whole reply may hold, then the stream ends with
// an error (they grew with max_tokens: gigabytes at long contexts).
TEST(HttpLogprobs, AStreamOfTokensWithoutTextHoldsNoMoreThanAReplyMay) {
  // (a thinking family's answer holds leading white space until its
  // thought opens or text begins: this vocabulary has no token without text)
  const int32_t kNoText = tokenizer().encode("\n\nOnce", false).front();
  ASSERT_EQ(tokenizer().decode(100, kNoText).find_first_not_of(" \n"), std::string::npos)
      << "precondition: white space alone";
  const ApiRequest request = parse(
      Endpoint::chat, R"({"messages": [{"role": "user", "content": "A story"}], "logprobs": true, "top_logprobs": 20,
                          "stream": true})", ChatTemplate::qwen3);
  const size_t bound = size_t(kMaxReplyLogprobs) / 21;  // (one choice, 21 log probabilities a token)
  caf::actor_system_config config;
  caf::actor_system system{config};
  RecordingSink sink;
  ServedModel served = model();
  const GenerationContext context{served, tokenizer(), metrics::disagg_metrics()};
  RequestId id = 0;
  Generation generation(context, sink, std::make_shared<Client>(system, router_actor{}), request, "chatcmpl-t",
                        [&](GenerateRequest r) { id = r.id; });
  generation.start();
  size_t fed = 0, most = 0;
  for (; fed < 2 * bound && !generation.done(); ++fed) {
    TokenEvent e;
    e.id = id;
    e.index = int32_t(fed);
    e.token = kNoText;
    e.logprobs = {-0.25f, {kNoText}, {-0.25f}};
    generation.on_token(id, e);
    most = std::max(most, generation.held_logprobs());
  }
  EXPECT_TRUE(generation.done()) << "the stream held " << most << " tokens' log probabilities";
  EXPECT_LE(most, bound + 1);
  // (no chunk went out yet: the error is the whole reply's; else in the stream, before [DONE])
  const std::string error = sink.events.empty() ? sink.error : sink.events[sink.events.size() - 2];
  EXPECT_NE(error.find("had no text to carry their log probabilities"), std::string::npos) << error;
}

// A thinking family's reply under tools: the reasoning goes apart
// (reasoning_content) and only what follows it is read for calls, vLLM's
// order: a call the model thinks about is no call, and the thinking never
// reached content (it did: the text went to the tool reader whole).
TEST(HttpReasoning, AThinkingFamilysToolCallsAreReadAfterItsReasoning) {
  const std::string text =
      "<think>\nI could call <tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call> here\n</think>\n\n"
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
  // (SentencePiece writes a space before the first word: that token left
  // out, the text starts at its "<" as a model's does)
  std::vector<int> tokens = tokenizer().encode(text, false);
  ASSERT_EQ(tokenizer().decode(100, tokens[0]), " ") << "precondition: the first token is the space alone";
  tokens.erase(tokens.begin());
  ASSERT_EQ(tokenizer().decode_all(100, tokens), text);
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    const std::string body = std::string(R"({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [)") +
                             kWeatherTool + "]" + (stream ? R"(, "stream": true)" : "") + "}";
    const ApiRequest request = parse(Endpoint::chat, body, ChatTemplate::qwen3);
    ASSERT_TRUE(request.tools.active());
    ASSERT_EQ(request.reasoning, gpu::ReasoningSyntax::qwen3);
    const Said said = generate_scripted(tokenizer(), request, tokens);
    EXPECT_NE(said.reasoning.find("I could call"), std::string::npos) << said.reasoning;
    EXPECT_EQ(said.content.find("think>"), std::string::npos) << said.content;
    EXPECT_EQ(said.names, std::vector<std::string>{"get_weather"});
  }
}

// A template that opens the thought in the prompt (Qwen3's thinking-only
// ones end with "<think>\n"): the reply is reasoning until </think>, streamed
// and whole alike; after a prompt that did not open it, a </think> in the
// reply is content both ways (the whole reply took it for reasoning while
// the stream, which cannot know, sent it all as content).
TEST(HttpReasoning, AThoughtOpenedByThePromptSplitsTheSameStreamedAndWhole) {
  ChatFormat opening(ChatTemplate::qwen3);
  opening.jinja = std::make_shared<const gpu::JinjaTemplate>(
      "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
      "<|im_start|>assistant\n<think>\n");
  const std::vector<int> tokens = tokenizer().encode("the user adds</think>\n\nFour", false);
  const std::string text = tokenizer().decode_all(100, tokens);
  ASSERT_EQ(text, " the user adds</think>\n\nFour");  // (SentencePiece's leading space)
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    const std::string body = std::string(R"({"messages": [{"role": "user", "content": "2+2?"}])") +
                             (stream ? R"(, "stream": true)" : "") + "}";
    const ApiRequest builtin = parse(Endpoint::chat, body, ChatTemplate::qwen3);  // (it opens none)
    const ApiRequest r = parse_request(Endpoint::chat, body, model(), tokenizer(), opening, [] { return uint64_t(42); });
    ASSERT_EQ(r.reasoning, gpu::ReasoningSyntax::qwen3);
    EXPECT_TRUE(r.thought_opened);
    EXPECT_FALSE(builtin.thought_opened);
    const Said in_thought = generate_scripted(tokenizer(), r, tokens);
    EXPECT_EQ(in_thought.reasoning, " the user adds");
    EXPECT_EQ(in_thought.content, "Four");
    const Said plain = generate_scripted(tokenizer(), builtin, tokens);
    EXPECT_EQ(plain.reasoning, "");
    EXPECT_EQ(plain.content, text);
  }
  // Under a grammar (a response_format, a required or named call) no
  // </think> can come: the output is content, the thought opened or not.
  const std::string formatted =
      R"({"messages": [{"role": "user", "content": "2+2?"}], "response_format": {"type": "json_object"}})";
  EXPECT_FALSE(parse_request(Endpoint::chat, formatted, model(), tokenizer(), opening, [] { return uint64_t(42); })
                   .thought_opened);
}

// A call marker that the vocabulary makes a control token (Mistral's
// [TOOL_CALLS]) has no text as other control tokens have none, so the calls
// after it were never found: under automatic tools it is written out, and
// only then (a reply without tools still skips it).
TEST(HttpTools, AMarkerThatIsAControlTokenIsWrittenOutUnderTools) {
  gpu::Vocabulary v = tokenizer().vocabulary();
  const std::string after = "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]";
  const std::vector<int> rest = tokenizer().encode(after, false);  // " [{...}]": SentencePiece's leading space
  const int marker = 511;
  ASSERT_EQ(std::count(rest.begin(), rest.end(), marker), 0) << "precondition: the call's text does not use the token";
  v.types.assign(v.pieces.size(), gpu::TokenType::normal);
  v.pieces[size_t(marker)] = "[TOOL_CALLS]";
  v.types[size_t(marker)] = gpu::TokenType::control;
  const gpu::Tokenizer t = gpu::Tokenizer::from_vocabulary(v, "mistral-like");
  ASSERT_EQ(t.encode("[TOOL_CALLS]", false), std::vector<int>{marker});
  std::vector<int> tokens = {marker};
  tokens.insert(tokens.end(), rest.begin(), rest.end());
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "whole");
    const std::string messages = R"({"messages": [{"role": "user", "content": "Weather in Paris?"}])";
    const std::string streamed = stream ? R"(, "stream": true)" : "";
    const ApiRequest with_tools = parse_request(Endpoint::chat, messages + R"(, "tools": [)" + kWeatherTool + "]" + streamed + "}",
                                                model(), t, ChatTemplate::mistral, [] { return uint64_t(42); });
    ASSERT_EQ(with_tools.tools.syntax, gpu::ToolSyntax::mistral);
    const Said called = generate_scripted(t, with_tools, tokens);
    EXPECT_EQ(called.names, std::vector<std::string>{"get_weather"}) << called.content;
    EXPECT_EQ(called.finish, "tool_calls");
    const ApiRequest plain = parse_request(Endpoint::chat, messages + streamed + "}", model(), t, ChatTemplate::mistral,
                                           [] { return uint64_t(42); });
    const Said text = generate_scripted(t, plain, tokens);
    EXPECT_EQ(text.content, t.decode_all(marker, rest)) << "without tools, control tokens have no text";
    EXPECT_TRUE(text.names.empty());
  }
}

// Qwen3's thinking: the reply's reasoning apart (reasoning_content), and
// chat_template_kwargs' enable_thinking passed to the template.
TEST(HttpReasoning, ThinkingFamiliesReplyWithReasoningApart) {
  const std::string body = R"({"messages": [{"role": "user", "content": "2+2?"}]})";
  const ApiRequest thinking = parse(Endpoint::chat, body, ChatTemplate::qwen3);
  EXPECT_EQ(thinking.reasoning, gpu::ReasoningSyntax::qwen3);
  EXPECT_EQ(parse(Endpoint::chat, body, ChatTemplate::qwen25).reasoning, gpu::ReasoningSyntax::none);
  const ApiRequest quiet = parse(
      Endpoint::chat, R"({"messages": [{"role": "user", "content": "2+2?"}], "chat_template_kwargs": {"enable_thinking": false}})",
      ChatTemplate::qwen3);
  auto text_of = [](const ApiRequest& r) {
    return tokenizer().decode_all(1, std::vector<int>(r.prompt_tokens.begin(), r.prompt_tokens.end()));
  };
  EXPECT_NE(text_of(quiet).find("<|im_start|>assistant\n<think>\n\n</think>\n\n"), std::string::npos) << text_of(quiet);
  EXPECT_EQ(text_of(thinking).find("</think>"), std::string::npos) << text_of(thinking);
  EXPECT_EQ(error_of(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3})").param,
            "chat_template_kwargs");

  const json choice = reasoned_choice_json(0, gpu::split_reasoning(gpu::ReasoningSyntax::qwen3, "<think>add</think>\n\n4"), "stop");
  EXPECT_EQ(choice["message"]["reasoning_content"], "add");
  EXPECT_EQ(choice["message"]["content"], "4");
  EXPECT_TRUE(reasoned_choice_json(0, {"", "4"}, "stop")["message"]["reasoning_content"].is_null());
  const json chunk = reasoned_chunk("c", 1, "m", 0, {"add", ""}, false);
  EXPECT_EQ(chunk["choices"][0]["delta"]["reasoning_content"], "add");
  EXPECT_FALSE(chunk["choices"][0]["delta"].contains("content"));
}

}  // namespace
}  // namespace disagg::http
