// A node killed while a request's KV streams from prefill to decode: every KV
// block it held elsewhere comes back, and the request, which had no token
// yet, starts over on the surviving or new nodes and completes with the
// colocated tokens. Real processes, SIGKILL, over both
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
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "support/http_client.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using namespace std::chrono_literals;

constexpr int kLongPrompt = 1900;  // tokens: a stream of 1900 x 8 layers x 2 x 512 floats (62 MB)

std::string slow_model(const std::string& dir) {
  gpu::ModelConfig c;
  c.dim = 512;
  c.hidden_dim = 1376;
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
  // (prefill-1 with a metrics port: its stream pieces are the event the kills wait for.)
  void start(TestCluster& cluster, const std::string& transport, int decode) {
    cluster.set_model(slow_model(cluster.dir()));
    cluster.set_disagg_options("kv-transport = \"" + transport + "\"\nack-timeout-ms = 3000\n");
    prefill_metrics_ = free_loopback_port();
    cluster.start_router();
    cluster.start_node("prefill", "prefill-1", "metrics-port = " + std::to_string(prefill_metrics_) + "\n");
    for (int i = 1; i <= decode; ++i) cluster.start_node("decode", "decode-" + std::to_string(i));
    ASSERT_TRUE(cluster.wait_for_workers(1, decode));
  }

  // Submits a long prompt and returns once its blocks are reserved at
  // decode-1 and prefill-1 has handed the first pieces of its KV to the data
  // plane: the stream is under way (it lasts 1-2 s; the last piece is
  // layer 8's).
  std::future<RequestOutcome> submit_and_wait_for_the_stream(TestCluster& cluster, int total_blocks) {
    auto pending = cluster.client().submit(request_of(kLongPrompt, 4));
    const auto reserved = decode_status_when(
        cluster, "decode-1", [&](const WorkerStatus& w) { return w.free_blocks < total_blocks; }, 20s);
    EXPECT_TRUE(reserved && reserved->free_blocks < total_blocks) << "no reservation at decode-1\n" << cluster.logs();
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    double pieces = 0;
    while ((pieces = metric_sample(scrape_metrics(prefill_metrics_), "disagg_kv_pieces_sent_total")) <= 0 &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(2ms);  // (a poll of the event, bounded)
    EXPECT_GT(pieces, 0) << "prefill-1 sent no KV piece\n" << cluster.logs();
    return pending;
  }

  uint16_t prefill_metrics_ = 0;
};

TEST_F(KvFaults, APrefillNodeKilledMidStreamFreesTheDecodeBlocksAndTheRequestCompletesOnAnother) {
  TestCluster cluster("kv-kill-prefill");
  ASSERT_NO_FATAL_FAILURE(start(cluster, "tcp", 1));
  const auto idle = decode_status_when(cluster, "decode-1", [](const WorkerStatus& w) { return w.total_blocks > 0; }, 5s);
  ASSERT_TRUE(idle);
  const int total = idle->total_blocks;
  auto pending = submit_and_wait_for_the_stream(cluster, total);
  cluster.kill_node("prefill-1");

  // The request had no token yet: it waits for another prefill worker, and
  // the decode node gives back the dead stream's blocks meanwhile.
  const auto freed =
      decode_status_when(cluster, "decode-1", [&](const WorkerStatus& w) { return w.free_blocks == total; }, 10s);
  ASSERT_TRUE(freed) << "decode-1 is missing from the router's status\n" << cluster.logs();
  EXPECT_EQ(freed->free_blocks, total) << "the decode node still holds the dead stream's blocks\n" << cluster.logs();
  EXPECT_EQ(pending.wait_for(0s), std::future_status::timeout) << "the request ended instead of waiting";

  cluster.start_node("prefill", "prefill-2");
  ASSERT_EQ(pending.wait_for(60s), std::future_status::ready) << "no terminal reply\n" << cluster.logs();
  const RequestOutcome out = pending.get();
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
  EXPECT_EQ(out.prefill_worker, "prefill-2");
  EXPECT_TRUE(out.timings.kv_streamed);
  EXPECT_EQ(out.tokens, colocated_tokens(cluster.model(), request_of(kLongPrompt, 4)));
  EXPECT_NE(cluster.node("router").log().find("starts over on other workers"), std::string::npos);
  EXPECT_TRUE(cluster.stop_all());
}

TEST_F(KvFaults, ADecodeNodeKilledMidStreamAndTheRequestCompletesOnAnother) {
  for (const std::string transport : {"tcp", "shm"}) {
    SCOPED_TRACE("kv-transport " + transport);
    TestCluster cluster("kv-kill-decode-" + transport);
    ASSERT_NO_FATAL_FAILURE(start(cluster, transport, 1));
    const auto idle =
        decode_status_when(cluster, "decode-1", [](const WorkerStatus& w) { return w.total_blocks > 0; }, 5s);
    ASSERT_TRUE(idle);
    auto pending = submit_and_wait_for_the_stream(cluster, idle->total_blocks);
    cluster.kill_node("decode-1");

    // Another decode node joins; the prefill node (its compute no longer
    // stuck on the dead stream) runs the request again, into it.
    cluster.start_node("decode", "decode-2");
    ASSERT_EQ(pending.wait_for(60s), std::future_status::ready) << "no terminal reply\n" << cluster.logs();
    const RequestOutcome out = pending.get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
    EXPECT_EQ(out.decode_worker, "decode-2");
    EXPECT_TRUE(out.timings.kv_streamed);
    EXPECT_EQ(out.tokens, colocated_tokens(cluster.model(), request_of(kLongPrompt, 4)));
    const RequestOutcome next = cluster.client().generate(request_of(64, 4));
    EXPECT_TRUE(next.ok()) << to_string(next.code) << ": " << next.message << "\n" << cluster.logs();
    EXPECT_TRUE(cluster.stop_all());
  }
}

}  // namespace
}  // namespace disagg::test
