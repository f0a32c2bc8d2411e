// Serves a Registry as GET /metrics (Prometheus text format) over HTTP/1.1 on
// its own thread (Boost.Beast): a node's metrics port. Scrapes read the
// atomics; they never wait for an actor.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "metrics/metrics.h"

namespace disagg::metrics {

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
