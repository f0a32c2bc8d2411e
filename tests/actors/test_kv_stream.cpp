// Streamed KV at the decode worker: a reservation with a prompt opens a
// stream (its blocks registered with the KV receiver under a fresh transfer
// id); every way the stream can end gives the blocks back: the lease ends
// before any piece, a cancel in the middle, a corrupt piece, a commit that
// does not match. (Streams that complete are what every generation test runs.)
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <thread>
#include <vector>

#include "actors/actor_fixture.h"
#include "caf/all.hpp"
#include "model/checkpoint.h"
#include "engine/kv_stream.h"
#include "kv/plane.h"
#include "support/raw_kv_peer.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using namespace std::chrono_literals;

constexpr int kPromptLen = 20;  // positions streamed: 32 (two key tiles), 2 blocks of 16
constexpr int kPositions = 40;  // reserved: 3 blocks of 16

class KvStreamTest : public ActorTest {
 protected:
  void SetUp() override {
    ActorTest::SetUp();
    LocalClusterOptions options;
    options.config = shared_model_config(1, 1);
    options.config.kv_transport = "shm";  // both receivers: shared memory for this host, TCP for others
    start(std::move(options));
    total_ = cluster_->decode_loads().at(0).total_blocks;
    const auto model = gpu::Checkpoint::open(shared_model());
    fingerprint_ = model->fingerprint();
    layers_ = model->config().n_layers;
    plan_.emplace(model->config().n_layers, model->config().kv_dim(), kPromptLen, cluster_->config().block_size);
  }

  // A reservation as the router makes it, for a prefill worker on this host
  // (same host: shared memory) or elsewhere ("": TCP).
  ReserveReply reserve(RequestId id, int64_t lease_ms, const std::string& prefill_host) {
    caf::scoped_actor self{*system_};
    ReserveReply reply;
    self->request(cluster_->decode_workers().at(0), 5s, reserve_atom::value,
                  KvReservation{id, kPositions, lease_ms, kPromptLen, prefill_host})
        .receive([&](ReserveReply& r) { reply = std::move(r); },
                 [&](caf::error& e) { ADD_FAILURE() << system_->render(e); });
    tickets_[id] = reply.target.ticket;
    return reply;
  }

  // Each reservation's ticket (KvTarget::ticket), which its KV must carry.
  std::map<RequestId, uint64_t> tickets_;

  KvAck commit(RequestId id, uint64_t transfer_id, uint64_t fingerprint, int32_t prompt_len = kPromptLen,
               std::vector<int32_t> context = {}) {
    caf::scoped_actor self{*system_};
    KvTransfer t;
    t.id = id;
    t.prompt_len = prompt_len;
    t.context = std::move(context);
    t.max_new_tokens = 4;
    t.first_token = 5;
    t.transfer_id = transfer_id;
    t.fingerprint = fingerprint;
    t.ticket = tickets_[id];
    KvAck ack;
    self->request(cluster_->decode_workers().at(0), 5s, kv_atom::value, std::move(t))
        .receive([&](KvAck& a) { ack = std::move(a); }, [&](caf::error& e) { ADD_FAILURE() << system_->render(e); });
    return ack;
  }

  kv::KvReceiver& receiver(const KvTarget& target) {
    return cluster_->kv_plane()->receiver(kv::Transport(target.transport));
  }

  // The decode worker's free blocks once they equal `expected` (or the last
  // seen value after 3 s).
  int free_blocks_when(int expected) {
    const auto deadline = std::chrono::steady_clock::now() + 3s;
    int seen = -1;
    while (std::chrono::steady_clock::now() < deadline) {
      const auto loads = cluster_->decode_loads();
      if (loads.size() == 1) seen = loads[0].free_blocks;
      if (seen == expected) return seen;
      std::this_thread::sleep_for(2ms);
    }
    return seen;
  }

  int total_ = 0;
  int layers_ = 0;
  uint64_t fingerprint_ = 0;
  std::optional<gpu::KvStreamPlan> plan_;
};

TEST_F(KvStreamTest, AReservationWithAPromptOpensAStreamOnTheTransportOfThePrefillsHost) {
  const ReserveReply same_host = reserve(9101, 60000, kv::host_identity());
  ASSERT_EQ(same_host.code, ErrorCode::none) << same_host.message;
  EXPECT_NE(same_host.target.transfer_id, 0u);
  EXPECT_EQ(same_host.target.transport, uint8_t(kv::Transport::shm));
  EXPECT_EQ(same_host.target.block_size, cluster_->config().block_size);
  EXPECT_FALSE(same_host.target.address.empty());
  const ReserveReply elsewhere = reserve(9102, 60000, "another-host/boot");
  ASSERT_EQ(elsewhere.code, ErrorCode::none) << elsewhere.message;
  EXPECT_EQ(elsewhere.target.transport, uint8_t(kv::Transport::tcp));
  EXPECT_NE(elsewhere.target.transfer_id, same_host.target.transfer_id);
  EXPECT_EQ(receiver(same_host.target).pending_transfers(), 1u);
  EXPECT_EQ(receiver(elsewhere.target).pending_transfers(), 1u);
  for (RequestId id : {9101, 9102}) caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, id);
  EXPECT_EQ(free_blocks_when(total_), total_);
  EXPECT_EQ(receiver(same_host.target).pending_transfers(), 0u);
  EXPECT_EQ(receiver(elsewhere.target).pending_transfers(), 0u);
}

TEST_F(KvStreamTest, AStreamWhosePrefillNeverComesExpiresAndFreesItsBlocks) {
  const ReserveReply reply = reserve(9111, 200, kv::host_identity());
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  EXPECT_EQ(reply.load.free_blocks, total_ - 3);
  EXPECT_EQ(free_blocks_when(total_), total_) << "the lease ended but the blocks are still held";
  EXPECT_EQ(receiver(reply.target).pending_transfers(), 0u) << "the stream outlived its reservation";
  const KvAck late = commit(9111, reply.target.transfer_id, fingerprint_);
  EXPECT_EQ(late.code, ErrorCode::timeout) << late.message;
}

TEST_F(KvStreamTest, CancellingAHalfSentStreamFreesItsBlocksAndTheSenderHearsIt) {
  const std::vector<std::string> hosts = {kv::host_identity(), "another-host/boot"};  // shm, tcp
  for (size_t h = 0; h < hosts.size(); ++h) {
    const std::string& host = hosts[h];
    SCOPED_TRACE("prefill host " + host);
    const RequestId id = 9121 + h;
    const ReserveReply reply = reserve(id, 60000, host);
    ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
    auto tx = cluster_->kv_plane()->sender(kv::Transport(reply.target.transport), reply.target.address);
    std::vector<float> layer0(plan_->total_bytes() / sizeof(float), 1.0f);
    int pieces = 0;
    const auto* source = reinterpret_cast<const uint8_t*>(layer0.data());
    plan_->for_each_piece(0, 0, kPromptLen, [&](size_t offset, size_t from, size_t bytes) {
      ASSERT_TRUE(tx->send(reply.target.transfer_id, uint32_t(pieces++), offset, source + from, bytes));
    });
    EXPECT_GT(pieces, 0);
    caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, id);
    EXPECT_EQ(free_blocks_when(total_), total_);
    EXPECT_EQ(receiver(reply.target).pending_transfers(), 0u);
    const kv::TransferResult verdict = tx->wait(reply.target.transfer_id, kv::Clock::now() + 5s);
    // cancelled; or, when the cancel overtook the piece, unknown_transfer for it
    EXPECT_TRUE(verdict.status == kv::TransferStatus::cancelled ||
                verdict.status == kv::TransferStatus::unknown_transfer)
        << kv::to_string(verdict.status) << ": " << verdict.detail;
  }
}

TEST_F(KvStreamTest, ACancelNeverWaitsForAStalledSenderItsBlocksFollowTheVerdict) {
  // A sender that stalls mid-piece writes into the blocks until the
  // receiver cuts its connection (TCP: at the drain deadline, a second;
  // shared memory: never). The worker does not wait for that: it answers
  // at once with the blocks still held, and frees them at the verdict.
  const ReserveReply reply = reserve(9141, 60000, "another-host/boot");  // TCP
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  kv::ContextOptions tcp;
  tcp.transports = "tcp";
  tcp.peer_failure_detection = true;
  RawKvPeer peer(kv::KvContext::create(tcp), reply.target.address);
  std::vector<float> layer0(plan_->total_bytes() / sizeof(float), 1.0f);
  const auto* source = reinterpret_cast<const uint8_t*>(layer0.data());
  struct Piece {
    kv::PieceHeader header;
    const uint8_t* data;
  };
  std::vector<Piece> pieces;  // layer 0's
  plan_->for_each_piece(0, 0, kPromptLen, [&](size_t offset, size_t from, size_t bytes) {
    kv::PieceHeader h;
    h.transfer_id = reply.target.transfer_id;
    h.piece_index = uint32_t(pieces.size());
    h.offset = offset;
    h.length = bytes;
    h.checksum = kv::piece_checksum(source + from, bytes, offset);
    pieces.push_back({h, source + from});
  });
  ASSERT_GE(pieces.size(), 2u);
  ASSERT_EQ(peer.send(kv::wire::kPiece, pieces[0].header, pieces[0].data, pieces[0].header.length,
                      UCP_AM_SEND_FLAG_REPLY, kv::Clock::now() + 5s),
            UCS_OK);
  peer.start_stalled(pieces[1].header, pieces[1].data, pieces[1].header.length);
  kv::KvReceiver& rx = receiver(reply.target);
  const auto give_up = kv::Clock::now() + 5s;
  while (rx.receives_in_flight() == 0 && kv::Clock::now() < give_up) std::this_thread::yield();
  ASSERT_EQ(rx.receives_in_flight(), 1u) << "the receiver never started the stalled piece's receive";
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9141});
  const auto loads = cluster_->decode_loads();  // (asked after the cancel: answered after it)
  ASSERT_EQ(loads.size(), 1u);
  EXPECT_EQ(loads[0].free_blocks, total_ - 3) << "freed while the stalled piece could still write, or waited for it";
  EXPECT_EQ(free_blocks_when(total_), total_) << "the verdict did not free the blocks";
  EXPECT_EQ(rx.receives_in_flight(), 0u);
}

TEST_F(KvStreamTest, ACorruptPieceFailsTheStreamAndFreesItsBlocksAtOnce) {
  const ReserveReply reply = reserve(9131, 60000, "another-host/boot");  // TCP
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  kv::ContextOptions tcp;
  tcp.transports = "tcp";
  kv::SenderOptions corrupting;
  int sent = 0;
  corrupting.after_checksum = [&](const kv::PieceHeader&, const void* data, size_t) {
    if (sent++ == 3) const_cast<float*>(static_cast<const float*>(data))[0] += 1.0f;  // our own buffer
  };
  kv::KvSender tx(kv::KvContext::create(tcp), reply.target.address, corrupting);
  std::vector<float> cache(plan_->total_bytes() / sizeof(float), 0.5f);
  bool refused = false;  // the receiver failed the stream: send() says so from then on
  for (int layer = 0; layer < layers_ && !refused; ++layer)
    plan_->for_each_piece(layer, 0, kPromptLen, [&](size_t offset, size_t from, size_t bytes) {
      const auto* source = reinterpret_cast<const uint8_t*>(cache.data());
      if (!refused) refused = !tx.send(reply.target.transfer_id, uint32_t(sent), offset, source + from, bytes);
    });
  const kv::TransferResult verdict = tx.wait(reply.target.transfer_id, kv::Clock::now() + 5s);
  EXPECT_EQ(verdict.status, kv::TransferStatus::bad_checksum) << verdict.detail;
  EXPECT_EQ(free_blocks_when(total_), total_) << "a failed stream keeps its blocks";
  const KvAck ack = commit(9131, reply.target.transfer_id, fingerprint_);
  EXPECT_NE(ack.code, ErrorCode::none);
}

TEST_F(KvStreamTest, ACommitOfAnotherStreamOrModelIsRefused) {
  const ReserveReply reply = reserve(9141, 60000, kv::host_identity());
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  const KvAck wrong_stream = commit(9141, reply.target.transfer_id + 1, fingerprint_);
  EXPECT_EQ(wrong_stream.code, ErrorCode::invalid_request) << wrong_stream.message;
  EXPECT_EQ(free_blocks_when(total_ - 3), total_ - 3) << "a stray commit must not end the reservation";
  // (its stream's bytes fill the reserved prompt's positions: a commit of a
  // longer prompt would decode positions never written)
  const KvAck wrong_prompt = commit(9141, reply.target.transfer_id, fingerprint_, kPromptLen + 2);
  EXPECT_EQ(wrong_prompt.code, ErrorCode::invalid_request) << wrong_prompt.message;
  EXPECT_EQ(free_blocks_when(total_ - 3), total_ - 3);
  const KvAck wrong_model = commit(9141, reply.target.transfer_id, fingerprint_ ^ 1);
  EXPECT_EQ(wrong_model.code, ErrorCode::incompatible_kv) << wrong_model.message;
  EXPECT_EQ(free_blocks_when(total_), total_);
  EXPECT_EQ(receiver(reply.target).pending_transfers(), 0u);
}

// A stream's commit that waits for its stream keeps the reservation: a KV
// sent as one message for the same request meanwhile is refused (it took
// the blocks, and the waiting commit was never answered), and the commit is
// answered when the reservation ends.
TEST_F(KvStreamTest, AOneMessageKvWhileAStreamsCommitWaitsIsRefused) {
  const ReserveReply reply = reserve(9161, 60000, kv::host_identity());
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  caf::scoped_actor prefill{*system_};
  KvTransfer streamed;
  streamed.id = 9161;
  streamed.prompt_len = kPromptLen;
  streamed.max_new_tokens = 4;
  streamed.first_token = 5;
  streamed.transfer_id = reply.target.transfer_id;
  streamed.fingerprint = fingerprint_;
  streamed.ticket = reply.target.ticket;
  auto waiting = prefill->request(cluster_->decode_workers().at(0), 10s, kv_atom::value, streamed);  // (no bytes yet)
  const KvAck message = commit(9161, 0, fingerprint_);
  EXPECT_EQ(message.code, ErrorCode::invalid_request) << message.message;
  EXPECT_NE(message.message.find("waiting"), std::string::npos) << message.message;
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9161});
  KvAck ended;
  ended.code = ErrorCode::none;
  std::move(waiting).receive([&](KvAck& a) { ended = std::move(a); },
                             [&](caf::error& e) { ADD_FAILURE() << "the waiting commit: " << system_->render(e); });
  EXPECT_EQ(ended.code, ErrorCode::cancelled) << ended.message;
  EXPECT_EQ(free_blocks_when(total_), total_);
}

// A reservation that names its prompt (the prefix cache's): a stream's
// commit of another prompt of the same length is refused too (its blocks
// would go to the cache under the reserved prompt's hashes, another
// client's later prompt then decoding over this KV).
TEST_F(KvStreamTest, AStreamsCommitOfAnotherPromptIsRefused) {
  std::vector<int32_t> prompt(size_t(kPromptLen), 7);
  prompt[0] = 1;
  caf::scoped_actor self{*system_};
  KvReservation r{9151, kPositions, 60000, kPromptLen, kv::host_identity(), prompt};
  ReserveReply reply;
  self->request(cluster_->decode_workers().at(0), 5s, reserve_atom::value, r)
      .receive([&](ReserveReply& got) { reply = std::move(got); }, [&](caf::error& e) { ADD_FAILURE() << system_->render(e); });
  ASSERT_EQ(reply.code, ErrorCode::none) << reply.message;
  ASSERT_NE(reply.target.transfer_id, 0u);
  tickets_[9151] = reply.target.ticket;
  std::vector<int32_t> other = prompt;
  other.back() = 8;
  const KvAck refused = commit(9151, reply.target.transfer_id, fingerprint_, kPromptLen, other);
  EXPECT_EQ(refused.code, ErrorCode::invalid_request) << refused.message;
  EXPECT_NE(refused.message.find("another prompt"), std::string::npos) << refused.message;
  EXPECT_EQ(free_blocks_when(total_ - 3), total_ - 3) << "a stray commit must not end the reservation";
  caf::send_as(cluster_->router(), cluster_->decode_workers().at(0), cancel_atom::value, RequestId{9151});
  EXPECT_EQ(free_blocks_when(total_), total_);
}

}  // namespace
}  // namespace disagg::test
