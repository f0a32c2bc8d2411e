// kv/: the transfer library over UCX, sender and receiver in one process
// (each with its own worker and progress thread), on 127.0.0.1.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <future>
#include <algorithm>
#include <numeric>
#include <ostream>
#include <random>
#include <stdexcept>
#include <thread>
#include <string>
#include <vector>

#include "kv/plane.h"
#include "kv/transfer.h"
#include "kv/wire.h"
#include "support/raw_kv_peer.h"

namespace disagg::kv {
namespace {

using namespace std::chrono_literals;

constexpr auto kTestDeadline = 20s;  // generous: a passing test ends long before

Deadline in(std::chrono::milliseconds d) { return Clock::now() + d; }
Deadline soon() { return Clock::now() + kTestDeadline; }

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  std::mt19937 rng(seed);
  for (auto& b : out) b = uint8_t(rng());
  return out;
}

// The two transport settings: TCP with peer-failure handling (what crosses
// hosts), and shared memory on one host (UCX 1.13 uses it only without
// peer-failure handling; tcp is listed for the connection handshake).
ContextOptions tcp_mode() { return ContextOptions{"tcp", {}, true}; }
ContextOptions shm_mode() { return ContextOptions{"posix,cma,tcp", {}, false}; }

// A receiver and a sender connected to it.
struct Pair {
  explicit Pair(const ContextOptions& mode = tcp_mode(), SenderOptions sender_options = {},
                ReceiverOptions receiver_options = {})
      : context(KvContext::create(mode)),
        rx(context, receiver_options),
        tx(context, rx.address(), sender_options) {}
  std::shared_ptr<KvContext> context;
  KvReceiver rx;
  KvSender tx;
};

// ---------------------------------------------------------------- bytes in = bytes out

struct RoundTripCase {
  bool shm;
  size_t bytes;
  size_t piece_bytes;
  size_t max_inflight_bytes;
};

void PrintTo(const RoundTripCase& c, std::ostream* os) {
  *os << (c.shm ? "shm" : "tcp") << ", " << c.bytes << " bytes in pieces of " << c.piece_bytes << ", at most "
      << c.max_inflight_bytes << " in flight";
}

class RoundTrip : public ::testing::TestWithParam<RoundTripCase> {};

TEST_P(RoundTrip, BytesArriveIdentical) {
  const RoundTripCase c = GetParam();
  SenderOptions options;
  options.max_inflight_bytes = c.max_inflight_bytes;
  Pair p(c.shm ? shm_mode() : tcp_mode(), options);
  const auto src = random_bytes(c.bytes, uint32_t(c.bytes));
  std::vector<uint8_t> dst(c.bytes, 0);
  const uint64_t id = new_transfer_id();
  p.rx.expect(id, dst.data(), dst.size(), soon());
  ASSERT_TRUE(p.tx.send_all(id, src.data(), src.size(), c.piece_bytes));
  const TransferResult sent = p.tx.wait(id, soon());
  EXPECT_EQ(sent.status, TransferStatus::complete) << sent.detail;
  const TransferResult got = p.rx.wait(id, soon());
  ASSERT_EQ(got.status, TransferStatus::complete) << got.detail;
  EXPECT_EQ(got.bytes_received, c.bytes);
  EXPECT_TRUE(dst == src);
  EXPECT_EQ(p.rx.pending_transfers(), 0u);
}

// Odd sizes and pieces; pieces below UCX's rendezvous threshold arrive eager
// (copied from UCX's buffer), large ones by rendezvous straight into place;
// a small in-flight budget exercises backpressure.
INSTANTIATE_TEST_SUITE_P(
    Sizes, RoundTrip,
    ::testing::Values(RoundTripCase{false, 1, 1, 64 << 20}, RoundTripCase{false, 4095, 1000, 64 << 20},
                      RoundTripCase{false, (1 << 20) + 3, (64 << 10) + 1, 256 << 10},
                      RoundTripCase{false, (8 << 20) + 5, (3 << 20) + 7, 4 << 20},
                      RoundTripCase{false, (8 << 20) + 5, 16 << 20, 1 << 20},  // one piece larger than the budget
                      RoundTripCase{true, 4095, 1000, 64 << 20},
                      RoundTripCase{true, (8 << 20) + 5, (1 << 20) + 1, 4 << 20}),
    [](const auto& param_info) {
      return std::string(param_info.param.shm ? "shm" : "tcp") + "_" + std::to_string(param_info.index);
    });

TEST(KvTransfer, PiecesInAnyOrderIntoSeveralRegions) {
  // A paged destination: three blocks of odd sizes, pieces one per block,
  // sent last first, plus two transfers interleaved on one connection.
  Pair p;
  const std::vector<size_t> sizes = {70001, 3, 250000};
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t(0));
  const auto src_a = random_bytes(total, 1), src_b = random_bytes(total, 2);
  std::vector<std::vector<uint8_t>> blocks_a, blocks_b;
  std::vector<Region> regions_a, regions_b;
  for (size_t s : sizes) {
    blocks_a.emplace_back(s, 0);
    blocks_b.emplace_back(s, 0);
    regions_a.push_back({blocks_a.back().data(), s});
    regions_b.push_back({blocks_b.back().data(), s});
  }
  const uint64_t a = new_transfer_id(), b = new_transfer_id();
  p.rx.expect(a, regions_a, soon());
  p.rx.expect(b, regions_b, soon());
  std::vector<size_t> offsets = {0, sizes[0], sizes[0] + sizes[1]};
  for (int i = 2; i >= 0; --i) {
    ASSERT_TRUE(p.tx.send(a, uint32_t(i), offsets[i], src_a.data() + offsets[i], sizes[i]));
    ASSERT_TRUE(p.tx.send(b, uint32_t(i), offsets[i], src_b.data() + offsets[i], sizes[i]));
  }
  EXPECT_TRUE(p.tx.wait(a, soon()).ok());
  EXPECT_TRUE(p.tx.wait(b, soon()).ok());
  ASSERT_TRUE(p.rx.wait(a, soon()).ok());
  ASSERT_TRUE(p.rx.wait(b, soon()).ok());
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(0, std::memcmp(blocks_a[i].data(), src_a.data() + offsets[i], sizes[i])) << "block " << i;
    EXPECT_EQ(0, std::memcmp(blocks_b[i].data(), src_b.data() + offsets[i], sizes[i])) << "block " << i;
  }
}

TEST(KvTransfer, OnDoneCallbackReportsTheResult) {
  Pair p;
  const auto src = random_bytes(100000, 3);
  std::vector<uint8_t> dst(src.size());
  std::promise<TransferResult> done;
  const uint64_t id = new_transfer_id();
  p.rx.expect(id, dst.data(), dst.size(), soon(), [&](const TransferResult& r) { done.set_value(r); });
  ASSERT_TRUE(p.tx.send_all(id, src.data(), src.size(), 30000));
  EXPECT_TRUE(p.tx.wait(id, soon()).ok());
  auto f = done.get_future();
  ASSERT_EQ(f.wait_for(kTestDeadline), std::future_status::ready);
  EXPECT_TRUE(f.get().ok());
  EXPECT_TRUE(dst == src);
}

// ---------------------------------------------------------------- rejected pieces

class Corruption : public ::testing::TestWithParam<size_t> {};

TEST_P(Corruption, AFlippedByteFailsTheTransfer) {
  // The hook flips a byte of piece 1 after its checksum was taken.
  const size_t piece = GetParam();
  SenderOptions options;
  std::vector<uint8_t> src = random_bytes(3 * piece, 4);
  options.after_checksum = [&](const PieceHeader& h, const void*, size_t) {
    if (h.piece_index == 1) src[h.offset + h.length / 2] ^= 0x01;
  };
  Pair p(tcp_mode(), options);
  std::vector<uint8_t> dst(src.size());
  const uint64_t id = new_transfer_id();
  p.rx.expect(id, dst.data(), dst.size(), soon());
  p.tx.send_all(id, src.data(), src.size(), piece);
  const TransferResult got = p.rx.wait(id, soon());
  EXPECT_EQ(got.status, TransferStatus::bad_checksum);
  EXPECT_NE(got.detail.find("piece 1"), std::string::npos) << got.detail;
  const TransferResult sent = p.tx.wait(id, soon());
  EXPECT_EQ(sent.status, TransferStatus::bad_checksum) << sent.detail;
  EXPECT_EQ(p.rx.pending_transfers(), 0u);
}

// A small piece (eager: checked after the copy) and a large one (rendezvous:
// checked in place).
INSTANTIATE_TEST_SUITE_P(Paths, Corruption, ::testing::Values(size_t(1000), size_t(2) << 20));

TEST(KvTransfer, BytesBeyondTheExpectedSizeAreRejected) {
  Pair p;
  const auto src = random_bytes(4096, 5);
  std::vector<uint8_t> dst(4000, 0xAB);
  std::vector<uint8_t> guard(64, 0xCD);
  const uint64_t id = new_transfer_id();
  p.rx.expect(id, dst.data(), dst.size(), soon());
  p.tx.send_all(id, src.data(), src.size(), 1024);  // the last piece runs 96 bytes past the end
  const TransferResult got = p.rx.wait(id, soon());
  EXPECT_EQ(got.status, TransferStatus::out_of_range);
  EXPECT_NE(got.detail.find("exceeds the 4000 expected bytes"), std::string::npos) << got.detail;
  EXPECT_EQ(p.tx.wait(id, soon()).status, TransferStatus::out_of_range);

  // A single piece that starts past the end fails the same way.
  const uint64_t id2 = new_transfer_id();
  p.rx.expect(id2, dst.data(), dst.size(), soon());
  p.tx.send(id2, 0, 4000, src.data(), 1);
  EXPECT_EQ(p.rx.wait(id2, soon()).status, TransferStatus::out_of_range);
  EXPECT_EQ(p.tx.wait(id2, soon()).status, TransferStatus::out_of_range);
}

TEST(KvTransfer, OverlappingOrRegionCrossingPiecesAreRejected) {
  Pair p;
  const auto src = random_bytes(2000, 6);
  std::vector<uint8_t> dst(2000);
  const uint64_t overlap = new_transfer_id();
  p.rx.expect(overlap, dst.data(), dst.size(), soon());
  p.tx.send(overlap, 0, 0, src.data(), 1000);
  p.tx.send(overlap, 1, 999, src.data() + 999, 1001);
  EXPECT_EQ(p.rx.wait(overlap, soon()).status, TransferStatus::overlap);
  p.tx.wait(overlap, soon());

  std::vector<uint8_t> b0(1000), b1(1000);
  const uint64_t crossing = new_transfer_id();
  p.rx.expect(crossing, {{b0.data(), b0.size()}, {b1.data(), b1.size()}}, soon());
  p.tx.send(crossing, 0, 500, src.data(), 1000);
  const TransferResult got = p.rx.wait(crossing, soon());
  EXPECT_EQ(got.status, TransferStatus::out_of_range);
  EXPECT_NE(got.detail.find("region 0"), std::string::npos) << got.detail;
  p.tx.wait(crossing, soon());
}

TEST(KvTransfer, PiecesOfAnUnknownTransferAreRefused) {
  Pair p;
  const auto src = random_bytes(3 << 20, 7);
  const uint64_t id = new_transfer_id();  // never expected
  p.tx.send_all(id, src.data(), src.size(), 1 << 20);  // false once the first refusal is in
  const TransferResult sent = p.tx.wait(id, soon());
  EXPECT_EQ(sent.status, TransferStatus::unknown_transfer) << sent.detail;
}

TEST(KvTransfer, ALargePieceFromAConnectionThatCannotBeNamedIsRefused) {
  // The drain deadline ends a failed transfer's receives by cutting the
  // connections its pieces came from; a rendezvous piece sent without
  // UCP_AM_SEND_FLAG_REPLY names none, so one whose sender stalled would
  // hold the transfer's memory (and cancel()) for ever. It is refused, and
  // the transfer fails; the same piece with the flag lands.
  auto context = KvContext::create(tcp_mode());
  KvReceiver rx(context);
  const auto src = random_bytes(256 << 10, 12);
  std::vector<uint8_t> dst(src.size());
  PieceHeader h;
  h.length = src.size();
  h.checksum = piece_checksum(src.data(), src.size(), 0);
  test::RawKvPeer peer(context, rx.address());
  for (const bool reply : {false, true}) {
    SCOPED_TRACE(reply ? "with a reply endpoint" : "without one");
    h.transfer_id = new_transfer_id();
    std::fill(dst.begin(), dst.end(), 0x5A);
    rx.expect(h.transfer_id, dst.data(), dst.size(), soon());
    const uint32_t flags = UCP_AM_SEND_FLAG_RNDV | (reply ? UCP_AM_SEND_FLAG_REPLY : 0);
    const ucs_status_t sent = peer.send(wire::kPiece, h, src.data(), src.size(), flags, soon());
    const TransferResult got = rx.wait(h.transfer_id, soon());
    if (reply) {
      EXPECT_EQ(sent, UCS_OK) << ucs_status_string(sent);
      EXPECT_TRUE(got.ok()) << to_string(got.status) << ": " << got.detail;
      EXPECT_TRUE(dst == src);
    } else {
      EXPECT_NE(sent, UCS_OK);
      EXPECT_EQ(got.status, TransferStatus::protocol_error) << got.detail;
      EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0x5A; }));
    }
  }
}

// ---------------------------------------------------------------- deadlines, cancel, peers

TEST(KvTransfer, ATransferWhoseSenderNeverSendsExpiresAtItsDeadline) {
  auto context = KvContext::create(tcp_mode());
  KvReceiver rx(context);
  std::vector<uint8_t> dst(1 << 20);
  const uint64_t id = new_transfer_id();
  const auto start = Clock::now();
  rx.expect(id, dst.data(), dst.size(), start + 200ms);
  EXPECT_EQ(rx.pending_transfers(), 1u);
  const TransferResult got = rx.wait(id, soon());
  const auto took = Clock::now() - start;
  EXPECT_EQ(got.status, TransferStatus::expired);
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, 1500ms);
  EXPECT_EQ(rx.pending_transfers(), 0u);
  EXPECT_FALSE(rx.cancel(id));  // already final, the memory is free
}

TEST(KvTransfer, AHalfSentTransferExpiresAndTheSenderLearnsIt) {
  Pair p;
  const auto src = random_bytes(200000, 8);
  std::vector<uint8_t> dst(src.size());
  const uint64_t id = new_transfer_id();
  p.rx.expect(id, dst.data(), dst.size(), in(300ms));
  p.tx.send(id, 0, 0, src.data(), 100000);  // and never the rest
  const TransferResult got = p.rx.wait(id, soon());
  EXPECT_EQ(got.status, TransferStatus::expired);
  EXPECT_EQ(got.bytes_received, 100000u);
  EXPECT_EQ(p.tx.wait(id, soon()).status, TransferStatus::expired);
}

TEST(KvTransfer, CancelFreesTheTransfer) {
  Pair p;
  std::vector<uint8_t> dst(1 << 20);
  const uint64_t id = new_transfer_id();
  p.rx.expect(id, dst.data(), dst.size(), soon());
  EXPECT_TRUE(p.rx.cancel(id));
  EXPECT_EQ(p.rx.pending_transfers(), 0u);
  EXPECT_EQ(p.rx.wait(id, soon()).status, TransferStatus::cancelled);
  EXPECT_FALSE(p.rx.cancel(id));
  // A sender that did not hear of it is refused, and nothing is written.
  const auto src = random_bytes(dst.size(), 9);
  std::fill(dst.begin(), dst.end(), 0x5A);
  p.tx.send_all(id, src.data(), src.size(), 256 << 10);
  EXPECT_EQ(p.tx.wait(id, soon()).status, TransferStatus::unknown_transfer);
  EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0x5A; }));
  // The connection serves the next transfer as usual. (Ids are never
  // reused: late refusals of the cancelled one may still be on their way.)
  const uint64_t next = new_transfer_id();
  p.rx.expect(next, dst.data(), dst.size(), soon());
  EXPECT_TRUE(p.tx.send_all(next, src.data(), src.size(), 256 << 10));
  EXPECT_TRUE(p.tx.wait(next, soon()).ok());
  EXPECT_TRUE(p.rx.wait(next, soon()).ok());
  EXPECT_TRUE(dst == src);
}

TEST(KvTransfer, CancelDuringATransferReturnsWithTheMemoryFree) {
  // Pieces are streaming while the receiver cancels: once cancel returns no
  // piece writes into the memory any more.
  Pair p;
  const size_t bytes = 64 << 20;
  const auto src = random_bytes(bytes, 10);
  std::vector<uint8_t> dst(bytes);
  const uint64_t id = new_transfer_id();
  p.rx.expect(id, dst.data(), dst.size(), soon());
  auto sending = std::async(std::launch::async, [&] { return p.tx.send_all(id, src.data(), bytes, 1 << 20); });
  std::this_thread::sleep_for(20ms);
  const bool cancelled = p.rx.cancel(id);
  std::fill(dst.begin(), dst.end(), 0x5A);
  sending.get();
  const TransferResult sent = p.tx.wait(id, soon());
  if (cancelled) {
    EXPECT_EQ(p.rx.wait(id, soon()).status, TransferStatus::cancelled);
    EXPECT_NE(sent.status, TransferStatus::complete);
    EXPECT_TRUE(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0x5A; }));
  } else {  // the whole transfer beat the cancel on this machine
    EXPECT_TRUE(sent.ok());
  }
}

TEST(KvTransfer, DropNeverWaitsForAStalledPieceAndTheResultSaysWhenTheMemoryIsFree) {
  // A sender that stalls mid-piece (its rendezvous announced, its data never
  // sent) holds the transfer's memory until the drain deadline cuts its
  // connection (TCP with peer-failure handling; over shared memory nothing
  // can). drop() returns at once all the same, saying the memory is still
  // written into; the transfer's result, when the cut ends the receive, says
  // it is free.
  auto context = KvContext::create(tcp_mode());
  ReceiverOptions options;
  options.drain_timeout = 300ms;
  KvReceiver rx(context, options);
  const auto src = random_bytes(1 << 20, 13);
  std::vector<uint8_t> dst(src.size(), 0x5A);
  const uint64_t id = new_transfer_id();
  std::promise<TransferResult> done;
  auto result = done.get_future();
  rx.expect(id, dst.data(), dst.size(), soon(), [&](const TransferResult& r) { done.set_value(r); });
  test::RawKvPeer peer(context, rx.address());
  PieceHeader first;
  first.transfer_id = id;
  first.length = 4096;
  first.checksum = piece_checksum(src.data(), first.length, 0);
  ASSERT_EQ(peer.send(wire::kPiece, first, src.data(), first.length, UCP_AM_SEND_FLAG_REPLY, soon()), UCS_OK);
  PieceHeader rest = first;
  rest.piece_index = 1;
  rest.offset = first.length;
  rest.length = src.size() - first.length;
  rest.checksum = piece_checksum(src.data() + rest.offset, rest.length, rest.offset);
  peer.start_stalled(rest, src.data() + rest.offset, rest.length);
  const auto give_up = Clock::now() + 5s;
  while (rx.receives_in_flight() == 0 && Clock::now() < give_up) std::this_thread::yield();
  ASSERT_EQ(rx.receives_in_flight(), 1u) << "the receiver never started the stalled piece's receive";
  EXPECT_EQ(rx.drop(id), Dropped::draining);
  EXPECT_EQ(rx.pending_transfers(), 1u);  // (still writing)
  ASSERT_EQ(result.wait_until(soon()), std::future_status::ready) << "no result after the drain deadline";
  const TransferResult got = result.get();
  EXPECT_EQ(got.status, TransferStatus::cancelled) << got.detail;
  EXPECT_EQ(got.bytes_received, first.length);
  EXPECT_EQ(rx.receives_in_flight(), 0u);
  EXPECT_EQ(rx.drop(id), Dropped::unknown);
  EXPECT_TRUE(std::equal(src.begin(), src.begin() + first.length, dst.begin()));
  // A transfer with nothing in flight is the caller's again at once.
  const uint64_t idle = new_transfer_id();
  rx.expect(idle, dst.data(), dst.size(), soon());
  EXPECT_EQ(rx.drop(idle), Dropped::released);
  EXPECT_EQ(rx.wait(idle, soon()).status, TransferStatus::cancelled);
}

TEST(KvTransfer, ASenderThatGoesAwayFailsItsTransfersAtOnce) {
  auto context = KvContext::create(tcp_mode());
  KvReceiver rx(context);
  std::vector<uint8_t> dst(1 << 20);
  const auto src = random_bytes(dst.size(), 11);
  const uint64_t id = new_transfer_id();
  rx.expect(id, dst.data(), dst.size(), soon());
  {
    KvSender tx(context, rx.address());
    tx.send(id, 0, 0, src.data(), 1000);
    EXPECT_EQ(tx.wait(id, in(300ms)).status, TransferStatus::timed_out);
  }  // the connection closes here
  const auto start = Clock::now();
  const TransferResult got = rx.wait(id, soon());
  EXPECT_EQ(got.status, TransferStatus::peer_failed) << got.detail;
  EXPECT_LT(Clock::now() - start, 5s);  // not the 20 s deadline
}

// A sender that stays silent has its connection closed after
// idle_connection (over shared memory one killed without its bye looks the
// same: that connection never breaks, and each holds a UCX endpoint); one
// that keeps sending, or feeds a transfer, is kept however long it lives or
// pauses.
TEST(KvTransfer, AConnectionSilentPastItsIdleBoundIsClosedUnlessItFeedsATransfer) {
  for (const bool shm : {false, true}) {
    SCOPED_TRACE(shm ? "shm" : "tcp");
    ReceiverOptions options;
    options.idle_connection = 2s;
    Pair p(shm ? shm_mode() : tcp_mode(), {}, options);
    for (int i = 0; i < 9; ++i) {  // a transfer every 300 ms: past the bound since the handshake
      std::vector<uint8_t> got(1000);
      const auto sent = random_bytes(got.size(), i);
      const uint64_t id = new_transfer_id();
      p.rx.expect(id, got.data(), got.size(), soon());
      ASSERT_TRUE(p.tx.send(id, 0, 0, sent.data(), sent.size()));
      ASSERT_EQ(p.tx.wait(id, soon()).status, TransferStatus::complete) << "transfer " << i;
      ASSERT_EQ(p.rx.wait(id, soon()).status, TransferStatus::complete) << "transfer " << i;
      std::this_thread::sleep_for(300ms);  // (the pauses are the case, not waits for something)
    }
    EXPECT_EQ(p.rx.connections(), 1u);
    std::vector<uint8_t> dst(2000);
    const auto src = random_bytes(dst.size(), 5);
    const uint64_t id = new_transfer_id();
    p.rx.expect(id, dst.data(), dst.size(), soon());
    ASSERT_TRUE(p.tx.send(id, 0, 0, src.data(), 1000));
    std::this_thread::sleep_for(4500ms);  // (the pause is the case, not a wait for something)
    EXPECT_EQ(p.rx.connections(), 1u);
    ASSERT_TRUE(p.tx.send(id, 1, 1000, src.data() + 1000, 1000));
    EXPECT_EQ(p.tx.wait(id, soon()).status, TransferStatus::complete);
    EXPECT_EQ(p.rx.wait(id, soon()).status, TransferStatus::complete);
    EXPECT_EQ(dst, src);
    const auto deadline = Clock::now() + 10s;
    while (p.rx.connections() != 0 && Clock::now() < deadline) std::this_thread::sleep_for(10ms);
    EXPECT_EQ(p.rx.connections(), 0u) << "a silent connection feeding nothing was kept";
  }
}

// ---------------------------------------------------------------- connecting

// A port on 127.0.0.1 that refuses connections: bound, never listening.
struct RefusingPort {
  RefusingPort() {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
  }
  ~RefusingPort() { close(fd); }
  int fd = -1;
  uint16_t port = 0;
};

TEST(KvTransfer, AnUnreachableReceiverFailsClearlyAndQuickly) {
  auto context = KvContext::create(tcp_mode());
  RefusingPort refusing;
  const std::string address = "127.0.0.1:" + std::to_string(refusing.port);
  SenderOptions options;
  options.connect_timeout = 2s;
  const auto start = Clock::now();
  try {
    KvSender tx(context, address, options);
    FAIL() << "connected to a port nobody listens on";
  } catch (const KvError& e) {
    EXPECT_TRUE(e.code() == KvErrc::unreachable || e.code() == KvErrc::timed_out) << e.what();
    EXPECT_NE(std::string(e.what()).find(address), std::string::npos) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 3s);
}

TEST(KvTransfer, ASilentPeerTimesOutAtTheConnectTimeout) {
  // A TCP listener that accepts (in the kernel's backlog) but never speaks UCX.
  auto context = KvContext::create(tcp_mode());
  RefusingPort silent;
  ASSERT_EQ(listen(silent.fd, 4), 0);
  SenderOptions options;
  options.connect_timeout = 300ms;
  const auto start = Clock::now();
  try {
    KvSender tx(context, "127.0.0.1:" + std::to_string(silent.port), options);
    FAIL() << "a handshake with a silent peer succeeded";
  } catch (const KvError& e) {
    EXPECT_TRUE(e.code() == KvErrc::timed_out || e.code() == KvErrc::unreachable) << e.what();
  }
  EXPECT_LT(Clock::now() - start, 3s);
}

TEST(KvTransfer, BadCallsAreRefused) {
  auto context = KvContext::create(tcp_mode());
  EXPECT_THROW(KvSender(context, "no-port-here"), KvError);
  EXPECT_THROW(KvSender(context, "127.0.0.1:99999"), KvError);
  // An IPv6 address without brackets: which colon starts the port is a guess.
  for (const char* unbracketed : {"::1:4700", "2001:db8::1"}) {
    try {
      KvSender(context, unbracketed);
      ADD_FAILURE() << unbracketed << " was taken";
    } catch (const KvError& e) {
      EXPECT_EQ(e.code(), KvErrc::invalid_argument) << unbracketed << ": " << e.what();
    }
  }
  EXPECT_THROW(KvContext::create({"no_such_transport_xyz", {}, true}), KvError);
  KvReceiver rx(context);
  std::vector<uint8_t> dst(16);
  EXPECT_THROW(rx.expect(0, dst.data(), dst.size(), soon()), KvError);
  EXPECT_THROW(rx.expect(1, nullptr, 16, soon()), KvError);
  rx.expect(7, dst.data(), dst.size(), soon());
  EXPECT_THROW(rx.expect(7, dst.data(), dst.size(), soon()), KvError);
  EXPECT_TRUE(rx.cancel(7));
  EXPECT_NE(new_transfer_id(), new_transfer_id());
}

}  // namespace
}  // namespace disagg::kv

// ---------------------------------------------------------------- interfaces

namespace disagg::kv {
namespace {

// Every interface with an address must be in the /sys that UCX reads: here
// (the machine's own namespace and its sysfs) none is missing; a folder
// that lists none names one (there is always one: lo has 127.0.0.1) and
// says why.
TEST(KvInterfaces, AnInterfaceMissingFromSysfsIsNamed) {
  EXPECT_EQ(interfaces_problem(), "");
  const std::string problem = interfaces_problem("/nonexistent/class/net");
  EXPECT_EQ(problem.rfind("this process's network interface ", 0), 0u) << problem;
  EXPECT_NE(problem.find(" is not in /nonexistent/class/net, where UCX looks"), std::string::npos) << problem;
  EXPECT_NE(problem.find("ip netns exec"), std::string::npos) << problem;
}

}  // namespace
}  // namespace disagg::kv

namespace disagg::kv {
namespace {

// A decode node started again listens at a new address, and its old one is
// never asked for again: opening the new connection closes the broken one
// (the soak found 6-9 file descriptors left per decode restart on each
// prefill node).
TEST(KvPlaneSenders, OpeningAConnectionClosesTheBrokenOnesToOtherAddresses) {
  PlaneOptions receiving;
  receiving.listen_host = "127.0.0.1";
  receiving.shared_memory = false;
  PlaneOptions sending;
  sending.shared_memory = false;
  KvPlane plane(sending);
  std::shared_ptr<KvSender> old;
  {
    KvPlane first(receiving);
    old = plane.sender(Transport::tcp, first.address(Transport::tcp));
    ASSERT_TRUE(old->connected());
  }  // (the first receiver's process is gone)
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (old->connected() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // (a poll of the connection, bounded)
  ASSERT_FALSE(old->connected()) << "the sender did not notice its receiver go";
  old.reset();
  KvPlane second(receiving);
  ASSERT_TRUE(plane.sender(Transport::tcp, second.address(Transport::tcp))->connected());
  EXPECT_EQ(plane.senders(), 1u) << "the broken connection to the old address is still kept";
  // An address nobody listens on: refused, and nothing kept for it.
  RefusingPort refusing;
  EXPECT_THROW(plane.sender(Transport::tcp, "127.0.0.1:" + std::to_string(refusing.port)), KvError);
  EXPECT_EQ(plane.senders(), 1u) << "an empty entry was left for the unreachable address";
}

// Shared memory has no peer-failure detection: a connection to a receiver
// that is gone stays "connected" for ever. One not asked for within
// idle_sender is closed when another opens (a decode node started again
// listens at a new address; the old one is never asked for again).
TEST(KvPlaneSenders, AnIdleConnectionIsClosedWhenAnotherOpens) {
  PlaneOptions receiving;
  receiving.listen_host = "127.0.0.1";
  for (const bool idle_at_once : {false, true}) {
    SCOPED_TRACE(idle_at_once ? "idle at once" : "the default idle time");
    PlaneOptions sending;
    if (idle_at_once) sending.idle_sender = std::chrono::milliseconds(0);
    KvPlane plane(sending);
    {
      KvPlane first(receiving);
      const std::shared_ptr<KvSender> old = plane.sender(Transport::shm, first.address(Transport::shm));
      ASSERT_TRUE(old->connected());
    }  // (the first receiver's process is gone)
    KvPlane second(receiving);
    const std::shared_ptr<KvSender> now = plane.sender(Transport::shm, second.address(Transport::shm));
    ASSERT_TRUE(now->connected());
    EXPECT_EQ(plane.senders(), idle_at_once ? 1u : 2u);
    // The connection asked for is kept while it is not idle, and opened anew
    // once it was (the receiver closes a connection silent for twice that).
    const std::shared_ptr<KvSender> again = plane.sender(Transport::shm, second.address(Transport::shm));
    if (idle_at_once) {
      EXPECT_NE(again, now);
    } else {
      EXPECT_EQ(again, now);
    }
    EXPECT_TRUE(again->connected());
  }
}

// Asking for a connection is no sign that it is alive at the receiver,
// which counts from the last piece it got: one that sent nothing for
// idle_sender is opened anew, however often it was asked for (a prefill
// that failed before its first piece asked, and kept a connection the
// receiver then closed).
TEST(KvPlaneSenders, AConnectionThatSentNothingForItsIdleTimeIsOpenedAnew) {
  PlaneOptions receiving;
  receiving.listen_host = "127.0.0.1";
  receiving.shared_memory = false;
  KvPlane receiver(receiving);
  PlaneOptions sending;
  sending.shared_memory = false;
  sending.idle_sender = std::chrono::milliseconds(2000);
  KvPlane plane(sending);
  const std::string address = receiver.address(Transport::tcp);
  const std::shared_ptr<KvSender> first = plane.sender(Transport::tcp, address);
  // (the pauses are the case, not waits: a longer one can only fail the
  // EXPECT_EQ below, never make the test pass wrongly)
  std::this_thread::sleep_for(std::chrono::milliseconds(600));
  EXPECT_EQ(plane.sender(Transport::tcp, address), first);  // (asked again, nothing sent)
  std::this_thread::sleep_for(std::chrono::milliseconds(1600));
  EXPECT_NE(plane.sender(Transport::tcp, address), first);
}

}  // namespace
}  // namespace disagg::kv
