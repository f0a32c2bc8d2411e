#include "node/relay.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include "actors/log.h"
#include "actors/senders.h"
#include "actors/timing.h"
#include "node/tls.h"
#include "caf/all.hpp"
#include "caf/io/middleman.hpp"

namespace disagg {

namespace {

using refresh_atom = caf::atom_constant<caf::atom("refresh")>;
using endpoint_atom = caf::atom_constant<caf::atom("endpoint")>;
using retry_atom = caf::atom_constant<caf::atom("retry")>;
using probed_atom = caf::atom_constant<caf::atom("probed")>;

// How long a decode endpoint may take to answer a TCP connection before the
// gate gives up on it for this round. CAF 0.17's middleman connects with a
// blocking connect() inside its one actor: to an address that drops the
// SYNs that took the kernel's retries (about 127 s), and every other
// connection of the node (to other decode workers, to a restarted router)
// waited behind it. So an endpoint is asked first, here, with a deadline.
constexpr std::chrono::milliseconds kDialProbe{2000};

// Whether host:port accepts a TCP connection within `limit` (`why` says
// why not). Blocking: run on a thread of its own.
bool answers_within(const std::string& host, uint16_t port, std::chrono::milliseconds limit, std::string& why) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int e = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found); e != 0) {
    why = std::string("cannot resolve ") + host + ": " + ::gai_strerror(e);
    return false;
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  bool ok = false;
  why = "no address";
  for (addrinfo* a = found; a && !ok; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      why = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      ok = true;
    } else if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      const int ready = ::poll(&p, 1, int(std::max<int64_t>(0, left.count())));
      int error = 0;
      socklen_t length = sizeof error;
      if (ready == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &length) == 0 && error == 0) ok = true;
      else why = ready == 0 ? "no answer within " + std::to_string(limit.count()) + " ms" : std::strerror(error ? error : errno);
    } else {
      why = std::strerror(errno);
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return ok;
}

// "host:port" -> (host, port); port 0 when malformed.
std::pair<std::string, uint16_t> split_endpoint(const std::string& endpoint) {
  const auto colon = endpoint.rfind(':');
  if (colon == std::string::npos) return {endpoint, 0};
  const std::string port = endpoint.substr(colon + 1);
  char* end = nullptr;
  const unsigned long value = std::strtoul(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || value == 0 || value > 65535) return {endpoint, 0};
  return {endpoint.substr(0, colon), uint16_t(value)};
}

// ---------------------------------------------------------------- the prefill gate

using gate_actor = prefill_actor::extend<caf::reacts_to<refresh_atom>,
                                         caf::reacts_to<router_atom, router_actor>,
                                         // a dial's probe: endpoint, worker, whether it answered, why not
                                         caf::reacts_to<probed_atom, std::string, std::string, bool, std::string>,
                                         // its prefill worker's KV events, passed on by the relay
                                         caf::reacts_to<kv_events_atom, KvEvents>>;

struct WaitingJob {
  PrefillJob job;
  decode_actor decode;
  caf::typed_response_promise<PrefillReport> promise;
  bool covered = false;  // a router status asked for after its arrival was seen
};

struct GateState {
  prefill_actor prefill;
  caf::actor_addr relay;  // the only sender of its router and its worker's KV events
  router_actor router;  // invalid until the node has reached one
  std::chrono::milliseconds refresh{1000};
  std::map<std::string, caf::node_id> direct;      // dialled decode endpoint -> its node
  std::map<caf::actor_addr, std::string> watched;  // published decode actor -> its endpoint
  std::set<std::string> dialing;
  bool asking_router = false;
  uint64_t ask_serial = 0;  // answers to questions asked of a previous router are ignored
  std::vector<WaitingJob> waiting;
  static inline const char* name = "prefill-gate";
};

using GateSelf = gate_actor::stateful_pointer<GateState>;

bool has_direct_route(GateSelf self, const decode_actor& decode) {
  if (decode.node() == self->node()) return true;
  for (const auto& kv : self->state.direct)
    if (kv.second == decode.node()) return true;
  return false;
}

void pass_on(GateSelf self, WaitingJob& w) {
  w.promise.delegate(self->state.prefill, prefill_atom::value, std::move(w.job), std::move(w.decode));
}

void ask_router(GateSelf self);

// Jobs with a direct route go on at once, whatever else is still being
// looked up (a decode node that accepts connections and never answers must
// not hold up the jobs for the others for the dial's 10 s). Once no lookup is
// in flight: jobs that arrived before the last status was asked for and
// still have no route fail; jobs that arrived later make the gate ask again.
void settle(GateSelf self) {
  auto& st = self->state;
  const bool lookups_done = !st.asking_router && st.dialing.empty();
  std::vector<WaitingJob> still;
  for (auto& w : st.waiting) {
    if (has_direct_route(self, w.decode)) {
      pass_on(self, w);
    } else if (lookups_done && w.covered) {
      PrefillReport r;
      r.id = w.job.id;
      r.code = ErrorCode::internal;
      r.message = "no direct connection from this prefill node to the decode worker's node (" +
                  caf::to_string(w.decode.node()) +
                  "): its endpoint is unknown to the router or unreachable";
      node_log("request " + std::to_string(w.job.id) + ": " + r.message);
      w.promise.deliver(std::move(r));
    } else {
      still.push_back(std::move(w));
    }
  }
  st.waiting = std::move(still);
  if (lookups_done && !st.waiting.empty()) ask_router(self);
}

void dial(GateSelf self, const std::string& endpoint, const std::string& worker) {
  const auto [host, port] = split_endpoint(endpoint);
  if (port == 0) {
    node_log("decode worker " + worker + " advertises a malformed endpoint \"" + endpoint + "\"");
    return;
  }
  self->state.dialing.insert(endpoint);
  // Asked first on a thread of its own (kDialProbe); the connection itself
  // is made when it answers (connect_probed).
  self->spawn<caf::detached>([gate = caf::actor_cast<gate_actor>(self), endpoint, worker, host = host, port = port](caf::blocking_actor* b) {
    std::string why;
    const bool answered = answers_within(host, port, kDialProbe, why);
    b->send(gate, probed_atom::value, endpoint, worker, answered, why);
  });
}

void connect_probed(GateSelf self, const std::string& endpoint, const std::string& worker) {
  const auto [host, port] = split_endpoint(endpoint);
  auto mm = connection_manager(self->system());  // TLS when the node is configured for it
  self->request(mm, std::chrono::seconds(10), caf::connect_atom::value, host, port)
      .then(
          [=](caf::node_id& node, caf::strong_actor_ptr& published, std::set<std::string>&) {
            auto& st = self->state;
            st.dialing.erase(endpoint);
            st.direct[endpoint] = node;
            if (published) {
              // Forget the route when that decode worker goes away, so a new
              // one on the same endpoint is dialled again.
              self->monitor(published);
              st.watched[published->address()] = endpoint;
            }
            node_log("direct connection to decode worker " + worker + " at " + endpoint + " (node " +
                     caf::to_string(node) + ")");
            settle(self);
          },
          [=](caf::error& e) {
            self->state.dialing.erase(endpoint);
            node_log("cannot connect to decode worker " + worker + " at " + endpoint + ": " +
                     self->system().render(e));
            settle(self);
          });
}

void ask_router(GateSelf self) {
  auto& st = self->state;
  if (st.asking_router) return;
  if (!st.router) {  // no router yet: nothing can be dispatched here either
    settle(self);
    return;
  }
  st.asking_router = true;
  const uint64_t serial = ++st.ask_serial;
  for (auto& w : st.waiting) w.covered = true;
  self->request(st.router, std::chrono::seconds(5), status_atom::value)
      .then(
          [=](RouterStatus& status) {
            auto& st = self->state;
            if (serial != st.ask_serial) return;
            st.asking_router = false;
            for (const auto& w : status.workers)
              if (w.role == WorkerRole::decode && !w.endpoint.empty() && !st.direct.count(w.endpoint) &&
                  !st.dialing.count(w.endpoint))
                dial(self, w.endpoint, w.name);
            settle(self);
          },
          [=](caf::error& e) {
            if (serial != self->state.ask_serial) return;
            self->state.asking_router = false;
            node_log("asking the router for decode endpoints failed: " + self->system().render(e));
            settle(self);
          });
}

gate_actor::behavior_type gate_behavior(GateSelf self, prefill_actor prefill,
                                        std::chrono::milliseconds refresh, caf::actor_addr relay) {
  self->state.prefill = prefill;
  self->state.relay = std::move(relay);
  self->state.refresh = refresh;
  self->link_to(prefill);  // the gate is the prefill worker's face: they live and die together
  self->set_down_handler([=](caf::down_msg& down) {
    auto& st = self->state;
    auto it = st.watched.find(down.source);
    if (it == st.watched.end()) return;
    node_log("decode worker at " + it->second + " went away");
    st.direct.erase(it->second);
    st.watched.erase(it);
  });
  self->delayed_send(self, refresh, refresh_atom::value);
  return {
      [=](prefill_atom, PrefillJob& job,
          decode_actor& decode) -> caf::typed_response_promise<PrefillReport> {
        // The router's orders, as its worker's (read before the promise takes the sender).
        const bool ordered = from_node_or(self, self->state.router.address());
        auto promise = self->make_response_promise<PrefillReport>();
        if (!ordered) {
          promise.deliver(PrefillReport{job.id, ErrorCode::invalid_request, kNotItsRouter});
          return promise;
        }
        WaitingJob w{std::move(job), std::move(decode), promise, false};
        if (has_direct_route(self, w.decode)) {
          pass_on(self, w);
        } else {
          self->state.waiting.push_back(std::move(w));
          ask_router(self);
        }
        return promise;
      },
      [=](cancel_atom, RequestId id) {
        if (!from_node_or(self, self->state.router.address())) return;
        auto& waiting = self->state.waiting;
        for (auto it = waiting.begin(); it != waiting.end(); ++it)
          if (it->job.id == id) {  // still here: the prefill worker never saw it
            PrefillReport r;
            r.id = id;
            r.code = ErrorCode::cancelled;
            r.message = "cancelled";
            it->promise.deliver(std::move(r));
            waiting.erase(it);
            return;
          }
        self->send(self->state.prefill, cancel_atom::value, id);
      },
      [=](status_atom) { return self->delegate(self->state.prefill, status_atom::value); },
      [=](kv_events_atom) { return self->delegate(self->state.prefill, kv_events_atom::value); },
      [=](kv_events_atom, KvEvents& events) {
        // Sent by the gate itself: the router knows the worker by this face.
        if (self->state.router && from(self, self->state.relay))
          self->send(self->state.router, kv_events_atom::value, std::move(events));
      },
      [=](refresh_atom) {
        if (!from_itself(self)) return;  // (each one starts a chain of its own)
        ask_router(self);
        self->delayed_send(self, self->state.refresh, refresh_atom::value);
      },
      [=](probed_atom, const std::string& endpoint, const std::string& worker, bool answered, const std::string& why) {
        // (its own prober's, for an endpoint it dials: else a peer had the
        // middleman connect anywhere, unprobed, blocking it for minutes)
        if (!from_this_node(self) || !self->state.dialing.count(endpoint)) return;
        if (answered) return connect_probed(self, endpoint, worker);
        self->state.dialing.erase(endpoint);
        node_log("cannot connect to decode worker " + worker + " at " + endpoint + ": " + why);
        settle(self);
      },
      [=](router_atom, router_actor& router) {
        if (!from(self, self->state.relay)) return;
        // A question still out to the previous router may never be answered.
        self->state.router = std::move(router);
        self->state.asking_router = false;
        ++self->state.ask_serial;
        // (the worker takes the jobs this router delegates through here, and
        // its cancels, from it; before the router knows this face)
        self->send(self->state.prefill, router_atom::value, self->state.router.address());
        ask_router(self);
      },
      [](router_atom, caf::actor_addr&) {},  // (a worker's: this face learns its router from its relay)
  };
}

// ---------------------------------------------------------------- the relay

using relay_actor = router_actor::extend<caf::reacts_to<router_atom, router_actor>,
                                         caf::reacts_to<endpoint_atom, std::string>,
                                         caf::reacts_to<retry_atom, uint64_t>>;

// The one worker that registered through this relay, as the router sees it.
struct Registration {
  caf::actor_addr worker;  // the worker actor that registered
  WorkerInfo info;
  prefill_actor face;  // prefill: the gate
  decode_actor decode;
  gate_actor gate;
};

struct RelayState {
  RelaySpec spec;
  router_actor router;   // invalid until set_relay_router
  std::string endpoint;  // decode: set_relay_endpoint
  std::optional<Registration> worker;
  uint64_t registration = 0;           // the latest attempt; a retry names the one that failed
  // Since the first answer that another worker holds the name (reset by any
  // other answer and by a new router).
  std::optional<std::chrono::steady_clock::time_point> name_held_since;
  std::chrono::milliseconds retry_delay;  // until the next attempt after a failed one
  static inline const char* name = "router-relay";
};

using RelaySelf = relay_actor::stateful_pointer<RelayState>;

// Registers the worker with the current router, once everything is known.
void register_worker(RelaySelf self) {
  auto& st = self->state;
  if (!st.worker || !st.router) return;
  Registration& w = *st.worker;
  if (w.decode && st.endpoint.empty() && w.info.colocated.empty()) return;  // (colocated: reached in-process)
  w.info.endpoint = st.endpoint;
  w.info.cluster = st.spec.cluster;
  const std::string name = w.info.name;
  const router_actor router = st.router;
  const uint64_t attempt = ++st.registration;
  auto on_ok = [=](caf::ok_atom) {
    self->state.retry_delay = self->state.spec.register_retry;
    self->state.name_held_since.reset();
    node_log("registered with the router as " + name +
             (self->state.endpoint.empty() ? "" : " (KV endpoint " + self->state.endpoint + ")"));
    const auto& after = self->state.spec.ready_after;
    if (after && after->fetch_sub(1) > 1) return;  // the node's other worker is not in yet
    const std::string& ready = self->state.spec.ready_file;
    if (!ready.empty() && !write_ready_file(ready, name)) node_log("cannot write ready file " + ready);
  };
  auto on_error = [=](caf::error& e) {
    // A router that went away is replaced by the node (set_relay_router),
    // which registers again; a question that was out to it may only time out
    // now. The router refused this worker for good (another cluster, another
    // model): trying again cannot help, so the relay stops, and with it
    // (linked) the worker and its node, naming the reason. Another worker
    // holds the name: tried again up to name_held_wait (the holder may be
    // gone unnoticed), then the same. The same router did not answer: try
    // again, with backoff (unless a newer attempt is already out).
    auto& st = self->state;
    if (router != st.router) return;
    // The router's reason, unquoted (render() escapes it inside a tuple).
    const caf::message& why = e.context();
    const std::string reason = why.size() == 1 && why.match_element<std::string>(0) ? why.get_as<std::string>(0)
                                                                                  : self->system().render(e);
    const auto now = std::chrono::steady_clock::now();
    if (e != kRegistrationNameHeld) st.name_held_since.reset();
    else if (!st.name_held_since) st.name_held_since = now;
    if (e == kRegistrationRefused || (e == kRegistrationNameHeld && now - *st.name_held_since >= st.spec.name_held_wait)) {
      node_log(LogLevel::error, "the router refused " + name + ": " + reason + "; exiting");
      self->quit(e);
      return;
    }
    node_log(LogLevel::warning, "registration of " + name + " failed: " + reason + "; trying again in " +
             std::to_string(st.retry_delay.count()) + " ms");
    if (attempt != st.registration) return;
    self->delayed_send(self, st.retry_delay, retry_atom::value, attempt);
    st.retry_delay = std::min(st.retry_delay * 2, st.spec.register_retry_max);
  };
  if (w.face)
    self->request(router, st.spec.register_timeout, register_atom::value, w.info, w.face).then(on_ok, on_error);
  else
    self->request(router, st.spec.register_timeout, register_atom::value, w.info, w.decode).then(on_ok, on_error);
}

// Tells the worker (a prefill worker's gate, which tells it) the router it
// serves: before the router learns the worker (register_worker), so that
// the router's first order finds it known.
void tell_router(RelaySelf self) {
  auto& st = self->state;
  if (!st.worker || !st.router) return;
  if (st.worker->gate)
    self->send(st.worker->gate, router_atom::value, st.router);
  else
    self->send(st.worker->decode, router_atom::value, st.router.address());
}

// The worker's own registration: answered at once (the relay registers it
// whenever there is a router, so the worker never waits on the network).
// Taken from the worker itself only, once: any peer that reaches the node
// can address the relay, and a registration of its own had the relay link
// to it and register it (its refusal or its loss ended the relay and,
// linked, the node's worker).
caf::result<caf::ok_atom> take_registration(RelaySelf self, WorkerInfo& info, prefill_actor prefill,
                                            decode_actor decode) {
  auto& st = self->state;
  const caf::actor_addr worker = prefill ? prefill.address() : decode.address();
  if (!from(self, worker) || !from_this_node(self))
    return caf::make_error(caf::sec::runtime_error, "a worker registers itself with its node's relay");
  if (st.worker) {
    if (st.worker->worker == worker) return caf::ok_atom::value;  // (again: nothing changes)
    return caf::make_error(caf::sec::runtime_error, "this relay has its worker already");
  }
  Registration w;
  w.worker = worker;
  w.info = std::move(info);
  if (prefill) {
    self->link_to(prefill);
    w.gate = self->spawn(gate_behavior, prefill, st.spec.peer_refresh, self->address());
    w.face = caf::actor_cast<prefill_actor>(w.gate);
  } else {
    self->link_to(decode);
    w.decode = std::move(decode);
  }
  st.worker = std::move(w);
  tell_router(self);
  register_worker(self);
  return caf::ok_atom::value;
}

relay_actor::behavior_type relay_behavior(RelaySelf self, RelaySpec spec) {
  self->state.spec = std::move(spec);
  self->state.retry_delay = self->state.spec.register_retry;
  // Before the node has reached a router nothing is dispatched to this
  // worker, so nothing is sent either; requests then fail at once.
  auto no_router = [] { return caf::make_error(caf::sec::request_receiver_down); };
  return {
      [=](generate_atom, GenerateRequest& request,
          client_actor& client) -> caf::result<RequestOutcome> {
        if (!self->state.router) return no_router();
        return self->delegate(self->state.router, generate_atom::value, std::move(request),
                              std::move(client));
      },
      [=](cancel_atom, RequestId id) {
        if (self->state.router) self->delegate(self->state.router, cancel_atom::value, id);
      },
      [=](register_atom, WorkerInfo& info, prefill_actor& worker) -> caf::result<caf::ok_atom> {
        return take_registration(self, info, std::move(worker), decode_actor{});
      },
      [=](register_atom, WorkerInfo& info, decode_actor& worker) -> caf::result<caf::ok_atom> {
        return take_registration(self, info, prefill_actor{}, std::move(worker));
      },
      // Delegated: the router attributes load reports to their sender.
      [=](token_atom, TokenBatch& batch) {
        if (self->state.router) self->delegate(self->state.router, token_atom::value, std::move(batch));
      },
      [=](done_atom, DecodeDone& done) {
        if (self->state.router) self->delegate(self->state.router, done_atom::value, std::move(done));
      },
      [=](load_atom, DecodeLoad& load) {
        if (self->state.router) self->delegate(self->state.router, load_atom::value, std::move(load));
      },
      [=](kv_events_atom, KvEvents& events) {
        // A prefill worker's go through its gate (the face the router knows),
        // its own only; a decode worker's straight on, their sender kept
        // (the router takes them from the registered worker only).
        if (self->state.worker && self->state.worker->gate) {
          if (from(self, self->state.worker->worker))
            self->send(self->state.worker->gate, kv_events_atom::value, std::move(events));
        } else if (self->state.router)
          self->delegate(self->state.router, kv_events_atom::value, std::move(events));
      },
      [](deadline_atom, int64_t) {},  // the router's own timer, as the heartbeat
      [](heartbeat_atom) {},  // the router's own timer: nothing a worker's relay passes on
      [=](status_atom) -> caf::result<RouterStatus> {
        if (!self->state.router) return no_router();
        return self->delegate(self->state.router, status_atom::value);
      },
      // The node's settings (set_relay_router, set_relay_endpoint) and the
      // relay's own retry timer: from itself only.
      [=](router_atom, router_actor& router) {
        if (!from_itself(self)) return;
        self->state.router = std::move(router);
        self->state.retry_delay = self->state.spec.register_retry;
        self->state.name_held_since.reset();
        tell_router(self);
        register_worker(self);
      },
      [=](endpoint_atom, std::string& endpoint) {
        if (!from_itself(self)) return;
        self->state.endpoint = std::move(endpoint);
        register_worker(self);
      },
      [=](retry_atom, uint64_t attempt) {
        if (from_itself(self) && attempt == self->state.registration) register_worker(self);
      },
  };
}

}  // namespace

router_actor spawn_router_relay(caf::actor_system& system, RelaySpec spec) {
  return system.spawn(relay_behavior, std::move(spec));
}

// (as the relay itself: it takes its settings from no one else)
void set_relay_router(const router_actor& relay, const router_actor& router) {
  const auto r = caf::actor_cast<relay_actor>(relay);
  caf::send_as(r, r, router_atom::value, router);
}

void set_relay_endpoint(const router_actor& relay, const std::string& endpoint) {
  const auto r = caf::actor_cast<relay_actor>(relay);
  caf::send_as(r, r, endpoint_atom::value, endpoint);
}

bool write_ready_file(const std::string& path, const std::string& content) {
  // A name of its own per write: a colocated node's two relays may write at
  // once, on two threads (one temporary name mixed their bytes, or one
  // rename found the file gone).
  static std::atomic<uint64_t> writes{0};
  const std::string temp = path + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(++writes);
  FILE* f = std::fopen(temp.c_str(), "w");
  if (!f) return false;
  const bool written = std::fputs((content + "\n").c_str(), f) >= 0;
  if (std::fclose(f) == 0 && written && std::rename(temp.c_str(), path.c_str()) == 0) return true;
  std::remove(temp.c_str());
  return false;
}

}  // namespace disagg
