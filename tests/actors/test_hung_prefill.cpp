// A prefill worker that stops answering (a SIGSTOPped node) or goes down once
// its part of a request is done (the KV committed and acked, its report not
// yet sent): the request is the decode worker's from then on. The router must
// neither restart, migrate nor fail it, and a request whose last token has
// streamed completes whatever comes after (a silent prefill worker, its
// deadline). Issue 18, item 5.
//
// The cluster is built here, so that each part can be held where the test
// needs it (no sleeps, no timing luck):
//   - the prefill worker is real, behind a gate that registers with the
//     router in its place and passes jobs on; once a report comes back the
//     gate holds it and answers nothing more (heartbeats included) until it
//     is woken (SIGCONT), when it delivers what it held, late;
//   - the decode worker is real, its compute actor behind a gate that can
//     hold decode steps, so a request can be kept mid-generation, and its
//     router handle a relay that can lose its done message;
//   - the router's heartbeat rounds come from the test (heartbeat-interval-ms
//     is an hour), so the silence lands where the test puts it.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "actors/actor_fixture.h"
#include "actors/compute.h"
#include "actors/decode.h"
#include "actors/prefill.h"
#include "actors/router.h"
#include "caf/all.hpp"
#include "model/checkpoint.h"
#include "engine/engine.h"
#include "engine/kv_format.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using pause_atom = caf::atom_constant<caf::atom("pause")>;
using resume_atom = caf::atom_constant<caf::atom("resume")>;
using pause_admissions_atom = caf::atom_constant<caf::atom("pauseadmit")>;
using wake_atom = caf::atom_constant<caf::atom("wake")>;
using fail_atom = caf::atom_constant<caf::atom("fail")>;

// What the test sees of the prefill gate (read from the test thread).
struct GateLog {
  std::atomic<int> jobs{0};  // prefill jobs the router sent it
  std::mutex mutex;
  std::vector<RequestId> cancelled;  // requests the router told it to drop
  std::condition_variable cancel_seen;  // (each cancel)
  std::atomic<bool> stop_after_report{true};
  // Jobs still to be answered worker_lost at once, unrun (as a prefill
  // worker whose KV connection to the decode worker broke).
  std::atomic<int> lose_jobs{0};
  std::promise<void> committed;  // set when the first report came back (then it stops)
  std::atomic<bool> committed_set{false};

  bool was_cancelled(RequestId id) {
    std::lock_guard<std::mutex> lock(mutex);
    return std::find(cancelled.begin(), cancelled.end(), id) != cancelled.end();
  }
  // Whether the router tells it to drop `id` within `within`.
  bool cancelled_within(RequestId id, std::chrono::milliseconds within) {
    std::unique_lock<std::mutex> lock(mutex);
    return cancel_seen.wait_for(lock, within, [&] {
      return std::find(cancelled.begin(), cancelled.end(), id) != cancelled.end();
    });
  }
};

struct GateState {
  prefill_actor worker;  // the real prefill worker behind the gate
  bool stopped = false;
  // What a stopped process leaves unread, handled when it wakes.
  std::vector<std::pair<caf::typed_response_promise<PrefillReport>, PrefillReport>> reports;
  std::vector<caf::typed_response_promise<PrefillLoad>> heartbeats;
  std::vector<std::function<void()>> unread;
};

caf::behavior prefill_gate(caf::stateful_actor<GateState>* self, router_actor router, std::shared_ptr<GateLog> log) {
  auto& st = self->state;
  return {
      // The real worker registers here (it was spawned with the gate as its
      // router): the gate registers itself with the router in its place.
      [=, &st](register_atom, WorkerInfo& info, prefill_actor& worker) {
        st.worker = worker;
        self->link_to(worker);
        auto promise = self->make_response_promise<caf::ok_atom>();
        self->request(router, std::chrono::seconds(10), register_atom::value, std::move(info),
                      caf::actor_cast<prefill_actor>(self))
            .then([=](caf::ok_atom) mutable { promise.deliver(caf::ok_atom::value); },
                  [=](caf::error& e) mutable { promise.deliver(e); });
        return promise;
      },
      [=, &st](prefill_atom, PrefillJob& job, decode_actor& decode) {
        log->jobs += 1;
        auto promise = self->make_response_promise<PrefillReport>();
        if (log->lose_jobs > 0) {
          log->lose_jobs -= 1;
          PrefillReport lost;
          lost.id = job.id;
          lost.code = ErrorCode::worker_lost;
          lost.message = "KV stream: KV connection to 127.0.0.1:1: Endpoint timeout (the test's)";
          promise.deliver(std::move(lost));
          return promise;
        }
        auto pass_on = [=, &st]() mutable {
          self->request(st.worker, caf::infinite, prefill_atom::value, job, decode)
              .then(
                  [=, &st](PrefillReport& report) mutable {
                    // The commit is acked: the decode worker has the KV. Stop here.
                    if (st.stopped || log->stop_after_report) {
                      st.stopped = true;
                      st.reports.emplace_back(promise, std::move(report));
                    } else {
                      promise.deliver(std::move(report));
                    }
                    if (!log->committed_set.exchange(true)) log->committed.set_value();
                  },
                  [=](caf::error& e) mutable { promise.deliver(e); });
        };
        if (st.stopped)
          st.unread.push_back(pass_on);
        else
          pass_on();
        return promise;
      },
      [=, &st](cancel_atom, RequestId id) {
        {
          std::lock_guard<std::mutex> lock(log->mutex);
          log->cancelled.push_back(id);
        }
        log->cancel_seen.notify_all();
        auto pass_on = [=, &st] { self->send(st.worker, cancel_atom::value, id); };
        if (st.stopped)
          st.unread.push_back(pass_on);
        else
          pass_on();
      },
      [=, &st](status_atom) {
        auto promise = self->make_response_promise<PrefillLoad>();
        if (st.stopped) {
          st.heartbeats.push_back(promise);  // unanswered while stopped
          return promise;
        }
        self->request(st.worker, std::chrono::seconds(5), status_atom::value)
            .then([=](PrefillLoad& load) mutable { promise.deliver(load); },
                  [=](caf::error& e) mutable { promise.deliver(e); });
        return promise;
      },
      // Wakes, but answers the jobs it held with an error (as if its wait
      // for the decode worker's ack had timed out).
      [=, &st](fail_atom) {
        for (auto& held : st.reports) {
          held.second.code = ErrorCode::timeout;
          held.second.message = "KV ack from decode worker: timeout (the test's)";
        }
        self->send(self, wake_atom::value);
      },
      // SIGCONT: what it held goes out, late.
      [=, &st](wake_atom) {
        st.stopped = false;
        log->stop_after_report = false;
        for (auto& [promise, report] : st.reports) promise.deliver(std::move(report));
        st.reports.clear();
        for (auto& promise : st.heartbeats) promise.deliver(PrefillLoad{});
        st.heartbeats.clear();
        auto unread = std::move(st.unread);
        st.unread.clear();
        for (auto& f : unread) f();
      },
  };
}

// In front of a decode worker's compute actor: passes everything on, but
// holds decode steps while paused (and KV admissions while those are).
struct ComputeGateState {
  bool paused = false;
  bool admissions_paused = false;
  std::vector<std::function<void()>> held;
};

// Asks the compute `what` (a message of `Ts`) for the gate's caller: now,
// or when resumed if paused, in order with everything else held.
template <class Result, class... Ts>
caf::typed_response_promise<Result> pass_or_hold(caf::stateful_actor<ComputeGateState>* self,
                                                 const compute_actor& compute, bool hold, Ts... what) {
  auto promise = self->make_response_promise<Result>();
  auto pass_on = [=]() mutable {
    self->request(compute, caf::infinite, what...)
        .then([=](Result& r) mutable { promise.deliver(std::move(r)); },
              [=](caf::error& e) mutable { promise.deliver(e); });
  };
  if (hold)
    self->state.held.push_back(pass_on);
  else
    pass_on();
  return promise;
}

caf::behavior compute_gate(caf::stateful_actor<ComputeGateState>* self, compute_actor compute) {
  self->link_to(compute);
  auto& st = self->state;
  return {
      // (held too while paused: a compute busy with a step answers nothing before it)
      [=](info_atom a) { return pass_or_hold<ModelInfo>(self, compute, self->state.paused, a); },
      [=](prefill_atom a, PrefillWork& w) { return self->delegate(compute, a, std::move(w)); },
      [=](admit_atom a, KvAdmit& k) {
        return pass_or_hold<AdmitResult>(self, compute, self->state.admissions_paused, a, std::move(k));
      },
      [=](step_atom a, DecodeStep& step) { return pass_or_hold<StepResult>(self, compute, self->state.paused, a, step); },
      [=](chunk_atom a) { self->send(compute, a); },
      [=, &st](pause_atom) { st.paused = true; },
      [=, &st](pause_admissions_atom) { st.admissions_paused = true; },
      [=, &st](resume_atom) {
        st.paused = false;
        st.admissions_paused = false;
        auto held = std::move(st.held);
        st.held.clear();
        for (auto& f : held) f();
      },
  };
}

// The decode worker's router handle: passes everything on to the router
// (delegated: the router sees the decode worker as the sender), but can lose
// the worker's done messages, as a broken connection would.
struct RelayLog {
  std::atomic<bool> drop_done{false};
  std::promise<void> dropped;
  // Set once the first token batch is on its way to the router: the router
  // knows the decode worker has the KV before anything sent later reaches
  // it (the client's own token, streamed directly, says nothing of that).
  std::atomic<bool> batch_seen{false};
  std::promise<void> first_batch;
};

caf::behavior decode_relay(caf::event_based_actor* self, router_actor router, std::shared_ptr<RelayLog> log) {
  return {
      [=](register_atom a, WorkerInfo& info, decode_actor& worker) {
        return self->delegate(router, a, std::move(info), std::move(worker));
      },
      [=](token_atom a, TokenBatch& b) {
        self->delegate(router, a, std::move(b));
        if (!log->batch_seen.exchange(true)) log->first_batch.set_value();
      },
      [=](done_atom a, DecodeDone& done) {
        if (log->drop_done.exchange(false)) {
          log->dropped.set_value();
          return;
        }
        self->delegate(router, a, std::move(done));
      },
      [=](load_atom a, DecodeLoad& load) { self->delegate(router, a, std::move(load)); },
      [=](kv_events_atom a, KvEvents& events) { self->delegate(router, a, std::move(events)); },
  };
}

constexpr int64_t kHeartbeatTimeoutMs = 200;
const char* const kHungName = "prefill-hung";
const Sampling kSampled{0.9f, 0.9f, 77};

class HungPrefillTest : public ActorTest {
 protected:
  // Router, one decode worker (its compute gated) and, as the only prefill
  // worker, a real one behind the prefill gate.
  void SetUp() override {
    ActorTest::SetUp();
    config_ = shared_model_config(1, 1);
    if (compute_timeout_ms_ > 0) config_.compute_timeout_ms = compute_timeout_ms_;
    config_.heartbeat_interval_ms = 3600 * 1000;  // rounds come from the test
    config_.heartbeat_timeout_ms = kHeartbeatTimeoutMs;
    ASSERT_EQ(config_.validate(), "");
    const auto checkpoint = gpu::Checkpoint::open(config_.model);
    gpu::EngineOptions engine;
    engine.backend = config_.backend;
    plane_ = make_kv_plane(config_, true);
    router_ = spawn_router(*system_, config_, nullptr, model_info(*checkpoint));
    const ComputeUnit unit =
        spawn_compute_unit(*system_, {checkpoint, engine, config_.block_size, config_.pool_blocks, plane_});
    decode_compute_ = system_->spawn(compute_gate, unit.actor);
    relay_ = system_->spawn(decode_relay, router_, relay_log_);
    decode_ = spawn_decode(*system_, config_, caf::actor_cast<compute_actor>(decode_compute_),
                           caf::actor_cast<router_actor>(relay_), "decode-0", DecodeKv{unit.pool, plane_});
    gate_ = system_->spawn(prefill_gate, router_, log_);
    const compute_actor prefill_compute = spawn_compute(*system_, {checkpoint, engine, 0, 0, plane_});
    prefill_ = spawn_prefill(*system_, config_, prefill_compute, caf::actor_cast<router_actor>(gate_), kHungName);
    client_ = std::make_unique<Client>(*system_, router_);
    ASSERT_TRUE(wait_for([](const RouterStatus& s) {
      return s.count(WorkerRole::prefill) == 1 && s.count(WorkerRole::decode) == 1 && prefill_status(s);
    })) << "the workers never registered";
  }

  void TearDown() override {
    caf::anon_send(gate_, wake_atom::value);
    caf::anon_send(decode_compute_, resume_atom::value);
    if (expect_pool_free_) EXPECT_TRUE(wait_pool_free()) << "the decode pool did not return to full capacity";
    // (the workers are linked to their gates and compute actors)
    caf::anon_send_exit(gate_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(decode_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(router_, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(relay_, caf::exit_reason::user_shutdown);
    relay_ = caf::actor{};
    // A detached compute actor's thread ends once no handle is left.
    gate_ = caf::actor{};
    prefill_ = prefill_actor{};
    decode_compute_ = caf::actor{};
    decode_ = decode_actor{};
    router_ = router_actor{};
    ActorTest::TearDown();
  }

  bool wait_pool_free() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    caf::scoped_actor self{*system_};
    while (std::chrono::steady_clock::now() < deadline) {
      bool free = false;
      self->request(decode_, std::chrono::seconds(5), status_atom::value)
          .receive([&](DecodeLoad& l) { free = l.free_blocks == l.total_blocks && l.active_sequences == 0; },
                   [](caf::error&) {});
      if (free) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  static const WorkerStatus* prefill_status(const RouterStatus& s) {
    for (const auto& w : s.workers)
      if (w.role == WorkerRole::prefill && w.name == kHungName) return &w;
    return nullptr;
  }

  // Polls the router's status until `done` holds (at most 10 s).
  template <class Predicate>
  bool wait_for(Predicate done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < deadline) {
      if (const auto s = client_->status(); s && done(*s)) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return false;
  }

  // One heartbeat round now (the router's own timer is an hour away).
  void heartbeat_round() { caf::anon_send(router_, heartbeat_atom::value); }

  // Exactly the colocated tokens, each index streamed once, in order.
  static void expect_exact(const RequestOutcome& out, TokenLog& log, const gpu::GenerateResult& local) {
    EXPECT_EQ(out.tokens, local.tokens);
    EXPECT_EQ(out.finish, FinishReason::length);
    std::lock_guard<std::mutex> lock(log.mutex);
    ASSERT_EQ(log.events.size(), out.tokens.size()) << "a gap or a duplicate in the stream";
    for (size_t i = 0; i < log.events.size(); ++i) {
      EXPECT_EQ(log.events[i].index, int32_t(i));
      EXPECT_EQ(log.events[i].token, out.tokens[i]);
    }
  }

  // Submits a request that must not reach BOS before max_new tokens; the
  // promises are set when the client has its first and its last token (the
  // router has them then: it forwarded them).
  std::future<RequestOutcome> submit(int max_new, const Sampling& sampling, TokenLog& log,
                                     std::promise<void>* last_token = nullptr,
                                     std::promise<void>* first_token = nullptr) {
    local_ = colocated(kOnceUponATime, max_new, sampling);
    EXPECT_EQ(local_.tokens.size(), size_t(max_new)) << "precondition: no BOS before max_new_tokens";
    auto request = make_request(kOnceUponATime, max_new, sampling);
    request.id = client_->next_id();
    request.deadline_ms = 8000;
    victim_ = request.id;
    auto record = log.callback();
    return client_->submit(request, [=](const TokenEvent& e) {
      record(e);
      if (first_token && e.index == 0) first_token->set_value();
      if (last_token && e.index == max_new - 1) last_token->set_value();
    });
  }

  // SIGCONT: the stopped worker's late report frees its slot (held until
  // then: the worker had not reported the job); once it answers a heartbeat
  // it gets work again, here the request `next` that waited meanwhile.
  void wake_and_serve(std::future<RequestOutcome>& next, const Sampling& sampling) {
    caf::anon_send(gate_, wake_atom::value);
    EXPECT_TRUE(wait_for([](const RouterStatus& s) {
      const WorkerStatus* w = prefill_status(s);
      return w && w->in_flight == 0;
    })) << "the late report did not free the stopped worker's slot";
    heartbeat_round();
    ASSERT_EQ(next.wait_for(std::chrono::seconds(15)), std::future_status::ready);
    const RequestOutcome again = next.get();
    ASSERT_TRUE(again.ok()) << to_string(again.code) << ": " << again.message;
    EXPECT_EQ(again.tokens, colocated(kOnceUponATime, 16, sampling).tokens);
    EXPECT_EQ(again.prefill_worker, kHungName);
  }

  std::future<RequestOutcome> submit_next(const Sampling& sampling) {
    auto request = make_request(kOnceUponATime, 16, sampling);
    request.deadline_ms = 15000;
    return client_->submit(request);
  }

  // The prefill worker stops after its commit and is marked stopped (its
  // heartbeat left unanswered) either once every token has streamed or while
  // the decode worker is held mid-generation; the request completes there.
  enum class Silence { after_the_last_token, mid_generation };
  void expect_completes_past_a_stopped_prefill(const Sampling& sampling, int max_new, Silence when) {
    if (when == Silence::mid_generation) caf::anon_send(decode_compute_, pause_atom::value);
    TokenLog log;
    std::promise<void> last_token, first_token;
    auto future = submit(max_new, sampling, log, &last_token, &first_token);
    log_->committed.get_future().wait();  // KV committed and acked: the gate stops
    first_token.get_future().wait();
    if (when == Silence::after_the_last_token) last_token.get_future().wait();
    heartbeat_round();  // left unanswered: the router marks the worker stopped

    // A request arriving now waits: a stopped worker gets no new work. (One
    // sent to it before the router noticed the silence starts over, so it
    // ends up queued either way, and is queued only once the router has
    // marked the worker stopped.)
    std::future<RequestOutcome> next;
    if (when == Silence::mid_generation) {
      next = submit_next(sampling);
      // The held request still decodes: in flight, not restarted.
      ASSERT_TRUE(wait_for([](const RouterStatus& s) { return s.queued == 1 && s.in_flight == 1; }))
          << "the request held mid-generation was restarted (or the next one never waited)";
      caf::anon_send(decode_compute_, resume_atom::value);
    }
    // (well before its deadline: completing at the deadline is another rule)
    ASSERT_EQ(future.wait_for(std::chrono::seconds(4)), std::future_status::ready);
    const RequestOutcome out = future.get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
    expect_exact(out, log, local_);
    EXPECT_EQ(out.prefill_worker, kHungName) << "it was restarted";
    EXPECT_FALSE(log_->was_cancelled(victim_)) << "the router told the stopped worker to drop a request it no longer held";

    if (when == Silence::after_the_last_token) {
      // It completed at the silence: the router has marked the worker stopped.
      next = submit_next(sampling);
      ASSERT_TRUE(wait_for([](const RouterStatus& s) { return s.queued == 1 && s.in_flight == 0; }))
          << "the next request never waited for the stopped worker";
      EXPECT_EQ(log_->jobs.load(), 1) << "a stopped worker got new work";
    }
    const auto held = client_->status();
    ASSERT_TRUE(held);
    ASSERT_NE(prefill_status(*held), nullptr);
    EXPECT_GE(prefill_status(*held)->in_flight, 1) << "the unreported job's slot was freed";
    wake_and_serve(next, sampling);
  }

  DisaggConfig config_;
  std::shared_ptr<kv::KvPlane> plane_;
  router_actor router_;
  caf::actor decode_compute_;
  caf::actor relay_;
  std::shared_ptr<RelayLog> relay_log_ = std::make_shared<RelayLog>();
  decode_actor decode_;
  bool expect_pool_free_ = true;
  int64_t compute_timeout_ms_ = 0;  // > 0: the workers' compute-timeout-ms
  caf::actor gate_;
  prefill_actor prefill_;
  std::shared_ptr<GateLog> log_ = std::make_shared<GateLog>();
  gpu::GenerateResult local_;
  RequestId victim_ = 0;
};

// The case: every token streamed (400 sampled, 300 greedy: that
// prompt reaches BOS at 341), then the stopped prefill worker's silence. The
// client must get its outcome, not worker_lost.
// The router notices a silent worker at heartbeat-timeout-ms after the
// heartbeat it leaves unanswered: not before, and not at twice the bound
// (the scheduling of this machine's threads is the margin).
TEST_F(HungPrefillTest, ASilentWorkerIsNoticedAtTheHeartbeatTimeout) {
  TokenLog log;
  auto future = submit(16, {}, log);
  log_->committed.get_future().wait();  // the gate answers nothing from now on
  const auto sent = std::chrono::steady_clock::now();
  heartbeat_round();
  ASSERT_TRUE(wait_for([](const RouterStatus& s) {
    const WorkerStatus* w = prefill_status(s);
    return w && !w->responsive;
  })) << "the silent worker was never noticed";
  const auto noticed_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - sent).count();
  EXPECT_GE(noticed_ms, kHeartbeatTimeoutMs) << "noticed before its heartbeat timed out";
  EXPECT_LT(noticed_ms, 2 * kHeartbeatTimeoutMs) << "noticed " << noticed_ms << " ms after the heartbeat, over "
                                                 << kHeartbeatTimeoutMs << " ms";
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_TRUE(future.get().ok());
}

TEST_F(HungPrefillTest, AGreedyRequestWhoseTokensAllStreamedCompletesPastAStoppedPrefillWorker) {
  expect_completes_past_a_stopped_prefill(Sampling{}, 300, Silence::after_the_last_token);
}
TEST_F(HungPrefillTest, ASampledRequestWhoseTokensAllStreamedCompletesPastAStoppedPrefillWorker) {
  expect_completes_past_a_stopped_prefill(kSampled, 400, Silence::after_the_last_token);
}

// The prefill worker stops after its commit while the decode worker is in the
// middle of the request: it goes on there, neither restarted nor migrated.
TEST_F(HungPrefillTest, AGreedyRequestDecodingWhenItsPrefillWorkerStopsIsNotRestarted) {
  expect_completes_past_a_stopped_prefill(Sampling{}, 300, Silence::mid_generation);
}
TEST_F(HungPrefillTest, ASampledRequestDecodingWhenItsPrefillWorkerStopsIsNotRestarted) {
  expect_completes_past_a_stopped_prefill(kSampled, 400, Silence::mid_generation);
}

// The same with the prefill worker going down after its commit (the router
// hears of it at once, and its job's answer is an error): the request,
// held mid-generation, completes on its decode worker.
class LostPrefillTest : public HungPrefillTest {
 protected:
  void expect_completes_past_a_lost_prefill(const Sampling& sampling, int max_new) {
    caf::anon_send(decode_compute_, pause_atom::value);
    TokenLog log;
    std::promise<void> first_token;
    auto future = submit(max_new, sampling, log, nullptr, &first_token);
    log_->committed.get_future().wait();
    first_token.get_future().wait();
    relay_log_->first_batch.get_future().wait();  // the router saw it too
    caf::anon_send_exit(gate_, caf::exit_reason::kill);  // the real worker goes with it (linked)
    ASSERT_TRUE(wait_for([](const RouterStatus& s) { return s.count(WorkerRole::prefill) == 0; }));
    caf::anon_send(decode_compute_, resume_atom::value);
    ASSERT_EQ(future.wait_for(std::chrono::seconds(4)), std::future_status::ready);
    const RequestOutcome out = future.get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
    expect_exact(out, log, local_);
    EXPECT_EQ(log_->jobs.load(), 1);
  }

  // The prefill worker answers its job with an error after the router saw
  // the decode worker's first token (its ack wait timed out, say): the
  // request, held mid-generation, is the decode worker's and completes there.
  // (An error that reaches the router before any token fails the request:
  // the router cannot know then that the decode worker has the KV.)
  void expect_completes_past_a_late_prefill_error(const Sampling& sampling, int max_new) {
    caf::anon_send(decode_compute_, pause_atom::value);
    TokenLog log;
    std::promise<void> first_token;
    auto future = submit(max_new, sampling, log, nullptr, &first_token);
    log_->committed.get_future().wait();
    first_token.get_future().wait();
    relay_log_->first_batch.get_future().wait();  // the router saw it too
    caf::anon_send(gate_, fail_atom::value);
    // The router has the error once it freed the job's slot.
    ASSERT_TRUE(wait_for([](const RouterStatus& s) {
      const WorkerStatus* w = prefill_status(s);
      return w && w->in_flight == 0;
    }));
    caf::anon_send(decode_compute_, resume_atom::value);
    ASSERT_EQ(future.wait_for(std::chrono::seconds(4)), std::future_status::ready);
    const RequestOutcome out = future.get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
    expect_exact(out, log, local_);
    EXPECT_EQ(log_->jobs.load(), 1);
    EXPECT_FALSE(log_->was_cancelled(victim_));
  }
};

// The prefill worker's KV stream to the decode worker broke before any token
// (the decode node died and the router has not heard yet; ctest
// KvFaults.ADecodeNodeKilledMidStream... failed this way under load): the
// request starts over, within max-worker-retries, instead of failing.
TEST_F(LostPrefillTest, ARequestWhoseKvStreamBrokeBeforeAnyTokenStartsOver) {
  log_->stop_after_report = false;
  log_->lose_jobs = 1;
  TokenLog log;
  auto future = submit(40, Sampling{}, log);
  ASSERT_EQ(future.wait_for(std::chrono::seconds(8)), std::future_status::ready);
  const RequestOutcome out = future.get();
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  expect_exact(out, log, local_);
  EXPECT_EQ(log_->jobs.load(), 2);
}

TEST_F(LostPrefillTest, AGreedyRequestDecodingWhenItsPrefillWorkerGoesDownCompletes) {
  expect_completes_past_a_lost_prefill(Sampling{}, 300);
}
TEST_F(LostPrefillTest, ASampledRequestDecodingWhenItsPrefillWorkerGoesDownCompletes) {
  expect_completes_past_a_lost_prefill(kSampled, 400);
}
TEST_F(LostPrefillTest, AGreedyRequestDecodingIsNotFailedByALatePrefillError) {
  expect_completes_past_a_late_prefill_error(Sampling{}, 300);
}
TEST_F(LostPrefillTest, ASampledRequestDecodingIsNotFailedByALatePrefillError) {
  expect_completes_past_a_late_prefill_error(kSampled, 400);
}

// The decode worker streams every token, then its done is lost and the worker
// goes down: the tokens are final, so the request completes (rather than
// failing with worker_lost after its whole text reached the client).
class LostDecodeTest : public HungPrefillTest {
 protected:
  void expect_completes_past_a_lost_decode(const Sampling& sampling, int max_new) {
    expect_pool_free_ = false;  // the pool goes with its worker
    log_->stop_after_report = false;
    relay_log_->drop_done = true;
    TokenLog log;
    std::promise<void> last_token;
    auto future = submit(max_new, sampling, log, &last_token);
    last_token.get_future().wait();
    relay_log_->dropped.get_future().wait();
    caf::anon_send_exit(decode_, caf::exit_reason::kill);
    ASSERT_EQ(future.wait_for(std::chrono::seconds(4)), std::future_status::ready);
    const RequestOutcome out = future.get();
    ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
    expect_exact(out, log, local_);
  }
};

TEST_F(LostDecodeTest, AGreedyRequestWhoseTokensAllStreamedCompletesWhenItsDecodeWorkerGoesDown) {
  expect_completes_past_a_lost_decode(Sampling{}, 300);
}
TEST_F(LostDecodeTest, ASampledRequestWhoseTokensAllStreamedCompletesWhenItsDecodeWorkerGoesDown) {
  expect_completes_past_a_lost_decode(kSampled, 400);
}

// The deadline passes after the last token streamed, while the prefill
// worker's report is still held (stopped, but no heartbeat round noticed
// it): the tokens are final, so the request completes rather than timing out.
TEST_F(HungPrefillTest, ARequestWhoseLastTokenStreamedCompletesAtItsDeadline) {
  const int max_new = 64;
  const auto local = colocated(kOnceUponATime, max_new);
  ASSERT_EQ(local.tokens.size(), size_t(max_new));
  TokenLog log;
  auto record = log.callback();
  std::promise<void> last_token;
  auto request = make_request(kOnceUponATime, max_new);
  request.deadline_ms = 1500;
  auto future = client_->submit(request, [&](const TokenEvent& e) {
    record(e);
    if (e.index == max_new - 1) last_token.set_value();
  });
  ASSERT_EQ(last_token.get_future().wait_for(std::chrono::milliseconds(1500)), std::future_status::ready)
      << "precondition: the tokens stream within the deadline";
  const RequestOutcome out = future.get();
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  expect_exact(out, log, local);
  EXPECT_EQ(log_->jobs.load(), 1);
  EXPECT_FALSE(log_->was_cancelled(out.id));
}

// A request cancelled while its decode step is held, then admitted again
// under the same id (as a restart may come back to the same worker) before
// that step answers: the step's token belongs to the attempt it was asked
// for, and the new one's tokens are its own prompt's.
TEST_F(HungPrefillTest, AStepsAnswerGoesToTheAttemptItWasAskedForNotALaterOne) {
  log_->stop_after_report = false;  // (the prefill worker keeps working)
  caf::anon_send(decode_compute_, pause_atom::value);
  auto first = make_request(kOnceUponATime, 16);
  first.id = client_->next_id();
  first.deadline_ms = 15000;
  auto started = std::make_shared<std::promise<void>>();  // (the callbacks may outlive a failed test)
  auto future = client_->submit(first, [started](const TokenEvent& e) {
    if (e.index == 0) started->set_value();
  });
  // Its first token (the prefill's) is in: the sequence is active at the
  // decode worker and its step is held.
  ASSERT_EQ(started->get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
  client_->cancel(first.id);
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(future.get().code, ErrorCode::cancelled);

  const auto local = colocated(kTomHadARedBall, 8);
  auto again = make_request(kTomHadARedBall, 8);
  again.id = first.id;
  again.deadline_ms = 15000;
  auto admitted = std::make_shared<std::promise<void>>();
  auto second = client_->submit(again, [admitted](const TokenEvent& e) {
    if (e.index == 0) admitted->set_value();
  });
  const bool in = admitted->get_future().wait_for(std::chrono::seconds(10)) == std::future_status::ready;
  if (!in) caf::anon_send(decode_compute_, resume_atom::value);
  ASSERT_TRUE(in) << "precondition: the second attempt is admitted while the first one's step is held; "
                  << (second.wait_for(std::chrono::seconds(10)) == std::future_status::ready
                          ? [&] { const RequestOutcome o = second.get(); return to_string(o.code) + ": " + o.message; }()
                          : std::string("(no outcome)"));
  caf::anon_send(decode_compute_, resume_atom::value);
  ASSERT_EQ(second.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const RequestOutcome out = second.get();
  ASSERT_TRUE(out.ok()) << to_string(out.code) << ": " << out.message;
  EXPECT_EQ(out.tokens, local.tokens) << "the held step's token went to the later attempt";
}

// The prefill worker goes silent after its commit (the router waits for its
// report no longer), then the decode worker is lost mid-generation: the
// restart tells the silent prefill worker to drop the job it may still hold
// (a wait for an ack that never comes); else, answering again, it refused
// the restart's job as "already in prefill" and the request failed.
TEST_F(HungPrefillTest, ARestartTellsASilentPrefillWorkerToDropItsJob) {
  expect_pool_free_ = false;  // (the pool goes with its worker)
  caf::anon_send(decode_compute_, pause_atom::value);
  TokenLog log;
  std::promise<void> first_token;
  auto future = submit(300, Sampling{}, log, nullptr, &first_token);
  log_->committed.get_future().wait();
  first_token.get_future().wait();
  relay_log_->first_batch.get_future().wait();  // the router saw it too: Decoding
  heartbeat_round();                            // left unanswered
  ASSERT_TRUE(wait_for([](const RouterStatus& s) {
    const WorkerStatus* w = prefill_status(s);
    return w && !w->responsive;
  }));
  ASSERT_FALSE(log_->was_cancelled(victim_));
  caf::anon_send_exit(decode_, caf::exit_reason::kill);
  EXPECT_TRUE(log_->cancelled_within(victim_, std::chrono::seconds(5)))
      << "the silent prefill worker was not told to drop the old job";
  client_->cancel(victim_);
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
}

// A one-message KV held at the compute (Admitting) while its request is
// cancelled and then reserved again under the same id (as a restart may come
// back to the same worker): the new reservation is taken (it was refused as
// "already held", which failed the request), the cancelled admission stays
// cancelled when the compute stores its KV (its blocks come back then), and
// the new reservation stays held until its own cancel.
TEST_F(HungPrefillTest, ACancelledAdmissionStaysCancelledWhenItsIdIsReservedAgain) {
  caf::scoped_actor self{*system_};
  const RequestId id = 0xC0FFEE;
  auto reserve = [&] {
    ReserveReply reply;
    self->request(decode_, std::chrono::seconds(5), reserve_atom::value, KvReservation{id, 40, 60000})
        .receive([&](ReserveReply& r) { reply = std::move(r); }, [&](caf::error& e) { ADD_FAILURE() << system_->render(e); });
    return reply;
  };
  auto free_blocks = [&] {
    int32_t free = -1;
    self->request(decode_, std::chrono::seconds(5), status_atom::value)
        .receive([&](const DecodeLoad& l) { free = l.free_blocks; }, [](caf::error&) {});
    return free;
  };
  const int32_t all = free_blocks();
  const ReserveReply first = reserve();
  ASSERT_EQ(first.code, ErrorCode::none) << first.message;
  KvTransfer t;
  t.ticket = first.target.ticket;
  {
    gpu::EngineOptions options;
    options.backend = "cpu";
    gpu::Engine engine(gpu::Checkpoint::open(shared_model()), options);
    const gpu::PrefillOutput out = engine.prefill(kOnceUponATime);
    t.id = id;
    t.prompt_len = int32_t(kOnceUponATime.size());
    t.max_new_tokens = 8;
    t.first_token = 5;
    t.bytes = gpu::serialize_kv(engine.fingerprint(), out.shape, out.kv.data());
  }
  caf::anon_send(decode_compute_, pause_admissions_atom::value);
  self->send(decode_, kv_atom::value, std::move(t));  // (its KvAck comes back here)
  self->send(decode_, cancel_atom::value, id);
  const ReserveReply again = reserve();  // (after the two above: one sender's messages arrive in order)
  EXPECT_EQ(again.code, ErrorCode::none) << again.message;
  caf::anon_send(decode_compute_, resume_atom::value);
  KvAck ack;
  self->receive([&](KvAck& a) { ack = std::move(a); }, caf::after(std::chrono::seconds(10)) >> [&] { ADD_FAILURE() << "no KvAck"; });
  EXPECT_EQ(ack.code, ErrorCode::cancelled) << ack.message;
  EXPECT_EQ(free_blocks(), all - 3) << "the admission's blocks came back, the new reservation's are held";
  self->send(decode_, cancel_atom::value, id);
  EXPECT_TRUE(wait_pool_free());
}

// A compute that takes longer than compute-timeout-ms over a decode step.
class StalledComputeTest : public HungPrefillTest {
 protected:
  // (every compute call of the fixture has it: a prefill, an admission and
  // the registrations must fit it on a loaded machine too)
  StalledComputeTest() { compute_timeout_ms_ = 1000; }

  DecodeLoad decode_load() {
    caf::scoped_actor self{*system_};
    DecodeLoad load;
    self->request(decode_, std::chrono::seconds(5), status_atom::value)
        .receive([&](DecodeLoad& l) { load = l; }, [](caf::error& e) { ADD_FAILURE() << caf::to_string(e); });
    return load;
  }
};

// The step times out: its request fails (its one terminal reply), but the
// compute may still be running the step and writing KV into the request's
// blocks, so they stay out of the allocator (a new request would get them
// and have its KV overwritten) until the compute has answered a later call;
// then every block comes back.
TEST_F(StalledComputeTest, TheBlocksOfADecodeStepThatTimedOutWaitForTheCompute) {
  caf::anon_send(decode_compute_, pause_atom::value);
  TokenLog log;
  auto future = submit(16, Sampling{}, log);
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const RequestOutcome out = future.get();
  EXPECT_EQ(out.code, ErrorCode::timeout) << out.message;
  EXPECT_NE(out.message.find("decode step"), std::string::npos) << out.message;
  // Past two more timeouts the compute is still silent: the blocks still wait.
  for (int i = 0; i < 2; ++i) {
    const DecodeLoad load = decode_load();
    EXPECT_EQ(load.active_sequences, 0);
    EXPECT_LT(load.free_blocks, load.total_blocks) << "blocks the stalled step may still write were freed";
    caf::scoped_actor waiter{*system_};
    waiter->receive(caf::after(std::chrono::milliseconds(1100)) >> [] {});  // (a timeout passing, on purpose)
  }
  caf::anon_send(decode_compute_, resume_atom::value);
  EXPECT_TRUE(wait_pool_free()) << "the blocks never came back once the compute answered";
}

}  // namespace
}  // namespace disagg::test
