// A small C++ client of a disagg router (in-process or remote handle): submit
// a request, get each token as it is produced, get the one terminal outcome.
// Never hangs: every wait ends at the request's deadline plus a grace period.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <optional>

#include "caf/actor_system.hpp"
#include "messages/interfaces.h"

namespace disagg {

struct ClientOptions {
  int64_t default_deadline_ms = kDefaultDeadlineMs;  // used when a request sets none
  int64_t grace_ms = 5000;              // beyond the deadline, for the router's reply to arrive
};

// Called on a CAF thread, in token order, before the outcome is set.
using TokenCallback = std::function<void(const TokenEvent&)>;
// Called once, on a CAF thread, with the request's terminal outcome.
using OutcomeCallback = std::function<void(RequestOutcome)>;

class Client {
 public:
  Client(caf::actor_system& system, router_actor router, ClientOptions options = {});

  // A fresh id: a random per-client prefix and a counter.
  RequestId next_id();

  // Sends `request` (id 0 gets next_id(), deadline 0 the default). The future
  // always gets a value: the router's outcome, or timeout / worker_lost when
  // the router did not answer in time or went away.
  std::future<RequestOutcome> submit(GenerateRequest request, TokenCallback on_token = {});

  // The same without a future: `on_outcome` gets the outcome (exactly once,
  // by the deadline plus the grace period at the latest).
  void submit_async(GenerateRequest request, TokenCallback on_token, OutcomeCallback on_outcome);

  // submit(...).get()
  RequestOutcome generate(GenerateRequest request, TokenCallback on_token = {});

  // Asks the router to cancel; the request's outcome then says cancelled
  // (unless it had already finished).
  void cancel(RequestId id);

  // The router's view of the cluster, or nullopt when it does not answer in time.
  std::optional<RouterStatus> status(std::chrono::milliseconds timeout = std::chrono::seconds(5));

  const router_actor& router() const { return router_; }

 private:
  caf::actor_system& system_;
  router_actor router_;
  ClientOptions options_;
  uint64_t prefix_;
  std::atomic<uint32_t> counter_{0};
};

}  // namespace disagg
