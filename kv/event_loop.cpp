#include "kv/event_loop.h"

#include <poll.h>
#include <pthread.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace disagg::kv::detail {

namespace {

// Longest sleep without a timer. Only a safety net: posted work and network
// events wake the loop through the worker's event descriptor.
constexpr int kMaxSleepMs = 1000;
// Linux limits thread names to 15 characters plus the terminator.
constexpr size_t kThreadNameMax = 15;

}  // namespace

std::string ucx_message(const std::string& what, ucs_status_t status) {
  return what + ": " + ucs_status_string(status);
}

EventLoop::EventLoop(ucp_context_h context) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;  // only the loop thread touches the worker
  ucs_status_t status = ucp_worker_create(context, &params, &worker_);
  if (status != UCS_OK) throw KvError(KvErrc::ucx_error, ucx_message("ucp_worker_create", status));
  status = ucp_worker_get_efd(worker_, &event_fd_);
  if (status != UCS_OK) {
    ucp_worker_destroy(worker_);
    throw KvError(KvErrc::ucx_error, ucx_message("ucp_worker_get_efd", status));
  }
}

EventLoop::~EventLoop() {
  stop();
  destroy_worker();  // (an owner's that did not: no request can be pending then)
}

void EventLoop::destroy_worker() {
  if (worker_ == nullptr) return;
  ucp_worker_destroy(worker_);
  worker_ = nullptr;
}

void EventLoop::start(const std::string& thread_name) {
  thread_ = std::thread([this] { run(); });
  thread_id_ = thread_.get_id();
  pthread_setname_np(thread_.native_handle(), thread_name.substr(0, kThreadNameMax).c_str());
}

void EventLoop::stop() {
  if (!thread_.joinable()) return;
  stopping_ = true;
  wake();
  thread_.join();
  thread_id_ = std::thread::id();
}

void EventLoop::post(std::function<void()> fn) {
  {
    std::lock_guard<std::mutex> lock(posted_mu_);
    posted_.push_back(std::move(fn));
    has_posted_ = true;
  }
  wake();
}

void EventLoop::wake() { ucp_worker_signal(worker_); }

bool EventLoop::run_posted() {
  if (!has_posted_.load()) return false;
  {
    std::lock_guard<std::mutex> lock(posted_mu_);
    running_.swap(posted_);
    has_posted_ = false;
  }
  for (auto& fn : running_) fn();
  running_.clear();
  return true;
}

void EventLoop::run() {
  while (!stopping_.load()) {
    // One round of progress, then the deferred work it queued (rendezvous
    // receives to start, messages to send): under a steady stream of events
    // neither waits for the other.
    bool busy = run_posted();
    if (ucp_worker_progress(worker_) != 0) busy = true;
    if (after_progress(Clock::now())) busy = true;
    if (busy) continue;

    // Idle: sleep until UCX, a poster or the next timer wakes us. Arming
    // fails with BUSY when events arrived since the last progress; work
    // posted after run_posted() either sets has_posted_ before we look at it
    // below, or signals the worker after it was armed, which wakes the poll.
    const ucs_status_t armed = ucp_worker_arm(worker_);
    if (armed == UCS_ERR_BUSY) continue;
    if (has_posted_.load() || stopping_.load()) continue;
    int timeout_ms = kMaxSleepMs;
    const Deadline timer = next_timer();
    if (timer != Deadline::max()) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(timer - Clock::now()).count();
      timeout_ms = int(std::clamp<long long>(left, 0, kMaxSleepMs));
    }
    pollfd fd{event_fd_, POLLIN, 0};
    poll(&fd, 1, timeout_ms);  // EINTR or timeout: just go round again
  }
}

void set_am_handler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t param{};
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                     UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = id;
  param.flags = UCP_AM_FLAG_WHOLE_MSG;
  param.cb = cb;
  param.arg = arg;
  const ucs_status_t status = ucp_worker_set_am_recv_handler(worker, &param);
  if (status != UCS_OK) throw KvError(KvErrc::ucx_error, ucx_message("ucp_worker_set_am_recv_handler", status));
}

}  // namespace disagg::kv::detail
