// A hung node: its process stopped (SIGSTOP), its connections still open, so
// CAF reports nothing. The router's heartbeats notice: the node gets no new
// work, requests it held without a token start over on other workers, and it
// gets work again once it answers.
#include <gtest/gtest.h>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "cluster/cluster_fixture.h"
#include "gpu/checkpoint.h"
#include "gpu/engine.h"
#include "gpu/generate.h"
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

std::vector<int32_t> colocated_tokens(const GenerateRequest& r) {
  static gpu::Engine engine(gpu::Checkpoint::open(shared_model()));
  const std::vector<int> prompt(r.prompt_tokens.begin(), r.prompt_tokens.end());
  const auto out = gpu::generate(engine, prompt, r.max_new_tokens, gpu::SamplingParams{});
  return std::vector<int32_t>(out.tokens.begin(), out.tokens.end());
}

bool log_has(TestCluster& cluster, const std::string& name, const std::string& text, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cluster.node(name).log().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
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
    ASSERT_EQ(pending[i].wait_for(10s), std::future_status::ready) << cluster.logs();
    const RequestOutcome out = pending[i].get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
    EXPECT_EQ(out.decode_worker, "decode-2");
    EXPECT_EQ(out.tokens, colocated_tokens(requests[i]));
  }
  EXPECT_TRUE(log_has(cluster, "router", "worker decode-1 did not answer a heartbeat", 1s)) << cluster.logs();

  // Awake again: it answers, its stale reservations are cancelled, and it
  // takes work again.
  ASSERT_EQ(::kill(stopped, SIGCONT), 0);
  EXPECT_TRUE(log_has(cluster, "router", "worker decode-1 answers again", 5s)) << cluster.logs();
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

}  // namespace
}  // namespace disagg::test
