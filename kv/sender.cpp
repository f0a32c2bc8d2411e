// KvSender: one UCP endpoint to one receiver, and bounded pieces in flight.
//
// send() runs on the caller's thread: it checksums the piece, waits for
// budget (bytes and slots in flight), fills a preallocated slot with the
// header and queues the slot's index; the loop thread hands queued slots to
// ucp_am_send_nbx (zero-copy from the caller's memory: rendezvous for large
// pieces, so the receiver pulls the bytes straight into its destination) and
// frees the slot when UCX reports the send complete. Verdicts from the
// receiver and completions meet in `transfers_` under `mu_`, where wait()
// looks for them. No UCX call is made outside the loop thread.
#include <ucp/api/ucp.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "kv/address.h"
#include "kv/event_loop.h"
#include "kv/transfer.h"

namespace disagg::kv {

using detail::ucx_message;

namespace {

// How long the destructor lets pieces in flight finish, and then the
// connection close, before it stops waiting.
constexpr auto kDrainOnCloseTimeout = std::chrono::seconds(2);
constexpr auto kCloseTimeout = std::chrono::seconds(2);
// After wait() cuts the connection, how long it waits for UCX to fail the
// pieces still in flight (a forced close fails them at once).
constexpr auto kCutTimeout = std::chrono::seconds(2);

struct ContextHolder {  // first base: the context outlives the worker
  std::shared_ptr<KvContext> context;
};

struct Slot {
  KvSender::Impl* owner = nullptr;
  PieceHeader header;  // UCX reads it until the send completes
  const void* data = nullptr;
  size_t bytes = 0;
};

struct SentTransfer {
  unsigned outstanding = 0;  // pieces handed over and not yet completed
  bool refused = false;      // a piece's send failed (the verdict says why)
  ucs_status_t refusal = UCS_OK;
  bool verdict_in = false;
  wire::VerdictHeader verdict;
};

}  // namespace

struct KvSender::Impl : ContextHolder, detail::EventLoop {
  Impl(std::shared_ptr<KvContext> ctx, const std::string& address, const SenderOptions& options)
      : ContextHolder{std::move(ctx)}, EventLoop(context->native()), address_(address), options_(options) {
    if (options_.max_inflight_pieces == 0 || options_.max_inflight_bytes == 0) {
      throw KvError(KvErrc::invalid_argument, "max_inflight_pieces and max_inflight_bytes must be positive");
    }
    const detail::HostPort hp = detail::parse_address(address);
    const detail::SocketAddress peer = detail::resolve(hp.host, hp.port);
    set_handler(wire::kHelloAck, &Impl::on_hello_ack_am);
    set_handler(wire::kVerdict, &Impl::on_verdict_am);
    slots_.resize(options_.max_inflight_pieces);
    for (uint32_t i = 0; i < options_.max_inflight_pieces; ++i) {
      slots_[i].owner = this;
      free_slots_.push_back(options_.max_inflight_pieces - 1 - i);
    }
    submit_.reserve(slots_.size());
    submitting_.reserve(slots_.size());
    start("kv-sender");
    try {
      call([&] { connect(peer); });
      std::unique_lock<std::mutex> lock(mu_);
      const bool answered = cv_.wait_for(lock, options_.connect_timeout, [&] { return hello_acked_ || broken_; });
      if (broken_) throw KvError(KvErrc::unreachable, "cannot reach the KV receiver at " + address_ + ": " + reason_);
      if (!answered) {
        throw KvError(KvErrc::timed_out, "the KV receiver at " + address_ + " did not answer within " +
                                             std::to_string(options_.connect_timeout.count()) + " ms");
      }
    } catch (...) {
      tear_down();
      throw;
    }
  }

  ~Impl() override {
    tear_down();
    destroy_worker();  // (its pending sends complete into slots_ and transfers_: alive until then)
  }

  // ---------------------------------------------------------------- public side

  bool send(uint64_t id, uint32_t piece_index, uint64_t offset, const void* data, size_t bytes, Deadline until) {
    if (id == 0) throw KvError(KvErrc::invalid_argument, "transfer id 0 is reserved");
    if (data == nullptr || bytes == 0) throw KvError(KvErrc::invalid_argument, "a piece needs bytes");
    PieceHeader header;
    header.transfer_id = id;
    header.piece_index = piece_index;
    header.offset = offset;
    header.length = bytes;
    header.checksum = piece_checksum(data, bytes, offset);  // outside the lock: the expensive part
    if (options_.after_checksum) options_.after_checksum(header, data, bytes);

    std::unique_lock<std::mutex> lock(mu_);
    // A piece larger than the byte budget goes when nothing else is in flight.
    const bool room = cv_.wait_until(lock, until, [&] {
      return broken_ || (!free_slots_.empty() &&
                         (inflight_bytes_ == 0 || inflight_bytes_ + bytes <= options_.max_inflight_bytes));
    });
    if (broken_) throw KvError(KvErrc::connection_lost, "KV connection to " + address_ + ": " + reason_);
    if (!room)
      throw KvError(KvErrc::timed_out, "KV connection to " + address_ + ": the receiver took no piece in time (" +
                                           std::to_string(inflight_bytes_) + " bytes in flight)");
    SentTransfer& t = transfers_[id];
    if (t.refused || t.verdict_in) return false;
    const uint32_t index = free_slots_.back();
    free_slots_.pop_back();
    Slot& slot = slots_[index];
    slot.header = header;
    slot.data = data;
    slot.bytes = bytes;
    inflight_bytes_ += bytes;
    ++t.outstanding;
    last_sent_ = Clock::now();
    const bool was_idle = submit_.empty();
    submit_.push_back(index);
    lock.unlock();
    if (was_idle) wake();  // otherwise a wake-up is already on its way
    return true;
  }

  TransferResult wait(uint64_t id, Deadline until) {
    TransferResult result;
    result.transfer_id = id;
    std::unique_lock<std::mutex> lock(mu_);
    auto it = transfers_.find(id);
    if (it == transfers_.end()) {
      result.status = TransferStatus::unknown_transfer;
      result.detail = "nothing was sent for this transfer";
      return result;
    }
    SentTransfer& t = it->second;  // references survive rehashing
    const bool settled =
        cv_.wait_until(lock, until, [&] { return t.outstanding == 0 && (t.verdict_in || broken_); });
    if (!settled && t.outstanding > 0) {
      // The caller's memory must be free when we return: cut the connection,
      // which fails the sends still in flight.
      lock.unlock();
      call([this] { cut("no verdict by the sender's wait deadline"); });
      lock.lock();
      cv_.wait_for(lock, kCutTimeout, [&] { return t.outstanding == 0; });
    }
    if (t.verdict_in) {
      result.status = TransferStatus(t.verdict.status);
      result.bytes_received = t.verdict.bytes_received;
      if (!result.ok()) {
        result.detail = std::string("the receiver reports ") + to_string(result.status) +
                        (t.verdict.has_piece ? " at piece " + std::to_string(t.verdict.piece_index) : "");
      }
    } else if (broken_) {
      result.status = TransferStatus::peer_failed;
      result.detail = "KV connection to " + address_ + ": " + reason_;
    } else {
      result.status = TransferStatus::timed_out;
      result.detail = "no verdict from " + address_ + " by the deadline";
    }
    transfers_.erase(id);
    return result;
  }

  void abandon(uint64_t id, Deadline until) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = transfers_.find(id);
    if (it == transfers_.end()) return;
    SentTransfer& t = it->second;
    if (!cv_.wait_until(lock, until, [&] { return t.outstanding == 0; })) {
      lock.unlock();
      call([this] { cut("a transfer was abandoned with pieces in flight"); });
      lock.lock();
      cv_.wait_for(lock, kCutTimeout, [&] { return t.outstanding == 0; });
    }
    transfers_.erase(id);
  }

  bool connected() const {
    std::lock_guard<std::mutex> lock(mu_);
    return !broken_;
  }
  Deadline last_sent() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_sent_;
  }

 private:
  // ---------------------------------------------------------------- setup and teardown (loop thread)

  void set_handler(unsigned id, ucp_am_recv_callback_t cb) { detail::set_am_handler(worker(), id, cb, this); }

  void connect(const detail::SocketAddress& peer) {
    ucp_ep_params_t params{};
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = peer.get();
    params.sockaddr.addrlen = peer.length;
    if (context->options().peer_failure_detection) {
      params.err_mode = UCP_ERR_HANDLING_MODE_PEER;  // a dead peer fails requests instead of hanging them
      params.err_handler.cb = &Impl::on_ep_error;
      params.err_handler.arg = this;
    } else {
      params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    }
    const ucs_status_t status = ucp_ep_create(worker(), &params, &ep_);
    if (status != UCS_OK) {
      ep_ = nullptr;
      throw KvError(KvErrc::unreachable, ucx_message("cannot reach the KV receiver at " + address_, status));
    }
    // The handshake: the receiver answers only a sender of this build.
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    param.cb.send = &Impl::on_control_sent;
    ucs_status_ptr_t request = ucp_am_send_nbx(ep_, wire::kHello, &hello_, sizeof hello_, nullptr, 0, &param);
    if (UCS_PTR_IS_ERR(request)) mark_broken(ucs_status_string(UCS_PTR_STATUS(request)));
  }

  // Lets the pieces in flight finish (briefly), closes the connection, stops the thread.
  void tear_down() {
    if (!on_loop_thread()) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, kDrainOnCloseTimeout, [&] { return broken_ || inflight_bytes_ == 0; });
    }
    call([this] {
      if (ep_ != nullptr) {
        std::unique_lock<std::mutex> lock(mu_);
        // Flush-close only a healthy connection with nothing in flight;
        // anything else would wait for a peer that is not going to answer.
        const bool force = broken_ || !hello_acked_ || inflight_bytes_ != 0;
        lock.unlock();
        if (!force) say_bye();
        close_ep(force);
      }
      const Deadline give_up = Clock::now() + kCloseTimeout;
      while (close_request_ != nullptr && Clock::now() < give_up) {
        while (ucp_worker_progress(worker()) != 0) {
        }
        after_progress(Clock::now());
      }
      if (close_request_ != nullptr) {  // given up on: UCX frees it when it ends (at the worker's destruction)
        ucp_request_free(close_request_);
        close_request_ = nullptr;
      }
    });
    stop();
  }

  // Tells the receiver to close its side now, while this side still answers
  // its flush (the close below flushes the bye out first).
  void say_bye() {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;
    param.cb.send = &Impl::on_control_sent;
    ucp_am_send_nbx(ep_, wire::kBye, &hello_, sizeof hello_, nullptr, 0, &param);  // best effort
  }

  void close_ep(bool force) {
    if (ep_ == nullptr) return;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // Forcing needs peer-failure handling on both ends (else UCX's behaviour
    // is undefined); 0: flush, then disconnect.
    param.flags = force && context->options().peer_failure_detection ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t request = ucp_ep_close_nbx(ep_, &param);
    ep_ = nullptr;
    if (UCS_PTR_IS_PTR(request)) close_request_ = request;
  }

  void cut(const std::string& why) {
    mark_broken(why);
    close_ep(true);
  }

  // ---------------------------------------------------------------- UCX callbacks

  void mark_broken(const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return;
    broken_ = true;
    reason_ = why;
    cv_.notify_all();
  }

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* self = static_cast<Impl*>(arg);
    self->mark_broken(ucs_status_string(status));
    self->close_needed_ = true;  // UCX requires closing a failed endpoint; done after progress
  }

  static ucs_status_t on_hello_ack_am(void* arg, const void* header, size_t header_length, void*, size_t,
                                      const ucp_am_recv_param_t*) {
    auto* self = static_cast<Impl*>(arg);
    wire::HelloHeader hello;
    if (!wire::read_header(header, header_length, &hello)) return UCS_OK;
    std::lock_guard<std::mutex> lock(self->mu_);
    self->hello_acked_ = true;
    self->last_sent_ = Clock::now();  // (the receiver counts its silence from the handshake)
    self->cv_.notify_all();
    return UCS_OK;
  }

  static ucs_status_t on_verdict_am(void* arg, const void* header, size_t header_length, void*, size_t,
                                    const ucp_am_recv_param_t*) {
    auto* self = static_cast<Impl*>(arg);
    wire::VerdictHeader verdict;
    if (!wire::read_header(header, header_length, &verdict)) return UCS_OK;
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->transfers_.find(verdict.transfer_id);
    if (it == self->transfers_.end() || it->second.verdict_in) return UCS_OK;  // the first verdict counts
    it->second.verdict_in = true;
    it->second.verdict = verdict;
    self->cv_.notify_all();
    return UCS_OK;
  }

  static void on_control_sent(void* request, ucs_status_t, void*) { ucp_request_free(request); }

  static void on_piece_sent(void* request, ucs_status_t status, void* user_data) {
    auto* slot = static_cast<Slot*>(user_data);
    slot->owner->piece_done(*slot, status);
    ucp_request_free(request);
  }

  void piece_done(Slot& slot, ucs_status_t status) {
    std::lock_guard<std::mutex> lock(mu_);
    inflight_bytes_ -= slot.bytes;
    free_slots_.push_back(uint32_t(&slot - slots_.data()));
    auto it = transfers_.find(slot.header.transfer_id);
    if (it != transfers_.end()) {
      --it->second.outstanding;
      if (status != UCS_OK && !it->second.refused) {
        it->second.refused = true;
        it->second.refusal = status;
      }
    }
    cv_.notify_all();
  }

  // ---------------------------------------------------------------- the loop's deferred work

  bool after_progress(Deadline) override {
    bool did = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      submitting_.swap(submit_);
    }
    for (uint32_t index : submitting_) {
      post_piece(slots_[index]);
      did = true;
    }
    submitting_.clear();
    if (close_needed_) {
      close_needed_ = false;
      close_ep(true);
      did = true;
    }
    if (close_request_ != nullptr && ucp_request_check_status(close_request_) != UCS_INPROGRESS) {
      ucp_request_free(close_request_);
      close_request_ = nullptr;
    }
    return did;
  }

  void post_piece(Slot& slot) {
    if (ep_ == nullptr) {
      piece_done(slot, UCS_ERR_NOT_CONNECTED);
      return;
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_AM_SEND_FLAG_REPLY;  // the receiver answers with a verdict on this connection
    param.cb.send = &Impl::on_piece_sent;
    param.user_data = &slot;
    ucs_status_ptr_t request =
        ucp_am_send_nbx(ep_, wire::kPiece, &slot.header, sizeof slot.header, slot.data, slot.bytes, &param);
    if (request == nullptr) {
      piece_done(slot, UCS_OK);
    } else if (UCS_PTR_IS_ERR(request)) {
      piece_done(slot, UCS_PTR_STATUS(request));
    }
  }

  std::string address_;
  SenderOptions options_;
  ucp_ep_h ep_ = nullptr;  // loop thread only
  void* close_request_ = nullptr;
  bool close_needed_ = false;
  const wire::HelloHeader hello_{};

  std::vector<Slot> slots_;  // fixed size: UCX holds pointers to the headers

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::vector<uint32_t> free_slots_;
  std::vector<uint32_t> submit_, submitting_;  // slot indices waiting for the loop (capacity: all slots)
  size_t inflight_bytes_ = 0;
  std::unordered_map<uint64_t, SentTransfer> transfers_;
  bool hello_acked_ = false;
  bool broken_ = false;
  Deadline last_sent_ = Clock::now();  // (guarded by mu_) last_sent()
  std::string reason_;
};

// -------------------------------------------------------------------- KvSender

KvSender::KvSender(std::shared_ptr<KvContext> context, const std::string& address, const SenderOptions& options)
    : address_(address), impl_(std::make_unique<Impl>(std::move(context), address, options)) {}

KvSender::~KvSender() = default;

bool KvSender::send(uint64_t id, uint32_t piece_index, uint64_t offset, const void* data, size_t bytes,
                    Deadline until) {
  return impl_->send(id, piece_index, offset, data, bytes, until);
}

bool KvSender::send_all(uint64_t id, const void* data, size_t bytes, size_t piece_bytes) {
  if (piece_bytes == 0) throw KvError(KvErrc::invalid_argument, "piece_bytes must be positive");
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t index = 0;
  for (size_t offset = 0; offset < bytes; offset += piece_bytes, ++index) {
    if (!impl_->send(id, index, offset, p + offset, std::min(piece_bytes, bytes - offset), Deadline::max()))
      return false;
  }
  return true;
}

TransferResult KvSender::wait(uint64_t id, Deadline until) { return impl_->wait(id, until); }

void KvSender::abandon(uint64_t id, Deadline until) { impl_->abandon(id, until); }

bool KvSender::connected() const { return impl_->connected(); }
Deadline KvSender::last_sent() const { return impl_->last_sent(); }

}  // namespace disagg::kv
