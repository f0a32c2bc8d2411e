#include "support/http_client.h"

#include <sys/socket.h>
#include <sys/time.h>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace disagg::test {

namespace net = boost::asio;
namespace bhttp = boost::beast::http;

HttpReply http_request(uint16_t port, bhttp::verb verb, const std::string& target, const std::string& body,
                       std::chrono::seconds timeout) {
  return http_request("127.0.0.1", port, verb, target, body, timeout);
}

HttpReply http_request(const std::string& host, uint16_t port, bhttp::verb verb, const std::string& target,
                       const std::string& body, std::chrono::seconds timeout) {
  net::io_context ioc;
  net::ip::tcp::socket socket(ioc);
  socket.connect(net::ip::tcp::endpoint(net::ip::make_address(host), port));
  timeval tv{timeout.count(), 0};
  ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  bhttp::request<bhttp::string_body> req{verb, target, 11};
  req.set(bhttp::field::host, host);
  if (!body.empty()) req.set(bhttp::field::content_type, "application/json");
  req.body() = body;
  req.prepare_payload();
  bhttp::write(socket, req);
  boost::beast::flat_buffer buffer;
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(64 << 20);
  bhttp::read(socket, buffer, parser);
  const auto& res = parser.get();
  return HttpReply{int(res.result_int()), res.body(), std::string(res[bhttp::field::content_type]),
                   std::string(res[bhttp::field::retry_after])};
}

std::string scrape_metrics(uint16_t port) { return http_request(port, bhttp::verb::get, "/metrics").body; }

double metric_sample(const std::string& text, const std::string& name) {
  const size_t at = text.find("\n" + name + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name.size() + 2));
}

}  // namespace disagg::test
