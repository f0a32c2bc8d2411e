#include "actors/client.h"

#include <algorithm>
#include <random>

#include "actors/errors.h"
#include "actors/request_metrics.h"
#include "caf/all.hpp"

namespace disagg {

namespace {

// One short-lived actor per request: it receives the token events (it is the
// request's client_actor) and the router's reply, then quits. The events
// come from the decode worker (direct-token-streams) or the router, the
// reply from the router: each index is passed on once and in order (after a
// migration the new decode worker streams again from where the router's
// record ends, which may be before what arrived here), and a completed
// outcome's tokens that no event brought (late, or lost with a worker) are
// passed on before the outcome.
client_actor::behavior_type request_behavior(client_actor::pointer self, router_actor router,
                                             GenerateRequest request, TokenCallback on_token_callback,
                                             OutcomeCallback outcome_callback, std::chrono::milliseconds wait,
                                             std::shared_ptr<LiveRequests> live, uint64_t ticket) {
  const RequestId id = request.id;
  auto next = std::make_shared<int32_t>(0);  // the index of the next token to pass on
  // The caller's callbacks, held once (the handlers share them): both are
  // destroyed as the outcome is passed on, the token callback before it, so
  // what they hold (a connection of the HTTP frontend) is released by then,
  // not whenever this actor's handlers are destroyed after it quits.
  struct Callbacks {
    TokenCallback on_token;
    OutcomeCallback result;
  };
  auto callbacks = std::make_shared<Callbacks>(Callbacks{std::move(on_token_callback), std::move(outcome_callback)});
  auto on_token = [callbacks](const TokenEvent& event) {
    if (callbacks->on_token) callbacks->on_token(event);
  };
  auto result = [callbacks, live, id, ticket](RequestOutcome outcome) {
    live->close(id, ticket);
    callbacks->on_token = nullptr;
    OutcomeCallback once = std::move(callbacks->result);
    callbacks->result = nullptr;
    if (once) once(std::move(outcome));
  };
  auto deliver = [=](RequestOutcome outcome) {
    if (outcome.ok() && size_t(*next) < outcome.tokens.size()) {
      record_tokens_from_outcome(outcome.tokens.size() - size_t(*next));
      for (; size_t(*next) < outcome.tokens.size(); ++*next)
        on_token(TokenEvent{id, *next, outcome.tokens[size_t(*next)], {}, outcome.timings.cached_tokens,
                            size_t(*next) < outcome.logprobs.size() ? outcome.logprobs[size_t(*next)]
                                                                    : TokenLogprobs{}});
    }
    result(std::move(outcome));
  };
  // The router going away (its process killed, its node's connection lost)
  // ends the request at once: its reply can no longer come.
  self->monitor(router);
  self->set_down_handler([=](caf::down_msg& down) {
    result(make_failure(id, ErrorCode::worker_lost, "the router went away (" + caf::to_string(down.reason) + ")"));
    self->quit();
  });
  self->request(router, wait, generate_atom::value, std::move(request),
                caf::actor_cast<client_actor>(self))
      .then(
          [=](RequestOutcome& outcome) {
            deliver(std::move(outcome));
            self->quit();
          },
          [=](caf::error& e) {
            result(make_failure(id, code_of(e), describe("router", e)));
            self->quit();
          });
  // (after the request: a cancel from this actor reaches the router behind it)
  if (live->attach(id, ticket, caf::actor_cast<client_actor>(self))) self->send(router, cancel_atom::value, id);
  return {
      [=](token_atom, TokenEvent& event) {
        // (an index past the next one: an earlier one was lost; the outcome brings them all)
        if (event.id != id || event.index != *next) return;
        ++*next;
        on_token(event);
      },
  };
}

}  // namespace

Client::Client(caf::actor_system& system, router_actor router, ClientOptions options)
    : system_(system), router_(std::move(router)), options_(options) {
  std::random_device rd;
  prefix_ = (uint64_t(rd()) << 32) ^ uint64_t(rd());
  prefix_ &= 0xffffffff00000000ull;  // the low half counts
  if (prefix_ == 0) prefix_ = uint64_t(1) << 32;  // id 0 means "choose one"
}

RequestId Client::next_id() { return prefix_ | uint64_t(++counter_); }

std::future<RequestOutcome> Client::submit(GenerateRequest request, TokenCallback on_token) {
  auto result = std::make_shared<std::promise<RequestOutcome>>();
  auto future = result->get_future();
  submit_async(std::move(request), std::move(on_token),
               [result](RequestOutcome outcome) { result->set_value(std::move(outcome)); });
  return future;
}

void Client::submit_async(GenerateRequest request, TokenCallback on_token, OutcomeCallback on_outcome) {
  if (request.id == 0) request.id = next_id();
  if (request.deadline_ms == 0) request.deadline_ms = options_.default_deadline_ms;
  // A deadline outside [0, kMaxDeadlineMs] is the router's to reject (at
  // once); clamped here so the wait itself cannot overflow.
  const auto wait = std::chrono::milliseconds(std::clamp<int64_t>(request.deadline_ms, 0, kMaxDeadlineMs) +
                                              options_.grace_ms);
  const uint64_t ticket = live_->open(request.id);
  system_.spawn(request_behavior, router_, std::move(request), std::move(on_token), std::move(on_outcome), wait,
                live_, ticket);
}

RequestOutcome Client::generate(GenerateRequest request, TokenCallback on_token) {
  return submit(std::move(request), std::move(on_token)).get();
}

void Client::cancel(RequestId id) {
  // (as the request's own actor: the router takes a cancel from no one else)
  if (auto actor = live_->cancel(id)) caf::send_as(*actor, router_, cancel_atom::value, id);
}

uint64_t LiveRequests::open(RequestId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, fresh] = entries_.try_emplace(id);
  if (!fresh) return 0;
  it->second.ticket = ++tickets_;
  return it->second.ticket;
}

bool LiveRequests::attach(RequestId id, uint64_t ticket, client_actor actor) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (ticket == 0 || it == entries_.end() || it->second.ticket != ticket) return false;
  it->second.actor = std::move(actor);
  return it->second.cancelled;
}

void LiveRequests::close(RequestId id, uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (ticket != 0 && it != entries_.end() && it->second.ticket == ticket) entries_.erase(it);
}

std::optional<client_actor> LiveRequests::cancel(RequestId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return std::nullopt;
  if (!it->second.actor) {
    it->second.cancelled = true;  // (the actor sends it once it starts)
    return std::nullopt;
  }
  return it->second.actor;
}

size_t LiveRequests::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.size();
}

std::optional<RouterStatus> Client::status(std::chrono::milliseconds timeout) {
  std::optional<RouterStatus> out;
  caf::scoped_actor self{system_};
  self->request(router_, timeout, status_atom::value)
      .receive([&](RouterStatus& s) { out = std::move(s); }, [&](caf::error&) {});
  return out;
}

}  // namespace disagg
