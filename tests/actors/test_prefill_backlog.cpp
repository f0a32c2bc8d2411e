// Prompts of requests that already ended (deadline passed, cancelled) are not
// computed: the compute actor skips them, and the router keeps a prefill slot
// until the prefill worker has reported, so its compute queue stays bounded by
// max-prefill-inflight and a later request does not wait behind dead work.
#include <gtest/gtest.h>

#include <chrono>
#include <future>

#include "actors/actor_fixture.h"
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

// Runs one request of the long prompt; returns its wall time.
Clock::duration timed_request(Client& client) {
  auto request = make_request(long_prompt(), 1);
  request.deadline_ms = 60000;
  const auto start = Clock::now();
  const RequestOutcome out = client.generate(request);
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  return Clock::now() - start;
}

TEST_F(ActorTest, TimedOutPromptsDoNotDelayTheNextRequest) {
  start(1, 1);
  const auto single = timed_request(*client_);
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
  // What may still run: the one prompt compute had started, then this one.
  const auto after = timed_request(*client_);
  EXPECT_LT(after, std::chrono::seconds(2) + 4 * single)
      << "one request takes " << std::chrono::duration_cast<std::chrono::milliseconds>(single).count()
      << " ms alone, "
      << std::chrono::duration_cast<std::chrono::milliseconds>(after).count() << " ms after the storm";
}

TEST_F(ActorTest, CancelledJobsAreSkippedByThePrefillCompute) {
  start(1, 1);
  const auto single = timed_request(*client_);
  // Straight to the prefill worker (the router knows nothing of these ids),
  // and cancelled at once: at most the first is computed.
  const prefill_actor prefill = cluster_->prefill_workers().at(0);
  const decode_actor decode = cluster_->decode_workers().at(0);
  caf::scoped_actor self{*system_};
  const int jobs = 40;
  for (int i = 0; i < jobs; ++i) {
    PrefillJob job;
    job.id = 700000 + RequestId(i);
    job.prompt_tokens = long_prompt();
    job.max_new_tokens = 1;
    job.deadline_ms = 60000;
    self->send(prefill, prefill_atom::value, std::move(job), decode);  // the report comes back as a message
  }
  // Sent after the jobs (same sender, so each finds its job), as the router would.
  for (int i = 0; i < jobs; ++i) self->send(prefill, cancel_atom::value, 700000 + RequestId(i));
  int cancelled = 0;
  for (int i = 0; i < jobs; ++i)
    self->receive([&](PrefillReport& report) { cancelled += report.code == ErrorCode::cancelled; },
                  [&](caf::error&) {}, caf::after(std::chrono::seconds(30)) >> [] {});
  EXPECT_GE(cancelled, jobs - 1);
  const auto after = timed_request(*client_);
  EXPECT_LT(after, std::chrono::seconds(2) + 4 * single)
      << "one request takes " << std::chrono::duration_cast<std::chrono::milliseconds>(single).count()
      << " ms alone, "
      << std::chrono::duration_cast<std::chrono::milliseconds>(after).count() << " ms after the cancels";
}

}  // namespace
}  // namespace disagg::test
