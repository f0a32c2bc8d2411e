// The llama2.c tokenizer: byte-fallback BPE with score-ordered merges, from a
// llama2.c tokenizer file or a GGUF vocabulary of the SentencePiece kind.
#pragma once
#include <string>
#include <unordered_map>
#include <vector>

namespace disagg::gpu {

constexpr int kBosToken = 1;  // <s>; generation stops before an emitted BOS

// A SentencePiece-style vocabulary in llama2.c's convention: spaces as ' '
// (not U+2581), <0xHH> byte pieces at ids 3..258.
struct Vocabulary {
  std::vector<std::string> pieces;
  std::vector<float> scores;
};

// A piece as a GGUF `llama` vocabulary spells it (SentencePiece's word
// boundary U+2581 for each ' '), and back.
std::string sentencepiece_spelling(const std::string& piece);
std::string llama2c_spelling(const std::string& sentencepiece_piece);

class Tokenizer {
 public:
  // Throws Error("<path>: <problem>"); expected_vocab > 0 rejects a tokenizer
  // whose vocabulary size differs from the model's.
  static Tokenizer load(const std::string& path, int expected_vocab);
  // From a vocabulary (a model file's); `source` names it in errors.
  static Tokenizer from_vocabulary(Vocabulary vocabulary, const std::string& source);

  int vocab_size() const { return static_cast<int>(pieces_.size()); }
  Vocabulary vocabulary() const { return {pieces_, scores_}; }

  // BOS first, a leading space prepended to non-empty text, UTF-8 code points
  // looked up whole else byte pieces, then highest-score merges.
  std::vector<int> encode(const std::string& text) const;

  // Text of `token` when it follows `previous` (drops the leading space of the
  // first piece after BOS; <0xHH> pieces are raw bytes). Throws on a bad id.
  std::string decode(int previous, int token) const;
  // Text of a continuation: tokens that follow `previous`.
  std::string decode_all(int previous, const std::vector<int>& tokens) const;

 private:
  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int> lookup_;
};

// A vocabulary of `vocab_size` pieces (>= 259): <unk>, <s>, </s>, the 256
// byte pieces, then filler merges, so a synthetic model has text I/O; and
// the same as a tokenizer file. Throw Error for fewer pieces.
Vocabulary byte_vocabulary(int vocab_size);
void write_byte_tokenizer(const std::string& path, int vocab_size);

}  // namespace disagg::gpu
