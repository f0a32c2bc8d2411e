// Throughput of the in-process disaggregated actors against sequential
// gpu::generate, measured in one run: N requests generated one after another
// by gpu::generate (one engine, no actors, no batching, no server: a baseline
// for the actors' overhead, NOT a colocated server), then the same N submitted
// at once to an in-process cluster (router + P prefill + D decode workers).
// Prints tokens/s of both and their ratio ("vs sequential gpu::generate"), TTFT
// and time per output token, and checks that every request produced the tokens
// of gpu::generate.
//
// Disaggregated against colocated serving (worker nodes that prefill and decode
// with continuous batching, behind the same router and HTTP frontend, under an
// open-loop load with SLOs) is `scripts/bench compare`, not this program.
//
//   bench_serving [--model M] [--requests 16] [--new-tokens 100] [--prefill 2] [--decode 2]
//
// Without --model it uses ../shared/models/stories260K.bin when present, else a
// synthetic model written to the temp dir.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <future>
#include <mutex>
#include <string>
#include <vector>

#include "actors/client.h"
#include "actors/config.h"
#include "node/local_cluster.h"
#include "apps/cli/cli.h"
#include "caf/actor_system.hpp"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "engine/engine.h"
#include "engine/generate.h"

namespace {

using Clock = std::chrono::steady_clock;
using disagg::cli::parse_integer;
using disagg::cli::UsageError;

struct Options {
  std::string model;
  int requests = 16;
  int new_tokens = 100;
  int prefill = 2;
  int decode = 2;
};

const char* kUsage =
    "usage: bench_serving [--model M] [--requests N] [--new-tokens N] [--prefill P] [--decode D]\n";

Options parse_args(int argc, char** argv) {
  Options o;
  for (disagg::cli::Flags flags(argc, argv); flags.next();) {
    const std::string& flag = flags.flag();
    const std::string& value = flags.value();
    if (flag == "--model") o.model = value;
    else if (flag == "--requests") o.requests = int(parse_integer(flag, value, 1, 4096));
    else if (flag == "--new-tokens") o.new_tokens = int(parse_integer(flag, value, 1, 100000));
    else if (flag == "--prefill") o.prefill = int(parse_integer(flag, value, 1, 64));
    else if (flag == "--decode") o.decode = int(parse_integer(flag, value, 1, 64));
    else throw UsageError{"unknown option " + flag};
  }
  return o;
}

std::string default_model() {
  const std::string shared = std::string(DISAGG_SOURCE_DIR) + "/../shared/models/stories260K.bin";
  if (std::filesystem::exists(shared)) return shared;
  const auto path = (std::filesystem::temp_directory_path() / "disagg-bench-serving.bin").string();
  disagg::gpu::ModelConfig c{64, 172, 5, 8, 4, 512, 512, true};
  disagg::gpu::write_random_checkpoint(path, c, 11);
  return path;
}

// Request i: a short prompt of its own, sampled with seed i (temperature 0.8).
std::vector<int> prompt_of(int i, int vocab) {
  return {1, 3 + (i * 37) % (vocab - 3), 3 + (i * 101 + 7) % (vocab - 3), 3 + (i * 13 + 5) % (vocab - 3)};
}

double percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[std::min(v.size() - 1, size_t(p * double(v.size() - 1) + 0.5))];
}

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// The baseline: sequential gpu::generate, one engine, requests one after another.
struct Sequential {
  std::vector<std::vector<int>> tokens;  // each request's
  size_t count = 0;                      // all of them
  double ms = 0;
};

Sequential run_sequential(const std::shared_ptr<const disagg::gpu::Checkpoint>& checkpoint, int requests,
                          int new_tokens) {
  Sequential out;
  out.tokens.resize(size_t(requests));
  const int vocab = checkpoint->config().vocab_size;
  disagg::gpu::Engine engine(checkpoint);
  const auto start = Clock::now();
  for (int i = 0; i < requests; ++i) {
    disagg::gpu::SamplingParams sampling;
    sampling.temperature = 0.8f;
    sampling.top_p = 0.9f;
    sampling.seed = uint64_t(i);
    out.tokens[size_t(i)] = disagg::gpu::generate(engine, prompt_of(i, vocab), new_tokens, sampling).tokens;
    out.count += out.tokens[size_t(i)].size();
  }
  out.ms = ms_between(start, Clock::now());
  return out;
}

int run(const Options& opt) {
  const std::string model = opt.model.empty() ? default_model() : opt.model;
  auto checkpoint = disagg::gpu::Checkpoint::open(model);
  const int vocab = checkpoint->config().vocab_size;
  const int new_tokens = std::min(opt.new_tokens, checkpoint->config().seq_len - 4);
  std::printf("model %s, %d requests x %d new tokens, cluster %d prefill + %d decode (in process)\n",
              model.c_str(), opt.requests, new_tokens, opt.prefill, opt.decode);
  std::printf("baseline: sequential gpu::generate (one engine, no server; not colocated serving: for that see "
              "scripts/bench compare)\n");

  const Sequential baseline = run_sequential(checkpoint, opt.requests, new_tokens);
  const std::vector<std::vector<int>>& expected = baseline.tokens;
  const size_t sequential_tokens = baseline.count;
  const double sequential_ms = baseline.ms;

  // Disaggregated: all requests at once through the router.
  disagg::DisaggSystemConfig system_config;
  caf::actor_system system{system_config};
  disagg::LocalClusterOptions cluster_options;
  cluster_options.config.model = model;
  cluster_options.config.prefill_workers = opt.prefill;
  cluster_options.config.decode_workers = opt.decode;
  disagg::LocalCluster cluster(system, cluster_options);
  disagg::Client client(system, cluster.router());

  std::mutex mutex;
  std::vector<Clock::time_point> first_token(opt.requests);
  std::vector<bool> seen(opt.requests, false);
  std::vector<std::future<disagg::RequestOutcome>> futures;
  const auto start = Clock::now();
  for (int i = 0; i < opt.requests; ++i) {
    disagg::GenerateRequest request;
    const auto prompt = prompt_of(i, vocab);
    request.prompt_tokens.assign(prompt.begin(), prompt.end());
    request.max_new_tokens = new_tokens;
    request.sampling.temperature = 0.8f;
    request.sampling.top_p = 0.9f;
    request.sampling.seed = uint64_t(i);
    futures.push_back(client.submit(std::move(request), [&, i](const disagg::TokenEvent&) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!seen[i]) first_token[i] = Clock::now(), seen[i] = true;
    }));
  }
  std::vector<double> ttft, tpot;
  size_t disagg_tokens = 0;
  int mismatches = 0, failures = 0;
  for (int i = 0; i < opt.requests; ++i) {
    const disagg::RequestOutcome outcome = futures[i].get();
    const auto done = Clock::now();
    if (!outcome.ok()) {
      ++failures;
      std::printf("request %d failed: %s: %s\n", i, to_string(outcome.code).c_str(), outcome.message.c_str());
      continue;
    }
    disagg_tokens += outcome.tokens.size();
    if (std::vector<int>(outcome.tokens.begin(), outcome.tokens.end()) != expected[i]) ++mismatches;
    std::lock_guard<std::mutex> lock(mutex);
    ttft.push_back(ms_between(start, first_token[i]));
    if (outcome.tokens.size() > 1)
      tpot.push_back(ms_between(first_token[i], done) / double(outcome.tokens.size() - 1));
  }
  const double disagg_ms = ms_between(start, Clock::now());

  const double sequential_rate = 1000.0 * double(sequential_tokens) / sequential_ms;
  const double disagg_rate = 1000.0 * double(disagg_tokens) / disagg_ms;
  std::printf("sequential gpu::generate: %zu tokens in %.1f ms: %.0f tokens/s\n", sequential_tokens, sequential_ms,
              sequential_rate);
  std::printf("disaggregated actors (at once): %zu tokens in %.1f ms: %.0f tokens/s, "
              "%.2fx vs sequential gpu::generate\n",
              disagg_tokens, disagg_ms, disagg_rate, disagg_rate / sequential_rate);
  std::printf("TTFT ms p50 %.1f p99 %.1f; time per output token ms p50 %.2f p99 %.2f\n", percentile(ttft, 0.5),
              percentile(ttft, 0.99), percentile(tpot, 0.5), percentile(tpot, 0.99));
  std::printf("%d of %d requests differ from gpu::generate's tokens, %d failed\n", mismatches, opt.requests, failures);
  cluster.stop();
  return mismatches == 0 && failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return disagg::cli::main_with_usage("bench_serving", kUsage, argc, argv, parse_args, run);
}
