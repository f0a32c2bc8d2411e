// Load with failures: 200 requests on a 2 prefill + 2 decode cluster while
// one prefill and one decode node are killed (SIGKILL). Every request ends
// with exactly one terminal reply, within its deadline; a completed one has
// exactly the colocated tokens, streamed with every index once and in order
// (requests that lose their worker start over or migrate); nothing is left
// in flight, and the surviving decode pool is full again.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <mutex>
#include <thread>

#include "cluster/cluster_fixture.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using namespace std::chrono_literals;

constexpr int kRequests = 200;
constexpr int64_t kDeadlineMs = 60000;

GenerateRequest chaos_request(int i) {
  GenerateRequest r;
  r.prompt_tokens = {1};
  const int prompt_len = 4 + (i * 7) % 60;
  for (int t = 1; t < prompt_len; ++t) r.prompt_tokens.push_back(3 + (i * 31 + t * 17) % 500);
  r.max_new_tokens = 20 + (i * 13) % 100;
  if (i % 3 == 0) r.sampling = Sampling{0.8f, 0.9f, uint64_t(1000 + i)};
  r.deadline_ms = kDeadlineMs;
  return r;
}

struct Tracked {
  std::mutex mutex;
  std::vector<TokenEvent> events;
  std::promise<RequestOutcome> outcome;
  std::atomic<int> replies{0};
  std::chrono::steady_clock::time_point sent;
  std::chrono::steady_clock::time_point ended;
};

TEST(ClusterChaos, TwoHundredRequestsWhileAPrefillAndADecodeNodeAreKilled) {
  TestCluster cluster("chaos");
  cluster.set_disagg_options("heartbeat-interval-ms = 200\nheartbeat-timeout-ms = 2000\nmax-worker-retries = 3\n");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(2, 2));

  std::vector<std::unique_ptr<Tracked>> tracked;
  for (int i = 0; i < kRequests; ++i) tracked.push_back(std::make_unique<Tracked>());
  std::atomic<int> done{0};
  for (int i = 0; i < kRequests; ++i) {
    Tracked* t = tracked[size_t(i)].get();
    t->sent = std::chrono::steady_clock::now();
    cluster.client().submit_async(
        chaos_request(i),
        [t](const TokenEvent& e) {
          std::lock_guard<std::mutex> lock(t->mutex);
          t->events.push_back(e);
        },
        [t, &done](RequestOutcome out) {
          t->ended = std::chrono::steady_clock::now();
          if (t->replies++ == 0) t->outcome.set_value(std::move(out));
          ++done;
        });
  }
  // Kill one node of each role while the load runs.
  while (done < kRequests / 5) std::this_thread::sleep_for(5ms);
  cluster.kill_node("decode-1");
  cluster.kill_node("prefill-1");

  std::map<std::string, int> codes;
  int completed = 0;
  for (int i = 0; i < kRequests; ++i) {
    Tracked& t = *tracked[size_t(i)];
    auto future = t.outcome.get_future();
    ASSERT_EQ(future.wait_for(std::chrono::milliseconds(kDeadlineMs + 10000)), std::future_status::ready)
        << "request " << i << " got no terminal reply\n" << cluster.logs();
    const RequestOutcome out = future.get();
    codes[to_string(out.code)] += 1;
    EXPECT_LE(t.ended - t.sent, std::chrono::milliseconds(kDeadlineMs + 1000)) << "request " << i;
    if (!out.ok()) {
      EXPECT_TRUE(out.code == ErrorCode::worker_lost) << "request " << i << ": " << to_string(out.code) << ": "
                                                      << out.message;
      continue;
    }
    ++completed;
    EXPECT_EQ(out.tokens, colocated_tokens(shared_model(), chaos_request(i))) << "request " << i;
    std::lock_guard<std::mutex> lock(t.mutex);
    ASSERT_EQ(t.events.size(), out.tokens.size()) << "request " << i << ": a gap or a duplicate in its stream";
    for (size_t k = 0; k < t.events.size(); ++k) EXPECT_EQ(t.events[k].index, int32_t(k)) << "request " << i;
  }
  std::this_thread::sleep_for(200ms);  // any second reply would have come by now
  for (int i = 0; i < kRequests; ++i) EXPECT_EQ(tracked[size_t(i)]->replies.load(), 1) << "request " << i;
  std::string summary;
  for (const auto& [code, n] : codes) summary += code + "=" + std::to_string(n) + " ";
  RecordProperty("outcomes", summary);
  std::cout << "[ chaos    ] " << summary << "\n";
  EXPECT_GE(completed, kRequests * 9 / 10) << summary << "\n" << cluster.logs();
  // The kills hit requests in flight: some started over or migrated.
  const std::string router_log = cluster.node("router").log();
  size_t restarted = 0;
  for (size_t at = router_log.find("starts over on other workers"); at != std::string::npos;
       at = router_log.find("starts over on other workers", at + 1))
    ++restarted;
  std::cout << "[ chaos    ] requests restarted or migrated: " << restarted << "\n";
  EXPECT_GT(restarted, 0u) << "the kills hit nothing in flight\n" << router_log;

  // Nothing is left anywhere: the router holds no request, the surviving
  // decode pool is full.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  bool settled = false;
  while (!settled && std::chrono::steady_clock::now() < deadline) {
    if (const auto status = cluster.client().status()) {
      settled = status->in_flight == 0 && status->queued == 0 && status->count(WorkerRole::decode) == 1 &&
                status->count(WorkerRole::prefill) == 1;
      for (const auto& w : status->workers)
        if (w.role == WorkerRole::decode) settled = settled && w.free_blocks == w.total_blocks;
    }
    if (!settled) std::this_thread::sleep_for(20ms);
  }
  EXPECT_TRUE(settled) << cluster.logs();
  EXPECT_TRUE(cluster.stop_all());
}

}  // namespace
}  // namespace disagg::test
