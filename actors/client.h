// A small C++ client of a disagg router (in-process or remote handle): submit
// a request, get each token as it is produced, get the one terminal outcome.
// Never hangs: every wait ends at the request's deadline plus a grace period.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>

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

// A Client's requests in flight, by id: the actor that is each one's
// client_actor, through which a cancel goes (the router takes a request's
// cancel from its client only). A cancel that comes before the actor has
// started is kept for it. Thread-safe; shared by the Client and its
// requests' actors (either may outlive the other).
class LiveRequests {
 public:
  // A submission of `id`: its ticket, or 0 when `id` is in flight already
  // (the first keeps the entry: a cancel of `id` reaches the first only; the
  // router refuses the duplicate while it holds the first).
  uint64_t open(RequestId id);
  // The request's actor has started: true when it was cancelled before.
  bool attach(RequestId id, uint64_t ticket, client_actor actor);
  // The request's outcome is out.
  void close(RequestId id, uint64_t ticket);
  // The actor to cancel `id` through; none (and the cancel is kept) while
  // it has not started; none for an id not in flight.
  std::optional<client_actor> cancel(RequestId id);
  size_t size() const;

 private:
  struct Entry {
    uint64_t ticket = 0;
    client_actor actor;
    bool cancelled = false;
  };
  mutable std::mutex mu_;
  uint64_t tickets_ = 0;
  std::unordered_map<RequestId, Entry> entries_;
};

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

  // Asks the router to cancel a request this Client submitted; its outcome
  // then says cancelled (unless it had already finished). Nothing for any
  // other id.
  void cancel(RequestId id);

  // Requests of this Client whose outcome is not out yet.
  size_t in_flight() const { return live_->size(); }

  // The router's view of the cluster, or nullopt when it does not answer in time.
  std::optional<RouterStatus> status(std::chrono::milliseconds timeout = std::chrono::seconds(5));

  const router_actor& router() const { return router_; }

 private:
  caf::actor_system& system_;
  router_actor router_;
  ClientOptions options_;
  uint64_t prefix_;
  std::atomic<uint32_t> counter_{0};
  std::shared_ptr<LiveRequests> live_ = std::make_shared<LiveRequests>();
};

}  // namespace disagg
