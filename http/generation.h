// The OpenAI layer of one request to /v1/completions or /v1/chat/completions,
// apart from the HTTP transport (http/frontend.cpp's connection): its
// choices (n, best_of) as requests of their own to the router, their text
// assembled from token events (stop strings, UTF-8), log probabilities and
// token ids, the reply (one JSON body, or SSE events as tokens come), and
// its metrics.
//
// A generation's life:
//
//   start --> choice 0 submitted --(its first token, or its end)--> choices 1.. submitted
//     --> each choice ends ("stop": eos or a stop string; "length") --> complete: the reply
//     any outcome that is an error --> fail: every running choice cancelled, the error replied
//     the client gone (abandon) --> every running choice cancelled, nothing replied
//
// It is over for the connection once replied (done()) and every submitted
// choice's outcome is in (all_outcomes_in()): a choice cancelled after a stop
// string still answers. Runs on the connection's strand only.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/client.h"
#include "actors/timing.h"
#include "http/api.h"
#include "metrics/disagg_metrics.h"

namespace disagg::http {

// What a generation writes its reply through: the connection.
class ReplySink {
 public:
  virtual ~ReplySink() = default;
  virtual void reply_json(int status, const json& body) = 0;  // a whole response
  virtual void reply_error(const ApiError& e) = 0;
  virtual void open_events() = 0;                 // the SSE response's header
  virtual void event(std::string data) = 0;       // one SSE event (sse_event's bytes)
  virtual void end_events() = 0;                  // the response is complete
};

// What stays the same for every generation of a frontend.
struct GenerationContext {
  const ServedModel& model;
  const gpu::Tokenizer& tokenizer;
  metrics::DisaggMetrics& metrics;
};

class Generation {
 public:
  // Hands one choice's request to the router; its events and outcome come
  // back through on_token and on_outcome (on the connection's strand).
  using Submit = std::function<void(GenerateRequest)>;

  Generation(const GenerationContext& context, ReplySink& sink, std::shared_ptr<Client> client, ApiRequest request,
             std::string response_id, Submit submit);

  void start();
  bool owns(RequestId id) const { return choice(id) != nullptr; }
  void on_token(RequestId id, const TokenEvent& event);
  void on_outcome(RequestId id, RequestOutcome outcome);
  // The client went away before the reply: every running choice is cancelled.
  void abandon();

  bool done() const { return done_; }
  // Tokens whose log probabilities are held (the bound's test).
  size_t held_logprobs() const;
  bool all_outcomes_in() const;
  // Its metrics, once: `error` empty for a success.
  void record_end(const std::string& error);

 private:
  struct Choice {
    int index = 0;
    RequestId id = 0;
    bool submitted = false;
    bool outcome_in = false;    // the router's outcome came (after a cancel too)
    std::string finish;         // "stop" / "length" ("tool_calls") once the choice has ended
    std::optional<ToolReply> tools;  // with tools: what its text says (read when it ends)
    std::optional<ToolStream> tool_stream;  // streamed with tools: its text read as it comes
    std::optional<gpu::ReasoningStream> thinking;  // streamed chat of a thinking family: its reasoning apart
    std::optional<TextAssembler> text;
    std::vector<int32_t> ids;   // its tokens so far (return_token_ids, logprobs)
    // Their log probabilities when asked for (ApiRequest::logprobs >= 0): those of
    // ids[ids_streamed..] (a streamed chunk lets go of those it carried).
    std::vector<TokenLogprobs> logprobs;
    std::vector<TokenLogprobs> prompt_logprobs;  // echo with logprobs: the outcome's (choice 0 computes them)
    size_t ids_streamed = 0;    // of them, those a streamed chunk carried
    double cumulative_logprob = 0.0;  // the sum of its tokens' (best_of ranks by it)
    int64_t text_offset = 0;    // completions' logprobs: where the next streamed token's text begins
    std::optional<Clock::time_point> last_token;
  };

  Choice* choice(RequestId id);
  const Choice* choice(RequestId id) const;
  bool all_finished() const;
  // Choice 0 ended by a stop string while the prompt's log probabilities
  // (echo), which come with its outcome, are not in yet: the reply waits.
  bool waits_for_prompt_logprobs(const Choice& c) const;
  int64_t completion_tokens() const;
  // Of them, the thoughts' (a thinking family's chat; else -1: not reported).
  int64_t reasoning_tokens() const;

  void submit(Choice& c);
  void submit_others();
  std::string tool_call_id_prefix(const Choice& c) const;
  std::string add_token(Choice& c, int32_t token, TokenLogprobs logprobs);
  bool holds_too_many_logprobs(const Choice& c) const;
  json with_token_data(Choice& c, json choice, bool streamed);
  void open_events_once();
  void send_piece(Choice& c, const std::string& piece, const std::string& finish_reason);
  // A piece of a choice's text as it streams: apart into reasoning and
  // content for a thinking family (ReasoningStream), else as it is.
  void send_text(Choice& c, const std::string& piece);
  void send_reasoned(Choice& c, const gpu::Reasoned& piece);
  // A piece under tools: reasoning apart (a thinking family), the content read for calls.
  void send_tool_text(Choice& c, const std::string& piece);
  void send_tool_deltas(Choice& c, const std::vector<ToolStream::Delta>& deltas);
  void finish_choice(Choice& c, const std::string& finish_reason);
  void complete();
  void fail(const ApiError& e);
  void cancel_running();

  const GenerationContext& context_;
  ReplySink& sink_;
  std::shared_ptr<Client> client_;
  ApiRequest request_;
  std::string response_id_;
  Submit submit_;
  int64_t created_ = 0;
  std::vector<Choice> choices_;   // best_of of them
  bool others_submitted_ = false;  // choices 1..: after choice 0's first token (or its end)
  bool events_open_ = false;       // streaming: the SSE header went (from then on, errors go in-band)
  bool done_ = false;              // the HTTP reply is complete (outcomes may still come)
  bool counted_ = false;           // its metrics were recorded
  Clock::time_point accepted_;
  std::optional<Clock::time_point> first_token_;
  int64_t cached_tokens_ = 0;  // prompt tokens the prefix cache held (choice 0's token events say)
};

}  // namespace disagg::http
