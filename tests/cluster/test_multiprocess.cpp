// A real multi-process cluster (1 router, 2 prefill, 2 decode disagg-node
// processes on loopback) serving the shared model: token identity with the
// shared references and with colocated generation, concurrency, the direct
// prefill -> decode connections that carry the KV, and the client binary.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <map>
#include <set>

#include "actors/config.h"
#include "cluster/cluster_fixture.h"
#include "cluster/tcp_traffic.h"
#include "model/checkpoint.h"
#include "engine/engine.h"
#include "engine/generate.h"
#include "text/tokenizer.h"
#include "support/reference_cases.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

TEST(MultiProcessCluster, ServesTheSharedReferenceCasesTokenForToken) {
  TestCluster cluster("cluster-reference");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(2, 2));
  const auto cases = load_all_reference_cases();  // both reference files
  ASSERT_FALSE(cases.empty());
  for (const auto& c : cases) {
    SCOPED_TRACE(describe(c));
    const RequestOutcome by_tokens = cluster.client().generate(token_request(c.prompt_tokens, c.max_new_tokens));
    ASSERT_TRUE(by_tokens.ok()) << to_string(by_tokens.code) << ": " << by_tokens.message;
    EXPECT_EQ(by_tokens.tokens, std::vector<int32_t>(c.output_tokens.begin(), c.output_tokens.end()));
    EXPECT_EQ(by_tokens.text, c.text);
    EXPECT_EQ(by_tokens.finish == FinishReason::eos, int(c.output_tokens.size()) < c.max_new_tokens);

    GenerateRequest text = token_request({}, c.max_new_tokens);
    text.prompt_text = c.prompt;  // encoded by the router's tokenizer
    text.prompt_is_text = true;
    const RequestOutcome by_text = cluster.client().generate(text);
    ASSERT_TRUE(by_text.ok()) << to_string(by_text.code) << ": " << by_text.message;
    EXPECT_EQ(by_text.prompt_tokens, std::vector<int32_t>(c.prompt_tokens.begin(), c.prompt_tokens.end()))
        << "the router's tokenizer encoded the text prompt differently";
    EXPECT_EQ(by_text.tokens, by_tokens.tokens);
    EXPECT_EQ(by_text.text, c.text);
  }
  EXPECT_TRUE(cluster.stop_all());
}

TEST(MultiProcessCluster, ConcurrentRequestsMatchColocatedGenerationOverDirectKvConnections) {
  TestCluster cluster("cluster-concurrent");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(2, 2));

  auto checkpoint = gpu::Checkpoint::open(shared_model());
  gpu::Engine engine(checkpoint, gpu::EngineOptions{"cpu"});
  const auto tokenizer = gpu::Tokenizer::load(shared_tokenizer(), checkpoint->config().vocab_size);
  const std::vector<std::string> prompts = {"Once upon a time", "The little dog", "Lily and Tom went to the",
                                            "One day, a big", "Sam saw a bird"};

  struct Pending {
    GenerateRequest request;
    gpu::GenerateResult expected;
    std::shared_ptr<std::mutex> mutex = std::make_shared<std::mutex>();
    std::shared_ptr<std::vector<TokenEvent>> events = std::make_shared<std::vector<TokenEvent>>();
    std::future<RequestOutcome> outcome;
  };
  std::vector<Pending> requests(32);
  for (size_t i = 0; i < requests.size(); ++i) {
    Sampling sampling;
    if (i % 2 == 1) sampling = Sampling{0.9f, i % 4 == 1 ? 0.9f : 1.0f, 1000 + i};  // odd: sampled
    const auto prompt = tokenizer.encode(prompts[i % prompts.size()]);
    requests[i].request = token_request(prompt, 8 + int(i * 7) % 56, sampling);
    requests[i].expected = gpu::generate(engine, prompt, requests[i].request.max_new_tokens,
                                         gpu::SamplingParams{sampling.temperature, sampling.top_p, sampling.seed});
  }
  for (auto& p : requests) {
    auto mutex = p.mutex;
    auto events = p.events;
    p.outcome = cluster.client().submit(p.request, [mutex, events](const TokenEvent& e) {
      std::lock_guard<std::mutex> lock(*mutex);
      events->push_back(e);
    });
  }
  std::set<std::string> prefill_workers, decode_workers;
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i));
    const RequestOutcome out = requests[i].outcome.get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
    EXPECT_EQ(out.tokens, std::vector<int32_t>(requests[i].expected.tokens.begin(), requests[i].expected.tokens.end()));
    std::lock_guard<std::mutex> lock(*requests[i].mutex);
    std::vector<int32_t> streamed;
    for (size_t k = 0; k < requests[i].events->size(); ++k) {
      EXPECT_EQ((*requests[i].events)[k].index, int(k));
      streamed.push_back((*requests[i].events)[k].token);
    }
    EXPECT_EQ(streamed, out.tokens);
    prefill_workers.insert(out.prefill_worker);
    decode_workers.insert(out.decode_worker);
  }
  EXPECT_EQ(prefill_workers, (std::set<std::string>{"prefill-1", "prefill-2"}));
  EXPECT_EQ(decode_workers, (std::set<std::string>{"decode-1", "decode-2"}));

  // The KV went over each prefill node's own connection to each decode
  // node's port (CAF routes to a node over a direct connection when one
  // exists; the prefill gate lets no job through without one).
  for (const auto& prefill : cluster.names("prefill"))
    for (const auto& decode : cluster.names("decode"))
      EXPECT_TRUE(has_connection_to_port(cluster.node(prefill).pid(), cluster.port_of(decode)))
          << prefill << " has no direct connection to " << decode << " (port " << cluster.port_of(decode) << ")";
  // The router never dials a decode node's KV port.
  for (const auto& decode : cluster.names("decode"))
    EXPECT_FALSE(has_connection_to_port(cluster.node("router").pid(), cluster.port_of(decode)));
  EXPECT_NE(cluster.node("prefill-1").log().find("direct connection to decode worker decode-2"), std::string::npos);
  EXPECT_TRUE(cluster.stop_all());
}

// The KV goes from the prefill nodes to the decode nodes over connections of
// their own, streamed over UCX's TCP transport (kv-transport tcp) or as CAF
// messages to the decode nodes' ports (message), and never through the
// router's node. (shm takes shared memory on one host: no TCP bytes to count.)
void expect_kv_goes_prefill_to_decode(const std::string& transport) {
  SCOPED_TRACE("kv-transport " + transport);
  TestCluster cluster("cluster-kv-route-" + transport);
  cluster.set_disagg_options("kv-transport = \"" + transport + "\"");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(2, 2));
  // Long prompts, short answers: the traffic is almost all KV.
  std::vector<int> prompt = {1};
  for (int i = 0; i < 299; ++i) prompt.push_back(300 + i % 200);
  const gpu::ModelConfig model = gpu::Checkpoint::open(shared_model())->config();
  const uint64_t kv_bytes_per_request =
      uint64_t(prompt.size()) * model.n_layers * 2 * model.n_kv_heads * model.head_size() * sizeof(float);
  const int requests = 8;
  std::vector<std::future<RequestOutcome>> pending;
  for (int i = 0; i < requests; ++i) pending.push_back(cluster.client().submit(token_request(prompt, 2)));
  for (auto& f : pending) {
    const RequestOutcome out = f.get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
    EXPECT_EQ(out.timings.kv_streamed, transport != "message");
  }

  const auto connections = established_connections();
  ASSERT_TRUE(connections) << "`ss` (iproute2, scripts/install-deps) is needed to read TCP counters";
  std::set<pid_t> prefill_pids, decode_pids;
  for (const auto& name : cluster.names("prefill")) prefill_pids.insert(cluster.node(name).pid());
  for (const auto& name : cluster.names("decode")) decode_pids.insert(cluster.node(name).pid());
  // Ports of the decode nodes' ends of every connection.
  std::set<std::pair<uint16_t, uint16_t>> decode_ends;  // (local, remote) as the decode node sees them
  for (const auto& c : *connections)
    if (decode_pids.count(c.pid)) decode_ends.insert({c.local_port, c.remote_port});
  const pid_t router = cluster.node("router").pid();
  uint64_t router_received = 0, prefill_to_decode = 0;
  for (const auto& c : *connections) {
    if (c.pid == router) router_received += c.bytes_received;
    if (prefill_pids.count(c.pid) && decode_ends.count({c.remote_port, c.local_port})) prefill_to_decode += c.bytes_sent;
  }
  const uint64_t kv_total = requests * kv_bytes_per_request;
  EXPECT_GE(prefill_to_decode, kv_total) << "the KV did not go over the prefill nodes' own connections";
  EXPECT_LT(router_received, kv_total / 10) << "the router's node received " << router_received << " bytes";
  EXPECT_TRUE(cluster.stop_all());
}

TEST(MultiProcessCluster, KvBytesGoFromPrefillToDecodeNodesNotThroughTheRouter) {
  expect_kv_goes_prefill_to_decode("tcp");
  expect_kv_goes_prefill_to_decode("message");
}

// A decode node set to shm and a prefill node on the same host set to tcp:
// the prefill node cannot send over shared memory, so the KV goes over TCP
// (it told its host to the decode node all the same, which picked shm, and
// every transfer between them failed).
TEST(MultiProcessCluster, ADecodeNodeOnShmStreamsOverTcpFromAPrefillNodeWithout) {
  TestCluster cluster("mixed-kv-transports");
  cluster.start_router();
  cluster.start_node("prefill", "prefill-1", "", "kv-transport = \"tcp\"\n");
  cluster.start_node("decode", "decode-1", "", "kv-transport = \"shm\"\n");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  std::vector<int> prompt = {1};
  for (int i = 0; i < 99; ++i) prompt.push_back(300 + i % 200);
  const GenerateRequest request = token_request(prompt, 8);
  const RequestOutcome out = cluster.client().generate(request);
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
  EXPECT_TRUE(out.timings.kv_streamed);
  EXPECT_EQ(out.tokens, colocated_tokens(shared_model(), request));
  EXPECT_TRUE(cluster.stop_all());
}

// A prefill node on kv-transport message, a decode node that streams and
// whose port takes messages of 64 KiB: a KV message larger than that is
// refused before it goes (kv_too_large, at once, naming the limit), where
// the decode node's guard cut the connection, and every request on it,
// which then ended at the ack timeout; a smaller one goes and decodes.
TEST(MultiProcessCluster, AOneMessageKvOverTheDecodeNodesLimitIsRefusedBeforeItGoes) {
  TestCluster cluster("kv-message-limit");
  cluster.start_router();
  cluster.start_node("prefill", "prefill-1", "", "kv-transport = \"message\"\n");
  cluster.start_node("decode", "decode-1", "max-message-bytes = 65536\n");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  auto prompt_of = [](int n) {
    std::vector<int> p = {1};
    for (int i = 1; i < n; ++i) p.push_back(300 + i % 200);
    return p;
  };
  const RequestOutcome big = cluster.client().generate(token_request(prompt_of(100), 8));
  EXPECT_EQ(big.code, ErrorCode::kv_too_large) << to_string(big.code) << ": " << big.message << "\n" << cluster.logs();
  EXPECT_NE(big.message.find("decode node's limit of 65536"), std::string::npos) << big.message;
  const GenerateRequest small = token_request(prompt_of(20), 8);
  const RequestOutcome out = cluster.client().generate(small);
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
  EXPECT_FALSE(out.timings.kv_streamed);
  EXPECT_EQ(out.tokens, colocated_tokens(shared_model(), small));
  EXPECT_EQ(cluster.logs().find("message_too_large"), std::string::npos) << cluster.logs();
  EXPECT_TRUE(cluster.stop_all());
}

// Conditional disaggregation with the default local-prefill-tokens (the
// fixture's is 0): a short prompt is prefilled by the decode node chosen for
// it, no KV travels; a prompt longer than that goes to the prefill node and
// its KV is streamed. Both give gpu::generate's tokens.
TEST(MultiProcessCluster, ByDefaultShortPromptsArePrefilledOnTheirDecodeNode) {
  TestCluster cluster("local-prefill");
  cluster.set_local_prefill_tokens(std::nullopt);
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  auto engine = std::make_shared<gpu::Engine>(gpu::Checkpoint::open(shared_model()));
  const int local = DisaggConfig{}.local_prefill_tokens;
  for (const int n : {5, local, local + 1}) {
    SCOPED_TRACE(std::to_string(n) + " prompt tokens");
    std::vector<int> p{1};
    for (int i = 1; i < n; ++i) p.push_back(3 + (i * 37 + n) % 500);  // (another prompt each time)
    const RequestOutcome out = cluster.client().generate(token_request(p, 8));
    ASSERT_TRUE(out.ok()) << out.message << "\n" << cluster.logs();
    EXPECT_EQ(out.tokens, gpu::generate(*engine, p, 8, {}).tokens);
    EXPECT_EQ(out.decode_worker, "decode-1");
    if (n <= local) {
      EXPECT_EQ(out.prefill_worker, "decode-1");
    } else {
      EXPECT_EQ(out.prefill_worker, "prefill-1");
      EXPECT_TRUE(out.timings.kv_streamed);
    }
  }
  EXPECT_TRUE(cluster.stop_all());
}

// KV-aware routing to prefill nodes: a prefill worker's prefix-cache events
// reach the router through its node's relay and gate (the face the router
// knows it by), so each group's later requests go to the prefill node that
// computed the group's first. (The events travel two local hops more than
// the job's report: one of the 9 may race the client's next request.)
TEST(MultiProcessCluster, RequestsGoToThePrefillNodeThatHoldsTheirPrefix) {
  TestCluster cluster("prefill-prefix");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(2, 1));
  auto engine = std::make_shared<gpu::Engine>(gpu::Checkpoint::open(shared_model()));
  std::map<int, std::string> home;
  std::set<std::string> used;
  int on_home = 0;
  for (int round = 0; round < 4; ++round)
    for (int g = 0; g < 3; ++g) {
      std::vector<int> p{1};
      for (int i = 1; i < 96; ++i) p.push_back(3 + (i * 37 + g * 101) % 500);  // the group's 6 blocks
      for (int i = 0; i < 19; ++i) p.push_back(3 + (i * 53 + round * 7 + g) % 500);
      const RequestOutcome out = cluster.client().generate(token_request(p, 4));
      ASSERT_TRUE(out.ok()) << out.message << "\n" << cluster.logs();
      EXPECT_EQ(out.tokens, gpu::generate(*engine, p, 4, {}).tokens);
      used.insert(out.prefill_worker);
      if (round == 0) home[g] = out.prefill_worker;
      else on_home += out.prefill_worker == home[g];
    }
  EXPECT_GE(on_home, 8) << "of the 9 requests after each group's first\n" << cluster.node("router").log();
  EXPECT_EQ(used.size(), 2u) << "the groups did not spread over both prefill nodes";
  // The router's index follows the prefill nodes' own events, not just its
  // predictions: together they hold each group's 6 shared full blocks and
  // each prompt's own 7th (3 groups, 12 prompts of 115 tokens: at least
  // 3 x 6 + 12 x 1 = 30; more when a group visited both).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int held = 0;
  while (held < 30 && std::chrono::steady_clock::now() < deadline) {
    held = 0;
    if (const auto status = cluster.client().status())
      for (const auto& w : status->workers)
        if (w.role == WorkerRole::prefill) held += w.cached_blocks;
  }
  EXPECT_GE(held, 30) << "the prefill nodes' KV events did not reach the router's index";
  EXPECT_TRUE(cluster.stop_all());
}

// Colocated worker nodes (role `worker`, config/colocated/): each registers
// a prefill and a decode worker of its unit, serves token for token what
// gpu::generate makes (greedy and sampled, concurrent), keeps a request's
// prefill and decode in one process, and when one is killed the other takes
// every new request.
TEST(MultiProcessCluster, ColocatedWorkerNodesServeTokenForTokenAndSurviveOneLost) {
  TestCluster cluster("cluster-colocated");
  cluster.start_router();
  cluster.start_node("worker", "worker-1");
  cluster.start_node("worker", "worker-2");
  ASSERT_TRUE(cluster.wait_for_workers(2, 2));
  auto run_batch = [&](int n, const std::string& only_unit) {
    std::vector<GenerateRequest> requests;
    std::vector<std::future<RequestOutcome>> futures;
    for (int i = 0; i < n; ++i) {
      Sampling sampling;
      if (i % 2 == 1) sampling = Sampling{0.9f, 0.95f, uint64_t(300 + i)};
      requests.push_back(token_request({1, 403, 407, 261, 378}, 10 + (i * 13) % 50, sampling));
      futures.push_back(cluster.client().submit(requests.back()));
    }
    std::set<std::string> units;
    for (int i = 0; i < n; ++i) {
      const RequestOutcome out = futures[size_t(i)].get();
      ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message << "\n" << cluster.logs();
      EXPECT_EQ(out.tokens, colocated_tokens(cluster.model(), requests[size_t(i)]));
      const std::string unit = out.decode_worker.substr(0, out.decode_worker.rfind('/'));
      EXPECT_EQ(out.prefill_worker, unit + "/prefill") << "prefilled in another process than " << out.decode_worker;
      EXPECT_EQ(out.decode_worker, unit + "/decode");
      units.insert(unit);
    }
    if (only_unit.empty())
      EXPECT_EQ(units.size(), 2u) << "both colocated nodes took requests";
    else
      EXPECT_EQ(units, std::set<std::string>{only_unit});
  };
  ASSERT_NO_FATAL_FAILURE(run_batch(16, ""));
  cluster.kill_node("worker-1");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  ASSERT_NO_FATAL_FAILURE(run_batch(8, "worker-2"));
  EXPECT_TRUE(cluster.stop_all());
}

TEST(MultiProcessCluster, ClientBinaryPrintsWhatDisaggGenerateDoes) {
  TestCluster cluster("cluster-client");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  const auto timeout = std::chrono::seconds(60);
  std::string out, err, ref_out, ref_err;

  // --json with a text prompt: the same object as disagg-generate, plus timings.
  ASSERT_EQ(run_to_completion({client_binary(), "--router", cluster.router_address(), "--prompt", "Once upon a time",
                               "--max-new-tokens", "40", "--tokenizer", shared_tokenizer(), "--json"},
                              out, err, timeout),
            0)
      << err;
  ASSERT_EQ(run_to_completion({bin_dir() + "/disagg-generate", "--model", shared_model(), "--tokenizer",
                               shared_tokenizer(), "--prompt", "Once upon a time", "--max-new-tokens", "40", "--json"},
                              ref_out, ref_err, timeout),
            0)
      << ref_err;
  const ReferenceCase got = parse_reference_case(out);
  const ReferenceCase want = parse_reference_case(ref_out);
  EXPECT_EQ(got.prompt_tokens, want.prompt_tokens);
  EXPECT_EQ(got.output_tokens, want.output_tokens);
  EXPECT_EQ(got.text, want.text);
  EXPECT_NE(out.find("\"ttft_ms\":"), std::string::npos);
  EXPECT_NE(err.find("tokens/s"), std::string::npos);

  // Streaming, sampled, by token ids: stdout holds the continuation.
  ASSERT_EQ(run_to_completion({client_binary(), "--router", cluster.router_address(), "--prompt-tokens",
                               "1 403 407 261 378", "--max-new-tokens", "30", "--temperature", "0.8", "--seed", "7"},
                              out, err, timeout),
            0)
      << err;
  EXPECT_NE(err.find("ttft"), std::string::npos);
  // The streamed text is colocated generation's, same seed and temperature.
  std::string sampled_ref, sampled_err;
  ASSERT_EQ(run_to_completion({bin_dir() + "/disagg-generate", "--model", shared_model(), "--tokenizer",
                               shared_tokenizer(), "--prompt-tokens", "1 403 407 261 378", "--max-new-tokens", "30",
                               "--temperature", "0.8", "--seed", "7", "--json"},
                              sampled_ref, sampled_err, timeout),
            0)
      << sampled_err;
  const ReferenceCase sampled = parse_reference_case(sampled_ref);
  ASSERT_FALSE(sampled.text.empty());
  std::string streamed = out;
  while (!streamed.empty() && streamed.back() == '\n') streamed.pop_back();
  EXPECT_EQ(streamed, sampled.text);

  // An error from the cluster: its code and message, and an exit code per
  // kind (a refused request 4, a passed deadline 6).
  ASSERT_EQ(run_to_completion({client_binary(), "--router", cluster.router_address(), "--prompt-tokens", "1 99999",
                               "--max-new-tokens", "4"},
                              out, err, timeout),
            4);
  EXPECT_NE(err.find("invalid_request"), std::string::npos) << err;
  // (200 tokens across three processes take far longer than 1 ms)
  ASSERT_EQ(run_to_completion({client_binary(), "--router", cluster.router_address(), "--prompt-tokens", "1 403",
                               "--max-new-tokens", "200", "--deadline-ms", "1"},
                              out, err, timeout),
            6)
      << err;
  EXPECT_NE(err.find("timeout"), std::string::npos) << err;

  // No router there: exit 3.
  EXPECT_EQ(run_to_completion({client_binary(), "--router", "127.0.0.1:" + std::to_string(free_loopback_port()),
                               "--status"},
                              out, err, timeout),
            3);
  EXPECT_TRUE(cluster.stop_all());
}

}  // namespace
}  // namespace disagg::test
