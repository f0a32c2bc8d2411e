// Prompts of requests that already ended (deadline passed, cancelled) are not
// computed: the compute actor skips them, and the router keeps a prefill slot
// until the prefill worker has reported, so its compute queue stays bounded by
// max-prefill-inflight and a later request does not wait behind dead work.
#include <gtest/gtest.h>

#include <algorithm>

#include <chrono>
#include <future>

#include "actors/actor_fixture.h"
#include "actors/compute.h"
#include "caf/all.hpp"

namespace disagg::test {
namespace {

using Clock = std::chrono::steady_clock;

// A long prompt: each one keeps the compute actor busy for a while.
std::vector<int32_t> long_prompt() {
  std::vector<int32_t> prompt{1};
  for (int i = 0; i < 450; ++i) prompt.push_back(300 + i % 200);
  return prompt;
}

// Runs one request of the long prompt; returns its wall time, and in
// *prefill the time its prefill computation took (when given).
Clock::duration timed_request(Client& client, Clock::duration* prefill = nullptr) {
  auto request = make_request(long_prompt(), 1);
  request.deadline_ms = 60000;
  const auto start = Clock::now();
  const RequestOutcome out = client.generate(request);
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  if (prefill) *prefill = std::chrono::microseconds(std::max<int64_t>(1, out.timings.prefill_us));
  return Clock::now() - start;
}

// Prompts the compute actors of this process computed since `before`.
int64_t computed_since(const PrefillCounts& before) { return prefill_counts().computed - before.computed; }

// Sends `jobs` prefill jobs of the long prompt, ids first_id.., straight to
// the cluster's prefill worker (the router knows nothing of them); their
// reports come back to `self` as messages.
void send_jobs_straight(caf::scoped_actor& self, LocalCluster& cluster, RequestId first_id, int jobs,
                        int64_t deadline_ms) {
  const prefill_actor prefill = cluster.prefill_workers().at(0);
  const decode_actor decode = cluster.decode_workers().at(0);
  for (int i = 0; i < jobs; ++i) {
    PrefillJob job;
    job.id = first_id + RequestId(i);
    job.prompt_tokens = long_prompt();
    job.max_new_tokens = 1;
    job.deadline_ms = deadline_ms;
    self->send(prefill, prefill_atom::value, std::move(job), decode);
  }
}

TEST_F(ActorTest, TimedOutPromptsDoNotDelayTheNextRequest) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.max_prefill_inflight = 32;  // many expired prompts reach the compute actor's mailbox
  // The same prompt each time: with the prefix cache its repeats would be
  // prefilled in a moment on the decode worker, and none would expire.
  options.config.prefix_caching = false;
  start(std::move(options));
  const PrefillCounts at_start = prefill_counts();
  Clock::duration one_prefill{};
  const auto single = timed_request(*client_, &one_prefill);
  ASSERT_EQ(computed_since(at_start), 1);
  const PrefillCounts before_storm = prefill_counts();
  const auto storm_start = Clock::now();
  std::vector<std::future<RequestOutcome>> storm;
  for (int i = 0; i < 200; ++i) {
    auto request = make_request(long_prompt(), 1);
    request.deadline_ms = 20;
    storm.push_back(client_->submit(request));
  }
  for (auto& f : storm) {
    const RequestOutcome out = f.get();
    EXPECT_TRUE(out.ok() || out.code == ErrorCode::timeout) << to_string(out.code) << ": " << out.message;
  }
  // Only prompts begun within their 20 ms can have been computed: those the
  // compute actor reached before the deadlines passed (a prefill computation
  // takes `one_prefill`), plus the one it was in when they did, and a margin
  // of 2 for deadlines that start as the jobs arrive (not all at once) and a
  // first measurement that may run warmer or colder than the storm's. Without
  // the skipping, all 200 (below: all 40) would be computed.
  const auto after = timed_request(*client_);
  const int64_t computed = computed_since(before_storm) - 1;  // less the request after the storm
  const int64_t allowed = 4 + std::chrono::milliseconds(20) / one_prefill;
  // (On a loaded machine the compute actor may reach a few more in time
  // than one measured prefill predicts: CI once saw 5 of 40 where 4 were
  // allowed below. The bounds stay far under "all", which the skip prevents.)
  const int64_t storm_bound = std::max<int64_t>(allowed, 25);
  EXPECT_LE(computed, storm_bound) << "computed " << computed << " of the storm's 200 prompts";
  // The request after the storm waits for at most the prompt in progress.
  EXPECT_LT(after, std::chrono::seconds(1) + (allowed + 1) * single)
      << "one request takes " << std::chrono::duration_cast<std::chrono::milliseconds>(single).count()
      << " ms alone, "
      << std::chrono::duration_cast<std::chrono::milliseconds>(after).count() << " ms after the storm ("
      << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - storm_start).count()
      << " ms since it began)";

  // The router holds most of a storm back (prefill slots, decode room), so
  // the compute actor's own check is shown with jobs sent straight to the
  // prefill worker: 40 prompts of 20 ms deadlines queue behind each other, and
  // only those begun within their 20 ms may run.
  caf::scoped_actor self{*system_};
  const int jobs = 40;
  const PrefillCounts before = prefill_counts();
  send_jobs_straight(self, *cluster_, 800000, jobs, 20);
  int reports = 0;
  for (int i = 0; i < jobs; ++i)
    self->receive([&](PrefillReport&) { ++reports; }, [&](caf::error&) {},
                  caf::after(std::chrono::seconds(30)) >> [] {});
  EXPECT_EQ(reports, jobs);
  const PrefillCounts counts = prefill_counts();
  const int64_t straight_bound = std::max<int64_t>(allowed, jobs / 4);
  EXPECT_LE(counts.computed - before.computed, straight_bound);
  EXPECT_GE(counts.skipped_expired - before.skipped_expired, jobs - straight_bound);
  // Their decode worker holds nothing for these (never reserved): it refused
  // or dropped any KV that reached it.
}

TEST_F(ActorTest, CancelledJobsAreSkippedByThePrefillCompute) {
  start(1, 1);
  const auto single = timed_request(*client_);
  // Straight to the prefill worker (the router knows nothing of these ids),
  // and cancelled at once: only those begun before their cancel are computed.
  const prefill_actor prefill = cluster_->prefill_workers().at(0);
  caf::scoped_actor self{*system_};
  const int jobs = 40;
  const PrefillCounts before = prefill_counts();
  send_jobs_straight(self, *cluster_, 700000, jobs, 60000);
  // Sent after the jobs (same sender, so each finds its job), as the router would.
  for (int i = 0; i < jobs; ++i) self->send(prefill, cancel_atom::value, 700000 + RequestId(i));
  int cancelled = 0, reports = 0;
  for (int i = 0; i < jobs; ++i)
    self->receive(
        [&](PrefillReport& report) {
          ++reports;
          cancelled += report.code == ErrorCode::cancelled;
        },
        [&](caf::error&) {}, caf::after(std::chrono::seconds(30)) >> [] {});
  EXPECT_EQ(reports, jobs);
  // The reports say "cancelled" whether or not the prompt ran: the compute
  // actor's counts say what it did. A job the compute actor began before its
  // cancel arrived runs: the first, usually, but on a loaded machine the
  // compute actor may finish two or three while this thread waits to send
  // the cancels (CI once saw 2), and those report what they did, not
  // always a cancel. Without the skip all 40 would run. Every skipped job
  // reports its cancel.
  const PrefillCounts counts = prefill_counts();
  EXPECT_LE(counts.computed - before.computed, jobs / 4);
  EXPECT_GE(counts.skipped_cancelled - before.skipped_cancelled, jobs - jobs / 4);
  EXPECT_GE(cancelled, counts.skipped_cancelled - before.skipped_cancelled);
  EXPECT_EQ(counts.computed - before.computed + counts.skipped_cancelled - before.skipped_cancelled, jobs);
  const auto after = timed_request(*client_);
  EXPECT_LT(after, std::chrono::seconds(1) + 2 * single)
      << "one request takes " << std::chrono::duration_cast<std::chrono::milliseconds>(single).count()
      << " ms alone, "
      << std::chrono::duration_cast<std::chrono::milliseconds>(after).count() << " ms after the cancels";
}

}  // namespace
}  // namespace disagg::test
