// Checkpoint loading, validation, fingerprinting and random-checkpoint writing.
#include <gtest/gtest.h>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "model/checkpoint.h"
#include "model/model_writer.h"
#include "gpu/error.h"
#include "gpu/open_error.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

namespace fs = std::filesystem;

// Small, valid, unshared-classifier shape for the synthetic files.
ModelConfig small_config() { return ModelConfig{16, 24, 2, 4, 2, 300, 32, true}; }

std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
void write_bytes(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}
float float_at(const std::vector<char>& bytes, size_t offset) {
  float f;
  std::memcpy(&f, bytes.data() + offset, sizeof f);
  return f;
}

// The README's layout, computed independently of the loader: offsets in floats
// from the first tensor.
struct Layout {
  size_t token_embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, rope, wcls, end;
  explicit Layout(const ModelConfig& c) {
    const size_t hs = c.dim / c.n_heads, L = c.n_layers, D = c.dim, H = c.hidden_dim;
    const size_t kv = c.n_kv_heads * hs;
    token_embedding = 0;
    rms_att = token_embedding + size_t(c.vocab_size) * D;
    wq = rms_att + L * D;
    wk = wq + L * D * D;
    wv = wk + L * kv * D;
    wo = wv + L * kv * D;
    rms_ffn = wo + L * D * D;
    w1 = rms_ffn + L * D;
    w2 = w1 + L * H * D;
    w3 = w2 + L * D * H;
    rms_final = w3 + L * H * D;
    rope = rms_final + D;
    wcls = rope + size_t(c.seq_len) * hs;  // two blocks of seq_len * head_size / 2
    end = c.shared_classifier ? wcls : wcls + size_t(c.vocab_size) * D;
  }
};

void expect_layout(const Checkpoint& cp) {
  const Layout l(cp.config());
  const Weights& w = cp.weights();
  const float* base = w.token_embedding.f32();
  const ModelConfig& c = cp.config();
  const size_t D = size_t(c.dim), H = size_t(c.hidden_dim), kv = size_t(c.kv_dim());
  ASSERT_EQ(w.layers.size(), size_t(c.n_layers));
  // Layer i's tensor is the i-th of the file's all-layer block.
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& L = w.layers[i];
    EXPECT_EQ(size_t(L.rms_att - base), l.rms_att + i * D);
    EXPECT_EQ(size_t(L.wq.f32() - base), l.wq + i * D * D);
    EXPECT_EQ(size_t(L.wk.f32() - base), l.wk + i * kv * D);
    EXPECT_EQ(size_t(L.wv.f32() - base), l.wv + i * kv * D);
    EXPECT_EQ(size_t(L.wo.f32() - base), l.wo + i * D * D);
    EXPECT_EQ(size_t(L.rms_ffn - base), l.rms_ffn + i * D);
    EXPECT_EQ(size_t(L.w1.f32() - base), l.w1 + i * H * D);
    EXPECT_EQ(size_t(L.w2.f32() - base), l.w2 + i * D * H);
    EXPECT_EQ(size_t(L.w3.f32() - base), l.w3 + i * H * D);
  }
  EXPECT_EQ(size_t(w.rms_final - base), l.rms_final);
  if (cp.config().shared_classifier)
    EXPECT_EQ(w.wcls, w.token_embedding);
  else
    EXPECT_EQ(size_t(w.wcls.f32() - base), l.wcls);
}

class CheckpointFiles : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::make_temp_dir("checkpoint"); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // A valid file whose header int `index` is replaced by `value`.
  std::string with_header_int(int index, int32_t value) {
    const std::string p = path("bad-header.bin");
    write_random_checkpoint(p, small_config(), 1);
    auto bytes = read_bytes(p);
    std::memcpy(bytes.data() + 4 * index, &value, sizeof value);
    write_bytes(p, bytes);
    return p;
  }

  void expect_open_error(const std::string& p, const std::string& problem) {
    try {
      Checkpoint::open(p);
      ADD_FAILURE() << "opened " << p << " without error, expected: " << problem;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(p + ": "), std::string::npos) << what;
      EXPECT_NE(what.find(problem), std::string::npos) << what;
    }
  }

  std::string dir_;
};

TEST(Checkpoint, LoadsSharedModel) {
  auto cp = Checkpoint::open(test::shared_model());
  const ModelConfig& c = cp->config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.seq_len, 512);
  EXPECT_TRUE(c.shared_classifier);
  EXPECT_EQ(cp->path(), test::shared_model());
  expect_layout(*cp);

  // The pointers read the file's bytes: spot-check against an independent read.
  const auto bytes = read_bytes(test::shared_model());
  const Layout l(c);
  EXPECT_EQ(28 + 4 * l.end, bytes.size());
  EXPECT_EQ(cp->weights().token_embedding.f32()[0], float_at(bytes, 28));
  EXPECT_EQ(cp->weights().rms_final[c.dim - 1], float_at(bytes, 28 + 4 * (l.rms_final + c.dim - 1)));
  EXPECT_EQ(cp->weights().layers[0].w2.f32()[7], float_at(bytes, 28 + 4 * (l.w2 + 7)));
  EXPECT_EQ(cp->name(), "stories260K");
  EXPECT_FALSE(cp->vocabulary());
}

TEST(Checkpoint, FingerprintIsXxh3OfTheFile) {
  // XXH3-64 (seed 0) of stories260K.bin's bytes, pinned: the fingerprint
  // depends on the file's content only, in every build and every release.
  EXPECT_EQ(Checkpoint::open(test::shared_model())->fingerprint(), 0x0c9b5a18d38a945fULL);
}

// The fingerprint memo (Checkpoint::open's second argument) says the hash of
// this very file only: a memo of another file, or of this one before it
// changed, or not a memo at all, is not believed.
TEST_F(CheckpointFiles, AFingerprintMemoIsBelievedOnlyForTheFileUnchanged) {
  write_random_checkpoint(path("m.bin"), small_config(), 9);
  const uint64_t real = Checkpoint::open(path("m.bin"))->fingerprint();
  const std::string memo = path("m.bin") + ".fingerprint";
  // A file changed a moment ago is not remembered (a change within the same
  // clock tick would leave its times as they are)...
  EXPECT_EQ(Checkpoint::open(path("m.bin"), "model")->fingerprint(), real);
  EXPECT_FALSE(fs::exists(memo));
  // ... one changed over a second ago is. (A wait for the clock, not for
  // another thread: nothing else can make the file older.)
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_EQ(Checkpoint::open(path("m.bin"), "model")->fingerprint(), real);
  ASSERT_TRUE(fs::exists(memo));
  EXPECT_EQ(Checkpoint::open(path("m.bin"), dir_ + "/memos")->fingerprint(), real);
  EXPECT_TRUE(fs::exists(dir_ + "/memos/m.bin.fingerprint"));

  // A memo of this file is believed (the file is not read to hash it): one
  // that says another value is taken at its word...
  auto rewrite_memo = [&](const std::string& from, const std::string& to) {
    std::ifstream in(memo);
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_NE(text.find(from), std::string::npos) << text;
    text.replace(text.find(from), from.size(), to);
    std::ofstream(memo, std::ios::trunc) << text;
  };
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(real));
  rewrite_memo(hex, "00000000000000aa");
  EXPECT_EQ(Checkpoint::open(path("m.bin"), "model")->fingerprint(), 0xaau);
  EXPECT_EQ(Checkpoint::open(path("m.bin"), "off")->fingerprint(), real);  // no memo read
  EXPECT_EQ(Checkpoint::open(path("m.bin"))->fingerprint(), real);
  // ... until the file changes (same size, the times moved): hashed again.
  {
    std::fstream f(path("m.bin"), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    f.put('\x42');
  }
  const uint64_t changed = Checkpoint::open(path("m.bin")).get()->fingerprint();
  EXPECT_NE(changed, real);
  EXPECT_EQ(Checkpoint::open(path("m.bin"), "model")->fingerprint(), changed);
  // Not a memo: hashed.
  std::ofstream(memo, std::ios::trunc) << "{\"file\": 1";
  EXPECT_EQ(Checkpoint::open(path("m.bin"), "model")->fingerprint(), changed);
}

TEST_F(CheckpointFiles, RandomCheckpointRoundTrips) {
  const ModelConfig c = small_config();
  write_random_checkpoint(path("a.bin"), c, 7);
  auto cp = Checkpoint::open(path("a.bin"));
  EXPECT_EQ(cp->config().dim, c.dim);
  EXPECT_EQ(cp->config().hidden_dim, c.hidden_dim);
  EXPECT_EQ(cp->config().n_layers, c.n_layers);
  EXPECT_EQ(cp->config().n_heads, c.n_heads);
  EXPECT_EQ(cp->config().n_kv_heads, c.n_kv_heads);
  EXPECT_EQ(cp->config().vocab_size, c.vocab_size);
  EXPECT_EQ(cp->config().seq_len, c.seq_len);
  EXPECT_TRUE(cp->config().shared_classifier);
  EXPECT_EQ(fs::file_size(path("a.bin")), 28 + 4 * Layout(c).end);
  expect_layout(*cp);

  // Values are in the documented ranges: norms near 1, projections within 3/sqrt(fan_in).
  const Weights& w = cp->weights();
  for (int i = 0; i < c.n_layers * c.dim; ++i) EXPECT_NEAR(w.layers[0].rms_att[i], 1.0f, 0.1001f);
  const float bound = 3.0f / std::sqrt(float(c.dim));
  for (int i = 0; i < c.n_layers * c.hidden_dim * c.dim; ++i) ASSERT_LE(std::fabs(w.layers[0].w1.f32()[i]), bound);
  // The unused RoPE blocks are written as zeros.
  const auto bytes = read_bytes(path("a.bin"));
  const Layout l(c);
  for (size_t i = l.rope; i < l.wcls; ++i) ASSERT_EQ(float_at(bytes, 28 + 4 * i), 0.0f);
}

TEST_F(CheckpointFiles, SeparateClassifierIsStoredLast) {
  ModelConfig c = small_config();
  c.shared_classifier = false;
  write_random_checkpoint(path("unshared.bin"), c, 7);
  const auto bytes = read_bytes(path("unshared.bin"));
  int32_t vocab_field;
  std::memcpy(&vocab_field, bytes.data() + 20, sizeof vocab_field);
  EXPECT_EQ(vocab_field, -c.vocab_size);  // llama2.c: negative vocab = separate classifier

  auto cp = Checkpoint::open(path("unshared.bin"));
  EXPECT_FALSE(cp->config().shared_classifier);
  EXPECT_EQ(cp->config().vocab_size, c.vocab_size);
  EXPECT_FALSE(cp->weights().wcls == cp->weights().token_embedding);
  expect_layout(*cp);
  EXPECT_EQ(fs::file_size(path("unshared.bin")), 28 + 4 * Layout(c).end);
}

TEST_F(CheckpointFiles, SameSeedSameBytesAndFingerprint) {
  write_random_checkpoint(path("a.bin"), small_config(), 7);
  write_random_checkpoint(path("b.bin"), small_config(), 7);
  write_random_checkpoint(path("c.bin"), small_config(), 8);
  EXPECT_EQ(read_bytes(path("a.bin")), read_bytes(path("b.bin")));
  const uint64_t a = Checkpoint::open(path("a.bin"))->fingerprint();
  EXPECT_EQ(a, Checkpoint::open(path("b.bin"))->fingerprint());
  EXPECT_NE(a, Checkpoint::open(path("c.bin"))->fingerprint());
}

TEST_F(CheckpointFiles, FingerprintChangesWhenAnyTensorChanges) {
  ModelConfig c = small_config();
  c.shared_classifier = false;
  write_random_checkpoint(path("base.bin"), c, 3);
  const auto base = read_bytes(path("base.bin"));
  const uint64_t base_fp = Checkpoint::open(path("base.bin"))->fingerprint();
  const Layout l(c);
  const std::pair<size_t, size_t> tensors[] = {  // (first float, end)
      {l.token_embedding, l.rms_att}, {l.rms_att, l.wq}, {l.wq, l.wk}, {l.wk, l.wv}, {l.wv, l.wo},
      {l.wo, l.rms_ffn}, {l.rms_ffn, l.w1}, {l.w1, l.w2}, {l.w2, l.w3}, {l.w3, l.rms_final},
      {l.rms_final, l.rope}, {l.rope, l.wcls}, {l.wcls, l.end}};
  for (const auto& [first, end] : tensors) {
    ASSERT_LT(first, end);
    // The first, a middle and the last float of each tensor (the unused RoPE
    // tables too: the fingerprint covers every byte of the file).
    for (size_t offset : {first, first + (end - first) / 2 + 1, end - 1}) {
      if (offset >= end) continue;
      auto bytes = base;
      const float changed = float_at(bytes, 28 + 4 * offset) + 0.5f;
      std::memcpy(bytes.data() + 28 + 4 * offset, &changed, sizeof changed);
      write_bytes(path("changed.bin"), bytes);
      EXPECT_NE(Checkpoint::open(path("changed.bin"))->fingerprint(), base_fp) << "float " << offset;
    }
  }
  // One bit of one float in the middle of w2.
  auto flipped = base;
  flipped[28 + 4 * (l.w2 + (l.w3 - l.w2) / 3) + 1] ^= 0x01;
  write_bytes(path("flipped.bin"), flipped);
  EXPECT_NE(Checkpoint::open(path("flipped.bin"))->fingerprint(), base_fp);
}

TEST_F(CheckpointFiles, FingerprintChangesWhenTwoWeightsAreSwapped) {
  write_random_checkpoint(path("base.bin"), small_config(), 3);
  const auto base = read_bytes(path("base.bin"));
  const uint64_t base_fp = Checkpoint::open(path("base.bin"))->fingerprint();
  const Layout l(small_config());
  // Two different floats of wq swapped: same multiset of values, other model.
  const size_t a = 28 + 4 * (l.wq + 5), b = 28 + 4 * (l.wq + 500);
  ASSERT_NE(float_at(base, a), float_at(base, b));
  auto swapped = base;
  std::swap_ranges(swapped.begin() + long(a), swapped.begin() + long(a + 4), swapped.begin() + long(b));
  write_bytes(path("swapped.bin"), swapped);
  EXPECT_NE(Checkpoint::open(path("swapped.bin"))->fingerprint(), base_fp);
  // Two whole rows of w1 swapped.
  const size_t row = 4 * size_t(small_config().dim), r0 = 28 + 4 * l.w1, r1 = r0 + 3 * row;
  auto rows = base;
  std::swap_ranges(rows.begin() + long(r0), rows.begin() + long(r0 + row), rows.begin() + long(r1));
  write_bytes(path("rows.bin"), rows);
  EXPECT_NE(Checkpoint::open(path("rows.bin"))->fingerprint(), base_fp);
}

TEST_F(CheckpointFiles, WriteRejectsInvalidConfig) {
  ModelConfig c = small_config();
  c.n_kv_heads = 3;
  EXPECT_THROW(write_random_checkpoint(path("x.bin"), c, 1), Error);
  EXPECT_FALSE(fs::exists(path("x.bin")));
  EXPECT_THROW(write_random_checkpoint(dir_ + "/no/such/dir/x.bin", small_config(), 1), Error);
}

TEST_F(CheckpointFiles, MissingFile) { expect_open_error(path("absent.bin"), "cannot open"); }

// A FIFO, a socket or a device named as the model is refused at once, naming
// it (issue 44: open() of a FIFO blocked until the process was killed).
TEST_F(CheckpointFiles, AFifoSocketOrDeviceIsRefusedWithoutBlocking) {
  const std::string fifo = path("model.bin");
  test::make_fifo(fifo);
  const std::string e = test::error_beside_fifo(fifo, [&] { Checkpoint::open(fifo); });
  EXPECT_EQ(e, fifo + ": not a regular file or a directory (a FIFO)");

  const std::string socket_path = path("model.sock");
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  ASSERT_LT(socket_path.size(), sizeof address.sun_path);
  std::memcpy(address.sun_path, socket_path.c_str(), socket_path.size() + 1);
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(s, 0);
  ASSERT_EQ(::bind(s, reinterpret_cast<const sockaddr*>(&address), sizeof address), 0);
  expect_open_error(socket_path, "not a regular file or a directory (a socket)");
  ::close(s);

  expect_open_error("/dev/null", "not a regular file or a directory (a character device)");
}

TEST_F(CheckpointFiles, TruncatedHeader) {
  write_bytes(path("short.bin"), std::vector<char>(10, 1));
  expect_open_error(path("short.bin"), "truncated header");
}

TEST_F(CheckpointFiles, TruncatedBody) {
  write_random_checkpoint(path("t.bin"), small_config(), 1);
  const auto size = fs::file_size(path("t.bin"));
  fs::resize_file(path("t.bin"), size - 4);
  expect_open_error(path("t.bin"), "truncated: expected " + std::to_string(size) + " bytes, found " +
                                       std::to_string(size - 4));
}

TEST_F(CheckpointFiles, ExtraBytes) {
  write_random_checkpoint(path("long.bin"), small_config(), 1);
  auto bytes = read_bytes(path("long.bin"));
  bytes.push_back(0);
  write_bytes(path("long.bin"), bytes);
  expect_open_error(path("long.bin"), "too long");
}

TEST_F(CheckpointFiles, ZeroDim) { expect_open_error(with_header_int(0, 0), "must be positive"); }

TEST_F(CheckpointFiles, NegativeLayers) { expect_open_error(with_header_int(2, -2), "must be positive"); }

TEST_F(CheckpointFiles, DimNotDivisibleByHeads) {
  expect_open_error(with_header_int(3, 3), "dim 16 is not divisible by n_heads 3");
}

TEST_F(CheckpointFiles, HeadsNotMultipleOfKvHeads) {
  expect_open_error(with_header_int(4, 3), "n_heads 4 is not a multiple of n_kv_heads 3");
}

TEST_F(CheckpointFiles, HugeDimensionsReportTruncationNotOverflow) {
  // Products of these overflow 64 bits; the loader must still say "truncated".
  const std::string p = with_header_int(0, 1 << 30);
  auto bytes = read_bytes(p);
  // (heads of 2^14 values: as wide as a head may be, model_config.h kMaxHeadSize; the longest context, kMaxSeqLen)
  const int32_t big[] = {1 << 30, 1 << 30, 1 << 30, 1 << 16, 1 << 16, 1 << 30, kMaxSeqLen};
  std::memcpy(bytes.data(), big, sizeof big);
  write_bytes(p, bytes);
  expect_open_error(p, "truncated");
}

}  // namespace
}  // namespace disagg::gpu
