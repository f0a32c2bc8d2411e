// A hung node: its process stopped (SIGSTOP), its connections still open, so
// CAF reports nothing. The router's heartbeats notice: the node gets no new
// work, requests it held without a token start over on other workers, and it
// gets work again once it answers.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <future>
#include <thread>

#include "cluster/cluster_fixture.h"
#include "cluster/raw_peer.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using namespace std::chrono_literals;

GenerateRequest short_request(int i) {
  GenerateRequest r;
  r.prompt_tokens = {1, 403, 407, 261 + i % 50, 378};
  r.max_new_tokens = 12;
  r.deadline_ms = 60000;
  return r;
}

// The router's view, for failure messages.
std::string describe(const std::optional<RouterStatus>& status) {
  if (!status) return "router status: no answer";
  std::string out = "router status: queued " + std::to_string(status->queued) + ", in flight " +
                    std::to_string(status->in_flight);
  for (const auto& w : status->workers)
    out += "; " + w.name + " in_flight " + std::to_string(w.in_flight) + " free " + std::to_string(w.free_blocks) +
           "/" + std::to_string(w.total_blocks);
  return out;
}

TEST(ClusterLiveness, AStoppedDecodeNodeGetsNoWorkItsRequestsCompleteElsewhereAndItRejoinsWhenItWakes) {
  TestCluster cluster("liveness");
  // A long ack timeout: only the heartbeats can rescue a request that waits
  // for the stopped node's answer (a reservation, a KV ack).
  cluster.set_disagg_options("heartbeat-interval-ms = 100\nheartbeat-timeout-ms = 600\nack-timeout-ms = 30000\n");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 2));
  const pid_t stopped = cluster.node("decode-1").pid();
  ASSERT_EQ(::kill(stopped, SIGSTOP), 0);

  // Requests sent at once: those dispatched to decode-1 before the router
  // noticed start over on decode-2; every one completes with the colocated tokens.
  std::vector<GenerateRequest> requests;
  std::vector<std::future<RequestOutcome>> pending;
  for (int i = 0; i < 12; ++i) {
    requests.push_back(short_request(i));
    pending.push_back(cluster.client().submit(requests.back()));
  }
  for (size_t i = 0; i < pending.size(); ++i) {
    ASSERT_EQ(pending[i].wait_for(10s), std::future_status::ready) << describe(cluster.client().status()) << "\n"
                                                                     << cluster.logs();
    const RequestOutcome out = pending[i].get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
    EXPECT_EQ(out.decode_worker, "decode-2");
    EXPECT_EQ(out.tokens, colocated_tokens(shared_model(), requests[i]));
  }
  EXPECT_TRUE(cluster.node("router").log_says("worker decode-1 did not answer a heartbeat", 1s)) << cluster.logs();

  // Awake again: it answers, its stale reservations are cancelled, and it
  // takes work again.
  ASSERT_EQ(::kill(stopped, SIGCONT), 0);
  EXPECT_TRUE(cluster.node("router").log_says("worker decode-1 answers again", 5s)) << cluster.logs();
  bool served_by_decode_1 = false;
  for (int i = 0; i < 8 && !served_by_decode_1; ++i) {
    const RequestOutcome out = cluster.client().generate(short_request(100 + i));
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
    served_by_decode_1 = out.decode_worker == "decode-1";
  }
  EXPECT_TRUE(served_by_decode_1) << "the woken node gets no work\n" << cluster.logs();
  const auto status = cluster.client().status();
  ASSERT_TRUE(status);
  for (const auto& w : status->workers)
    if (w.role == WorkerRole::decode) EXPECT_EQ(w.free_blocks, w.total_blocks) << w.name;
  EXPECT_TRUE(cluster.stop_all());
}

// Issue 18's probe: a prefill node stopped (SIGSTOP) after its commit, as
// the request's first token reaches the client. The router once counted
// the request as still on that worker until its report came, and failed
// one in six whose 400 tokens had all streamed (worker_lost). Now the
// decode worker's first token means the prefill worker's part is done: 20
// runs, greedy and sampled in turn, each completes with the colocated
// tokens, and the woken node rejoins before the next run.
TEST(ClusterLiveness, APrefillNodeStoppedAfterItsCommitFailsNoRequest) {
  TestCluster cluster("stopped-prefill");
  cluster.set_disagg_options("heartbeat-interval-ms = 50\nheartbeat-timeout-ms = 200\nack-timeout-ms = 30000\n");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  const pid_t prefill = cluster.node("prefill-1").pid();
  auto count = [&](const std::string& text) {
    const std::string log = cluster.node("router").log();
    size_t n = 0;
    for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++n;
    return n;
  };
  for (int run = 0; run < 20; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    GenerateRequest request = short_request(run);
    request.max_new_tokens = 400;
    if (run % 2) request.sampling = Sampling{0.9f, 0.9f, uint64_t(1000 + run)};
    const size_t silences = count("worker prefill-1 did not answer a heartbeat");
    const size_t wakes = count("worker prefill-1 answers again");
    std::atomic<bool> stopped{false};
    std::vector<int32_t> streamed;
    auto pending = cluster.client().submit(request, [&](const TokenEvent& e) {
      if (!stopped.exchange(true)) ::kill(prefill, SIGSTOP);
      streamed.push_back(e.token);
    });
    ASSERT_EQ(pending.wait_for(20s), std::future_status::ready) << cluster.logs();
    const RequestOutcome out = pending.get();
    ASSERT_TRUE(stopped.load()) << "no token streamed";
    // The router notices the silence (during or after the generation) ...
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (count("worker prefill-1 did not answer a heartbeat") == silences && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(10ms);
    ::kill(prefill, SIGCONT);
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
    EXPECT_EQ(out.tokens, colocated_tokens(shared_model(), request));
    EXPECT_EQ(streamed, out.tokens);
    // ... and the woken node answers again before the next run.
    const auto woken_by = std::chrono::steady_clock::now() + 10s;
    while (count("worker prefill-1 did not answer a heartbeat") > silences &&
           count("worker prefill-1 answers again") == wakes && std::chrono::steady_clock::now() < woken_by)
      std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(cluster.stop_all());
}

// A client's requests end with worker_lost as soon as the router's process
// dies, not at their deadline (60 s here).
TEST(ClusterLiveness, ClientsHearAtOnceThatTheRouterIsGone) {
  TestCluster cluster("router-gone");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  GenerateRequest long_one = short_request(0);
  long_one.max_new_tokens = 400;
  std::promise<void> first_token;
  std::atomic<bool> seen{false};
  auto pending = cluster.client().submit(long_one, [&](const TokenEvent&) {
    if (!seen.exchange(true)) first_token.set_value();
  });
  ASSERT_EQ(first_token.get_future().wait_for(10s), std::future_status::ready);
  const auto killed = std::chrono::steady_clock::now();
  cluster.kill_node("router");
  ASSERT_EQ(pending.wait_for(5s), std::future_status::ready) << "the client waits for a dead router";
  const RequestOutcome out = pending.get();
  EXPECT_EQ(out.code, ErrorCode::worker_lost) << out.message;
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 5s);
}

// A decode worker whose advertised endpoint drops every connection attempt
// (no RST: a host gone, a firewall). CAF 0.17's middleman connects with a
// blocking connect() in its one actor, which the kernel keeps retrying for
// about 127 s: every other connection of the prefill node waited behind it,
// so a decode worker that joined later was never reached and requests
// failed. The gate asks an endpoint first, with a deadline.
TEST(ClusterLiveness, AnEndpointThatDropsConnectionsHoldsUpNoOtherDial) {
  TestCluster cluster("black-hole");
  cluster.start_router();
  cluster.start_node("decode", "decode-2", "advertise-host = \"127.0.0.3\"\n");
  // Its advertised address: a listener whose backlog is full (one
  // connection it never accepts), so the kernel drops every SYN to it.
  const int hole = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(cluster.port_of("decode-2"));
  ::inet_pton(AF_INET, "127.0.0.3", &at.sin_addr);
  ASSERT_EQ(::bind(hole, reinterpret_cast<sockaddr*>(&at), sizeof at), 0) << std::strerror(errno);
  ASSERT_EQ(::listen(hole, 0), 0);
  const int filler = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_EQ(::connect(filler, reinterpret_cast<sockaddr*>(&at), sizeof at), 0);
  cluster.start_node("prefill", "prefill-1");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  EXPECT_TRUE(cluster.node("prefill-1").log_says("cannot connect to decode worker decode-2", 15s)) << cluster.logs();
  // That worker goes; one that can be reached comes: served, though the
  // prefill node's dials of the first may still be out.
  cluster.kill_node("decode-2");
  cluster.start_node("decode", "decode-1");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  GenerateRequest request = short_request(0);
  request.deadline_ms = 30000;
  const RequestOutcome out = cluster.client().generate(request);
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
  EXPECT_EQ(out.decode_worker, "decode-1");
  ::close(filler);
  ::close(hole);
  EXPECT_TRUE(cluster.stop_all());
}

// A worker pointed at an address that accepts connections and never speaks
// (not a router) waits for it, and still exits at once on SIGTERM.
TEST(ClusterLiveness, AWorkerWaitingForASilentRouterExitsPromptlyOnSigterm) {
  TestCluster cluster("silent-router");
  // A listening socket nobody reads: the kernel completes TCP handshakes into
  // its backlog, so connecting works and no byte ever comes back.
  uint16_t silent_port = 0;
  const int listener = listen_on_loopback(silent_port);
  ASSERT_GE(listener, 0);
  std::string ini = cluster.config_text("prefill", "prefill-1", 0);
  const std::string from = "router-port = " + std::to_string(cluster.router_port());
  ini.replace(ini.find(from), from.size(), "router-port = " + std::to_string(silent_port));
  write_text_file(cluster.dir() + "/silent.ini", ini);
  ChildProcess worker({node_binary(), "--config-file=" + cluster.dir() + "/silent.ini"}, cluster.dir() + "/silent.log");
  EXPECT_TRUE(worker.log_says("not reachable yet", 10s)) << worker.log();
  const auto signalled = std::chrono::steady_clock::now();
  EXPECT_EQ(worker.stop(std::chrono::seconds(10)), 0) << worker.log();
  EXPECT_LT(std::chrono::steady_clock::now() - signalled, 2s) << "SIGTERM took long to end the wait";
  ::close(listener);
}

}  // namespace
}  // namespace disagg::test
