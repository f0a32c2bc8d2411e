// Fuzzing a running HTTP frontend (issue 18): thousands of generated
// malformed and adversarial bodies (tests/support/adversarial_json.h: numbers
// beyond a double, nesting to 400,000 levels, long and invalid UTF-8
// strings, every field with every wrong type, damaged text) and bodies over
// the size limit. Every reply must be a 4xx within 1 s, the frontend's RSS
// must stay within a bound, and a canary request sent all the while from
// another thread must keep being served with the same text.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <atomic>
#include <thread>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>

#include "cluster/cluster_fixture.h"
#include "support/adversarial_json.h"

namespace disagg::test {
namespace {

namespace net = boost::asio;
namespace bhttp = boost::beast::http;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

constexpr size_t kBodies = 4000;
constexpr int64_t kBodyLimit = 1 << 20;  // node.http-body-limit's default
// How much the frontend's RSS may grow over the run: the largest body is
// 1 MiB, parsed at most once at a time on its one I/O thread.
constexpr int64_t kRssGrowthBound = int64_t(64) << 20;
constexpr auto kReplyBound = std::chrono::seconds(1);

struct Reply {
  int status = 0;
  std::string body;
};

// One POST on a fresh connection; a reply that takes longer than `timeout`
// (SO_RCVTIMEO) throws.
Reply post(uint16_t port, const std::string& target, const std::string& body, std::chrono::seconds timeout) {
  net::io_context ioc;
  net::ip::tcp::socket socket(ioc);
  socket.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  timeval tv{timeout.count(), 0};
  ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  bhttp::request<bhttp::string_body> req{bhttp::verb::post, target, 11};
  req.set(bhttp::field::host, "127.0.0.1");
  req.set(bhttp::field::content_type, "application/json");
  req.keep_alive(false);
  req.body() = body;
  req.prepare_payload();
  boost::system::error_code ec;
  bhttp::write(socket, req, ec);  // a body over the limit: the frontend may answer 413 before reading it all
  boost::beast::flat_buffer buffer;
  bhttp::response_parser<bhttp::string_body> parser;
  parser.body_limit(16 << 20);
  bhttp::read(socket, buffer, parser);
  return Reply{int(parser.get().result_int()), parser.get().body()};
}

TEST(HttpFuzz, AdversarialBodiesGet4xxWithinASecondWhileACanaryIsServed) {
  TestCluster cluster("http-fuzz");
  cluster.start_all(1, 1);
  cluster.start_node("frontend", "frontend");
  const uint16_t port = cluster.port_of("frontend");
  const pid_t frontend = cluster.node("frontend").pid();

  const std::string canary_body = R"({"prompt":"Once upon a time","max_tokens":8,"temperature":0})";
  // The frontend answers once the router has its workers.
  Reply first;
  const auto ready_by = Clock::now() + std::chrono::seconds(30);
  while (Clock::now() < ready_by) {
    try {
      first = post(port, "/v1/completions", canary_body, std::chrono::seconds(10));
      if (first.status == 200) break;
    } catch (const std::exception&) {
      // not listening yet
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(first.status, 200) << first.body << cluster.logs();
  const std::string canary_text = json::parse(first.body)["choices"][0]["text"];

  std::atomic<bool> fuzzing{true};
  std::atomic<int> canaries{0};
  std::string canary_failure;
  std::thread canary([&] {
    while (fuzzing.load() && canary_failure.empty()) {
      try {
        const Reply r = post(port, "/v1/completions", canary_body, std::chrono::seconds(10));
        if (r.status != 200 || json::parse(r.body)["choices"][0]["text"] != canary_text)
          canary_failure = std::to_string(r.status) + " " + r.body;
        else
          ++canaries;
      } catch (const std::exception& e) {
        canary_failure = e.what();
      }
    }
  });

  auto bodies = adversarial_bodies(7, kBodies, size_t(kBodyLimit));
  for (size_t extra : {size_t(1), size_t(4096)})
    bodies.push_back({"over the body limit", false, "{\"prompt\":\"" + std::string(size_t(kBodyLimit) + extra, 'a') + "\"}"});
  const int64_t rss_before = rss_bytes(frontend);
  int64_t rss_peak = rss_before;
  Clock::duration slowest{};
  std::string slowest_what;
  int failures = 0;
  for (size_t i = 0; i < bodies.size() && failures < 10; ++i) {
    const auto& b = bodies[i];
    const auto start = Clock::now();
    try {
      const Reply r = post(port, b.chat ? "/v1/chat/completions" : "/v1/completions", b.body, std::chrono::seconds(5));
      const auto took = Clock::now() - start;
      if (took > slowest) slowest = took, slowest_what = b.what;
      if (r.status < 400 || r.status >= 500) {
        ++failures;
        ADD_FAILURE() << b.what << ": " << r.status << " " << r.body.substr(0, 300);
      }
    } catch (const std::exception& e) {
      ++failures;
      ADD_FAILURE() << b.what << ": no reply (" << e.what() << ")";
    }
    if (i % 50 == 0) rss_peak = std::max(rss_peak, rss_bytes(frontend));
    ASSERT_TRUE(process_alive(frontend)) << "the frontend died at " << b.what << "\n" << cluster.node("frontend").log();
  }
  rss_peak = std::max(rss_peak, rss_bytes(frontend));
  fuzzing = false;
  canary.join();

  EXPECT_LT(slowest, kReplyBound) << "slowest reply: "
                                  << std::chrono::duration_cast<std::chrono::milliseconds>(slowest).count() << " ms, "
                                  << slowest_what;
  EXPECT_LT(rss_peak - rss_before, kRssGrowthBound) << "frontend RSS " << rss_before << " -> peak " << rss_peak;
  EXPECT_TRUE(canary_failure.empty()) << canary_failure;
  EXPECT_GT(canaries.load(), 0);
  std::cout << bodies.size() << " bodies, slowest reply "
            << std::chrono::duration_cast<std::chrono::milliseconds>(slowest).count() << " ms (" << slowest_what
            << "), frontend RSS " << rss_before / 1024 << " KiB -> peak " << rss_peak / 1024 << " KiB, "
            << canaries.load() << " canary completions\n";
}

}  // namespace
}  // namespace disagg::test
