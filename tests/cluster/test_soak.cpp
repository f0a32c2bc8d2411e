// The soak (scripts/soak, not a ctest: DISABLED_ here, run with
// --gtest_also_run_disabled_tests): the multi-host cluster of
// tests/support/net_lab.h (router, 2 prefill, 2 decode, each a host of its
// own) on shaped, lossy links (1 Gbit/s, 0.5% of packets dropped), a closed
// loop of requests (greedy and seeded, 8 at a time) for SOAK_MINUTES
// (default 30), and a fault every SOAK_FAULT_S seconds (default 60) in a
// seeded random order (SOAK_SEED): a worker killed (SIGKILL) and started
// again, a worker stopped (SIGSTOP) for 10 s, a decode host cut off from the
// router for 10 s. Checked at the end: every request answered once and ok,
// with colocated generation's tokens; every decode pool whole; each node's
// RSS and open file descriptors sampled every 10 s (their growth per hour
// over the run's second half is reported; a process started again counts
// from its restart). Written to SOAK_OUT (default build/soak): requests.csv
// (time, latency, ok, tokens equal), faults.csv, resources.csv, summary.txt;
// scripts/soak plots latency over time with the faults marked.
#include <gtest/gtest.h>

#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <random>
#include <thread>

#include "cluster/cluster_fixture.h"
#include "support/net_lab.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : fallback;
}

size_t open_fds(pid_t pid) {
  std::error_code ec;
  size_t n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec))
    ++n;
  return n;
}

TEST(Soak, DISABLED_HostsOnLossyLinksWithAFaultEveryMinute) {
  const std::string refused = NetLab::enter_private_namespace();
  if (!refused.empty()) GTEST_SKIP() << "no network namespace of the test's own: " << refused;
  const int minutes = env_int("SOAK_MINUTES", 30), fault_every = env_int("SOAK_FAULT_S", 60);
  const std::string out_dir = std::getenv("SOAK_OUT") && *std::getenv("SOAK_OUT") ? std::getenv("SOAK_OUT")
                                                                                   : std::string(DISAGG_SOURCE_DIR) + "/build/soak";
  std::filesystem::create_directories(out_dir);
  const std::vector<std::string> hosts = {"router", "prefill-1", "prefill-2", "decode-1", "decode-2"};
  NetLab lab(hosts);
  TestCluster cluster("soak");
  cluster.set_disagg_options("heartbeat-interval-ms = 200\nheartbeat-timeout-ms = 1000\n");
  for (const std::string& h : hosts) cluster.place(h, lab.run_on(h), lab.address(h));
  for (const std::string& h : hosts) lab.shape(h, "1gbit");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(2, 2));
  lab.lose(0.005);

  const auto start = Clock::now(), end = start + std::chrono::minutes(minutes);
  auto since = [&](Clock::time_point t) { return std::chrono::duration<double>(t - start).count(); };
  std::ofstream requests_csv(out_dir + "/requests.csv"), faults_csv(out_dir + "/faults.csv"),
      resources_csv(out_dir + "/resources.csv");
  requests_csv << "t_s,latency_s,ok,tokens_equal,decode_worker,code\n";
  faults_csv << "t_s,fault,target\n";
  resources_csv << "t_s,node,pid,rss_bytes,fds\n";
  std::mutex csv_mutex, nodes_mutex;  // (the cluster's node handles: faults restart them, the sampler reads them)

  // Faults, in a seeded order, each on a seeded worker.
  std::atomic<bool> running{true}, nodes_stopped{false};
  std::thread faults([&] {
    // A node this thread starts again is killed when this thread ends
    // (PR_SET_PDEATHSIG follows the thread that forked): it ends only once
    // every node is stopped.
    struct Linger {
      std::atomic<bool>& until;
      ~Linger() {
        while (!until) std::this_thread::sleep_for(50ms);  // (until the test has stopped the nodes)
      }
    } linger{nodes_stopped};
    std::mt19937 rng(uint32_t(env_int("SOAK_SEED", 1)));
    const std::vector<std::string> workers = {"prefill-1", "prefill-2", "decode-1", "decode-2"};
    for (auto next = start + std::chrono::seconds(fault_every); running && next + 20s < end;
         next += std::chrono::seconds(fault_every)) {
      while (running && Clock::now() < next) std::this_thread::sleep_for(100ms);  // (the fault's schedule)
      if (!running) break;
      const int kind = int(rng() % 3);
      const std::string target = kind == 2 ? (rng() % 2 ? "decode-1" : "decode-2") : workers[rng() % workers.size()];
      const char* names[] = {"kill -9 and restart", "SIGSTOP 10 s", "cut from the router 10 s"};
      {
        std::lock_guard<std::mutex> lock(csv_mutex);
        faults_csv << since(Clock::now()) << "," << names[kind] << "," << target << "\n" << std::flush;
      }
      if (kind == 0) {
        std::lock_guard<std::mutex> lock(nodes_mutex);
        cluster.kill_node(target);
        cluster.start_node(target.rfind("prefill", 0) == 0 ? "prefill" : "decode", target);
      } else if (kind == 1) {
        pid_t pid;
        {
          std::lock_guard<std::mutex> lock(nodes_mutex);
          pid = cluster.node(target).pid();
        }
        ::kill(pid, SIGSTOP);
        std::this_thread::sleep_for(10s);  // (the fault's length: the scenario, checked by outcomes, not waited on)
        ::kill(pid, SIGCONT);
      } else {
        lab.cut(target, "router");
        std::this_thread::sleep_for(10s);  // (the fault's length: the scenario, checked by outcomes, not waited on)
        lab.heal(target, "router");
      }
    }
  });
  // Resources every 10 s.
  std::thread sampler([&] {
    for (auto next = start; running; next += 10s) {
      while (running && Clock::now() < next) std::this_thread::sleep_for(100ms);  // (the sampling schedule)
      std::lock_guard<std::mutex> lock(csv_mutex);
      std::lock_guard<std::mutex> nodes_lock(nodes_mutex);
      for (const std::string& h : hosts) {
        const pid_t pid = cluster.node(h).pid();
        resources_csv << since(Clock::now()) << "," << h << "," << pid << "," << rss_bytes(pid) << "," << open_fds(pid)
                      << "\n";
      }
      resources_csv << std::flush;
    }
  });

  // The closed loop: 8 requests at a time, each checked against colocated generation.
  const std::vector<std::vector<int>> prompts = {{1, 403, 407, 261, 378}, {1, 365, 74, 275}, {1, 24, 7, 95, 30, 11},
                                                 {1, 450, 3, 51, 9}, {1, 170, 110, 27}};
  size_t sent = 0, ok = 0, equal = 0;
  std::map<std::string, size_t> codes;
  while (Clock::now() < end) {
    struct Pending {
      GenerateRequest request;
      Clock::time_point sent;
      std::future<RequestOutcome> outcome;
    };
    std::vector<Pending> batch;
    for (int i = 0; i < 8; ++i, ++sent) {
      Sampling sampling;
      if (sent % 2) sampling = Sampling{0.9f, 0.9f, uint64_t(1000 + sent)};
      GenerateRequest r = token_request(std::vector<int>(prompts[sent % prompts.size()]), 8 + int(sent * 7 % 56), sampling);
      r.deadline_ms = 60000;
      batch.push_back({r, Clock::now(), cluster.client().submit(r)});
    }
    for (auto& p : batch) {
      const RequestOutcome out = p.outcome.get();  // (the client answers by the deadline plus its grace)
      const bool same = out.ok() && out.tokens == colocated_tokens(cluster.model(), p.request);
      ok += out.ok();
      equal += same;
      codes[to_string(out.code)] += 1;
      std::lock_guard<std::mutex> lock(csv_mutex);
      requests_csv << since(p.sent) << "," << std::chrono::duration<double>(Clock::now() - p.sent).count() << ","
                   << out.ok() << "," << same << "," << out.decode_worker << "," << to_string(out.code) << "\n";
    }
  }
  running = false;
  sampler.join();
  requests_csv.close();
  faults_csv.close();
  resources_csv.close();

  // Pools whole once the last faults have passed (a restarted worker's too).
  const bool whole = cluster.wait_for_workers(2, 2) && cluster.wait_until_idle(30s);
  for (const std::string& h : hosts) {  // (the cluster's folder goes with the test process)
    std::error_code ignored;
    std::filesystem::copy_file(cluster.node(h).log_path(), out_dir + "/" + h + ".log",
                               std::filesystem::copy_options::overwrite_existing, ignored);
  }
  std::ofstream summary(out_dir + "/summary.txt");
  summary << "minutes " << minutes << ", fault every " << fault_every << " s, seed " << env_int("SOAK_SEED", 1) << "\n"
          << "requests " << sent << ", ok " << ok << ", tokens equal " << equal << "\n";
  for (const auto& [code, n] : codes) summary << "  " << code << ": " << n << "\n";
  summary << "pools whole at the end: " << (whole ? "yes" : "no") << "\n";
  summary.close();
  EXPECT_EQ(ok, sent) << "requests lost";
  EXPECT_EQ(equal, sent) << "requests whose tokens are not colocated generation's";
  EXPECT_TRUE(whole) << "a decode pool is not whole at the end";
  EXPECT_TRUE(cluster.stop_all());
  nodes_stopped = true;
  faults.join();
}

}  // namespace
}  // namespace disagg::test
