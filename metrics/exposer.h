// Serves a Registry as GET /metrics (Prometheus text format) over HTTP/1.1 on
// its own thread (Boost.Beast): a node's metrics port. Scrapes read the
// atomics; they never wait for an actor.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/steady_timer.hpp>

#include "metrics/metrics.h"

namespace disagg::metrics {

// After a failed accept (no file descriptor left, ENFILE, ENOBUFS), the next
// try: the exposer's, the port guard's and the HTTP frontend's. (At once,
// the same error came back at once: a core spun.)
constexpr std::chrono::milliseconds kAcceptRetry{100};

// Runs `accept_again` on `executor` kAcceptRetry from now (not when the wait
// is cancelled: the acceptor is closing).
template <class Executor, class F>
void accept_later(const Executor& executor, F accept_again) {
  auto timer = std::make_shared<boost::asio::steady_timer>(executor, kAcceptRetry);
  timer->async_wait([timer, accept_again](const boost::system::error_code& cancelled) {
    if (!cancelled) accept_again();
  });
}

// Scrapers connected at once; one more is closed as it comes (a scraper
// that keeps its connection alive holds a file descriptor for good).
constexpr int kMaxScrapers = 16;

class Exposer {
 public:
  // Listens on host:port (0: any free port) at once. Throws
  // std::runtime_error("cannot listen on HOST:PORT: <reason>").
  Exposer(const std::string& host, uint16_t port, const Registry& registry);
  ~Exposer();  // stops listening, closes connections, joins its thread
  Exposer(const Exposer&) = delete;
  Exposer& operator=(const Exposer&) = delete;

  uint16_t port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace disagg::metrics
