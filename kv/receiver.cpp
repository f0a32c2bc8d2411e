// KvReceiver: a UCP listener and worker that accept pieces into memory
// registered per transfer.
//
// Everything here runs on the loop thread, except the "public side" of Impl,
// which reaches it through call() (the transfer table has one owner, no
// locks) or, for wait(), through the results map under results_mu_, and the
// verifier thread, which only hashes pieces handed to it.
//
// A piece arrives as an active message. Its handler (inside
// ucp_worker_progress) checks the header against the transfer and claims the
// byte range; then either the data is already here (eager: copied into place
// and checked at once) or UCX holds a rendezvous descriptor, and after
// progress returns the loop starts ucp_am_recv_data_nbx straight into the
// destination, so a large piece is never staged in a buffer of ours. When
// its bytes are in place the verifier hashes them. A transfer is final when
// all its bytes are verified, or when it failed and no piece is being written
// into or read from its memory any more.
#include <pthread.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>

#include "kv/address.h"
#include "kv/event_loop.h"
#include "kv/transfer.h"

namespace disagg::kv {

using detail::ucx_message;

namespace {

// How long the destructor waits for connections to close and pieces in
// flight to end before it gives up on them.
constexpr auto kShutdownTimeout = std::chrono::seconds(5);
// After a sender's bye, how long before our side of its connection is
// released (the sender closes its side at once; this covers its flush).
constexpr auto kByeLinger = std::chrono::seconds(1);

struct Connection {
  KvReceiver::Impl* owner = nullptr;
  ucp_ep_h ep = nullptr;
  bool failed = false;
  Deadline heard;  // its handshake or its last piece (ReceiverOptions::idle_connection)
};

// The longest idle_connection taken: a later point would overflow the clock.
constexpr auto kLongestIdle = std::chrono::hours(24 * 365);

struct Transfer {
  uint64_t id = 0;
  std::vector<Region> regions;
  std::vector<uint64_t> starts;  // offset of each region in the transfer's byte space
  uint64_t total = 0;
  Deadline deadline;
  KvReceiver::DoneCallback on_done;

  uint64_t bytes_done = 0;                              // received and verified
  std::vector<std::pair<uint64_t, uint64_t>> claimed;   // sorted, merged [begin, end)
  unsigned inflight = 0;                                // rendezvous receives writing into regions
  std::vector<Connection*> sources;                     // connections that sent pieces

  TransferStatus failure = TransferStatus::pending;    // set once; final when inflight == 0
  std::string detail;
  std::optional<uint32_t> failed_piece;
  Deadline drain_deadline = Deadline::max();
  std::vector<std::promise<void>*> release_waiters;    // cancel() callers
};

// One rendezvous receive in flight. Pooled: a steady stream of pieces
// allocates none.
struct PieceOp {
  KvReceiver::Impl* owner = nullptr;
  Transfer* transfer = nullptr;
  PieceHeader header;
  uint8_t* dest = nullptr;
  void* desc = nullptr;      // UCX's rendezvous descriptor
  bool checksum_ok = false;  // set by whoever hashed the landed bytes
};

struct OutMessage {  // a verdict or hello-ack, alive until UCX is done with its header
  wire::VerdictHeader verdict;
  wire::HelloHeader hello;
};

struct ContextHolder {  // first base: the context outlives the worker
  std::shared_ptr<KvContext> context;
};

}  // namespace

struct KvReceiver::Impl : ContextHolder, detail::EventLoop {
  Impl(std::shared_ptr<KvContext> ctx, const ReceiverOptions& options)
      : ContextHolder{std::move(ctx)}, EventLoop(context->native()), options_(options) {
    options_.idle_connection = std::min<std::chrono::milliseconds>(options_.idle_connection, kLongestIdle);
    set_handler(wire::kHello, &Impl::on_hello_am);
    set_handler(wire::kPiece, &Impl::on_piece_am);
    set_handler(wire::kBye, &Impl::on_bye_am);

    const detail::SocketAddress bind = detail::resolve(options.host, options.port);
    ucp_listener_params_t params{};
    params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    params.sockaddr.addr = bind.get();
    params.sockaddr.addrlen = bind.length;
    params.conn_handler.cb = &Impl::on_conn_request;
    params.conn_handler.arg = this;
    ucs_status_t status = ucp_listener_create(worker(), &params, &listener_);
    const std::string where = detail::format_address(options.host, options.port);
    if (status != UCS_OK) throw KvError(KvErrc::ucx_error, ucx_message("KV receiver cannot listen on " + where, status));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    status = ucp_listener_query(listener_, &attr);
    if (status != UCS_OK) {
      ucp_listener_destroy(listener_);
      throw KvError(KvErrc::ucx_error, ucx_message("ucp_listener_query", status));
    }
    address_ = detail::format_address(options.host, detail::port_of(attr.sockaddr));
    if (options.verify_thread) {
      verifier_ = std::thread([this] { verify_loop(); });
      pthread_setname_np(verifier_.native_handle(), "kv-verify");
    }
    start("kv-receiver");
  }

  ~Impl() override {
    call([this] { shut_down(); });
    stop_verifier();
    stop();
    destroy_worker();  // (receives still pending complete into the transfers and ops: alive until then)
  }

  // ---------------------------------------------------------------- public side (via call)

  void expect(uint64_t id, std::vector<Region> regions, Deadline deadline, DoneCallback on_done) {
    auto t = std::make_unique<Transfer>();
    t->id = id;
    for (const Region& r : regions) {
      t->starts.push_back(t->total);
      t->total += r.bytes;
    }
    t->regions = std::move(regions);
    t->deadline = deadline;
    t->on_done = std::move(on_done);
    call([&] {
      if (shutting_down_) throw KvError(KvErrc::invalid_argument, "KV receiver is shutting down");
      if (transfers_.count(id) != 0) {
        throw KvError(KvErrc::invalid_argument, "transfer " + std::to_string(id) + " is already expected");
      }
      next_timer_ = std::min(next_timer_, deadline);
      transfers_.emplace(id, std::move(t));
      ++pending_count_;
    });
  }

  bool cancel(uint64_t id) {
    std::promise<void> released;
    const bool blocking = !on_loop_thread();
    const bool found = call([&] {
      auto it = transfers_.find(id);
      if (it == transfers_.end()) return false;
      // One that failed already but still has pieces being written into its
      // memory (draining) is waited for too, its failure kept: returning at
      // once handed memory UCX still wrote into back to the caller.
      if (blocking) it->second->release_waiters.push_back(&released);
      fail(*it->second, TransferStatus::cancelled, "cancelled by the receiver");
      return true;
    });
    if (found && blocking) released.get_future().wait();
    return found;
  }

  Dropped drop(uint64_t id) {
    return call([&] {
      auto it = transfers_.find(id);
      if (it == transfers_.end()) return Dropped::unknown;
      Transfer& t = *it->second;
      fail(t, TransferStatus::cancelled, "cancelled by the receiver");
      return t.inflight == 0 ? Dropped::released : Dropped::draining;  // (released: finished, out of the table)
    });
  }

  size_t receives_in_flight() {
    return call([this] {
      size_t n = 0;
      for (const auto& [id, t] : transfers_) n += t->inflight;
      return n;
    });
  }

  TransferResult wait(uint64_t id, Deadline until) {
    std::unique_lock<std::mutex> lock(results_mu_);
    if (!results_cv_.wait_until(lock, until, [&] { return results_.count(id) != 0; })) {
      TransferResult pending;
      pending.transfer_id = id;
      return pending;
    }
    auto node = results_.extract(id);
    return std::move(node.mapped());
  }

  const std::string& address() const { return address_; }
  size_t pending_count() const { return pending_count_.load(); }
  size_t connection_count() { return call([this] { return connections_.size(); }); }

 private:
  // ---------------------------------------------------------------- UCX callbacks (record, defer)

  void set_handler(unsigned id, ucp_am_recv_callback_t cb) { detail::set_am_handler(worker(), id, cb, this); }

  static void on_conn_request(ucp_conn_request_h request, void* arg) {
    static_cast<Impl*>(arg)->conn_requests_.push_back(request);
  }

  // The peer died or closed: mark it; the loop sweeps it after progress.
  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t) {
    auto* conn = static_cast<Connection*>(arg);
    conn->failed = true;
    conn->owner->sweep_needed_ = true;
  }

  static ucs_status_t on_hello_am(void* arg, const void* header, size_t header_length, void*, size_t,
                                  const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    wire::HelloHeader hello;
    // Another build or not a KV sender: no answer, its handshake times out.
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || !wire::read_header(header, header_length, &hello))
      return UCS_OK;
    self->hello_acks_.push_back(param->reply_ep);
    return UCS_OK;
  }

  static ucs_status_t on_bye_am(void* arg, const void*, size_t, void*, size_t, const ucp_am_recv_param_t* param) {
    if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) static_cast<Impl*>(arg)->byes_.push_back(param->reply_ep);
    return UCS_OK;
  }

  static ucs_status_t on_piece_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param) {
    return static_cast<Impl*>(arg)->on_piece(header, header_length, data, length, param);
  }

  ucs_status_t on_piece(const void* raw_header, size_t header_length, void* data, size_t length,
                        const ucp_am_recv_param_t* param) {
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    // For a rendezvous piece a status other than OK/INPROGRESS drops the data
    // and completes the sender's send with that status; an eager piece is
    // simply dropped. The verdict message says why.
    const ucs_status_t refuse = rndv ? UCS_ERR_REJECTED : UCS_OK;
    Connection* source = nullptr;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
      auto it = connections_.find(param->reply_ep);
      if (it != connections_.end()) source = it->second.get();
    }
    if (source) source->heard = Clock::now();
    if (header_length != sizeof(PieceHeader)) return refuse;  // cannot even name the transfer
    PieceHeader h;
    std::memcpy(&h, raw_header, sizeof h);

    auto it = transfers_.find(h.transfer_id);
    if (it == transfers_.end()) {
      // Final but not yet delivered (it failed in this round of progress):
      // its verdict goes to this source too, and must be the first it hears.
      for (auto& done : finished_) {
        if (done->id == h.transfer_id) {
          add_source(*done, source);
          return refuse;
        }
      }
      queue_verdict(source, h.transfer_id, TransferStatus::unknown_transfer, 0, h.piece_index);
      return refuse;
    }
    Transfer& t = *it->second;
    add_source(t, source);
    if (t.failure != TransferStatus::pending) return refuse;  // failed, draining: the verdict follows
    // Only a failure builds a message (no allocation per piece).
    const auto piece = [&] { return "piece " + std::to_string(h.piece_index); };
    if (h.magic != wire::kMagic || h.version != wire::kVersion) {
      fail(t, TransferStatus::protocol_error, piece() + ": wrong magic or version", h.piece_index);
      return refuse;
    }
    if (rndv && source == nullptr) {
      // A receive into the transfer's memory that we could not end: the
      // drain deadline cuts the connections a transfer's pieces came from,
      // and this one names none (sent without UCP_AM_SEND_FLAG_REPLY, which
      // our sender always sets), so a stalled sender would hold cancel() for
      // ever.
      fail(t, TransferStatus::protocol_error, piece() + ": a large piece from a connection that cannot be named",
           h.piece_index);
      return refuse;
    }
    if (h.length != length || length == 0) {
      fail(t, TransferStatus::protocol_error,
           piece() + ": header says " + std::to_string(h.length) + " bytes, message carries " + std::to_string(length),
           h.piece_index);
      return refuse;
    }
    if (h.offset > t.total || h.length > t.total - h.offset) {
      fail(t, TransferStatus::out_of_range,
           piece() + " [" + std::to_string(h.offset) + ", +" + std::to_string(h.length) + ") exceeds the " +
               std::to_string(t.total) + " expected bytes",
           h.piece_index);
      return refuse;
    }
    const size_t r = size_t(std::upper_bound(t.starts.begin(), t.starts.end(), h.offset) - t.starts.begin()) - 1;
    if (h.offset + h.length > t.starts[r] + t.regions[r].bytes) {
      fail(t, TransferStatus::out_of_range, piece() + " crosses the end of region " + std::to_string(r),
           h.piece_index);
      return refuse;
    }
    if (!claim(t, h.offset, h.offset + h.length)) {
      fail(t, TransferStatus::overlap, piece() + " overlaps bytes already received", h.piece_index);
      return refuse;
    }
    uint8_t* dest = static_cast<uint8_t*>(t.regions[r].data) + (h.offset - t.starts[r]);
    if (!rndv) {  // small: copy and check at once
      std::memcpy(dest, data, length);
      counted(t, h, piece_checksum(dest, h.length, h.offset) == h.checksum);
      return UCS_OK;
    }
    PieceOp* op = acquire_op();
    op->transfer = &t;
    op->header = h;
    op->dest = dest;
    op->desc = data;
    ++t.inflight;
    rndv_starts_.push_back(op);  // ucp_am_recv_data_nbx after progress returns
    return UCS_INPROGRESS;
  }

  static void on_recv_done(void* request, ucs_status_t status, size_t, void* user_data) {
    auto* op = static_cast<PieceOp*>(user_data);
    op->owner->piece_landed(op, status);
    ucp_request_free(request);
  }

  static void on_message_sent(void* request, ucs_status_t, void* user_data) {
    delete static_cast<OutMessage*>(user_data);
    ucp_request_free(request);
  }

  // ---------------------------------------------------------------- transfer state

  static bool claim(Transfer& t, uint64_t begin, uint64_t end) {
    auto& c = t.claimed;
    auto next = std::lower_bound(c.begin(), c.end(), std::make_pair(begin, uint64_t(0)));
    if (next != c.end() && next->first < end) return false;
    if (next != c.begin() && std::prev(next)->second > begin) return false;
    // Merge with neighbours so that pieces sent in order keep one entry.
    const bool joins_prev = next != c.begin() && std::prev(next)->second == begin;
    const bool joins_next = next != c.end() && next->first == end;
    if (joins_prev && joins_next) {
      std::prev(next)->second = next->second;
      c.erase(next);
    } else if (joins_prev) {
      std::prev(next)->second = end;
    } else if (joins_next) {
      next->first = begin;
    } else {
      c.insert(next, {begin, end});
    }
    return true;
  }

  static void add_source(Transfer& t, Connection* source) {
    if (source != nullptr && std::find(t.sources.begin(), t.sources.end(), source) == t.sources.end()) {
      t.sources.push_back(source);
    }
  }

  // A rendezvous receive ended. With a verifier thread the checksum is taken
  // there, so that this thread goes on with the next piece's copy meanwhile;
  // the piece stays in flight (its memory is being read) until it is checked.
  void piece_landed(PieceOp* op, ucs_status_t status) {
    if (status == UCS_OK && op->transfer->failure == TransferStatus::pending) {
      if (verifier_.joinable()) {
        {
          std::lock_guard<std::mutex> lock(verify_mu_);
          to_verify_.push_back(op);
        }
        verify_cv_.notify_one();
        return;
      }
      op->checksum_ok = piece_checksum(op->dest, op->header.length, op->header.offset) == op->header.checksum;
    }
    piece_checked(op, status);
  }

  void piece_checked(PieceOp* op, ucs_status_t status) {
    Transfer& t = *op->transfer;
    --t.inflight;
    if (t.failure == TransferStatus::pending) {
      if (status != UCS_OK) {
        fail(t, TransferStatus::peer_failed,
             ucx_message("piece " + std::to_string(op->header.piece_index) + ": receive failed", status),
             op->header.piece_index);
      } else {
        counted(t, op->header, op->checksum_ok);
      }
    } else if (t.inflight == 0) {
      finish(t);
    }
    release_op(op);
  }

  // The piece's bytes are in place and were hashed: count them, or fail.
  void counted(Transfer& t, const PieceHeader& h, bool checksum_ok) {
    if (!checksum_ok) {
      fail(t, TransferStatus::bad_checksum,
           "piece " + std::to_string(h.piece_index) + " [" + std::to_string(h.offset) + ", +" +
               std::to_string(h.length) + "): checksum mismatch",
           h.piece_index);
      return;
    }
    t.bytes_done += h.length;
    if (t.bytes_done == t.total) finish(t);
  }

  // The verifier thread: hashes landed pieces, hands them back to the loop.
  void verify_loop() {
    std::vector<PieceOp*> batch;
    std::unique_lock<std::mutex> lock(verify_mu_);
    for (;;) {
      verify_cv_.wait(lock, [&] { return verify_stop_ || !to_verify_.empty(); });
      if (to_verify_.empty()) return;  // stopping, nothing left
      batch.swap(to_verify_);
      lock.unlock();
      for (PieceOp* op : batch) {
        op->checksum_ok = piece_checksum(op->dest, op->header.length, op->header.offset) == op->header.checksum;
      }
      lock.lock();
      verified_.insert(verified_.end(), batch.begin(), batch.end());
      batch.clear();
      wake();
    }
  }

  void stop_verifier() {
    if (!verifier_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(verify_mu_);
      verify_stop_ = true;
    }
    verify_cv_.notify_one();
    verifier_.join();
  }

  void fail(Transfer& t, TransferStatus status, std::string detail, std::optional<uint32_t> piece = {}) {
    if (t.failure != TransferStatus::pending) return;
    t.failure = status;
    t.detail = std::move(detail);
    t.failed_piece = piece;
    if (t.inflight == 0) {
      finish(t);
    } else {
      // Pieces are still being written into the memory: it is released when
      // they end, or when their connections are cut at the drain deadline.
      t.drain_deadline = Clock::now() + options_.drain_timeout;
      next_timer_ = std::min(next_timer_, t.drain_deadline);
    }
  }

  // Final: out of the table, delivered after this round of progress.
  void finish(Transfer& t) {
    if (t.failure == TransferStatus::pending) t.failure = TransferStatus::complete;
    auto node = transfers_.extract(t.id);
    finished_.push_back(std::move(node.mapped()));
    --pending_count_;
  }

  PieceOp* acquire_op() {
    if (free_ops_.empty()) {
      all_ops_.push_back(std::make_unique<PieceOp>());
      all_ops_.back()->owner = this;
      return all_ops_.back().get();
    }
    PieceOp* op = free_ops_.back();
    free_ops_.pop_back();
    return op;
  }
  void release_op(PieceOp* op) { free_ops_.push_back(op); }

  // ---------------------------------------------------------------- sending control messages

  void queue_verdict(Connection* to, uint64_t id, TransferStatus status, uint64_t bytes,
                     std::optional<uint32_t> piece) {
    if (to == nullptr || to->failed) return;
    auto* msg = new OutMessage;
    msg->verdict.transfer_id = id;
    msg->verdict.status = uint8_t(status);
    msg->verdict.bytes_received = bytes;
    msg->verdict.has_piece = piece ? 1 : 0;
    msg->verdict.piece_index = piece.value_or(0);
    outgoing_.push_back({to->ep, wire::kVerdict, msg});
  }

  void send_outgoing() {
    for (const Outgoing& out : outgoing_) {
      auto it = connections_.find(out.ep);
      if (it == connections_.end() || it->second->failed) {
        delete out.msg;
        continue;
      }
      const void* header = out.id == wire::kVerdict ? static_cast<const void*>(&out.msg->verdict)
                                                     : static_cast<const void*>(&out.msg->hello);
      const size_t header_length = out.id == wire::kVerdict ? sizeof(wire::VerdictHeader) : sizeof(wire::HelloHeader);
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      param.cb.send = &Impl::on_message_sent;
      param.user_data = out.msg;
      ucs_status_ptr_t request = ucp_am_send_nbx(out.ep, out.id, header, header_length, nullptr, 0, &param);
      if (!UCS_PTR_IS_PTR(request)) delete out.msg;  // done at once, or failed (the peer learns by timeout)
    }
    outgoing_.clear();
  }

  // ---------------------------------------------------------------- the loop's deferred work

  bool after_progress(Deadline now) override {
    bool did = false;
    for (ucp_conn_request_h request : conn_requests_) {
      accept(request);
      did = true;
    }
    conn_requests_.clear();

    for (ucp_ep_h ep : hello_acks_) {
      auto it = connections_.find(ep);
      if (it == connections_.end()) continue;
      it->second->heard = now;
      outgoing_.push_back({ep, wire::kHelloAck, new OutMessage});
    }
    hello_acks_.clear();

    // Swap out first: a receive that completes at once lands (and may queue
    // more work) while we iterate.
    if (!rndv_starts_.empty()) {
      starting_.swap(rndv_starts_);
      for (PieceOp* op : starting_) start_receive(op);
      starting_.clear();
      did = true;
    }

    for (ucp_ep_h ep : byes_) {
      auto it = connections_.find(ep);
      if (it == connections_.end()) continue;
      drop_source(it->second.get(), "the sender closed the connection");
      // The sender closes its side now; ours is released once it is gone
      // (a flush would race its disconnect).
      parting_.push_back({std::move(it->second), now + kByeLinger});
      next_timer_ = std::min(next_timer_, now + kByeLinger);
      connections_.erase(it);
      did = true;
    }
    byes_.clear();
    {
      std::lock_guard<std::mutex> lock(verify_mu_);
      checked_.swap(verified_);
    }
    if (!checked_.empty()) {
      for (PieceOp* op : checked_) piece_checked(op, UCS_OK);
      checked_.clear();
      did = true;
    }
    if (sweep_needed_ && sweep_failed_connections()) did = true;
    if (now >= next_timer_) run_timers(now);

    if (!finished_.empty()) {
      deliver_finished();
      did = true;
    }
    if (!outgoing_.empty()) {
      send_outgoing();
      did = true;
    }
    reap_closed();
    return did;
  }

  Deadline next_timer() const override { return next_timer_; }

  void accept(ucp_conn_request_h request) {
    if (shutting_down_) {
      ucp_listener_reject(listener_, request);
      return;
    }
    auto conn = std::make_unique<Connection>();
    conn->owner = this;
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.conn_request = request;
    if (context->options().peer_failure_detection) {
      params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails its requests instead of hanging them
      params.err_handler.cb = &Impl::on_ep_error;
      params.err_handler.arg = conn.get();
    } else {
      params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    }
    if (ucp_ep_create(worker(), &params, &conn->ep) != UCS_OK) return;  // the peer's handshake fails
    conn->heard = Clock::now();
    next_timer_ = std::min(next_timer_, conn->heard + options_.idle_connection);
    connections_.emplace(conn->ep, std::move(conn));
  }

  void start_receive(PieceOp* op) {
    if (op->transfer->failure != TransferStatus::pending) {
      // Failed before its bytes moved: release the rendezvous descriptor
      // (UCX completes the sender's send) instead of pulling bytes nobody
      // wants; the verdict tells the sender why.
      ucp_am_data_release(worker(), op->desc);
      piece_landed(op, UCS_ERR_CANCELED);
      return;
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.recv_am = &Impl::on_recv_done;
    param.user_data = op;
    ucs_status_ptr_t request = ucp_am_recv_data_nbx(worker(), op->desc, op->dest, op->header.length, &param);
    if (request == nullptr) {
      piece_landed(op, UCS_OK);
    } else if (UCS_PTR_IS_ERR(request)) {
      piece_landed(op, UCS_PTR_STATUS(request));
    }
  }

  bool sweep_failed_connections() {
    sweep_needed_ = false;
    bool any = false;
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (!it->second->failed) {
        ++it;
        continue;
      }
      drop_source(it->second.get(), "the sender's connection broke");
      close(std::move(it->second), context->options().peer_failure_detection);
      it = connections_.erase(it);
      any = true;
    }
    return any;
  }

  // Closes the connections silent for idle_connection that feed no
  // transfer (a sender killed without its bye: shared memory never breaks
  // its connection); returns when to look again.
  Deadline close_idle_connections(Deadline now) {
    Deadline next = Deadline::max();
    for (auto it = connections_.begin(); it != connections_.end();) {
      Connection* conn = it->second.get();
      const Deadline quiet_until = conn->heard + options_.idle_connection;
      if (conn->failed) {
        ++it;  // (the sweep's)
      } else if (now < quiet_until) {
        next = std::min(next, quiet_until);
        ++it;
      } else if (feeds_a_transfer(conn)) {
        next = std::min(next, now + options_.idle_connection);
        ++it;
      } else {
        drop_source(conn, "the sender's connection was idle");  // (finished transfers' verdicts forget it)
        // (forced only with peer-failure handling, as UCX requires: an idle
        // connection has nothing in flight, so its flush ends at once)
        close(std::move(it->second), context->options().peer_failure_detection);
        it = connections_.erase(it);
      }
    }
    return next;
  }

  bool feeds_a_transfer(const Connection* conn) const {
    for (const auto& [id, t] : transfers_)
      if (std::find(t->sources.begin(), t->sources.end(), conn) != t->sources.end()) return true;
    return false;
  }

  // A connection is gone: transfers it fed fail (others continue).
  void drop_source(Connection* conn, const std::string& why) {
    std::vector<Transfer*> fed;
    for (auto& [id, t] : transfers_) {
      auto s = std::find(t->sources.begin(), t->sources.end(), conn);
      if (s == t->sources.end()) continue;
      t->sources.erase(s);
      fed.push_back(t.get());
    }
    for (Transfer* t : fed) fail(*t, TransferStatus::peer_failed, why);
    for (auto& t : finished_) t->sources.erase(std::remove(t->sources.begin(), t->sources.end(), conn), t->sources.end());
  }

  // Forced: outstanding requests complete with an error now. UCX allows it
  // with peer-failure handling on both ends, or once the peer is gone;
  // otherwise: flush, then disconnect.
  // The Connection (the error handler's argument) lives until the close is done.
  void close(std::unique_ptr<Connection> conn, bool force) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t request = ucp_ep_close_nbx(conn->ep, &param);
    if (UCS_PTR_IS_PTR(request)) closing_.push_back({request, std::move(conn)});
  }

  void reap_closed() {
    for (auto it = closing_.begin(); it != closing_.end();) {
      if (ucp_request_check_status(it->request) == UCS_INPROGRESS) {
        ++it;
      } else {
        ucp_request_free(it->request);
        it = closing_.erase(it);
      }
    }
  }

  void run_timers(Deadline now) {
    Deadline next = Deadline::max();
    for (auto it = parting_.begin(); it != parting_.end();) {
      if (now >= it->second) {
        close(std::move(it->first), /*force=*/true);  // the peer has gone
        it = parting_.erase(it);
      } else {
        next = std::min(next, it->second);
        ++it;
      }
    }
    next = std::min(next, close_idle_connections(now));
    std::vector<Transfer*> expired, stuck;
    for (auto& [id, t] : transfers_) {
      if (t->failure == TransferStatus::pending) {
        if (now >= t->deadline) expired.push_back(t.get());
        else next = std::min(next, t->deadline);
      } else if (t->inflight > 0) {
        if (now >= t->drain_deadline) stuck.push_back(t.get());
        else next = std::min(next, t->drain_deadline);
      }
    }
    next_timer_ = next;  // fail() lowers it again for a transfer that must drain
    for (Transfer* t : expired) {
      fail(*t, TransferStatus::expired,
           "not complete by its deadline (" + std::to_string(t->bytes_done) + " of " + std::to_string(t->total) +
               " bytes)");
    }
    for (Transfer* t : stuck) {
      // Cutting the connections ends the receives that write into its memory
      // (they complete with an error and the transfer finishes). Without
      // peer-failure handling UCX cannot cut them: wait for the writes.
      t->drain_deadline = Deadline::max();
      if (!context->options().peer_failure_detection) continue;
      for (Connection* conn : t->sources) conn->failed = true;
      sweep_needed_ = true;
    }
    if (sweep_needed_) sweep_failed_connections();
  }

  void deliver_finished() {
    std::vector<std::unique_ptr<Transfer>> done;
    done.swap(finished_);
    for (auto& t : done) {
      TransferResult result;
      result.transfer_id = t->id;
      result.status = t->failure;
      result.bytes_received = t->bytes_done;
      result.detail = t->detail;
      for (Connection* conn : t->sources) queue_verdict(conn, t->id, result.status, t->bytes_done, t->failed_piece);
      for (std::promise<void>* waiter : t->release_waiters) waiter->set_value();
      if (t->on_done) {
        t->on_done(result);
      } else {
        std::lock_guard<std::mutex> lock(results_mu_);
        results_[t->id] = std::move(result);
        results_cv_.notify_all();
      }
    }
  }

  void shut_down() {
    shutting_down_ = true;
    std::vector<Transfer*> all;
    for (auto& [id, t] : transfers_) all.push_back(t.get());
    for (Transfer* t : all) fail(*t, TransferStatus::cancelled, "the receiver shut down");
    for (auto& [ep, conn] : connections_) conn->failed = true;
    sweep_failed_connections();
    for (auto& [conn, when] : parting_) close(std::move(conn), /*force=*/true);
    parting_.clear();
    const Deadline give_up = Clock::now() + kShutdownTimeout;
    while ((!transfers_.empty() || !closing_.empty() || !finished_.empty()) && Clock::now() < give_up) {
      while (ucp_worker_progress(worker()) != 0) {
      }
      after_progress(Clock::now());
    }
    ucp_listener_destroy(listener_);
  }

  struct Outgoing {
    ucp_ep_h ep;
    unsigned id;
    OutMessage* msg;
  };

  ReceiverOptions options_;
  ucp_listener_h listener_ = nullptr;
  std::string address_;
  bool shutting_down_ = false;
  bool sweep_needed_ = false;  // some connection failed since the last sweep

  std::unordered_map<uint64_t, std::unique_ptr<Transfer>> transfers_;
  std::unordered_map<ucp_ep_h, std::unique_ptr<Connection>> connections_;
  std::atomic<size_t> pending_count_{0};
  Deadline next_timer_ = Deadline::max();

  // Queued by UCX callbacks, handled in after_progress.
  std::vector<ucp_conn_request_h> conn_requests_;
  std::vector<ucp_ep_h> hello_acks_;
  std::vector<ucp_ep_h> byes_;
  std::vector<std::pair<std::unique_ptr<Connection>, Deadline>> parting_;  // said bye; released at the deadline
  std::vector<PieceOp*> rndv_starts_, starting_;
  std::vector<std::unique_ptr<Transfer>> finished_;
  std::vector<Outgoing> outgoing_;
  struct Closing {
    void* request;
    std::unique_ptr<Connection> conn;
  };
  std::vector<Closing> closing_;

  // The verifier: landed rendezvous pieces in, checked ones out.
  std::thread verifier_;
  std::mutex verify_mu_;
  std::condition_variable verify_cv_;
  bool verify_stop_ = false;
  std::vector<PieceOp*> to_verify_, verified_;
  std::vector<PieceOp*> checked_;  // loop thread: verified_, swapped out

  std::vector<std::unique_ptr<PieceOp>> all_ops_;
  std::vector<PieceOp*> free_ops_;

  std::mutex results_mu_;
  std::condition_variable results_cv_;
  std::unordered_map<uint64_t, TransferResult> results_;
};

// -------------------------------------------------------------------- KvReceiver

KvReceiver::KvReceiver(std::shared_ptr<KvContext> context, const ReceiverOptions& options)
    : impl_(std::make_unique<Impl>(std::move(context), options)) {}

KvReceiver::~KvReceiver() = default;

std::string KvReceiver::address() const { return impl_->address(); }

void KvReceiver::expect(uint64_t id, std::vector<Region> regions, Deadline deadline, DoneCallback on_done) {
  if (id == 0) throw KvError(KvErrc::invalid_argument, "transfer id 0 is reserved");
  if (regions.empty()) throw KvError(KvErrc::invalid_argument, "a transfer needs at least one region");
  for (const Region& r : regions) {
    if (r.data == nullptr || r.bytes == 0) throw KvError(KvErrc::invalid_argument, "an empty or null region");
  }
  impl_->expect(id, std::move(regions), deadline, std::move(on_done));
}

void KvReceiver::expect(uint64_t id, void* dest, size_t bytes, Deadline deadline, DoneCallback on_done) {
  expect(id, std::vector<Region>{Region{dest, bytes}}, deadline, std::move(on_done));
}

TransferResult KvReceiver::wait(uint64_t id, Deadline until) { return impl_->wait(id, until); }

bool KvReceiver::cancel(uint64_t id) { return impl_->cancel(id); }
Dropped KvReceiver::drop(uint64_t id) { return impl_->drop(id); }
size_t KvReceiver::receives_in_flight() const { return impl_->receives_in_flight(); }

size_t KvReceiver::pending_transfers() const { return impl_->pending_count(); }
size_t KvReceiver::connections() const { return impl_->connection_count(); }

}  // namespace disagg::kv
