#include "http/frontend.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <deque>
#include <iomanip>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <sys/resource.h>

#include "actors/client.h"
#include "actors/log.h"
#include "node/relay.h"
#include "node/runtime.h"
#include "actors/timing.h"
#include "caf/all.hpp"
#include "model/checkpoint.h"
#include "http/api.h"
#include "metrics/disagg_metrics.h"

namespace disagg::http {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = net::ip::tcp;
using namespace std::chrono_literals;

namespace {

// A connection that sends no complete request header for this long is closed
// (idle keep-alive connections included).
constexpr auto kIdleTimeout = 60s;
// A response write that does not finish in this long: the client is gone
// or stopped reading; the connection closes and its request is cancelled.
constexpr auto kWriteTimeout = 30s;
// Bytes a client may send (pipelined) while its request runs, and how much
// one read of them takes at a time.
constexpr size_t kMaxPipelinedBytes = 64 << 10;
constexpr size_t kWatchReadBytes = 4096;
// A connection closed after an error reply (413) is drained this long first,
// so the client reads the reply instead of a reset.
constexpr auto kLingerTimeout = 1s;
// How long GET /health waits for the router's status.
constexpr auto kHealthTimeout = 2s;
// After SIGTERM: how long requests still in flight get to end (they are
// cancelled first) before the process stops anyway.
constexpr auto kShutdownDrain = 5s;
// After a failed accept (e.g. no file descriptor left), the next try.
constexpr auto kAcceptRetry = 100ms;
// Hex digits of a response id ("cmpl-<id>").
constexpr int kIdHexDigits = 16;

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double seconds_between(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// ---------------------------------------------------------------- shared state

class Frontend {
 public:
  Frontend(caf::actor_system& system, const NodeOptions& node, const DisaggConfig& cfg, ServedModel model,
           gpu::Tokenizer tokenizer, ChatTemplate tmpl)
      : ioc(node.http_threads), acceptor(ioc), system(system), node(node), cfg(cfg), model(std::move(model)),
        tokenizer(std::move(tokenizer)), tmpl(tmpl), random_(std::random_device{}()) {}

  net::io_context ioc;
  tcp::acceptor acceptor;
  caf::actor_system& system;
  const NodeOptions& node;
  const DisaggConfig& cfg;
  const ServedModel model;
  const gpu::Tokenizer tokenizer;
  const ChatTemplate tmpl;
  metrics::DisaggMetrics& metrics = metrics::disagg_metrics();

  // The router, once reached (null while not).
  void set_router(std::optional<router_actor> router) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (router) {
      ClientOptions options;
      options.default_deadline_ms = cfg.default_deadline_ms;
      client_ = std::make_shared<Client>(system, *router, options);
    } else {
      client_.reset();
    }
  }
  std::shared_ptr<Client> client() {
    std::lock_guard<std::mutex> lock(mutex_);
    return client_;
  }

  uint64_t random_u64() {
    std::lock_guard<std::mutex> lock(mutex_);
    return random_();
  }
  std::string new_id(const char* prefix) {
    std::ostringstream out;
    out << prefix << std::hex << std::setw(kIdHexDigits) << std::setfill('0') << random_u64();
    return out.str();
  }

  // Requests submitted and not yet answered, so shutdown can cancel them.
  void track(RequestId id, std::shared_ptr<Client> c) {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_[id] = std::move(c);
  }
  void untrack(RequestId id) {
    std::lock_guard<std::mutex> lock(mutex_);
    in_flight_.erase(id);
  }
  size_t cancel_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, c] : in_flight_) c->cancel(id);
    return in_flight_.size();
  }
  size_t in_flight() {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_flight_.size();
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<Client> client_;
  std::mt19937_64 random_;
  std::map<RequestId, std::shared_ptr<Client>> in_flight_;
};

// ---------------------------------------------------------------- one connection

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, Frontend& fe)
      : stream_(std::move(socket)), fe_(fe), write_timer_(stream_.get_executor()) {}

  void start() {
    net::dispatch(stream_.get_executor(), [self = shared_from_this()] { self->read(); });
  }

 private:
  // What one queued write sends: raw bytes (a whole response or a header),
  // one chunk of a chunked body, or the last chunk.
  struct Out {
    enum Kind { raw, chunk, last } kind;
    std::string data;
  };

  // One choice of a generation (n, best_of): a request of its own to the router.
  struct Choice {
    int index = 0;
    RequestId id = 0;
    bool submitted = false;
    bool outcome_in = false;    // the router's outcome came (after a cancel too)
    std::string finish;         // "stop" / "length" once the choice has ended
    std::optional<TextAssembler> text;
    std::vector<int32_t> ids;   // its tokens so far (return_token_ids, logprobs)
    std::vector<TokenLogprobs> logprobs;  // theirs (Sampling::logprobs >= 0)
    std::vector<TokenLogprobs> prompt_logprobs;  // echo with logprobs: the outcome's (choice 0 computes them)
    size_t ids_streamed = 0;    // of them, those a streamed chunk carried
    int64_t text_offset = 0;    // completions' logprobs: where the next streamed token's text begins
    std::optional<Clock::time_point> last_token;
    double cumulative_logprob() const {
      double sum = 0.0;
      for (const TokenLogprobs& lp : logprobs) sum += double(lp.logprob);
      return sum;
    }
  };

  // The generation a request started, while it runs: its choices (choice 0
  // first; the others once its prompt is in a decode worker's prefix cache).
  struct Generation {
    std::shared_ptr<Client> client;
    ApiRequest request;
    std::string response_id;
    int64_t created = 0;
    std::vector<Choice> choices;  // best_of of them
    bool others_submitted = false;  // choices 1..: after choice 0's first token (or its end)
    bool header_sent = false;  // streaming: the SSE header (and from then on, errors go in-band)
    bool done = false;         // the HTTP reply is complete (outcomes may still come)
    bool counted = false;      // its metrics were recorded
    Clock::time_point accepted;
    std::optional<Clock::time_point> first_token;
    int64_t cached_tokens = 0;  // prompt tokens the prefix cache held (choice 0's token events say)

    Choice* choice(RequestId id) {
      for (Choice& c : choices)
        if (c.submitted && c.id == id) return &c;
      return nullptr;
    }
    bool all_finished() const {
      return std::all_of(choices.begin(), choices.end(), [](const Choice& c) { return !c.finish.empty(); });
    }
    bool all_outcomes_in() const {
      return std::all_of(choices.begin(), choices.end(), [](const Choice& c) { return !c.submitted || c.outcome_in; });
    }
    int64_t completion_tokens() const {
      int64_t n = 0;
      for (const Choice& c : choices) n += c.text->tokens();
      return n;
    }
  };

  // The next token's text (held back, maybe: TextAssembler).
  static std::string add_token(Choice& c, int32_t token, TokenLogprobs logprobs) {
    c.ids.push_back(token);
    c.logprobs.push_back(std::move(logprobs));
    return c.text->add(token);
  }
  // A choice object with its tokens' ids and log probabilities, when asked
  // for: all of them, or (streaming) those no chunk carried yet.
  json with_token_data(const Generation& g, Choice& c, json choice, bool streamed) {
    const bool ids = g.request.return_token_ids, logprobs = g.request.logprobs >= 0;
    if (!ids && !logprobs) return choice;
    const size_t from = streamed ? c.ids_streamed : 0;
    if (ids) choice["token_ids"] = std::vector<int32_t>(c.ids.begin() + long(from), c.ids.end());
    if (logprobs) {
      // echo: the text, and its log probabilities, begin with the prompt's
      json prompt;
      int64_t offset = streamed ? c.text_offset : 0;
      if (g.request.echo && !streamed)
        prompt = prompt_logprobs_json(fe_.tokenizer, g.request.prompt_tokens, g.choices[0].prompt_logprobs, offset);
      choice["logprobs"] = logprobs_json(g.request.endpoint, fe_.tokenizer, g.request.prompt_tokens.back(), c.ids,
                                         c.logprobs, from, offset);
      if (streamed) c.text_offset = offset;
      if (!prompt.is_null())
        for (auto& [key, values] : prompt.items()) {
          values.insert(values.end(), choice["logprobs"][key].begin(), choice["logprobs"][key].end());
          choice["logprobs"][key] = std::move(values);
        }
    }
    if (streamed) c.ids_streamed = c.ids.size();
    return choice;
  }

  // ---- reading requests
  void read() {
    if (closed_) return;
    parser_.emplace();
    parser_->body_limit(uint64_t(fe_.node.http_body_limit));
    stream_.expires_after(kIdleTimeout);
    // The header first: a client that sends "Expect: 100-continue" waits for
    // a 100 before it sends the body (or gets the 413 instead).
    bhttp::async_read_header(stream_, buffer_, *parser_,
                             [self = shared_from_this()](beast::error_code ec, size_t) { self->on_header(ec); });
  }

  void on_header(beast::error_code ec) {
    if (ec) return on_read(ec);
    auto read_body = [self = shared_from_this()] {
      self->stream_.expires_after(kIdleTimeout);
      bhttp::async_read(self->stream_, self->buffer_, *self->parser_,
                        [self](beast::error_code ec, size_t) { self->on_read(ec); });
    };
    if (!beast::iequals(parser_->get()[bhttp::field::expect], "100-continue") || parser_->is_done())
      return read_body();
    continue_.emplace(bhttp::status::continue_, parser_->get().version());
    bhttp::async_write(stream_, *continue_, [self = shared_from_this(), read_body](beast::error_code ec, size_t) {
      self->continue_.reset();
      if (ec) return self->close();
      read_body();
    });
  }

  void on_read(beast::error_code ec) {
    if (ec == bhttp::error::body_limit) {
      keep_alive_ = false;
      ApiError e;
      e.status = 413;
      e.message = "request body larger than " + std::to_string(fe_.node.http_body_limit) + " bytes (node.http-body-limit)";
      e.code = "body_too_large";
      send_error(e);
      return;
    }
    if (ec && ec.category() == bhttp::make_error_code(bhttp::error::bad_method).category() &&
        ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message) {
      // Not HTTP/1.x the parser understands: one 400, then the connection closes.
      keep_alive_ = false;
      ApiError e;
      e.message = "malformed HTTP request: " + ec.message();
      e.code = "bad_http";
      send_error(e);
      return;
    }
    if (ec) return close();
    const auto& req = parser_->get();
    keep_alive_ = req.keep_alive();
    version_ = req.version();
    const std::string target(req.target());
    const std::string path = target.substr(0, target.find('?'));
    const auto method = req.method();
    auto only = [&](bhttp::verb verb) {
      if (method == verb) return true;
      ApiError e;
      e.status = 405;
      e.message = std::string(bhttp::to_string(method)) + " " + path + ": use " + std::string(bhttp::to_string(verb));
      e.code = "method_not_allowed";
      send_error(e);
      return false;
    };
    if (path == "/v1/completions" || path == "/v1/chat/completions") {
      if (only(bhttp::verb::post))
        start_generation(path == "/v1/completions" ? Endpoint::completions : Endpoint::chat, req.body());
    } else if (path == "/tokenize" || path == "/detokenize") {  // vLLM's: at the root
      if (only(bhttp::verb::post)) {
        try {
          send_json(200, path == "/tokenize" ? tokenize_response(req.body(), fe_.model, fe_.tokenizer, fe_.tmpl)
                                             : detokenize_response(req.body(), fe_.model, fe_.tokenizer));
        } catch (const ApiError& e) {
          send_error(e);
        }
      }
    } else if (path == "/v1/models") {
      if (only(bhttp::verb::get)) send_json(200, models_response(fe_.model));
    } else if (path == "/health") {
      if (only(bhttp::verb::get)) health();
    } else if (path == "/metrics") {
      if (only(bhttp::verb::get)) send_text(200, metrics::kTextContentType, metrics::process_registry().render());
    } else {
      ApiError e;
      e.status = 404;
      e.message = "no such endpoint: " + path;
      e.code = "not_found";
      send_error(e);
    }
  }

  // ---- simple replies
  bhttp::response<bhttp::string_body> response(int status, const char* content_type, std::string body) {
    bhttp::response<bhttp::string_body> res{bhttp::int_to_status(unsigned(status)), version_};
    res.set(bhttp::field::server, "disagg");
    res.set(bhttp::field::content_type, content_type);
    res.keep_alive(keep_alive_);
    res.body() = std::move(body);
    res.prepare_payload();
    return res;
  }

  void send_text(int status, const char* content_type, std::string body, int retry_after_s = 0) {
    auto res = response(status, content_type, std::move(body));
    if (retry_after_s > 0) res.set(bhttp::field::retry_after, std::to_string(retry_after_s));
    std::ostringstream out;
    out << res;  // Beast's serializer
    finish_response(Out{Out::raw, out.str()});
  }
  void send_json(int status, const json& body) { send_text(status, "application/json", dump(body)); }
  void send_error(const ApiError& e) {
    send_text(e.status, "application/json", dump(error_body(e)), e.retry_after_s);
  }

  // ---- health
  void health() {
    auto client = fe_.client();
    if (!client) {
      send_json(503, {{"status", "unavailable"},
                      {"reason", "the router at " + fe_.node.router_host + ":" + std::to_string(fe_.node.router_port) +
                                     " is not reachable"}});
      return;
    }
    busy_ = true;
    auto self = shared_from_this();
    auto reply = [self](std::optional<RouterStatus> status) {
      net::post(self->stream_.get_executor(), [self, status] { self->on_health(status); });
    };
    fe_.system.spawn([router = client->router(), reply](caf::event_based_actor* actor) -> caf::behavior {
      actor->request(router, kHealthTimeout, status_atom::value)
          .then(
              [=](RouterStatus& s) {
                reply(s);
                actor->quit();
              },
              [=](caf::error&) {
                reply(std::nullopt);
                actor->quit();
              });
      return {[](status_atom) {}};  // nothing else: it lives for the one reply
    });
    watch();
  }

  void on_health(const std::optional<RouterStatus>& status) {
    if (closed_) return;
    busy_ = false;  // finish_response sends below
    if (!status) {
      send_json(503, {{"status", "unavailable"}, {"reason", "the router did not answer within " +
                                                                std::to_string(kHealthTimeout.count()) + " s"}});
      return;
    }
    const int prefill = status->count(WorkerRole::prefill), decode = status->count(WorkerRole::decode);
    json body = {{"prefill_workers", prefill}, {"decode_workers", decode},
                 {"queued", status->queued}, {"in_flight", status->in_flight}};
    if (prefill > 0 && decode > 0) {
      body["status"] = "ok";
      send_json(200, body);
      return;
    }
    body["status"] = "unavailable";
    body["reason"] = prefill == 0 && decode == 0 ? "no prefill and no decode worker registered"
                     : prefill == 0               ? "no prefill worker registered"
                                                  : "no decode worker registered";
    send_json(503, body);
  }

  // ---- generation
  void start_generation(Endpoint endpoint, const std::string& body) {
    ApiRequest request;
    try {
      request = parse_request(endpoint, body, fe_.model, fe_.tokenizer, fe_.tmpl, [this] { return fe_.random_u64(); });
    } catch (const ApiError& e) {
      fe_.metrics.error("invalid_request").inc();
      send_error(e);
      return;
    } catch (const std::exception& e) {  // a bug of ours (parse_request throws ApiError only): this request fails, not the node
      node_log(LogLevel::error, std::string("internal error parsing a request: ") + e.what());
      ApiError err = error_for_outcome(ErrorCode::internal, "internal error while parsing the request");
      fe_.metrics.error("internal").inc();
      send_error(err);
      return;
    }
    auto client = fe_.client();
    if (!client) {
      ApiError e = error_for_outcome(ErrorCode::overloaded, "the router is not reachable");
      e.code = "router_unreachable";
      send_error(e);
      return;
    }
    if (gen_) record_end(*gen_, "");  // stopped by a stop string; its outcome never came
    gen_.emplace();
    Generation& g = *gen_;
    g.client = client;
    g.request = std::move(request);
    g.response_id = fe_.new_id(g.request.endpoint == Endpoint::completions ? "cmpl-" : "chatcmpl-");
    g.created = unix_now();
    g.accepted = Clock::now();
    g.choices.resize(size_t(g.request.best_of));
    for (size_t i = 0; i < g.choices.size(); ++i) {
      g.choices[i].index = int(i);
      g.choices[i].text.emplace(fe_.tokenizer, g.request.stop, g.request.prompt_tokens.back());
    }
    busy_ = true;
    fe_.metrics.num_requests_running.add(1);
    if (g.request.stream && g.request.echo)  // the prompt first (echo is not streamed with logprobs)
      for (Choice& c : g.choices) send_piece(g, c, g.request.echo_text, "");
    submit(g, g.choices[0]);
    watch();
  }

  // Choice c's request to the router: the sampling of choice 0 with the
  // choice's own seed (gpu::sample_seed), and one session for all choices,
  // so they share the decode worker that holds their prompt.
  void submit(Generation& g, Choice& c) {
    c.id = g.client->next_id();
    c.submitted = true;
    GenerateRequest r;
    r.id = c.id;
    r.prompt_tokens = g.request.prompt_tokens;
    r.max_new_tokens = g.request.max_tokens;
    r.up_to_capacity = g.request.max_tokens_defaulted;
    r.sampling = g.request.sampling;
    r.sampling.seed = gpu::sample_seed(g.request.sampling.seed, c.index);
    if (c.index > 0) r.sampling.prompt_logprobs = -1;  // choice 0's serve them all
    r.session = !g.request.user.empty() || g.choices.size() == 1 ? g.request.user : g.response_id;
    r.cache_salt = g.request.cache_salt;
    if (c.index > 0) r.first_choice = g.choices[0].id;
    r.token_text = false;  // decoded here
    fe_.track(c.id, g.client);
    auto self = shared_from_this();
    const RequestId id = c.id;
    g.client->submit_async(
        std::move(r),
        [self, id](const TokenEvent& event) {
          net::post(self->stream_.get_executor(), [self, id, event] { self->on_token(id, event); });
        },
        [self, id, fe = &fe_](RequestOutcome outcome) {
          fe->untrack(id);
          net::post(self->stream_.get_executor(),
                    [self, id, outcome = std::move(outcome)]() mutable { self->on_outcome(id, std::move(outcome)); });
        });
  }

  // Choices 1.. once choice 0's prompt KV is in its decode worker (its first
  // token) or choice 0 has ended: they find the prompt in that worker's
  // prefix cache (the full blocks; the rest is prefilled by the worker itself).
  void submit_others(Generation& g) {
    if (g.others_submitted) return;
    g.others_submitted = true;
    for (size_t i = 1; i < g.choices.size(); ++i) submit(g, g.choices[i]);
  }

  Generation* current(RequestId id) { return gen_ && gen_->choice(id) ? &*gen_ : nullptr; }

  void on_token(RequestId id, const TokenEvent& event) {
    Generation* g = current(id);
    if (!g || g->done) return;
    Choice& c = *g->choice(id);
    if (!c.finish.empty()) return;
    if (c.index == 0) g->cached_tokens = event.cached_tokens;
    const auto now = Clock::now();
    if (!g->first_token) {
      g->first_token = now;
      fe_.metrics.time_to_first_token.observe(seconds_between(g->accepted, now));
    } else if (c.last_token) {
      fe_.metrics.inter_token_latency.observe(seconds_between(*c.last_token, now));
    }
    c.last_token = now;
    const std::string piece = add_token(c, event.token, event.logprobs);
    if (g->request.stream && !piece.empty()) send_piece(*g, c, piece, "");
    if (c.index == 0) submit_others(*g);
    if (c.text->stopped()) {
      g->client->cancel(c.id);  // the rest is not wanted; the cancelled outcome is ignored
      finish_choice(*g, c, "stop");
    }
  }

  void on_outcome(RequestId id, RequestOutcome outcome) {
    Generation* g = current(id);
    if (!g) return;
    Choice& c = *g->choice(id);
    c.outcome_in = true;
    if (g->done || !c.finish.empty()) {  // stopped by a stop string, or the reply is over
      if (g->done && g->all_outcomes_in()) {
        record_end(*g, "");
        if (!busy_) gen_.reset();
      }
      return;
    }
    if (!outcome.ok()) {
      node_log(LogLevel::warning, "request " + std::to_string(id) + " failed: " + to_string(outcome.code) + ": " +
                                      outcome.message);
      record_end(*g, to_string(outcome.code));
      fail(*g, error_for_outcome(outcome.code, outcome.message));
      return;
    }
    if (c.index == 0) {
      g->cached_tokens = outcome.timings.cached_tokens;
      c.prompt_logprobs = std::move(outcome.prompt_logprobs);
      // (lost only with a decode worker that went down after its last token)
      if (g->request.sampling.prompt_logprobs >= 0 && c.prompt_logprobs.size() + 1 != g->request.prompt_tokens.size()) {
        record_end(*g, to_string(ErrorCode::worker_lost));
        fail(*g, error_for_outcome(ErrorCode::worker_lost,
                                   "the prompt's log probabilities were lost with a decode worker; try again"));
        return;
      }
    }
    // (every token came as an event: the client library passes on, before
    // the outcome, any that no event brought)
    const std::string rest = c.text->flush();
    if (g->request.stream && !rest.empty()) send_piece(*g, c, rest, "");
    finish_choice(*g, c, outcome.finish == FinishReason::eos ? "stop" : "length");
    if (c.index == 0) submit_others(*g);
  }

  // Its metrics, once: `error` empty for a success.
  void record_end(Generation& g, const std::string& error) {
    if (g.counted) return;
    g.counted = true;
    auto& m = fe_.metrics;
    m.num_requests_running.add(-1);
    m.e2e_request_latency.observe(seconds_between(g.accepted, Clock::now()));
    if (!error.empty()) {
      m.error(error).inc();
      return;
    }
    m.prompt_tokens.inc(double(g.request.prompt_tokens.size()));
    m.generation_tokens.inc(double(g.completion_tokens()));
  }

  void send_header_once(Generation& g) {
    if (g.header_sent) return;
    g.header_sent = true;
    bhttp::response<bhttp::empty_body> res{bhttp::status::ok, version_};
    res.set(bhttp::field::server, "disagg");
    res.set(bhttp::field::content_type, "text/event-stream");
    res.set(bhttp::field::cache_control, "no-cache");
    // HTTP/1.1: a chunked body on a connection that stays open; HTTP/1.0
    // knows no chunks: the body ends when the connection closes.
    chunked_ = version_ >= 11;
    if (!chunked_) keep_alive_ = false;
    res.keep_alive(keep_alive_);
    res.chunked(chunked_);
    std::ostringstream out;
    out << res.base();  // Beast writes the header
    enqueue(Out{Out::raw, out.str()});
    if (g.request.endpoint == Endpoint::chat)  // each choice's first chunk carries the role
      for (const Choice& c : g.choices)
        enqueue(Out{Out::chunk, sse_event(stream_chunk(Endpoint::chat, g.response_id, g.created, fe_.model.name, c.index,
                                                       "", "", true, g.request.include_usage))});
  }

  void send_piece(Generation& g, Choice& c, const std::string& piece, const std::string& finish_reason) {
    send_header_once(g);
    json chunk = stream_chunk(g.request.endpoint, g.response_id, g.created, fe_.model.name, c.index, piece,
                              finish_reason, false, g.request.include_usage);
    chunk["choices"][0] = with_token_data(g, c, chunk["choices"][0], true);
    enqueue(Out{Out::chunk, sse_event(chunk)});
  }

  // Choice c has ended ("stop" or "length"); the reply completes with the last.
  void finish_choice(Generation& g, Choice& c, const std::string& finish_reason) {
    c.finish = finish_reason;
    fe_.metrics.success(finish_reason).inc();
    if (g.request.stream) send_piece(g, c, "", finish_reason);
    if (g.all_finished()) complete(g);
  }

  // The reply of a request whose choices have all ended. best_of: the n of
  // highest cumulative log probability (ties: the lower index), in that order.
  void complete(Generation& g) {
    g.done = true;
    const int64_t prompt = int64_t(g.request.prompt_tokens.size()), completion = g.completion_tokens();
    if (g.all_outcomes_in()) record_end(g, "");
    if (g.request.stream) {
      if (g.request.include_usage)
        enqueue(Out{Out::chunk,
                    sse_event(usage_chunk(g.request.endpoint, g.response_id, g.created, fe_.model.name, prompt,
                                          completion, g.cached_tokens))});
      enqueue(Out{Out::chunk, kSseDone});
      finish_response(Out{Out::last, {}});
      return;
    }
    std::vector<Choice*> order;
    for (Choice& c : g.choices) order.push_back(&c);
    if (g.request.best_of > g.request.n)
      std::stable_sort(order.begin(), order.end(), [](const Choice* a, const Choice* b) {
        return a->cumulative_logprob() > b->cumulative_logprob();
      });
    json choices = json::array();
    for (int i = 0; i < g.request.n; ++i) {
      Choice& c = *order[size_t(i)];
      const std::string text = g.request.echo ? g.request.echo_text + c.text->text() : c.text->text();
      choices.push_back(with_token_data(g, c, choice_json(g.request.endpoint, i, text, c.finish), false));
    }
    send_json(200, response_json(g.request.endpoint, g.response_id, g.created, fe_.model.name, std::move(choices),
                                 prompt, completion, g.cached_tokens));
  }

  // The reply is an error: every choice still running is cancelled.
  void fail(Generation& g, const ApiError& e) {
    g.done = true;
    cancel_running(g);
    if (g.header_sent) {  // streaming began: the error goes in-band
      enqueue(Out{Out::chunk, sse_event(error_body(e))});
      enqueue(Out{Out::chunk, kSseDone});
      finish_response(Out{Out::last, {}});
    } else {
      send_error(e);
    }
  }

  void cancel_running(Generation& g) {
    for (Choice& c : g.choices)
      if (c.submitted && !c.outcome_in && c.finish.empty()) g.client->cancel(c.id);  // its blocks are freed at once
  }

  // ---- the client going away while its request runs
  // A read while a request runs: bytes the client pipelines are kept for the
  // next request; an error means the client is gone, which cancels it.
  void watch() {
    if (watching_ || closed_) return;
    watching_ = true;
    stream_.expires_never();  // the request's own deadline bounds the wait
    stream_.async_read_some(buffer_.prepare(kWatchReadBytes),
                            [self = shared_from_this()](beast::error_code ec, size_t n) { self->on_watch(ec, n); });
  }

  void on_watch(beast::error_code ec, size_t n) {
    watching_ = false;
    if (closed_) return;
    if (!ec) {
      buffer_.commit(n);
      if (!busy_) return read();
      if (buffer_.size() >= kMaxPipelinedBytes) return client_gone();
      return watch();
    }
    if (ec == net::error::operation_aborted && !busy_) return read();  // cancelled by end_response
    client_gone();
  }

  void client_gone() {
    if (gen_ && !gen_->done) {
      gen_->done = true;
      cancel_running(*gen_);
      record_end(*gen_, "cancelled");
    }
    close();
  }

  // ---- writing
  void enqueue(Out out) {
    if (closed_) return;
    const bool stream_event = out.kind == Out::chunk;
    if (out.kind != Out::raw && !chunked_) out.kind = Out::raw;  // HTTP/1.0 stream: plain bytes
    queued_bytes_ += out.data.size();
    queue_.push_back(std::move(out));
    // A streaming client that reads too slowly: its request is cancelled and
    // the connection closed, so one slow reader holds no more than this.
    // (A whole response, e.g. /metrics, is queued at once, whatever its size.)
    if (stream_event && queued_bytes_ > size_t(fe_.node.http_stream_buffer_bytes)) return client_gone();
    if (!writing_) write_next();
  }

  // The last write of a response: afterwards the next request is read.
  void finish_response(Out out) {
    response_complete_ = true;
    enqueue(std::move(out));
  }

  void write_next() {
    if (queue_.empty() || closed_) return;
    writing_ = true;
    // The stream's own timeout is for reading request headers; a write has
    // its own timer, so the pending watch read keeps no deadline of its own.
    stream_.expires_never();
    write_timer_.expires_after(kWriteTimeout);
    write_timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (!ec && self->writing_) self->client_gone();  // stopped reading
    });
    auto done = [self = shared_from_this()](beast::error_code ec, size_t) { self->on_write(ec); };
    const Out& out = queue_.front();
    switch (out.kind) {
      case Out::raw: net::async_write(stream_, net::buffer(out.data), done); break;
      case Out::chunk: net::async_write(stream_, bhttp::make_chunk(net::buffer(out.data)), done); break;
      case Out::last: net::async_write(stream_, bhttp::make_chunk_last(), done); break;
    }
  }

  void on_write(beast::error_code ec) {
    writing_ = false;
    write_timer_.cancel();
    if (ec) return client_gone();
    queued_bytes_ -= queue_.front().data.size();
    queue_.pop_front();
    if (!queue_.empty()) return write_next();
    if (response_complete_) end_response();
  }

  void end_response() {
    response_complete_ = false;
    busy_ = false;
    if (gen_ && gen_->done && gen_->all_outcomes_in()) {
      record_end(*gen_, "");
      gen_.reset();
    }
    if (!keep_alive_) return linger_close();
    if (watching_) {
      // The watch read ends with operation_aborted (or data) and then reads.
      beast::error_code ignored;
      stream_.socket().cancel(ignored);
      return;
    }
    read();
  }

  // Half-closes, reads (and drops) what the client still sends for a
  // moment, then closes: a client still sending a refused body reads the
  // reply instead of a connection reset.
  void linger_close() {
    if (closed_) return;
    if (watching_) return close();  // the request's body was read whole: nothing to drain
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
    stream_.expires_after(kLingerTimeout);
    drain();
  }
  void drain() {
    if (closed_) return;
    stream_.async_read_some(buffer_.prepare(kWatchReadBytes), [self = shared_from_this()](beast::error_code ec, size_t) {
      self->buffer_.clear();
      if (ec) return self->close();
      self->drain();
    });
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.close();
  }

  beast::tcp_stream stream_;
  Frontend& fe_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::optional<bhttp::response<bhttp::empty_body>> continue_;  // "100 Continue" while it is written
  unsigned version_ = 11;
  bool keep_alive_ = true;
  bool busy_ = false;               // a request is being answered
  bool watching_ = false;           // the watch read is pending
  bool writing_ = false;
  bool response_complete_ = false;  // the queue ends with the response's last bytes
  bool closed_ = false;
  bool chunked_ = true;             // streaming body in chunks (HTTP/1.1)
  std::deque<Out> queue_;
  size_t queued_bytes_ = 0;
  std::optional<Generation> gen_;
  net::steady_timer write_timer_;
};

void accept(Frontend& fe) {
  fe.acceptor.async_accept(net::make_strand(fe.ioc), [&fe](beast::error_code ec, tcp::socket socket) {
    if (!fe.acceptor.is_open()) return;
    if (!ec) {
      // Responses go out in several writes (headers, then each SSE chunk):
      // with Nagle's algorithm, a write waits for the ACK of the previous
      // one, which the client delays by up to 40 ms (reproduced: every
      // request after the first on a keep-alive connection took 44 ms).
      beast::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      std::make_shared<Session>(std::move(socket), fe)->start();
      return accept(fe);
    }
    // Out of file descriptors (or another failure): try again a little later
    // instead of spinning; the connections already open keep being served.
    node_log(LogLevel::warning, "accept failed: " + ec.message());
    auto timer = std::make_shared<net::steady_timer>(fe.ioc, kAcceptRetry);
    timer->async_wait([&fe, timer](beast::error_code) { accept(fe); });
  });
}

// Each connection is a file descriptor: allow as many as the hard limit does
// (thousands of idle keep-alive connections; the soft limit is often 1024).
void raise_open_files_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) node_log(LogLevel::warning, "cannot raise the open files limit");
  }
}

}  // namespace

int run_frontend(caf::actor_system& system, const NodeOptions& node, const DisaggConfig& cfg) {
  raise_open_files_limit();
  ServedModel model;
  std::optional<gpu::Tokenizer> tokenizer;
  try {
    auto checkpoint = gpu::Checkpoint::open(cfg.model);
    model.vocab_size = checkpoint->config().vocab_size;
    model.seq_len = checkpoint->config().seq_len;
    model.name = node.served_model_name.empty() ? checkpoint->name() : node.served_model_name;
    tokenizer.emplace(gpu::load_tokenizer(*checkpoint, cfg.tokenizer));
  } catch (const std::exception& e) {
    node_log(LogLevel::error, std::string("cannot load the model or tokenizer: ") + e.what());
    return 1;
  }
  model.max_prompt_bytes = cfg.max_prompt_bytes;
  model.created = unix_now();
  // node.chat-template: a built-in by name, or "auto": the one that renders
  // the model file's template (an unrecognised one is an error here); without
  // one in the file, llama2 for a SentencePiece vocabulary, plain otherwise.
  ChatTemplate tmpl = ChatTemplate::plain;
  std::string tmpl_source = "named by node.chat-template";
  if (node.chat_template != "auto") {
    tmpl = *gpu::parse_chat_template(node.chat_template);  // validated with the config
  } else if (const std::string& jinja = tokenizer->vocabulary().chat_template; !jinja.empty()) {
    const auto detected = gpu::detect_chat_template(jinja);
    if (!detected) {
      node_log(LogLevel::error, cfg.model + ": the model file's chat template is not one the built-ins render (" +
                                    gpu::chat_template_names() + "): name one with node.chat-template");
      return 1;
    }
    tmpl = *detected;
    tmpl_source = "the model file's";
  } else {
    tmpl = tokenizer->vocabulary().model == gpu::TokenizerModel::sentencepiece ? ChatTemplate::llama2 : ChatTemplate::plain;
    tmpl_source = "the model file has none";
  }

  auto fe = std::make_unique<Frontend>(system, node, cfg, model, std::move(*tokenizer), tmpl);
  beast::error_code ec;
  const auto address = net::ip::make_address(node.http_host, ec);
  const std::string wanted = node.http_host + ":" + std::to_string(node.http_port);
  if (ec) {
    node_log(LogLevel::error, "cannot listen on " + wanted + ": not an IP address");
    return 1;
  }
  const tcp::endpoint endpoint(address, node.http_port);
  fe->acceptor.open(endpoint.protocol(), ec);
  if (!ec) fe->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) fe->acceptor.bind(endpoint, ec);
  if (!ec) fe->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    node_log(LogLevel::error, "cannot listen on " + wanted + ": " + ec.message());
    return 1;
  }
  const std::string where = node.http_host + ":" + std::to_string(fe->acceptor.local_endpoint().port());
  accept(*fe);
  std::vector<std::thread> threads;
  for (int i = 0; i < node.http_threads; ++i) threads.emplace_back([&ioc = fe->ioc] { ioc.run(); });
  node_log("frontend serving http://" + where + " (model " + model.name + ", context " +
           std::to_string(model.seq_len) + ", chat template " + gpu::to_string(tmpl) + ": " + tmpl_source + ")");
  if (!node.ready_file.empty() && !write_ready_file(node.ready_file, where))
    node_log(LogLevel::error, "cannot write ready file " + node.ready_file);

  // Reach the router, and reach it again whenever it goes away; HTTP is
  // served meanwhile (/health says 503, requests get 503).
  caf::scoped_actor self{system};
  int code = 0;
  while (!node_stopping()) {
    auto router = connect_to_router(system, node);
    if (!router) {
      if (!node_stopping()) code = 1;
      break;
    }
    fe->set_router(*router);
    self->monitor(*router);
    bool down = false;
    while (!down && !node_stopping())
      self->receive([&](caf::down_msg&) { down = true; }, caf::after(100ms) >> [] {});
    if (down) {
      node_log(LogLevel::warning, "lost the router; reaching it again");
      fe->set_router(std::nullopt);
    }
  }
  node_log("stopping");
  net::post(fe->ioc, [&fe] {
    beast::error_code ignored;
    fe->acceptor.close(ignored);
  });
  fe->cancel_all();
  const auto deadline = Clock::now() + kShutdownDrain;
  while (fe->in_flight() > 0 && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
  const bool drained = fe->in_flight() == 0;
  fe->ioc.stop();
  for (auto& t : threads) t.join();
  fe->set_router(std::nullopt);
  if (!drained) {
    // A request actor may still call into the frontend: keep it alive.
    node_log(LogLevel::warning, "requests still in flight at exit");
    (void)fe.release();
  }
  return code;
}

}  // namespace disagg::http
