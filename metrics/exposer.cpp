#include "metrics/exposer.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>
#include <stdexcept>
#include <thread>

namespace disagg::metrics {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;

namespace {

// A scraper that sends nothing (or reads nothing) for this long is dropped.
constexpr std::chrono::seconds kIdleTimeout{30};
// A scrape request has no body worth the name.
constexpr uint64_t kRequestBodyLimit = 4096;

class Session : public std::enable_shared_from_this<Session> {
 public:
  // `open` counts the sessions alive (the exposer's one thread only).
  Session(tcp::socket socket, const Registry& registry, int& open)
      : stream_(std::move(socket)), registry_(registry), open_(open) {
    ++open_;
  }
  ~Session() { --open_; }

  void start() { read(); }

 private:
  void read() {
    parser_.emplace();
    parser_->body_limit(kRequestBodyLimit);
    stream_.expires_after(kIdleTimeout);
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](beast::error_code ec, size_t) { self->on_read(ec); });
  }

  void on_read(beast::error_code ec) {
    if (ec) {
      stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
      return;
    }
    const auto& req = parser_->get();
    auto res = std::make_shared<http::response<http::string_body>>();
    res->version(req.version());
    res->keep_alive(req.keep_alive());
    const std::string target(req.target());
    const bool metrics_path = target == "/metrics" || target.rfind("/metrics?", 0) == 0;
    if (metrics_path && (req.method() == http::verb::get || req.method() == http::verb::head)) {
      res->result(http::status::ok);
      res->set(http::field::content_type, kTextContentType);
      res->body() = registry_.render();
    } else if (metrics_path) {
      res->result(http::status::method_not_allowed);
      res->set(http::field::allow, "GET, HEAD");
      res->set(http::field::content_type, "text/plain");
      res->body() = "use GET /metrics\n";
    } else {
      res->result(http::status::not_found);
      res->set(http::field::content_type, "text/plain");
      res->body() = "not found: this port serves GET /metrics\n";
    }
    res->prepare_payload();
    if (req.method() == http::verb::head) res->body().clear();
    stream_.expires_after(kIdleTimeout);
    http::async_write(stream_, *res, [self = shared_from_this(), res](beast::error_code ec, size_t) {
      if (ec || !res->keep_alive()) {
        self->stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
        return;
      }
      self->read();
    });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  const Registry& registry_;
  int& open_;
};

}  // namespace

struct Exposer::Impl {
  net::io_context ioc{1};
  tcp::acceptor acceptor{ioc};
  const Registry& registry;
  std::thread thread;

  explicit Impl(const Registry& r) : registry(r) {}

  int open = 0;  // sessions alive

  void accept() {
    acceptor.async_accept(net::make_strand(ioc), [this](beast::error_code ec, tcp::socket socket) {
      if (ec == net::error::operation_aborted || !acceptor.is_open()) return;
      if (ec) return accept_later(ioc.get_executor(), [this] { accept(); });
      if (open < kMaxScrapers) std::make_shared<Session>(std::move(socket), registry, open)->start();
      // (else closed as `socket` goes)
      accept();
    });
  }
};

Exposer::Exposer(const std::string& host, uint16_t port, const Registry& registry)
    : impl_(std::make_unique<Impl>(registry)) {
  const std::string where = host + ":" + std::to_string(port);
  beast::error_code ec;
  const auto address = net::ip::make_address(host, ec);
  if (ec) throw std::runtime_error("cannot listen on " + where + ": not an IP address");
  const tcp::endpoint endpoint(address, port);
  auto& acceptor = impl_->acceptor;
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) throw std::runtime_error("cannot listen on " + where + ": " + ec.message());
  impl_->accept();
  impl_->thread = std::thread([this] { impl_->ioc.run(); });
}

Exposer::~Exposer() {
  net::post(impl_->ioc, [this] {
    beast::error_code ignored;
    impl_->acceptor.close(ignored);  // (a retry that fires later finds it closed)
  });
  impl_->ioc.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

uint16_t Exposer::port() const { return impl_->acceptor.local_endpoint().port(); }

}  // namespace disagg::metrics
