// Quantized weights (gpu/quant.h): half precision against the CPU's own
// F16C instructions, Q8_0 quantization as ggml's reference does it, the
// Q8_0 matrix product of every kernel set bit for bit against its naive
// reference (gpu/quant.cpp) and independent of the batch and the threads,
// and Q8_0 and Q4_0 models: prefill equals stepwise decode, byte for byte the
// peer converter's files, and how closely they follow the F32 model.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <filesystem>
#include <fstream>
#include <random>

#include "gpu/backend.h"
#include "gpu/checkpoint.h"
#include "gpu/cpu/cpu_kernels.h"
#include "gpu/engine.h"
#include "gpu/fixed_math.h"
#include "gpu/generate.h"
#include "gpu/gguf.h"
#include "gpu/quant.h"
#include "gpu/tokenizer.h"
#include "support/reference_cases.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

__attribute__((target("f16c"))) float hw_half_to_float(uint16_t h) { return _cvtsh_ss(h); }
__attribute__((target("f16c"))) uint16_t hw_float_to_half(float f) { return _cvtss_sh(f, 0); }
bool has_f16c() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("f16c");
}

uint32_t bits_of(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

TEST(Half, EveryHalfConvertsExactlyAndRoundsAsF16c) {
  if (!has_f16c()) GTEST_SKIP() << "no F16C on this CPU to compare with";
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = half_to_float(uint16_t(h));
    const float hw = hw_half_to_float(uint16_t(h));
    if (std::isnan(hw)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      continue;
    }
    ASSERT_EQ(bits_of(f), bits_of(hw)) << "half " << h;
    ASSERT_EQ(float_to_half(f), uint16_t(h)) << "half " << h << " does not round-trip";
  }
  // Floats between halves (ties included), subnormal halves, overflow: as vcvtps2ph.
  std::mt19937 rng(3);
  for (int i = 0; i < 2000000; ++i) {
    uint32_t b = rng();
    if (i % 4 == 0) b = (b & 0x80000000u) | (0x33000000u + (b % (0x47800000u - 0x33000000u)));  // the half range
    if (i % 8 == 1) b = (b & ~0x0fffu) | 0x1000u;  // a tie for the normal halves
    float f;
    std::memcpy(&f, &b, sizeof f);
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), hw_float_to_half(f)) << "float bits " << std::hex << b;
    // fixed::round_to_half (the activations' scales) is the same rounding, as a float.
    ASSERT_EQ(bits_of(fixed::round_to_half(f)), bits_of(half_to_float(hw_float_to_half(f)))) << std::hex << b;
  }
}

TEST(Quant, QuantizeRowQ8_0IsGgmlsReference) {
  // One block by hand: d = max|x| / 127 as half, q = roundf(x / d).
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = float(j - 16) * 0.25f;  // max |x| = 4
  x[5] = 2.5f * (4.0f / 127.0f);  // a tie: roundf takes it away from zero (3), rint would give 2
  uint8_t block[34];
  quantize_row_q8_0(x, block, 32);
  uint16_t dh;
  std::memcpy(&dh, block, 2);
  EXPECT_EQ(dh, float_to_half(4.0f / 127.0f));
  const float id = 1.0f / (4.0f / 127.0f);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(int8_t(block[2 + j]), int8_t(std::round(x[j] * id))) << j;
  EXPECT_EQ(int8_t(block[2 + 0]), -127);
  EXPECT_EQ(int8_t(block[2 + 5]), int8_t(std::round(x[5] * id)));
  // An all-zero block: d = 0, q = 0.
  float zeros[32] = {};
  quantize_row_q8_0(zeros, block, 32);
  for (uint8_t b : block) EXPECT_EQ(b, 0);
  std::vector<float> back(32);
  dequantize_row(WeightType::q8_0, block, back.data(), 32);
  for (float v : back) EXPECT_EQ(v, 0.0f);
}

TEST(Quant, QuantizeRowQ4_0IsGgmlsReference) {
  // The value of largest magnitude sets d = m / -8; q = min(15, int8(x / d + 8.5)).
  float x[32];
  for (int j = 0; j < 32; ++j) x[j] = float(j) * 0.05f - 1.0f;  // in [-1, 0.55]
  x[20] = 2.0f;  // now the largest, positive: d = -0.25, so 2.0 -> q = 0 (value -8 * d = 2)
  uint8_t block[18];
  quantize_row_q4_0(x, block, 32);
  uint16_t dh;
  std::memcpy(&dh, block, 2);
  EXPECT_EQ(dh, float_to_half(-0.25f));
  int8_t values[32];
  EXPECT_EQ(unpack_block(WeightType::q4_0, block, values), -0.25f);
  EXPECT_EQ(values[20], -8);  // 2.0 / -0.25 + 8.5 = 0.5 -> 0 -> -8
  for (int j = 0; j < 32; ++j) {
    const int want = std::min(15, int(int8_t(x[j] * (1.0f / -0.25f) + 8.5f))) - 8;
    EXPECT_EQ(values[j], want) << j;
  }
  // Byte j: value j low, value j + 16 high.
  EXPECT_EQ(block[2 + 4] & 0x0f, values[4] + 8);
  EXPECT_EQ(block[2 + 4] >> 4, values[20] + 8);
  std::vector<float> back(32);
  dequantize_row(WeightType::q4_0, block, back.data(), 32);
  EXPECT_EQ(back[20], 2.0f);
}

// Rows of n x k in `type` from seeded values, with the blocks that test the
// edges: a zero block, the most negative weight (Q8_0 -128, Q4_0 -8), a
// subnormal scale.
std::vector<uint8_t> quantized_matrix(WeightType type, int n, int k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> w(size_t(n) * k);
  for (float& v : w) v = u(rng);
  const size_t row = row_bytes(type, k), block = block_bytes(type);
  std::vector<uint8_t> q(size_t(n) * row);
  for (int r = 0; r < n; ++r) quantize_row(type, w.data() + size_t(r) * k, q.data() + size_t(r) * row, k);
  std::memset(q.data() + 2, type == WeightType::q4_0 ? 0x88 : 0, block - 2);  // row 0, block 0: all zero weights
  if (k > 32) q[block + 2 + 7] = type == WeightType::q4_0 ? 0x00 : 0x80;     // row 0, block 1: the most negative
  const uint16_t subnormal = 0x0003;
  if (n > 1) std::memcpy(q.data() + row, &subnormal, 2);  // row 1, block 0
  return q;
}

const WeightType kQuantized[] = {WeightType::q8_0, WeightType::q4_0};

std::vector<float> activations(int m, int k, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> a(size_t(m) * k);
  for (float& v : a) v = u(rng);
  for (int j = 0; j < 32 && m > 1; ++j) a[size_t(k) + j] = 0.0f;  // row 1, block 0: all zero
  return a;
}

TEST(Quant, EveryKernelSetsQuantizedProductIsItsReferenceBitForBit) {
  for (const WeightType type : kQuantized)
  for (const std::string& isa : cpu::supported_isas()) {
    const auto& kt = cpu::kernels_for(isa);
    // Single outputs, groups of four columns, tiles of 8 rows with edges, and more than one row block (64).
    for (const auto& [m, n, k] : {std::tuple{1, 7, 32}, {1, 37, 96}, {3, 33, 64}, {17, 40, 320}, {5, 3, 4096},
                                  {130, 13, 64}}) {
      SCOPED_TRACE(std::string(to_string(type)) + " " + isa + " m=" + std::to_string(m) + " n=" + std::to_string(n) +
                   " k=" + std::to_string(k));
      const auto w = quantized_matrix(type, n, k, uint32_t(n + k));
      const auto a = activations(m, k, uint32_t(m * 7 + k));
      std::vector<float> want(size_t(m) * n), got(size_t(m) * n, -1.0f);
      matmul_quantized_reference(type, a.data(), w.data(), want.data(), m, n, k);
      std::vector<float> scales(size_t(m) * k / 32);
      std::vector<int8_t> q(size_t(m) * k);
      for (int r = 0; r < m; ++r)
        quantize_activations(a.data() + size_t(r) * k, k, scales.data() + size_t(r) * k / 32, q.data() + size_t(r) * k);
      // Two column ranges, as two threads would.
      kt.matmul_quantized(type, scales.data(), q.data(), w.data(), got.data(), m, n, k, 0, n / 2);
      kt.matmul_quantized(type, scales.data(), q.data(), w.data(), got.data(), m, n, k, n / 2, n);
      ASSERT_EQ(std::memcmp(want.data(), got.data(), want.size() * sizeof(float)), 0);
      // The reference is a Q8_0 product at all: close to the float product of the dequantized weights.
      std::vector<float> deq(static_cast<size_t>(k));
      dequantize_row(type, w.data() + row_bytes(type, k) * size_t(n - 1), deq.data(), k);
      double exact = 0, scale = 0;
      for (int j = 0; j < k; ++j) exact += double(a[size_t(m - 1) * k + j]) * deq[size_t(j)], scale += std::fabs(a[size_t(m - 1) * k + j] * deq[size_t(j)]);
      EXPECT_NEAR(want[size_t(m - 1) * n + n - 1], exact, 0.02 * scale + 1e-6);
    }
  }
}

// Through the backend (threads, its own activation scratch): a row's result
// does not depend on the other rows of the batch.
TEST(Quant, TheBackendsQuantizedProductDoesNotDependOnTheBatch) {
  for (const WeightType type : kQuantized) {
  SCOPED_TRACE(to_string(type));
  const int m = 9, n = 300, k = 512;
  const auto w = quantized_matrix(type, n, k, 11);
  const auto a = activations(m, k, 12);
  auto b = make_cpu_backend();
  DeviceArray<float> da(*b), dc(*b, size_t(m) * n);
  da.upload(a.data(), a.size());
  b->matmul_quantized(type, da.get(), w.data(), dc.get(), m, n, k);
  std::vector<float> all(size_t(m) * n);
  dc.download(all.data(), all.size());
  std::vector<float> want(size_t(m) * n);
  matmul_quantized_reference(type, a.data(), w.data(), want.data(), m, n, k);
  EXPECT_EQ(std::memcmp(all.data(), want.data(), all.size() * sizeof(float)), 0);
  for (int r = 0; r < m; ++r) {
    DeviceArray<float> one(*b), out(*b, size_t(n));
    one.upload(a.data() + size_t(r) * k, size_t(k));
    b->matmul_quantized(type, one.get(), w.data(), out.get(), 1, n, k);
    std::vector<float> row(static_cast<size_t>(n));
    out.download(row.data(), row.size());
    ASSERT_EQ(std::memcmp(row.data(), all.data() + size_t(r) * n, row.size() * sizeof(float)), 0) << "row " << r;
  }
  }
}

// The shared model in a quantized type (write_gguf, ggml's reference
// quantizer), written once per type.
std::shared_ptr<const Checkpoint> quantized_model(WeightType type) {
  static std::map<WeightType, std::shared_ptr<const Checkpoint>> models;
  auto& cp = models[type];
  if (!cp) {
    const std::string out = test::make_temp_dir("quantized-model") + "/stories260K-" + to_string(type) + ".gguf";
    const auto f32 = Checkpoint::open(test::shared_model());
    write_gguf(*f32, Tokenizer::load(test::shared_tokenizer(), f32->config().vocab_size).vocabulary(), "stories260K",
               out, type);
    cp = Checkpoint::open(out);
  }
  return cp;
}

class QuantModel : public ::testing::TestWithParam<WeightType> {};

TEST_P(QuantModel, KeepsItsWeightsInTheirType) {
  const auto cp = quantized_model(GetParam());
  EXPECT_EQ(cp->weights().token_embedding.type, GetParam());
  EXPECT_EQ(cp->weights().layers[0].wq.type, GetParam());
  EXPECT_EQ(cp->weights().layers[4].w1.type, GetParam());
  // Rows of 172 (hidden) are no whole blocks: w2 stays f32, as ggml's quantizer leaves them.
  EXPECT_EQ(cp->weights().layers[0].w2.type, WeightType::f32);
  EXPECT_TRUE(cp->weights().wcls == cp->weights().token_embedding);
  EXPECT_NE(cp->weights().layers[0].rms_att, nullptr);
}

// Prefill rows run the same arithmetic as decode steps: logits agree bit for
// bit, under whichever kernel set runs (the ISA invariants rerun it).
TEST_P(QuantModel, PrefillEqualsStepwiseDecode) {
  Engine engine(quantized_model(GetParam()));
  const std::vector<int> prompt = {1, 403, 407, 261, 378, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311, 312};
  const PrefillOutput prefilled = engine.prefill(prompt);
  const int block = 16;
  KvPool pool(engine, block, 4);
  std::vector<int> blocks = {3, 1};
  std::vector<float> logits;
  for (size_t pos = 0; pos < prompt.size(); ++pos)
    logits = engine.decode_step(pool, {DecodeSlot{prompt[pos], int(pos), &blocks}});
  ASSERT_EQ(logits.size(), prefilled.logits.size());
  EXPECT_EQ(std::memcmp(logits.data(), prefilled.logits.data(), logits.size() * sizeof(float)), 0);
}

// Greedy tokens of the quantized model against the F32 model's (the shared
// reference) over every reference case: how many agree before the first
// difference. Quantization changes the logits, so the share is a figure, not
// identity (on this 64-wide model, 2 blocks a row: Q8_0 34.2%, its weights
// alone dequantized into an F32 model 50.5%; Q4_0 5.1%, as llama.cpp's 5% on
// its own Q4_0 file in the peer tools' README; against llama.cpp on the same
// files, peer-match.sh: 360 of 360 tokens for both); printed for the README.
// A broken Q8_0 product (near 0%) fails.
TEST_P(QuantModel, GreedyTokensFollowTheF32Model) {
  Engine engine(quantized_model(GetParam()));
  size_t agreed = 0, total = 0;
  for (const auto& c : test::load_all_reference_cases()) {
    const GenerateResult r = generate(engine, c.prompt_tokens, c.max_new_tokens, SamplingParams{});
    size_t same = 0;
    while (same < r.tokens.size() && same < c.output_tokens.size() && r.tokens[same] == c.output_tokens[same]) ++same;
    agreed += same;
    total += c.output_tokens.size();
    // The same request twice: the same tokens (nothing carried over).
    EXPECT_EQ(generate(engine, c.prompt_tokens, c.max_new_tokens, SamplingParams{}).tokens, r.tokens);
  }
  std::cout << to_string(GetParam()) << " stories260K: " << agreed << " of " << total << " reference tokens ("
            << (100.0 * double(agreed) / double(total)) << "%) agree before the first difference\n";
  if (GetParam() == WeightType::q8_0) EXPECT_GT(double(agreed), 0.25 * double(total));
}

// The peer tools' converter (../shared/tools/peer/llama2c-to-gguf.py --type
// q8_0 / q4_0, numpy; written by no one here) quantizes as ggml's reference
// does too: every tensor both files have holds the same bytes, and its file
// gives our tokens.
TEST_P(QuantModel, OurTensorsAreThoseOfThePeersConverter) {
  const std::string script = test::shared_dir() + "/tools/peer/llama2c-to-gguf.py";
  if (!std::filesystem::exists(script)) GTEST_SKIP() << script << " is not there";
  if (test::run_command("/usr/bin/python3 -c 'import numpy' 2>/dev/null").second != 0)
    GTEST_SKIP() << "numpy (Debian python3-numpy) is not installed";
  const std::string type = to_string(GetParam());
  const std::string peer = test::make_temp_dir("peer-quantized") + "/peer-" + type + ".gguf";
  const auto [log, status] = test::run_command("/usr/bin/python3 " + test::shell_quoted(script) + " " +
                                               test::shell_quoted(test::shared_model()) + " " +
                                               test::shell_quoted(test::shared_tokenizer()) + " " + test::shell_quoted(peer) +
                                               " --type " + type + " --name stories260K 2>&1");
  ASSERT_EQ(status, 0) << log;
  const auto theirs = Checkpoint::open(peer);
  const auto ours = quantized_model(GetParam());
  auto read = [](const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
  };
  const auto their_bytes = read(peer), our_bytes = read(ours->path());
  const auto their_file = gguf::File::parse(their_bytes.data(), their_bytes.size(), peer);
  const auto our_file = gguf::File::parse(our_bytes.data(), our_bytes.size(), ours->path());
  const uint32_t ggml_type = uint32_t(GetParam() == WeightType::q8_0 ? gguf::TensorType::q8_0 : gguf::TensorType::q4_0);
  int compared = 0, quantized = 0;
  for (const auto& t : our_file.tensors()) {
    const gguf::TensorInfo* u = their_file.tensor(t.name);
    ASSERT_NE(u, nullptr) << t.name;
    EXPECT_EQ(u->type, t.type) << t.name;
    ASSERT_EQ(u->bytes, t.bytes) << t.name;
    EXPECT_EQ(std::memcmp(their_bytes.data() + u->offset, our_bytes.data() + t.offset, t.bytes), 0) << t.name;
    ++compared;
    quantized += t.type == ggml_type;
  }
  EXPECT_GT(quantized, 10);
  std::cout << compared << " tensors compared, " << quantized << " of them " << type << "\n";
  Engine a(ours), b(theirs);
  const auto c = test::load_all_reference_cases().front();
  EXPECT_EQ(generate(a, c.prompt_tokens, c.max_new_tokens, SamplingParams{}).tokens,
            generate(b, c.prompt_tokens, c.max_new_tokens, SamplingParams{}).tokens);
}

INSTANTIATE_TEST_SUITE_P(Types, QuantModel, ::testing::Values(WeightType::q8_0, WeightType::q4_0),
                         [](const auto& info) { return std::string(to_string(info.param)); });

}  // namespace
}  // namespace disagg::gpu
