// A node killed while a request's KV streams from prefill to decode: the
// request ends with one terminal error, every KV block comes back, and the
// surviving nodes serve the next request. Real processes, SIGKILL, over both
// stream transports where they survive it: TCP always; shared memory only
// for a dead receiver (UCX 1.13's CMA aborts a receiver whose sender dies
// mid-stream, README: so kv-transport shm is opt-in).
//
// The model is synthetic and larger than the shared one, so that a long
// prompt's prefill (and with it the stream) lasts about a second on one
// core: the kill lands in the middle of it.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <thread>

#include "cluster/cluster_fixture.h"
#include "gpu/checkpoint.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using namespace std::chrono_literals;

constexpr int kLongPrompt = 1900;  // tokens: a stream of 1900 x 8 layers x 2 x 256 floats (31 MB)

std::string slow_model(const std::string& dir) {
  gpu::ModelConfig c;
  c.dim = 256;
  c.hidden_dim = 688;
  c.n_layers = 8;
  c.n_heads = 8;
  c.n_kv_heads = 8;
  c.vocab_size = 512;  // the shared tokenizer's, which the router loads
  c.seq_len = 2048;
  const std::string path = dir + "/slow-model.bin";
  gpu::write_random_checkpoint(path, c, 11);
  return path;
}

GenerateRequest request_of(int prompt_len, int max_new_tokens) {
  GenerateRequest r;
  r.prompt_tokens.push_back(1);
  for (int i = 1; i < prompt_len; ++i) r.prompt_tokens.push_back(3 + (i * 37) % 500);
  r.max_new_tokens = max_new_tokens;
  r.deadline_ms = 60000;
  return r;
}

// The router's view of one decode worker, once `pred` holds (or the last one seen after `timeout`).
template <class Pred>
std::optional<WorkerStatus> decode_status_when(TestCluster& cluster, const std::string& name, Pred pred,
                                               std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::optional<WorkerStatus> seen;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto status = cluster.client().status())
      for (const auto& w : status->workers)
        if (w.name == name) seen = w;
    if (seen && pred(*seen)) return seen;
    std::this_thread::sleep_for(10ms);
  }
  return seen;
}

class KvFaults : public ::testing::Test {
 protected:
  // 1 router, 1 prefill, `decode` decode nodes on the slow model, streaming
  // over this test's transport; a short ack timeout so that a stream to a
  // dead receiver (shared memory has no peer-failure detection) gives up soon.
  void start(TestCluster& cluster, const std::string& transport, int decode) {
    cluster.set_model(slow_model(cluster.dir()));
    cluster.set_disagg_options("kv-transport = \"" + transport + "\"\nack-timeout-ms = 3000\n");
    ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, decode));
  }

  // Submits a long prompt and returns once its blocks are reserved at
  // decode-1 and its prefill (the stream) is under way.
  std::future<RequestOutcome> submit_and_wait_for_the_stream(TestCluster& cluster, int total_blocks) {
    auto pending = cluster.client().submit(request_of(kLongPrompt, 4));
    const auto reserved = decode_status_when(
        cluster, "decode-1", [&](const WorkerStatus& w) { return w.free_blocks < total_blocks; }, 20s);
    EXPECT_TRUE(reserved && reserved->free_blocks < total_blocks) << "no reservation at decode-1\n" << cluster.logs();
    std::this_thread::sleep_for(300ms);  // well into a prefill of ~1 s
    return pending;
  }
};

TEST_F(KvFaults, APrefillNodeKilledMidStreamFailsTheRequestAndFreesTheDecodeBlocks) {
  TestCluster cluster("kv-kill-prefill");
  ASSERT_NO_FATAL_FAILURE(start(cluster, "tcp", 1));
  const auto idle = decode_status_when(cluster, "decode-1", [](const WorkerStatus& w) { return w.total_blocks > 0; }, 5s);
  ASSERT_TRUE(idle);
  const int total = idle->total_blocks;
  auto pending = submit_and_wait_for_the_stream(cluster, total);
  cluster.kill_node("prefill-1");

  ASSERT_EQ(pending.wait_for(30s), std::future_status::ready) << "no terminal reply\n" << cluster.logs();
  const RequestOutcome out = pending.get();
  EXPECT_EQ(out.code, ErrorCode::worker_lost) << out.message;
  const auto freed =
      decode_status_when(cluster, "decode-1", [&](const WorkerStatus& w) { return w.free_blocks == total; }, 10s);
  ASSERT_TRUE(freed) << "decode-1 is missing from the router's status\n" << cluster.logs();
  EXPECT_EQ(freed->free_blocks, total) << "the decode node still holds the dead stream's blocks\n" << cluster.logs();

  // A new prefill node: the decode node takes its stream as before.
  cluster.start_node("prefill", "prefill-2");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  const RequestOutcome next = cluster.client().generate(request_of(64, 4));
  EXPECT_TRUE(next.ok()) << to_string(next.code) << ": " << next.message << "\n" << cluster.logs();
  EXPECT_TRUE(next.timings.kv_streamed);
  EXPECT_TRUE(cluster.stop_all());
}

TEST_F(KvFaults, ADecodeNodeKilledMidStreamFailsTheRequestAndThePrefillNodeServesOn) {
  for (const std::string transport : {"tcp", "shm"}) {
  SCOPED_TRACE("kv-transport " + transport);
  TestCluster cluster("kv-kill-decode-" + transport);
  ASSERT_NO_FATAL_FAILURE(start(cluster, transport, 1));
  const auto idle = decode_status_when(cluster, "decode-1", [](const WorkerStatus& w) { return w.total_blocks > 0; }, 5s);
  ASSERT_TRUE(idle);
  auto pending = submit_and_wait_for_the_stream(cluster, idle->total_blocks);
  cluster.kill_node("decode-1");

  ASSERT_EQ(pending.wait_for(30s), std::future_status::ready) << "no terminal reply\n" << cluster.logs();
  const RequestOutcome out = pending.get();
  EXPECT_EQ(out.code, ErrorCode::worker_lost) << out.message;

  // Another decode node joins; the prefill node (its compute no longer
  // stuck on the dead stream) serves the next request through it.
  cluster.start_node("decode", "decode-2");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  const auto start = std::chrono::steady_clock::now();
  const RequestOutcome next = cluster.client().generate(request_of(64, 4));
  EXPECT_TRUE(next.ok()) << to_string(next.code) << ": " << next.message << "\n" << cluster.logs();
  EXPECT_TRUE(next.timings.kv_streamed);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s);
  EXPECT_TRUE(cluster.stop_all());
  }
}

}  // namespace
}  // namespace disagg::test
