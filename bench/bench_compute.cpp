// Compute-library throughput on the current backend (Google Benchmark; run by
// `scripts/bench micro`, not by ctest). With --model FILE, instead, one model
// file's figures (bench/model_report.h). Two synthetic (seeded) models:
//   m50: dim 512, hidden 1376, 16 layers, 8 heads, vocab 4096, seq 2048 (~50M)
//   m15: dim 288, hidden 768, 6 layers, 6 heads, vocab 32000, seq 256 (stories15M's shape)
// Each benchmark takes the OpenMP thread count as its last argument.
// - Prefill/<model>/<tokens>/<threads>: tokens/s, and attn_share, the share of
//   the prefill's time spent in attention (the attention op timed alone on the
//   same shapes).
// - PrefillChunks/<model>/<tokens>/<chunk>/<threads>: the prompt in chunks into
//   a pool (a colocated worker), tokens/s, and vs_whole, its time over one
//   whole prefill.
// - DecodeStep/<model>/<batch>/<context>/<threads>: one decode step of `batch`
//   sequences at `context` positions (they share the KV of their context, each
//   writes its own last block), tokens/s.
// - Attention/<model>/<tokens>/<threads>: the attention op of a prefill alone.
// - Matmul/<m>/<n>/<k>/<threads>: our fixed-order product, and OpenBLAS's
//   sgemm on the same shapes when built with it (ours_vs_sgemm = sgemm time /
//   ours; BLAS threads = ours). Both pools then exist in one process: compare
//   at 1 thread, where neither spins against the other.
// - QuantizedRow/<type>/<n>: one activation row (a decode's) times a
//   quantized n x 2048 matrix in tiles, on one thread with the default
//   kernel set (DISAGG_CPU_ISA picks another): gb_s, the tiles' bytes a
//   second. n = 256 (288-430 KB: from L2) against n = 65536 (from memory)
//   tells a kernel's arithmetic from its reading (the weights' values do not
//   change its time: random bytes).
// - KvSerializeParse: bytes/s of the KV wire format.
#include <benchmark/benchmark.h>
#include <omp.h>
#if DISAGG_BENCH_SGEMM
#include <cblas.h>
extern "C" void openblas_set_num_threads(int);
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/backend.h"
#include "gpu/cpu/cpu_kernels.h"
#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "engine/engine.h"
#include "engine/kv_format.h"
#include "bench/model_report.h"

namespace {

using namespace disagg::gpu;
using Clock = std::chrono::steady_clock;

ModelConfig model_config(int which) {
  ModelConfig c;
  if (which == 50) {
    c.dim = 512, c.hidden_dim = 1376, c.n_layers = 16, c.n_heads = 8, c.n_kv_heads = 8;
    c.vocab_size = 4096, c.seq_len = 2048;
  } else {
    c.dim = 288, c.hidden_dim = 768, c.n_layers = 6, c.n_heads = 6, c.n_kv_heads = 6;
    c.vocab_size = 32000, c.seq_len = 256;
  }
  c.shared_classifier = true;
  return c;
}

Engine& engine(int which) {
  static std::map<int, std::unique_ptr<Engine>> engines;
  auto& e = engines[which];
  if (!e) {
    auto path = std::filesystem::temp_directory_path() / ("disagg-bench-m" + std::to_string(which) + ".bin");
    write_random_checkpoint(path.string(), model_config(which), 7);
    e = std::make_unique<Engine>(Checkpoint::open(path.string()));
    std::fprintf(stderr, "m%d on %s\n", which, e->backend().describe().c_str());
  }
  return *e;
}

std::vector<int> prompt_of(int n, int vocab) {
  std::vector<int> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = 3 + (i * 37) % (vocab - 3);
  tokens[0] = 1;
  return tokens;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Seconds of the attention op for a prefill of n tokens (all layers).
double attention_seconds(Engine& e, int n) {
  const ModelConfig& c = e.config();
  Backend& b = e.backend();
  const int hs = c.head_size(), width = c.n_heads * hs;
  const KvShape shape = e.kv_shape(n);
  DeviceArray<float> cache(b, shape.floats()), q(b, size_t(n) * width), out(b, size_t(n) * width);
  std::vector<float> host(shape.floats());
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (float& x : host) x = dist(rng);
  cache.upload(host.data(), host.size());
  q.upload(host.data(), size_t(n) * width);
  std::vector<int> positions(n);
  std::iota(positions.begin(), positions.end(), 0);
  DeviceArray<int> pos(b), table(b);
  pos.upload(positions.data(), positions.size());
  const int zero = 0;
  table.upload(&zero, 1);
  const PagedKv kv{cache.get(), n, 1, c.kv_dim(), table.get(), 0};  // one block of n positions
  const auto t0 = Clock::now();
  for (int l = 0; l < c.n_layers; ++l) b.attention(q.get(), out.get(), kv, l, pos.get(), n, c.n_heads, c.n_kv_heads, hs);
  b.synchronize();
  return seconds_since(t0);
}

void BM_Prefill(benchmark::State& state) {
  const int which = int(state.range(0)), n = int(state.range(1));
  omp_set_num_threads(int(state.range(2)));
  Engine& e = engine(which);
  const auto tokens = prompt_of(n, e.config().vocab_size);
  e.prefill(tokens);  // warm-up: the engine's buffers reach their size once, as in a server
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    benchmark::DoNotOptimize(e.prefill(tokens));
    total += seconds_since(t0);
  }
  state.counters["tok_s"] = benchmark::Counter(double(n) * state.iterations() / total);
  state.counters["attn_share"] = attention_seconds(e, n) / (total / state.iterations());
}

// A prompt of `tokens` prefilled into a pool in chunks of `chunk` positions
// (Engine::prefill_chunk: a colocated worker, decode steps between chunks),
// tokens/s, and vs_whole: its time over one prefill() of the whole prompt,
// measured in the same run (what chunking costs: weights read once per chunk).
void BM_PrefillChunks(benchmark::State& state) {
  const int which = int(state.range(0)), n = int(state.range(1)), chunk = int(state.range(2));
  omp_set_num_threads(int(state.range(3)));
  Engine& e = engine(which);
  const auto tokens = prompt_of(n, e.config().vocab_size);
  constexpr int kBlock = 16;
  KvPool pool = kv_pool_for(e, kBlock, KvPool::blocks_for(n, kBlock));
  std::vector<int> blocks(size_t(pool.num_blocks()));
  std::iota(blocks.begin(), blocks.end(), 0);
  auto chunked = [&] {
    for (int p0 = 0; p0 < n; p0 += chunk) {
      const int rows = std::min(chunk, n - p0);
      benchmark::DoNotOptimize(
          e.prefill_chunk(pool, std::vector<int>(tokens.begin() + p0, tokens.begin() + p0 + rows), p0, blocks));
    }
  };
  chunked();  // warm-up
  e.prefill(tokens);
  // Chunked and whole by turns, so both see the same machine.
  double total = 0, whole = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    chunked();
    const double t = seconds_since(t0);
    total += t;
    state.SetIterationTime(t);
    t0 = Clock::now();
    benchmark::DoNotOptimize(e.prefill(tokens));
    whole += seconds_since(t0);
  }
  state.counters["tok_s"] = benchmark::Counter(double(n) * state.iterations() / total);
  state.counters["vs_whole"] = total / whole;
}

// One decode step for `batch` sequences at `context` positions.
void BM_DecodeStep(benchmark::State& state) {
  const int which = int(state.range(0)), batch = int(state.range(1)), context = int(state.range(2));
  omp_set_num_threads(int(state.range(3)));
  Engine& e = engine(which);
  const int block_size = 16;
  const int shared_blocks = context / block_size;  // full blocks of the common context
  const int own_blocks = KvPool::blocks_for(context + 1, block_size) - shared_blocks;
  KvPool pool = kv_pool_for(e, block_size, shared_blocks + batch * own_blocks);
  const auto prefill = e.prefill(prompt_of(context, e.config().vocab_size));
  const auto bytes = serialize_kv(e.fingerprint(), prefill.shape, prefill.kv.data());
  const auto view = parse_kv(bytes.data(), bytes.size(), e.kv_expectation());
  std::vector<std::vector<int>> tables(batch);
  std::vector<DecodeSlot> slots(batch);
  for (int b = 0; b < batch; ++b) {
    tables[b].resize(shared_blocks + own_blocks);
    std::iota(tables[b].begin(), tables[b].begin() + shared_blocks, 0);
    std::iota(tables[b].begin() + shared_blocks, tables[b].end(), shared_blocks + b * own_blocks);
    // The shared blocks once; a tail block holds context positions only when
    // the context is not a multiple of the block size.
    if (b == 0 || context % block_size != 0) pool.write(tables[b], view);
    slots[b] = DecodeSlot{3 + b, context, &tables[b]};
  }
  for (auto _ : state) benchmark::DoNotOptimize(e.decode_step(pool, slots));
  state.counters["tok_s"] = benchmark::Counter(double(batch) * state.iterations(), benchmark::Counter::kIsRate);
}

// The attention op alone over a prefill of n tokens of a model (all layers).
void BM_Attention(benchmark::State& state) {
  const int which = int(state.range(0)), n = int(state.range(1));
  omp_set_num_threads(int(state.range(2)));
  Engine& e = engine(which);
  double total = 0;
  for (auto _ : state) total += attention_seconds(e, n);
  const ModelConfig& c = e.config();
  // Causal: row r attends r + 1 positions; 2 flops per multiply-add, QK and PV.
  const double flops = 4.0 * c.n_layers * c.n_heads * c.head_size() * (double(n) * (n + 1) / 2);
  state.counters["gflops"] = flops * state.iterations() / total / 1e9;
}

void BM_Matmul(benchmark::State& state) {
  const int m = int(state.range(0)), n = int(state.range(1)), k = int(state.range(2)), threads = int(state.range(3));
  omp_set_num_threads(threads);
  auto b = make_cpu_backend();
  std::vector<float> a(size_t(m) * k, 0.5f), w(size_t(n) * k, 0.25f), c(size_t(m) * n);
  DeviceArray<float> pw(*b, b->packed_floats(n, k));
  b->pack_matrix(w.data(), pw.get(), n, k);
  double ours = 0, blas = 0;
  for (auto _ : state) {
    auto t0 = Clock::now();
    b->matmul(a.data(), pw.get(), c.data(), m, n, k);
    ours += seconds_since(t0);
#if DISAGG_BENCH_SGEMM
    openblas_set_num_threads(threads);
    t0 = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, a.data(), k, w.data(), k, 0.0f, c.data(), n);
    blas += seconds_since(t0);
#endif
  }
  const double flops = 2.0 * m * n * k * state.iterations();
  state.counters["ours_gflops"] = flops / ours / 1e9;
  if (blas > 0) {
    state.counters["sgemm_gflops"] = flops / blas / 1e9;
    state.counters["ours_vs_sgemm"] = blas / ours;
  }
}

// m rows against one matrix of n x 2048 random weights of `type` (tiled):
// the time a call takes, and gb_s, the weights' bytes a second.
void time_quantized_rows(benchmark::State& state, WeightType type, int m, int n) {
  const int k = 2048;
  const cpu::KernelTable& kernels = cpu::kernels_for("");
  const size_t bytes = cpu::tiled_bytes(type, n, k);
  // Allocated by the CPU backend, as a model's weights are (huge pages).
  const std::unique_ptr<Backend> backend = make_cpu_backend();
  DeviceArray<uint8_t> held(*backend, bytes);
  uint8_t* w = held.get();
  std::mt19937 rng(1);
  for (size_t i = 0; i < bytes; ++i) w[i] = uint8_t(rng());
  std::vector<int8_t> qa(size_t(m) * size_t(k));
  for (auto& q : qa) q = int8_t(int(rng() % 255) - 127);
  std::vector<float> scales(size_t(m) * size_t(k) / 32, 0.01f), c(size_t(m) * size_t(n));
  std::vector<int16_t> sums(size_t(m) * size_t(k) / 16, 3);
  for (auto _ : state) {
    if (is_k_quant(type))
      kernels.matmul_kquant(type, scales.data(), qa.data(), sums.data(), w, c.data(), m, n, k, 0, n);
    else
      kernels.matmul_quantized(type, scales.data(), qa.data(), w, c.data(), m, n, k, 0, n);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["gb_s"] = benchmark::Counter(double(bytes) * double(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
  state.SetLabel(std::string(to_string(type)) + ", " + kernels.isa);
}

// A decode's row, from L2 (n = 256) or from memory (n = 65536).
void BM_QuantizedRow(benchmark::State& state) {
  time_quantized_rows(state, WeightType(state.range(0)), 1, int(state.range(1)));
}

// m rows (a verification step's k + 1, a small batch), from L2 (n = 128),
// L3 (n = 2048) or memory (n = 65536): against m = 1, the cost of each
// further row.
void BM_QuantizedRows(benchmark::State& state) {
  time_quantized_rows(state, WeightType(state.range(0)), int(state.range(1)), int(state.range(2)));
}

// KV of a 256-token prompt of the m50 model (16 MiB).
void BM_KvSerializeParse(benchmark::State& state) {
  const ModelConfig c = model_config(50);
  KvShape shape{uint32_t(c.n_layers), uint32_t(c.n_kv_heads), uint32_t(c.head_size()), 256};
  std::vector<float> payload(shape.floats(), 0.5f);
  KvExpectation expect{42, shape.n_layers, shape.n_kv_heads, shape.head_dim, uint32_t(c.seq_len)};
  for (auto _ : state) {
    auto bytes = serialize_kv(42, shape, payload.data());
    benchmark::DoNotOptimize(parse_kv(bytes.data(), bytes.size(), expect));
  }
  state.SetBytesProcessed(state.iterations() * int64_t(kv_buffer_bytes(shape)));
}

void prefill_args(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) {
    for (int n : {256, 1024, 2048}) b->Args({50, n, threads});
    for (int n : {64, 256}) b->Args({15, n, threads});
  }
}
void prefill_chunk_args(benchmark::internal::Benchmark* b) {
  for (int chunk : {32, 64, 128, 256, 512}) b->Args({50, 512, chunk, 1});
}
void decode_args(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2}) {
    for (int context : {128, 1920})
      for (int batch : {1, 16, 64}) b->Args({50, batch, context, threads});
    for (int context : {128, 240})
      for (int batch : {1, 16, 64}) b->Args({15, batch, context, threads});
  }
}

}  // namespace

BENCHMARK(BM_Prefill)->Apply(prefill_args)->ArgNames({"model", "tokens", "threads"})->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_PrefillChunks)->Apply(prefill_chunk_args)->ArgNames({"model", "tokens", "chunk", "threads"})
    ->Unit(benchmark::kMillisecond)->UseManualTime()->MinTime(2.0);
BENCHMARK(BM_DecodeStep)->Apply(decode_args)->ArgNames({"model", "batch", "context", "threads"})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Attention)->ArgNames({"model", "tokens", "threads"})->Args({50, 2048, 1})->Args({50, 2048, 2})
    ->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Matmul)
    ->ArgNames({"m", "n", "k", "threads"})
    ->Args({1, 1376, 512, 1})
    ->Args({64, 1376, 512, 1})
    ->Args({512, 1376, 512, 1})
    ->Args({512, 512, 1376, 1})
    ->Args({512, 1376, 512, 2})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_QuantizedRow)
    ->ArgNames({"type", "n"})
    ->ArgsProduct({{int(WeightType::q8_0), int(WeightType::q4_0), int(WeightType::q4_k), int(WeightType::q5_k),
                    int(WeightType::q6_k)},
                   {256, 65536}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_QuantizedRows)
    ->ArgNames({"type", "m", "n"})
    ->ArgsProduct({{int(WeightType::q8_0), int(WeightType::q4_0), int(WeightType::q4_k), int(WeightType::q5_k),
                    int(WeightType::q6_k)},
                   {1, 2, 3, 4, 5, 6, 8, 9, 16, 64},
                   {128, 2048, 65536}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_KvSerializeParse)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--model") return disagg::bench::model_report(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
