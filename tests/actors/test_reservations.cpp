// The receiver allocates first: a decode worker reserves a request's blocks
// when the router asks, before any prefill work, and holds them until the KV
// arrives, the request is cancelled, or the reservation's lease ends.
#include <gtest/gtest.h>

#include <limits>

#include <chrono>
#include <map>
#include <future>
#include <thread>

#include "actors/actor_fixture.h"
#include "actors/compute.h"
#include "actors/router.h"
#include "model/checkpoint.h"
#include "engine/engine.h"
#include "engine/kv_format.h"
#include "support/test_paths.h"
#include "caf/all.hpp"

namespace disagg::test {
namespace {

using namespace std::chrono_literals;

// The decode worker's free blocks once they equal `expected` (or the last
// seen value after 2 s).
int free_blocks_when(LocalCluster& cluster, int expected) {
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  int seen = -1;
  while (std::chrono::steady_clock::now() < deadline) {
    const auto loads = cluster.decode_loads();
    if (loads.size() == 1) seen = loads[0].free_blocks;
    if (seen == expected) return seen;
    std::this_thread::sleep_for(2ms);
  }
  return seen;
}

class ReservationTest : public ActorTest {
 protected:
  ReserveReply reserve(RequestId id, int positions, int64_t lease_ms, uint64_t attempt = 0) {
    caf::scoped_actor self{*system_};
    ReserveReply reply;
    KvReservation r{id, positions, lease_ms};
    r.attempt = attempt;
    self->request(cluster_->decode_workers().at(0), 5s, reserve_atom::value, r)
        .receive([&](ReserveReply& r) { reply = std::move(r); },
                 [&](caf::error& e) { ADD_FAILURE() << system_->render(e); });
    tickets_[id] = reply.target.ticket;
    return reply;
  }
  // Each reservation's ticket (KvTarget::ticket), which its KV must carry.
  std::map<RequestId, uint64_t> tickets_;
  KvAck send_kv(RequestId id, int prompt_len, int max_new_tokens = 4, int first_step = 0, uint64_t attempt = 0) {
    caf::scoped_actor self{*system_};
    KvTransfer t;
    t.id = id;
    t.attempt = attempt;
    t.prompt_len = prompt_len;
    t.max_new_tokens = max_new_tokens;
    t.first_step = first_step;
    t.first_token = 5;
    t.ticket = tickets_[id];
    KvAck ack;
    self->request(cluster_->decode_workers().at(0), 5s, kv_atom::value, std::move(t))
        .receive([&](KvAck& a) { ack = std::move(a); }, [&](caf::error& e) { ADD_FAILURE() << system_->render(e); });
    return ack;
  }
};

TEST_F(ReservationTest, AReservationWhoseKvNeverComesExpiresAndFreesItsBlocks) {
  start(1, 1);
  const int total = cluster_->decode_loads().at(0).total_blocks;
  const ReserveReply reply = reserve(9001, 40, 150);  // 40 positions: 3 blocks of 16
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  EXPECT_EQ(reply.load.free_blocks, total - 3);
  EXPECT_EQ(free_blocks_when(*cluster_, total - 3), total - 3);
  EXPECT_EQ(free_blocks_when(*cluster_, total), total) << "the lease ended but the blocks are still held";
  // KV arriving after the lease: refused, nothing taken.
  const KvAck late = send_kv(9001, 20);
  EXPECT_EQ(late.code, ErrorCode::timeout) << late.message;
  EXPECT_EQ(late.load.free_blocks, total);
}

TEST_F(ReservationTest, CancelFreesAReservation) {
  start(1, 1);
  const int total = cluster_->decode_loads().at(0).total_blocks;
  ASSERT_EQ(reserve(9002, 16, 60000).code, ErrorCode::none);
  EXPECT_EQ(free_blocks_when(*cluster_, total - 1), total - 1);
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9002});
  EXPECT_EQ(free_blocks_when(*cluster_, total), total);
  // A reservation after the cancel is a new attempt of the request (the router
  // restarts a request whose other worker was lost): granted.
  EXPECT_EQ(reserve(9002, 16, 60000).code, ErrorCode::none);
  EXPECT_EQ(free_blocks_when(*cluster_, total - 1), total - 1);
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9002});
  EXPECT_EQ(free_blocks_when(*cluster_, total), total);
}

TEST_F(ReservationTest, NoRoomIsOverloadedAndHoldsNothing) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.pool_blocks = 4;
  start(std::move(options));
  ASSERT_EQ(reserve(9003, 48, 60000).code, ErrorCode::none);  // 3 of 4 blocks
  const ReserveReply full = reserve(9004, 32, 60000);        // 2 more: no
  EXPECT_EQ(full.code, ErrorCode::overloaded) << full.message;
  EXPECT_EQ(full.load.free_blocks, 1);
  EXPECT_EQ(reserve(9003, 16, 60000).code, ErrorCode::invalid_request);  // already held
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9003});
  EXPECT_EQ(free_blocks_when(*cluster_, 4), 4);
  // A lease past any request's deadline plus the ack timeout holds nothing
  // (its timer and the stream's deadline would overflow the clock).
  EXPECT_EQ(reserve(9005, 16, kMaxLeaseMs + 1).code, ErrorCode::invalid_request);
  EXPECT_EQ(reserve(9006, 16, std::numeric_limits<int64_t>::max()).code, ErrorCode::invalid_request);
  EXPECT_EQ(free_blocks_when(*cluster_, 4), 4);
}

TEST_F(ReservationTest, KvNeedingMorePositionsThanReservedIsRefused) {
  start(1, 1);
  const int total = cluster_->decode_loads().at(0).total_blocks;
  ASSERT_EQ(reserve(9005, 10, 60000).code, ErrorCode::none);
  const KvAck ack = send_kv(9005, 30);  // 30 + 4 new tokens > 10 reserved
  EXPECT_EQ(ack.code, ErrorCode::invalid_request) << ack.message;
  // A peer's numbers that would wrap the sum past the check, or a first step
  // past the prompt (its tokens would index past the blocks).
  const KvAck wrapped = send_kv(9005, 5, std::numeric_limits<int32_t>::max() - 2);
  EXPECT_EQ(wrapped.code, ErrorCode::invalid_request) << wrapped.message;
  EXPECT_NE(wrapped.message.find("positions"), std::string::npos) << wrapped.message;
  const KvAck stepped = send_kv(9005, 5, 2, std::numeric_limits<int32_t>::max() - 1);
  EXPECT_EQ(stepped.code, ErrorCode::invalid_request) << stepped.message;
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9005});
  EXPECT_EQ(free_blocks_when(*cluster_, total), total);
}

// The KV of another attempt of the request (a late one message of an
// earlier attempt, its prefill worker slow, the retry back on this worker
// with the same prompt) does not fill this attempt's blocks: refused as
// cancelled, the reservation kept for its own.
TEST_F(ReservationTest, KvOfAnotherAttemptIsRefusedAndTheReservationKept) {
  start(1, 1);
  const int total = cluster_->decode_loads().at(0).total_blocks;
  ASSERT_EQ(reserve(9006, 10, 60000, 12).code, ErrorCode::none);
  const KvAck earlier = send_kv(9006, 30, 4, 0, 11);
  EXPECT_EQ(earlier.code, ErrorCode::cancelled) << earlier.message;
  EXPECT_EQ(free_blocks_when(*cluster_, total - 1), total - 1) << "the reservation was given up";
  const KvAck own = send_kv(9006, 30, 4, 0, 12);  // (past the attempt: refused for its size)
  EXPECT_EQ(own.code, ErrorCode::invalid_request) << own.message;
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9006});
  EXPECT_EQ(free_blocks_when(*cluster_, total), total);
}

// Only the prefill worker the router sent the reservation's target to holds
// its ticket (KvTarget::ticket): a KV of the right request, attempt and
// prompt but without the ticket, or with another, is refused, the blocks
// kept; the same KV with the ticket is taken.
TEST_F(ReservationTest, AKvWithoutItsReservationsTicketIsRefusedAndTheBlocksKept) {
  start(1, 1);
  const int total = cluster_->decode_loads().at(0).total_blocks;
  const ReserveReply reply = reserve(9007, 40, 60000);
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  const ReserveReply other = reserve(9008, 16, 60000);
  ASSERT_EQ(other.code, ErrorCode::none) << other.message;
  EXPECT_NE(reply.target.ticket, other.target.ticket) << "each reservation draws its own";
  KvTransfer kv;
  {
    gpu::EngineOptions options;
    options.backend = "cpu";
    gpu::Engine engine(gpu::Checkpoint::open(shared_model()), options);
    const gpu::PrefillOutput out = engine.prefill(kOnceUponATime);
    kv.id = 9007;
    kv.prompt_len = int32_t(kOnceUponATime.size());
    kv.max_new_tokens = 8;
    kv.first_token = 5;
    kv.bytes = gpu::serialize_kv(engine.fingerprint(), out.shape, out.kv.data());
  }
  caf::scoped_actor self{*system_};
  auto send = [&](uint64_t ticket) {
    KvTransfer t = kv;
    t.ticket = ticket;
    KvAck ack;
    ack.code = ErrorCode::internal;
    self->request(cluster_->decode_workers().at(0), 10s, kv_atom::value, std::move(t))
        .receive([&](KvAck& a) { ack = std::move(a); }, [&](caf::error& e) { ADD_FAILURE() << system_->render(e); });
    return ack;
  };
  for (uint64_t forged : {uint64_t{0}, reply.target.ticket ^ 1, other.target.ticket}) {
    const KvAck refused = send(forged);
    EXPECT_EQ(refused.code, ErrorCode::invalid_request) << refused.message;
    EXPECT_NE(refused.message.find("ticket"), std::string::npos) << refused.message;
    EXPECT_EQ(free_blocks_when(*cluster_, total - 4), total - 4) << "a refused KV must not end the reservation";
  }
  const KvAck taken = send(reply.target.ticket);
  EXPECT_EQ(taken.code, ErrorCode::none) << taken.message;
  EXPECT_EQ(taken.load.leases, 1) << "the filled reservation's lease was kept";
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9008});
  EXPECT_EQ(free_blocks_when(*cluster_, total), total) << "the taken request decoded and ended";
  EXPECT_EQ(cluster_->decode_loads().at(0).leases, 0) << "the cancelled reservation's lease was kept";
}

}  // namespace
}  // namespace disagg::test

namespace disagg::test {
namespace {

// A prefill worker that registers with a small model's limits and never
// computes anything.
prefill_actor::behavior_type small_model_prefill(prefill_actor::pointer self, router_actor router) {
  WorkerInfo info;
  info.role = WorkerRole::prefill;
  info.name = "small-model-prefill";
  info.model.vocab_size = 100;
  info.model.seq_len = 50;
  self->request(router, std::chrono::seconds(5), register_atom::value, info, caf::actor_cast<prefill_actor>(self))
      .then([](caf::ok_atom) {}, [=](caf::error& e) { self->quit(e); });
  return {
      [=](prefill_atom, PrefillJob&, decode_actor&) -> caf::result<PrefillReport> {
        return caf::make_error(caf::sec::request_timeout);
      },
      [](cancel_atom, RequestId) {},
      [](router_atom, caf::actor_addr&) {},
      [](status_atom) { return PrefillLoad{}; },
      [](kv_events_atom) { return KvEvents{}; },
  };
}

// The router takes vocabulary and context from its own model, from the start
// (it took them from the first prefill worker to register: after a smaller
// model's worker registered, every valid request of the real model was
// rejected until the router restarted), and refuses a worker of another model.
TEST(RouterAuthority, TheLimitsAreTheRoutersModelAndAnotherModelsWorkerIsRefused) {
  DisaggSystemConfig system_config;
  caf::actor_system system{system_config};
  const auto checkpoint = gpu::Checkpoint::open(shared_model_config(1, 1).model);
  const router_actor router = spawn_router(system, shared_model_config(1, 1), nullptr, model_info(*checkpoint));
  caf::scoped_actor self{system};
  // No worker yet, and still the context is known: 600 tokens exceed 512.
  std::vector<int32_t> too_long(600, 400);
  too_long[0] = 1;
  RequestOutcome out;
  self->request(router, 10s, generate_atom::value, make_request(too_long, 4), client_actor{})
      .receive([&](RequestOutcome& o) { out = std::move(o); }, [&](caf::error& e) { FAIL() << system.render(e); });
  EXPECT_EQ(out.code, ErrorCode::invalid_request) << out.message;
  // A worker of a smaller model is refused, naming why.
  auto small = system.spawn(small_model_prefill, router);
  self->monitor(small);
  std::string why;
  self->receive([&](caf::down_msg& down) { why = system.render(down.reason); },
                caf::after(10s) >> [&] { caf::anon_send_exit(small, caf::exit_reason::user_shutdown); });
  EXPECT_NE(why.find("is not the cluster's"), std::string::npos) << why;
  // A request within the real model (ids up to 400, 100 tokens) stays valid:
  // it waits for workers until its deadline.
  std::vector<int32_t> prompt(100, 400);
  prompt[0] = 1;
  GenerateRequest request = make_request(prompt, 20);
  request.deadline_ms = 300;
  self->request(router, 10s, generate_atom::value, request, client_actor{})
      .receive([&](RequestOutcome& o) { out = std::move(o); }, [&](caf::error& e) { FAIL() << system.render(e); });
  EXPECT_EQ(out.code, ErrorCode::timeout) << to_string(out.code) << ": " << out.message;
  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);
}

}  // namespace
}  // namespace disagg::test

namespace disagg::test {
namespace {

// A client that asks for a generation and waits (as a disagg-client does
// until Ctrl-C makes its node disappear).
client_actor::behavior_type waiting_client(client_actor::pointer self, router_actor router, GenerateRequest request) {
  self->request(router, std::chrono::seconds(60), generate_atom::value, std::move(request),
                caf::actor_cast<client_actor>(self))
      .then([](RequestOutcome&) {}, [](caf::error&) {});
  return {
      [](token_atom, TokenEvent&) {},
  };
}

TEST_F(ReservationTest, AClientThatGoesAwayCancelsItsRequestAtOnce) {
  LocalClusterOptions options;
  options.config = shared_model_config(1, 1);
  options.config.pool_blocks = 8;
  start(std::move(options));
  // The pool taken by a reservation the router does not know of: the
  // client's request (2 blocks) waits in the router's queue.
  ASSERT_EQ(reserve(9100, 128, 60000).code, ErrorCode::none);
  auto request = make_request(kOnceUponATime, 20);
  request.deadline_ms = 60000;
  auto client = system_->spawn(waiting_client, cluster_->router(), request);
  auto queued = [&] {
    const auto status = client_->status();
    return status ? status->queued + status->in_flight : -1;
  };
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (queued() != 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(2ms);
  ASSERT_EQ(queued(), 1) << "the request should be waiting for decode room";
  caf::anon_send_exit(client, caf::exit_reason::kill);
  // Gone within a second, not at its 60 s deadline.
  const auto gone_by = std::chrono::steady_clock::now() + 1s;
  while (queued() != 0 && std::chrono::steady_clock::now() < gone_by) std::this_thread::sleep_for(2ms);
  EXPECT_EQ(queued(), 0) << "the request of a client that went away is still held";
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9100});
}

}  // namespace
}  // namespace disagg::test
