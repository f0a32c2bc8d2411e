// The KV data plane's transfer API: bulk bytes from a prefill node's memory
// into memory a decode node reserved for them, over UCX (UCP active messages).
// CAF-free; the actors negotiate transfers with typed messages and use this to
// move the bytes. docs/kv-transfer.md has the design and the measured figures.
//
//   auto ctx = KvContext::create();                   // one per process (or per transport setting)
//   KvReceiver rx(ctx, receiver_options);             // decode node: listens (host, port 0 = any)
//   rx.expect(id, dest, bytes, deadline);             //   reserve first, then tell the sender rx.address() and id
//   KvSender tx(ctx, "10.0.0.2:41234");               // prefill node: connects (throws KvError when it cannot)
//   tx.send(id, 0, 0, piece0, n0); tx.send(id, 1, n0, piece1, n1); ...
//   tx.wait(id, deadline);                            //   the receiver's verdict: complete, or why not
//   rx.wait(id, deadline);                            //   (or the on_done callback given to expect)
//
// Threads: every KvReceiver and KvSender owns one UCP worker and one progress
// thread; only that thread calls into UCX for it, and it sleeps on the
// worker's event descriptor when there is nothing to do. A receiver also has
// a verifier thread that hashes landed pieces (ReceiverOptions); a sender
// hashes on the caller's thread, inside send(). The public methods
// may be called from any thread. Callbacks (on_done) run on the progress
// thread: keep them short (post a message, set a flag) and do not throw.
//
// Security: UCX authenticates nothing. A receiver accepts any peer that can
// reach its port and takes pieces for any transfer id it expects, so give its
// address only to peers introduced over the authenticated control channel,
// bind it to the cluster network, and use unguessable transfer ids
// (new_transfer_id). A piece is only written into memory expect() registered,
// inside the bounds given there.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kv/wire.h"

struct ucp_context;  // UCX's context (ucp_context_h), kept out of the callers' includes

namespace disagg::kv {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Failures of setting up or using a connection (not of one transfer: those are
// a TransferResult).
enum class KvErrc {
  invalid_argument,  // a bad call: zero id, empty memory, duplicate id, unparsable address
  ucx_error,         // UCX refused a setup call (bad transport name, port in use, ...)
  unreachable,       // the receiver's address refused or dropped the connection
  timed_out,         // the receiver did not answer the handshake in time
  connection_lost,   // the connection broke after it was established
};

class KvError : public std::runtime_error {
 public:
  KvError(KvErrc code, const std::string& what) : std::runtime_error(what), code_(code) {}
  KvErrc code() const { return code_; }

 private:
  KvErrc code_;
};

// The outcome of one transfer. Every status but `pending` is final.
enum class TransferStatus : uint8_t {
  pending = 0,       // no verdict yet (a wait whose deadline came first)
  complete,          // every expected byte arrived, each piece matched its checksum
  cancelled,         // the receiver's owner cancelled it (or shut the receiver down)
  expired,           // not complete by the deadline given to expect()
  bad_checksum,      // a piece's bytes did not match its header's checksum
  out_of_range,      // a piece beyond the expected bytes, or across two regions
  overlap,           // a piece overlapping bytes already received
  unknown_transfer,  // the receiver expects no such id (never, or no longer)
  protocol_error,    // a malformed header (wrong magic, version or length)
  peer_failed,       // the connection broke before the transfer completed
  timed_out,         // sender only: no verdict by the deadline given to wait()
};
const char* to_string(TransferStatus status);

struct TransferResult {
  uint64_t transfer_id = 0;
  TransferStatus status = TransferStatus::pending;
  uint64_t bytes_received = 0;  // validated bytes in place when it became final
  std::string detail;           // for a failure: which piece and why
  bool ok() const { return status == TransferStatus::complete; }
};

// 64 random bits from the operating system, never 0: transfer ids must not be
// guessable by a peer that reaches a receiver without being introduced, and
// are never reused (a late refusal of an old transfer carries only its id).
uint64_t new_transfer_id();

// ------------------------------------------------------------------ context

struct ContextOptions {
  // UCX_TLS for this context: "tcp" (also between hosts), "posix,cma,self"
  // (shared memory, one host only), ... Empty: UCX's own choice (the UCX_TLS
  // environment variable, else every transport available: shared memory to a
  // peer on this host, TCP or RDMA to another).
  std::string transports;
  // Further UCX settings for this context only, as ucp_config_modify names
  // without the UCX_ prefix, e.g. {"RNDV_THRESH", "256K"}. They override the
  // environment. UCP-level settings only: UCX 1.13 ignores transport ones
  // (TCP_*, POSIX_*, with a warning) here; those come from the environment.
  std::vector<std::pair<std::string, std::string>> ucx_settings;
  // UCX's peer-failure handling (UCP_ERR_HANDLING_MODE_PEER) on every
  // connection: a dead or vanished peer fails the requests in flight and the
  // transfers it fed (peer_failed) at once, and a stuck connection can be cut.
  // UCX 1.13 offers it on TCP (and RDMA) only: its shared-memory transports
  // (posix, sysv, cma) are not used while it is on. Turn it off for the
  // same-host path; a dead peer is then noticed by the transfer deadlines and
  // the control plane (which cancels), and a cancel or expiry waits for the
  // pieces in flight to end instead of cutting the connection (with CMA,
  // which copies each piece in one system call, they end at once).
  // Both ends of a connection must use the same setting.
  bool peer_failure_detection = true;
};

// UCX's TCP transport settings this library needs, which UCX 1.13 reads
// from the environment only (ContextOptions::ucx_settings cannot carry
// them): UCX_TCP_CONN_NB=y, the transport's connections dialled without
// blocking. UCX dials them from the event loop's thread, blocking by
// default: a SYN dropped on the way (a cut link) held that thread in
// connect() for the kernel's two minutes of SYN retries, and every caller
// waiting on the loop (a stream's sender giving up at its connect timeout)
// with it. A variable the environment already sets is left as it is.
// KvContext::create applies them; a process calls this itself before it
// starts threads (setenv), as a node does first thing.
void apply_process_settings();

// A UCP context. Receivers and senders made from it share its settings.
class KvContext {
 public:
  static std::shared_ptr<KvContext> create(const ContextOptions& options = {});
  ~KvContext();
  KvContext(const KvContext&) = delete;
  KvContext& operator=(const KvContext&) = delete;

  const ContextOptions& options() const { return options_; }
  ucp_context* native() const { return context_; }

 private:
  KvContext(ucp_context* context, ContextOptions options) : context_(context), options_(std::move(options)) {}
  ucp_context* context_;
  ContextOptions options_;
};

// ------------------------------------------------------------------ receiver

// Memory a transfer's bytes go to. A transfer's byte space is its regions one
// after the other (offsets 0 .. sum of sizes); a piece must fall inside one
// region (for a paged KV pool: one piece per block, or per part of a block).
struct Region {
  void* data = nullptr;
  size_t bytes = 0;
};

struct ReceiverOptions {
  std::string host = "127.0.0.1";  // address to listen on; also what address() reports
  uint16_t port = 0;               // 0: any free port
  // When a transfer is cancelled or expires while pieces are being written
  // into its memory, how long to wait for those writes before cutting the
  // connection they come over (which ends them). Only then is the memory
  // free. Without peer_failure_detection (ContextOptions) connections cannot
  // be cut: the wait lasts until the writes end.
  std::chrono::milliseconds drain_timeout{1000};
  // Check large pieces' checksums on a thread of their own, so that hashing
  // one piece overlaps receiving the next (the progress thread does the
  // receiving, and for shared memory the copy). Off: the progress thread
  // hashes too (one thread per receiver in all).
  bool verify_thread = true;
  // A connection that has sent nothing for this long and feeds no transfer
  // is closed: over shared memory one whose sender died without its bye
  // (killed) never breaks, and each holds a UCX endpoint and its memory. A
  // KvPlane's receivers take twice its senders' idle_sender, after which a
  // sender opens a new connection instead of using a connection closed here.
  std::chrono::milliseconds idle_connection{std::chrono::minutes(20)};
};

enum class Dropped { unknown, released, draining };  // KvReceiver::drop

class KvReceiver {
 public:
  using DoneCallback = std::function<void(const TransferResult&)>;

  // Listens at once; throws KvError (ucx_error) when it cannot bind.
  KvReceiver(std::shared_ptr<KvContext> context, const ReceiverOptions& options = {});
  // Cancels what is still expected, closes every connection, joins the thread.
  ~KvReceiver();
  KvReceiver(const KvReceiver&) = delete;
  KvReceiver& operator=(const KvReceiver&) = delete;

  // "host:port", what a sender connects to.
  std::string address() const;

  // Registers memory for transfer `id` (nonzero, not currently expected) and
  // how long it may take. The memory belongs to the receiver until the
  // transfer is final: complete, failed (a bad piece fails the whole
  // transfer), expired at `deadline`, or cancelled. The final result goes to
  // `on_done` (on the progress thread) or, without one, to wait().
  // Call it before the sender learns the id: a piece for an id not (yet)
  // expected is refused.
  void expect(uint64_t id, std::vector<Region> regions, Deadline deadline, DoneCallback on_done = {});
  void expect(uint64_t id, void* dest, size_t bytes, Deadline deadline, DoneCallback on_done = {});

  // The final result of a transfer expected without a callback, once (it is
  // forgotten then); {pending} when `until` comes first.
  TransferResult wait(uint64_t id, Deadline until);

  // Fails the transfer with `cancelled` and returns once no piece is being
  // written into (or hashed from) its memory any more: the memory is the
  // caller's again. That takes as long as the pieces in flight (bounded by
  // drain_timeout, see ReceiverOptions). A transfer that failed already and
  // is still draining keeps its failure, and is waited for the same. False
  // when the id is not expected (unknown, or already final). Called from an
  // on_done callback it does not wait for in-flight pieces.
  bool cancel(uint64_t id);

  // The same, without waiting (for an owner that must not block: a stalled
  // sender over shared memory, where connections cannot be cut, holds a
  // cancel() for as long as it stalls): `released` when no piece writes into
  // the transfer's memory (the memory is the caller's now), `draining` when
  // some still do (the memory is the caller's once the transfer's result is
  // out, to on_done or wait(): once, when those pieces end, see
  // drain_timeout), `unknown` when the id is not expected.
  Dropped drop(uint64_t id);

  // Pieces being written into (or hashed from) transfers' memory now, for tests.
  size_t receives_in_flight() const;

  // Transfers currently expected (not final), for tests and metrics.
  size_t pending_transfers() const;
  // Senders' connections open now, for tests and metrics.
  size_t connections() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// ------------------------------------------------------------------ sender

struct SenderOptions {
  // Backpressure: send() blocks while this many piece bytes are handed to UCX
  // and not yet taken by the receiver (a single larger piece still goes alone).
  // 32 MiB with 4-16 MiB pieces kept loopback TCP at raw-socket speed in
  // bench_kv_transfer; it also bounds what a cancel has to wait for.
  size_t max_inflight_bytes = size_t(32) << 20;
  // ... or while this many pieces are; their headers live in as many
  // preallocated slots, reused.
  uint32_t max_inflight_pieces = 64;
  // How long the constructor waits for the receiver's handshake.
  std::chrono::milliseconds connect_timeout{5000};
  // Test hook: runs after a piece's checksum is computed and before the piece
  // is handed to UCX (a test flips a byte of its buffer here).
  std::function<void(const PieceHeader& header, const void* data, size_t bytes)> after_checksum;
};

class KvSender {
 public:
  // Connects to a receiver's address ("host:port", "[v6]:port") and completes
  // the handshake. Throws KvError: invalid_argument (bad address),
  // unreachable (refused, no route, reset), timed_out (no answer within
  // connect_timeout).
  KvSender(std::shared_ptr<KvContext> context, const std::string& address, const SenderOptions& options = {});
  // Waits for pieces still in flight (cutting the connection after a short
  // while if the receiver stalls), closes the connection, joins the thread.
  ~KvSender();
  KvSender(const KvSender&) = delete;
  KvSender& operator=(const KvSender&) = delete;

  const std::string& address() const { return address_; }

  // Sends `bytes` (> 0) at `data` as piece `piece_index` of transfer `id`, to
  // land at `offset` in the receiver's memory. Zero-copy: `data` must stay
  // valid and unchanged until wait(id) returns. Blocks while the in-flight
  // bounds are reached, until `until` at most. Returns false, sending
  // nothing, when the transfer already failed (the reason comes from wait).
  // Throws KvError: connection_lost when the connection is gone, timed_out
  // when the receiver took no piece by `until` (a stalled or, over shared
  // memory, dead receiver; follow with abandon()).
  bool send(uint64_t id, uint32_t piece_index, uint64_t offset, const void* data, size_t bytes,
            Deadline until = Deadline::max());

  // Sends [data, data + bytes) as pieces of at most piece_bytes, in order
  // (piece i at offset i * piece_bytes). Same contract as send().
  bool send_all(uint64_t id, const void* data, size_t bytes, size_t piece_bytes);

  // Waits until every piece of `id` has left this process's hands (its
  // memory is the caller's again) and the receiver's verdict is in, then
  // forgets the transfer. At `until` without a verdict: {timed_out}; if
  // pieces were still in flight then, the connection is cut first (a receiver
  // that holds a piece that long is stuck), so the memory is free either way.
  // (Over shared memory UCX has no peer-failure handling and cannot cut a
  // connection: after a short wait for the pieces it returns anyway. A
  // stopped receiver that wakes later may then read memory the caller has
  // reused; its checksum of each piece refuses what changed, so no wrong
  // KV lands, and the broken connection takes no more pieces.)
  TransferResult wait(uint64_t id, Deadline until);

  // Gives up on transfer `id` without waiting for a verdict (the caller's
  // prefill failed or was cancelled part way): returns once no piece of it is
  // in flight any more, so its memory is the caller's again, and forgets it.
  // At `until` with pieces still in flight the connection is cut first, as in
  // wait(). The receiver learns of the end from its owner (cancel) or its
  // deadline; pieces it already has stay unverified-complete there.
  void abandon(uint64_t id, Deadline until);

  // False once the connection is broken; every later send() throws.
  bool connected() const;
  // When this connection last handed a piece to UCX (its handshake, before any).
  Deadline last_sent() const;

  struct Impl;

 private:
  std::string address_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace disagg::kv
