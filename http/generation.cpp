#include "http/generation.h"

#include <algorithm>
#include <chrono>

#include "actors/log.h"
#include "engine/sampling.h"

namespace disagg::http {

namespace {

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

}  // namespace

// A stream's chunks carry their tokens' log probabilities and let go of
// them; tokens with no text to carry (control tokens, text held back for a
// stop string or a thought's opening) keep theirs, at most the choice's
// share of what a whole reply may hold (kMaxReplyLogprobs, which
// fit_reply_logprobs applies to the others): past it the stream ends.
bool Generation::holds_too_many_logprobs(const Choice& c) const {
  if (request_.logprobs < 0) return false;
  const size_t share = size_t(kMaxReplyLogprobs) / choices_.size();
  return c.logprobs.size() * size_t(request_.logprobs + 1) > share;
}

size_t Generation::held_logprobs() const {
  size_t held = 0;
  for (const Choice& c : choices_) held += c.logprobs.size();
  return held;
}

Generation::Generation(const GenerationContext& context, ReplySink& sink, std::shared_ptr<Client> client,
                       ApiRequest request, std::string response_id, Submit submit)
    : context_(context), sink_(sink), client_(std::move(client)), request_(std::move(request)),
      response_id_(std::move(response_id)), submit_(std::move(submit)), created_(unix_now()),
      accepted_(Clock::now()) {
  choices_.resize(size_t(request_.best_of));
  for (size_t i = 0; i < choices_.size(); ++i) {
    choices_[i].index = int(i);
    choices_[i].text.emplace(context_.tokenizer, request_.stop, request_.prompt_tokens.back(), request_.tools.marker_tokens);
    if (request_.stream && request_.reasoning != gpu::ReasoningSyntax::none)
      choices_[i].thinking.emplace(request_.reasoning, request_.thought_opened);
    if (request_.stream && request_.tools.active()) choices_[i].tool_stream.emplace(request_.tools);
  }
}

void Generation::start() {
  context_.metrics.num_requests_running.add(1);
  if (request_.stream && request_.echo)  // the prompt first (echo is not streamed with logprobs)
    for (Choice& c : choices_) send_piece(c, request_.echo_text, "");
  submit(choices_[0]);
}

Generation::Choice* Generation::choice(RequestId id) {
  return const_cast<Choice*>(static_cast<const Generation*>(this)->choice(id));
}
const Generation::Choice* Generation::choice(RequestId id) const {
  for (const Choice& c : choices_)
    if (c.submitted && c.id == id) return &c;
  return nullptr;
}
bool Generation::all_finished() const {
  return std::all_of(choices_.begin(), choices_.end(), [](const Choice& c) { return !c.finish.empty(); });
}
bool Generation::all_outcomes_in() const {
  return std::all_of(choices_.begin(), choices_.end(), [](const Choice& c) { return !c.submitted || c.outcome_in; });
}
int64_t Generation::completion_tokens() const {
  int64_t n = 0;
  for (const Choice& c : choices_) n += c.text->tokens();
  return n;
}

// A choice's thought is the text before its content (text/reasoning.h's
// split, its markup included); its tokens are those that begin there.
int64_t Generation::reasoning_tokens() const {
  if (request_.endpoint != Endpoint::chat || request_.reasoning == gpu::ReasoningSyntax::none) return -1;
  int64_t n = 0;
  for (const Choice& c : choices_) {
    const std::string& text = c.text->text();
    const gpu::Reasoned split = gpu::split_reasoning(request_.reasoning, text, request_.thought_opened);
    n += tokens_within(context_.tokenizer, request_.prompt_tokens.back(), c.ids, text.size() - split.content.size());
  }
  return n;
}

// Choice c's request to the router: the sampling of choice 0 with the
// choice's own seed (gpu::sample_seed), and one session for all choices,
// so they share the decode worker that holds their prompt.
void Generation::submit(Choice& c) {
  // Not once the reply is over: sending it may have ended it (a client that
  // reads too slowly is gone, its running choices cancelled), and a choice
  // submitted after that cancel ran to its end at the router for nobody.
  if (done_) return;
  c.id = client_->next_id();
  c.submitted = true;
  GenerateRequest r;
  r.id = c.id;
  r.prompt_tokens = request_.prompt_tokens;
  r.max_new_tokens = request_.max_tokens;
  r.up_to_capacity = request_.max_tokens_defaulted;
  r.sampling = request_.sampling;
  r.sampling.seed = gpu::sample_seed(request_.sampling.seed, c.index);
  if (c.index > 0) r.sampling.prompt_logprobs = -1;  // choice 0's serve them all
  r.session = !request_.user.empty() || choices_.size() == 1 ? request_.user : response_id_;
  r.cache_salt = request_.cache_salt;
  if (c.index > 0) r.first_choice = choices_[0].id;
  r.token_text = false;  // decoded here
  submit_(std::move(r));
}

// Choices 1.. once choice 0's prompt KV is in its decode worker (its first
// token) or choice 0 has ended: they find the prompt in that worker's
// prefix cache (the full blocks; the rest is prefilled by the worker itself).
void Generation::submit_others() {
  if (others_submitted_) return;
  others_submitted_ = true;
  for (size_t i = 1; i < choices_.size(); ++i) submit(choices_[i]);
}

void Generation::on_token(RequestId id, const TokenEvent& event) {
  Choice* found = choice(id);
  if (!found || done_) return;
  Choice& c = *found;
  if (!c.finish.empty()) return;
  if (c.index == 0) cached_tokens_ = event.cached_tokens;
  const auto now = Clock::now();
  if (!first_token_) {
    first_token_ = now;
    context_.metrics.time_to_first_token.observe(seconds_between(accepted_, now));
  } else if (c.last_token) {
    context_.metrics.inter_token_latency.observe(seconds_between(*c.last_token, now));
  }
  c.last_token = now;
  const std::string piece = add_token(c, event.token, event.logprobs);
  if (request_.stream && holds_too_many_logprobs(c)) {
    record_end(to_string(ErrorCode::invalid_request));
    fail(bad_request(request_.endpoint == Endpoint::chat ? "top_logprobs" : "logprobs",
                     "the stream's last " + std::to_string(c.logprobs.size()) +
                         " tokens had no text to carry their log probabilities, more than a reply may hold (" +
                         std::to_string(kMaxReplyLogprobs) + " in all)"));
    return;
  }
  if (request_.stream && !piece.empty()) {
    if (c.tool_stream) send_tool_text(c, piece);
    else send_text(c, piece);
  }
  if (c.index == 0) submit_others();
  if (c.text->stopped()) {
    // The rest is not wanted; the cancelled outcome is ignored. Except
    // choice 0's when the prompt's log probabilities are asked for (echo):
    // they come with its outcome, which a cancel would bring without them.
    if (!(c.index == 0 && request_.sampling.prompt_logprobs >= 0)) client_->cancel(c.id);
    finish_choice(c, "stop");
  }
}

void Generation::on_outcome(RequestId id, RequestOutcome outcome) {
  Choice* found = choice(id);
  if (!found) return;
  Choice& c = *found;
  const bool waited_for = waits_for_prompt_logprobs(c);
  c.outcome_in = true;
  if (waited_for && !done_) {  // choice 0 ended early by a stop string; the reply waited for this
    if (!outcome.ok() || outcome.prompt_logprobs.size() + 1 != request_.prompt_tokens.size()) {
      record_end(to_string(outcome.ok() ? ErrorCode::worker_lost : outcome.code));
      fail(error_for_outcome(outcome.ok() ? ErrorCode::worker_lost : outcome.code,
                             outcome.ok() ? "the prompt's log probabilities were lost with a decode worker; try again"
                                          : outcome.message));
      return;
    }
    c.prompt_logprobs = std::move(outcome.prompt_logprobs);
    if (all_finished()) complete();
    return;
  }
  if (done_ || !c.finish.empty()) {  // stopped by a stop string, or the reply is over
    if (done_ && all_outcomes_in()) record_end("");
    return;
  }
  if (!outcome.ok()) {
    node_log(LogLevel::warning, "request " + std::to_string(id) + " failed: " + to_string(outcome.code) + ": " +
                                    outcome.message);
    record_end(to_string(outcome.code));
    fail(error_for_outcome(outcome.code, outcome.message));
    return;
  }
  if (c.index == 0) {
    cached_tokens_ = outcome.timings.cached_tokens;
    c.prompt_logprobs = std::move(outcome.prompt_logprobs);
    // (lost only with a decode worker that went down after its last token)
    if (request_.sampling.prompt_logprobs >= 0 && c.prompt_logprobs.size() + 1 != request_.prompt_tokens.size()) {
      record_end(to_string(ErrorCode::worker_lost));
      fail(error_for_outcome(ErrorCode::worker_lost,
                             "the prompt's log probabilities were lost with a decode worker; try again"));
      return;
    }
  }
  // (every token came as an event: the client library passes on, before
  // the outcome, any that no event brought)
  const std::string rest = c.text->flush();
  if (request_.stream && !rest.empty()) {
    if (c.tool_stream) send_tool_text(c, rest);
    else send_text(c, rest);
  }
  finish_choice(c, outcome.finish == FinishReason::eos ? "stop" : "length");
  if (c.index == 0) submit_others();
}

void Generation::abandon() {
  if (done_) return;
  done_ = true;
  cancel_running();
  record_end("cancelled");
}

void Generation::record_end(const std::string& error) {
  if (counted_) return;
  counted_ = true;
  auto& m = context_.metrics;
  m.num_requests_running.add(-1);
  m.e2e_request_latency.observe(seconds_between(accepted_, Clock::now()));
  if (!error.empty()) {
    m.error(error).inc();
    return;
  }
  m.prompt_tokens.inc(double(request_.prompt_tokens.size()));
  m.generation_tokens.inc(double(completion_tokens()));
}

// The next token's text (held back, maybe: TextAssembler).
std::string Generation::add_token(Choice& c, int32_t token, TokenLogprobs logprobs) {
  c.ids.push_back(token);
  c.cumulative_logprob += double(logprobs.logprob);
  if (request_.logprobs >= 0) c.logprobs.push_back(std::move(logprobs));
  return c.text->add(token);
}

// A choice object with its tokens' ids and log probabilities, when asked
// for: all of them, or (streaming) those no chunk carried yet.
json Generation::with_token_data(Choice& c, json choice, bool streamed) {
  const bool ids = request_.return_token_ids, logprobs = request_.logprobs >= 0;
  if (!ids && !logprobs) return choice;
  const size_t from = streamed ? c.ids_streamed : 0;
  if (ids) choice["token_ids"] = std::vector<int32_t>(c.ids.begin() + long(from), c.ids.end());
  if (logprobs) {
    // echo: the text, and its log probabilities, begin with the prompt's
    json prompt;
    int64_t offset = streamed ? c.text_offset : 0;
    if (request_.echo && !streamed)
      prompt = prompt_logprobs_json(context_.tokenizer, request_.prompt_tokens, choices_[0].prompt_logprobs, offset);
    choice["logprobs"] = logprobs_json(request_.endpoint, context_.tokenizer, request_.prompt_tokens.back(), c.ids,
                                       c.logprobs, from, offset);
    if (streamed) c.text_offset = offset;
    if (!prompt.is_null())
      for (auto& [key, values] : prompt.items()) {
        values.insert(values.end(), choice["logprobs"][key].begin(), choice["logprobs"][key].end());
        choice["logprobs"][key] = std::move(values);
      }
  }
  if (streamed) {
    c.ids_streamed = c.ids.size();
    c.logprobs.clear();  // (carried)
  }
  return choice;
}

void Generation::open_events_once() {
  if (events_open_) return;
  events_open_ = true;
  sink_.open_events();
  if (request_.endpoint == Endpoint::chat)  // each choice's first chunk carries the role
    for (const Choice& c : choices_)
      sink_.event(sse_event(stream_chunk(Endpoint::chat, response_id_, created_, context_.model.name, c.index, "", "",
                                         true, request_.include_usage)));
}

void Generation::send_piece(Choice& c, const std::string& piece, const std::string& finish_reason) {
  open_events_once();
  json chunk = stream_chunk(request_.endpoint, response_id_, created_, context_.model.name, c.index, piece,
                            finish_reason, false, request_.include_usage);
  chunk["choices"][0] = with_token_data(c, chunk["choices"][0], true);
  sink_.event(sse_event(chunk));
}

void Generation::send_text(Choice& c, const std::string& piece) {
  if (!c.thinking) {
    send_piece(c, piece, "");
    return;
  }
  send_reasoned(c, c.thinking->add(piece));
}

// A piece under tools: a thinking family's reasoning goes out as reasoning,
// and only the content is read for calls (vLLM's order: the calls a model
// thinks about are not calls).
void Generation::send_tool_text(Choice& c, const std::string& piece) {
  if (!c.thinking) return send_tool_deltas(c, c.tool_stream->add(piece));
  const gpu::Reasoned r = c.thinking->add(piece);
  send_reasoned(c, gpu::Reasoned{r.reasoning, ""});
  if (!r.content.empty()) send_tool_deltas(c, c.tool_stream->add(r.content));
}

void Generation::send_tool_deltas(Choice& c, const std::vector<ToolStream::Delta>& deltas) {
  for (const ToolStream::Delta& d : deltas) {
    if (d.kind != ToolStream::Delta::Kind::call && d.text.empty()) continue;
    open_events_once();
    sink_.event(sse_event(tool_delta_chunk(response_id_, created_, context_.model.name, c.index, d,
                                           tool_call_id_prefix(c), request_.include_usage)));
  }
}

void Generation::send_reasoned(Choice& c, const gpu::Reasoned& piece) {
  if (piece.reasoning.empty() && piece.content.empty()) return;
  open_events_once();
  json chunk = reasoned_chunk(response_id_, created_, context_.model.name, c.index, piece, request_.include_usage);
  chunk["choices"][0] = with_token_data(c, chunk["choices"][0], true);
  sink_.event(sse_event(chunk));
}

// Choice c has ended ("stop" or "length"); the reply completes with the last.
void Generation::finish_choice(Choice& c, const std::string& finish_reason) {
  c.finish = finish_reason;
  if (c.tool_stream) {
    if (c.thinking) {  // (what the split held back)
      const gpu::Reasoned rest = c.thinking->flush();
      send_reasoned(c, gpu::Reasoned{rest.reasoning, ""});
      if (!rest.content.empty()) send_tool_deltas(c, c.tool_stream->add(rest.content));
    }
    std::vector<ToolStream::Delta> owed;
    c.tools = c.tool_stream->finish(finish_reason, owed);
    send_tool_deltas(c, owed);
  } else if (request_.tools.active()) {
    // Whole: the reasoning split off first (none without a thinking family), the calls read from the content.
    const gpu::Reasoned split = gpu::split_reasoning(request_.reasoning, c.text->text(), request_.thought_opened);
    c.tools = read_tool_calls(request_.tools, split.content, finish_reason);
    c.tools->reasoning = split.reasoning;
  }
  if (c.tools) c.finish = c.tools->finish_reason;
  context_.metrics.success(c.finish).inc();
  if (c.thinking && !request_.tools.active()) send_reasoned(c, c.thinking->flush());  // (what it held back)
  if (request_.stream) send_piece(c, "", c.finish);
  if (all_finished()) complete();
}

// A choice's tool call ids: "call_", its request id, the call's index.
std::string Generation::tool_call_id_prefix(const Choice& c) const { return "call_" + std::to_string(c.id) + "_"; }

// The reply of a request whose choices have all ended. best_of: the n of
// highest cumulative log probability (ties: the lower index), in that order.
void Generation::complete() {
  if (waits_for_prompt_logprobs(choices_[0])) return;  // (on_outcome completes it)
  done_ = true;
  const int64_t prompt = int64_t(request_.prompt_tokens.size()), completion = completion_tokens();
  if (all_outcomes_in()) record_end("");
  if (request_.stream) {
    if (request_.include_usage)
      sink_.event(sse_event(usage_chunk(request_.endpoint, response_id_, created_, context_.model.name, prompt,
                                        completion, cached_tokens_, reasoning_tokens())));
    sink_.event(kSseDone);
    sink_.end_events();
    return;
  }
  std::vector<Choice*> order;
  for (Choice& c : choices_) order.push_back(&c);
  if (request_.best_of > request_.n)
    std::stable_sort(order.begin(), order.end(), [](const Choice* a, const Choice* b) {
      return a->cumulative_logprob > b->cumulative_logprob;
    });
  json choices = json::array();
  for (int i = 0; i < request_.n; ++i) {
    Choice& c = *order[size_t(i)];
    const std::string text = request_.echo ? request_.echo_text + c.text->text() : c.text->text();
    if (c.tools)
      choices.push_back(with_token_data(c, tool_choice_json(i, *c.tools, tool_call_id_prefix(c)), false));
    else if (request_.reasoning != gpu::ReasoningSyntax::none)
      choices.push_back(with_token_data(
          c, reasoned_choice_json(i, gpu::split_reasoning(request_.reasoning, text, request_.thought_opened), c.finish),
          false));
    else
      choices.push_back(with_token_data(c, choice_json(request_.endpoint, i, text, c.finish), false));
  }
  sink_.reply_json(200, response_json(request_.endpoint, response_id_, created_, context_.model.name,
                                      std::move(choices), prompt, completion, cached_tokens_, reasoning_tokens()));
}

// The reply is an error: every choice still running is cancelled.
void Generation::fail(const ApiError& e) {
  done_ = true;
  cancel_running();
  if (events_open_) {  // streaming began: the error goes in-band
    sink_.event(sse_event(error_body(e)));
    sink_.event(kSseDone);
    sink_.end_events();
  } else {
    sink_.reply_error(e);
  }
}

void Generation::cancel_running() {
  for (Choice& c : choices_)
    if (c.submitted && !c.outcome_in && (c.finish.empty() || waits_for_prompt_logprobs(c)))
      client_->cancel(c.id);  // its blocks are freed at once
}

// Choice 0 ended by a stop string while the prompt's log probabilities, which
// come with its outcome, are asked for and not in yet.
bool Generation::waits_for_prompt_logprobs(const Choice& c) const {
  return c.index == 0 && request_.sampling.prompt_logprobs >= 0 && !c.finish.empty() && !c.outcome_in;
}

}  // namespace disagg::http
