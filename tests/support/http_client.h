// One HTTP/1.1 request (to 127.0.0.1 unless told) on a fresh connection (Boost.Beast,
// blocking, the reply bounded by a receive timeout), and a sample's value in
// a Prometheus text: the cluster tests' client of the frontend and of every
// node's /metrics.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include <boost/beast/http/verb.hpp>

namespace disagg::test {

struct HttpReply {
  int status = 0;
  std::string body;
  std::string content_type;
  std::string retry_after;
};

HttpReply http_request(uint16_t port, boost::beast::http::verb verb, const std::string& target,
                       const std::string& body = "", std::chrono::seconds timeout = std::chrono::seconds(60));
// The same to `host` (an IP address: another host of a NetLab).
HttpReply http_request(const std::string& host, uint16_t port, boost::beast::http::verb verb, const std::string& target,
                       const std::string& body = "", std::chrono::seconds timeout = std::chrono::seconds(60));

// GET /metrics.
std::string scrape_metrics(uint16_t port);

// The value of the sample line "name value" in a /metrics text, or -1.
double metric_sample(const std::string& text, const std::string& name);

}  // namespace disagg::test
