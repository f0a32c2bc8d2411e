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

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include "actors/client.h"
#include "actors/log.h"
#include "metrics/exposer.h"  // (metrics::kAcceptRetry)
#include "node/relay.h"
#include "node/runtime.h"
#include "actors/timing.h"
#include "caf/all.hpp"
#include "model/checkpoint.h"
#include "http/api.h"
#include "http/generation.h"
#include "http/responses.h"
#include "http/target.h"
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
// The most a connection's read buffer holds: a request's header (the
// parser's 8 KiB), or a chunked body's size line or trailer, or the
// pipelined bytes above. The body limit counts a chunked body's data only,
// so a size line or trailer that never ends grew the buffer with all a
// client sent until the read's deadline; it fills this and gets a 400.
constexpr size_t kReadBufferBytes = 128 << 10;
// A connection closed after an error reply (413) is drained this long first,
// so the client reads the reply instead of a reset.
constexpr auto kLingerTimeout = 1s;
// How long GET /health waits for the router's status.
constexpr auto kHealthTimeout = 2s;
// After SIGTERM: how long requests still in flight get to end (they are
// cancelled first) before the process stops anyway.
constexpr auto kShutdownDrain = 5s;
// GET kModelPath + an id: that model's object.
const std::string kModelPath = "/v1/models/";

// Hex digits of a response id ("cmpl-<id>").
constexpr int kIdHexDigits = 16;

// ---------------------------------------------------------------- shared state

class Frontend {
 public:
  Frontend(caf::actor_system& system, const NodeOptions& node, const DisaggConfig& cfg, ServedModel model,
           gpu::Tokenizer tokenizer, ChatFormat chat)
      : ioc(node.http_threads), acceptor(net::make_strand(ioc)), system(system), node(node), cfg(cfg), model(std::move(model)),
        tokenizer(std::move(tokenizer)), chat(std::move(chat)), random_(std::random_device{}()) {}
  Frontend(const Frontend&) = delete;

  net::io_context ioc;
  // On a strand of its own: its accepts, their retries and the close at
  // shutdown run one at a time (with http-threads > 1, a close on one I/O
  // thread could meet an accept on another).
  tcp::acceptor acceptor;
  caf::actor_system& system;
  const NodeOptions& node;
  const DisaggConfig& cfg;
  const ServedModel model;
  const gpu::Tokenizer tokenizer;
  const ChatFormat chat;
  metrics::DisaggMetrics& metrics = metrics::disagg_metrics();
  const GenerationContext generation{model, tokenizer, metrics};

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
  // GET /health's questions to the router out now: their answers post to a
  // connection's executor, so shutdown waits for them too (they end within
  // kHealthTimeout) before it stops the I/O threads and frees the context.
  void probe_started() {
    std::lock_guard<std::mutex> lock(mutex_);
    ++probes_;
  }
  void probe_ended() {
    std::lock_guard<std::mutex> lock(mutex_);
    --probes_;
  }
  size_t in_flight() {
    std::lock_guard<std::mutex> lock(mutex_);
    return in_flight_.size() + probes_;
  }

 private:
  std::mutex mutex_;
  std::shared_ptr<Client> client_;
  std::mt19937_64 random_;
  std::map<RequestId, std::shared_ptr<Client>> in_flight_;
  size_t probes_ = 0;
};

// ---------------------------------------------------------------- one connection

// The HTTP transport of one connection: its requests read (limits,
// timeouts, "100-continue"), routed, and their responses written in order
// (whole, or as SSE events with a bound on what a slow reader holds); a
// client that goes away while its request runs cancels it. The OpenAI
// generation a request starts is http/generation.h's, writing through this
// connection (ReplySink).
class Session : public std::enable_shared_from_this<Session>, private ReplySink {
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
    } else if (path == "/v1/responses") {  // OpenAI's Responses API, as the chat request it stands for
      if (only(bhttp::verb::post)) start_generation(Endpoint::chat, req.body(), true);
    } else if (path == "/tokenize" || path == "/detokenize") {  // vLLM's: at the root
      if (only(bhttp::verb::post)) {
        try {
          send_json(200, path == "/tokenize" ? tokenize_response(req.body(), fe_.model, fe_.tokenizer, fe_.chat)
                                             : detokenize_response(req.body(), fe_.model, fe_.tokenizer));
        } catch (const ApiError& e) {
          send_error(e);
        } catch (const std::exception& e) {  // a bug of ours (they throw ApiError only): this request fails, not the node
          node_log(LogLevel::error, "internal error in " + path + ": " + e.what());
          ApiError err = error_for_outcome(ErrorCode::internal, "internal error in " + path);
          fe_.metrics.error("internal").inc();
          send_error(err);
        }
      }
    } else if (path == "/v1/models") {
      if (only(bhttp::verb::get)) send_json(200, models_response(fe_.model));
    } else if (path.rfind(kModelPath, 0) == 0) {  // OpenAI's "retrieve model": the id may be an encoded "org/name"
      if (only(bhttp::verb::get)) {
        try {
          const std::optional<std::string> decoded = decoded_path(target);
          send_json(200, model_response(fe_.model, decoded ? decoded->substr(kModelPath.size()) : std::string()));
        } catch (const ApiError& e) {
          send_error(e);
        }
      }
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
    fe_.probe_started();
    // (the reference goes before probe_ended, as a request's before its
    // untrack: the probe's actor destroys its handlers whenever it likes)
    auto holder = std::make_shared<std::shared_ptr<Session>>(shared_from_this());
    auto reply = [holder, fe = &fe_](std::optional<RouterStatus> status) {
      std::shared_ptr<Session> session = std::move(*holder);
      if (!session) return;
      net::post(session->stream_.get_executor(), [session, status] { session->on_health(status); });
      session.reset();
      fe->probe_ended();  // (after the post: the drain waits for it)
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
    // (busy_ stays until end_response, after the write: cleared here, a
    // pipelined request's watch read could start a read under the one
    // end_response starts)
    if (closed_) return;
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

  // ---- generation (http/generation.h)
  void start_generation(Endpoint endpoint, const std::string& body, bool responses = false) {
    ApiRequest request;
    try {
      const std::string chat = responses ? chat_body_of_responses(body) : std::string();
      request = parse_request(endpoint, responses ? chat : body, fe_.model, fe_.tokenizer, fe_.chat,
                              [this] { return fe_.random_u64(); });
      if (responses) fit_reply_logprobs(request);  // (a Responses stream ends with the whole response)
    } catch (const ApiError& e) {
      fe_.metrics.error("invalid_request").inc();
      send_error(responses ? as_responses_error(e) : e);
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
    if (gen_) gen_->record_end("");  // stopped by a stop string; its outcome never came
    gen_.reset();  // (before the sink it may write to)
    responses_.reset();
    const std::string id = fe_.new_id(request.endpoint == Endpoint::completions ? "cmpl-" : "chatcmpl-");
    ReplySink* sink = this;
    if (responses) {
      responses_ = std::make_unique<ResponsesSink>(static_cast<ReplySink&>(*this), fe_.new_id("resp_"), unix_now(),
                                                   fe_.model.name, body);
      sink = responses_.get();
    }
    busy_ = true;
    gen_ = std::make_unique<Generation>(fe_.generation, *sink, client, std::move(request), id,
                                        [this, client](GenerateRequest r) { submit(client, std::move(r)); });
    gen_->start();
    watch();
  }

  // A choice's request to the router, its events and outcome brought back
  // to this connection's strand.
  void submit(const std::shared_ptr<Client>& client, GenerateRequest r) {
    const RequestId id = r.id;
    fe_.track(id, client);
    auto self = shared_from_this();
    client->submit_async(
        std::move(r),
        [self, id](const TokenEvent& event) {
          net::post(self->stream_.get_executor(), [self, id, event] { self->on_token(id, event); });
        },
        [self, id, fe = &fe_](RequestOutcome outcome) mutable {
          // This closure's reference goes before the untrack: the shutdown's
          // drain ends at it and frees the I/O context, which no reference
          // to a connection may outlive (the Client destroys the callbacks
          // as the outcome comes; the token callback's went before).
          std::shared_ptr<Session> session = std::move(self);
          net::post(session->stream_.get_executor(), [session, id, outcome = std::move(outcome)]() mutable {
            session->on_outcome(id, std::move(outcome));
          });
          session.reset();
          fe->untrack(id);  // (after the post: the drain waits for it, then stops the I/O threads)
        });
  }

  void on_token(RequestId id, const TokenEvent& event) {
    if (gen_ && gen_->owns(id)) gen_->on_token(id, event);
  }

  void on_outcome(RequestId id, RequestOutcome outcome) {
    if (!gen_ || !gen_->owns(id)) return;
    gen_->on_outcome(id, std::move(outcome));
    if (gen_->done() && gen_->all_outcomes_in() && !busy_) {  // replied already
      gen_.reset();
      responses_.reset();
    }
  }

  // ReplySink: the generation's reply.
  void reply_json(int status, const json& body) override { send_json(status, body); }
  void reply_error(const ApiError& e) override { send_error(e); }
  void open_events() override {
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
  }
  void event(std::string data) override { enqueue(Out{Out::chunk, std::move(data)}); }
  void end_events() override { finish_response(Out{Out::last, {}}); }

  // ---- the client going away while its request runs
  // A read while a request runs: bytes the client pipelines are kept for the
  // next request; an error means the client is gone, which cancels it.
  void watch() {
    if (watching_ || closed_) return;
    if (buffer_.size() + kWatchReadBytes > buffer_.max_size()) return client_gone();  // (pipelined past the bound)
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
    if (gen_) gen_->abandon();
    close();
  }

  // ---- writing
  void enqueue(Out out) {
    if (closed_) return;
    const bool stream_event = out.kind == Out::chunk;
    if (out.kind != Out::raw && !chunked_) out.kind = Out::raw;  // HTTP/1.0 stream: plain bytes
    // A streaming client that reads too slowly: its request is cancelled and
    // the connection closed, so one slow reader holds no more than this
    // (and one burst). What counts is what was queued when the burst this
    // event belongs to began (the events one handler makes at once, which no
    // write can drain meanwhile): a burst is never refused for its own size
    // (a tool call's last chunk carries every token's log probabilities;
    // cut there, a stream lost its end and [DONE] with a reader keeping up).
    // (A whole response, e.g. /metrics, is queued at once, whatever its size.)
    if (!in_burst_) {
      in_burst_ = true;
      queued_before_burst_ = queued_bytes_;
      net::post(stream_.get_executor(), [self = shared_from_this()] { self->in_burst_ = false; });
    }
    if (stream_event && queued_before_burst_ > size_t(fe_.node.http_stream_buffer_bytes)) return client_gone();
    queued_bytes_ += out.data.size();
    queue_.push_back(std::move(out));
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
    if (gen_ && gen_->done() && gen_->all_outcomes_in()) {
      gen_->record_end("");
      gen_.reset();
      responses_.reset();
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
    buffer_.clear();  // (what it holds is dropped too: a full buffer has no room for the drain)
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
  beast::flat_buffer buffer_{kReadBufferBytes};
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
  std::optional<bhttp::response<bhttp::empty_body>> continue_;  // "100 Continue" while it is written
  unsigned version_ = 11;
  bool keep_alive_ = true;
  bool busy_ = false;               // a request is being answered
  bool in_burst_ = false;           // events are being queued by one handler (enqueue)
  size_t queued_before_burst_ = 0;  // queued_bytes_ when that began
  bool watching_ = false;           // the watch read is pending
  bool writing_ = false;
  bool response_complete_ = false;  // the queue ends with the response's last bytes
  bool closed_ = false;
  bool chunked_ = true;             // streaming body in chunks (HTTP/1.1)
  std::deque<Out> queue_;
  size_t queued_bytes_ = 0;
  std::unique_ptr<ResponsesSink> responses_;  // /v1/responses: the generation writes through it (outlives gen_)
  std::unique_ptr<Generation> gen_;
  net::steady_timer write_timer_;
};

// A client whose host is gone (a cut cable, a crash: no FIN, no RST) sends
// nothing, and a stream's writes land in the socket's buffer, so the
// connection would look alive until the kernel gave up retransmitting (15
// minutes and more). TCP itself finds it out instead: data unacknowledged
// for `dead_ms` ends the connection (TCP_USER_TIMEOUT), and one sent no data
// is probed from a third of that on (keep-alive), which the same bound ends.
// The pending watch read then fails: the request is cancelled, its blocks
// freed.
void watch_for_a_dead_peer(tcp::socket& socket, int64_t dead_ms) {
  const int fd = socket.native_handle();
  const unsigned user_timeout = unsigned(dead_ms);
  const int on = 1, idle = std::max(1, int(dead_ms / 3000)), probes = 3;
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout, sizeof user_timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
}

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
      watch_for_a_dead_peer(socket, fe.node.http_dead_client_ms);
      std::make_shared<Session>(std::move(socket), fe)->start();
      return accept(fe);
    }
    // Out of file descriptors (or another failure): try again a little later
    // instead of spinning; the connections already open keep being served.
    node_log(LogLevel::warning, "accept failed: " + ec.message());
    metrics::accept_later(fe.acceptor.get_executor(), [&fe] { accept(fe); });
  });
}

}  // namespace

namespace {

// The model as the API serves it, its tokenizer and chat template (logged
// and nullopt when they cannot be loaded).
struct Served {
  ServedModel model;
  std::optional<gpu::Tokenizer> tokenizer;
  ChatFormat chat;
  std::string chat_source;
};
std::optional<Served> load_served(const NodeOptions& node, const DisaggConfig& cfg) {
  Served s;
  try {
    auto checkpoint = gpu::Checkpoint::open(cfg.model, cfg.weight_cache);
    s.model.vocab_size = checkpoint->config().vocab_size;
    s.model.seq_len = checkpoint->config().seq_len;
    s.model.name = node.served_model_name.empty() ? checkpoint->name() : node.served_model_name;
    s.tokenizer.emplace(gpu::load_tokenizer(*checkpoint, cfg.tokenizer));
  } catch (const std::exception& e) {
    node_log(LogLevel::error, std::string("cannot load the model or tokenizer: ") + e.what());
    return std::nullopt;
  }
  s.model.max_prompt_bytes = cfg.max_prompt_bytes;
  s.model.created = unix_now();
  const auto chosen = gpu::choose_chat_template(node.chat_template, s.tokenizer->vocabulary());
  if (!chosen.error.empty()) {
    node_log(LogLevel::error, cfg.model + ": " + chosen.error);
    return std::nullopt;
  }
  s.chat = chosen.format;
  s.chat.trusts_request_templates = node.trust_request_chat_template;
  s.chat_source = chosen.source;
  return s;
}

// Binds node.http-host:http-port; the address it listens on ("" and logged when it cannot).
std::string listen(Frontend& fe, const NodeOptions& node) {
  beast::error_code ec;
  const auto address = net::ip::make_address(node.http_host, ec);
  const std::string wanted = node.http_host + ":" + std::to_string(node.http_port);
  if (ec) {
    node_log(LogLevel::error, "cannot listen on " + wanted + ": not an IP address");
    return {};
  }
  const tcp::endpoint endpoint(address, node.http_port);
  fe.acceptor.open(endpoint.protocol(), ec);
  if (!ec) fe.acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) fe.acceptor.bind(endpoint, ec);
  if (!ec) fe.acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    node_log(LogLevel::error, "cannot listen on " + wanted + ": " + ec.message());
    return {};
  }
  return node.http_host + ":" + std::to_string(fe.acceptor.local_endpoint().port());
}

// Reaches the router, and reaches it again whenever it goes away, until the
// node stops; HTTP is served meanwhile (/health says 503, requests get 503).
// 1 when the router could not be reached within node.connect-timeout-ms.
int follow_router(caf::actor_system& system, const NodeOptions& node, Frontend& fe) {
  caf::scoped_actor self{system};
  while (!node_stopping()) {
    auto router = connect_to_router(system, node);
    if (!router) return node_stopping() ? 0 : 1;
    fe.set_router(*router);
    self->monitor(*router);
    bool down = false;
    while (!down && !node_stopping())
      self->receive([&](caf::down_msg&) { down = true; }, caf::after(100ms) >> [] {});
    if (down) {
      node_log(LogLevel::warning, "lost the router; reaching it again");
      fe.set_router(std::nullopt);
    }
  }
  return 0;
}

// Stops accepting, cancels the requests in flight and gives them
// kShutdownDrain to end, then stops the I/O threads.
void drain_and_stop(std::unique_ptr<Frontend> fe, std::vector<std::thread>& threads) {
  net::post(fe->acceptor.get_executor(), [&fe] {
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
}

}  // namespace

int run_frontend(caf::actor_system& system, const NodeOptions& node, const DisaggConfig& cfg) {
  auto served = load_served(node, cfg);
  if (!served) return 1;
  auto fe = std::make_unique<Frontend>(system, node, cfg, served->model, std::move(*served->tokenizer), served->chat);
  const std::string where = listen(*fe, node);
  if (where.empty()) return 1;
  accept(*fe);
  std::vector<std::thread> threads;
  for (int i = 0; i < node.http_threads; ++i) threads.emplace_back([&ioc = fe->ioc] { ioc.run(); });
  node_log("frontend serving http://" + where + " (model " + served->model.name + ", context " +
           std::to_string(served->model.seq_len) + ", chat template: " + served->chat_source + ")");
  if (!node.ready_file.empty() && !write_ready_file(node.ready_file, where))
    node_log(LogLevel::error, "cannot write ready file " + node.ready_file);
  const int code = follow_router(system, node, *fe);
  node_log("stopping");
  drain_and_stop(std::move(fe), threads);
  return code;
}

}  // namespace disagg::http
