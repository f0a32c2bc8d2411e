// Prefix caching through the cluster (engine/kv_cache.h BlockPool on each
// decode worker): a request whose prompt starts with full blocks a decode
// worker holds (an earlier request's prompt, or its prompt and generated
// tokens: a conversation's next turn) shares them; its rest is prefilled by
// the decode worker itself when short (conditional disaggregation), or by a
// prefill worker that streams only the blocks after the cached ones. The
// tokens are those of gpu::generate on the whole prompt, greedy and sampled,
// on every path; a cache salt keeps requests apart, and eviction under a full
// pool never gives a request another prompt's KV.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <set>
#include <map>
#include <thread>

#include "actors/actor_fixture.h"
#include "caf/all.hpp"
#include "metrics/disagg_metrics.h"

namespace disagg::test {
namespace {

constexpr int kBlock = 16;  // DisaggConfig's default block size

// A prompt of n tokens of the shared model (ids its vocabulary has), `seed`
// making different prompts.
std::vector<int32_t> prompt_of(int n, int seed) {
  std::vector<int32_t> p{1};
  for (int i = 1; i < n; ++i) p.push_back(3 + (i * 37 + seed * 101) % 500);
  return p;
}

RequestOutcome generate(Client& client, std::vector<int32_t> prompt, int max_new, const Sampling& sampling = {},
                        const std::string& salt = {}) {
  GenerateRequest r = make_request(std::move(prompt), max_new, sampling);
  r.cache_salt = salt;
  return client.generate(std::move(r));
}

// Who computes the rest of a prompt after its cached blocks.
enum class Rest {
  decode_worker,   // the decode worker itself (conditional disaggregation)
  prefill_worker,  // a prefill worker, which sends only the positions after the cached blocks
  prefill_message,  // a prefill worker on kv-transport = message: all the KV in one message
};

// A conversation: turn 1, then turn 2 = turn 1's prompt + its answer + new
// tokens. Turn 2 has every full block before its last 5 positions cached.
void expect_second_turn_cached(Client& client, const Sampling& sampling, Rest rest) {
  const std::vector<int32_t> first = prompt_of(70, 1);
  const RequestOutcome one = generate(client, first, 40, sampling);
  ASSERT_TRUE(one.ok()) << one.message;
  EXPECT_EQ(one.tokens, colocated(first, 40, sampling).tokens);
  EXPECT_EQ(one.timings.cached_tokens, 0);
  ASSERT_EQ(one.tokens.size(), 40u) << "the test wants a turn that ends by length";
  std::vector<int32_t> second = first;
  second.insert(second.end(), one.tokens.begin(), one.tokens.end());
  const std::vector<int32_t> user = prompt_of(6, 2);
  second.insert(second.end(), user.begin() + 1, user.end());  // 115 tokens
  const RequestOutcome two = generate(client, second, 30, sampling);
  ASSERT_TRUE(two.ok()) << two.message;
  EXPECT_EQ(two.tokens, colocated(second, 30, sampling).tokens) << "cached KV gave other tokens";
  // Cached: the prompt's and the answer's full blocks whose KV was final
  // (all but the answer's last token): 70 + 39 = 109 positions -> 6 blocks.
  EXPECT_EQ(two.timings.cached_tokens, 6 * kBlock);
  if (rest == Rest::decode_worker) {
    EXPECT_EQ(two.prefill_worker, two.decode_worker) << "the short rest was not prefilled by the decode worker";
  } else {
    EXPECT_NE(two.prefill_worker, two.decode_worker);
    // Only the positions after the cached blocks travel (a colocated unit's
    // prefill worker counts what a stream would have carried).
    if (rest == Rest::prefill_worker)
      EXPECT_EQ(two.timings.kv_bytes, stream_bytes_for(int(second.size())) - stream_bytes_for(6 * kBlock));
  }
}

// 1 prefill + 1 decode worker with DisaggConfig's local-prefill-tokens (the
// fixture's is 0) or `local` positions.
LocalClusterOptions with_local_prefill(int local = DisaggConfig{}.local_prefill_tokens) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.local_prefill_tokens = local;
  return options;
}

TEST_F(ActorTest, ASecondTurnPrefillsOnlyItsNewTokensOnTheDecodeWorker) {
  start(with_local_prefill());
  expect_second_turn_cached(*client_, Sampling{}, Rest::decode_worker);
}

TEST_F(ActorTest, ASecondTurnSampledGivesTheSameTokensFromTheCache) {
  start(with_local_prefill());
  expect_second_turn_cached(*client_, Sampling{0.9f, 0.95f, 1234}, Rest::decode_worker);
}

// The decode worker's own prefill of the rest samples with the penalties
// of the whole prompt, cached part included.
TEST_F(ActorTest, ASecondTurnWithPenaltiesGivesTheSameTokensFromTheCache) {
  start(with_local_prefill());
  Sampling s{0.9f, 0.95f, 99};
  s.frequency_penalty = 0.8f;
  s.repetition_penalty = 1.2f;
  s.stop.ignore_eos = true;  // (the test wants turns that end by length)
  expect_second_turn_cached(*client_, s, Rest::decode_worker);
}

// Prompt log probabilities need every position computed: such a request
// takes nothing from a prefix cache that holds its prompt (on the decode
// worker's own prefill, and on a prefill worker's).
void expect_prompt_logprobs_uncached(Client& client) {
  const std::vector<int32_t> prompt = prompt_of(70, 3);
  ASSERT_TRUE(generate(client, prompt, 8).ok());
  const RequestOutcome cached = generate(client, prompt, 8);
  ASSERT_GT(cached.timings.cached_tokens, 0) << "precondition: the prompt is cached";
  Sampling s;
  s.prompt_logprobs = 1;
  const RequestOutcome out = generate(client, prompt, 8, s);
  ASSERT_TRUE(out.ok()) << out.message;
  EXPECT_EQ(out.timings.cached_tokens, 0);
  const gpu::GenerateResult local = colocated(prompt, 8, s);
  ASSERT_EQ(out.prompt_logprobs.size(), prompt.size() - 1);
  for (size_t i = 0; i < out.prompt_logprobs.size(); ++i) {
    EXPECT_EQ(out.prompt_logprobs[i].logprob, local.prompt_logprobs[i].logprob) << "prompt token " << i + 1;
    EXPECT_EQ(out.prompt_logprobs[i].top_tokens, local.prompt_logprobs[i].top_tokens);
  }
  EXPECT_EQ(out.tokens, local.tokens);
}

TEST_F(ActorTest, PromptLogprobsComputeEveryPositionOnTheDecodeWorkerWhateverIsCached) {
  start(with_local_prefill());
  expect_prompt_logprobs_uncached(*client_);
}

TEST_F(ActorTest, PromptLogprobsComputeEveryPositionOnAPrefillWorkerWhateverIsCached) {
  start(with_local_prefill(0));
  expect_prompt_logprobs_uncached(*client_);
}

// Conditional disaggregation of a prompt with nothing cached: at most
// local-prefill-tokens positions and the decode worker chosen for it
// prefills it itself (no prefill worker, no KV sent); one position more and
// a prefill worker computes and streams all of it. The tokens are the same.
TEST_F(ActorTest, AShortPromptWithNothingCachedIsPrefilledByItsDecodeWorker) {
  start(with_local_prefill(64));
  int seed = 30;
  for (const Sampling& sampling : {Sampling{}, Sampling{0.9f, 0.95f, 77}}) {
    for (const int n : {64, 65}) {
      const std::vector<int32_t> prompt = prompt_of(n, ++seed);  // (another prompt each time: nothing cached)
      const double sent_before = metrics::disagg_metrics().kv_transfer_bytes.value();
      const RequestOutcome r = generate(*client_, prompt, 20, sampling);
      ASSERT_TRUE(r.ok()) << r.message;
      EXPECT_EQ(r.tokens, colocated(prompt, 20, sampling).tokens) << n << " positions";
      EXPECT_EQ(r.timings.cached_tokens, 0);
      const double sent = metrics::disagg_metrics().kv_transfer_bytes.value() - sent_before;
      if (n <= 64) {
        EXPECT_EQ(r.prefill_worker, r.decode_worker) << n << " positions went to a prefill worker";
        EXPECT_EQ(sent, 0) << "KV was sent for a prompt its decode worker prefilled";
      } else {
        EXPECT_EQ(sent, double(stream_bytes_for(n)));
        EXPECT_NE(r.prefill_worker, r.decode_worker) << n << " positions stayed on the decode worker";
        EXPECT_EQ(r.timings.kv_bytes, stream_bytes_for(n));
      }
    }
  }
}

TEST_F(ActorTest, WithoutLocalPrefillTheRestIsStreamedAfterTheCachedBlocks) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.local_prefill_tokens = 0;
  start(std::move(options));
  expect_second_turn_cached(*client_, Sampling{}, Rest::prefill_worker);
}

// A prefill worker on kv-transport = message beside a decode worker that
// streams sends every position in one message; the decode worker writes
// those after its cached blocks (the shared ones hold the same KV: fixed
// arithmetic) and caches the sequence's blocks as a streamed one's. Such a
// request was refused ("its KV must be streamed into the rest").
TEST_F(ActorTest, AOneMessageKvFillsOnlyTheBlocksAfterTheCachedOnes) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.local_prefill_tokens = 0;
  options.prefill_kv_transport = "message";
  start(std::move(options));
  expect_second_turn_cached(*client_, Sampling{0.9f, 0.95f, 1234}, Rest::prefill_message);
}

// A one-message KV has no stream id saying which attempt it is for: one of
// another prompt than the blocks were reserved for (a late message of an
// earlier attempt) is refused; taken, it would have published the shared
// blocks under the reserved prompt's hashes with another prompt's KV after them.
TEST_F(ActorTest, AOneMessageKvOfAnotherPromptThanReservedIsRefused) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.local_prefill_tokens = 0;
  start(std::move(options));
  const std::vector<int32_t> prompt = prompt_of(70, 5);
  ASSERT_TRUE(generate(*client_, prompt, 8).ok());
  caf::scoped_actor self{*system_};
  const decode_actor decode = cluster_->decode_workers().at(0);
  KvReservation r;
  r.id = 777;
  r.positions = 80;
  r.lease_ms = 60000;
  r.prompt_len = int32_t(prompt.size());
  r.prompt_tokens = prompt;
  ReserveReply reply;
  self->request(decode, std::chrono::seconds(5), reserve_atom::value, r)
      .receive([&](ReserveReply& got) { reply = std::move(got); }, [&](caf::error& e) { FAIL() << system_->render(e); });
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  ASSERT_EQ(reply.cached_tokens, 4 * kBlock) << "precondition: the prompt's blocks are cached";
  KvTransfer t;
  t.id = 777;
  t.prompt_len = int32_t(prompt.size());
  t.max_new_tokens = 4;
  t.first_token = 5;
  t.context = prompt_of(70, 6);  // another prompt of that length
  t.ticket = reply.target.ticket;
  KvAck ack;
  self->request(decode, std::chrono::seconds(5), kv_atom::value, t)
      .receive([&](KvAck& got) { ack = std::move(got); }, [&](caf::error& e) { FAIL() << system_->render(e); });
  EXPECT_EQ(ack.code, ErrorCode::invalid_request) << ack.message;
  EXPECT_NE(ack.message.find("another prompt"), std::string::npos) << ack.message;
  self->send(decode, cancel_atom::value, RequestId{777});
}

TEST_F(ActorTest, AColocatedWorkerPrefillsOnlyAfterItsCachedBlocks) {
  LocalClusterOptions options;
  options.config = shared_model_config(0, 0);
  options.colocated_workers = 1;
  start(std::move(options));
  expect_second_turn_cached(*client_, Sampling{}, Rest::prefill_worker);  // its unit's, into its own blocks
}

TEST_F(ActorTest, PrefixCachingOffCachesNothing) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.prefix_caching = false;
  start(std::move(options));
  const std::vector<int32_t> p = prompt_of(100, 3);
  ASSERT_TRUE(generate(*client_, p, 8).ok());
  const RequestOutcome again = generate(*client_, p, 8);
  ASSERT_TRUE(again.ok()) << again.message;
  EXPECT_EQ(again.timings.cached_tokens, 0);
  EXPECT_EQ(again.timings.kv_bytes, stream_bytes_for(100));
}

TEST_F(ActorTest, TheSamePromptAgainSharesAllButItsLastBlockAndASaltKeepsItApart) {
  start(1, 1);
  const std::vector<int32_t> p = prompt_of(96, 4);  // 6 full blocks
  const RequestOutcome one = generate(*client_, p, 8, {}, "tenant-a");
  ASSERT_TRUE(one.ok()) << one.message;
  const RequestOutcome two = generate(*client_, p, 8, {}, "tenant-a");
  ASSERT_TRUE(two.ok()) << two.message;
  // The last position is always computed (its logits give token 0), so the
  // last of the 6 full blocks is computed again.
  EXPECT_EQ(two.timings.cached_tokens, 5 * kBlock);
  EXPECT_EQ(two.tokens, one.tokens);
  const RequestOutcome other = generate(*client_, p, 8, {}, "tenant-b");
  ASSERT_TRUE(other.ok()) << other.message;
  EXPECT_EQ(other.timings.cached_tokens, 0) << "another tenant's salt shared the cache";
  EXPECT_EQ(other.tokens, one.tokens);
}

// A pool too small to keep everything: later prompts evict earlier ones'
// blocks (least recently released first), and whatever a prompt finds
// cached, its tokens stay those of gpu::generate.
TEST_F(ActorTest, EvictionUnderAFullPoolNeverGivesARequestWrongKv) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.pool_blocks = 24;  // 384 positions: about two of the prompts below and their answers
  options.config.prefill_cache_blocks = 0;  // (the prefill worker's cache would hold them all)
  start(std::move(options));
  std::vector<std::vector<int32_t>> prompts;
  for (int k = 0; k < 4; ++k) prompts.push_back(prompt_of(150, 10 + k));
  const double evicted_before = metrics::disagg_metrics().decode_prefix_cache_evictions.value();
  int misses = 0;
  for (int round = 0; round < 3; ++round)
    for (size_t k = 0; k < prompts.size(); ++k) {
      // Prompts that share a prefix with the previous one, and fresh ones.
      std::vector<int32_t> p = prompts[k];
      if (round == 2) p.resize(120);
      const RequestOutcome out = generate(*client_, p, 12);
      ASSERT_TRUE(out.ok()) << out.message;
      EXPECT_EQ(out.tokens, colocated(p, 12).tokens) << "round " << round << ", prompt " << k;
      misses += out.timings.cached_tokens == 0;
    }
  // 4 prompts of ~10 blocks through 24 blocks: the cache cannot hold them
  // all (misses after the first round), and the one just used is still there
  // for the next request of the same prompt.
  EXPECT_GT(misses, 4) << "nothing was evicted";
  // ... and the pool says so (disagg_prefix_cache_evictions_total{role="decode"}):
  // at least the first block of each prompt that missed after the first round.
  EXPECT_GE(metrics::disagg_metrics().decode_prefix_cache_evictions.value() - evicted_before, misses - 4)
      << "evictions not counted";
  const RequestOutcome again = generate(*client_, prompts[3], 12);
  ASSERT_TRUE(again.ok());
  EXPECT_GT(again.timings.cached_tokens, 0) << "the most recent prompt was evicted first";
  EXPECT_EQ(again.tokens, colocated(prompts[3], 12).tokens);
}

// The prefill worker's own prefix cache (engine/prefix_cache.h): a prompt
// that starts with one it computed before computes only the rest there, and
// streams what the decode worker lacks, cached positions included.
struct PrefillWorkerCounts {
  double computed = metrics::disagg_metrics().prefill_tokens.value();
  double hits = metrics::disagg_metrics().prefill_prefix_cache_hits.value();
  double queries = metrics::disagg_metrics().prefill_prefix_cache_queries.value();
  PrefillWorkerCounts since(const PrefillWorkerCounts& before) const {
    return {computed - before.computed, hits - before.hits, queries - before.queries};
  }
};

TEST_F(ActorTest, APrefillWorkerComputesOnlyWhatItsOwnCacheLacks) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.local_prefill_tokens = 0;  // every prompt to the prefill worker
  options.config.pool_blocks = 24;  // the decode worker keeps little: 384 positions
  start(std::move(options));
  const std::vector<int32_t> a = prompt_of(300, 21);
  std::vector<int32_t> b(a.begin(), a.begin() + 288);  // a's 18 full blocks, then 60 new tokens
  const std::vector<int32_t> tail = prompt_of(61, 22);
  b.insert(b.end(), tail.begin() + 1, tail.end());

  PrefillWorkerCounts before;
  ASSERT_TRUE(generate(*client_, a, 4).ok());
  EXPECT_EQ(PrefillWorkerCounts().since(before).computed, 300);
  // Another prompt of 22 blocks evicts nearly all of a from the decode
  // worker's 24 (not from the prefill worker's 1024).
  ASSERT_TRUE(generate(*client_, prompt_of(350, 23), 4).ok());

  before = PrefillWorkerCounts();
  const RequestOutcome two = generate(*client_, b, 12);
  ASSERT_TRUE(two.ok()) << two.message;
  EXPECT_EQ(two.tokens, colocated(b, 12).tokens) << "the prefill worker's cached KV gave other tokens";
  const PrefillWorkerCounts counts = PrefillWorkerCounts().since(before);
  EXPECT_EQ(counts.queries, 348);
  EXPECT_EQ(counts.hits, 288) << "a's 18 blocks";
  EXPECT_EQ(counts.computed, 60) << "only the new tokens are computed";
  EXPECT_EQ(two.timings.cached_tokens, 288);
  // The decode worker lost most of a's blocks: the positions it lacks were
  // sent, cached ones included.
  EXPECT_GT(two.timings.kv_bytes, stream_bytes_for(348) - stream_bytes_for(288));

  // The same prompt under another salt: nothing cached, all computed.
  before = PrefillWorkerCounts();
  const RequestOutcome salted = generate(*client_, b, 12, {}, "tenant-b");
  ASSERT_TRUE(salted.ok()) << salted.message;
  EXPECT_EQ(PrefillWorkerCounts().since(before).computed, 348);
  EXPECT_EQ(salted.tokens, two.tokens);
}

TEST_F(ActorTest, WithoutAPrefillCacheThePrefillWorkerComputesEverything) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.local_prefill_tokens = 0;
  options.config.prefill_cache_blocks = 0;
  start(std::move(options));
  const std::vector<int32_t> a = prompt_of(200, 24);
  ASSERT_TRUE(generate(*client_, a, 4).ok());
  std::vector<int32_t> b = a;
  b.push_back(7);
  const PrefillWorkerCounts before;
  const RequestOutcome two = generate(*client_, b, 4);
  ASSERT_TRUE(two.ok()) << two.message;
  EXPECT_EQ(PrefillWorkerCounts().since(before).computed, 201);
  EXPECT_EQ(PrefillWorkerCounts().since(before).hits, 0);
  EXPECT_EQ(two.tokens, colocated(b, 4).tokens);
}

}  // namespace
}  // namespace disagg::test

namespace disagg::test {
namespace {

// KV-aware routing: with two decode workers, the requests of a group that
// shares a 96-token prefix go to the worker whose prefix cache holds it (the
// router's index of the workers' KV events), and the groups spread over
// both workers. Without the index (weight 0) equal free blocks leave it to
// round robin, which with three groups moves each group between workers.
int requests_on_their_groups_worker(Client& client, std::map<std::string, int>* per_worker,
                                    std::string RequestOutcome::*worker = &RequestOutcome::decode_worker) {
  std::map<int, std::string> home;  // group -> the worker of its first request
  int on_home = 0;
  for (int round = 0; round < 4; ++round)
    for (int g = 0; g < 3; ++g) {
      std::vector<int32_t> p = prompt_of(96, 100 + g);
      const std::vector<int32_t> suffix = prompt_of(20, 1000 + 10 * round + g);
      p.insert(p.end(), suffix.begin() + 1, suffix.end());
      const RequestOutcome out = generate(client, p, 4);
      EXPECT_TRUE(out.ok()) << out.message;
      EXPECT_EQ(out.tokens, colocated(p, 4).tokens);
      (*per_worker)[out.*worker] += 1;
      if (round == 0) home[g] = out.*worker;
      else on_home += out.*worker == home[g];
    }
  return on_home;
}

TEST_F(ActorTest, RequestsGoToTheDecodeWorkerThatHoldsTheirPrefix) {
  start(1, 2);
  std::map<std::string, int> per_worker;
  const int on_home = requests_on_their_groups_worker(*client_, &per_worker);
  EXPECT_EQ(on_home, 9) << "of the 9 requests after each group's first";
  EXPECT_EQ(per_worker.size(), 2u) << "the groups did not spread over both workers";
}

// Two requests of a group sent together, before the first one's KV is in
// anywhere: the router counts the first one's blocks as on their way to its
// decode worker (PrefixIndex::predict), so the second follows it there
// (without, the first's reservation makes the other worker the emptier).
// (A third would go to the other worker: two reservations of 8 blocks
// outweigh 2 x 6 shared blocks, kv-routing-prefill-weight's trade.)
TEST_F(ActorTest, AGroupsConcurrentRequestsFollowItsFirstToOneDecodeWorker) {
  start(1, 2);
  std::vector<std::future<RequestOutcome>> outcomes;
  std::vector<std::vector<int32_t>> prompts;
  for (int k = 0; k < 2; ++k) {
    std::vector<int32_t> p = prompt_of(96, 300);  // the group's 6 blocks
    const std::vector<int32_t> suffix = prompt_of(20, 310 + k);
    p.insert(p.end(), suffix.begin() + 1, suffix.end());
    prompts.push_back(p);
    auto done = std::make_shared<std::promise<RequestOutcome>>();
    outcomes.push_back(done->get_future());
    client_->submit_async(make_request(p, 4), {}, [done](RequestOutcome out) { done->set_value(std::move(out)); });
  }
  std::set<std::string> workers;
  for (size_t k = 0; k < outcomes.size(); ++k) {
    const RequestOutcome out = outcomes[k].get();
    ASSERT_TRUE(out.ok()) << out.message;
    EXPECT_EQ(out.tokens, colocated(prompts[k], 4).tokens);
    workers.insert(out.decode_worker);
  }
  EXPECT_EQ(workers.size(), 1u) << "the group's requests scattered over the decode workers";
}

TEST_F(ActorTest, WithoutKvAwareRoutingAGroupsRequestsMoveBetweenWorkers) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 2);
  options.config.kv_routing_prefill_weight = 0;
  start(std::move(options));
  std::map<std::string, int> per_worker;
  EXPECT_LT(requests_on_their_groups_worker(*client_, &per_worker), 9);
}

// The same for prefill workers (their own prefix caches' events), when the
// rests go to them: each group's later requests go to the prefill worker that
// computed its first, and compute only their suffixes there.
TEST_F(ActorTest, RequestsGoToThePrefillWorkerThatHoldsTheirPrefix) {
  LocalClusterOptions options;
  options.config = shared_model_config(2, 1);
  options.config.local_prefill_tokens = 0;
  start(std::move(options));
  std::map<std::string, int> per_worker;
  const PrefillWorkerCounts before;
  EXPECT_EQ(requests_on_their_groups_worker(*client_, &per_worker, &RequestOutcome::prefill_worker), 9);
  EXPECT_EQ(per_worker.size(), 2u) << "the groups did not spread over both prefill workers";
  EXPECT_EQ(PrefillWorkerCounts().since(before).hits, 9 * 96) << "each later request found its group's 6 blocks";
}

TEST_F(ActorTest, WithoutKvAwareRoutingAGroupsRequestsMoveBetweenPrefillWorkers) {
  LocalClusterOptions options;
  options.config = shared_model_config(2, 1);
  options.config.local_prefill_tokens = 0;
  options.config.kv_routing_prefill_weight = 0;
  start(std::move(options));
  std::map<std::string, int> per_worker;
  EXPECT_LT(requests_on_their_groups_worker(*client_, &per_worker, &RequestOutcome::prefill_worker), 9);
}

// A decode worker that dies takes its cached blocks with it: the router
// forgets them with the worker, and the same prompt, on the survivor, is
// computed whole (nothing cached) and gives the same tokens.
TEST_F(ActorTest, ALostDecodeWorkersCachedBlocksAreForgotten) {
  start(1, 2);
  expect_pools_free_ = false;  // one pool dies with its worker
  const std::vector<int32_t> p = prompt_of(120, 7);
  const RequestOutcome first = generate(*client_, p, 6);
  ASSERT_TRUE(first.ok()) << first.message;
  const RequestOutcome hit = generate(*client_, p, 6);
  ASSERT_TRUE(hit.ok()) << hit.message;
  ASSERT_EQ(hit.decode_worker, first.decode_worker) << "the router did not send the prompt back to its blocks";
  ASSERT_GT(hit.timings.cached_tokens, 0);
  const size_t holder = first.decode_worker == "decode-0" ? 0 : 1;  // (LocalCluster's names, in order)
  caf::anon_send_exit(cluster_->decode_workers().at(holder), caf::exit_reason::kill);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (;;) {  // until the router has seen it go (it monitors its workers)
    const auto status = client_->status();
    if (status && status->count(WorkerRole::decode) == 1) break;
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the router never saw the worker go";
    std::this_thread::yield();
  }
  const RequestOutcome after = generate(*client_, p, 6);
  ASSERT_TRUE(after.ok()) << after.message;
  EXPECT_NE(after.decode_worker, first.decode_worker);
  // Nothing of it was on the survivor: all its KV was sent (the prefill
  // worker's own cache may have spared it the compute).
  EXPECT_EQ(after.timings.kv_bytes, stream_bytes_for(int(p.size())));
  EXPECT_EQ(after.tokens, first.tokens);
}

// A job whose KV target no stream plan fits (a first position at or past
// the prompt's end, a block size that is no whole number of tiles) is refused
// with invalid_request, and the prefill worker goes on serving.
TEST_F(ActorTest, APrefillJobWithAnImpossibleTargetIsRefusedAndTheWorkerServesOn) {
  start(1, 1);
  caf::scoped_actor self{*system_};
  const std::vector<int32_t> p = prompt_of(40, 9);
  for (const auto& [first_position, block_size] : {std::pair<int, int>{48, 16}, {16, 16}, {0, 20}}) {
    PrefillJob job;
    job.id = 777000 + RequestId(first_position + block_size);
    job.prompt_tokens = first_position == 16 ? std::vector<int32_t>(p.begin(), p.begin() + 16) : p;
    job.max_new_tokens = 1;
    job.deadline_ms = 10000;
    job.target = KvTarget{12345, 0, "127.0.0.1:1", block_size, {}, first_position};
    PrefillReport report;
    self->request(cluster_->prefill_workers().at(0), std::chrono::seconds(10), prefill_atom::value, job,
                  cluster_->decode_workers().at(0))
        .receive([&](PrefillReport& r) { report = std::move(r); },
                 [&](caf::error& e) { ADD_FAILURE() << system_->render(e); });
    EXPECT_EQ(report.code, ErrorCode::invalid_request) << report.message;
  }
  const RequestOutcome out = generate(*client_, p, 4);
  ASSERT_TRUE(out.ok()) << out.message;
  EXPECT_EQ(out.tokens, colocated(p, 4).tokens);
}

// A decode worker's own prefill runs a job only into a local reservation of
// its own, as that worker planned it: a job for no reservation here, of
// another attempt or with another target is refused, and one whose target
// claims the positions the prefix cache shares writes only the reserved ones
// (it wrote the shared blocks, which another request's cached prompt then
// decoded over).
TEST_F(ActorTest, ADecodeWorkersOwnPrefillTakesOnlyItsReservationsPlan) {
  start(with_local_prefill(1 << 20));
  const std::vector<int32_t> cached = prompt_of(70, 3);
  ASSERT_TRUE(generate(*client_, cached, 8).ok());
  const decode_actor worker = cluster_->decode_workers().at(0);
  caf::scoped_actor self{*system_};
  std::vector<int32_t> longer = cached;
  for (int t : {11, 12, 13, 14, 15}) longer.push_back(t);
  KvReservation r{0x10CA1, 96, 60000, int32_t(longer.size()), {}, longer, {}, 1 << 20, {}, 0};
  ReserveReply reply;
  self->request(worker, std::chrono::seconds(5), reserve_atom::value, r)
      .receive([&](ReserveReply& got) { reply = std::move(got); }, [&](caf::error& e) { FAIL() << system_->render(e); });
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  ASSERT_TRUE(reply.target.local());
  ASSERT_GT(reply.target.first_position, 0) << "precondition: the prompt's first blocks are shared from the cache";
  auto run = [&](PrefillJob job) {
    PrefillReport report;
    report.code = ErrorCode::internal;
    self->request(worker, std::chrono::seconds(30), prefill_atom::value, std::move(job))
        .receive([&](PrefillReport& got) { report = std::move(got); },
                 [&](caf::error& e) { report.message = system_->render(e); });
    return report;
  };
  PrefillJob job;
  job.id = r.id;
  job.prompt_tokens = prompt_of(int(longer.size()), 4);  // (another prompt: its KV differs everywhere)
  job.max_new_tokens = 4;
  job.deadline_ms = 20000;
  job.target = reply.target;
  PrefillJob unknown = job;
  unknown.id = 0x10CA2;
  const PrefillReport no_reservation = run(unknown);
  EXPECT_EQ(no_reservation.code, ErrorCode::timeout) << no_reservation.message;
  PrefillJob other_attempt = job;
  other_attempt.attempt = 7;
  const PrefillReport late = run(other_attempt);  // (refused before any compute, not at its commit)
  EXPECT_EQ(late.code, ErrorCode::cancelled) << late.message;
  EXPECT_NE(late.message.find("a prefill of attempt 7"), std::string::npos) << late.message;
  PrefillJob other_target = job;
  other_target.target.transfer_id ^= 1;
  const PrefillReport stray = run(other_target);
  EXPECT_EQ(stray.code, ErrorCode::invalid_request) << stray.message;
  EXPECT_NE(stray.message.find("not the local one reserved here"), std::string::npos) << stray.message;
  job.target.first_position = 0;
  run(job);  // (its commit is refused: another prompt than the reserved one)
  self->send(worker, cancel_atom::value, r.id);
  const RequestOutcome again = generate(*client_, cached, 8);
  ASSERT_TRUE(again.ok()) << again.message;
  EXPECT_GT(again.timings.cached_tokens, 0);
  EXPECT_EQ(again.tokens, colocated(cached, 8).tokens) << "the shared blocks were written";
}

}  // namespace
}  // namespace disagg::test
