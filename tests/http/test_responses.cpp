// http/responses.h: the Responses API read as the chat request it stands
// for, and a chat reply (whole, or its stream's chunks) written back as a
// response object or the Responses stream's events. Through a cluster and
// the OpenAI clients: test_cluster HttpFrontend/AgentsSdk.*Responses*,
// HttpFrontend.OfficialOpenAiNodeClientResponses.
#include <gtest/gtest.h>

#include <set>

#include "http/api.h"
#include "http/responses.h"

namespace disagg::http {
namespace {

using ojson = nlohmann::ordered_json;

ojson chat_of(const std::string& responses_body) { return ojson::parse(chat_body_of_responses(responses_body)); }

ApiError error_of(const std::string& responses_body) {
  try {
    chat_body_of_responses(responses_body);
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no error for " << responses_body;
  return {};
}

TEST(Responses, ARequestIsTheChatRequestItStandsFor) {
  const ojson chat = chat_of(R"({
    "model": "m", "instructions": "Be brief.", "max_output_tokens": 50, "temperature": 0, "stream": true,
    "input": [
      {"role": "developer", "content": "Use tools."},
      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}]},
      {"type": "reasoning", "id": "rs_1", "summary": []},
      {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
      {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "call_a", "output": "18 C"},
      {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "noon"}]},
      {"role": "assistant", "content": [{"type": "output_text", "text": "It is 18 C.", "annotations": []}]}],
    "tools": [{"type": "function", "name": "get_weather", "description": "d", "parameters": {"type": "object", "properties": {"z": {}, "a": {}}}, "strict": true}],
    "tool_choice": {"type": "function", "name": "get_weather"},
    "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"}, "strict": true}},
    "store": false, "include": [], "truncation": "disabled"})");
  const ojson expected_messages = ojson::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
      {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
    {"role": "assistant", "content": "It is 18 C."}])");
  EXPECT_EQ(chat["messages"], expected_messages) << chat["messages"].dump(1);
  EXPECT_EQ(chat["max_tokens"], 50);
  EXPECT_EQ(chat["temperature"], 0);
  EXPECT_EQ(chat["model"], "m");
  EXPECT_EQ(chat["stream_options"]["include_usage"], true);
  EXPECT_EQ(chat["tools"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(chat["tools"][0]["function"]["strict"], true);
  // (a schema keeps its keys' order: properties are generated in it)
  EXPECT_EQ(chat["tools"][0]["function"]["parameters"]["properties"].begin().key(), "z");
  EXPECT_EQ(chat["tool_choice"], ojson::parse(R"({"type": "function", "function": {"name": "get_weather"}})"));
  EXPECT_EQ(chat["response_format"]["type"], "json_schema");
  EXPECT_EQ(chat["response_format"]["json_schema"]["name"], "answer");
  EXPECT_FALSE(chat.contains("store"));
  // A string input is one user message; plain text and json_object formats.
  const ojson simple = chat_of(R"({"input": "hi", "text": {"format": {"type": "text"}}})");
  EXPECT_EQ(simple["messages"], ojson::parse(R"([{"role": "user", "content": "hi"}])"));
  EXPECT_FALSE(simple.contains("response_format"));
  EXPECT_FALSE(simple.contains("stream_options"));
  EXPECT_EQ(chat_of(R"({"input": "hi", "text": {"format": {"type": "json_object"}}})")["response_format"]["type"],
            "json_object");
  // A turn's text and its calls after it (the reasoning between them left
  // out) are one assistant message, as the model wrote them.
  const ojson turn = chat_of(R"({"input": [{"role": "user", "content": "Weather?"},
      {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]},
      {"type": "reasoning", "id": "rs_1", "summary": []},
      {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": "{}"}]})");
  ASSERT_EQ(turn["messages"].size(), 2u) << turn.dump(1);
  EXPECT_EQ(turn["messages"][1]["content"], "Let me check.");
  EXPECT_EQ(turn["messages"][1]["tool_calls"][0]["id"], "call_a");
  // Responses' successors of user (the router's session affinity key).
  EXPECT_EQ(chat_of(R"({"input": "hi", "prompt_cache_key": "s1"})")["user"], "s1");
  EXPECT_EQ(chat_of(R"({"input": "hi", "user": "u", "prompt_cache_key": "s1"})")["user"], "u");
  // A stream that is not a boolean goes on to chat's check (a 400 there, not an exception here).
  EXPECT_EQ(chat_of(R"({"input": "hi", "stream": "yes"})")["stream"], "yes");
  // Log probabilities: include's message.output_text.logprobs, top_logprobs alternatives.
  const ojson lp = chat_of(R"({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 3})");
  EXPECT_EQ(lp["logprobs"], true);
  EXPECT_EQ(lp["top_logprobs"], 3);
  EXPECT_FALSE(chat_of(R"({"input": "hi", "top_logprobs": 3})").contains("logprobs"));
  // Not JSON: passed on as it is (parse_request reports it as for any endpoint).
  EXPECT_EQ(chat_body_of_responses("{not json"), "{not json");
}

TEST(Responses, WhatNeedsStoredStateOrOtherToolsIsA400NamingTheField) {
  EXPECT_EQ(error_of(R"({"input": "hi", "previous_response_id": "resp_1"})").param, "previous_response_id");
  EXPECT_EQ(error_of(R"({"input": "hi", "conversation": "conv_1"})").param, "conversation");
  EXPECT_EQ(error_of(R"({"input": "hi", "background": true})").param, "background");
  EXPECT_EQ(error_of(R"({"model": "m"})").code, "missing");
  EXPECT_EQ(error_of(R"({"input": 3})").param, "input");
  const ApiError image = error_of(R"({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})");
  EXPECT_EQ(image.param, "input[0].content");
  EXPECT_EQ(image.code, "unsupported");
  EXPECT_EQ(error_of(R"({"input": [{"type": "web_search_call", "id": "w"}]})").param, "input[0]");
  EXPECT_EQ(error_of(R"({"input": [{"type": "function_call", "call_id": "c"}]})").param, "input[0]");
  EXPECT_EQ(error_of(R"({"input": "hi", "tools": [{"type": "web_search"}]})").param, "tools[0]");
  EXPECT_EQ(error_of(R"({"input": "hi", "tool_choice": {"type": "file_search"}})").param, "tool_choice");
  EXPECT_EQ(error_of(R"({"input": "hi", "text": {"format": {"type": "grammar"}}})").param, "text.format");
  EXPECT_EQ(error_of(R"({"input": "hi", "instructions": 7})").param, "instructions");
  // The chat request's own 400s name the Responses field.
  ApiError chat = bad_request("messages[3].content", "x");
  EXPECT_EQ(as_responses_error(chat).param, "input");
  chat.param = "max_tokens";
  EXPECT_EQ(as_responses_error(chat).param, "max_output_tokens");
  chat.param = "response_format.json_schema.schema";
  EXPECT_EQ(as_responses_error(chat).param, "text.format");
  chat.param = "temperature";
  EXPECT_EQ(as_responses_error(chat).param, "temperature");
}

// What a response writes to its connection.
class Recording : public ReplySink {
 public:
  void reply_json(int s, const json& body) override {
    status = s;
    whole = body;
  }
  void reply_error(const ApiError& e) override { error = e.message; }
  void open_events() override { opened = true; }
  void event(std::string data) override { events.push_back(std::move(data)); }
  void end_events() override { ended = true; }
  int status = 0;
  json whole;
  std::string error;
  bool opened = false, ended = false;
  std::vector<std::string> events;
  // The events' types and data (each "event: T\ndata: {...}\n\n").
  std::vector<json> data() const {
    std::vector<json> out;
    for (const std::string& e : events) {
      const size_t at = e.find("\ndata: ");
      EXPECT_EQ(e.rfind("event: ", 0), 0u) << e;
      EXPECT_NE(at, std::string::npos) << e;
      const json d = json::parse(e.substr(at + 7));
      EXPECT_EQ(e.substr(7, at - 7), d["type"].get<std::string>()) << e;
      out.push_back(d);
    }
    return out;
  }
};

const char* kRequest = R"({"input": "Weather?", "instructions": "Be brief.", "tools": [{"type": "function", "name": "get_weather"}], "temperature": 0.5})";

TEST(Responses, AWholeChatReplyIsAResponseObject) {
  Recording out;
  ResponsesSink sink(out, "resp_abc", 1700000000, "m", kRequest);
  sink.reply_json(200, json::parse(R"({"id": "chatcmpl-1", "object": "chat.completion", "choices": [{"index": 0,
      "message": {"role": "assistant", "content": "Let me look.", "reasoning_content": "The user wants weather.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
      "finish_reason": "tool_calls"}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29, "prompt_tokens_details": {"cached_tokens": 16},
              "completion_tokens_details": {"reasoning_tokens": 6}}})"));
  ASSERT_EQ(out.status, 200);
  const json& r = out.whole;
  EXPECT_EQ(r["id"], "resp_abc");
  EXPECT_EQ(r["object"], "response");
  EXPECT_EQ(r["created_at"], 1700000000);
  EXPECT_EQ(r["status"], "completed");
  EXPECT_EQ(r["model"], "m");
  EXPECT_EQ(r["instructions"], "Be brief.");
  EXPECT_EQ(r["temperature"], 0.5);
  EXPECT_EQ(r["tool_choice"], "auto");
  EXPECT_EQ(r["tools"][0]["name"], "get_weather");
  ASSERT_EQ(r["output"].size(), 3u) << r.dump(1);
  EXPECT_EQ(r["output"][0]["type"], "reasoning");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "The user wants weather.");
  EXPECT_EQ(r["output"][1]["type"], "message");
  EXPECT_EQ(r["output"][1]["role"], "assistant");
  EXPECT_EQ(r["output"][1]["content"][0]["type"], "output_text");
  EXPECT_EQ(r["output"][1]["content"][0]["text"], "Let me look.");
  EXPECT_EQ(r["output"][2]["type"], "function_call");
  EXPECT_EQ(r["output"][2]["call_id"], "call_1");
  EXPECT_EQ(r["output"][2]["name"], "get_weather");
  EXPECT_EQ(r["output"][2]["arguments"], "{\"city\":\"Paris\"}");
  std::set<std::string> ids;
  for (const json& item : r["output"]) ids.insert(item["id"].get<std::string>());
  EXPECT_EQ(ids.size(), 3u) << "items share an id";
  EXPECT_EQ(r["usage"], json::parse(R"({"input_tokens": 20, "input_tokens_details": {"cached_tokens": 16},
      "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 6}, "total_tokens": 29})"));
  // Log probabilities (chat's logprobs.content) go with the text.
  Recording lp;
  ResponsesSink lp_sink(lp, "resp_lp", 1, "m", R"({"input": "x"})");
  const json entries = json::parse(R"([{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []},
                                       {"token": "b", "logprob": -1.5, "bytes": [98], "top_logprobs": []}])");
  lp_sink.reply_json(200, {{"choices", json::array({{{"message", {{"content", "ab"}}}, {"logprobs", {{"content", entries}}},
                                                     {"finish_reason", "stop"}}})}});
  EXPECT_EQ(lp.whole["output"][0]["content"][0]["logprobs"], entries);
  // With reasoning (or calls) the tokens' log probabilities are not the text's alone: none.
  Recording thought;
  ResponsesSink thought_sink(thought, "resp_t", 1, "m", R"({"input": "x"})");
  thought_sink.reply_json(200, {{"choices", json::array({{{"message", {{"content", "ab"}, {"reasoning_content", "hm"}}},
                                                         {"logprobs", {{"content", entries}}}, {"finish_reason", "stop"}}})}});
  EXPECT_EQ(thought.whole["output"][1]["content"][0]["logprobs"], json::array());
  // Cut by max_output_tokens: incomplete, saying why.
  Recording cut;
  ResponsesSink cut_sink(cut, "resp_c", 1, "m", R"({"input": "x", "max_output_tokens": 2})");
  cut_sink.reply_json(200, json::parse(R"({"choices": [{"message": {"content": "ab"}, "finish_reason": "length"}],
      "usage": {"prompt_tokens": 1, "completion_tokens": 2}})"));
  EXPECT_EQ(cut.whole["status"], "incomplete");
  EXPECT_EQ(cut.whole["incomplete_details"]["reason"], "max_output_tokens");
  EXPECT_EQ(cut.whole["max_output_tokens"], 2);
}

std::string chunk(const std::string& delta, const std::string& finish = "") {
  json c = {{"object", "chat.completion.chunk"},
            {"choices", json::array({{{"index", 0}, {"delta", json::parse(delta)},
                                      {"finish_reason", finish.empty() ? json(nullptr) : json(finish)}}})}};
  return sse_event(c);
}

TEST(Responses, AChatStreamIsTheResponsesStreamsEvents) {
  Recording out;
  ResponsesSink sink(out, "resp_s", 5, "m", kRequest);
  sink.open_events();
  sink.event(chunk(R"({"role": "assistant", "content": ""})"));
  sink.event(chunk(R"({"reasoning_content": "hm"})"));
  sink.event(chunk(R"({"content": "Let "})"));
  sink.event(chunk(R"({"content": "me."})"));
  sink.event(chunk(R"({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]})"));
  sink.event(chunk(R"({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]})"));
  sink.event(chunk(R"({"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]})"));
  sink.event(chunk(R"({})", "tool_calls"));
  sink.event(sse_event(json::parse(R"({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}})")));
  sink.event(kSseDone);
  sink.end_events();
  EXPECT_TRUE(out.opened);
  EXPECT_TRUE(out.ended);
  const std::vector<json> events = out.data();
  std::vector<std::string> types;
  for (size_t i = 0; i < events.size(); ++i) {
    types.push_back(events[i]["type"]);
    EXPECT_EQ(events[i]["sequence_number"], int64_t(i));
  }
  const std::vector<std::string> expected = {
      "response.created", "response.in_progress",
      "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done", "response.output_item.done",
      "response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
      "response.output_text.done", "response.content_part.done", "response.output_item.done",
      "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
      "response.function_call_arguments.done", "response.output_item.done", "response.completed"};
  EXPECT_EQ(types, expected);
  const json& done = events.back()["response"];
  EXPECT_EQ(done["status"], "completed");
  ASSERT_EQ(done["output"].size(), 3u) << done.dump(1);
  EXPECT_EQ(done["output"][0]["content"][0]["text"], "hm");
  EXPECT_EQ(done["output"][1]["content"][0]["text"], "Let me.");
  // An item as it opens is its fields in progress, nothing of ours.
  const json added = events[6]["item"];
  EXPECT_EQ(added, json::parse(R"({"type": "message", "id": "msg_s_1", "status": "in_progress", "role": "assistant", "content": []})"));
  EXPECT_EQ(done["output"][2]["arguments"], "{\"city\":\"Oslo\"}");
  EXPECT_EQ(done["output"][2]["status"], "completed");
  EXPECT_EQ(done["usage"]["output_tokens"], 4);
  // Each item as it ended is the item in the final response.
  for (const json& e : events)
    if (e["type"] == "response.output_item.done") EXPECT_EQ(e["item"], done["output"][e["output_index"].get<size_t>()]);
  // The text's deltas add up to its done text.
  EXPECT_EQ(events[10]["text"], "Let me.");
}

// Streamed log probabilities: each delta's, and all of them at the end.
TEST(Responses, StreamedLogProbabilitiesGoWithTheirDeltas) {
  Recording out;
  ResponsesSink sink(out, "resp_p", 5, "m", R"({"input": "x"})");
  sink.open_events();
  auto with_logprobs = [](const std::string& piece, const std::string& token, const std::string& finish = "") {
    json c = json::parse(chunk(json({{"content", piece}}).dump(), finish).substr(6));
    c["choices"][0]["logprobs"] = {{"content", json::array({{{"token", token}, {"logprob", -1.0}}})}};
    return sse_event(c);
  };
  sink.event(with_logprobs("a", "a"));
  sink.event(with_logprobs("", "\xe2"));  // (a token whose text waits for the next one's)
  sink.event(with_logprobs("b", "b", "stop"));
  sink.end_events();
  const std::vector<json> events = out.data();
  std::vector<json> delta_logprobs;
  for (const json& e : events)
    if (e["type"] == "response.output_text.delta") delta_logprobs.push_back(e["logprobs"]);
  ASSERT_EQ(delta_logprobs.size(), 2u);
  EXPECT_EQ(delta_logprobs[0][0]["token"], "a");
  const json& final_part = events.back()["response"]["output"][0]["content"][0];
  ASSERT_EQ(final_part["logprobs"].size(), 3u) << final_part;
  EXPECT_EQ(final_part["logprobs"][2]["token"], "b");
  // After reasoning, none (its tokens' and the </think>'s would come with the text's).
  Recording thought;
  ResponsesSink thought_sink(thought, "resp_q", 5, "m", R"({"input": "x"})");
  thought_sink.open_events();
  thought_sink.event(chunk(R"({"reasoning_content": "hm"})"));
  thought_sink.event(with_logprobs("a", "</think>a", "stop"));
  thought_sink.end_events();
  const std::vector<json> thought_events = thought.data();
  for (const json& e : thought_events)
    if (e["type"] == "response.output_text.delta") EXPECT_EQ(e["logprobs"], json::array()) << e;
  EXPECT_EQ(thought_events.back()["response"]["output"][1]["content"][0]["logprobs"], json::array());
}

// Cut by max_output_tokens: the item cut short and the response are incomplete.
TEST(Responses, AStreamCutByMaxOutputTokensIsIncomplete) {
  Recording out;
  ResponsesSink sink(out, "resp_l", 5, "m", R"({"input": "x", "max_output_tokens": 2})");
  sink.open_events();
  sink.event(chunk(R"({"content": "ab"})"));
  sink.event(chunk(R"({})", "length"));
  sink.event(kSseDone);
  sink.end_events();
  const std::vector<json> events = out.data();
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back()["type"], "response.incomplete");
  EXPECT_EQ(events.back()["response"]["incomplete_details"]["reason"], "max_output_tokens");
  EXPECT_EQ(events.back()["response"]["output"][0]["status"], "incomplete");
  EXPECT_EQ(events[events.size() - 2]["item"]["status"], "incomplete");
}

TEST(Responses, AnErrorAfterTheStreamBeganFailsTheResponse) {
  Recording out;
  ResponsesSink sink(out, "resp_e", 5, "m", R"({"input": "x"})");
  sink.open_events();
  sink.event(chunk(R"({"content": "par"})"));
  sink.event(sse_event(json::parse(R"({"error": {"message": "the worker was lost", "type": "server_error", "code": "worker_lost", "param": null}})")));
  sink.event(kSseDone);
  sink.end_events();
  const std::vector<json> events = out.data();
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events.back()["type"], "response.failed");
  EXPECT_EQ(events.back()["response"]["status"], "failed");
  EXPECT_EQ(events.back()["response"]["error"]["code"], "worker_lost");
  bool error_event = false;
  for (const json& e : events) error_event |= e["type"] == "error" && e["message"] == "the worker was lost";
  EXPECT_TRUE(error_event);
  EXPECT_EQ(events.back()["response"]["output"][0]["status"], "incomplete") << "a message cut by the error";
}

}  // namespace
}  // namespace disagg::http
