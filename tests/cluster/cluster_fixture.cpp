#include "cluster/cluster_fixture.h"

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "model/checkpoint.h"
#include "engine/engine.h"
#include "gpu/error.h"
#include "engine/generate.h"
#include "support/test_paths.h"

namespace disagg::test {

GenerateRequest token_request(const std::vector<int>& prompt, int max_new_tokens, Sampling sampling) {
  GenerateRequest r;
  r.prompt_tokens.assign(prompt.begin(), prompt.end());
  r.max_new_tokens = max_new_tokens;
  r.sampling = sampling;
  return r;
}

std::vector<int32_t> colocated_tokens(const std::string& model, const GenerateRequest& request) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<gpu::Engine>> engines;
  std::lock_guard<std::mutex> lock(mutex);
  auto& engine = engines[model];
  if (!engine) engine = std::make_unique<gpu::Engine>(gpu::Checkpoint::open(model));
  const auto out = gpu::generate(*engine, std::vector<int>(request.prompt_tokens.begin(), request.prompt_tokens.end()),
                                 request.max_new_tokens,
                                 {request.sampling.temperature, request.sampling.top_p, request.sampling.seed});
  return std::vector<int32_t>(out.tokens.begin(), out.tokens.end());
}

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

std::string node_binary() { return bin_dir() + "/disagg-node"; }
std::string client_binary() { return bin_dir() + "/disagg-client"; }

void make_certificates(const std::string& dir, const std::vector<std::string>& names) {
  std::vector<std::string> argv{std::string(DISAGG_SOURCE_DIR) + "/scripts/cluster", "certs", dir};
  argv.insert(argv.end(), names.begin(), names.end());
  std::string out, err;
  const int code = run_to_completion(argv, out, err, std::chrono::seconds(60));
  if (code != 0)
    throw std::runtime_error("scripts/cluster certs " + dir + " failed (" + std::to_string(code) + "): " + out + err);
}

TlsOptions certificate_files(const std::string& dir, const std::string& name) {
  return TlsOptions{dir + "/" + name + ".pem", dir + "/" + name + ".key", dir + "/ca.pem"};
}

TestCluster::TestCluster(const std::string& tag) : dir_(make_temp_dir(tag)), router_port_(free_loopback_port()) {
  if (!std::filesystem::exists(node_binary()))
    throw std::runtime_error(node_binary() + " is missing: build the disagg-node target");
}

TestCluster::~TestCluster() {
  remote_.reset();
  for (auto& kv : nodes_) kv.second->stop(std::chrono::seconds(3));
  nodes_.clear();
  std::error_code ignored;
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir_, ignored);
}

std::string TestCluster::model() const { return model_.empty() ? shared_model() : model_; }

void TestCluster::enable_tls() {
  tls_dir_ = dir_ + "/tls";
  make_certificates(tls_dir_, {"router", "prefill-1", "prefill-2", "decode-1", "decode-2", "client"});
  remote_.reset();
}

std::string TestCluster::config_text(const std::string& role, const std::string& name, uint16_t port,
                                     const std::string& extra, const std::string& disagg_extra) const {
  std::ostringstream ini;
  // A default of the fixture's only where the test's extras do not set the
  // key (a node refuses a key set twice: CAF kept the first, the default).
  const std::string disagg_extras = disagg_extra_ + "\n" + disagg_extra;
  auto set_in = [](const std::string& extras, const std::string& key) {
    std::istringstream lines(extras);
    for (std::string line; std::getline(lines, line);) {
      const auto start = line.find_first_not_of(" \t");
      if (start != std::string::npos && line.compare(start, key.size(), key) == 0 &&
          line.find_first_not_of(" \t", start + key.size()) != std::string::npos &&
          line[line.find_first_not_of(" \t", start + key.size())] == '=')
        return true;
    }
    return false;
  };
  auto node_default = [&](const std::string& key, const std::string& value) {
    if (!set_in(extra, key)) ini << key << " = " << value << "\n";
  };
  ini << "; written by test_cluster\n[node]\nrole = \"" << role << "\"\n";
  if (role != "router") ini << "name = \"" << name << "\"\nrouter-port = " << router_port_ << "\n";
  if (placed_.count(name)) ini << (role == "frontend" ? "http-host" : "host") << " = \"" << address_of(name) << "\"\n";
  if (role != "router" && (placed_.count("router") || !router_dialed_at_.empty()))
    ini << "router-host = \"" << (router_dialed_at_.empty() ? address_of("router") : router_dialed_at_) << "\"\n";
  if (role == "frontend") ini << "http-port = " << port << "\n";
  else if (role != "prefill" && role != "worker") ini << "port = " << port << "\n";
  node_default("connect-retry-ms", "50");
  node_default("connect-backoff-max-ms", "500");
  node_default("connect-timeout-ms", "60000");
  node_default("peer-refresh-ms", "200");
  ini << extra;
  ini << "\n[disagg]\nmodel = \"" << (model_.empty() ? shared_model() : model_) << "\"\nbackend = \"cpu\"\n";
  // (the workers read the vocabulary's bytes from it for structured output)
  if (with_tokenizer_) ini << "tokenizer = \"" << shared_tokenizer() << "\"\n";
  if ((role == "decode" || role == "worker") && !set_in(disagg_extras, "pool-blocks")) ini << "pool-blocks = 512\n";
  if (local_prefill_tokens_ && !set_in(disagg_extras, "local-prefill-tokens"))
    ini << "local-prefill-tokens = " << *local_prefill_tokens_ << "\n";
  ini << disagg_extras << "\n";
  if (tls()) {
    const TlsOptions files = certificate_files(tls_dir_, name);
    ini << "\n[tls]\ncertificate = \"" << files.certificate << "\"\nkey = \"" << files.key << "\"\nca-file = \""
        << files.ca_file << "\"\n";
  }
  return ini.str();
}

ChildProcess& TestCluster::start_node(const std::string& role, const std::string& name, const std::string& extra,
                                      const std::string& disagg_extra) {
  uint16_t port = 0;
  if (role == "router") port = router_port_;
  else if (role == "decode" || role == "frontend") port = ports_.count(name) ? ports_.at(name) : free_loopback_port();
  const std::string ini = dir_ + "/" + name + ".ini";
  write_text_file(ini, config_text(role, name, port, extra, disagg_extra));
  roles_[name] = role;
  ports_[name] = port;
  if (auto it = nodes_.find(name); it != nodes_.end()) it->second->stop();
  stopped_.erase(name);
  std::vector<std::string> argv;
  if (auto it = placed_.find(name); it != placed_.end()) argv = it->second.prefix;
  argv.push_back(node_binary());
  argv.push_back("--config-file=" + ini);
  nodes_[name] = std::make_unique<ChildProcess>(std::move(argv), dir_ + "/" + name + ".log");
  return *nodes_[name];
}

void TestCluster::place(const std::string& name, std::vector<std::string> prefix, const std::string& address) {
  placed_[name] = Placement{std::move(prefix), address};
  if (name == "router") remote_.reset();
}

std::string TestCluster::address_of(const std::string& name) const {
  auto it = placed_.find(name);
  return it == placed_.end() ? "127.0.0.1" : it->second.address;
}

void TestCluster::start_all(int prefill, int decode) {
  start_router();
  for (int i = 1; i <= prefill; ++i) start_node("prefill", "prefill-" + std::to_string(i));
  for (int i = 1; i <= decode; ++i) start_node("decode", "decode-" + std::to_string(i));
  ASSERT_TRUE(wait_for_workers(prefill, decode));
}

int TestCluster::stop_node(const std::string& name) {
  stopped_.insert(name);
  return nodes_.at(name)->stop();
}

void TestCluster::kill_node(const std::string& name) {
  stopped_.insert(name);
  nodes_.at(name)->kill_hard();
}

std::vector<std::string> TestCluster::names(const std::string& role) const {
  std::vector<std::string> out;
  for (const auto& kv : roles_)
    if (kv.second == role) out.push_back(kv.first);
  return out;
}

::testing::AssertionResult TestCluster::wait_until_idle(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string last = "no status";
  for (;;) {
    if (auto status = client().status()) {
      bool idle = status->in_flight == 0 && status->queued == 0;
      last = "in flight " + std::to_string(status->in_flight) + ", queued " + std::to_string(status->queued);
      for (const auto& w : status->workers)
        if (w.role == WorkerRole::decode) {
          idle = idle && w.free_blocks == w.total_blocks;
          last += "; " + w.name + " free " + std::to_string(w.free_blocks) + "/" + std::to_string(w.total_blocks);
        }
      if (idle) return ::testing::AssertionSuccess();
    }
    if (Clock::now() >= deadline) return ::testing::AssertionFailure() << "not idle: " << last;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // (a poll of the router's status, bounded)
  }
}

Client& TestCluster::client() {
  if (!remote_) {
    try {
      remote_ = std::make_unique<RemoteClient>(router_address(), std::chrono::seconds(20), ClientOptions{},
                                               tls() ? certificate_files(tls_dir_, "client") : TlsOptions{});
    } catch (const gpu::Error& e) {
      throw std::runtime_error(std::string(e.what()) + "\n" + logs());
    }
  }
  return remote_->client();
}

::testing::AssertionResult TestCluster::wait_for_workers(int prefill, int decode, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  std::string last = "no status";
  for (;;) {
    for (auto& kv : nodes_)
      if (!stopped_.count(kv.first) && !kv.second->running())
        return ::testing::AssertionFailure() << "node " << kv.first << " exited\n" << logs();
    if (auto status = client().status(std::chrono::seconds(2))) {
      const int p = status->count(WorkerRole::prefill), d = status->count(WorkerRole::decode);
      if (p == prefill && d == decode) return ::testing::AssertionSuccess();
      last = "prefill=" + std::to_string(p) + " decode=" + std::to_string(d);
    }
    if (Clock::now() >= deadline)
      return ::testing::AssertionFailure() << "expected prefill=" << prefill << " decode=" << decode
                                           << ", the router reports " << last << "\n"
                                           << logs();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

::testing::AssertionResult TestCluster::stop_all() {
  remote_.reset();
  std::string failures;
  // Workers first, so none of them spends its shutdown looking for the router.
  for (const char* role : {"frontend", "prefill", "decode", "router"})
    for (auto& kv : nodes_) {
      if (roles_[kv.first] != role) continue;
      const bool was_running = kv.second->running();
      const int code = kv.second->stop();
      if (was_running && code != 0) failures += kv.first + " exited with " + std::to_string(code) + "; ";
      if (process_alive(kv.second->pid())) failures += kv.first + " is still alive; ";
    }
  if (failures.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << failures << "\n" << logs();
}

std::string TestCluster::logs() const {
  std::string out;
  for (const auto& kv : nodes_) out += "---- " + kv.first + ".log\n" + kv.second->log();
  return out;
}

}  // namespace disagg::test
