// The OpenAI-compatible API of the frontend, without the network: parsing and
// validating request bodies (nlohmann-json), the chat template, stop strings
// and text assembly from token events, response and error bodies, and how the
// protocol's error codes map onto HTTP statuses. http/server.cpp serves these.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpu/json_fields.h"
#include "text/tokenizer.h"
#include "text/chat_template.h"
#include "text/reasoning.h"
#include "text/tool_calls.h"
#include "messages/request.h"

namespace disagg::http {

using json = nlohmann::json;
using gpu::ChatFormat;
using gpu::ChatTemplate;

// max_tokens of a completion that sets none (OpenAI's legacy default; vLLM's too).
constexpr int kDefaultCompletionMaxTokens = 16;
// The largest sampling temperature accepted (disagg-client's limit too).
constexpr double kMaxTemperature = 100.0;
// Bounds on a request body beyond node.http-body-limit, checked while it is
// parsed or before a field is used (README, security):
// - containers nested deeper than this: 400 invalid_json, found during the
//   parse (nothing deeper is built; OpenAI's shapes nest 4 deep, a
//   response_format JSON schema rarely 20);
constexpr int kMaxJsonDepth = 64;
// - objects of more members than this: the same (OpenAI's bound on a
//   structured output schema's properties; a key-ordered parse, which JSON
//   schemas, tools and chat templates need, looks each key up in a list:
//   quadratic in an object's members, a 1 MiB body of 5,000-member objects
//   0.6 s on a Zen 3, of 20,000-member ones 1.3 s, unbounded ones more);
constexpr size_t kMaxJsonMembers = 5000;
// JSON text of a request (its body, or a string field that holds JSON: a tool
// call's arguments, guided_json) parsed with those bounds, since what walks it
// later (dump, copies, the schema compiler) recurses: a JSON text nested
// 300,000 deep in a string of 600 KB overflowed the stack. Throws
// JsonOutOfBounds past a bound (what(): "nests deeper ..." or "holds an object ..."), json::exception when it is
// not JSON.
struct JsonOutOfBounds : std::runtime_error {
  using std::runtime_error::runtime_error;
};
json parse_json_limited(const std::string& text);
// The same, keeping objects' keys in the text's order (a JSON schema's
// properties are written in it).
nlohmann::ordered_json parse_ordered_json_limited(const std::string& text);
// - an error message quotes at most this many bytes of an offending value;
constexpr size_t kMaxQuotedBytes = 64;
// - more stop strings than this, or one longer than kMaxStopBytes: 400 (each
//   is searched after every token, its prefixes held back).
constexpr size_t kMaxStopStrings = 16;
constexpr size_t kMaxStopBytes = 256;

// The most choices a request may ask for (n, best_of): kMaxChoices
// (messages/request.h), each a request of its own to the router.

// The most log probabilities (each token's and its alternatives') a whole
// reply may carry: it is built in memory, ~0.5 KB each as a JSON tree (n =
// 16, top_logprobs = 20 and a long max_tokens asked for gigabytes). A
// request that could exceed it, max(n, best_of) x (max_tokens + echoed
// prompt) x (top_logprobs + 1), is refused (400) unless streamed; best_of's
// samples all count (each is held until the best are known), and so does a
// stream under tools (its log probabilities come with the calls, at the end).
// A stream's other chunks carry theirs and let them go.
constexpr int64_t kMaxReplyLogprobs = int64_t(1) << 20;
struct ApiRequest;
// That bound on `r` (parse_request applies it unless streamed as above; a reply that
// keeps a stream's log probabilities whole, /v1/responses', too): a
// defaulted max_tokens lowered to what fits, else a 400. No-op without
// log probabilities.
void fit_reply_logprobs(ApiRequest& r);

// An error reply: {"error": {"message", "type", "param", "code"}} with `status`.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
  int retry_after_s = 0;  // > 0: a Retry-After header (503 overloaded)
};
json error_body(const ApiError& e);
ApiError bad_request(const std::string& param, const std::string& message, const std::string& code = "invalid_value");

// The terminal error of a request (a RequestOutcome's code) as an HTTP error:
// invalid_request and kv_too_large 400, overloaded 503 (Retry-After),
// timeout 504, worker_lost, incompatible_kv, internal and cancelled 500.
ApiError error_for_outcome(ErrorCode code, const std::string& message);
// Seconds a client is told to wait after an overloaded reply.
constexpr int kOverloadedRetryAfterS = 1;

enum class Endpoint { completions, chat };

// What the frontend serves.
struct ServedModel {
  std::string name;          // the "model" of requests and /v1/models
  int32_t vocab_size = 0;
  int32_t seq_len = 0;       // context: prompt + max_tokens must fit
  int64_t max_prompt_bytes = 0;  // longest text prompt encoded (disagg.max-prompt-bytes)
  int64_t created = 0;       // unix time the frontend started
};

// Tools on /v1/chat/completions (OpenAI's shapes): what the request allows
// and how its reply is read. none: no tools (or tool_choice "none"); auto:
// the output is parsed for the family's call syntax (text/tool_calls.h);
// required: the output is generated as a JSON array of calls
// [{"name", "arguments"}] under the tools' schemas; named: as the named
// function's arguments under its schema.
struct ToolUse {
  enum class Choice { none, automatic, required, named } choice = Choice::none;
  std::string name;  // named: the function
  gpu::ToolSyntax syntax = gpu::ToolSyntax::none;
  // automatic: the call markers that are control tokens of this vocabulary
  // (Mistral's [TOOL_CALLS], Llama 3's <|python_tag|>), written out in the
  // reply's text so that the calls can be read (control tokens have no text
  // otherwise; vLLM's tool parsers turn skip_special_tokens off for them).
  std::vector<int32_t> marker_tokens;
  bool active() const { return choice != Choice::none; }
};

// The most tools a request may define (vLLM has no bound; OpenAI's is 128).
constexpr size_t kMaxTools = 128;

struct ApiRequest {
  Endpoint endpoint = Endpoint::completions;
  ToolUse tools;
  // chat with a thinking family's template (qwen3): the reply's reasoning
  // apart from its content (text/reasoning.h).
  gpu::ReasoningSyntax reasoning = gpu::ReasoningSyntax::none;
  bool thought_opened = false;  // the rendered prompt ends inside a thought (gpu::prompt_opens_thought)
  std::vector<int32_t> prompt_tokens;
  int32_t max_tokens = 0;
  bool max_tokens_defaulted = false;  // chat without max_tokens: the rest of the context, as much as fits
  Sampling sampling;  // of choice 0; choice i samples with gpu::sample_seed(seed, i)
  // n choices returned; best_of >= n sampled, the n of highest cumulative log
  // probability returned (not streamed).
  int32_t n = 1;
  int32_t best_of = 1;
  int32_t logprobs = -1;  // what the reply shows (Sampling::logprobs may be more: best_of computes them)
  // completions' echo: the text starts with the prompt (echo_text: as sent,
  // or its tokens' text), and with logprobs so do the log probabilities
  // (Sampling::prompt_logprobs; not streamed).
  bool echo = false;
  std::string echo_text;
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;
  std::string user;  // the router's session affinity key
  std::string cache_salt;  // GenerateRequest::cache_salt
  // vLLM's return_token_ids: each choice (and each streamed chunk) carries
  // the ids of the completion's tokens ("token_ids"), so that a client can
  // resend a conversation as the very tokens it was made of.
  bool return_token_ids = false;
};

// Parses and validates a request body; throws ApiError and nothing else:
// malformed JSON (also numbers beyond a double, nesting beyond kMaxJsonDepth,
// invalid UTF-8), a known field of the wrong type, shape or range,
// unsupported options (chat's echo, response_format other than text), sampling controls out of range (gpu::check_sampling's rules, named
// by their parameter), prompt + max_tokens beyond the
// context (400, naming the parameter), an unknown model (404). Unknown fields
// are ignored. `random_seed` gives the seed of a request that sets none.
ApiRequest parse_request(Endpoint endpoint, const std::string& body, const ServedModel& model,
                         const gpu::Tokenizer& tokenizer, const ChatFormat& chat,
                         const std::function<uint64_t()>& random_seed);

// Turns a request's token events into text: each token's piece after its
// predecessor (the first after the prompt's last token, as disagg-generate
// does), held back while it could be the start of a stop string or ends in
// an incomplete UTF-8 character; cut before the first stop string. The
// control tokens in `shown` are written as their pieces (ToolUse::marker_tokens).
class TextAssembler {
 public:
  TextAssembler(const gpu::Tokenizer& tokenizer, std::vector<std::string> stop, int32_t last_prompt_token,
                std::vector<int32_t> shown = {});
  // The token's text, returns what may be sent now (possibly empty).
  std::string add(int32_t token);
  // Whatever is held back, at the end of a request that did not stop.
  std::string flush();
  bool stopped() const { return stopped_; }
  int32_t tokens() const { return tokens_; }
  const std::string& text() const { return text_; }  // everything returned so far

 private:
  std::string release(size_t upto);
  const gpu::Tokenizer& tokenizer_;
  std::vector<std::string> stop_;
  std::vector<int32_t> shown_;
  int32_t previous_;
  std::string pending_;  // decoded, not yet returned
  std::string text_;
  bool stopped_ = false;
  int32_t tokens_ = 0;
};

// The response bodies (OpenAI's shapes). finish_reason: "stop" or "length";
// an empty string writes null.
// cached_tokens: of the prompt, in the prefix cache (usage.prompt_tokens_details.cached_tokens, as vLLM);
// reasoning_tokens: of the completion, its thoughts' (completion_tokens_details.reasoning_tokens, as
// OpenAI's; a chat request of a thinking family), or -1: not reported.
json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens = 0,
                int64_t reasoning_tokens = -1);
// One choice: completions {index, text, logprobs: null, finish_reason}; chat
// {index, message: {role: "assistant", content}, logprobs: null, finish_reason}.
json choice_json(Endpoint endpoint, int index, const std::string& text, const std::string& finish_reason);
// A chat choice's message with its reasoning apart ("reasoning_content",
// null when there is none), as vLLM's reasoning parsers reply.
json reasoned_choice_json(int index, const gpu::Reasoned& text, const std::string& finish_reason);
// A streamed chat chunk whose delta carries reasoning_content and/or content.
json reasoned_chunk(const std::string& id, int64_t created, const std::string& model, int index,
                    const gpu::Reasoned& piece, bool include_usage);
// What a choice's text says under its request's tools: calls (and the text
// around them), or content alone. `finish_reason` becomes "tool_calls" when
// the calls are whole.
struct ToolReply {
  std::string content;
  std::vector<gpu::ToolCall> calls;
  std::string finish_reason;
  std::string reasoning;  // a thinking family's reasoning, split off before the calls were read (vLLM's order)
};

// A chat choice's text under tools, read as it comes (streamed) or whole
// (read_tool_calls, the same reading): what it is sure of goes out at once,
// the rest when the choice ends, so what a stream sent is what the reply says.
//   named:    the call's head with the first text, then every piece as its
//             arguments (the text as generated). It is the call however the
//             choice ends; finish "tool_calls" when it is a whole object, else
//             the choice's ("length": arguments cut short, as OpenAI's).
//   required: each call as its element of the array [{"name", "arguments"},
//             ...] ends (arguments parsed and written again); cut short, the
//             calls whose element ended, finish "length"; no call: content.
//   auto:     content until the family's call markup may begin (a tail that
//             may be its start is held back), the rest read whole at the end
//             (text/tool_calls.h): calls (the reply's content is the text
//             before them, trimmed), or content; cut short: content.
class ToolStream {
 public:
  struct Delta {
    enum class Kind { content, call, arguments } kind;
    std::string text;  // content; call: the function's name; arguments: a piece
    size_t index = 0;  // call, arguments: the call's
  };
  explicit ToolStream(const ToolUse& tools);
  std::vector<Delta> add(const std::string& piece);
  // The choice ended with `finish_reason` ("stop" / "length"): the reply;
  // the deltas the stream still owes are appended to `deltas`.
  ToolReply finish(const std::string& finish_reason, std::vector<Delta>& deltas);

 private:
  void scan_array(std::vector<Delta>& out);
  void add_call(gpu::ToolCall call, std::vector<Delta>& out);

  ToolUse tools_;
  std::string text_;             // all of it so far
  std::vector<gpu::ToolCall> calls_;  // sent
  bool head_sent_ = false;       // named
  size_t streamed_ = 0;          // auto: text_ sent as content up to here
  bool held_ = false;            // auto: the call markup began (the rest waits for the end)
  // required: the array read so far (string-aware bracket depth)
  size_t scanned_ = 0, element_ = 0;
  int depth_ = 0;
  bool in_string_ = false, escaped_ = false, closed_ = false, broken_ = false;
};

ToolReply read_tool_calls(const ToolUse& tools, const std::string& text, const std::string& finish_reason);
// A chat choice's message with tool_calls [{id, type, function: {name,
// arguments}}] (ids: id_prefix + index), content null when empty.
json tool_choice_json(int index, const ToolReply& reply, const std::string& id_prefix);
// A delta as a streamed chunk: {"content"}, or {"tool_calls": [{index, id,
// type, function: {name, arguments: ""}}]} for a call's head, then
// {"tool_calls": [{index, function: {arguments}}]} for its pieces.
json tool_delta_chunk(const std::string& id, int64_t created, const std::string& model, int index,
                      const ToolStream::Delta& delta, const std::string& id_prefix, bool include_usage);
// A reply ("text_completion" or "chat.completion") with its choices (choice_json) and usage.
json response_json(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model, json choices,
                   int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens = 0,
                   int64_t reasoning_tokens = -1);
// One streamed chunk of choice `index`; for chat, `first` adds role
// "assistant" to the delta. With include_usage every chunk carries "usage":
// null (the last one the counts).
json stream_chunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model, int index,
                  const std::string& text, const std::string& finish_reason, bool first, bool include_usage);
json usage_chunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                 int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens = 0,
                 int64_t reasoning_tokens = -1);
// GET /v1/models: the list of the one served model; GET /v1/models/{id}:
// that model (OpenAI's model object), or 404 model_not_found for another id.
json models_response(const ServedModel& model);
json model_response(const ServedModel& model, const std::string& id);
// The 404 of a request for a model this server does not serve ("model").
ApiError model_not_found(const std::string& asked, const ServedModel& model);

// Of `ids` (decoded one after another from `previous`), how many begin
// within the text's first `bytes` (a thought's tokens: usage's reasoning_tokens).
int64_t tokens_within(const gpu::Tokenizer& tokenizer, int32_t previous, const std::vector<int32_t>& ids, size_t bytes);

// The text of prompt tokens, BOS and EOS skipped (/detokenize, echo).
std::string prompt_text(const gpu::Tokenizer& tokenizer, const std::vector<int32_t>& tokens);
// echo's completions "logprobs" of the prompt (logprobs_json's shape): the
// first token has null log probabilities (it follows nothing), token i
// those of logprobs[i - 1]; text_offset from `text_offset` on, advanced.
json prompt_logprobs_json(const gpu::Tokenizer& tokenizer, const std::vector<int32_t>& prompt,
                          const std::vector<TokenLogprobs>& logprobs, int64_t& text_offset);

// POST /tokenize (vLLM's shapes): {"prompt": text, "add_special_tokens":
// true (BOS)} or {"messages": [...]} (the chat template, as a chat request
// renders them), optional "return_token_strs"; answers {count,
// max_model_len, tokens, token_strs (the vocabulary's pieces, or null)}.
// POST /detokenize: {"tokens": [ids]} answers {"prompt": text}, BOS and EOS
// skipped (skip_special_tokens). Both throw
// ApiError as parse_request does (a bad field 400, another model 404).
json tokenize_response(const std::string& body, const ServedModel& model, const gpu::Tokenizer& tokenizer,
                       const ChatFormat& chat);
json detokenize_response(const std::string& body, const ServedModel& model, const gpu::Tokenizer& tokenizer);

// The "logprobs" of a choice for tokens ids[from..] with their log
// probabilities (`logprobs[i - from]` ids[i]'s), each decoded after its
// predecessor (`previous`: the token before ids[0]).
//   completions: {tokens, token_logprobs, top_logprobs: [{text: logprob}]
//     (the top N and the sampled token, as OpenAI's), text_offset: from
//     `text_offset` on, which advances past these tokens' text};
//   chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
json logprobs_json(Endpoint endpoint, const gpu::Tokenizer& tokenizer, int32_t previous, const std::vector<int32_t>& ids,
                   const std::vector<TokenLogprobs>& logprobs, size_t from, int64_t& text_offset);

// Seconds since the Unix epoch: a reply's `created`.
int64_t unix_now();

// "data: {json}\n\n" (invalid UTF-8 replaced by U+FFFD) and the final "data: [DONE]\n\n".
std::string sse_event(const json& payload);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";
// A compact JSON text, invalid UTF-8 replaced (never throws on token bytes);
// of a `json` or an `nlohmann::ordered_json`.
template <class Json>
std::string dump(const Json& value) {
  return value.dump(-1, ' ', false, Json::error_handler_t::replace);
}

}  // namespace disagg::http
