// Every way a request can fail ends in exactly one terminal reply with the
// right code, and leaves no KV blocks behind (ActorTest::TearDown checks).
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <functional>
#include <limits>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <vector>

#include "actors/actor_fixture.h"
#include "actors/compute.h"
#include "actors/decode.h"
#include "actors/router.h"
#include "caf/all.hpp"
#include "caf/default_attachable.hpp"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "metrics/disagg_metrics.h"
#include "grammar/json_grammar.h"
#include "kv/transfer.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

// The cap on the KV a prefill worker ships: a streamed KV is refused before
// any compute (its size follows from the prompt), one message once computed.
class KvCapTest : public ActorTest {
 protected:
  void expect_kv_cap(const std::string& transport, size_t cap, size_t large_bytes);
};

void KvCapTest::expect_kv_cap(const std::string& transport, size_t cap, size_t large_bytes) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.kv_transport = transport;
  options.config.max_kv_transfer_bytes = int64_t(cap);
  start(std::move(options));

  const RequestOutcome small = client_->generate(make_request(kOnceUponATime, 8));
  EXPECT_TRUE(small.ok()) << small.message;

  const RequestOutcome large = client_->generate(make_request(kTomHadARedBall, 8));
  EXPECT_EQ(large.code, ErrorCode::kv_too_large) << large.message;
  EXPECT_NE(large.message.find(std::to_string(large_bytes)), std::string::npos) << large.message;
  EXPECT_TRUE(large.tokens.empty());

  // The worker is still fine afterwards.
  EXPECT_TRUE(client_->generate(make_request(kOnceUponATime, 8)).ok());
}

TEST_F(KvCapTest, KvLargerThanTheCapIsRejectedWithoutHanging) {
  expect_kv_cap("message", kv_bytes_for(10), kv_bytes_for(29));
}

TEST_F(KvCapTest, StreamedKvLargerThanTheCapIsRejectedBeforeItsPrefill) {
  const int64_t computed_before = prefill_counts().computed;
  expect_kv_cap("tcp", stream_bytes_for(16), stream_bytes_for(29));
  EXPECT_EQ(prefill_counts().computed - computed_before, 2) << "only the two small prompts ran";
}

// A decode worker spawned into a running cluster, on `model`, named `name`;
// returns why it stopped (the router refused it), or an empty string when it
// was still running after 10 s.
std::string refusal_of_extra_decode_worker(caf::actor_system& system, LocalCluster& cluster, const std::string& model,
                                          const std::string& name) {
  ComputeSpec spec;
  spec.checkpoint = gpu::Checkpoint::open(model);
  spec.pool_block_size = 16;
  spec.pool_blocks = 64;
  auto compute = spawn_compute(system, spec);
  auto worker = spawn_decode(system, shared_model_config(1, 1), compute, cluster.router(), name);
  caf::scoped_actor self{system};
  self->monitor(worker);
  std::string why;
  self->receive([&](caf::down_msg& down) { why = system.render(down.reason); },
                caf::after(std::chrono::seconds(10)) >> [&] {
                  caf::anon_send_exit(worker, caf::exit_reason::user_shutdown);
                });
  return why;
}

// A router node without disagg.model used to accept workers of any model
// (issue 22). Now its first worker's model is the cluster's: a second worker
// with other weights is refused as by a router that loaded the model.
TEST_F(ActorTest, ARouterWithoutAModelTakesItsFirstWorkersAndRefusesOthers) {
  const auto dir = make_temp_dir("actors-first-model");
  const std::string other = dir + "/other.bin";
  gpu::write_random_checkpoint(other, gpu::Checkpoint::open(shared_model())->config(), 7);
  const DisaggConfig config = shared_model_config(1, 1);
  const router_actor router = spawn_router(*system_, config, nullptr);
  auto spawn_worker = [&](const std::string& model, const std::string& name) {
    ComputeSpec spec;
    spec.checkpoint = gpu::Checkpoint::open(model);
    spec.pool_block_size = 16;
    spec.pool_blocks = 64;
    return spawn_decode(*system_, config, spawn_compute(*system_, spec), router, name);
  };
  const decode_actor first = spawn_worker(shared_model(), "first");
  caf::scoped_actor self{*system_};
  int decode_workers = 0;  // registered: the router's status says so
  for (const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       decode_workers == 0 && std::chrono::steady_clock::now() < deadline;)
    self->request(router, std::chrono::seconds(5), status_atom::value)
        .receive([&](const RouterStatus& s) { decode_workers = s.count(WorkerRole::decode); }, [](caf::error&) {});
  ASSERT_EQ(decode_workers, 1);
  const decode_actor second = spawn_worker(other, "second");
  self->monitor(second);
  std::string why;
  self->receive([&](caf::down_msg& down) { why = system_->render(down.reason); },
                caf::after(std::chrono::seconds(10)) >> [&] { caf::anon_send_exit(second, caf::exit_reason::user_shutdown); });
  EXPECT_NE(why.find("is not the cluster's (fingerprint " +
                     std::to_string(gpu::Checkpoint::open(shared_model())->fingerprint())),
            std::string::npos)
      << why;
  for (const auto& actor : {caf::actor_cast<caf::actor>(first), caf::actor_cast<caf::actor>(router)})
    caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
  std::filesystem::remove_all(dir);
}

TEST_F(ActorTest, DecodeWorkerWithAnotherModelIsRefusedAtRegistration) {
  const auto dir = make_temp_dir("actors-incompatible");
  const std::string other = dir + "/other.bin";
  gpu::write_random_checkpoint(other, gpu::Checkpoint::open(shared_model())->config(), 7);
  ASSERT_NE(gpu::Checkpoint::open(other)->fingerprint(), gpu::Checkpoint::open(shared_model())->fingerprint());
  start(1, 1);
  const std::string why = refusal_of_extra_decode_worker(*system_, *cluster_, other, "stranger");
  EXPECT_NE(why.find("refused"), std::string::npos) << why;
  EXPECT_NE(why.find("is not the cluster's"), std::string::npos) << why;
  // It never joined: requests go to the cluster's own decode worker.
  EXPECT_EQ(client_->status()->count(WorkerRole::decode), 1);
  const RequestOutcome out = client_->generate(make_request(kOnceUponATime, 8));
  EXPECT_TRUE(out.ok()) << out.message;
  EXPECT_EQ(out.tokens, colocated(kOnceUponATime, 8).tokens);
  std::filesystem::remove_all(dir);
}

TEST_F(ActorTest, ASecondWorkerWithATakenNameIsRefused) {
  start(1, 1);
  const std::string why = refusal_of_extra_decode_worker(*system_, *cluster_, shared_model(), "decode-0");
  EXPECT_NE(why.find("is taken by another worker"), std::string::npos) << why;
  EXPECT_EQ(client_->status()->count(WorkerRole::decode), 1);
}

TEST_F(ActorTest, CancelMidGenerationStopsItAndFreesItsBlocks) {
  start(1, 1);
  const int max_new = 300;  // greedy output reaches BOS only after 341 tokens
  ASSERT_EQ(colocated(kOnceUponATime, max_new).tokens.size(), size_t(max_new))
      << "precondition: the prompt must not reach BOS before max_new_tokens";
  auto request = make_request(kOnceUponATime, max_new);
  request.id = client_->next_id();
  std::atomic<int> seen{0};
  Client* client = client_.get();
  const RequestId id = request.id;
  const double decoded_before = metrics::disagg_metrics().decode_tokens.value();
  auto future = client_->submit(request, [&seen, client, id](const TokenEvent&) {
    if (seen++ == 2) client->cancel(id);
  });
  const RequestOutcome out = future.get();
  EXPECT_EQ(out.code, ErrorCode::cancelled) << out.message;
  EXPECT_LT(seen.load(), max_new);
  // The cancelled request's blocks come back (TearDown checks all pools too),
  // also in the router's books: it was cancelled while a decode step ran, so
  // the blocks are freed after that step, and the decode worker must say so.
  EXPECT_TRUE(cluster_->wait_pools_free());
  // ... because the decode worker was told: left alone it would have gone on
  // to all 300 tokens (and freed the blocks then, tens of ms later).
  const double decoded = metrics::disagg_metrics().decode_tokens.value() - decoded_before;
  EXPECT_LT(decoded, max_new / 2) << "the decode worker made " << decoded << " tokens of a request cancelled at its 3rd";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  int router_free = -1, total = -1;
  while (router_free != total && std::chrono::steady_clock::now() < deadline) {
    if (const auto status = client_->status())
      for (const auto& w : status->workers)
        if (w.role == WorkerRole::decode) std::tie(router_free, total) = std::make_pair(w.free_blocks, w.total_blocks);
    if (router_free != total) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(router_free, total) << "the router still counts the cancelled request's blocks";
  // Cancelling again, or an unknown id, changes nothing.
  client_->cancel(id);
  client_->cancel(12345);
  EXPECT_TRUE(client_->generate(make_request(kOnceUponATime, 4)).ok());
}

// A request speculating with a draft model, cancelled mid-generation: its
// draft KV goes with its blocks.
TEST_F(ActorTest, CancelMidGenerationDropsADraftModelsKv) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.speculation = "draft";
  options.config.draft_model = shared_model();
  start(options);
  auto draft_sequences = [] { return metrics::disagg_metrics().spec_decode_draft_sequences.value(); };
  const double before = draft_sequences();
  // Sampled, so that the greedy draft is often wrong and the request takes
  // many steps (the cancel comes long before its 300 tokens).
  Sampling sampling{1.0f, 1.0f, 5};
  sampling.stop.ignore_eos = true;
  auto request = make_request(kOnceUponATime, 300, sampling);
  request.id = client_->next_id();
  std::atomic<int> seen{0};
  std::atomic<double> drafts_seen{0};
  Client* client = client_.get();
  const RequestId id = request.id;
  auto future = client_->submit(request, [&, client, id](const TokenEvent&) {
    drafts_seen = std::max(drafts_seen.load(), draft_sequences() - before);
    if (seen++ == 12) client->cancel(id);
  });
  const RequestOutcome out = future.get();
  EXPECT_EQ(out.code, ErrorCode::cancelled) << out.message;
  EXPECT_GE(drafts_seen.load(), 1.0) << "precondition: the request had a draft";
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (draft_sequences() != before && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // (a poll: the condition decides, not the time)
  EXPECT_EQ(draft_sequences(), before) << "the cancelled request's draft KV was left behind";
}

TEST_F(ActorTest, FullAdmissionQueueAnswersOverloadedAtOnce) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.block_size = 16;
  options.config.pool_blocks = 32;    // one 405-position request (26 blocks) at a time
  options.config.queue_capacity = 1;  // and one waiting
  start(std::move(options));
  // Three at once (each client request is its own actor, so they may reach
  // the router in any order): one runs, one waits, one is turned away.
  std::vector<RequestId> ids;
  std::vector<std::future<RequestOutcome>> futures;
  for (int i = 0; i < 3; ++i) {
    auto request = make_request(kOnceUponATime, 400);
    request.id = client_->next_id();
    ids.push_back(request.id);
    futures.push_back(client_->submit(request));
  }
  // The rejected one is answered at once, while the others still hold the
  // pool and the queue: wait for it first, then cancel the rest.
  std::optional<size_t> rejected;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!rejected && std::chrono::steady_clock::now() < deadline)
    for (size_t i = 0; i < futures.size() && !rejected; ++i)
      if (futures[i].wait_for(std::chrono::milliseconds(1)) == std::future_status::ready) rejected = i;
  ASSERT_TRUE(rejected) << "no request was answered";
  const RequestOutcome turned_away = futures[*rejected].get();
  EXPECT_EQ(turned_away.code, ErrorCode::overloaded) << turned_away.message;
  EXPECT_NE(turned_away.message.find("queue"), std::string::npos) << turned_away.message;
  for (RequestId id : ids) client_->cancel(id);
  for (size_t i = 0; i < futures.size(); ++i) {
    if (i == *rejected) continue;
    const RequestOutcome out = futures[i].get();
    EXPECT_EQ(out.code, ErrorCode::cancelled) << to_string(out.code) << ": " << out.message;
  }
}

TEST_F(ActorTest, RequestNoDecodeWorkerCanHoldIsOverloaded) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.pool_blocks = 4;  // 64 positions
  start(std::move(options));
  const RequestOutcome out = client_->generate(make_request(kOnceUponATime, 100));
  EXPECT_EQ(out.code, ErrorCode::overloaded) << out.message;
  EXPECT_TRUE(client_->generate(make_request(kOnceUponATime, 20)).ok());
}

// The registration a worker of the test's sends: the cluster's model (it
// may join), its role from its handle's type.
template <class Handle>
WorkerInfo info_of(std::string name, int32_t total_blocks) {
  WorkerInfo info;
  info.role = std::is_same_v<Handle, decode_actor> ? WorkerRole::decode : WorkerRole::prefill;
  info.name = std::move(name);
  info.model = model_info(*gpu::Checkpoint::open(shared_model()));
  info.block_size = 16;
  info.total_blocks = total_blocks;
  return info;
}

// A worker of the test's joins `router` as any worker does (by message).
template <class Handle, class Self>
void join_as(Self self, const router_actor& router, std::string name, int32_t total_blocks = 0) {
  self->request(router, std::chrono::seconds(5), register_atom::value, info_of<Handle>(std::move(name), total_blocks),
                caf::actor_cast<Handle>(self))
      .then([](caf::ok_atom) {});
}

// A decode worker of the test's: it joins like any other (by message) with
// a pool of `total` blocks, `free` of them free (the router tries the
// roomiest first); its reservations and KV are answered by the script (a KV
// refused where it has none), and the rest idle.
struct DecodeScript {
  std::string name;
  int32_t free = 1024;
  int32_t total = 1024;
  std::function<caf::result<ReserveReply>(decode_actor::pointer, const KvReservation&)> reserve;
  std::function<caf::result<KvAck>(decode_actor::pointer, KvTransfer&)> kv;
  std::function<void(decode_actor::pointer)> on_status;  // before the load is answered
  DecodeLoad load() const { return DecodeLoad{free, total, 16, 0}; }
};

decode_actor::behavior_type scripted_decode(decode_actor::pointer self, router_actor router, DecodeScript script) {
  join_as<decode_actor>(self, router, script.name, script.total);
  return {
      [=](reserve_atom, const KvReservation& r) { return script.reserve(self, r); },
      [=](kv_atom, KvTransfer& t) -> caf::result<KvAck> {
        if (script.kv) return script.kv(self, t);
        return KvAck{t.id, ErrorCode::internal, "the test's", script.load()};
      },
      [](prefill_atom, PrefillJob& job) { return PrefillReport{job.id, ErrorCode::internal}; },
      [](cancel_atom, RequestId) {},
      [](router_atom, caf::actor_addr&) {},
      [](lease_atom, int64_t) {},
      [](landed_atom, RequestId, uint64_t, KvLanded&) {},
      [=](status_atom) {
        if (script.on_status) script.on_status(self);
        return script.load();
      },
      [](kv_events_atom) { return KvEvents{0, true, {}, {}}; },
  };
}

// A decode worker that never has room: it claims a huge pool, so the router
// tries it first. It counts the reservations and the KV transfers it is sent
// (with the receiver reserving first, there are none of the latter).
DecodeScript always_full(std::shared_ptr<std::atomic<int>> kv_sent, std::shared_ptr<std::atomic<int>> reservations) {
  DecodeScript script{"always-full", 0, 1 << 20, {}, {}, {}};
  const DecodeLoad load = script.load();
  script.reserve = [=](decode_actor::pointer, const KvReservation& r) -> caf::result<ReserveReply> {
    reservations->fetch_add(1);
    return ReserveReply{r.id, ErrorCode::overloaded, "always full", load};
  };
  script.kv = [=](decode_actor::pointer, KvTransfer& t) -> caf::result<KvAck> {
    kv_sent->fetch_add(1);
    return KvAck{t.id, ErrorCode::overloaded, "always full", load};
  };
  return script;
}

// The router's status, once `done` says it is what the test waits for (or
// the last one after 10 s).
RouterStatus status_when(Client& client, const std::function<bool(const RouterStatus&)>& done) {
  RouterStatus seen;
  for (const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       std::chrono::steady_clock::now() < deadline;) {
    if (auto status = client.status()) {
      seen = *status;
      if (done(seen)) break;
    }
  }
  return seen;
}

void wait_for_decode_workers(Client& client, int n) {
  const int seen = status_when(client, [n](const RouterStatus& s) { return s.count(WorkerRole::decode) == n; })
                       .count(WorkerRole::decode);
  ASSERT_EQ(seen, n) << "decode workers did not register";
}

TEST_F(ActorTest, DecodeWithoutRoomIsRetriedOnAnotherWorkerBeforeAnyPrefill) {
  start(1, 1);
  auto kv_sent = std::make_shared<std::atomic<int>>(0);
  auto full = system_->spawn(scripted_decode, cluster_->router(), always_full(kv_sent, std::make_shared<std::atomic<int>>(0)));
  wait_for_decode_workers(*client_, 2);
  const RequestOutcome out = client_->generate(make_request(kOnceUponATime, 8));
  EXPECT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.decode_worker, "decode-0");
  EXPECT_EQ(out.tokens, colocated(kOnceUponATime, 8).tokens);
  // The full worker refused the reservation, so no prompt was computed for it.
  EXPECT_EQ(kv_sent->load(), 0);
  caf::anon_send_exit(full, caf::exit_reason::user_shutdown);
}

// No room is not a failure: a refused reservation sends the request back to
// the queue, where it waits for room on any decode worker (it used to fail
// with overloaded once max-decode-retries were used up, here at once).
TEST_F(ActorTest, ARequestWithoutDecodeRoomWaitsForItInsteadOfFailing) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.pool_blocks = 24;  // 384 positions
  options.config.max_decode_retries = 0;
  start(std::move(options));
  auto first = client_->submit(make_request(kOnceUponATime, 300));  // 305 positions: 20 of the 24 blocks
  auto kv_sent = std::make_shared<std::atomic<int>>(0);
  auto reservations = std::make_shared<std::atomic<int>>(0);
  auto full = system_->spawn(scripted_decode, cluster_->router(), always_full(kv_sent, reservations));
  wait_for_decode_workers(*client_, 2);
  // 7 blocks: the full worker refuses, the real one has 4 free until the first ends.
  const RequestOutcome second = client_->generate(make_request(kOnceUponATime, 100));
  const RequestOutcome one = first.get();
  ASSERT_TRUE(one.ok()) << one.message;
  ASSERT_TRUE(second.ok()) << to_string(second.code) << ": " << second.message;
  EXPECT_EQ(second.decode_worker, "decode-0");
  EXPECT_EQ(second.tokens, colocated(kOnceUponATime, 100).tokens);
  EXPECT_EQ(kv_sent->load(), 0);
  // Its refusal's report (no block free) kept it out of the router's books
  // since: not asked again and again while the request waited.
  EXPECT_LE(reservations->load(), 2);
  caf::anon_send_exit(full, caf::exit_reason::user_shutdown);
}

// A cluster where requests wait: its one real decode worker too small for
// them (32 positions), and (spawn_full_worker) a scripted one that they fit
// and that refuses every reservation.
LocalClusterOptions waiting_room() {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.pool_blocks = 2;
  return options;
}

caf::actor spawn_full_worker(caf::actor_system& system, const router_actor& router, Client& client) {
  auto full = system.spawn(scripted_decode, router,
                           always_full(std::make_shared<std::atomic<int>>(0), std::make_shared<std::atomic<int>>(0)));
  wait_for_decode_workers(client, 2);
  return caf::actor_cast<caf::actor>(full);
}

// The router's timer messages (deadline_atom, heartbeat_atom) are its own:
// from anyone else, here deadline wake-ups at any time a request that waits
// for room may have, they end nothing (a wake-up ends only requests whose
// deadline has passed; when one named a request, any holder of the router's
// handle could end it) and start no timer chain.
TEST_F(ActorTest, TheRoutersTimerMessagesFromAnyoneElseAreIgnored) {
  start(waiting_room());
  auto full = spawn_full_worker(*system_, cluster_->router(), *client_);
  GenerateRequest request = make_request(kOnceUponATime, 100);
  request.id = 0x5EED;
  auto outcome = client_->submit(request);  // waits: the worker it fits refuses every reservation
  caf::scoped_actor outsider{*system_};
  RouterStatus status;
  for (int i = 0; i < 200 && status.queued == 0; ++i)
    outsider->request(cluster_->router(), std::chrono::seconds(5), status_atom::value)
        .receive([&](RouterStatus& s) { status = s; }, [](caf::error&) {});
  ASSERT_EQ(status.queued, 1);
  // (wake-ups at every time a deadline of this request's may have: any
  // passed deadline ends with any wake-up, so that one is the router's own)
  const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
  for (int64_t at = now - (int64_t{1} << 40); at < now + (int64_t{1} << 46); at += int64_t{1} << 40)
    outsider->send(cluster_->router(), deadline_atom::value, at);
  outsider->send(cluster_->router(), heartbeat_atom::value);
  // (One sender's messages arrive in order: this answer comes after them.)
  outsider->request(cluster_->router(), std::chrono::seconds(5), status_atom::value)
      .receive([&](RouterStatus& s) { status = s; }, [&](caf::error&) { status.queued = -1; });
  EXPECT_EQ(status.queued, 1);
  client_->cancel(request.id);
  const RequestOutcome out = outcome.get();
  EXPECT_EQ(out.code, ErrorCode::cancelled) << out.message;
  caf::anon_send_exit(full, caf::exit_reason::user_shutdown);
}

// A client actor that can say how many monitors an actor holds on it (in
// CAF 0.17 each monitor() adds one, kept until the watched actor ends).
class WatchedClient : public client_actor::base {
 public:
  explicit WatchedClient(caf::actor_config& cfg) : client_actor::base(cfg) {}
  behavior_type make_behavior() override {
    return {[](token_atom, TokenEvent&) {}};
  }
  size_t monitors_by(const caf::actor_addr& observer) {
    std::unique_lock<std::mutex> guard{mtx_};
    return detach_impl(caf::default_attachable::observe_token{observer, caf::default_attachable::monitor}, false,
                       true);  // (dry run: counts)
  }
};

// The router watches a request's client actor (a client gone cancels its
// requests) once, however many of its requests it holds, and no longer
// once the last has ended: a long-lived client (one actor submitting
// request after request) held a monitor for every request it ever made.
TEST_F(ActorTest, ARouterWatchesAClientActorOnceWhileItsRequestsAreHere) {
  start(waiting_room());
  auto full = spawn_full_worker(*system_, cluster_->router(), *client_);
  const client_actor client = system_->spawn<WatchedClient>();
  auto* watched = static_cast<WatchedClient*>(caf::actor_cast<caf::abstract_actor*>(client));
  const caf::actor_addr router = cluster_->router().address();
  caf::scoped_actor self{*system_};
  constexpr int kWaiting = 3;
  for (int i = 0; i < kWaiting; ++i) {  // (they wait: the worker they fit refuses every reservation)
    GenerateRequest request = make_request(kOnceUponATime, 100);
    request.id = 0x3A7C0 + RequestId(i);
    self->send(cluster_->router(), generate_atom::value, request, client);
  }
  RouterStatus status;
  for (int i = 0; i < 200 && status.queued < kWaiting; ++i)
    self->request(cluster_->router(), std::chrono::seconds(5), status_atom::value)
        .receive([&](RouterStatus& s) { status = s; }, [](caf::error&) {});
  ASSERT_EQ(status.queued, kWaiting);
  EXPECT_EQ(watched->monitors_by(router), 1u) << "one monitor a request";
  for (int i = 0; i < kWaiting; ++i) self->send(cluster_->router(), cancel_atom::value, 0x3A7C0 + RequestId(i));
  // (one sender's messages arrive in order: this answer comes after the cancels)
  self->request(cluster_->router(), std::chrono::seconds(5), status_atom::value)
      .receive([&](RouterStatus& s) { status = s; }, [&](caf::error&) { status.queued = -1; });
  EXPECT_EQ(status.queued, 0);
  EXPECT_EQ(watched->monitors_by(router), 0u) << "a monitor outlived the client's last request";
  caf::anon_send_exit(client, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(full, caf::exit_reason::user_shutdown);
}

// A decode worker's lease wake-up (lease_atom) ends only leases past their
// end, from whoever it comes, and arms no timer (actors/deadlines.h); its
// receiver's verdict (landed_atom) is its own: from a peer, for every
// serial, it ends no reservation (else any holder of the worker's handle
// could drop live reservations, their commits then refused, or free blocks a
// stream still writes into).
TEST_F(ActorTest, ADecodeWorkersLeaseMessagesFromAnyoneElseAreIgnored) {
  const DisaggConfig config = shared_model_config(1, 1);
  const router_actor router = spawn_router(*system_, config, nullptr);
  ComputeSpec spec;
  spec.checkpoint = gpu::Checkpoint::open(shared_model());
  spec.pool_block_size = 16;
  spec.pool_blocks = 64;
  const decode_actor worker = spawn_decode(*system_, config, spawn_compute(*system_, spec), router, "leased");
  const StopAll stop(worker, router);
  caf::scoped_actor outsider{*system_};
  int decode_workers = 0;  // registered: it takes reservations from then on
  for (const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
       decode_workers == 0 && std::chrono::steady_clock::now() < deadline;)
    outsider->request(router, std::chrono::seconds(5), status_atom::value)
        .receive([&](const RouterStatus& s) { decode_workers = s.count(WorkerRole::decode); }, [](caf::error&) {});
  ASSERT_EQ(decode_workers, 1);
  auto free_blocks = [&] {
    int32_t free = -1;
    outsider->request(worker, std::chrono::seconds(5), status_atom::value)
        .receive([&](const DecodeLoad& l) { free = l.free_blocks; }, [](caf::error&) {});
    return free;
  };
  const int32_t all = free_blocks();
  KvReservation r;
  r.id = 0x1EA5E;
  r.positions = 40;  // 3 blocks
  r.prompt_len = 8;
  r.lease_ms = 60000;
  std::string refused = "no answer";
  uint64_t transfer_id = 0;
  outsider->request(worker, std::chrono::seconds(5), reserve_atom::value, r)
      .receive(
          [&](const ReserveReply& reply) {
            refused = reply.code == ErrorCode::none ? "" : reply.message;
            transfer_id = reply.target.transfer_id;
          },
          [](caf::error&) {});
  ASSERT_EQ(refused, "");
  ASSERT_EQ(free_blocks(), all - 3);
  auto load = [&] {
    DecodeLoad l;
    l.leases = l.lease_wakeups = -1;
    outsider->request(worker, std::chrono::seconds(5), status_atom::value)
        .receive([&](const DecodeLoad& got) { l = got; }, [](caf::error&) {});
    return l;
  };
  const DecodeLoad leased = load();
  ASSERT_EQ(leased.leases, 1);
  const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
  const int64_t day = std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::hours(24)).count();
  for (const int64_t at : {int64_t{0}, now, now + day, std::numeric_limits<int64_t>::max()})
    outsider->send(worker, lease_atom::value, at);
  EXPECT_EQ(free_blocks(), all - 3) << "(one sender's messages arrive in order: the status comes after them)";
  EXPECT_EQ(load().leases, 1);
  EXPECT_EQ(load().lease_wakeups, leased.lease_wakeups) << "a forged wake-up armed a timer";
  for (uint64_t serial = 0; serial < 64; ++serial)
    outsider->send(worker, landed_atom::value, r.id, serial,
                   KvLanded{transfer_id, uint8_t(kv::TransferStatus::expired), 0, "the test's forged verdict"});
  EXPECT_EQ(free_blocks(), all - 3) << "a peer's verdict freed the blocks";
  outsider->send(worker, cancel_atom::value, r.id);
  EXPECT_EQ(free_blocks(), all);
}

// A decode worker of the test's that takes every reservation and, asked for
// its status by another than the router after its second reservation, first
// sends the router a token of the first attempt: a token its node's relay
// held back and delivered late (its answers go straight to the router).
DecodeScript late_token(router_actor router) {
  DecodeScript script{"late-token", 1000, 1024, {}, {}, {}};
  const DecodeLoad load = script.load();
  auto attempts = std::make_shared<std::vector<uint64_t>>();  // KvReservation::attempt of each
  auto id = std::make_shared<RequestId>(0);
  script.reserve = [=](decode_actor::pointer, const KvReservation& r) -> caf::result<ReserveReply> {
    attempts->push_back(r.attempt);
    *id = r.id;
    return ReserveReply{r.id, ErrorCode::none, {}, load};
  };
  auto sent = std::make_shared<bool>(false);
  script.on_status = [=](decode_actor::pointer self) {
    if (attempts->size() < 2 || *sent || self->current_sender() == caf::actor_cast<caf::strong_actor_ptr>(router))
      return;
    *sent = true;
    self->send(router, token_atom::value, TokenBatch{{TokenEvent{*id, 0, 7, {}, 0, {}, attempts->front()}}});
  };
  return script;
}

// A prefill worker of the test's: each job answered by its script.
using PrefillScript =
    std::function<caf::result<PrefillReport>(prefill_actor::pointer, const PrefillJob&, const decode_actor&)>;

prefill_actor::behavior_type scripted_prefill(prefill_actor::pointer self, router_actor router, std::string name,
                                              PrefillScript answer) {
  join_as<prefill_actor>(self, router, std::move(name));
  return {
      [=](prefill_atom, PrefillJob& job, decode_actor& decode) { return answer(self, job, decode); },
      [](cancel_atom, RequestId) {},
      [](router_atom, caf::actor_addr&) {},
      [](status_atom) { return PrefillLoad{}; },
      [](kv_events_atom) { return KvEvents{0, true, {}, {}}; },
  };
}

// The first job's KV link breaks (the request starts over); later jobs fail
// once their decode worker has answered a status (so what it sends the
// router before is there before the failure: one mailbox, in order).
PrefillScript link_breaks_then_fails() {
  auto jobs = std::make_shared<int>(0);
  return [jobs](prefill_actor::pointer self, const PrefillJob& job,
                const decode_actor& decode) -> caf::result<PrefillReport> {
    if (++*jobs == 1) return PrefillReport{job.id, ErrorCode::worker_lost, "KV stream: the test's broken link"};
    auto report = self->make_response_promise<PrefillReport>();
    const PrefillReport failed{job.id, ErrorCode::internal, "the test's prefill failure"};
    self->request(decode, std::chrono::seconds(5), status_atom::value)
        .then([=](const DecodeLoad&) mutable { report.deliver(failed); },
              [=](caf::error&) mutable { report.deliver(failed); });
    return report;
  };
}

// A restart that comes back to the same decode worker (the only one) while a
// token of its first attempt is still on the way: that token is no sign that
// the worker has the new attempt's KV, so the new attempt's prefill failure
// fails the request at once (taken for the new attempt's, the token had the
// router ignore that failure and wait for the deadline: tokens and done name
// their attempt).
TEST_F(ActorTest, ALateTokenOfAnEarlierAttemptOnTheSameWorkerIsIgnored) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  const router_actor router = spawn_router(*system_, config, nullptr);
  auto decode = system_->spawn(scripted_decode, router, late_token(router));
  auto prefill = system_->spawn(scripted_prefill, router, "failing-prefill", link_breaks_then_fails());
  Client client(*system_, router);
  const StopAll stop(decode, prefill, router);
  auto request = make_request(kOnceUponATime, 8);
  request.deadline_ms = 5000;
  const RequestOutcome out = client.generate(request);
  EXPECT_EQ(out.code, ErrorCode::internal) << to_string(out.code) << ": " << out.message;
  EXPECT_NE(out.message.find("the test's prefill failure"), std::string::npos) << out.message;
}

// A decode worker of the test's that the router tries first (a pool it
// claims to be huge) and that goes down right after it took a request's KV
// and streamed its first token, its ack to the prefill worker never sent (the
// prefill worker waits for it up to ack-timeout-ms, as for a node that died).
DecodeScript dies_after_its_first_token(router_actor router, std::shared_ptr<std::vector<caf::typed_response_promise<KvAck>>> acks) {
  DecodeScript script{"dying", 1 << 20, 1 << 20, {}, {}, {}};
  const DecodeLoad load = script.load();
  auto attempt = std::make_shared<uint64_t>(0);  // of the last reservation
  script.reserve = [=](decode_actor::pointer, const KvReservation& r) -> caf::result<ReserveReply> {
    *attempt = r.attempt;
    return ReserveReply{r.id, ErrorCode::none, {}, load};
  };
  script.kv = [=](decode_actor::pointer self, KvTransfer& t) -> caf::result<KvAck> {
    acks->push_back(self->make_response_promise<KvAck>());  // (never delivered)
    self->send(router, token_atom::value,
               TokenBatch{{TokenEvent{t.id, t.first_step, t.first_token, {}, 0, t.first_logprobs, *attempt}}});
    self->quit(caf::exit_reason::kill);
    return acks->back();
  };
  return script;
}

// The decode worker goes down after its first token while the prefill
// worker still waits for its ack: the request migrates, and its new job
// comes to the same prefill worker, which must have been told to drop the
// old one (it refused the new job as "already in prefill", and the request
// failed).
TEST_F(ActorTest, AMigrationBackToAPrefillWorkerStillWaitingForItsAckIsServed) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.ack_timeout_ms = 60000;  // (the old job's wait outlasts the test)
  start(std::move(options));
  auto acks = std::make_shared<std::vector<caf::typed_response_promise<KvAck>>>();
  auto dying = system_->spawn(scripted_decode, cluster_->router(), dies_after_its_first_token(cluster_->router(), acks));
  wait_for_decode_workers(*client_, 2);
  const RequestOutcome out = client_->generate(make_request(kOnceUponATime, 24));
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.decode_worker, "decode-0");
  EXPECT_EQ(out.tokens, colocated(kOnceUponATime, 24).tokens);
  caf::anon_send_exit(dying, caf::exit_reason::kill);
}

// A decode worker of the test's that never answers a reservation (it keeps
// the promises) and counts them.
DecodeScript silent(std::shared_ptr<std::vector<caf::typed_response_promise<ReserveReply>>> held,
                    std::shared_ptr<std::atomic<int>> reservations) {
  DecodeScript script{"silent", 1024, 1024, {}, {}, {}};
  script.reserve = [=](decode_actor::pointer self, const KvReservation&) -> caf::result<ReserveReply> {
    reservations->fetch_add(1);
    held->push_back(self->make_response_promise<ReserveReply>());
    return held->back();
  };
  return script;
}

// The only decode worker that could hold a request leaves its reservations
// unanswered: it is asked again within max-decode-retries (an unanswered
// reservation is no "no room"), and the request then fails with the
// reservation's timeout, not as if every worker had answered overloaded.
TEST_F(ActorTest, AnUnansweredReservationIsRetriedThenFailsWithItsTimeout) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  config.ack_timeout_ms = 300;  // the bound of a reservation's answer
  config.max_decode_retries = 1;
  const router_actor router = spawn_router(*system_, config, nullptr);
  auto held = std::make_shared<std::vector<caf::typed_response_promise<ReserveReply>>>();
  auto reservations = std::make_shared<std::atomic<int>>(0);
  auto decode = system_->spawn(scripted_decode, router, silent(held, reservations));
  auto prefill = system_->spawn(scripted_prefill, router, "failing-prefill", link_breaks_then_fails());
  Client client(*system_, router);
  const StopAll stop(decode, prefill, router);
  auto request = make_request(kOnceUponATime, 8);
  request.deadline_ms = 20000;
  const RequestOutcome out = client.generate(request);
  EXPECT_EQ(out.code, ErrorCode::timeout) << to_string(out.code) << ": " << out.message;
  EXPECT_NE(out.message.find("reservation"), std::string::npos) << out.message;
  EXPECT_EQ(reservations->load(), 2);
}

// Which decode worker took each reservation, in order (shared by the test's workers).
struct ReservationLog {
  std::mutex mutex;
  std::vector<std::string> workers;
  std::atomic<int> jobs{0};
};

// A decode worker of the test's that takes every reservation and logs it.
DecodeScript logging(std::string name, std::shared_ptr<ReservationLog> log) {
  DecodeScript script{name, 1024, 1024, {}, {}, {}};
  const DecodeLoad load = script.load();
  script.reserve = [=](decode_actor::pointer, const KvReservation& r) -> caf::result<ReserveReply> {
    std::lock_guard<std::mutex> lock(log->mutex);
    log->workers.push_back(name);
    return ReserveReply{r.id, ErrorCode::none, {}, load};
  };
  return script;
}

// The first job any worker sharing `log` gets takes its worker down with it;
// later ones fail.
PrefillScript first_job_kills(std::shared_ptr<ReservationLog> log) {
  return [log](prefill_actor::pointer self, const PrefillJob& job, const decode_actor&) -> caf::result<PrefillReport> {
    if (log->jobs.fetch_add(1) == 0) {
      self->quit(caf::exit_reason::kill);
      return caf::sec::request_receiver_down;
    }
    return PrefillReport{job.id, ErrorCode::internal, "the test's prefill failure"};
  };
}

// A prefill worker goes down under a request: it starts over, and its next
// attempt may go to the same decode worker (here the one its session keeps
// to), which did nothing wrong (it was avoided, as after a decode worker's
// failure).
TEST_F(ActorTest, ARestartAfterALostPrefillWorkerKeepsItsDecodeWorker) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  const router_actor router = spawn_router(*system_, config, nullptr);
  auto log = std::make_shared<ReservationLog>();
  std::vector<caf::actor> actors{caf::actor_cast<caf::actor>(router)};
  for (const char* name : {"decode-a", "decode-b"})
    actors.push_back(caf::actor_cast<caf::actor>(system_->spawn(scripted_decode, router, logging(name, log))));
  for (const char* name : {"prefill-a", "prefill-b"})
    actors.push_back(caf::actor_cast<caf::actor>(system_->spawn(scripted_prefill, router, name, first_job_kills(log))));
  StopAll stop;
  stop.actors = actors;
  Client client(*system_, router);
  status_when(client, [](const RouterStatus& s) { return s.workers.size() == 4; });
  auto request = make_request(kOnceUponATime, 8);
  request.session = "one user";
  request.deadline_ms = 10000;
  const RequestOutcome out = client.generate(request);
  EXPECT_EQ(out.code, ErrorCode::internal) << to_string(out.code) << ": " << out.message;
  std::lock_guard<std::mutex> lock(log->mutex);
  ASSERT_GE(log->workers.size(), 2u);
  for (const std::string& worker : log->workers) EXPECT_EQ(worker, log->workers[0]);
}

int32_t total_blocks_of(const RouterStatus& status, const std::string& name) {
  for (const auto& w : status.workers)
    if (w.name == name) return w.total_blocks;
  return -1;
}

// A worker registered again (its relay's retry) keeps the shape the
// router's books were made from: another pool size is refused (it was
// taken, the books kept, and with 0 blocks every request then failed "no
// decode worker can hold it"); the same registration again is taken.
TEST_F(ActorTest, ARegistrationAgainWithAnotherShapeIsRefused) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  const router_actor router = spawn_router(*system_, config, nullptr);
  auto decode = system_->spawn(scripted_decode, router, logging("reshaped", std::make_shared<ReservationLog>()));
  const StopAll stop(decode, router);
  Client client(*system_, router);
  ASSERT_EQ(total_blocks_of(status_when(client, [](const RouterStatus& s) { return s.count(WorkerRole::decode) == 1; }),
                            "reshaped"),
            1024);
  caf::scoped_actor outsider{*system_};
  auto register_again = [&](int32_t blocks) {
    std::string refused;
    outsider->request(router, std::chrono::seconds(5), register_atom::value, info_of<decode_actor>("reshaped", blocks),
                      decode)
        .receive([](caf::ok_atom) {}, [&](caf::error& e) { refused = system_->render(e); });
    return refused;
  };
  EXPECT_NE(register_again(0).find("registered before as another decode worker"), std::string::npos);
  EXPECT_EQ(total_blocks_of(*client.status(), "reshaped"), 1024);
  EXPECT_EQ(register_again(1024), "");
}

// A worker that some request named as its client (anyone may name any
// actor) is removed when it dies: with that request still waiting (and
// failed then: the router monitors it twice, as a worker and as a client,
// either down does both), or (`ended_first`) after its submitter cancelled
// it (the client's watch goes with its last request, the worker's stays:
// one demonitor ends them all in CAF 0.17, and the router then never heard
// of the worker's death).
void expect_a_worker_named_as_a_client_removed(caf::actor_system& system, bool ended_first) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  const router_actor router = spawn_router(system, config, nullptr);
  auto decode = system.spawn(scripted_decode, router, logging("named-client", std::make_shared<ReservationLog>()));
  const StopAll stop(router);
  Client client(system, router);
  ASSERT_EQ(status_when(client, [](const RouterStatus& s) { return s.count(WorkerRole::decode) == 1; })
                .count(WorkerRole::decode),
            1);
  caf::scoped_actor outsider{system};
  auto request = make_request(kOnceUponATime, 8);  // (no prefill worker: it waits)
  request.id = 0xC11E47;
  outsider->send(router, generate_atom::value, request, caf::actor_cast<client_actor>(decode));
  ASSERT_EQ(status_when(client, [](const RouterStatus& s) { return s.queued == 1; }).queued, 1);
  if (ended_first) {
    outsider->send(router, cancel_atom::value, request.id);  // (its submitter's)
    ASSERT_EQ(status_when(client, [](const RouterStatus& s) { return s.queued == 0; }).queued, 0);
  }
  caf::anon_send_exit(decode, caf::exit_reason::kill);
  const RouterStatus after = status_when(client, [](const RouterStatus& s) { return s.count(WorkerRole::decode) == 0; });
  EXPECT_EQ(after.count(WorkerRole::decode), 0) << "the router missed its worker's death";
  EXPECT_EQ(after.queued, 0);
}

TEST_F(ActorTest, AWorkerNamedAsARequestsClientIsRemovedWhenItDies) {
  expect_a_worker_named_as_a_client_removed(*system_, false);
}

TEST_F(ActorTest, AWorkerNamedAsAnEndedRequestsClientIsStillRemovedWhenItDies) {
  expect_a_worker_named_as_a_client_removed(*system_, true);
}

// A decode worker that streams past a request's allowance (max_tokens):
// the router passes on none of the extra tokens and keeps none of its
// done's (it forwarded them all, and the outcome had them).
DecodeScript streams_too_many(router_actor router) {
  DecodeScript script{"too-many", 1024, 1024, {}, {}, {}};
  const DecodeLoad load = script.load();
  auto held = std::make_shared<std::pair<RequestId, uint64_t>>(0, 0);  // the reservation's id and attempt
  script.reserve = [=](decode_actor::pointer, const KvReservation& r) -> caf::result<ReserveReply> {
    *held = {r.id, r.attempt};
    return ReserveReply{r.id, ErrorCode::none, {}, load};
  };
  script.on_status = [=](decode_actor::pointer self) {
    if (held->first == 0 || self->current_sender() == caf::actor_cast<caf::strong_actor_ptr>(router)) return;
    TokenBatch batch;
    for (int32_t i = 0; i < 6; ++i) batch.events.push_back(TokenEvent{held->first, i, 100 + i, {}, 0, {}, held->second});
    self->send(router, token_atom::value, std::move(batch));
    DecodeDone done;
    done.id = held->first;
    done.tokens = {100, 101, 102, 103, 104, 105};
    done.attempt = held->second;
    self->send(router, done_atom::value, std::move(done));
    held->first = 0;
  };
  return script;
}

// Its prefill: the report first, then a status asked of the decode worker
// (whose tokens so come after the report: one mailbox, in order).
PrefillScript reports_then_asks() {
  return [](prefill_actor::pointer self, const PrefillJob& job, const decode_actor& decode) -> caf::result<PrefillReport> {
    auto report = self->make_response_promise<PrefillReport>();
    report.deliver(PrefillReport{job.id, ErrorCode::none});
    self->request(decode, std::chrono::seconds(5), status_atom::value).then([](const DecodeLoad&) {}, [](caf::error&) {});
    return report;
  };
}

TEST_F(ActorTest, TokensPastTheRequestsAllowanceAreNotPassedOn) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  config.direct_token_streams = false;  // (the router passes the tokens on)
  const router_actor router = spawn_router(*system_, config, nullptr);
  auto decode = system_->spawn(scripted_decode, router, streams_too_many(router));
  auto prefill = system_->spawn(scripted_prefill, router, "reporting", reports_then_asks());
  Client client(*system_, router);
  const StopAll stop(decode, prefill, router);
  status_when(client, [](const RouterStatus& s) { return s.workers.size() == 2; });
  std::mutex mutex;
  std::vector<int32_t> events;
  const RequestOutcome out = client.generate(make_request(kOnceUponATime, 2), [&](const TokenEvent& e) {
    std::lock_guard<std::mutex> lock(mutex);
    events.push_back(e.index);
  });
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{100, 101}));
  std::lock_guard<std::mutex> lock(mutex);
  EXPECT_EQ(events, (std::vector<int32_t>{0, 1}));
}

// A prefill worker that never reports (the job's answer kept unsent, as by
// a node that hung after its KV went out); it asks its decode worker for a
// status, which then streams the request whole.
PrefillScript never_reports(std::shared_ptr<std::vector<caf::typed_response_promise<PrefillReport>>> held) {
  return [held](prefill_actor::pointer self, const PrefillJob&, const decode_actor& decode) -> caf::result<PrefillReport> {
    held->push_back(self->make_response_promise<PrefillReport>());
    self->request(decode, std::chrono::seconds(5), status_atom::value).then([](const DecodeLoad&) {}, [](caf::error&) {});
    return held->back();
  };
}

// The router stopped while a request's tokens are all out and only its
// prefill report is missing completes it with those tokens (as its deadline
// would), instead of failing a request its client already has whole.
TEST_F(ActorTest, ARouterThatStopsCompletesARequestWhoseTokensAreFinal) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  config.direct_token_streams = false;  // (the router passes the tokens on: the last one seen, its done is there)
  const router_actor router = spawn_router(*system_, config, nullptr);
  auto decode = system_->spawn(scripted_decode, router, streams_too_many(router));
  auto held = std::make_shared<std::vector<caf::typed_response_promise<PrefillReport>>>();
  auto prefill = system_->spawn(scripted_prefill, router, "never-reports", never_reports(held));
  Client client(*system_, router);
  const StopAll stop(decode, prefill, router);
  status_when(client, [](const RouterStatus& s) { return s.workers.size() == 2; });
  std::promise<void> last_token;
  auto request = make_request(kOnceUponATime, 6);
  request.deadline_ms = 60000;
  auto outcome = client.submit(request, [&](const TokenEvent& e) {
    if (e.index == 5) last_token.set_value();
  });
  ASSERT_EQ(last_token.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);  // (behind the done, in its mailbox)
  ASSERT_EQ(outcome.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const RequestOutcome out = outcome.get();
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{100, 101, 102, 103, 104, 105}));
}

// Further choices wait in a line of their own, not counted against
// queue-capacity one by one but bounded by it: kMaxChoices - 1 for each
// request it counts (a client naming first choices that are not there grew
// that line without bound).
TEST_F(ActorTest, FurtherChoicesWaitingAreBoundedByTheQueuesCapacity) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  config.queue_capacity = 1;
  const router_actor router = spawn_router(*system_, config, nullptr);  // (no workers: all of them wait)
  const StopAll stop(router);
  Client client(*system_, router);
  auto further_choice = [](RequestId id) {
    GenerateRequest r = make_request(kOnceUponATime, 8);
    r.id = id;
    r.first_choice = 0xF1257;
    r.deadline_ms = 20000;
    return r;
  };
  std::vector<std::future<RequestOutcome>> waiting;
  for (int i = 0; i < kMaxChoices - 1; ++i) waiting.push_back(client.submit(further_choice(0xC4010 + i)));
  ASSERT_EQ(status_when(client, [](const RouterStatus& s) { return s.queued == kMaxChoices - 1; }).queued,
            kMaxChoices - 1);
  const RequestOutcome refused = client.generate(further_choice(0xC4010 + kMaxChoices));
  EXPECT_EQ(refused.code, ErrorCode::overloaded) << refused.message;
  for (int i = 0; i < kMaxChoices - 1; ++i) client.cancel(0xC4010 + i);
  for (auto& w : waiting) EXPECT_EQ(w.get().code, ErrorCode::cancelled);
}

// A request is cancelled by its own client (or whoever submitted it) only:
// a cancel from anyone else holding the router's handle (an anonymous
// message, another actor: another frontend, a worker) is ignored.
TEST_F(ActorTest, OnlyARequestsClientOrSubmitterCancelsIt) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  const router_actor router = spawn_router(*system_, config, nullptr);  // (no workers: all of them wait)
  const StopAll stop(router);
  Client client(*system_, router);
  GenerateRequest request = make_request(kOnceUponATime, 8);
  request.id = 0xCA11;
  request.deadline_ms = 20000;
  auto waiting = client.submit(request);
  caf::scoped_actor submitter{*system_};  // a raw one, with no client actor
  GenerateRequest raw = request;
  raw.id = 0xCA12;
  auto raw_reply = submitter->request(router, std::chrono::seconds(30), generate_atom::value, raw, client_actor{});
  ASSERT_EQ(status_when(client, [](const RouterStatus& s) { return s.queued == 2; }).queued, 2);
  caf::scoped_actor outsider{*system_};
  for (RequestId id : {request.id, raw.id}) {
    caf::anon_send(router, cancel_atom::value, id);
    outsider->send(router, cancel_atom::value, id);
  }
  const auto after = client.status();  // (asked after the cancels: answered after them)
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->queued, 2) << "a cancel from another than the request's client ended it";
  client.cancel(request.id);
  EXPECT_EQ(waiting.get().code, ErrorCode::cancelled);
  EXPECT_EQ(client.in_flight(), 0u);
  submitter->send(router, cancel_atom::value, raw.id);
  RequestOutcome raw_outcome;
  std::move(raw_reply).receive([&](RequestOutcome& o) { raw_outcome = std::move(o); },
                               [&](caf::error& e) { ADD_FAILURE() << system_->render(e); });
  EXPECT_EQ(raw_outcome.code, ErrorCode::cancelled) << raw_outcome.message;
}

// The router asked to stop answers every request it holds, at once (a
// promise destroyed unanswered sends nothing in CAF 0.17: a requester that
// does not monitor the router waited out its own timeout).
TEST_F(ActorTest, ARouterThatStopsAnswersEveryRequestItHolds) {
  DisaggConfig config = shared_model_config(1, 1);
  config.heartbeat_interval_ms = 0;
  const router_actor router = spawn_router(*system_, config, nullptr);  // (no workers: it waits)
  Client client(*system_, router);
  caf::scoped_actor requester{*system_};
  auto request = make_request(kOnceUponATime, 8);
  request.id = 0x5709;
  auto reply = requester->request(router, std::chrono::seconds(30), generate_atom::value, request, client_actor{});
  ASSERT_EQ(status_when(client, [](const RouterStatus& s) { return s.queued == 1; }).queued, 1);
  const auto stopped = std::chrono::steady_clock::now();
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
  RequestOutcome out;
  std::move(reply).receive([&](RequestOutcome& o) { out = std::move(o); },
                           [&](caf::error& e) { out = make_failure(request.id, ErrorCode::internal, system_->render(e)); });
  EXPECT_EQ(out.code, ErrorCode::worker_lost) << out.message;
  EXPECT_LT(std::chrono::steady_clock::now() - stopped, std::chrono::seconds(10));
}

TEST_F(ActorTest, InvalidRequestsAreRejected) {
  start(1, 1);
  struct Case {
    const char* what;
    GenerateRequest request;
  };
  std::vector<Case> cases;
  cases.push_back({"empty prompt", make_request({}, 8)});
  cases.push_back({"out-of-vocabulary token", make_request({1, 403, 512}, 8)});
  cases.push_back({"negative token", make_request({1, -1}, 8)});
  cases.push_back({"prompt + max_new_tokens beyond seq_len", make_request(kOnceUponATime, 512 - 5 + 1)});
  cases.push_back({"max_new_tokens 0", make_request(kOnceUponATime, 0)});
  cases.push_back({"negative temperature", make_request(kOnceUponATime, 8, Sampling{-1.0f, 1.0f, 0})});
  cases.push_back({"top_p 0", make_request(kOnceUponATime, 8, Sampling{0.8f, 0.0f, 0})});
  GenerateRequest text;
  text.prompt_is_text = true;
  text.prompt_text = "Once upon a time";
  text.max_new_tokens = 8;
  cases.push_back({"text prompt without a tokenizer", text});
  for (const auto& c : cases) {
    const RequestOutcome out = client_->generate(c.request);
    EXPECT_EQ(out.code, ErrorCode::invalid_request) << c.what << ": " << to_string(out.code);
    EXPECT_FALSE(out.message.empty()) << c.what;
  }
  // The longest valid request is accepted.
  EXPECT_TRUE(client_->generate(make_request({1}, 511)).ok());
  const auto status = client_->status();
  ASSERT_TRUE(status);
  EXPECT_EQ(status->in_flight, 0);
  EXPECT_EQ(status->queued, 0);
}

TEST_F(ActorTest, DuplicateRequestIdIsRejectedWhileInFlight) {
  start(1, 1);
  auto request = make_request(kOnceUponATime, 300);
  request.id = client_->next_id();
  auto first = client_->submit(request);
  auto second = client_->submit(request);
  // Either may reach the router first; the other is the duplicate.
  const RequestOutcome a = first.get();
  const RequestOutcome b = second.get();
  EXPECT_TRUE((a.ok() && b.code == ErrorCode::invalid_request) ||
              (b.ok() && a.code == ErrorCode::invalid_request))
      << to_string(a.code) << " / " << to_string(b.code);
}

TEST_F(ActorTest, PassedDeadlineAnswersTimeout) {
  start(1, 1);
  auto request = make_request(kOnceUponATime, 400);
  request.deadline_ms = 5;
  const RequestOutcome out = client_->generate(request);
  EXPECT_EQ(out.code, ErrorCode::timeout) << out.message;
}

// The router's deadline timers (CAF 0.17's cannot be cancelled) are a few
// wake-ups, not one per request: requests with deadlines of about a day,
// each finished long before it (each one a second shorter than the last,
// so no earlier wake-up serves the next), leave a few pending, where a
// timer each stayed a day; and a short deadline after them ends its
// request as before.
TEST_F(ActorTest, RequestsWithLongDeadlinesLeaveAFewTimersNotOneEach) {
  start(1, 1);
  constexpr int kRequests = 150;
  for (int i = 0; i < kRequests; ++i) {
    auto request = make_request(kOnceUponATime, 1);
    request.deadline_ms = kMaxDeadlineMs - int64_t(i) * 1000;
    const RequestOutcome out = client_->generate(request);
    ASSERT_TRUE(out.ok()) << out.message;
  }
  caf::scoped_actor self{*system_};
  RouterStatus status;
  status.deadline_wakeups = -1;
  self->request(cluster_->router(), std::chrono::seconds(5), status_atom::value)
      .receive([&](RouterStatus& s) { status = s; }, [](caf::error&) {});
  EXPECT_GE(status.deadline_wakeups, 1);
  EXPECT_LE(status.deadline_wakeups, 4) << "of " << kRequests << " requests";
  // The decode worker's leases (each the request's deadline plus the ack
  // timeout) the same: none kept once filled, a few timers for them all.
  DecodeLoad load;
  load.leases = load.lease_wakeups = -1;
  self->request(cluster_->decode_workers().at(0), std::chrono::seconds(5), status_atom::value)
      .receive([&](DecodeLoad& l) { load = l; }, [](caf::error&) {});
  EXPECT_EQ(load.leases, 0) << "a filled reservation's lease was kept";
  EXPECT_GE(load.lease_wakeups, 1);
  EXPECT_LE(load.lease_wakeups, 4) << "of " << kRequests << " reservations";
  auto request = make_request(kOnceUponATime, 400);
  request.deadline_ms = 5;
  const RequestOutcome out = client_->generate(request);
  EXPECT_EQ(out.code, ErrorCode::timeout) << out.message;
}

// Kills whichever decode worker holds a sequence; returns how many it killed.
int kill_busy_decode_workers(caf::actor_system& system, LocalCluster& cluster) {
  int killed = 0;
  for (const auto& d : cluster.decode_workers()) {
    caf::scoped_actor self{system};
    self->request(d, std::chrono::seconds(5), status_atom::value)
        .receive(
            [&](DecodeLoad& load) {
              if (load.active_sequences > 0) {
                caf::anon_send_exit(d, caf::exit_reason::kill);
                ++killed;
              }
            },
            [](caf::error&) {});
  }
  return killed;
}

// A decode worker dies mid-generation: the request migrates to the other one
// (prefill of prompt + the tokens streamed so far, sampling from that step)
// and ends with exactly the colocated tokens; the client's stream has every
// index once, in order. Then the survivor still serves, and its pool is empty.
class MigrationTest : public ActorTest {
 protected:
  void expect_exact_migration(const Sampling& sampling, int max_new, int kill_after_tokens) {
    LocalClusterOptions options;
    options.config = shared_model_config(1, 2);
    if (!sampling.grammar.empty()) options.config.tokenizer = shared_tokenizer();  // (the vocabulary it constrains with)
    options.config.draft_model = draft_model_;
    start(options);
    expect_pools_free_ = false;  // one pool dies with its worker; the other is checked below
    // (shared with the token callback, which may outlive a failed test)
    struct Seen {
      std::promise<void> some_tokens;
      TokenLog log;
      std::atomic<int> count{0};
    };
    auto seen = std::make_shared<Seen>();
    TokenLog& log = seen->log;
    auto some_tokens = seen->some_tokens.get_future();
    auto future = client_->submit(make_request(kOnceUponATime, max_new, sampling), [seen, kill_after_tokens](const TokenEvent& e) {
      seen->log.callback()(e);
      if (++seen->count == kill_after_tokens) seen->some_tokens.set_value();
    });
    // Until the tokens came, or the request ended first (then the test fails
    // on its outcome rather than waiting forever), within a bound.
    for (const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
         some_tokens.wait_for(std::chrono::milliseconds(5)) != std::future_status::ready;) {
      if (future.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
        const RequestOutcome early = future.get();
        FAIL() << "the request ended before " << kill_after_tokens << " tokens: " << to_string(early.code) << ": "
               << early.message;
      }
      ASSERT_LT(std::chrono::steady_clock::now(), until) << "no " << kill_after_tokens << " tokens within 60 s";
    }
    // (Prefills of this process's workers: the first ran the prompt.)
    const double prefilled_before = metrics::disagg_metrics().prefill_tokens.value();
    ASSERT_EQ(kill_busy_decode_workers(*system_, *cluster_), 1);
    const RequestOutcome out = future.get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
    EXPECT_EQ(out.tokens, colocated(kOnceUponATime, max_new, sampling).tokens);
    // The new prefill continued: it ran the prompt and the tokens already
    // streamed (at least the ones the client had seen), not the prompt alone.
    EXPECT_GE(metrics::disagg_metrics().prefill_tokens.value() - prefilled_before,
              double(kOnceUponATime.size() + size_t(kill_after_tokens)))
        << "the migrated request was prefilled from scratch";
    {
      std::lock_guard<std::mutex> lock(log.mutex);
      ASSERT_EQ(log.events.size(), out.tokens.size()) << "a gap or a duplicate in the stream";
      for (size_t i = 0; i < log.events.size(); ++i) {
        EXPECT_EQ(log.events[i].index, int32_t(i));
        EXPECT_EQ(log.events[i].token, out.tokens[i]);
      }
    }
    const RequestOutcome next = client_->generate(make_request(kOnceUponATime, 8));
    EXPECT_TRUE(next.ok()) << next.message;
    const auto loads = cluster_->decode_loads(std::chrono::milliseconds(500));
    ASSERT_EQ(loads.size(), 1u);
    EXPECT_EQ(loads[0].free_blocks, loads[0].total_blocks);
  }
  std::string draft_model_;  // DisaggConfig::draft_model of the cluster
};

TEST_F(MigrationTest, ADecodeWorkerGoingDownMidGenerationMigratesItsRequestsExactly) {
  const int max_new = 300;
  ASSERT_EQ(colocated(kOnceUponATime, max_new).tokens.size(), size_t(max_new))
      << "precondition: the prompt must not reach BOS before max_new_tokens";
  expect_exact_migration(Sampling{}, max_new, 20);
}

TEST_F(MigrationTest, ASampledRequestMigratesExactlyToo) { expect_exact_migration(Sampling{0.9f, 0.9f, 77}, 200, 10); }

// The penalties read the request's earlier output, which the new prefill
// worker gets as the end of its prompt: the continuation is still exact.
TEST_F(MigrationTest, ARequestWithPenaltiesAndBiasesMigratesExactlyToo) {
  Sampling s{0.9f, 0.9f, 77};
  s.presence_penalty = 0.5f;
  s.frequency_penalty = 0.5f;
  s.repetition_penalty = 1.3f;
  s.logit_bias = {{400, 2.0f}};
  s.top_k = 40;
  s.stop.ignore_eos = true;  // (so it runs long enough to be migrated)
  expect_exact_migration(s, 200, 10);
}

// A grammar's place is found again from the output so far: the new prefill
// worker and decode worker mask the continuation as the first ones would.
TEST_F(MigrationTest, AConstrainedRequestMigratesExactlyToo) {
  Sampling s{0.9f, 0.9f, 77};
  s.grammar = grammar::json_object_grammar().to_json();
  s.stop.ignore_eos = true;  // (a finished object goes on with end tokens: it runs long enough to be migrated)
  expect_exact_migration(s, 200, 10);
}

// Speculation (engine/speculation.h) through a migration: the new decode
// worker guesses from the prompt and the output so far, and the tokens are
// still plain decoding's.
TEST_F(MigrationTest, ASpeculatingRequestMigratesExactlyToo) {
  Sampling s;
  s.speculation = {gpu::SpeculationMethod::ngram, 4, 1, 3};
  const double accepted_before = metrics::disagg_metrics().spec_decode_accepted_tokens.value();
  expect_exact_migration(s, 300, 20);
  EXPECT_GT(metrics::disagg_metrics().spec_decode_accepted_tokens.value(), accepted_before)
      << "no guess was accepted: nothing speculated";
}

// ... and with a draft model (the model itself): the new decode worker's
// draft starts from the prompt and the output so far; the dead one's draft
// KV went with it.
TEST_F(MigrationTest, ARequestSpeculatingWithADraftModelMigratesExactlyToo) {
  Sampling s;
  s.speculation = {gpu::SpeculationMethod::draft, 4, 0, 0};
  const double accepted_before = metrics::disagg_metrics().spec_decode_accepted_tokens.value();
  draft_model_ = shared_model();
  expect_exact_migration(s, 300, 20);
  EXPECT_GT(metrics::disagg_metrics().spec_decode_accepted_tokens.value(), accepted_before)
      << "no guess was accepted: nothing speculated";
}

// ... and under a grammar, whose place each guessed row's mask is found from.
TEST_F(MigrationTest, AConstrainedSpeculatingRequestMigratesExactlyToo) {
  Sampling s{0.9f, 0.9f, 77};
  s.grammar = grammar::json_object_grammar().to_json();
  s.stop.ignore_eos = true;
  s.speculation = {gpu::SpeculationMethod::ngram, 4, 1, 3};
  const double fed_before = metrics::disagg_metrics().spec_decode_draft_tokens.value();
  expect_exact_migration(s, 200, 10);
  EXPECT_GT(metrics::disagg_metrics().spec_decode_draft_tokens.value(), fed_before) << "no guess was fed";
}

// Past max-worker-retries a lost decode worker fails its request with worker_lost.
TEST_F(ActorTest, DecodeWorkerGoingDownPastTheRetriesFailsItsRequestsWithWorkerLost) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 2);
  options.config.max_worker_retries = 0;
  start(std::move(options));
  expect_pools_free_ = false;
  std::promise<void> first_token;
  std::atomic<bool> seen{false};
  auto future = client_->submit(make_request(kOnceUponATime, 300), [&](const TokenEvent&) {
    if (!seen.exchange(true)) first_token.set_value();
  });
  first_token.get_future().wait();
  ASSERT_EQ(kill_busy_decode_workers(*system_, *cluster_), 1);
  const RequestOutcome out = future.get();
  EXPECT_EQ(out.code, ErrorCode::worker_lost) << to_string(out.code) << ": " << out.message;
  const RequestOutcome next = client_->generate(make_request(kOnceUponATime, 8));
  EXPECT_TRUE(next.ok()) << next.message;
  const auto status = client_->status();
  ASSERT_TRUE(status);
  EXPECT_EQ(status->count(WorkerRole::decode), 1);
}

}  // namespace
}  // namespace disagg::test
