#include "bench/model_report.h"

#include <immintrin.h>
#include <omp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "model/checkpoint.h"
#include "engine/engine.h"
#include "model/llama_tensors.h"
#include "gpu/host_memory.h"
#include "gpu/quant.h"
#include "apps/cli/cli.h"

namespace disagg::bench {
namespace {

using namespace disagg::gpu;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

const char* kUsage =
    "usage: bench_compute --model FILE [--threads 1,2] [--prefill 512] [--decode 64] [--batch 16]\n"
    "                     [--context 16] [--weight-cache off|model|FOLDER]\n"
    "Loads FILE (llama2.c or GGUF, any weight type) and prints, as JSON lines: the load\n"
    "(seconds, peak RSS / file size), the measured read bandwidth per thread count, then per\n"
    "thread count decode (one sequence, --decode steps after a --context prompt), batched\n"
    "decode (--batch sequences in lock-step) and prefill (--prefill tokens): tokens/s,\n"
    "GFLOP/s, weight bytes read per decode step and decode's share of the bandwidth limit.\n";

}  // namespace

// The first CPU's model name with its family and model numbers (a VM's
// name may be only "AMD EPYC": family 25 model < 16 is Zen 3, 25 from 16
// Zen 4, 26 Zen 5).
std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, name = "unknown", family, model;
  auto value = [&] {
    std::string v = line.substr(line.find(':') + 1);
    v.erase(0, v.find_first_not_of(' '));
    return v;
  };
  while (std::getline(in, line) && !line.empty()) {  // (the first processor's block)
    if (line.find(':') == std::string::npos) continue;
    if (line.rfind("model name", 0) == 0) name = value();
    else if (line.rfind("cpu family", 0) == 0) family = value();
    else if (line.rfind("model\t", 0) == 0 || line.rfind("model :", 0) == 0) model = value();
  }
  if (!family.empty() && !model.empty()) name += " (family " + family + ", model " + model + ")";
  return name;
}

namespace {

// Peak resident set of this process (VmHWM), bytes.
size_t peak_rss() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return size_t(std::strtoull(line.c_str() + 6, nullptr, 10)) * 1024;
  return 0;
}

// Bytes of one stream's chunk: a thread's streams read adjacent chunks (as a
// decode kernel's panels and tiles lie side by side), then the next
// `streams` chunks. Not streams a power of two apart: those alias in the
// caches and the memory's banks (AMD Zen 3 VM, 1 GiB on 1 thread: 4 streams
// 256 MiB apart read 16-23 GB/s, 3 or 5 apart 25-30, 4 over adjacent 128
// KiB chunks 24-28).
constexpr size_t kProbeChunk = 128 * 1024;

// One thread's share of the buffer (`n` uint64, a multiple of `streams`
// chunks) summed with 256-bit loads, in `streams` streams over adjacent
// chunks, each 4 loads (2 lines) a step, with a software prefetch `ahead`
// bytes in front of each stream (0: none).
__attribute__((target("avx2"))) uint64_t sum_streams(const uint64_t* p, size_t n, int streams, size_t ahead) {
  __m256i acc = _mm256_setzero_si256();
  const size_t chunk = kProbeChunk / sizeof(uint64_t), group = chunk * size_t(streams);
  const size_t lead = ahead / sizeof(uint64_t);
  for (size_t g = 0; g + group <= n; g += group)
    for (size_t i = 0; i < chunk; i += 16)
      for (int s = 0; s < streams; ++s) {
        const uint64_t* q = p + g + size_t(s) * chunk + i;
        if (lead) _mm_prefetch(reinterpret_cast<const char*>(q + lead), _MM_HINT_T0);
        const __m256i a = _mm256_load_si256(reinterpret_cast<const __m256i*>(q));
        const __m256i b = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 4));
        const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 8));
        const __m256i d = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + 12));
        acc = _mm256_add_epi64(acc, _mm256_add_epi64(_mm256_add_epi64(a, b), _mm256_add_epi64(c, d)));
      }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), acc);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// Bytes per second of reading a buffer far larger than the caches with
// `threads` threads, as a decode step reads its weights: the best of 2
// passes of each way of reading (1 to 8 streams a thread over adjacent
// chunks; no prefetch, or 512 B ahead), so that the limit is the machine's,
// not one loop's. The buffer is in transparent huge pages, as the weights
// are (before 2026-12-06 it was in 4 KiB pages: a Zen 3 VM's probe moved
// within its noise either way, 22.5-26.5 GB/s on 1 thread; and until
// 2026-12-06 its 2, 4 or 8 streams were a power of two apart, so on that
// VM the probe read ~23 GB/s on 1 thread where an F32 decode read 26-28).
// A decode that reads faster than this says so (model_report).
double read_bandwidth_here(int threads) {
  const size_t n = size_t(1) << 27;  // 1 GiB of uint64
  static uint64_t* buffer = nullptr;
  if (!buffer) {
    buffer = static_cast<uint64_t*>(std::aligned_alloc(kHugePage, n * sizeof(uint64_t)));
    advise_huge_pages(buffer, n * sizeof(uint64_t));
    for (size_t i = 0; i < n; ++i) buffer[i] = i;
  }
  double best = 0;
  volatile uint64_t sink = 0;
  for (const int streams : {1, 2, 3, 4, 5, 6, 8})
    for (const size_t ahead : {size_t(0), size_t(512)})
      for (int pass = 0; pass < 2; ++pass) {
        // (std::thread, not OpenMP: this runs in a child forked from a
        // process whose OpenMP pool is live, where libgomp hangs.)
        const size_t group = kProbeChunk / sizeof(uint64_t) * size_t(streams);
        const size_t per = n / size_t(threads) / group * group;  // whole groups of chunks a thread
        const size_t read = size_t(threads) * per * sizeof(uint64_t);
        std::vector<uint64_t> sums(static_cast<size_t>(threads));
        const auto t0 = Clock::now();
        std::vector<std::thread> readers;
        for (int t = 0; t < threads; ++t)
          readers.emplace_back([&, t] { sums[size_t(t)] = sum_streams(buffer + per * size_t(t), per, streams, ahead); });
        for (std::thread& r : readers) r.join();
        const double s = seconds_since(t0);
        for (uint64_t x : sums) sink = sink + x;
        best = std::max(best, double(read) / s);
      }
  return best;
}

// read_bandwidth_here for each thread count, measured in a child process
// before the model loads, so its 1 GiB buffer is not in this process's peak RSS.
std::vector<double> read_bandwidths(const std::vector<int>& threads) {
  int fds[2];
  if (::pipe(fds) != 0) return std::vector<double>(threads.size(), 0.0);
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    for (int t : threads) {
      const double bw = read_bandwidth_here(t);
      if (::write(fds[1], &bw, sizeof bw) != ssize_t(sizeof bw)) ::_exit(1);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::vector<double> out;
  for (size_t i = 0; i < threads.size(); ++i) {
    double bw = 0;
    if (::read(fds[0], &bw, sizeof bw) != ssize_t(sizeof bw)) bw = 0;
    out.push_back(bw);
  }
  ::close(fds[0]);
  int status = 0;
  if (child > 0) ::waitpid(child, &status, 0);
  return out;
}

// Bytes of weights one decode step reads (every matrix once; one embedding row) and
// the multiply-adds of one token's matrix products.
void weight_figures(const Checkpoint& cp, double& bytes, double& macs) {
  const ModelConfig& c = cp.config();
  bytes = macs = 0;
  for_each_tensor(c, [&](Tensor t, int layer) {
    if (!is_matrix(t)) {
      bytes += double(shape_of(t, c).cols) * 4;
      return;
    }
    const Matrix& m = cp.weights().matrix(t, layer);
    const TensorShape s = shape_of(t, c);
    const double row = double(row_bytes(m.type, int(s.cols)));
    if (t == Tensor::token_embedding) {
      bytes += row;  // one row looked up
      if (c.shared_classifier) bytes += row * double(s.rows), macs += double(s.rows) * double(s.cols);
    } else {
      bytes += row * double(s.rows);
      macs += double(s.rows) * double(s.cols);
    }
  });
}

std::vector<int> prompt_of(int n, int vocab) {
  std::vector<int> tokens(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) tokens[size_t(i)] = 3 + (i * 37) % (vocab - 3);
  tokens[0] = 1;
  return tokens;
}

std::vector<int> parse_list(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(int(cli::parse_integer("--threads", item, 1, 1024)));
  return out;
}

struct Options {
  std::string model;
  std::vector<int> threads = {1, 2};
  int prefill = 512, decode = 64, batch = 16, context = 16;
  std::string weight_cache;  // EngineOptions::weight_cache
};

Options parse_options(int argc, char** argv) {
  Options o;
  for (cli::Flags f(argc, argv); f.next();) {
    const std::string& flag = f.flag();
    const std::string& value = f.value();
    if (flag == "--model") o.model = value;
    else if (flag == "--threads") o.threads = parse_list(value);
    else if (flag == "--prefill") o.prefill = int(cli::parse_integer(flag, value, 1, 1 << 20));
    else if (flag == "--decode") o.decode = int(cli::parse_integer(flag, value, 2, 1 << 20));
    else if (flag == "--batch") o.batch = int(cli::parse_integer(flag, value, 1, 4096));
    else if (flag == "--context") o.context = int(cli::parse_integer(flag, value, 1, 1 << 20));
    else if (flag == "--weight-cache") o.weight_cache = value;
    else throw cli::UsageError{"unknown option " + flag};
  }
  if (o.model.empty() || o.threads.empty()) throw cli::UsageError{"--model and --threads are needed"};
  return o;
}

// One thread count's figures: decode of one sequence (`decode` steps after a
// `context` prompt), `batch` sequences in lock-step, prefill (best of 2).
struct Speeds {
  double decode_tps, batched_tps, prefill_tps;
};

Speeds measure(Engine& engine, KvPool& pool, const Options& o, int per_seq) {
  const ModelConfig& c = engine.config();
  auto blocks_of = [&](int s) {
    std::vector<int> b(static_cast<size_t>(per_seq));
    std::iota(b.begin(), b.end(), s * per_seq);
    return b;
  };
  const auto prompt = prompt_of(o.context, c.vocab_size);
  Speeds out{};
  const std::vector<int> seq = blocks_of(0);
  engine.prefill_chunk(pool, prompt, 0, seq);
  auto d0 = Clock::now();
  for (int s = 0; s < o.decode; ++s) engine.decode_step(pool, {DecodeSlot{3 + s % 50, o.context + s, &seq}});
  out.decode_tps = o.decode / seconds_since(d0);
  std::vector<std::vector<int>> tables;
  for (int b = 0; b < o.batch; ++b) {
    tables.push_back(blocks_of(b + 1));
    engine.prefill_chunk(pool, prompt, 0, tables.back());
  }
  const int steps = std::max(4, o.decode / 4);
  d0 = Clock::now();
  for (int s = 0; s < steps; ++s) {
    std::vector<DecodeSlot> slots;
    for (int b = 0; b < o.batch; ++b) slots.push_back(DecodeSlot{3 + (s + b) % 50, o.context + s, &tables[size_t(b)]});
    engine.decode_step(pool, slots);
  }
  out.batched_tps = double(o.batch) * steps / seconds_since(d0);
  const auto tokens = prompt_of(o.prefill, c.vocab_size);
  engine.prefill(tokens);  // warm-up
  double best = 1e30;
  for (int r = 0; r < 2; ++r) {
    const auto p0 = Clock::now();
    engine.prefill(tokens);
    best = std::min(best, seconds_since(p0));
  }
  out.prefill_tps = o.prefill / best;
  return out;
}

}  // namespace

int model_report(int argc, char** argv) {
  return cli::main_with_usage("bench_compute", kUsage, argc, argv, parse_options, [](const Options& o) {
    struct stat st {};
    if (::stat(o.model.c_str(), &st) != 0) throw std::runtime_error(o.model + ": cannot stat");
    const std::vector<double> bandwidths = read_bandwidths(o.threads);
    const auto t0 = Clock::now();
    auto cp = Checkpoint::open(o.model);
    EngineOptions engine_options;
    engine_options.weight_cache = o.weight_cache;
    Engine engine(cp, engine_options);
    const double load_s = seconds_since(t0);
    const ModelConfig& c = engine.config();
    double bytes = 0, macs = 0;
    weight_figures(*cp, bytes, macs);
    std::printf("{\"model\":\"%s\",\"cpu\":\"%s\",\"backend\":\"%s\",\"file_bytes\":%lld,\"load_s\":%.2f,"
                "\"peak_rss_over_file\":%.3f,\"weight_bytes_per_token\":%.0f,\"gflop_per_token\":%.3f}\n",
                o.model.c_str(), cpu_name().c_str(), engine.backend().describe().c_str(), (long long)st.st_size, load_s,
                double(peak_rss()) / double(st.st_size), bytes, 2 * macs / 1e9);
    std::fflush(stdout);

    const int block = 16;
    const int positions = std::max(o.context + o.decode, o.prefill) + 1;
    const int per_seq = KvPool::blocks_for(positions, block);
    KvPool pool = kv_pool_for(engine, block, per_seq * (o.batch + 1));
    const double pool_bytes = double(pool.num_blocks()) * block * c.n_layers * 2.0 * c.kv_dim() * sizeof(float);
    for (size_t ti = 0; ti < o.threads.size(); ++ti) {
      const int t = o.threads[ti];
      omp_set_num_threads(t);
      const Speeds v = measure(engine, pool, o, per_seq);
      // The best of the probe before the load and one right after these
      // runs: a shared host's bandwidth drifts (AMD Zen 3 VM, 2026-12-06: 27
      // to 47 GB/s on 2 threads within the hour), and a share is only as
      // good as the probe's moment.
      const double bw = std::max(bandwidths[ti], read_bandwidths({t})[0]);
      std::printf("{\"threads\":%d,\"read_gb_s\":%.2f,\"decode_tok_s\":%.2f,\"decode_gb_s\":%.2f,"
                  "\"decode_bw_fraction\":%.3f,\"batched\":%d,\"batched_tok_s\":%.2f,\"prefill_tokens\":%d,"
                  "\"prefill_tok_s\":%.2f,\"prefill_gflop_s\":%.1f}\n",
                  t, bw / 1e9, v.decode_tps, v.decode_tps * bytes / 1e9, v.decode_tps * bytes / bw, o.batch,
                  v.batched_tps, o.prefill, v.prefill_tps, v.prefill_tps * 2 * macs / 1e9);
      std::fflush(stdout);
      // A share over 1 means the probe missed the machine's limit, not a kernel beating it.
      if (v.decode_tps * bytes > bw)
        std::fprintf(stderr, "bench_compute: decode read %.2f GB/s with %d threads, more than the probe's %.2f GB/s\n",
                     v.decode_tps * bytes / 1e9, t, bw / 1e9);
    }
    // The KV pool is the engine's, sized for this run: left out of the ratio.
    std::printf("{\"peak_rss_bytes\":%zu,\"kv_pool_bytes\":%.0f,\"peak_rss_less_pool_over_file\":%.3f}\n",
                peak_rss(), pool_bytes, (double(peak_rss()) - pool_bytes) / double(st.st_size));
    return 0;
  });
}

}  // namespace disagg::bench
