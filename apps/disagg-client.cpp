// disagg-client: sends one request to a running cluster's router (as a remote
// CAF node), streams the generated text to stdout as tokens arrive and prints
// the time to first token and the token rate to stderr; or, with --status,
// prints the router's view of the cluster.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "node/client.h"
#include "apps/cli/cli.h"
#include "gpu/error.h"
#include "text/tokenizer.h"

namespace {

using namespace disagg::cli;

const std::string kUsage = std::string(
    "usage: disagg-client --router HOST:PORT (--prompt TEXT | --prompt-tokens \"1 403 407\")\n"
    "                     --max-new-tokens N [sampling flags]\n"
    "                     [--session KEY] [--deadline-ms MS] [--connect-timeout-ms MS] [--tokenizer T] [--json]\n"
    "       disagg-client --router HOST:PORT --status\n"
    "       (either form) [--tls-cert PEM --tls-key PEM --tls-ca PEM]\n"
    "Streams the continuation to stdout and prints TTFT and tokens/s to stderr; with --json\n"
    "prints one line {\"prompt_tokens\":[...],\"output_tokens\":[...],\"text\":\"...\", timings}.\n"
    "--tokenizer (default: $TOKENIZER) encodes a text prompt here; without it the router\n"
    "encodes it (prompt_tokens in the JSON are the router's). --status prints \"workers prefill=P decode=D queued=Q\n"
    "in_flight=F\" and one line per worker. Exit codes: 0 ok, 1 the request failed in the cluster\n"
    "(worker_lost, incompatible_kv, internal, cancelled), 2 bad usage, 3 the router is unreachable,\n"
    "4 the request was refused (invalid_request, kv_too_large), 5 overloaded (retry later),\n"
    "6 timeout (its deadline passed).\n"
    "--connect-timeout-ms (default 5000, at most --deadline-ms): how long a refused or reset\n"
    "connection to the router is retried, with backoff, before exit 3.\n"
    "--tls-cert/--tls-key/--tls-ca (all three): mutual TLS with a router whose nodes set tls.*; the\n"
    "client's certificate must be signed by the cluster's CA (scripts/cluster certs makes one).\n") + "Sampling flags:\n" + kSamplingUsage;

struct Options {
  std::string router_host;
  uint16_t router_port = 0;
  std::string tokenizer, session;
  GenerationFlags gen;
  bool json = false, status = false;
  int64_t deadline_ms = 0;
  int64_t connect_timeout_ms = disagg::kDefaultConnectWait.count();
  disagg::TlsOptions tls;
};

Options parse_args(int argc, char** argv) {
  Options o;
  if (const char* env = std::getenv("TOKENIZER"); env && *env) o.tokenizer = env;
  for (Flags flags(argc, argv, {"--json", "--status"}); flags.next();) {
    const std::string& flag = flags.flag();
    const std::string& value = flags.value();
    if (flag == "--json" || flag == "--status") {
      (flag == "--json" ? o.json : o.status) = true;
      continue;
    }
    if (o.gen.take(flag, value)) continue;
    if (flag == "--router") {
      const auto colon = value.rfind(':');
      if (colon == std::string::npos || colon == 0) throw UsageError{"--router expects HOST:PORT, got '" + value + "'"};
      o.router_host = value.substr(0, colon);
      o.router_port = uint16_t(parse_integer("--router port", value.substr(colon + 1), 1, 65535));
    } else if (flag == "--session") {
      o.session = value;
    } else if (flag == "--deadline-ms") {
      o.deadline_ms = parse_integer(flag, value, 1, disagg::kMaxDeadlineMs);
    } else if (flag == "--connect-timeout-ms") {
      o.connect_timeout_ms = parse_integer(flag, value, 0, disagg::kMaxDeadlineMs);
    } else if (flag == "--tokenizer") {
      o.tokenizer = value;
    } else if (flag == "--tls-cert") {
      o.tls.certificate = value;
    } else if (flag == "--tls-key") {
      o.tls.key = value;
    } else if (flag == "--tls-ca") {
      o.tls.ca_file = value;
    } else {
      throw UsageError{"unknown option " + flag};
    }
  }
  if (o.router_host.empty()) throw UsageError{"--router HOST:PORT is required"};
  if (const std::string problems = o.tls.validate(); !problems.empty())
    throw UsageError{problems + " (--tls-cert, --tls-key, --tls-ca)"};
  if (o.status) return o;
  o.gen.require_complete();
  return o;
}

// The process's exit code for a request's outcome: the CLI edge of the
// system's error codes (as http/api.cpp error_for_outcome is the HTTP one).
int exit_code_for(disagg::ErrorCode code) {
  using disagg::ErrorCode;
  switch (code) {
    case ErrorCode::none: return 0;
    case ErrorCode::invalid_request:
    case ErrorCode::kv_too_large: return 4;
    case ErrorCode::overloaded: return 5;
    case ErrorCode::timeout: return 6;
    case ErrorCode::incompatible_kv:
    case ErrorCode::cancelled:
    case ErrorCode::worker_lost:
    case ErrorCode::internal: break;
  }
  return 1;
}

int print_status(disagg::Client& client, const std::string& where) {
  auto status = client.status();
  if (!status) {
    std::cerr << "disagg-client: the router at " << where << " did not answer the status request\n";
    return 3;
  }
  using disagg::WorkerRole;
  std::cout << "workers prefill=" << status->count(WorkerRole::prefill)
            << " decode=" << status->count(WorkerRole::decode) << " queued=" << status->queued
            << " in_flight=" << status->in_flight << "\n";
  for (const auto& w : status->workers) {
    std::cout << to_string(w.role) << " " << w.name << " in_flight=" << w.in_flight;
    if (w.role == WorkerRole::prefill)
      std::cout << " outstanding_tokens=" << w.outstanding_tokens;
    else
      std::cout << " free_blocks=" << w.free_blocks << "/" << w.total_blocks
                << " active_sequences=" << w.active_sequences << " endpoint=" << w.endpoint;
    std::cout << "\n";
  }
  return 0;
}

// The request the flags describe: the prompt as token ids (encoded here when
// there is a tokenizer) or as text for the router to encode.
disagg::GenerateRequest request_of(const Options& o, const disagg::gpu::Tokenizer* tokenizer) {
  disagg::GenerateRequest request;
  if (o.gen.has_prompt_tokens) {
    request.prompt_tokens = o.gen.prompt_tokens;
  } else if (tokenizer) {
    request.prompt_tokens = tokenizer->encode(o.gen.prompt);
  } else {
    request.prompt_text = o.gen.prompt;
    request.prompt_is_text = true;
  }
  request.max_new_tokens = o.gen.max_new_tokens;
  request.sampling = o.gen.sampling;
  request.session = o.session;
  request.deadline_ms = o.deadline_ms;
  return request;
}

// The summary on stderr and, with --json, the one line on stdout.
void report(const Options& o, const disagg::RequestOutcome& outcome, const std::string& text, double ttft_ms,
            double total_ms) {
  const size_t n = outcome.tokens.size();
  const double tokens_per_s = total_ms > 0 ? 1000.0 * double(n) / total_ms : 0.0;
  char summary[256];
  std::snprintf(summary, sizeof summary, "ttft %.1f ms, %zu tokens in %.1f ms (%.1f tokens/s), finish %s", ttft_ms,
                n, total_ms, tokens_per_s, to_string(outcome.finish).c_str());
  std::cerr << summary << " [prefill " << outcome.prefill_worker << " " << outcome.timings.prefill_us / 1000.0
            << " ms, kv transfer " << outcome.timings.kv_transfer_us / 1000.0 << " ms, decode "
            << outcome.decode_worker << " " << outcome.timings.decode_us / 1000.0 << " ms]\n";
  if (!o.json) return;
  nlohmann::ordered_json line;
  line["prompt_tokens"] = outcome.prompt_tokens;
  line["output_tokens"] = outcome.tokens;
  line["text"] = text;
  line["finish"] = to_string(outcome.finish);
  line["ttft_ms"] = ttft_ms;
  line["total_ms"] = total_ms;
  line["tokens_per_s"] = tokens_per_s;
  line["timings"] = {{"queued_us", outcome.timings.queued_us},
                     {"prefill_us", outcome.timings.prefill_us},
                     {"kv_transfer_us", outcome.timings.kv_transfer_us},
                     {"decode_us", outcome.timings.decode_us}};
  line["prefill_worker"] = outcome.prefill_worker;
  line["decode_worker"] = outcome.decode_worker;
  std::cout << json_line(line) << std::endl;
}

int run(const Options& o) {
  using Clock = std::chrono::steady_clock;
  std::unique_ptr<disagg::gpu::Tokenizer> tokenizer;
  if (!o.tokenizer.empty() && (o.gen.has_prompt || !o.json))
    tokenizer = std::make_unique<disagg::gpu::Tokenizer>(disagg::gpu::Tokenizer::load(o.tokenizer, 0));

  const std::string where = o.router_host + ":" + std::to_string(o.router_port);
  std::unique_ptr<disagg::RemoteClient> remote;
  try {
    const int64_t wait = o.deadline_ms > 0 ? std::min(o.connect_timeout_ms, o.deadline_ms) : o.connect_timeout_ms;
    remote = std::make_unique<disagg::RemoteClient>(where, std::chrono::milliseconds(wait), disagg::ClientOptions{},
                                                    o.tls);
  } catch (const disagg::gpu::Error& e) {
    std::cerr << "disagg-client: " << e.what() << "\n";
    return 3;
  }
  disagg::Client& client = remote->client();
  if (o.status) return print_status(client, where);

  const disagg::GenerateRequest request = request_of(o, tokenizer.get());
  const bool stream = !o.json;
  if (stream && o.gen.has_prompt) std::cout << o.gen.prompt << std::flush;

  // The token callback runs on a CAF thread; the main thread reads these
  // only after the outcome arrived (which the client sets after the tokens).
  std::mutex mutex;
  std::optional<Clock::time_point> first_token_at;
  int previous = request.prompt_tokens.empty() ? disagg::gpu::kBosToken : request.prompt_tokens.back();
  const auto start = Clock::now();
  auto on_token = [&](const disagg::TokenEvent& event) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!first_token_at) first_token_at = Clock::now();
    if (!stream) return;
    std::string piece = event.text;
    if (tokenizer && piece.empty()) {
      try {
        piece = tokenizer->decode(previous, event.token);
      } catch (const std::exception&) {
      }
    }
    previous = event.token;
    std::cout << piece << std::flush;
  };
  const disagg::RequestOutcome outcome = client.generate(request, on_token);
  const auto end = Clock::now();
  if (stream) std::cout << std::endl;
  if (!outcome.ok()) {
    std::cerr << "disagg-client: error " << to_string(outcome.code) << ": " << outcome.message << "\n";
    return exit_code_for(outcome.code);
  }

  std::lock_guard<std::mutex> lock(mutex);
  const double total_ms = std::chrono::duration<double, std::milli>(end - start).count();
  const double ttft_ms =
      first_token_at ? std::chrono::duration<double, std::milli>(*first_token_at - start).count() : total_ms;
  std::string text = outcome.text;
  if (text.empty() && tokenizer && !outcome.prompt_tokens.empty())
    text = tokenizer->decode_all(outcome.prompt_tokens.back(), outcome.tokens);
  report(o, outcome, text, ttft_ms, total_ms);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return disagg::cli::main_with_usage("disagg-client", kUsage.c_str(), argc, argv, parse_args, run);
}
