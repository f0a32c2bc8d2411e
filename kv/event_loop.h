// Internal: one UCP worker and the thread that drives it. Only that thread
// calls into UCX for the worker (so the worker runs in UCX's single-thread
// mode, without locks); other threads hand it work with post() or call() and
// wake it with ucp_worker_signal, the one UCX call that is safe from anywhere.
//
// The loop: run posted work; call ucp_worker_progress (UCX runs its callbacks
// in there, which only record what happened); run the owner's after_progress
// (the deferred work those callbacks queued, and timers); repeat while any
// of them did something. When idle, arm the worker and sleep in poll() on
// its event descriptor until a network event, a signal or the owner's next
// timer.
#pragma once
#include <ucp/api/ucp.h>

#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kv/transfer.h"

namespace disagg::kv::detail {

// "what: UCX's words for status".
std::string ucx_message(const std::string& what, ucs_status_t status);

// Registers `cb` (with `arg`) for active messages `id` on `worker`, each
// delivered whole (an eager piece in one call, reassembled by UCX); throws
// KvError (ucx_error) when UCX refuses.
void set_am_handler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb, void* arg);

class EventLoop {
 public:
  explicit EventLoop(ucp_context_h context);
  // The owner must have called stop() and destroy_worker() (its members die first).
  virtual ~EventLoop();
  EventLoop(const EventLoop&) = delete;
  EventLoop& operator=(const EventLoop&) = delete;

  ucp_worker_h worker() const { return worker_; }

  void start(const std::string& thread_name);
  // Joins the thread. Posted work not yet run is dropped.
  void stop();

  // Runs fn on the loop thread, soon.
  void post(std::function<void()> fn);

  // Runs fn on the loop thread and returns its result (or rethrows). On the
  // loop thread itself it runs fn at once.
  template <class F>
  auto call(F&& fn) -> std::invoke_result_t<F&> {
    using R = std::invoke_result_t<F&>;
    if (on_loop_thread()) return fn();
    auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
    std::future<R> result = task->get_future();
    post([task] { (*task)(); });
    return result.get();
  }

  bool on_loop_thread() const { return std::this_thread::get_id() == thread_id_; }

  // Wakes the loop (from any thread).
  void wake();

 protected:
  // Deferred work queued by UCX callbacks, and timers. Runs on the loop
  // thread after each round of progress; returns true when it did something
  // (the loop then progresses again before it sleeps).
  virtual bool after_progress(Deadline now) = 0;
  // After stop(), while the owner's members live: destroying the worker
  // completes its requests still pending (a flush-close that never ended,
  // sends to a peer that stopped reading: shared memory has no peer-failure
  // detection) with their callbacks, which touch the owner's members.
  void destroy_worker();
  // When after_progress must run next even without network events.
  virtual Deadline next_timer() const { return Deadline::max(); }

 private:
  void run();
  bool run_posted();

  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::thread thread_;
  std::thread::id thread_id_;
  std::atomic<bool> stopping_{false};

  std::mutex posted_mu_;
  std::vector<std::function<void()>> posted_;
  std::vector<std::function<void()>> running_;  // swapped with posted_, keeps its capacity
  std::atomic<bool> has_posted_{false};
};

}  // namespace disagg::kv::detail
