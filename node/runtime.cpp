#include "node/runtime.h"

#include <sys/resource.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>

#include "actors/compute.h"
#include "actors/decode.h"
#include "node/config.h"
#include "actors/log.h"
#include "node/relay.h"
#include "actors/prefill.h"
#include "actors/router.h"
#include "node/port_guard.h"
#include "node/tls.h"
#include "caf/all.hpp"
#include "caf/io/all.hpp"
#include "engine/memory.h"
#include "model/checkpoint.h"
#include "text/tokenizer.h"
#include "metrics/disagg_metrics.h"
#include "metrics/exposer.h"

namespace disagg {

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// What a KvTransfer message adds to the KV bytes it carries (ids, sampling,
// CAF's framing): the port guard's limit for one-message KV leaves this room.
constexpr int64_t kMessageOverheadBytes = int64_t{1} << 20;

// How long a node's teardown (the actor system's: CAF joins its threads)
// may take once its role has returned: CAF 0.17's multiplexer can stay
// inside OpenSSL's read of a TLS handshake that a partition silenced, and
// the join then waits for good. Past this the process exits anyway, saying so.
constexpr std::chrono::seconds kTeardownBound{10};

volatile std::sig_atomic_t g_stop = 0;
extern "C" void on_stop_signal(int) { g_stop = 1; }
bool stopping() { return g_stop != 0; }

std::string endpoint_of(const std::string& host, uint16_t port) { return host + ":" + std::to_string(port); }

// Why `host:port` cannot be listened on, in the words of the OS ("Address
// already in use"); CAF only says "tcp socket creation failed". Empty when
// the host is no numeric address (IPv4 or IPv6: the caller's own message
// stands) or a listen works now.
std::string listen_problem(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found) return {};
  const int fd = ::socket(found->ai_family, SOCK_STREAM, 0);
  if (fd < 0) {
    ::freeaddrinfo(found);
    return std::strerror(errno);
  }
  const int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  std::string problem;
  if (::bind(fd, found->ai_addr, found->ai_addrlen) != 0 || ::listen(fd, 1) != 0) problem = std::strerror(errno);
  ::freeaddrinfo(found);
  ::close(fd);
  return problem;
}

// A published actor: the port peers connect to, and the guard in front of
// CAF's own port when there is one.
struct Published {
  uint16_t port = 0;
  std::unique_ptr<PortGuard> guard;
};

// Publishes `who` on host:port (port 0: any free one). With node.port-guard
// (the default) CAF listens on 127.0.0.1 at a free port and a PortGuard owns
// host:port, so no peer's bytes reach CAF unchecked (node/port_guard.h).
// SO_REUSEADDR lets a restarted node take its port back at once while old
// connections linger in TIME_WAIT; a port another process listens on is
// still refused.
template <class Handle>
std::optional<Published> publish_on(caf::actor_system& system, const Handle& who, const NodeOptions& node,
                                    int64_t max_message_bytes) {
  const std::string caf_host = node.port_guard ? "127.0.0.1" : node.host;
  const uint16_t caf_port = node.port_guard ? 0 : node.port;
  auto published = publish_actor(system, who, caf_port, caf_host);  // TLS when configured (node/tls.h)
  if (!published) {
    const std::string why = listen_problem(caf_host, caf_port);
    node_log("cannot listen on " + endpoint_of(caf_host, caf_port) + ": " +
             (why.empty() ? system.render(published.error()) : why));
    return std::nullopt;
  }
  Published out;
  out.port = *published;
  if (!node.port_guard) return out;
  PortGuardOptions options;
  options.listen_host = node.host;
  options.listen_port = node.port;
  options.target_port = *published;
  options.max_message_bytes = uint32_t(std::min<int64_t>(max_message_bytes, 0xFFFFFFFF));
  options.handshake_timeout = std::chrono::milliseconds(node.handshake_timeout_ms);
  options.message_timeout = std::chrono::milliseconds(node.message_timeout_ms);
  // Buffered messages of all peers together: four of the largest.
  options.max_buffered_bytes = 4 * int64_t(options.max_message_bytes);
  options.max_connections = node.max_connections;
  // Peers in their handshake hold at most a quarter of the slots.
  options.max_pending = std::max(1, node.max_connections / 4);
  options.max_pending_per_source = node.max_pending_per_source;
  options.inspect = !uses_tls(system);  // TLS bytes cannot be read: caps and the TLS handshake's deadline
  try {
    out.guard = std::make_unique<PortGuard>(options, [](const std::string& line) { node_log(LogLevel::error, line); });
  } catch (const std::exception& e) {
    const std::string why = listen_problem(node.host, node.port);
    node_log(why.empty() ? std::string(e.what()) : "cannot listen on " + endpoint_of(node.host, node.port) + ": " + why);
    return std::nullopt;
  }
  out.port = out.guard->port();
  return out;
}

// What a node waits for in its main thread: a signal, or one of `watched`
// going down (its reason is returned).
struct WaitResult {
  bool stopped = false;
  caf::actor_addr down;
  caf::error reason;
};

WaitResult wait_for_stop_or_down(caf::scoped_actor& self) {
  WaitResult r;
  while (!stopping()) {
    bool got = false;
    self->receive(
        [&](caf::down_msg& down) {
          r.down = down.source;
          r.reason = down.reason;
          got = true;
        },
        caf::after(100ms) >> [] {});
    if (got) return r;
  }
  r.stopped = true;
  return r;
}

// Sends an exit to `who` and waits (bounded) until it is gone, so the actor
// system can shut down without waiting on half-finished work.
template <class Handle>
void stop_actor(caf::scoped_actor& self, const Handle& who) {
  if (!who) return;
  self->monitor(who);
  self->send_exit(who, caf::exit_reason::user_shutdown);
  bool gone = false;
  const auto deadline = Clock::now() + 5s;
  while (!gone && Clock::now() < deadline)
    self->receive([&](caf::down_msg& down) { gone = down.source == who.address(); },
                  caf::after(100ms) >> [] {});
}

// ---------------------------------------------------------------- router

int run_router(caf::actor_system& system, const NodeOptions& node, const DisaggConfig& cfg) {
  std::shared_ptr<const gpu::Tokenizer> tokenizer;
  std::optional<ModelInfo> model;  // the router's own: the authority on vocabulary and context
  try {
    std::shared_ptr<const gpu::Checkpoint> checkpoint;
    if (!cfg.model.empty()) {
      checkpoint = gpu::Checkpoint::open(cfg.model, cfg.weight_cache);
      model = model_info(*checkpoint);
    }
    if (checkpoint && (!cfg.tokenizer.empty() || checkpoint->vocabulary()))
      tokenizer = std::make_shared<const gpu::Tokenizer>(gpu::load_tokenizer(*checkpoint, cfg.tokenizer));
    else if (!cfg.tokenizer.empty())
      tokenizer = std::make_shared<const gpu::Tokenizer>(gpu::Tokenizer::load(cfg.tokenizer, 0));
  } catch (const std::exception& e) {
    node_log(std::string("cannot load the model or tokenizer: ") + e.what());
    return 1;
  }
  auto router = spawn_router(system, cfg, tokenizer, model);
  caf::scoped_actor self{system};
  auto published = publish_on(system, router, node, node.max_message_bytes);
  if (!published) {
    stop_actor(self, router);
    return 1;
  }
  const uint16_t* port = &published->port;
  const std::string endpoint = endpoint_of(node.host, *port);
  node_log("router of cluster \"" + cfg.cluster + "\" listening on " + endpoint + (uses_tls(system) ? " (TLS)" : "") +
           (!tokenizer ? " (no tokenizer: token prompts only)"
                       : " (tokenizer " + (cfg.tokenizer.empty() ? "of " + cfg.model : cfg.tokenizer) + ")"));
  if (!node.ready_file.empty() && !write_ready_file(node.ready_file, endpoint))
    node_log("cannot write ready file " + node.ready_file);

  self->monitor(router);
  const WaitResult r = wait_for_stop_or_down(self);
  if (!r.stopped) {
    node_log("the router actor stopped: " + system.render(r.reason));
    return 1;
  }
  node_log("stopping");
  stop_actor(self, router);
  return 0;
}

}  // namespace

bool node_stopping() { return stopping(); }

std::optional<router_actor> connect_to_router(caf::actor_system& system, const NodeOptions& node) {
  const std::string where = endpoint_of(node.router_host, node.router_port);
  const auto start = Clock::now();
  auto delay = std::chrono::milliseconds(node.connect_retry_ms);
  // Each try waits this long for the router's handshake, so a stop signal
  // is seen within it even when the address accepts and never speaks (a
  // later try joins the handshake still pending in CAF's middleman).
  constexpr auto kHandshakeWait = std::chrono::milliseconds(500);
  for (int attempt = 1;; ++attempt) {
    auto router = remote_actor_at<router_actor>(system, node.router_host, node.router_port, kHandshakeWait);
    if (router) {
      node_log("connected to the router at " + where);
      return *router;
    }
    if (stopping()) return std::nullopt;
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    if (node.connect_timeout_ms > 0 && waited.count() >= node.connect_timeout_ms) {
      node_log("giving up: the router at " + where + " did not answer within " +
               std::to_string(node.connect_timeout_ms) + " ms (" + system.render(router.error()) + ")");
      return std::nullopt;
    }
    if (attempt == 1 || attempt % 10 == 0)
      node_log("router at " + where + " not reachable yet (" + system.render(router.error()) +
               "); retrying with backoff");
    for (auto slept = 0ms; slept < delay && !stopping(); slept += 50ms) std::this_thread::sleep_for(50ms);
    delay = std::min(delay * 2, std::chrono::milliseconds(node.connect_backoff_max_ms));
  }
}

namespace {

// ---------------------------------------------------------------- workers

// The KV data plane of a prefill or decode node (a decode node's receivers
// listen from here on); nullptr for none (colocated, kv-transport message).
// False when it cannot start (logged).
bool start_kv_plane(const DisaggConfig& cfg, bool colocated, bool is_decode, std::shared_ptr<kv::KvPlane>& plane) {
  if (colocated || cfg.kv_transport == "message") return true;
  try {
    plane = make_kv_plane(cfg, is_decode);
    if (is_decode)
      node_log("KV receivers at tcp " + plane->address(kv::Transport::tcp) +
               (plane->address(kv::Transport::shm).empty() ? "" : ", shm " + plane->address(kv::Transport::shm)));
    return true;
  } catch (const std::exception& e) {
    node_log(std::string("cannot start the KV data plane (kv-transport ") + cfg.kv_transport + "): " + e.what());
    return false;
  }
}

// Model and engine first: a bad model fails the node before it joins.
std::optional<ComputeUnit> load_compute(caf::actor_system& system, const DisaggConfig& cfg, bool holds_pool,
                                        std::shared_ptr<kv::KvPlane> plane,
                                        std::shared_ptr<kv::LocalKvTargets> local) {
  try {
    ComputeSpec spec;
    spec.checkpoint = gpu::Checkpoint::open(cfg.model, cfg.weight_cache);
    spec.engine.backend = cfg.backend;
    spec.engine.weight_cache = cfg.weight_cache;
    spec.engine.log = [](const std::string& line) { node_log(line); };
    spec.kv_plane = std::move(plane);
    spec.local_targets = std::move(local);
    spec.prefill_chunk = cfg.prefill_chunk;
    spec.pool_block_size = cfg.block_size;
    spec.tokenizer = cfg.tokenizer;
    if (holds_pool) spec.pool_blocks = cfg.pool_blocks;
    if (holds_pool && !cfg.draft_model.empty()) spec.draft = gpu::Checkpoint::open(cfg.draft_model, cfg.weight_cache);
    else spec.prefix_cache_blocks = cfg.prefill_cache_blocks_in_use();
    return spawn_compute_unit(system, spec);
  } catch (const std::exception& e) {
    node_log(std::string("cannot load the model: ") + e.what());
    return std::nullopt;
  }
}

RelaySpec relay_spec_of(const caf::actor_system_config& system, const NodeOptions& node, const DisaggConfig& cfg,
                        bool colocated) {
  RelaySpec spec;
  // As long as this node's middleman keeps a silent connection (the
  // router's, set alike, then drops a gone holder of the name).
  const auto connection_timeout = caf::get_or(system, "middleman.connection-timeout", caf::timespan{kMiddlemanConnectionTimeout});
  const auto heartbeat = caf::get_or(system, "middleman.heartbeat-interval", caf::timespan{kMiddlemanHeartbeat});
  spec.name_held_wait = std::chrono::duration_cast<std::chrono::milliseconds>(connection_timeout + heartbeat);
  spec.cluster = cfg.cluster;
  spec.ready_file = node.ready_file;
  spec.register_timeout = std::chrono::milliseconds(cfg.compute_timeout_ms);
  spec.peer_refresh = std::chrono::milliseconds(node.peer_refresh_ms);
  spec.register_retry = std::chrono::milliseconds(node.connect_retry_ms);
  spec.register_retry_max = std::chrono::milliseconds(node.connect_backoff_max_ms);
  if (colocated) spec.ready_after = std::make_shared<std::atomic<int>>(2);
  return spec;
}

// A node's workers, each with the relay it registers through.
using NodeWorkers = std::vector<std::pair<caf::actor, router_actor>>;

// The largest message a decode node's KV port takes (its guard's limit;
// 0: no guard): a one-message KV (kv-transport message) must fit it. What
// its reservations tell prefill workers (KvTarget::max_message_bytes).
int64_t kv_port_message_limit(const NodeOptions& node, const DisaggConfig& cfg) {
  if (!node.port_guard) return 0;
  return cfg.kv_transport == "message" ? std::max(node.max_message_bytes, cfg.max_kv_transfer_bytes + kMessageOverheadBytes)
                                       : node.max_message_bytes;
}

NodeWorkers spawn_workers(caf::actor_system& system, const DisaggConfig& cfg, const RelaySpec& relay_spec,
                          const std::string& name, NodeRole role, const ComputeUnit& compute,
                          const std::shared_ptr<kv::KvPlane>& plane,
                          const std::shared_ptr<kv::LocalKvTargets>& local, int64_t kv_message_limit) {
  NodeWorkers workers;
  auto add_worker = [&](auto spawn) {
    router_actor relay = spawn_router_relay(system, relay_spec);
    caf::actor worker = caf::actor_cast<caf::actor>(spawn(relay));
    // Linked now, not only once the worker has registered through the relay:
    // a worker that stops before (e.g. its KV port is taken) must take the
    // relay with it, or the actor system would wait for the relay forever on
    // exit. (add_link is thread-safe; an actor already gone makes the other exit.)
    caf::actor_cast<caf::abstract_actor*>(relay)->add_link(caf::actor_cast<caf::abstract_actor*>(worker));
    workers.emplace_back(worker, relay);
  };
  if (role == NodeRole::worker) {
    add_worker([&](router_actor relay) {
      return spawn_prefill(system, cfg, compute.actor, relay, name + "/prefill", name);
    });
    add_worker([&](router_actor relay) {
      return spawn_decode(system, cfg, compute.actor, relay, name + "/decode",
                          DecodeKv{compute.pool, nullptr, local, name});
    });
  } else if (role == NodeRole::decode) {
    add_worker([&](router_actor relay) {
      return spawn_decode(system, cfg, compute.actor, relay, name,
                          DecodeKv{compute.pool, plane, compute.local, {}, kv_message_limit});
    });
  } else {
    add_worker([&](router_actor relay) { return spawn_prefill(system, cfg, compute.actor, relay, name); });
  }
  return workers;
}

// A decode node's KV port, which prefill nodes connect to directly, and the
// endpoint its relay advertises; nullopt when it cannot listen (logged).
std::optional<Published> publish_kv_port(caf::actor_system& system, const NodeOptions& node,
                                         const DisaggConfig& cfg, const NodeWorkers& workers) {
  const caf::actor& worker = workers.front().first;
  auto port = publish_on(system, caf::actor_cast<decode_actor>(worker), node, kv_port_message_limit(node, cfg));
  if (!port) return std::nullopt;
  const std::string endpoint = endpoint_of(node.advertise_host.empty() ? node.host : node.advertise_host, port->port);
  node_log("decode worker listening for KV on " + endpoint_of(node.host, port->port) +
           (node.advertise_host.empty() ? "" : " (advertised as " + endpoint + ")"));
  set_relay_endpoint(workers.front().second, endpoint);
  return port;
}

// Joins, and joins again whenever the router goes away, until the node is
// told to stop (0) or a worker stops or the router cannot be reached (1).
int serve_router(caf::actor_system& system, caf::scoped_actor& self, const NodeOptions& node,
                 const NodeWorkers& workers) {
  for (;;) {
    auto router = connect_to_router(system, node);
    if (!router) return stopping() ? 0 : 1;
    self->monitor(*router);
    for (auto& w : workers) set_relay_router(w.second, *router);
    const WaitResult r = wait_for_stop_or_down(self);
    if (r.stopped) {
      node_log("stopping");
      return 0;
    }
    for (auto& w : workers)
      if (r.down == w.first.address()) {
        node_log("the worker stopped: " + system.render(r.reason));
        return 1;
      }
    node_log("lost the router (" + system.render(r.reason) + "); joining again");
    // Give the old router's port a moment to close, so the next try does not
    // reach the node that is shutting down.
    for (auto slept = 0ms; slept < std::chrono::milliseconds(node.connect_retry_ms) && !stopping(); slept += 10ms)
      std::this_thread::sleep_for(10ms);
  }
}

// A prefill, decode or colocated (`worker`) node. A colocated node runs a
// prefill and a decode worker on one compute actor and pool, each
// registered through a relay of its own as "<name>/prefill" and
// "<name>/decode" of unit <name>; KV moves between them in-process
// (kv/local.h), so it needs no KV data plane and no port of its own.
int run_worker(caf::actor_system& system, const NodeOptions& node, const DisaggConfig& cfg) {
  const NodeRole role = node.parsed_role();
  const bool colocated = role == NodeRole::worker, is_decode = role == NodeRole::decode;
  std::shared_ptr<kv::KvPlane> plane;
  if (!start_kv_plane(cfg, colocated, is_decode, plane)) return 1;
  std::shared_ptr<kv::LocalKvTargets> local;
  if (colocated) local = std::make_shared<kv::LocalKvTargets>();
  const auto compute = load_compute(system, cfg, is_decode || colocated, plane, local);
  if (!compute) return 1;

  const std::string name =
      !node.name.empty() ? node.name : node.role + "@" + node.host + "/" + std::to_string(::getpid());
  caf::scoped_actor self{system};
  const NodeWorkers workers =
      spawn_workers(system, cfg, relay_spec_of(system.config(), node, cfg, colocated), name, role, *compute, plane, local,
                    kv_port_message_limit(node, cfg));
  auto stop_workers = [&] {
    for (auto& w : workers) stop_actor(self, w.first);
  };
  std::optional<Published> decode_port;  // a decode node's KV port (and its guard) while the node runs
  if (is_decode && !(decode_port = publish_kv_port(system, node, cfg, workers))) {
    stop_workers();
    return 1;
  }
  if (colocated) node_log("colocated worker " + name + ": prefill and decode on one compute actor");
  for (auto& w : workers) self->monitor(w.first);
  const int code = serve_router(system, self, node, workers);
  stop_workers();
  return code;
}

}  // namespace

void raise_open_files_limit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) node_log(LogLevel::warning, "cannot raise the open files limit");
  }
}

int node_main(int argc, char** argv, RoleRunner frontend) {
  NodeSystemConfig config;
  const NodeConfigResult loaded = load_node_config(config, argc, argv);
  if (loaded.help_printed) return 0;
  if (!loaded.errors.empty()) {
    for (const auto& e : loaded.errors) std::cerr << "disagg-node: error: " << e << "\n";
    return 2;
  }
  const NodeOptions& node = config.node;
  kv::apply_process_settings();  // (setenv: before this process has threads of its own)
  gpu::fix_heap_thresholds();
  set_node_log_name(node.name.empty() ? node.role : node.role + " " + node.name);
  LogLevel level = LogLevel::info;
  parse_log_level(node.log_level, &level);  // validated with the config
  set_node_log_level(level);

  if (node.parsed_role() == NodeRole::frontend && !frontend) {
    std::cerr << "disagg-node: error: this build has no frontend role (http/ was not built)\n";
    return 2;
  }

  raise_open_files_limit();
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGPIPE, SIG_IGN);
  use_tls(config, config.tls);
  metrics::disagg_metrics();  // every family exists (at zero) from the first scrape
  std::unique_ptr<metrics::Exposer> exposer;
  if (node.metrics_port != 0) {
    try {
      exposer = std::make_unique<metrics::Exposer>(node.host, node.metrics_port, metrics::process_registry());
      node_log("metrics on http://" + endpoint_of(node.host, exposer->port()) + "/metrics");
    } catch (const std::exception& e) {
      node_log(LogLevel::error, e.what());
      return 1;
    }
  }
  caf::actor_system system{config};
  if (config.tls.enabled())
    node_log("mutual TLS on every connection: certificate " + config.tls.certificate + ", CA " + config.tls.ca_file);
  int code = 0;
  switch (node.parsed_role()) {
    case NodeRole::router: code = run_router(system, node, config.disagg); break;
    case NodeRole::frontend: code = frontend(system, node, config.disagg); break;
    default: code = run_worker(system, node, config.disagg); break;
  }
  // The teardown (the system's destructor, on return) bounded: a watchdog
  // that ends the process if it is still here kTeardownBound from now.
  std::thread([code] {
    std::this_thread::sleep_for(kTeardownBound);
    node_log(LogLevel::error, "the node's teardown did not end within " + std::to_string(kTeardownBound.count()) +
                                  " s (a connection stuck in CAF's network thread); exiting");
    std::_Exit(code == 0 ? 1 : code);
  }).detach();
  return code;
}

}  // namespace disagg
