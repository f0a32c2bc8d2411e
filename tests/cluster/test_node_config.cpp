// A node's configuration: what CAF would silently drop is an error with its
// file and line; a misconfigured node exits at once with a clear message; the
// example configs are valid; scripts/cluster starts and stops a cluster.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <regex>

#include "node/config.h"
#include "cluster/raw_peer.h"
#include "cluster/child_process.h"
#include "cluster/cluster_fixture.h"
#include "model/model_writer.h"
#include "gpu/open_error.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

// The problems check_config_file finds in `text`, one string.
std::string problems_in(const std::string& text) {
  const std::string dir = make_temp_dir("node-config");
  const std::string path = dir + "/node.ini";
  write_text_file(path, text);
  NodeSystemConfig config;
  std::string all;
  for (const auto& p : check_config_file(path, config.options())) all += p + "\n";
  std::filesystem::remove_all(dir);
  return all;
}

TEST(NodeConfigFile, AcceptsWhatCafReadsFaithfully) {
  EXPECT_EQ(problems_in("; comment\n[node]\nrole = \"decode\" ; why\nport = 4611\nconnect-retry-ms = 50\n"
                        "[disagg]\nmodel = \"m.bin\"\nblock-size = 32\n[middleman]\n"
                        "enable-automatic-connections = false\nheartbeat-interval = 1s\n"
                        "app-identifiers = [\"a\",\n  \"b\"]\n[scheduler]\npolicy = 'sharing'\n"),
            "");
}

// Every connection of a node is watched (actors/config.h, watch_connections):
// CAF's heartbeats and its timeout for a silent connection are on by
// default, and the node's file may set them otherwise.
TEST(NodeConfigFile, ConnectionsAreWatchedByDefaultAndTheFileMayChangeHow) {
  const caf::timespan off{0};
  auto loaded = [&](const std::string& text) {
    auto config = std::make_unique<NodeSystemConfig>();
    const std::string dir = make_temp_dir("node-config");
    write_text_file(dir + "/node.ini", "[node]\nrole = \"router\"\n" + text);
    std::string flag = "--config-file=" + dir + "/node.ini";
    char* argv[] = {const_cast<char*>("disagg-node"), flag.data(), nullptr};
    const NodeConfigResult result = load_node_config(*config, 2, argv);
    std::filesystem::remove_all(dir);
    EXPECT_TRUE(result.errors.empty()) << result.errors.front();
    return config;
  };
  const auto defaults = loaded("");
  EXPECT_EQ(caf::get_or(*defaults, "middleman.heartbeat-interval", off), caf::timespan{kMiddlemanHeartbeat});
  EXPECT_EQ(caf::get_or(*defaults, "middleman.connection-timeout", off), caf::timespan{kMiddlemanConnectionTimeout});
  const auto own = loaded("[middleman]\nheartbeat-interval = 1s\nconnection-timeout = 4s\n");
  EXPECT_EQ(caf::get_or(*own, "middleman.heartbeat-interval", off), caf::timespan{std::chrono::seconds(1)});
  EXPECT_EQ(caf::get_or(*own, "middleman.connection-timeout", off), caf::timespan{std::chrono::seconds(4)});
}

// The errors load_node_config finds for a command line of these
// arguments, one string.
std::string errors_of_args(std::vector<std::string> args) {
  NodeSystemConfig config;
  std::vector<char*> argv = {const_cast<char*>("disagg-node")};
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const NodeConfigResult result = load_node_config(config, int(argv.size()) - 1, argv.data());
  std::string all;
  for (const auto& e : result.errors) all += e + "\n";
  return all;
}

// The same for a router's config file of this text.
std::string errors_of_file(const std::string& ini) {
  const std::string dir = make_temp_dir("node-config");
  write_text_file(dir + "/node.ini", ini);
  const std::string all = errors_of_args({"--config-file=" + dir + "/node.ini"});
  std::filesystem::remove_all(dir);
  return all;
}

// Heartbeats off, or a silent connection's timeout no longer than two of
// them, would leave a vanished host's connections open or close healthy ones.
TEST(NodeConfigFile, RefusesConnectionWatchingThatCannotWork) {
  auto errors_of = [](const std::string& middleman) {
    return errors_of_file("[node]\nrole = \"router\"\n[middleman]\n" + middleman);
  };
  EXPECT_NE(errors_of("heartbeat-interval = 0s\n").find("middleman.heartbeat-interval must be > 0"), std::string::npos);
  EXPECT_NE(errors_of("heartbeat-interval = 3s\nconnection-timeout = 5s\n").find("at least twice"), std::string::npos);
  EXPECT_NE(errors_of("connection-timeout = 9s\n").find("at least twice"), std::string::npos);  // the 5 s default
  EXPECT_EQ(errors_of("heartbeat-interval = 1s\nconnection-timeout = 2s\n"), "");
  EXPECT_EQ(errors_of(""), "");
}

// A node's times are at most a day: a larger one overflowed the port
// guard's timers into the past, which then closed every connection at once.
TEST(NodeConfigFile, TimesAreAtMostADay) {
  auto errors_of = [](const std::string& node) { return errors_of_file("[node]\nrole = \"router\"\n" + node); };
  for (const char* key : {"handshake-timeout-ms", "message-timeout-ms", "connect-retry-ms", "connect-backoff-max-ms",
                          "connect-timeout-ms", "peer-refresh-ms"}) {
    SCOPED_TRACE(key);
    EXPECT_NE(errors_of(std::string(key) + " = 9223372036854775807\n").find(std::string("node.") + key + " must be in"),
              std::string::npos);
    const std::string day = std::string(key) + " = " + std::to_string(kMaxDeadlineMs) + "\n";
    EXPECT_EQ(errors_of(day + (std::string(key) == "connect-retry-ms" ? "connect-backoff-max-ms = 86400000\n" : "")), "");
  }
  EXPECT_NE(errors_of("handshake-timeout-ms = 0\n").find("node.handshake-timeout-ms must be in [1, "), std::string::npos);
  EXPECT_EQ(errors_of("connect-timeout-ms = 0\n"), "");  // (0: never give up)
}

// The file checked is the one CAF reads, each line of it: a second
// --config-file (CAF reads the first), CAF's own spelling of the flag, a key
// set twice (CAF keeps the first, silently) and a caf-application.ini that
// is a FIFO (CAF would block opening it) are errors.
TEST(NodeConfigFile, TheFileCheckedIsTheOneCafReads) {
  const std::string dir = make_temp_dir("node-config-read");
  write_text_file(dir + "/a.ini", "[node]\nrole = \"router\"\n");
  write_text_file(dir + "/b.ini", "[node]\nrole = \"router\"\nport = 4610\nport = 70000\n");
  EXPECT_NE(errors_of_args({"--config-file=" + dir + "/a.ini", "--config-file=" + dir + "/b.ini"}).find("given twice"),
            std::string::npos);
  EXPECT_NE(errors_of_args({"--caf#config-file=" + dir + "/b.ini"}).find("write --config-file=FILE"), std::string::npos);
  EXPECT_NE(errors_of_args({"--config-file=" + dir + "/b.ini"}).find("line 4: node.port is set again (line 3 set it"),
            std::string::npos);
  EXPECT_EQ(errors_of_args({"--config-file=" + dir + "/a.ini"}), "");
  // caf-application.ini in the working directory, a FIFO.
  const std::filesystem::path was = std::filesystem::current_path();
  std::filesystem::create_directories(dir + "/cwd");
  std::filesystem::current_path(dir + "/cwd");
  make_fifo(dir + "/cwd/caf-application.ini");
  std::string seen;
  const std::string error = error_beside_fifo(dir + "/cwd/caf-application.ini", [&] {
    seen = errors_of_args({});
    if (!seen.empty()) throw std::runtime_error(seen);
  });
  std::filesystem::current_path(was);
  EXPECT_NE(error.find("caf-application.ini: not a regular file (a FIFO)"), std::string::npos) << error;
  std::filesystem::remove_all(dir);
}

TEST(NodeConfigFile, ReportsEveryValueCafWouldIgnoreOrRejectWithItsLine) {
  const std::string single = problems_in("[node]\nrole = 'router'\n");
  EXPECT_NE(single.find("line 2: node.role = 'router': single-quoted"), std::string::npos) << single;
  const std::string bare = problems_in("[node]\n\nrole = router\n");
  EXPECT_NE(bare.find("line 3: node.role = router: strings must be double-quoted"), std::string::npos) << bare;
  const std::string range = problems_in("[node]\nrole = \"router\"\nport = 70000\n");
  EXPECT_NE(range.find("line 3: node.port = 70000: not a valid uint16"), std::string::npos) << range;
  const std::string type = problems_in("[disagg]\nblock-size = \"16\"\n");
  EXPECT_NE(type.find("line 2: disagg.block-size = \"16\": not a valid"), std::string::npos) << type;
  const std::string key = problems_in("[disagg]\nblock-sise = 16\n");
  EXPECT_NE(key.find("line 2: unknown option disagg.block-sise"), std::string::npos) << key;
  const std::string group = problems_in("[nodes]\n");
  EXPECT_NE(group.find("line 1: unknown group [nodes]"), std::string::npos) << group;
  const std::string hash = problems_in("# comment\n");
  EXPECT_NE(hash.find("line 1: comments start with ';'"), std::string::npos) << hash;
}

TEST(NodeConfigFile, ExampleClusterConfigsAreValid) {
  const std::string dir = std::string(DISAGG_SOURCE_DIR) + "/config/local";
  NodeSystemConfig config;
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".ini") continue;
    ++files;
    const auto problems = check_config_file(entry.path().string(), config.options());
    EXPECT_TRUE(problems.empty()) << problems.front();
  }
  EXPECT_EQ(files, 6);  // router, 2 prefill, 2 decode, frontend
}

struct Misconfiguration {
  std::string what;
  std::string ini;
  std::vector<std::string> args;
  int exit_code;
  std::string message;
};

// Runs disagg-node on `ini` (written to a temp file): it must exit quickly.
void expect_fails_fast(const Misconfiguration& m) {
  SCOPED_TRACE(m.what);
  const std::string dir = make_temp_dir("node-misconfig");
  const std::string path = dir + "/node.ini";
  write_text_file(path, m.ini);
  std::vector<std::string> argv = {node_binary(), "--config-file=" + path};
  argv.insert(argv.end(), m.args.begin(), m.args.end());
  std::string out, err;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(run_to_completion(argv, out, err, std::chrono::seconds(20)), m.exit_code) << err;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  EXPECT_NE(err.find(m.message), std::string::npos) << "stderr: " << err;
  std::filesystem::remove_all(dir);
}

TEST(NodeStartup, AMisconfiguredNodeExitsAtOnceWithAClearMessage) {
  const std::string model = "model = \"" + shared_model() + "\"\n";
  expect_fails_fast({"unknown role", "[node]\nrole = \"relay\"\n", {}, 2,
                     "node.role must be router, prefill, decode, worker or frontend (got \"relay\")"});
  // A llama2.c model carries no vocabulary (a GGUF's would do).
  expect_fails_fast({"frontend without tokenizer",
                     "[node]\nrole = \"frontend\"\nrouter-port = 4000\n[disagg]\n" + model, {}, 1,
                     "the model file has no vocabulary: name a tokenizer file"});
  expect_fails_fast({"unknown chat template", "[node]\nrole = \"frontend\"\nrouter-port = 4000\nchat-template = \"vicuna\"\n",
                     {}, 2, "node.chat-template must be \"auto\" or one of llama2, llama3, llama3.1, llama3.2, chatml, qwen2"});
  expect_fails_fast({"single-quoted value", "[node]\nrole = \"decode\"\nrouter-host = '127.0.0.1'\n", {}, 2,
                     "line 3: node.router-host = '127.0.0.1': single-quoted"});
  expect_fails_fast({"missing model", "[node]\nrole = \"prefill\"\nrouter-port = 4000\n[disagg]\n"
                     "model = \"/nonexistent/model.bin\"\n", {}, 2,
                     "disagg.model: /nonexistent/model.bin is not a readable file"});
  expect_fails_fast({"no model", "[node]\nrole = \"decode\"\nrouter-port = 4000\n", {}, 2,
                     "disagg.model is required for a decode node"});
  expect_fails_fast({"worker without router port", "[node]\nrole = \"decode\"\n[disagg]\n" + model, {}, 2,
                     "node.router-port is required"});
  // A decode node that would advertise a loopback address to prefill nodes
  // on other hosts (its router is on one); 127.0.0.1 beside a loopback
  // router stays valid (the config/local clusters).
  expect_fails_fast({"loopback advertised to other hosts",
                     "[node]\nrole = \"decode\"\nrouter-host = \"10.77.1.2\"\nrouter-port = 4000\n[disagg]\n" + model, {}, 2,
                     "node.advertise-host 127.0.0.1 is a loopback address, but the router (node.router-host 10.77.1.2) is "
                     "on another host"});
  expect_fails_fast({"localhost advertised to other hosts",
                     "[node]\nrole = \"decode\"\nhost = \"0.0.0.0\"\nadvertise-host = \"localhost\"\n"
                     "router-host = \"fd00::1\"\nrouter-port = 4000\n[disagg]\n" + model, {}, 2,
                     "node.advertise-host localhost is a loopback address"});
  expect_fails_fast({"loopback KV receivers for other hosts",
                     "[node]\nrole = \"decode\"\nhost = \"0.0.0.0\"\nadvertise-host = \"10.0.0.9\"\n"
                     "router-host = \"10.0.0.1\"\nrouter-port = 4000\n[disagg]\nkv-host = \"127.0.0.1\"\n" + model, {}, 2,
                     "disagg.kv-host 127.0.0.1 is a loopback address, but the router (node.router-host 10.0.0.1) is on "
                     "another host"});
  expect_fails_fast({"bad command-line value", "[node]\nrole = \"router\"\n", {"--disagg.block-size=x"}, 2,
                     "command line"});
  expect_fails_fast({"unknown log level", "[node]\nrole = \"router\"\nlog-level = \"loud\"\n", {}, 2,
                     "node.log-level must be"});
  expect_fails_fast({"invalid disagg value", "[node]\nrole = \"router\"\n", {"--disagg.block-size=0"}, 2,
                     "disagg.block-size must be a positive multiple of 16"});
  expect_fails_fast({"bad cluster name", "[node]\nrole = \"router\"\n", {"--disagg.cluster=a b"}, 2,
                     "disagg.cluster must be 1-64 characters"});
  const std::string dir = make_temp_dir("node-bad-model");
  write_text_file(dir + "/model.bin", "not a checkpoint");
  expect_fails_fast({"corrupt model", "[node]\nrole = \"prefill\"\nrouter-port = 4000\n[disagg]\nmodel = \"" +
                                          dir + "/model.bin\"\n", {}, 1, "cannot load the model"});
  std::filesystem::remove_all(dir);
}

// A FIFO where a node reads a file (the model, a Hugging Face directory's
// files, the tokenizer, a TLS file, the config file) is named at once, not
// waited on (issue 44: every node of `MODEL=dir scripts/cluster up`, dir's
// model.safetensors a FIFO, hung silently in open()).
TEST(NodeStartup, AFifoWhereAFileBelongsIsNamedNotWaitedOn) {
  const std::string dir = make_temp_dir("node-fifo");
  auto fifo = [&](const std::string& name) {
    const std::string path = dir + "/" + name;
    make_fifo(path);
    return path;
  };
  const std::string worker = "[node]\nrole = \"prefill\"\nrouter-port = 4000\n[disagg]\n";
  const std::string model = fifo("m.gguf");
  expect_fails_fast({"model", worker + "model = \"" + model + "\"\n", {}, 2,
                     "disagg.model: " + model + " is not a readable file (or a directory with a config.json): "
                     "not a regular file or a directory (a FIFO)"});
  const auto weights = gpu::random_weights(gpu::ModelConfig{64, 96, 2, 4, 2, 300, 128, false}, 4);
  gpu::write_hf_directory(*weights, dir + "/hf-config", gpu::FileType::f32);
  fifo("hf-config/config.json");
  expect_fails_fast({"config.json", worker + "model = \"" + dir + "/hf-config\"\n", {}, 2,
                     "disagg.model: " + dir + "/hf-config is not a readable file (or a directory with a config.json): "
                     "config.json: not a regular file (a FIFO)"});
  gpu::write_hf_directory(*weights, dir + "/hf-weights", gpu::FileType::f32);
  fifo("hf-weights/model.safetensors");
  expect_fails_fast({"model.safetensors", worker + "model = \"" + dir + "/hf-weights\"\n", {}, 1,
                     "cannot load the model: " + dir + "/hf-weights/model.safetensors: not a regular file (a FIFO)"});
  const std::string tokenizer = fifo("tokenizer.bin");
  expect_fails_fast({"tokenizer", worker + "model = \"" + shared_model() + "\"\ntokenizer = \"" + tokenizer + "\"\n", {}, 2,
                     "disagg.tokenizer: " + tokenizer + " is not a readable file: not a regular file (a FIFO)"});
  const std::string certificate = fifo("node.pem");
  expect_fails_fast({"TLS certificate", "[node]\nrole = \"router\"\n",
                     {"--tls.certificate=" + certificate, "--tls.key=" + certificate, "--tls.ca-file=" + certificate}, 2,
                     "tls.certificate: " + certificate + " is not a readable file: not a regular file (a FIFO)"});
  const std::string ini = fifo("node.ini");
  NodeSystemConfig config;
  EXPECT_EQ(error_beside_fifo(ini, [&] {
              const auto problems = check_config_file(ini, config.options());
              if (!problems.empty()) throw std::runtime_error(problems.front());
            }),
            "config " + ini + ": not a regular file (a FIFO)");
  std::filesystem::remove_all(dir);
}

TEST(NodeStartup, APortInUseIsReported) {
  // Hold a listening socket on a loopback port.
  uint16_t held = 0;
  const int fd = listen_on_loopback(held, 1);
  ASSERT_GE(fd, 0);
  const std::string port = std::to_string(held);
  expect_fails_fast({"router port in use", "[node]\nrole = \"router\"\nport = " + port + "\n", {}, 1,
                     "cannot listen on 127.0.0.1:" + port + ": Address already in use"});
  expect_fails_fast({"decode port in use",
                     "[node]\nrole = \"decode\"\nport = " + port + "\nrouter-port = 4000\n[disagg]\nmodel = \"" +
                         shared_model() + "\"\n",
                     {}, 1, "cannot listen on 127.0.0.1:" + port + ": Address already in use"});
  expect_fails_fast({"frontend port in use",
                     "[node]\nrole = \"frontend\"\nhttp-port = " + port + "\nrouter-port = 4000\n[disagg]\nmodel = \"" +
                         shared_model() + "\"\ntokenizer = \"" + shared_tokenizer() + "\"\n",
                     {}, 1, "cannot listen on 127.0.0.1:" + port + ": Address already in use"});
  expect_fails_fast({"metrics port in use", "[node]\nrole = \"router\"\nmetrics-port = " + port + "\n", {}, 1,
                     "cannot listen on 127.0.0.1:" + port + ": Address already in use"});
  ::close(fd);
}

// The same on IPv6's loopback (node.host = "::1"): the OS's reason, where
// "not an IPv4 address" replaced it.
TEST(NodeStartup, APortInUseOnIpv6IsReported) {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) GTEST_SKIP() << "no IPv6 here: " << std::strerror(errno);
  sockaddr_in6 at{};
  at.sin6_family = AF_INET6;
  at.sin6_addr = in6addr_loopback;
  socklen_t len = sizeof at;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0 || ::listen(fd, 1) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    GTEST_SKIP() << "cannot listen on [::1]: " << why;
  }
  const std::string port = std::to_string(ntohs(at.sin6_port));
  expect_fails_fast({"router port in use on ::1", "[node]\nrole = \"router\"\nhost = \"::1\"\nport = " + port + "\n", {}, 1,
                     "cannot listen on ::1:" + port + ": Address already in use"});
  ::close(fd);
}

TEST(ClusterScript, StartsWaitsForEveryWorkerAndStopsExactlyItsNodes) {
  TestCluster ports("cluster-script");  // only for its temp dir and free ports
  const std::string config_dir = ports.dir() + "/config";
  const std::string run_dir = ports.dir() + "/run";
  std::filesystem::create_directories(config_dir);
  // The files name a model that does not exist: MODEL / TOKENIZER replace it.
  auto with_fake_model = [](std::string ini) {
    return std::regex_replace(ini, std::regex("(model|tokenizer) = \"[^\"]*\""), "$1 = \"/nonexistent.bin\"");
  };
  write_text_file(config_dir + "/router.ini", with_fake_model(ports.config_text("router", "router", ports.router_port())));
  write_text_file(config_dir + "/prefill-1.ini", with_fake_model(ports.config_text("prefill", "prefill-1", 0)));
  write_text_file(config_dir + "/decode-1.ini",
                  with_fake_model(ports.config_text("decode", "decode-1", free_loopback_port())));
  const uint16_t http_port = free_loopback_port();
  write_text_file(config_dir + "/frontend.ini", with_fake_model(ports.config_text("frontend", "frontend", http_port)));
  const std::string script = std::string(DISAGG_SOURCE_DIR) + "/scripts/cluster";
  const std::vector<std::string> env = {"DISAGG_RUN_DIR=" + run_dir, "DISAGG_BIN_DIR=" + bin_dir(),
                                        "MODEL=" + shared_model(), "TOKENIZER=" + shared_tokenizer(),
                                        "CLUSTER_TIMEOUT=30"};
  struct Down {  // whatever happens, the nodes the script started go away
    std::string script;
    std::vector<std::string> env;
    ~Down() {
      std::string o, e;
      run_to_completion({"/bin/bash", script, "down"}, o, e, std::chrono::seconds(30), env);
    }
  } down{script, env};

  std::string out, err;
  ASSERT_EQ(run_to_completion({"/bin/bash", script, "up", config_dir}, out, err, std::chrono::seconds(60), env), 0)
      << out << err;
  EXPECT_NE(out.find("router=" + ports.router_address()), std::string::npos) << out;
  // The frontend's address on a line of its own; it answered /health with 200 already.
  EXPECT_NE(out.find("\nhttp=127.0.0.1:" + std::to_string(http_port) + "\n"), std::string::npos) << out;
  std::vector<pid_t> pids;
  for (const char* name : {"router", "prefill-1", "decode-1", "frontend"})
    pids.push_back(pid_t(std::stol(read_text_file(run_dir + "/" + name + ".pid"))));
  for (pid_t pid : pids) EXPECT_TRUE(process_alive(pid));

  ASSERT_EQ(run_to_completion({client_binary(), "--router", ports.router_address(), "--prompt", "Once upon a time",
                               "--max-new-tokens", "10"},
                              out, err, std::chrono::seconds(30)),
            0)
      << err;
  EXPECT_EQ(out.rfind("Once upon a time,", 0), 0u) << out;

  // A second `up` refuses while this cluster runs.
  EXPECT_EQ(run_to_completion({"/bin/bash", script, "up", config_dir}, out, err, std::chrono::seconds(30), env), 1);
  EXPECT_NE(err.find("already running"), std::string::npos) << err;

  ASSERT_EQ(run_to_completion({"/bin/bash", script, "down"}, out, err, std::chrono::seconds(30), env), 0) << err;
  EXPECT_NE(out.find("stopped 4 node(s)"), std::string::npos) << out;
  for (pid_t pid : pids) EXPECT_FALSE(process_alive(pid)) << "pid " << pid;
}

// TLS=1 scripts/cluster up: a test CA and a certificate per node in the run
// dir, every node with mutual TLS; status and the start-up wait use the
// client certificate; a client without one is turned away.
TEST(ClusterScript, Tls1StartsAMutualTlsCluster) {
  TestCluster ports("cluster-script-tls");  // only for its temp dir and free ports
  const std::string config_dir = ports.dir() + "/config";
  const std::string run_dir = ports.dir() + "/run";
  std::filesystem::create_directories(config_dir);
  write_text_file(config_dir + "/router.ini", ports.config_text("router", "router", ports.router_port()));
  write_text_file(config_dir + "/prefill-1.ini", ports.config_text("prefill", "prefill-1", 0));
  write_text_file(config_dir + "/decode-1.ini", ports.config_text("decode", "decode-1", free_loopback_port()));
  const std::string script = std::string(DISAGG_SOURCE_DIR) + "/scripts/cluster";
  const std::vector<std::string> env = {"DISAGG_RUN_DIR=" + run_dir, "DISAGG_BIN_DIR=" + bin_dir(), "TLS=1",
                                        "CLUSTER_TIMEOUT=30"};
  struct Down {
    std::string script;
    std::vector<std::string> env;
    ~Down() {
      std::string o, e;
      run_to_completion({"/bin/bash", script, "down"}, o, e, std::chrono::seconds(30), env);
    }
  } down{script, env};

  std::string out, err;
  ASSERT_EQ(run_to_completion({"/bin/bash", script, "up", config_dir}, out, err, std::chrono::seconds(60), env), 0)
      << out << err;
  EXPECT_NE(out.find("mutual TLS"), std::string::npos) << out;
  for (const std::string name : {"router", "prefill-1", "decode-1", "client"})
    EXPECT_TRUE(std::filesystem::exists(run_dir + "/tls/" + name + ".pem")) << name;
  for (const std::string name : {"router", "prefill-1", "decode-1"})
    EXPECT_NE(read_text_file(run_dir + "/" + name + ".log").find("mutual TLS on every connection"), std::string::npos)
        << name;
  ASSERT_EQ(run_to_completion({"/bin/bash", script, "status"}, out, err, std::chrono::seconds(30), env), 0) << err;
  EXPECT_NE(out.find("workers prefill=1 decode=1"), std::string::npos) << out;
  EXPECT_EQ(run_to_completion({client_binary(), "--router", ports.router_address(), "--status"}, out, err,
                              std::chrono::seconds(30)),
            3)
      << out << err;
  const TlsOptions client = certificate_files(run_dir + "/tls", "client");
  ASSERT_EQ(run_to_completion({client_binary(), "--router", ports.router_address(), "--prompt", "Once upon a time",
                               "--max-new-tokens", "10", "--tls-cert", client.certificate, "--tls-key", client.key,
                               "--tls-ca", client.ca_file},
                              out, err, std::chrono::seconds(30)),
            0)
      << err;
  EXPECT_EQ(out.rfind("Once upon a time,", 0), 0u) << out;
  ASSERT_EQ(run_to_completion({"/bin/bash", script, "down"}, out, err, std::chrono::seconds(30), env), 0) << err;
  EXPECT_NE(out.find("stopped 3 node(s)"), std::string::npos) << out;
}

// TLS options are all or nothing, and their files must load and fit
// together: CAF's openssl module would otherwise fail inside its network loop
// at the first connection, or a node would start unable to reach any peer.
TEST(NodeStartup, TlsFilesAreCheckedBeforeTheNodeStarts) {
  const std::string dir = make_temp_dir("node-tls");
  make_certificates(dir + "/a", {"router"});
  make_certificates(dir + "/b", {"router"});
  const TlsOptions a = certificate_files(dir + "/a", "router"), b = certificate_files(dir + "/b", "router");
  const std::string router = "[node]\nrole = \"router\"\n";
  expect_fails_fast({"certificate without key and CA", router, {"--tls.certificate=" + a.certificate}, 2,
                     "tls.key is required with TLS"});
  expect_fails_fast({"missing CA file", router,
                     {"--tls.certificate=" + a.certificate, "--tls.key=" + a.key, "--tls.ca-file=/nonexistent.pem"}, 2,
                     "tls.ca-file: /nonexistent.pem is not a readable file"});
  expect_fails_fast({"another certificate's key", router,
                     {"--tls.certificate=" + a.certificate, "--tls.key=" + b.key, "--tls.ca-file=" + a.ca_file}, 2,
                     "key values mismatch"});
  expect_fails_fast({"certificate of another CA", router,
                     {"--tls.certificate=" + b.certificate, "--tls.key=" + b.key, "--tls.ca-file=" + a.ca_file}, 2,
                     "is not signed by the CA of tls.ca-file"});
  expect_fails_fast({"not PEM", router,
                     {"--tls.certificate=" + a.key, "--tls.key=" + a.key, "--tls.ca-file=" + a.ca_file}, 2,
                     "tls.certificate: cannot load"});
  expect_fails_fast({"CAF's own openssl group", router + "[openssl]\ncertificate = \"" + a.certificate + "\"\n", {},
                     2, "set tls.certificate, tls.key and tls.ca-file instead"});
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace disagg::test
