// metrics/: the types, labels, the text exposition, promtool's verdict on it,
// concurrent updates, and the /metrics server.
#include <gtest/gtest.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>

#include "metrics/disagg_metrics.h"
#include "metrics/exposer.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::metrics {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Metrics, CounterGaugeHistogramValues) {
  Counter c;
  c.inc();
  c.inc(2.5);
  c.inc(-4);  // ignored: counters never go down
  EXPECT_DOUBLE_EQ(c.value(), 3.5);
  Gauge g;
  g.set(4);
  g.add(-1.5);
  EXPECT_DOUBLE_EQ(g.value(), 2.5);
  Histogram h({0.1, 1.0, 10.0});
  for (double v : {0.05, 0.1, 0.5, 5.0, 50.0}) h.observe(v);
  EXPECT_EQ(h.cumulative_counts(), (std::vector<uint64_t>{2, 3, 4, 5}));  // 0.1 falls in le="0.1"
  EXPECT_EQ(h.count(), 5u);
  EXPECT_DOUBLE_EQ(h.sum(), 55.65);
  EXPECT_THROW(Histogram({1.0, 1.0}), std::invalid_argument);
  EXPECT_THROW(Histogram({2.0, 1.0}), std::invalid_argument);
}

TEST(Metrics, RegistryRefusesNamesPrometheusRejects) {
  Registry r;
  EXPECT_THROW(r.counter("requests", "no _total"), std::invalid_argument);
  EXPECT_THROW(r.gauge("x_total", "only counters end in _total"), std::invalid_argument);
  EXPECT_THROW(r.gauge("vllm:num_requests", "colons are for recording rules"), std::invalid_argument);
  EXPECT_THROW(r.gauge("1abc", "starts with a digit"), std::invalid_argument);
  EXPECT_THROW(r.gauge("ok", "bad label", {"__reserved"}), std::invalid_argument);
  EXPECT_THROW(r.histogram("h_seconds", "le is the bucket label", {1.0}, {"le"}), std::invalid_argument);
  r.gauge("dup", "first");
  EXPECT_THROW(r.gauge("dup", "second"), std::invalid_argument);
  auto& fam = r.counter("labelled_total", "with a label", {"code"});
  EXPECT_THROW(fam.with({}), std::invalid_argument);
  EXPECT_EQ(&fam.with({"a"}), &fam.with({"a"}));  // one child per label values
}

TEST(Metrics, TextExposition) {
  Registry r;
  r.counter("t_requests_total", "Requests.\nSecond line", {"code"}).with({"a\"b\\c\nd"}).inc(3);
  r.gauge("t_usage_perc", "Usage.").get().set(0.25);
  auto& h = r.histogram("t_latency_seconds", "Latency.", {0.5, 1}).get();
  h.observe(0.2);
  h.observe(2);
  const std::string text = r.render();
  EXPECT_EQ(text,
            "# HELP t_requests_total Requests.\\nSecond line\n"
            "# TYPE t_requests_total counter\n"
            "t_requests_total{code=\"a\\\"b\\\\c\\nd\"} 3\n"
            "# HELP t_usage_perc Usage.\n"
            "# TYPE t_usage_perc gauge\n"
            "t_usage_perc 0.25\n"
            "# HELP t_latency_seconds Latency.\n"
            "# TYPE t_latency_seconds histogram\n"
            "t_latency_seconds_bucket{le=\"0.5\"} 1\n"
            "t_latency_seconds_bucket{le=\"1\"} 1\n"
            "t_latency_seconds_bucket{le=\"+Inf\"} 2\n"
            "t_latency_seconds_sum 2.2\n"
            "t_latency_seconds_count 2\n");
  EXPECT_EQ(format_value(0.1), "0.1");
  EXPECT_EQ(format_value(1e-4), "0.0001");
  EXPECT_EQ(format_value(2560), "2560");
}

TEST(Metrics, ConcurrentUpdatesLoseNothing) {
  Registry r;
  auto& c = r.counter("c_total", "c").get();
  auto& h = r.histogram("h_seconds", "h", {1.0}).get();
  auto& g = r.gauge("g", "g").get();
  constexpr int kThreads = 4, kPerThread = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        c.inc();
        h.observe(i % 2 ? 0.5 : 2.0);
        g.add(1);
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_DOUBLE_EQ(c.value(), kThreads * kPerThread);
  EXPECT_EQ(h.count(), uint64_t(kThreads * kPerThread));
  EXPECT_EQ(h.cumulative_counts()[0], uint64_t(kThreads * kPerThread / 2));
  EXPECT_DOUBLE_EQ(h.sum(), kThreads * (kPerThread / 2) * 2.5);
  EXPECT_DOUBLE_EQ(g.value(), kThreads * kPerThread);
}

TEST(Metrics, DisaggCatalogHasEveryLabelValueUpFront) {
  Registry r;
  DisaggMetrics m(r);
  m.success("stop").inc();
  m.error("overloaded").inc(2);
  m.workers.with({"decode"}).set(2);
  const std::string text = r.render();
  for (const char* name :
       {"disagg_time_to_first_token_seconds_bucket{le=\"0.001\"} 0", "disagg_inter_token_latency_seconds_count 0",
        "disagg_e2e_request_latency_seconds_bucket{le=\"7680\"} 0", "disagg_request_queue_time_seconds_sum 0",
        "disagg_request_prefill_time_seconds_count 0", "disagg_request_decode_time_seconds_count 0",
        "disagg_num_requests_running 0", "disagg_num_requests_waiting 0", "disagg_kv_cache_usage_perc 0",
        "disagg_prompt_tokens_total 0", "disagg_generation_tokens_total 0", "disagg_prefill_tokens_total 0",
        "disagg_decode_tokens_total 0",
        "disagg_request_success_total{finished_reason=\"stop\"} 1",
        "disagg_request_success_total{finished_reason=\"length\"} 0",
        "disagg_request_errors_total{code=\"overloaded\"} 2", "disagg_request_errors_total{code=\"internal\"} 0",
        "disagg_kv_transfer_seconds_count 0", "disagg_kv_transfer_bytes_total 0", "disagg_workers{role=\"decode\"} 2",
        "disagg_workers{role=\"prefill\"} 0"})
    EXPECT_TRUE(contains(text, std::string(name) + "\n")) << name << " missing in\n" << text;
}

// promtool (Debian's prometheus package) judges our output; skipped without it.
TEST(Metrics, PromtoolAcceptsTheOutput) {
  if (test::run_command("command -v promtool >/dev/null 2>&1").second != 0)
    GTEST_SKIP() << "promtool not installed (Debian package prometheus; scripts/install-deps installs it)";
  Registry r;
  DisaggMetrics m(r);
  m.time_to_first_token.observe(0.003);
  m.kv_transfer_bytes.inc(12345);
  m.success("length").inc();
  const std::string dir = test::make_temp_dir("metrics-promtool");
  const std::string path = dir + "/metrics.txt";
  std::ofstream(path) << r.render();
  const auto [out, status] = test::run_command("promtool check metrics < " + test::shell_quoted(path) + " 2>&1");
  std::filesystem::remove_all(dir);
  EXPECT_EQ(status, 0) << out;
  EXPECT_EQ(out, "") << "promtool found problems";
}

TEST(Metrics, ExposerServesMetricsAndNothingElse) {
  Registry r;
  r.counter("served_total", "s").get().inc(7);
  Exposer exposer("127.0.0.1", 0, r);
  ASSERT_NE(exposer.port(), 0);
  namespace net = boost::asio;
  namespace http = boost::beast::http;
  net::io_context ioc;
  boost::beast::tcp_stream stream(ioc);
  stream.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), exposer.port()));
  auto get = [&](const std::string& target) {
    http::request<http::empty_body> req(http::verb::get, target, 11);
    req.set(http::field::host, "127.0.0.1");
    http::write(stream, req);
    boost::beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(stream, buffer, res);
    return res;
  };
  const auto ok = get("/metrics");  // two requests on one keep-alive connection
  EXPECT_EQ(ok.result_int(), 200);
  EXPECT_EQ(std::string(ok[http::field::content_type]), kTextContentType);
  EXPECT_TRUE(contains(ok.body(), "served_total 7\n")) << ok.body();
  EXPECT_EQ(get("/other").result_int(), 404);
  EXPECT_THROW(Exposer("127.0.0.1", exposer.port(), r), std::runtime_error);  // port taken
}

// At most kMaxScrapers connections at once: one more is closed as it
// comes, and once one goes, the next is served.
TEST(Metrics, ExposerServesAtMostItsShareOfConnections) {
  Registry r;
  r.counter("served_total", "s").get().inc(1);
  Exposer exposer("127.0.0.1", 0, r);
  namespace net = boost::asio;
  namespace http = boost::beast::http;
  net::io_context ioc;
  const net::ip::tcp::endpoint at(net::ip::make_address("127.0.0.1"), exposer.port());
  // A scrape on a connection of its own: the status, or 0 when the exposer closed it.
  auto scrape = [&](boost::beast::tcp_stream& stream) {
    http::request<http::empty_body> req(http::verb::get, "/metrics", 11);
    req.set(http::field::host, "127.0.0.1");
    boost::beast::error_code ec;
    http::write(stream, req, ec);
    boost::beast::flat_buffer buffer;
    http::response<http::string_body> res;
    http::read(stream, buffer, res, ec);
    return ec ? 0 : res.result_int();
  };
  std::vector<std::unique_ptr<boost::beast::tcp_stream>> held;
  for (int i = 0; i < kMaxScrapers; ++i) {
    held.push_back(std::make_unique<boost::beast::tcp_stream>(ioc));
    held.back()->connect(at);
    ASSERT_EQ(scrape(*held.back()), 200) << "connection " << i;  // (served: its session is alive, kept open)
  }
  boost::beast::tcp_stream extra(ioc);
  extra.connect(at);
  EXPECT_EQ(scrape(extra), 0) << "a connection past kMaxScrapers was served";
  held.pop_back();  // one goes: the next is served (once the exposer has seen it go)
  bool served = false;
  for (int i = 0; i < 200 && !served; ++i) {
    boost::beast::tcp_stream next(ioc);
    next.connect(at);
    served = scrape(next) == 200;
  }
  EXPECT_TRUE(served);
}

}  // namespace
}  // namespace disagg::metrics
