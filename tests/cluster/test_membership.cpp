// Membership across processes: workers that start before the router, a
// worker node that dies, a decode node that comes back on its port, a router
// that restarts, a worker of another model that is refused.
#include <gtest/gtest.h>

#include <future>
#include <set>
#include <thread>

#include "actors/config.h"
#include "cluster/cluster_fixture.h"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

GenerateRequest small_request(int max_new_tokens = 8) {
  GenerateRequest r;
  r.prompt_tokens = {1, 403, 407, 261, 378};
  r.max_new_tokens = max_new_tokens;
  return r;
}

TEST(ClusterMembership, WorkersStartedBeforeTheRouterJoinOnceItIsUp) {
  TestCluster cluster("cluster-early-workers");
  cluster.start_node("prefill", "prefill-1");
  cluster.start_node("decode", "decode-1");
  // Both have tried the router and found it absent (and keep running).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  auto tried = [&](const std::string& name) {
    return cluster.node(name).log().find("not reachable yet") != std::string::npos;
  };
  while (!(tried("prefill-1") && tried("decode-1")) && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(tried("prefill-1")) << cluster.logs();
  ASSERT_TRUE(tried("decode-1")) << cluster.logs();
  ASSERT_TRUE(cluster.node("prefill-1").running()) << cluster.logs();
  ASSERT_TRUE(cluster.node("decode-1").running()) << cluster.logs();

  cluster.start_router();
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  const RequestOutcome out = cluster.client().generate(small_request());
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_TRUE(cluster.stop_all());
}

TEST(ClusterMembership, RouterDropsAWorkerWhoseProcessDiesAndTakesItBackWhenItReturns) {
  TestCluster cluster("cluster-worker-loss");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 2));
  cluster.kill_node("decode-2");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1, std::chrono::seconds(10)));
  for (int i = 0; i < 3; ++i) {
    const RequestOutcome out = cluster.client().generate(small_request());
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
    EXPECT_EQ(out.decode_worker, "decode-1");
  }

  // A new decode node on the same port: the prefill node dials it again.
  cluster.start_node("decode", "decode-2");
  ASSERT_TRUE(cluster.wait_for_workers(1, 2));
  std::vector<std::future<RequestOutcome>> pending;
  for (int i = 0; i < 6; ++i) pending.push_back(cluster.client().submit(small_request(16)));
  std::set<std::string> decode_workers;
  for (auto& f : pending) {
    const RequestOutcome out = f.get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
    decode_workers.insert(out.decode_worker);
  }
  EXPECT_EQ(decode_workers.count("decode-2"), 1u);
  EXPECT_TRUE(has_connection_to_port(cluster.node("prefill-1").pid(), cluster.port_of("decode-2")));
  EXPECT_TRUE(cluster.stop_all());
}

TEST(ClusterMembership, WorkersJoinARestartedRouter) {
  TestCluster cluster("cluster-router-restart");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  EXPECT_EQ(cluster.stop_node("router"), 0);
  cluster.reconnect_client();
  cluster.start_router();
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  const auto start = std::chrono::steady_clock::now();
  const RequestOutcome out = cluster.client().generate(small_request());
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  // Nothing waits on the old router (e.g. the prefill node's question for decode endpoints).
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(3)) << cluster.logs();
  EXPECT_NE(cluster.node("decode-1").log().find("lost the router"), std::string::npos);
  EXPECT_TRUE(cluster.stop_all());
}

// The router refuses a worker whose model is not the cluster's (same shape,
// other weights: it used to join, and its KV turned requests into garbage or
// incompatible_kv errors); the node logs why and exits 1.
TEST(ClusterMembership, AWorkerOfAnotherModelIsRefusedAndItsNodeExits) {
  TestCluster cluster("refused-model");
  cluster.start_all(1, 1);
  const std::string other = cluster.dir() + "/other.bin";
  gpu::write_random_checkpoint(other, gpu::Checkpoint::open(shared_model())->config(), 7);
  std::string ini = cluster.config_text("decode", "stranger", free_loopback_port());
  ini.replace(ini.find(shared_model()), shared_model().size(), other);
  write_text_file(cluster.dir() + "/stranger.ini", ini);
  ChildProcess stranger({node_binary(), "--config-file=" + cluster.dir() + "/stranger.ini"},
                        cluster.dir() + "/stranger.log");
  const auto code = stranger.wait_exit(std::chrono::seconds(30));
  ASSERT_TRUE(code.has_value()) << "the refused worker is still running\n" << stranger.log();
  EXPECT_EQ(*code, 1) << stranger.log();
  EXPECT_NE(stranger.log().find("refused"), std::string::npos) << stranger.log();
  EXPECT_NE(cluster.node("router").log().find("refused"), std::string::npos) << cluster.logs();
  EXPECT_TRUE(cluster.wait_for_workers(1, 1));
  // The router logs each registration and each failed request (id and code).
  const std::string router_log = cluster.node("router").log();
  EXPECT_NE(router_log.find("registered decode worker decode-1"), std::string::npos) << router_log;
  EXPECT_NE(router_log.find("registered prefill worker prefill-1"), std::string::npos) << router_log;
  GenerateRequest bad = small_request();
  bad.prompt_tokens = {1, 99999};
  const RequestOutcome out = cluster.client().generate(bad);
  EXPECT_EQ(out.code, ErrorCode::invalid_request);
  const std::string failed_line = "request " + std::to_string(out.id) + " refused: invalid_request";
  EXPECT_NE(cluster.node("router").log().find(failed_line), std::string::npos) << cluster.node("router").log();
  EXPECT_TRUE(cluster.stop_all());
}

// The router refuses a worker of another cluster (disagg.cluster), e.g. a
// node of a second cluster pointed at this one's router: logged there, and
// the node exits 1 naming the reason, as for another model.
// A second node with a name a registered worker holds is refused; the
// holder keeps serving.
// Another worker holds the name: the newcomer asks again for as long as its
// middleman keeps a silent connection (name_held_wait: the holder may be its
// own earlier run, gone unnoticed), here 3 s, then its node exits.
const std::string kQuickMiddleman = "\n[middleman]\nheartbeat-interval = 1s\nconnection-timeout = 2s\n";

TEST(ClusterMembership, AWorkerWithATakenNameIsRefusedAndItsNodeExits) {
  TestCluster cluster("refused-name");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  write_text_file(cluster.dir() + "/impostor.ini", cluster.config_text("prefill", "prefill-1", 0, kQuickMiddleman));
  ChildProcess impostor({node_binary(), "--config-file=" + cluster.dir() + "/impostor.ini"},
                        cluster.dir() + "/impostor.log");
  // (3 s of asking, after a start that takes well under a second here)
  const auto code = impostor.wait_exit(std::chrono::seconds(20));
  ASSERT_TRUE(code.has_value()) << "the refused worker is still running\n" << impostor.log();
  EXPECT_EQ(*code, 1) << impostor.log();
  EXPECT_NE(impostor.log().find("is taken by another worker; trying again"), std::string::npos) << impostor.log();
  EXPECT_NE(impostor.log().find("is taken by another worker; exiting"), std::string::npos) << impostor.log();
  EXPECT_NE(cluster.node("router").log().find("is taken by another worker"), std::string::npos)
      << cluster.node("router").log();
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  GenerateRequest r = small_request();
  const RequestOutcome out = cluster.client().generate(r);
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.prefill_worker, "prefill-1");
  EXPECT_TRUE(cluster.stop_all());
}

// A worker restarted before the router noticed its earlier run was gone
// (the 10-minute soak on a lossy link: the new run registered 44 ms before
// the router saw the old connection end, was refused and exited): it is
// told the name is held, asks again, and joins once the router has dropped
// the earlier run. Here the earlier run lives until the new one has been
// told, then is killed.
TEST(ClusterMembership, AWorkerRestartedBeforeTheRouterNoticedItsEarlierRunJoinsOnceItDoes) {
  TestCluster cluster("restarted-name");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  write_text_file(cluster.dir() + "/again.ini", cluster.config_text("decode", "decode-1", free_loopback_port()));
  ChildProcess again({node_binary(), "--config-file=" + cluster.dir() + "/again.ini"}, cluster.dir() + "/again.log");
  ASSERT_TRUE(again.log_says("is taken by another worker", std::chrono::seconds(60))) << again.log();
  ASSERT_NE(again.log().find("is taken by another worker; trying again"), std::string::npos) << again.log();
  ASSERT_TRUE(again.running()) << again.log();
  cluster.kill_node("decode-1");
  ASSERT_TRUE(again.log_says("registered with the router as decode-1", std::chrono::seconds(30)))
      << again.log() << cluster.node("router").log();
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  const RequestOutcome out = cluster.client().generate(small_request());
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.decode_worker, "decode-1");
  EXPECT_EQ(again.stop(), 0) << again.log();
  EXPECT_TRUE(cluster.stop_all());
}

TEST(ClusterMembership, AWorkerOfAnotherClusterIsRefusedAndItsNodeExits) {
  TestCluster cluster("refused-cluster");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  std::string ini = cluster.config_text("prefill", "neighbour", 0);
  ini.replace(ini.find("[disagg]\n"), 9, "[disagg]\ncluster = \"other\"\n");
  write_text_file(cluster.dir() + "/neighbour.ini", ini);
  ChildProcess neighbour({node_binary(), "--config-file=" + cluster.dir() + "/neighbour.ini"},
                         cluster.dir() + "/neighbour.log");
  // Bounded by the configuration, not a guess: the node loads the model,
  // reaches the router and waits up to compute-timeout-ms for the answer to
  // its registration (a busy machine stretches each step).
  const auto bound = std::chrono::milliseconds(DisaggConfig{}.compute_timeout_ms) + std::chrono::seconds(30);
  const auto code = neighbour.wait_exit(bound);
  ASSERT_TRUE(code.has_value()) << "the refused worker is still running\n" << neighbour.log();
  EXPECT_EQ(*code, 1) << neighbour.log();
  const std::string why = "belongs to cluster \"other\", this router serves cluster \"disagg\"";
  EXPECT_NE(neighbour.log().find("refused"), std::string::npos) << neighbour.log();
  EXPECT_NE(neighbour.log().find(why), std::string::npos) << neighbour.log();
  EXPECT_NE(cluster.node("router").log().find("registration of prefill worker \"neighbour\" refused: it " + why),
            std::string::npos)
      << cluster.node("router").log();
  EXPECT_NE(cluster.node("router").log().find("router of cluster \"disagg\" listening"), std::string::npos);
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  // The same node naming this cluster joins.
  ini = cluster.config_text("prefill", "neighbour", 0);
  ini.replace(ini.find("[disagg]\n"), 9, "[disagg]\ncluster = \"disagg\"\n");
  write_text_file(cluster.dir() + "/neighbour.ini", ini);
  ChildProcess member({node_binary(), "--config-file=" + cluster.dir() + "/neighbour.ini"},
                      cluster.dir() + "/member.log");
  EXPECT_TRUE(cluster.wait_for_workers(2, 1)) << member.log();
  EXPECT_EQ(member.stop(), 0) << member.log();
  EXPECT_TRUE(cluster.stop_all());
}

}  // namespace
}  // namespace disagg::test
