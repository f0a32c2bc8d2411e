#include "node/config.h"

#include "actors/log.h"

#include <arpa/inet.h>
#include <algorithm>
#include <cctype>
#include <sstream>
#include <sys/stat.h>

#include "caf/config_option_adder.hpp"
#include "caf/io/middleman.hpp"
#include "caf/settings.hpp"
#include "messages/request.h"
#include "text/chat_template.h"
#include "gpu/error.h"
#include "gpu/file_check.h"

namespace disagg {

namespace {

// 127.0.0.0/8, ::1, ::ffff:127.x.x.x or "localhost": an address only this host reaches.
bool is_loopback(const std::string& host) {
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) != 1) return false;
  if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
  return IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127;
}

void add_problem(std::string& problems, const std::string& what) {
  if (!problems.empty()) problems += "; ";
  problems += what;
}

std::string trim(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t\r");
  if (begin == std::string::npos) return {};
  const auto end = s.find_last_not_of(" \t\r");
  return s.substr(begin, end - begin + 1);
}

// `s` up to a ';' comment that is not inside a quoted string.
std::string strip_comment(const std::string& s) {
  char quote = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (quote) {
      if (c == '\\') ++i;
      else if (c == quote) quote = 0;
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == ';') {
      return s.substr(0, i);
    }
  }
  return s;
}

// Why `path` is no model file (nor a Hugging Face model directory with its
// config.json), or "": opened as the loader opens it, without blocking
// (gpu/file_check.h), so a FIFO is named here instead of hanging the node.
std::string model_problem(const std::string& path) {
  if (std::string why = gpu::file_problem(path, gpu::Accept::regular_file_or_directory); !why.empty()) return why;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    if (std::string why = gpu::file_problem(path + "/config.json"); !why.empty()) return "config.json: " + why;
  return {};
}

// One "key = value" line of the file, as the scanner saw it.
struct Entry {
  std::string name;  // "group.key"
  std::string value;
  int line = 0;
  std::string type;  // the option's CAF type name
};

// The line number CAF's INI parser put into its error, or 0.
int error_line(const caf::error& err) {
  const caf::message& ctx = err.context();
  if (ctx.size() == 1 && ctx.match_element<caf::settings>(0)) {
    const auto& where = ctx.get_as<caf::settings>(0);
    if (auto line = caf::get_if<int64_t>(&where, "line")) return int(*line);
  }
  return 0;
}

}  // namespace

std::string NodeOptions::validate() const {
  std::string problems;
  const bool worker = role == "prefill" || role == "decode" || role == "worker";
  const bool frontend = role == "frontend";
  if (role.empty())
    add_problem(problems, "node.role is required (router, prefill, decode, worker or frontend)");
  else if (role != "router" && !worker && !frontend)
    add_problem(problems, "node.role must be router, prefill, decode, worker or frontend (got \"" + role + "\")");
  if (host.empty()) add_problem(problems, "node.host must not be empty");
  if (max_message_bytes < 1024 || max_message_bytes > int64_t{0xFFFFFFFF})
    add_problem(problems, "node.max-message-bytes must be in [1024, 4294967295]");
  // A time in ms, at most a day (kMaxDeadlineMs): more overflowed the
  // timers' nanoseconds, and a port guard then expired every connection at once.
  auto in_ms = [&](int64_t value, const char* key, int64_t least) {
    if (value < least || value > kMaxDeadlineMs)
      add_problem(problems, std::string("node.") + key + " must be in [" + std::to_string(least) + ", " +
                                std::to_string(kMaxDeadlineMs) + "]");
  };
  in_ms(handshake_timeout_ms, "handshake-timeout-ms", 1);
  in_ms(message_timeout_ms, "message-timeout-ms", 1);
  if (max_connections <= 0) add_problem(problems, "node.max-connections must be > 0");
  if (max_pending_per_source <= 0) add_problem(problems, "node.max-pending-per-source must be > 0");
  if (role == "decode" && advertise_host.empty() && (host == "0.0.0.0" || host == "::"))
    add_problem(problems, "node.advertise-host is required when node.host is the wildcard " + host +
                              " (prefill nodes must know where to connect)");
  // A decode node's endpoint is dialled by prefill nodes: with the router on
  // another host, so may they be, and a loopback address would lead them
  // to themselves.
  const std::string advertised = advertise_host.empty() ? host : advertise_host;
  if (role == "decode" && is_loopback(advertised) && !router_host.empty() && !is_loopback(router_host))
    add_problem(problems, "node.advertise-host " + advertised + " is a loopback address, but the router (node.router-host " +
                              router_host + ") is on another host, and so may the prefill nodes be that dial it: set " +
                              "node.host or node.advertise-host to an address they can reach");
  if ((worker || frontend) && router_host.empty()) add_problem(problems, "node.router-host must not be empty");
  if ((worker || frontend) && router_port == 0)
    add_problem(problems, "node.router-port is required for a " + role + " node");
  in_ms(connect_retry_ms, "connect-retry-ms", 1);
  in_ms(connect_backoff_max_ms, "connect-backoff-max-ms", 1);
  if (connect_backoff_max_ms < connect_retry_ms)
    add_problem(problems, "node.connect-backoff-max-ms must be >= node.connect-retry-ms");
  in_ms(connect_timeout_ms, "connect-timeout-ms", 0);
  in_ms(peer_refresh_ms, "peer-refresh-ms", 1);
  if (frontend && http_host.empty()) add_problem(problems, "node.http-host must not be empty");
  if (http_body_limit <= 0) add_problem(problems, "node.http-body-limit must be > 0");
  if (http_stream_buffer_bytes <= 0) add_problem(problems, "node.http-stream-buffer-bytes must be > 0");
  if (http_dead_client_ms < 1000 || http_dead_client_ms > 3600000)
    add_problem(problems, "node.http-dead-client-ms must be in [1000, 3600000]");
  if (http_threads < 1) add_problem(problems, "node.http-threads must be >= 1");
  if (chat_template != "auto" && !gpu::parse_chat_template(chat_template))
    add_problem(problems, "node.chat-template must be \"auto\" or one of " + gpu::chat_template_names() + " (got \"" +
                              chat_template + "\")");
  LogLevel level;
  if (!parse_log_level(log_level, &level))
    add_problem(problems, "node.log-level must be \"error\", \"warning\" or \"info\" (got \"" + log_level + "\")");
  return problems;
}

NodeRole NodeOptions::parsed_role() const {
  if (role == "frontend") return NodeRole::frontend;
  if (role == "prefill") return NodeRole::prefill;
  if (role == "decode") return NodeRole::decode;
  if (role == "worker") return NodeRole::worker;
  return NodeRole::router;
}

void add_node_options(caf::config_option_set& options, NodeOptions& n) {
  OptionAdder{options, "node"}
      .add(n.role, "role", "router, prefill, decode, worker (colocated prefill + decode) or frontend")
      .add_computed(n.name, "name", "worker name at the router (default: role@host/pid)")
      .add(n.host, "host", "address this node listens on")
      .add(n.port, "port", "router: client/worker port; decode: KV port (0: any free port)")
      .add_computed(n.advertise_host, "advertise-host", "decode: host prefill nodes dial (default: host)")
      .add(n.router_host, "router-host", "workers: the router's address")
      .add(n.router_port, "router-port", "workers: the router's port")
      .add(n.connect_retry_ms, "connect-retry-ms", "first delay between tries to reach the router")
      .add(n.connect_backoff_max_ms, "connect-backoff-max-ms", "longest delay between tries")
      .add(n.connect_timeout_ms, "connect-timeout-ms", "give up reaching the router after (0: never)")
      .add(n.peer_refresh_ms, "peer-refresh-ms", "prefill: how often to look for new decode nodes")
      .add(n.ready_file, "ready-file", "file written once the node serves")
      .add(n.log_level, "log-level", "error, warning or info")
      .add(n.metrics_port, "metrics-port", "GET /metrics (Prometheus) on host:metrics-port (0: off)")
      .add(n.port_guard, "port-guard", "router, decode: check every peer's messages in front of the CAF port")
      .add(n.max_message_bytes, "max-message-bytes", "largest message a peer may announce (port guard)")
      .add(n.handshake_timeout_ms, "handshake-timeout-ms", "a peer's handshake must be complete by then (port guard)")
      .add(n.message_timeout_ms, "message-timeout-ms", "a message over 64 KiB must be complete by then (port guard)")
      .add(n.max_connections, "max-connections", "connections a port accepts at once (port guard)")
      .add(n.max_pending_per_source, "max-pending-per-source",
           "connections in their handshake from one address at once (port guard)")
      .add(n.http_host, "http-host", "frontend: address of the HTTP API")
      .add(n.http_port, "http-port", "frontend: port of the HTTP API (0: any free port)")
      .add(n.http_body_limit, "http-body-limit", "frontend: largest request body in bytes (more: 413)")
      .add(n.http_stream_buffer_bytes, "http-stream-buffer-bytes",
           "frontend: bytes of a stream queued for a client that reads slowly; more: cancelled, closed")
      .add(n.http_dead_client_ms, "http-dead-client-ms",
           "frontend: ms a client may acknowledge nothing (its host gone) before its request is cancelled")
      .add(n.http_threads, "http-threads", "frontend: HTTP I/O threads")
      .add(n.chat_template, "chat-template", "frontend: auto (the model file's) or a built-in (text/chat_template.h)")
      .add(n.trust_request_chat_template, "trust-request-chat-template",
           "frontend: render a request's own chat_template (code a client runs here); false: a 400")
      .add_computed(n.served_model_name, "served-model-name",
                    "frontend: the model's name in the API (default: file name)");
}

NodeSystemConfig::NodeSystemConfig() {
  add_node_options(custom_options_, node);
  add_tls_options(custom_options_, tls);
  load<caf::io::middleman>();
}

// What is wrong with `value` for an option of CAF type `type`, before CAF
// reads it ("": nothing the scanner sees).
std::string value_problem(const std::string& name, const std::string& value, const std::string& type) {
  if (value.empty()) return name + " has no value";
  if (value[0] == '\'' && type != "atom")
    return name + " = " + value + ": single-quoted values are atoms, which CAF ignores for a " + type +
           " option; write \"" + value.substr(1, value.size() >= 2 ? value.size() - 2 : 0) + "\"";
  if (std::isalpha(static_cast<unsigned char>(value[0])) && value != "true" && value != "false")
    return name + " = " + value + ": strings must be double-quoted (\"" + value + "\")";
  return {};
}

// CAF keeps only values it could convert to the option's type: whatever
// the scanner accepted (`entries`) but CAF dropped had the wrong type or range.
std::vector<std::string> check_with_caf(const std::string& text, const std::string& where,
                                        const caf::config_option_set& options, const std::vector<Entry>& entries) {
  std::vector<std::string> problems;
  std::istringstream again(text);
  auto parsed = caf::actor_system_config::parse_config(again, options);
  if (!parsed) {
    const int line = error_line(parsed.error());
    problems.push_back(where + (line > 0 ? " line " + std::to_string(line) : std::string()) +
                       ": CAF cannot parse it (strings must be double-quoted): " +
                       caf::actor_system_config::render(parsed.error()));
    return problems;
  }
  for (const auto& e : entries)
    if (caf::get_if(&*parsed, e.name) == nullptr)
      problems.push_back(where + " line " + std::to_string(e.line) + ": " + e.name + " = " + e.value + ": not a valid " +
                         e.type + " (CAF would ignore it)");
  return problems;
}

std::vector<std::string> check_config_file(const std::string& path,
                                           const caf::config_option_set& options) {
  std::vector<std::string> problems;
  const std::string where = "config " + path;
  // Read once, without blocking on a FIFO (gpu/file_check.h); both passes
  // below read these bytes.
  std::string text;
  try {
    text = gpu::read_regular_file(path);
  } catch (const gpu::Error& e) {
    return {std::string("config ") + e.what()};  // "config <path>: not a regular file (a FIFO)"
  }
  std::istringstream in(text);
  auto report = [&](int line, const std::string& what) {
    problems.push_back(where + " line " + std::to_string(line) + ": " + what);
  };
  auto known_group = [&](const std::string& group) {
    for (const auto& opt : options)
      if (std::string(opt.category().data(), opt.category().size()) == group) return true;
    return false;
  };

  std::vector<Entry> entries;
  std::string group = "global";
  std::string raw;
  for (int number = 1; std::getline(in, raw); ++number) {
    const std::string line = trim(raw);
    if (line.empty() || line[0] == ';') continue;
    if (line[0] == '#') {
      report(number, "comments start with ';' ('#' is a CAF parse error)");
      continue;
    }
    if (line[0] == '[') {
      const auto close = line.find(']');
      group = trim(line.substr(1, close == std::string::npos ? std::string::npos : close - 1));
      if (close == std::string::npos || trim(strip_comment(line.substr(close + 1))) != "")
        report(number, "malformed group header " + line);
      else if (!known_group(group))
        report(number, "unknown group [" + group + "]");
      continue;
    }
    const auto eq = line.find('=');
    if (eq == std::string::npos) {
      report(number, "expected key = value, got " + line);
      continue;
    }
    const std::string key = trim(line.substr(0, eq));
    std::string value = trim(strip_comment(line.substr(eq + 1)));
    const int first_line = number;
    // A list may continue over the next lines until its closing bracket.
    if (!value.empty() && value[0] == '[') {
      while (value.find(']') == std::string::npos && std::getline(in, raw)) {
        ++number;
        value += " " + trim(strip_comment(raw));
      }
    }
    const std::string name = group + "." + key;
    // (CAF keeps the first and drops the rest with a warning no one sees)
    if (auto earlier = std::find_if(entries.begin(), entries.end(), [&](const Entry& e) { return e.name == name; });
        earlier != entries.end()) {
      report(first_line, name + " is set again (line " + std::to_string(earlier->line) + " set it; CAF keeps that one)");
      continue;
    }
    auto option = options.qualified_name_lookup(group, key);
    if (!option) {
      report(first_line, "unknown option " + name);
      continue;
    }
    const caf::string_view type_view = option->type_name();
    const std::string type(type_view.data(), type_view.size());
    if (const std::string problem = value_problem(name, value, type); !problem.empty())
      report(first_line, problem);
    else
      entries.push_back(Entry{name, value, first_line, type});
  }
  if (!problems.empty()) return problems;
  return check_with_caf(text, where, options, entries);
}

NodeConfigResult load_node_config(NodeSystemConfig& config, int argc, char** argv) {
  NodeConfigResult result;
  auto& errors = result.errors;
  const std::string flag = "--config-file=";
  std::string file;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.compare(0, flag.size(), flag) == 0) {
      // (CAF reads the first: the file checked must be the one it reads)
      if (!file.empty()) {
        errors.push_back("--config-file given twice (" + file + ", " + arg.substr(flag.size()) + "): name one file");
        return result;
      }
      file = arg.substr(flag.size());
    }
    if (arg == "--config-file" || arg.rfind("--caf#config-file", 0) == 0) {
      errors.push_back("write --config-file=FILE (CAF reads no separate value, and the file it reads is checked)");
      return result;
    }
  }
  // Without --config-file CAF reads caf-application.ini when there is one
  // (of any kind: a FIFO is refused by the check, where CAF would block on it).
  struct stat st {};
  if (file.empty() && ::stat("caf-application.ini", &st) == 0) file = "caf-application.ini";
  if (!file.empty()) {
    errors = check_config_file(file, config.options());
    if (!errors.empty()) return result;
  }
  if (auto err = config.parse(argc, argv)) {
    errors.push_back("command line: " + caf::actor_system_config::render(err));
    return result;
  }
  if (config.cli_helptext_printed) {
    result.help_printed = true;
    return result;
  }
  for (const auto& arg : config.remainder) errors.push_back("unexpected argument " + arg);

  const NodeOptions& node = config.node;
  // The KV receivers listen where the node does (or where it is reached,
  // when it listens on every address), unless told otherwise.
  const bool wildcard = node.host == "0.0.0.0" || node.host == "::";
  if (config.disagg.kv_host.empty())
    config.disagg.kv_host = wildcard && !node.advertise_host.empty() ? node.advertise_host : node.host;
  const DisaggConfig& disagg = config.disagg;
  // validate() joins its problems with "; "; DisaggConfig names its options
  // without their group.
  auto split = [&](const std::string& problems, const std::string& prefix) {
    std::istringstream in(problems);
    std::string one;
    while (std::getline(in, one, ';')) errors.push_back(prefix + trim(one));
  };
  split(node.validate(), "");
  split(disagg.validate(), "disagg.");
  // CAF's own [openssl] group alone would configure certificates that no
  // connection uses (the openssl module is loaded only for [tls]).
  if (!config.openssl_certificate.empty() || !config.openssl_key.empty() || !config.openssl_cafile.empty() ||
      !config.openssl_capath.empty() || !config.openssl_passphrase.empty())
    errors.push_back("the [openssl] options are not used: set tls.certificate, tls.key and tls.ca-file instead");
  split(config.tls.validate(), "");
  // Every connection's liveness rests on CAF's heartbeats and its timeout for
  // a silent connection (actors/config.h, watch_connections).
  const auto heartbeat = caf::get_or(config, "middleman.heartbeat-interval", caf::timespan{kMiddlemanHeartbeat});
  const auto silent = caf::get_or(config, "middleman.connection-timeout", caf::timespan{kMiddlemanConnectionTimeout});
  if (heartbeat.count() <= 0)
    errors.push_back("middleman.heartbeat-interval must be > 0 (without heartbeats the connections of a host that "
                     "vanished are never closed)");
  else if (silent < 2 * heartbeat)
    errors.push_back("middleman.connection-timeout must be at least twice middleman.heartbeat-interval (else a "
                     "healthy idle connection is closed between two heartbeats)");
  if (node.role == "decode" && is_loopback(disagg.kv_host) && !is_loopback(node.router_host))
    errors.push_back("disagg.kv-host " + disagg.kv_host + " is a loopback address, but the router (node.router-host " +
                     node.router_host + ") is on another host, and so may the prefill nodes be that stream the KV " +
                     "there: set disagg.kv-host (default: the node's own address) to an address they can reach");
  if (!errors.empty()) return result;

  const bool worker = node.role != "router";  // frontends too: the model sets the context
  if (worker && disagg.model.empty())
    errors.push_back("disagg.model is required for a " + node.role + " node");
  if (!disagg.model.empty())
    if (const std::string why = model_problem(disagg.model); !why.empty())
      errors.push_back("disagg.model: " + disagg.model + " is not a readable file (or a directory with a config.json): " + why);
  if (!disagg.tokenizer.empty())
    if (const std::string why = gpu::file_problem(disagg.tokenizer); !why.empty())
      errors.push_back("disagg.tokenizer: " + disagg.tokenizer + " is not a readable file: " + why);
  return result;
}

}  // namespace disagg
