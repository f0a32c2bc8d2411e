// The options of one cluster node (disagg-node): its role, where it listens,
// where the router is, how it retries; bound to CAF config group "node" next
// to the "disagg" group of actors/config.h. Loading is strict: CAF 0.17
// silently drops INI values of the wrong type (a single-quoted string, an
// out-of-range port) and keeps unknown keys, so the config file is checked
// line by line and every such value is an error naming its file and line.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "actors/config.h"
#include "node/tls.h"

namespace disagg {

// worker: a colocated worker, one process that prefills and decodes (its
// prefill and decode worker share one compute actor and KV pool).
enum class NodeRole { router, prefill, decode, worker, frontend };

struct NodeOptions {
  std::string role;                 // router | prefill | decode | worker | frontend (required)
  std::string name;                 // worker name at the router; empty: "<role>@<host>/<pid>"
  std::string host = "127.0.0.1";   // address this node listens on
  // router: where clients and workers connect (0: any free port, logged).
  // decode: where prefill nodes connect to ship KV (0: any free port).
  // prefill, worker: unused (they only dial out).
  uint16_t port = 0;
  std::string advertise_host;       // decode: host prefill nodes dial; empty: `host`
  std::string router_host = "127.0.0.1";  // workers: the router's address
  uint16_t router_port = 0;               // workers: the router's port (required)
  int64_t connect_retry_ms = 100;         // first delay between attempts to reach the router
  int64_t connect_backoff_max_ms = 2000;  // the delay doubles up to this
  int64_t connect_timeout_ms = 0;         // give up after this long; 0 (the default): never
  int64_t peer_refresh_ms = 1000;         // prefill: how often it asks the router for decode endpoints
  std::string ready_file;  // written ("host:port" or the worker name) once the node serves
  std::string log_level = "info";  // "error", "warning" or "info" (actors/log.h)
  // Every role: GET /metrics (Prometheus text) on node.host:metrics-port; 0: none.
  uint16_t metrics_port = 0;
  // Router and decode: the port guard in front of the CAF port
  // (node/port_guard.h): CAF itself listens on 127.0.0.1 only, the guard on
  // host:port, checking every message header before its payload moves.
  bool port_guard = true;
  int64_t max_message_bytes = int64_t{16} << 20;  // largest message a peer may announce (raised for kv-transport message)
  int64_t handshake_timeout_ms = 5000;            // a peer's handshake (plain: BASP; TLS: TLS) must be complete by then
  int64_t message_timeout_ms = 10000;             // a message of more than 64 KiB must be complete by then
  int32_t max_connections = 1024;                 // connections at once; more are closed at accept
  int32_t max_pending_per_source = 16;            // of them in their handshake from one address
  // frontend (http/): the OpenAI-compatible HTTP API.
  std::string http_host = "127.0.0.1";
  uint16_t http_port = 0;                     // 0: any free port (logged, written to the ready file)
  int64_t http_body_limit = 1 << 20;          // bytes of a request body; more: 413
  int64_t http_stream_buffer_bytes = 1 << 20;  // a stream's bytes queued for a slow reader; more: cut off
  // A client that acknowledges nothing for this long (its host gone, a cut
  // cable: no FIN, no RST) is gone: its request is cancelled.
  int64_t http_dead_client_ms = 15000;
  int32_t http_threads = 1;                   // io_context threads
  std::string chat_template = "auto";  // auto (the model file's) | a built-in's name (text/chat_template.h)
  bool trust_request_chat_template = false;  // a request's own chat_template rendered (else a 400), vLLM's flag
  std::string served_model_name;              // empty: the model file's name without its extension

  // Empty when usable, else every problem found, separated by "; ".
  std::string validate() const;
  NodeRole parsed_role() const;  // only after validate() passed
};

// Registers the fields of `node` as options of group "node".
void add_node_options(caf::config_option_set& options, NodeOptions& node);

// DisaggSystemConfig plus the "node" and "tls" groups and the io middleman
// (node_main loads CAF's openssl module too when tls is configured).
class NodeSystemConfig : public DisaggSystemConfig {
 public:
  NodeSystemConfig();
  NodeOptions node;
  TlsOptions tls;
  const caf::config_option_set& options() const { return custom_options_; }
};

// Every line of the INI file `path` that CAF would reject or silently ignore:
// unknown groups and keys, '#' comments, unquoted or single-quoted strings,
// values of the wrong type or range. Each entry reads "config PATH line N: ...".
std::vector<std::string> check_config_file(const std::string& path,
                                           const caf::config_option_set& options);

struct NodeConfigResult {
  bool help_printed = false;        // --help / --dump-config: exit 0 without running
  std::vector<std::string> errors;  // empty: config.node and config.disagg are usable
};

// Parses the command line (--config-file=F first, then the options given on
// the command line override the file), checks the file, the values and the
// model/tokenizer paths the role needs.
NodeConfigResult load_node_config(NodeSystemConfig& config, int argc, char** argv);

}  // namespace disagg
