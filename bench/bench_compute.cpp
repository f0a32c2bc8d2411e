// Compute-library throughput on the current backend: prefill tokens/s by
// prompt length, decode tokens/s by batch size (continuous batching pays off
// when batch B gives more than B=1 tokens/s), and KV serialize/parse bytes/s.
// The model is synthetic (seeded), so the benchmark runs anywhere.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <numeric>
#include <vector>

#include "gpu/checkpoint.h"
#include "gpu/engine.h"
#include "gpu/kv_format.h"

namespace {

using namespace disagg::gpu;

// A model big enough that GEMMs dominate: ~25M parameters.
ModelConfig bench_config() {
  ModelConfig c;
  c.dim = 512;
  c.hidden_dim = 1376;
  c.n_layers = 8;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.vocab_size = 4096;
  c.seq_len = 1024;
  c.shared_classifier = true;
  return c;
}

Engine& engine() {
  static std::unique_ptr<Engine> e = [] {
    auto path = std::filesystem::temp_directory_path() / "disagg-bench-model.bin";
    write_random_checkpoint(path.string(), bench_config(), 7);
    return std::make_unique<Engine>(Checkpoint::open(path.string()));
  }();
  return *e;
}

std::vector<int> prompt_of(int n) {
  std::vector<int> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = 3 + (i * 37) % (bench_config().vocab_size - 3);
  tokens[0] = 1;
  return tokens;
}

void BM_Prefill(benchmark::State& state) {
  const auto tokens = prompt_of(int(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(engine().prefill(tokens));
  state.SetItemsProcessed(state.iterations() * int64_t(tokens.size()));
  state.SetLabel("tokens/s");
}
BENCHMARK(BM_Prefill)->Arg(16)->Arg(64)->Arg(256)->Unit(benchmark::kMillisecond);

// One decode step for B sequences, each with a 128-token context.
void BM_DecodeStep(benchmark::State& state) {
  const int batch = int(state.range(0));
  const int context = 128;
  const int block_size = 16;
  const int blocks_per_seq = KvPool::blocks_for(context + 1, block_size);
  KvPool pool(engine(), block_size, batch * blocks_per_seq);
  const auto prefill = engine().prefill(prompt_of(context));
  const auto bytes = serialize_kv(engine().fingerprint(), prefill.shape, prefill.kv.data());
  const auto view = parse_kv(bytes.data(), bytes.size(), engine().kv_expectation());
  std::vector<std::vector<int>> tables(batch);
  std::vector<DecodeSlot> slots(batch);
  for (int b = 0; b < batch; ++b) {
    tables[b].resize(blocks_per_seq);
    std::iota(tables[b].begin(), tables[b].end(), b * blocks_per_seq);
    pool.write(tables[b], view);
    slots[b] = DecodeSlot{3 + b, context, &tables[b]};
  }
  for (auto _ : state) benchmark::DoNotOptimize(engine().decode_step(pool, slots));
  state.SetItemsProcessed(state.iterations() * batch);
  state.SetLabel("tokens/s");
}
BENCHMARK(BM_DecodeStep)->Arg(1)->Arg(4)->Arg(16)->Arg(64)->Unit(benchmark::kMillisecond);

// KV of a 256-token prompt of the bench model (8 MiB).
void BM_KvSerializeParse(benchmark::State& state) {
  KvShape shape{uint32_t(bench_config().n_layers), uint32_t(bench_config().n_kv_heads),
                uint32_t(bench_config().dim / bench_config().n_heads), 256};
  std::vector<float> payload(shape.floats(), 0.5f);
  KvExpectation expect{42, shape.n_layers, shape.n_kv_heads, shape.head_dim, 1024};
  for (auto _ : state) {
    auto bytes = serialize_kv(42, shape, payload.data());
    benchmark::DoNotOptimize(parse_kv(bytes.data(), bytes.size(), expect));
  }
  state.SetBytesProcessed(state.iterations() * int64_t(kv_buffer_bytes(shape)));
}
BENCHMARK(BM_KvSerializeParse)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
