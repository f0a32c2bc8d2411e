// The router at scale: one real router actor (actors/router.h) with N
// simulated workers, no model. The fake prefill workers answer a job at once
// (one KV message to the decode worker, its ack, the report); the fake decode
// workers reserve at once and, every --step-ms, make one token for each
// sequence they hold, as a continuously batching decode worker does: sent
// to the request's client when the reservation names it (the router's
// direct-token-streams, the default) and, as one message per step, to the
// router, which records them (and forwards them with --through-router);
// then they report done and their load. Clients are the client library's
// (Client::submit_async, one actor per request); --concurrency requests
// stay in flight (closed loop) for --seconds after a warm-up.
//
// Each token carries the microsecond (since the run began) at which its fake
// decode worker sent it, so the client's callback measures the latency of
// each token from its decode worker: direct, one hop; through the router,
// two, and its mailbox.
//
//   bench_router [--workers 16,256,1024] [--concurrency 4096] [--new-tokens 40]
//                [--step-ms 16] [--seconds 5] [--warmup 2] [--prefill-share 0.5] [--through-router]
//
// Prints, for each worker count: requests/s completed, tokens/s delivered to
// the clients, the latency per token (p50, p99, max), the requests that
// failed (every accepted request must complete), the cores the process kept
// busy, and the router thread's own (the bench runs it detached): per
// token and per request.
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "actors/client.h"
#include "actors/config.h"
#include "actors/router.h"
#include "apps/cli/cli.h"
#include "caf/all.hpp"
#include "metrics/disagg_metrics.h"
#include "actors/log.h"

namespace {

using namespace disagg;
using BenchClock = std::chrono::steady_clock;
using cli::parse_integer;
using cli::UsageError;

struct Options {
  std::vector<int> workers{16, 256, 1024};
  int concurrency = 4096;
  int new_tokens = 40;
  int step_ms = 16;
  int seconds = 5;
  int warmup = 2;
  double prefill_share = 0.5;  // of the workers, prefill; the rest decode
  bool through_router = false;  // direct-token-streams = false
};

const char* kUsage =
    "usage: bench_router [--workers 16,256,1024] [--concurrency 4096] [--new-tokens 40] [--step-ms 16]\n"
    "                    [--seconds 5] [--warmup 2] [--prefill-share 0.5] [--through-router]\n";

Options parse_args(int argc, char** argv) {
  Options o;
  for (disagg::cli::Flags flags(argc, argv, {"--through-router"}); flags.next();) {
    const std::string& flag = flags.flag();
    const std::string& value = flags.value();
    if (flag == "--through-router") {
      o.through_router = true;
      continue;
    }
    if (flag == "--workers") {
      o.workers.clear();
      std::stringstream list(value);
      for (std::string n; std::getline(list, n, ',');) o.workers.push_back(int(parse_integer(flag, n, 2, 65536)));
    } else if (flag == "--concurrency") o.concurrency = int(parse_integer(flag, value, 1, 1 << 20));
    else if (flag == "--new-tokens") o.new_tokens = int(parse_integer(flag, value, 1, 100000));
    else if (flag == "--step-ms") o.step_ms = int(parse_integer(flag, value, 1, 10000));
    else if (flag == "--seconds") o.seconds = int(parse_integer(flag, value, 1, 3600));
    else if (flag == "--warmup") o.warmup = int(parse_integer(flag, value, 0, 3600));
    else if (flag == "--prefill-share") o.prefill_share = cli::parse_float(flag, value, 0.01f, 0.99f);
    else throw UsageError{"unknown option " + flag};
  }
  if (o.workers.empty()) throw UsageError{"--workers needs at least one count"};
  return o;
}

// Microseconds since the run began (the stamp a fake decode worker puts in
// each token: 2^31 us is 35 minutes).
BenchClock::time_point g_start;
int32_t stamp_now() {
  return int32_t(std::chrono::duration_cast<std::chrono::microseconds>(BenchClock::now() - g_start).count() &
                 0x7fffffff);
}

// The model every fake worker and the router agree on (nothing computes it).
ModelInfo fake_model() {
  ModelInfo m;
  m.fingerprint = 0x5eed;
  m.vocab_size = 32000;
  m.seq_len = 4096;
  m.n_layers = 16;
  m.n_kv_heads = 8;
  m.head_dim = 64;
  m.backend = "fake";
  return m;
}

constexpr int32_t kBlockSize = 16;
constexpr int32_t kPoolBlocks = 1 << 20;  // room is not what this measures

// ---- fake decode worker ------------------------------------------------------

using fake_decode_actor = decode_actor::extend<caf::reacts_to<step_atom>>;

struct FakeSequence {
  int32_t next_index = 0;  // of the next token to stream
  int32_t limit = 0;       // the index after the last
  int32_t first_step = 0;
  int32_t blocks = 0;
  std::vector<int32_t> tokens;
  client_actor client;  // KvReservation::client: where its tokens go too
  uint64_t attempt = 0;  // KvReservation::attempt: its tokens and done name it
};

struct FakeDecodeState {
  router_actor router;
  std::chrono::milliseconds step{16};
  std::unordered_map<RequestId, int32_t> reserved;  // id -> blocks
  std::unordered_map<RequestId, client_actor> clients;  // KvReservation::client of each reservation
  std::unordered_map<RequestId, uint64_t> attempts;     // KvReservation::attempt of each reservation
  std::unordered_map<RequestId, FakeSequence> active;
  int32_t free_blocks = kPoolBlocks;
  bool ticking = false;
  uint64_t serial = 1;
};

DecodeLoad fake_load(const FakeDecodeState& st) {
  return DecodeLoad{st.free_blocks, kPoolBlocks, kBlockSize, int32_t(st.active.size())};
}

using FakeDecodeSelf = fake_decode_actor::stateful_pointer<FakeDecodeState>;

// A reservation's blocks back to the pool, its client forgotten.
void fake_release(FakeDecodeState& st, RequestId id) {
  if (auto r = st.reserved.find(id); r != st.reserved.end()) {
    st.free_blocks += r->second;
    st.reserved.erase(r);
  }
  st.clients.erase(id);
  st.attempts.erase(id);
}

// One decode step: a token for every sequence (one message, as a decode
// worker's step sends), then the finished ones' done and the load.
void fake_step(FakeDecodeSelf self) {
  auto& st = self->state;
  TokenBatch batch;
  batch.events.reserve(st.active.size());
  std::vector<RequestId> finished;
  for (auto& [id, seq] : st.active) {
    const int32_t token = stamp_now();
    seq.tokens.push_back(token);
    TokenEvent event{id, seq.next_index++, token, {}, 0, {}, seq.attempt};
    if (seq.client) self->send(seq.client, token_atom::value, event);  // the router's record still follows
    batch.events.push_back(std::move(event));
    if (seq.next_index >= seq.limit) finished.push_back(id);
  }
  self->send(st.router, token_atom::value, std::move(batch));
  for (RequestId id : finished) {
    auto it = st.active.find(id);
    DecodeDone done;
    done.id = id;
    done.tokens = std::move(it->second.tokens);
    done.first_step = it->second.first_step;
    done.attempt = it->second.attempt;
    self->send(st.router, done_atom::value, std::move(done));
    fake_release(st, id);
    st.active.erase(it);
  }
  if (!finished.empty()) self->send(st.router, load_atom::value, fake_load(st));
  st.ticking = !st.active.empty();
  if (st.ticking) self->delayed_send(self, st.step, step_atom::value);
}

fake_decode_actor::behavior_type fake_decode(FakeDecodeSelf self,
                                             router_actor router, std::chrono::milliseconds step) {
  self->state.router = std::move(router);
  self->state.step = step;
  return {
      [=](reserve_atom, KvReservation& r) -> ReserveReply {
        auto& st = self->state;
        const int32_t blocks = (r.positions + kBlockSize - 1) / kBlockSize;
        st.reserved[r.id] = blocks;
        st.clients[r.id] = r.client;
        st.attempts[r.id] = r.attempt;
        st.free_blocks -= blocks;
        ReserveReply reply{r.id, ErrorCode::none, {}, fake_load(st), {}, 0};
        reply.target.transfer_id = st.serial++;
        reply.target.transport = 0;  // a stream, not a local prefill
        reply.target.block_size = kBlockSize;
        return reply;
      },
      [=](kv_atom, KvTransfer& kv) -> KvAck {
        auto& st = self->state;
        if (!st.reserved.count(kv.id)) return KvAck{kv.id, ErrorCode::timeout, "no reservation", fake_load(st)};
        FakeSequence seq;
        seq.next_index = kv.first_step;
        seq.first_step = kv.first_step;
        seq.limit = kv.first_step + kv.max_new_tokens;
        seq.client = st.clients[kv.id];
        seq.attempt = st.attempts[kv.id];
        st.active.emplace(kv.id, std::move(seq));
        if (!st.ticking) {
          st.ticking = true;
          self->delayed_send(self, st.step, step_atom::value);
        }
        return KvAck{kv.id, ErrorCode::none, {}, fake_load(st)};
      },
      [=](step_atom) { fake_step(self); },
      [=](prefill_atom, PrefillJob& job) -> PrefillReport {
        PrefillReport report;
        report.id = job.id;
        report.code = ErrorCode::internal;
        report.message = "a fake decode worker prefills nothing";
        return report;
      },
      [=](cancel_atom, RequestId id) {
        self->state.active.erase(id);
        fake_release(self->state, id);
      },
      [](router_atom, caf::actor_addr&) {},
      [=](lease_atom, int64_t) {},
      [=](landed_atom, RequestId, uint64_t, KvLanded&) {},
      [=](status_atom) { return fake_load(self->state); },
      [=](kv_events_atom) { return KvEvents{0, true, {}, {}}; },
  };
}

// ---- fake prefill worker -----------------------------------------------------

prefill_actor::behavior_type fake_prefill(prefill_actor::pointer self) {
  return {
      [=](prefill_atom, PrefillJob& job, decode_actor& decode) -> caf::result<PrefillReport> {
        auto promise = self->make_response_promise<PrefillReport>();
        KvTransfer kv;
        kv.id = job.id;
        kv.prompt_len = int32_t(job.prompt_tokens.size());
        kv.max_new_tokens = job.max_new_tokens;
        kv.sampling = job.sampling;
        kv.transfer_id = job.target.transfer_id;
        kv.ticket = job.target.ticket;
        kv.first_step = job.first_step;
        const RequestId id = job.id;
        self->request(decode, std::chrono::milliseconds(job.deadline_ms), kv_atom::value, std::move(kv))
            .then(
                [=](KvAck& ack) mutable {
                  PrefillReport report;
                  report.id = id;
                  report.code = ack.code;
                  report.message = ack.message;
                  report.decode_load = ack.load;
                  promise.deliver(std::move(report));
                },
                [=](caf::error& e) mutable {
                  PrefillReport report;
                  report.id = id;
                  report.code = ErrorCode::worker_lost;
                  report.message = caf::to_string(e);
                  promise.deliver(std::move(report));
                });
        return promise;
      },
      [=](cancel_atom, RequestId) {},
      [](router_atom, caf::actor_addr&) {},
      [=](status_atom) { return PrefillLoad{}; },
      [=](kv_events_atom) { return KvEvents{0, true, {}, {}}; },
  };
}

// ---- measurement -------------------------------------------------------------

// Added latency per token, 1 us buckets up to 1 s (the last bucket: more).
class LatencyHistogram {
 public:
  void add(int64_t us) {
    buckets_[size_t(std::clamp<int64_t>(us, 0, kBuckets - 1))].fetch_add(1, std::memory_order_relaxed);
  }
  uint64_t count() const {
    uint64_t n = 0;
    for (const auto& b : buckets_) n += b.load();
    return n;
  }
  // The smallest latency (us) at or below which a fraction p of the samples lie.
  int64_t percentile(double p) const {
    const uint64_t n = count();
    if (n == 0) return 0;
    const uint64_t rank = std::max<uint64_t>(1, uint64_t(p * double(n) + 0.5));
    uint64_t seen = 0;
    for (size_t i = 0; i < buckets_.size(); ++i)
      if ((seen += buckets_[i].load()) >= rank) return int64_t(i);
    return kBuckets - 1;
  }

 private:
  static constexpr int64_t kBuckets = 1000000;
  std::vector<std::atomic<uint64_t>> buckets_ = std::vector<std::atomic<uint64_t>>(kBuckets);
};

struct Load {
  std::atomic<bool> measuring{false};
  std::atomic<bool> stopping{false};
  std::atomic<uint64_t> tokens{0};     // delivered while measuring
  std::atomic<uint64_t> completed{0};  // ok outcomes while measuring
  std::atomic<uint64_t> failed{0};     // any other outcome, at any time
  std::atomic<int64_t> max_us{0};
  LatencyHistogram latency;
  std::mutex mutex;
  std::condition_variable drained;
  int outstanding = 0;
  std::string first_failure;
};

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

// CPU seconds of the router's own thread (RouterThread::own),
// and it is the process's one detached actor, whose thread CAF names
// "caf.actor" (/proc/self/task/*/comm; utime + stime of its stat).
double router_cpu_seconds() {
  double total = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string name;
    std::getline(comm, name);
    if (name != "caf.actor") continue;
    std::ifstream stat(task.path() / "stat");
    std::string line;
    std::getline(stat, line);
    std::istringstream fields(line.substr(line.rfind(')') + 2));  // after "pid (comm) "
    std::string field;
    unsigned long long utime = 0, stime = 0;
    for (int i = 3; i <= 15 && fields >> field; ++i) {  // fields 14 and 15 (1-based), state is 3
      if (i == 14) utime = std::stoull(field);
      if (i == 15) stime = std::stoull(field);
    }
    total += double(utime + stime) / double(sysconf(_SC_CLK_TCK));
  }
  return total;
}

// Keeps `load.outstanding` requests in flight until load.stopping: each
// outcome submits the next request.
void submit_one(Client& client, Load& load, const Options& opt, uint64_t n) {
  GenerateRequest request;
  request.prompt_tokens.reserve(16);
  request.prompt_tokens.push_back(1);
  for (int i = 1; i < 16; ++i) request.prompt_tokens.push_back(int32_t(3 + (n * 7919 + uint64_t(i) * 104729) % 31000));
  // Lengths from new_tokens/2 to 3 new_tokens/2 (mean new_tokens): requests
  // that all had one length would finish in waves, every one at once.
  request.max_new_tokens = std::max<int>(1, opt.new_tokens / 2 + int((n * 2654435761u) % uint64_t(opt.new_tokens + 1)));
  request.token_text = false;
  request.deadline_ms = 60000;
  auto on_token = [&load](const TokenEvent& event) {
    if (!load.measuring.load(std::memory_order_relaxed)) return;
    int64_t us = int64_t(stamp_now()) - int64_t(event.token);
    if (us < 0) us += int64_t(1) << 31;
    load.latency.add(us);
    load.tokens.fetch_add(1, std::memory_order_relaxed);
    int64_t seen = load.max_us.load(std::memory_order_relaxed);
    while (us > seen && !load.max_us.compare_exchange_weak(seen, us)) {
    }
  };
  auto on_outcome = [&client, &load, &opt, n](RequestOutcome outcome) {
    if (!outcome.ok()) {
      load.failed.fetch_add(1);
      std::lock_guard<std::mutex> lock(load.mutex);
      if (load.first_failure.empty()) load.first_failure = to_string(outcome.code) + ": " + outcome.message;
    } else if (load.measuring.load(std::memory_order_relaxed)) {
      load.completed.fetch_add(1, std::memory_order_relaxed);
    }
    if (!load.stopping.load()) {
      submit_one(client, load, opt, n + uint64_t(opt.concurrency));
      return;
    }
    std::lock_guard<std::mutex> lock(load.mutex);
    if (--load.outstanding == 0) load.drained.notify_all();
  };
  client.submit_async(std::move(request), std::move(on_token), std::move(on_outcome));
}

// True when every request completed.
bool run_point(const Options& opt, int workers) {
  DisaggSystemConfig config;
  caf::actor_system system{config};
  DisaggConfig disagg;
  disagg.queue_capacity = opt.concurrency;
  disagg.direct_token_streams = !opt.through_router;
  const ModelInfo model = fake_model();
  auto router = spawn_router(system, disagg, nullptr, model, RouterThread::own);  // (its CPU: router_cpu_seconds)

  const int prefills = std::clamp(int(double(workers) * opt.prefill_share + 0.5), 1, workers - 1);
  const int decodes = workers - prefills;
  std::vector<caf::actor> spawned;
  {
    caf::scoped_actor self{system};
    auto join = [&](WorkerInfo info, auto handle) {
      self->request(router, std::chrono::seconds(10), register_atom::value, std::move(info), handle)
          .receive([](caf::ok_atom) {},
                   [&](caf::error& e) { throw std::runtime_error("registration refused: " + caf::to_string(e)); });
    };
    for (int i = 0; i < prefills; ++i) {
      auto p = system.spawn(fake_prefill);
      spawned.push_back(caf::actor_cast<caf::actor>(p));
      WorkerInfo info{WorkerRole::prefill, "prefill-" + std::to_string(i), model, kBlockSize, 0, 0, {}, {}, {}, {}};
      join(std::move(info), p);
    }
    for (int i = 0; i < decodes; ++i) {
      auto d = system.spawn(fake_decode, router, std::chrono::milliseconds(opt.step_ms));
      spawned.push_back(caf::actor_cast<caf::actor>(d));
      WorkerInfo info{WorkerRole::decode, "decode-" + std::to_string(i), model, kBlockSize, kPoolBlocks, 0,
                      {}, {}, {}, {}};
      join(std::move(info), caf::actor_cast<decode_actor>(d));
    }
  }

  Client client(system, router);
  Load load;
  load.outstanding = opt.concurrency;
  for (int i = 0; i < opt.concurrency; ++i) submit_one(client, load, opt, uint64_t(i));
  std::this_thread::sleep_for(std::chrono::seconds(opt.warmup));  // (the run's length, not a synchronisation)
  const double cpu_before = cpu_seconds();
  const double router_before = router_cpu_seconds();
  const double late_before = metrics::disagg_metrics().tokens_from_outcome.value();
  const auto from = BenchClock::now();
  load.measuring = true;
  std::this_thread::sleep_for(std::chrono::seconds(opt.seconds));
  load.measuring = false;
  const double wall = std::chrono::duration<double>(BenchClock::now() - from).count();
  const double cpu = cpu_seconds() - cpu_before;
  const double router_cpu = router_cpu_seconds() - router_before;
  load.stopping = true;
  bool drained = false;
  {
    std::unique_lock<std::mutex> lock(load.mutex);  // every outcome comes by its deadline + the client's grace
    drained = load.drained.wait_for(lock, std::chrono::seconds(70), [&] { return load.outstanding == 0; });
    if (!drained) std::printf("  %d requests still outstanding after 70 s\n", load.outstanding);
  }

  const double tokens = double(load.tokens.load());
  const double requests = double(load.completed.load());
  std::printf("%5d workers (%d prefill, %d decode)%s: %6.0f requests/s, %7.0f tokens/s to clients; "
              "latency per token p50 %lld us, p99 %lld us, max %lld us; %llu failed; "
              "process %.2f cores busy; router thread %.2f cores busy, %.2f us per token, %.1f us per request\n",
              workers, prefills, decodes, opt.through_router ? " through the router" : " direct", requests / wall, tokens / wall,
              (long long)load.latency.percentile(0.50), (long long)load.latency.percentile(0.99),
              (long long)load.max_us.load(), (unsigned long long)load.failed.load(), cpu / wall, router_cpu / wall,
              tokens > 0 ? 1e6 * router_cpu / tokens : 0.0, requests > 0 ? 1e6 * router_cpu / requests : 0.0);
  if (!load.first_failure.empty()) std::printf("  first failure: %s\n", load.first_failure.c_str());
  const double late = metrics::disagg_metrics().tokens_from_outcome.value() - late_before;
  if (late > 0) std::printf("  %.0f tokens came with their outcome, not as events\n", late);
  std::fflush(stdout);

  caf::anon_send_exit(router, caf::exit_reason::user_shutdown);  // first: it would log each worker's exit
  for (auto& a : spawned) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  return drained && load.failed.load() == 0 && late == 0;
}

int run(const Options& opt) {
  g_start = BenchClock::now();
  set_node_log_level(LogLevel::warning);  // not a line per registration
  const double offered_tokens = double(opt.concurrency) * 1000.0 / double(opt.step_ms);
  std::printf("one router, simulated workers: %d requests in flight x %d tokens, one token per sequence every %d ms "
              "(offered at most %.0f tokens/s, %.0f requests/s); %d s measured after %d s\n",
              opt.concurrency, opt.new_tokens, opt.step_ms, offered_tokens, offered_tokens / opt.new_tokens,
              opt.seconds, opt.warmup);
  bool all = true;
  for (int workers : opt.workers) all = run_point(opt, workers) && all;
  return all ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return disagg::cli::main_with_usage("bench_router", kUsage, argc, argv, parse_args, run);
}
