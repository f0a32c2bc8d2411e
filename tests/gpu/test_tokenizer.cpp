// The llama2.c tokenizer against the shared reference, its load errors, and the
// synthetic byte tokenizer.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "gpu/error.h"
#include "gpu/open_error.h"
#include "text/tokenizer.h"
#include "support/reference_cases.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

namespace fs = std::filesystem;

std::vector<test::ReferenceCase> reference_cases() {
  return test::load_all_reference_cases();
}

Tokenizer shared_tokenizer() { return Tokenizer::load(test::shared_tokenizer(), 512); }

// ---- the shared tokenizer

TEST(Tokenizer, LoadsSharedTokenizer) { EXPECT_EQ(shared_tokenizer().vocab_size(), 512); }

TEST(Tokenizer, EncodesReferencePrompts) {
  const Tokenizer tok = shared_tokenizer();
  const auto cases = reference_cases();
  ASSERT_FALSE(cases.empty());
  for (const auto& c : cases) EXPECT_EQ(tok.encode(c.prompt), c.prompt_tokens) << test::describe(c);
}

TEST(Tokenizer, DecodesReferenceOutputs) {
  const Tokenizer tok = shared_tokenizer();
  const auto cases = reference_cases();
  ASSERT_FALSE(cases.empty());
  for (const auto& c : cases)
    EXPECT_EQ(tok.decode_all(c.prompt_tokens.back(), c.output_tokens), c.text) << test::describe(c);
}

TEST(Tokenizer, EmptyTextIsJustBos) { EXPECT_EQ(shared_tokenizer().encode(""), std::vector<int>{kBosToken}); }

TEST(Tokenizer, DecodeDropsLeadingSpaceOnlyAfterBos) {
  const Tokenizer tok = shared_tokenizer();
  const std::vector<int> ids = tok.encode("Once");  // BOS, " Once"-ish pieces
  ASSERT_GE(ids.size(), 2u);
  const std::string after_bos = tok.decode(kBosToken, ids[1]);
  const std::string elsewhere = tok.decode(ids[0] + 100, ids[1]);
  EXPECT_EQ(" " + after_bos, elsewhere);
  EXPECT_EQ(tok.decode_all(kBosToken, {ids.begin() + 1, ids.end()}), "Once");
}

TEST(Tokenizer, BytePiecesDecodeToRawBytes) {
  const Tokenizer tok = shared_tokenizer();
  EXPECT_EQ(tok.decode(5, '\n' + 3), "\n");
  EXPECT_EQ(tok.decode(kBosToken, 0xE2 + 3), "\xE2");
}

TEST(Tokenizer, UnknownCodePointsFallBackToBytes) {
  const Tokenizer tok = shared_tokenizer();
  const std::string text = "hi \xF0\x9F\x98\x80 there";  // an emoji the 512-piece vocab lacks
  const std::vector<int> ids = tok.encode(text);
  bool has_byte_fallback = false;
  for (int id : ids) has_byte_fallback |= (id == 0xF0 + 3);
  EXPECT_TRUE(has_byte_fallback);
  EXPECT_EQ(tok.decode_all(kBosToken, {ids.begin() + 1, ids.end()}), text);
}

TEST(Tokenizer, DecodeRejectsOutOfRangeIds) {
  const Tokenizer tok = shared_tokenizer();
  EXPECT_THROW(tok.decode(kBosToken, 512), Error);
  EXPECT_THROW(tok.decode(kBosToken, -1), Error);
  EXPECT_THROW(tok.decode_all(kBosToken, {5, 600}), Error);
}

// ---- load errors

class TokenizerFiles : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::make_temp_dir("tokenizer"); }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  static std::string shared_bytes() {
    std::ifstream in(test::shared_tokenizer(), std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  std::string write(const std::string& name, const std::string& bytes) {
    std::ofstream(path(name), std::ios::binary) << bytes;
    return path(name);
  }
  static void expect_load_error(const std::string& p, int vocab, const std::string& problem) {
    try {
      Tokenizer::load(p, vocab);
      ADD_FAILURE() << "loaded " << p << ", expected: " << problem;
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(p + ": "), std::string::npos) << what;
      EXPECT_NE(what.find(problem), std::string::npos) << what;
    }
  }

  std::string dir_;
};

TEST_F(TokenizerFiles, Missing) { expect_load_error(path("absent.bin"), 512, "cannot open"); }

// A FIFO (or a device) named as the tokenizer file is refused at once,
// naming it: open(O_RDONLY) of a FIFO used to block until a writer came.
TEST_F(TokenizerFiles, AFifoOrDeviceIsRefusedWithoutBlocking) {
  const std::string fifo = path("tokenizer.bin");
  test::make_fifo(fifo);
  const std::string e = test::error_beside_fifo(fifo, [&] { Tokenizer::load(fifo, 512); });
  EXPECT_EQ(e, fifo + ": not a regular file (a FIFO)");
  expect_load_error("/dev/null", 512, "not a regular file (a character device)");
}

TEST_F(TokenizerFiles, Empty) { expect_load_error(write("empty.bin", ""), 512, "truncated"); }

TEST_F(TokenizerFiles, TruncatedInsideAPiece) {
  const std::string bytes = shared_bytes();
  expect_load_error(write("cut.bin", bytes.substr(0, bytes.size() - 2)), 512, "truncated");
  expect_load_error(write("cut2.bin", bytes.substr(0, bytes.size() - 9)), 512, "truncated");
}

TEST_F(TokenizerFiles, NegativePieceLength) {
  std::string bytes = shared_bytes();
  const int32_t bad = -5;
  std::memcpy(&bytes[4 + 4], &bad, sizeof bad);  // length of piece 0 (after max_token_length, score)
  expect_load_error(write("neg.bin", bytes), 512, "piece 0 has length -5");
}

TEST_F(TokenizerFiles, AbsurdPieceLength) {
  std::string bytes = shared_bytes();
  const int32_t bad = 1 << 30;
  std::memcpy(&bytes[4 + 4], &bad, sizeof bad);
  expect_load_error(write("huge.bin", bytes), 512, "piece 0 has length 1073741824");
}

TEST_F(TokenizerFiles, VocabMismatch) {
  expect_load_error(test::shared_tokenizer(), 32000, "tokenizer has 512 pieces, model has 32000");
}

TEST_F(TokenizerFiles, TooFewPiecesForByteFallback) {
  write_byte_tokenizer(path("bytes.bin"), 300);
  std::string bytes;
  {
    std::ifstream in(path("bytes.bin"), std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  // Keep max_token_length and the first 100 pieces only.
  size_t pos = 4;
  for (int i = 0; i < 100; ++i) {
    int32_t len;
    std::memcpy(&len, &bytes[pos + 4], sizeof len);
    pos += 8 + size_t(len);
  }
  expect_load_error(write("few.bin", bytes.substr(0, pos)), 0, "byte fallback needs at least 259");
}

// ---- the synthetic byte tokenizer

TEST_F(TokenizerFiles, ByteTokenizerRoundTripsText) {
  write_byte_tokenizer(path("tok.bin"), 512);
  const Tokenizer tok = Tokenizer::load(path("tok.bin"), 512);
  EXPECT_EQ(tok.vocab_size(), 512);
  for (const std::string text :
       {"the quick brown fox jumps over the lazy dog", "Hello, World! 123", "  leading spaces", "tabs\tand\nnewlines\n",
        "a", "<s> is not special in text <0x41>", "caf\xC3\xA9 \xE2\x82\xAC"}) {
    const std::vector<int> ids = tok.encode(text);
    ASSERT_EQ(ids.front(), kBosToken);
    EXPECT_EQ(tok.decode_all(kBosToken, {ids.begin() + 1, ids.end()}), text);
  }
}

TEST_F(TokenizerFiles, ByteTokenizerMerges) {
  write_byte_tokenizer(path("tok.bin"), 512);
  const Tokenizer tok = Tokenizer::load(path("tok.bin"), 512);
  const std::string text = "the rain in the east";
  // Fewer tokens than characters: filler pieces really merge.
  EXPECT_LT(tok.encode(text).size(), text.size());
}

TEST_F(TokenizerFiles, EqualScoresMergeLeftmostFirst) {
  // The 512-piece byte tokenizer has " t" and "ee" but not " te" or "eee". In
  // " teee" the two "ee" pairs tie; llama2.c merges the leftmost: " t", "ee", "e".
  write_byte_tokenizer(path("tok.bin"), 512);
  const Tokenizer tok = Tokenizer::load(path("tok.bin"), 512);
  const std::vector<int> ids = tok.encode("teee");
  std::vector<std::string> pieces;
  for (size_t i = 1; i < ids.size(); ++i) pieces.push_back(tok.decode(0, ids[i]));
  EXPECT_EQ(pieces, (std::vector<std::string>{" t", "ee", "e"}));
}

TEST_F(TokenizerFiles, ByteTokenizerPiecesAreUnique) {
  write_byte_tokenizer(path("tok.bin"), 4096);
  const Tokenizer tok = Tokenizer::load(path("tok.bin"), 4096);
  std::set<std::string> seen;
  for (int id = 3; id < tok.vocab_size(); ++id) {
    std::string piece = tok.decode(0, id);
    if (id < 259) piece = "byte:" + piece;  // byte pieces decode to raw bytes that other pieces also spell
    EXPECT_TRUE(seen.insert(piece).second) << "duplicate piece " << id;
  }
}

TEST_F(TokenizerFiles, MinimalByteTokenizer) {
  write_byte_tokenizer(path("tok.bin"), 259);
  const Tokenizer tok = Tokenizer::load(path("tok.bin"), 259);
  const std::string text = "only bytes";
  const std::vector<int> ids = tok.encode(text);
  EXPECT_EQ(ids.size(), text.size() + 2);  // BOS, dummy space, one byte piece per char
  EXPECT_EQ(tok.decode_all(kBosToken, {ids.begin() + 1, ids.end()}), " " + text);
}

TEST_F(TokenizerFiles, ByteTokenizerRejectsSmallVocab) {
  EXPECT_THROW(write_byte_tokenizer(path("tok.bin"), 258), Error);
}

}  // namespace
}  // namespace disagg::gpu
