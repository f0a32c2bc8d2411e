// OpenAI's Responses API (POST /v1/responses), served through the chat
// completions path: a request is read as the chat request it stands for,
// and the chat reply, whole or streamed, is written back as a response
// object or as the Responses stream's events. Stateless: nothing is stored,
// so what needs a stored response (previous_response_id, conversation, a
// stored prompt) is refused.
//
//   request                                  chat request
//   input: "text"                            messages: [{user, "text"}]
//   input: [items]                           messages: one per item
//     {role, content: "..." | [input_text | output_text parts]}   {role, content} (developer: system)
//     {type: function_call, call_id, name, arguments}              an assistant message's tool_calls
//     {type: function_call_output, call_id, output}                {role: tool, tool_call_id, content}
//     {type: reasoning}                                            (left out: the template writes none back)
//   instructions                             a first system message
//   max_output_tokens                        max_tokens
//   tools: [{type: function, name, ...}]     tools: [{type: function, function: {name, ...}}]
//   tool_choice {type: function, name}       tool_choice {type: function, function: {name}}
//   text.format json_schema / json_object    response_format
//   temperature, top_p, seed, user, parallel_tool_calls, stream: as they are
//   include: [message.output_text.logprobs], top_logprobs   logprobs: true, top_logprobs
//
//   chat reply                               response.output
//   message.reasoning_content                {type: reasoning, summary: [], content: [reasoning_text]}
//   message.content                          {type: message, role: assistant, content: [output_text]}
//   message.tool_calls[i]                    {type: function_call, call_id, name, arguments}
//   finish_reason "length"                   status "incomplete", incomplete_details.reason max_output_tokens
//
// Streamed, the chat chunks become response.created, response.in_progress,
// then per output item response.output_item.added, its deltas
// (response.reasoning_text.delta, response.output_text.delta with
// response.content_part.added/done around them,
// response.function_call_arguments.delta) and .done events, and at the end
// response.completed (or response.incomplete) carrying the whole response;
// an error after the stream began: an error event, then response.failed.
#pragma once
#include <cstdint>
#include <map>
#include <string>

#include "http/api.h"
#include "http/generation.h"

namespace disagg::http {

// The chat completions body (its text) that a Responses request body
// stands for; the fields chat does not know are left out. Throws ApiError
// (400) naming the Responses field: not JSON, input or tools of the wrong
// shape, an input item or tool type other than the ones above, stored state.
std::string chat_body_of_responses(const std::string& responses_body);

// A 400 of the chat request (parse_request) naming the Responses field it
// came from: messages -> input (an item of it may have become two
// messages, or none: the whole of it is named), max_tokens ->
// max_output_tokens, response_format -> text.format.
ApiError as_responses_error(ApiError e);

// A generation's reply (a chat reply, http/generation.h) written to `out`
// as the response `id` to the Responses request `request` (its body).
class ResponsesSink : public ReplySink {
 public:
  ResponsesSink(ReplySink& out, std::string id, int64_t created_at, std::string model, const std::string& request);

  void reply_json(int status, const json& chat_reply) override;
  void reply_error(const ApiError& e) override { out_.reply_error(e); }
  void open_events() override;
  void event(std::string data) override;
  void end_events() override;

 private:
  enum class Open { none, reasoning, message, call };
  json response(const std::string& status) const;  // the response object as it stands
  void emit(const std::string& type, json fields);
  void add_item(json item, Open open);  // an output item, in progress
  void close_item(const char* status);  // the open one, done ("completed", or "incomplete": cut short)
  void on_chunk(const json& chunk);

  ReplySink& out_;
  std::string id_;
  int64_t created_at_;
  std::string model_;
  json request_;  // the fields a response echoes
  json output_ = json::array();
  json usage_;
  std::string finish_;  // the chat choice's finish_reason
  json error_;          // an in-band error's body
  Open open_ = Open::none;
  std::string text_;                 // the open message's text so far
  json logprobs_ = json::array();    // and its tokens' log probabilities
  bool text_alone_ = true;           // no reasoning or call so far (log probabilities align with the text)
  std::map<int, size_t> calls_;  // a chat tool call's index -> its output item
  int64_t sequence_ = 0;
};

}  // namespace disagg::http
