// A multi-process cluster for tests: disagg-node processes on free loopback
// ports, configured by INI files written into a temp dir, sharing the shared
// stories260K model; and a client in the test process (a remote CAF node).
// Everything started is stopped by the destructor, also when a test fails.
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "node/client.h"
#include "cluster/child_process.h"

namespace disagg::test {

// A request by token ids (no deadline: the client's default).
GenerateRequest token_request(const std::vector<int>& prompt, int max_new_tokens, Sampling sampling = {});
// What colocated generation (gpu::generate, what disagg-generate runs) makes
// of `request` on the checkpoint at `model` (each model's engine loaded once).
std::vector<int32_t> colocated_tokens(const std::string& model, const GenerateRequest& request);

std::string node_binary();    // build/bin/disagg-node
std::string client_binary();  // build/bin/disagg-client

// Makes a test CA in `dir` (ca.pem) and a certificate NAME.pem + NAME.key
// signed by it for each name, with `scripts/cluster certs`; throws on failure.
void make_certificates(const std::string& dir, const std::vector<std::string>& names);
// The files of certificate `name` in `dir`, as TlsOptions.
TlsOptions certificate_files(const std::string& dir, const std::string& name);

class TestCluster {
 public:
  explicit TestCluster(const std::string& tag);
  ~TestCluster();  // stops every node, removes the temp dir
  TestCluster(const TestCluster&) = delete;
  TestCluster& operator=(const TestCluster&) = delete;

  const std::string& dir() const { return dir_; }
  uint16_t router_port() const { return router_port_; }
  std::string router_address() const { return address_of("router") + ":" + std::to_string(router_port_); }
  // Runs node `name` (when started from now on) on another host: its command
  // after `prefix` (NetLab::run_on), listening and advertised at `address`;
  // every node and the client dial the router at its address.
  void place(const std::string& name, std::vector<std::string> prefix, const std::string& address);
  std::string address_of(const std::string& name) const;  // its host's, or 127.0.0.1
  // Nodes started from now on dial the router at `address` (its port
  // unchanged) instead of the router's own: a relay there (DelayRelay) adds a
  // link's latency. The client still dials the router itself.
  void dial_router_at(const std::string& address) { router_dialed_at_ = address; }

  // Mutual TLS for every node started from now on (a [tls] group with the
  // certificate named like the node) and for client(): a CA and certificates
  // for router, prefill-1..2, decode-1..2 and client, in <dir>/tls.
  void enable_tls();
  bool tls() const { return !tls_dir_.empty(); }
  const std::string& tls_dir() const { return tls_dir_; }

  // The INI text of a node of this cluster (shared model; the router and a
  // frontend also get the tokenizer); `extra` lines are appended to its
  // [node] group, `disagg_extra` to its [disagg] group (later keys win). A
  // frontend's `port` is its http-port.
  std::string config_text(const std::string& role, const std::string& name, uint16_t port,
                          const std::string& extra = "", const std::string& disagg_extra = "") const;
  // The checkpoint every node started from now on serves (default: the shared model).
  void set_model(const std::string& path) { model_ = path; }
  std::string model() const;  // what the nodes serve
  // Whether the router and frontends name the shared tokenizer file (default);
  // false for a model that carries its vocabulary (GGUF).
  void set_tokenizer_file(bool with) { with_tokenizer_ = with; }
  // Lines appended to the [disagg] group of every node started from now on.
  void set_disagg_options(const std::string& lines) { disagg_extra_ = lines; }
  // The router's local-prefill-tokens for nodes started from now on. The
  // fixture's is 0 (every prompt to a prefill node: the tests are about the
  // disaggregated path, which the default skips for their short prompts);
  // nullopt: DisaggConfig's default.
  void set_local_prefill_tokens(std::optional<int> n) { local_prefill_tokens_ = n; }
  // Writes <dir>/<name>.ini and starts disagg-node on it.
  ChildProcess& start_node(const std::string& role, const std::string& name, const std::string& extra = "",
                           const std::string& disagg_extra = "");
  ChildProcess& start_router() { return start_node("router", "router"); }
  // 1 router + `prefill` + `decode` workers, then waits for all to register.
  void start_all(int prefill, int decode);

  ChildProcess& node(const std::string& name) { return *nodes_.at(name); }
  // Stops (SIGTERM; its exit code) or kills (SIGKILL) a node on purpose:
  // wait_for_workers no longer counts its exit as a failure.
  int stop_node(const std::string& name);
  void kill_node(const std::string& name);
  uint16_t port_of(const std::string& name) const { return ports_.at(name); }
  std::vector<std::string> names(const std::string& role) const;

  // Waits until the router reports exactly these worker counts.
  ::testing::AssertionResult wait_for_workers(int prefill, int decode,
                                              std::chrono::milliseconds timeout = std::chrono::seconds(30));

  // Waits until the router holds no request (none in flight, none queued)
  // and every decode worker's pool is whole again.
  ::testing::AssertionResult wait_until_idle(std::chrono::milliseconds timeout);

  // A client connected to the router (connects on first use).
  Client& client();
  void reconnect_client() { remote_.reset(); }  // after a router restart

  // Stops every node with SIGTERM; each must exit 0. Returns the failures.
  ::testing::AssertionResult stop_all();
  // The logs of every node, for failure messages.
  std::string logs() const;

 private:
  std::string dir_;
  uint16_t router_port_;
  std::string router_dialed_at_;  // dial_router_at(); empty: the router's address
  std::map<std::string, std::string> roles_;
  std::map<std::string, uint16_t> ports_;
  std::map<std::string, std::unique_ptr<ChildProcess>> nodes_;
  std::set<std::string> stopped_;  // by stop_node / kill_node
  std::unique_ptr<RemoteClient> remote_;
  std::string disagg_extra_;
  std::optional<int> local_prefill_tokens_ = 0;
  std::string model_;
  bool with_tokenizer_ = true;
  std::string tls_dir_;
  struct Placement {
    std::vector<std::string> prefix;
    std::string address;
  };
  std::map<std::string, Placement> placed_;
};

}  // namespace disagg::test
