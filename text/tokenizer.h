// Tokenizers: llama2.c's (byte-fallback BPE with score-ordered merges: a
// llama2.c tokenizer file, a GGUF `llama` vocabulary) and byte-level BPE (a
// GGUF `gpt2` vocabulary, a Hugging Face tokenizer.json), behind one class.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace disagg::gpu {

constexpr int kBosToken = 1;  // llama2.c's <s>, which ends a llama2.c generation
constexpr int kEosToken = 2;  // llama2.c's </s>: a SentencePiece vocabulary's end when its file names none
constexpr int kByteTokenOffset = 3;  // a SentencePiece vocabulary's <0xHH> is token HH + 3 (after <unk>, <s>, </s>)

// What a vocabulary may hold, whatever its file says (each piece costs a
// trie node per byte when it is a special token, and every id a table
// entry): 2^22 tokens, 16x the largest real ones (Gemma 3's 262,144), and
// pieces of 64 KiB (real ones are at most a few hundred bytes).
constexpr int kMaxVocabSize = 1 << 22;
constexpr size_t kMaxPieceBytes = size_t(64) << 10;

// A model's vocabulary, as a model file carries it (GGUF `tokenizer.ggml.*`,
// a Hugging Face tokenizer.json) or a llama2.c tokenizer file.
enum class TokenizerModel {
  sentencepiece,  // llama.cpp's `llama`: score-ordered merges, <0xHH> byte fallback (Llama 2, TinyLlama, llama2.c)
  byte_bpe,       // llama.cpp's `gpt2`: byte-level BPE with merge ranks (Llama 3, Qwen2, Qwen3): text/byte_bpe.h
};

// GGUF's token types (llama.cpp's llama_token_type).
enum class TokenType : int32_t { normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

struct Vocabulary {
  TokenizerModel model = TokenizerModel::sentencepiece;
  // sentencepiece: llama2.c's spelling (spaces as ' ', not U+2581; <0xHH>
  // byte pieces at ids 3..258); byte_bpe: GPT-2's byte-level spelling, added
  // tokens as their text.
  std::vector<std::string> pieces;
  std::vector<float> scores;        // sentencepiece: merge priority; byte_bpe: empty
  std::vector<TokenType> types;     // one per piece; empty: all normal (a llama2.c tokenizer file)
  std::vector<std::string> merges;  // byte_bpe: "left right", lowest rank first
  std::string pre;                  // byte_bpe: the pre-tokenizer (tokenizer.ggml.pre)
  int bos = kBosToken;              // the beginning-of-sequence id, -1 for none
  bool add_bos = true;              // encode() puts BOS first
  int eos = kEosToken;              // the end-of-sequence id, -1 for none
  std::string chat_template;        // the file's Jinja chat template (tokenizer.chat_template), or empty
  // Its template for requests with tools, where it has one of its own
  // (tokenizer.chat_template.tool_use; transformers' named "tool_use"), or empty.
  std::string tool_use_template;
};

// A piece as a GGUF `llama` vocabulary spells it (SentencePiece's word
// boundary U+2581 for each ' '), and back.
std::string sentencepiece_spelling(const std::string& piece);
std::string llama2c_spelling(const std::string& sentencepiece_piece);

// The ids that end a generation (ModelConfig::end_tokens) for a vocabulary whose file names `named`
// (eos, eot, eom ids, -1 for absent): those, the control tokens that are a
// family's end of turn (<|eot_id|>, <|eom_id|>, <|im_end|>, <|endoftext|>,
// <|end|>, <end_of_turn>), and for a SentencePiece vocabulary BOS as well
// (llama2.c's rule: a new document ends this one).
std::vector<int> end_tokens_of(const Vocabulary& vocabulary, const std::vector<int>& named);

class Tokenizer {
 public:
  // Throws Error("<path>: <problem>"); expected_vocab > 0 rejects a tokenizer
  // whose vocabulary size differs from the model's.
  static Tokenizer load(const std::string& path, int expected_vocab);
  // From a vocabulary (a model file's); `source` names it in errors.
  static Tokenizer from_vocabulary(Vocabulary vocabulary, const std::string& source);

  int vocab_size() const;
  const Vocabulary& vocabulary() const;
  // The token's type (normal for every token of an untyped vocabulary).
  TokenType type_of(int token) const;

  // BOS first when the vocabulary says so, then the text's ids: control and
  // added tokens written in the text are recognised whole (a vocabulary with
  // token types only: not a llama2.c tokenizer file); the rest by the model:
  // SentencePiece prepends a space to text at the start, looks up UTF-8 code
  // points whole else as byte pieces, then merges highest score first;
  // byte-level BPE as text/byte_bpe.h says. Linear up to a log factor.
  // `add_bos` false: no BOS whatever the vocabulary says (a chat template
  // writes its own).
  // `marked`: `text` may hold defused_text() spans (a chat prompt): their
  // control-token text is encoded as plain text, the marks dropped.
  std::vector<int> encode(const std::string& text, bool add_bos = true, bool marked = false) const;

  // No role spoofing through text: `text` (a message's content, a tool's
  // result) with every control token written in it (<|eot_id|>,
  // <|im_start|>, [INST] where the vocabulary makes it one) defused, so that
  // encode(..., marked=true) of a prompt holding it reads that text as plain
  // text while the template's own control tokens stay tokens. A defused
  // token has U+FDD0 (a Unicode noncharacter) between its characters, and
  // a U+FDD0 of the text itself is doubled; without_marks() undoes both.
  // Added tokens that are not control tokens (<think>, <tool_call>) stay
  // as they are: they are what the model itself writes.
  std::string defused_text(const std::string& text) const;

  // Text of `token` when it follows `previous` (SentencePiece drops the
  // leading space of the first piece after BOS; <0xHH> pieces and byte-level
  // pieces are raw bytes, so a character may span tokens). Control tokens
  // have no text (skip_special_tokens). Throws on a bad id.
  std::string decode(int previous, int token) const;
  // Text of a continuation: tokens that follow `previous`.
  std::string decode_all(int previous, const std::vector<int>& tokens) const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// `text` less defused_text()'s marks: the text as written.
std::string without_marks(const std::string& text);

// A vocabulary of `vocab_size` pieces (>= 259): <unk>, <s>, </s>, the 256
// byte pieces, then filler merges, so a synthetic model has text I/O; and
// the same as a tokenizer file. Throw Error for fewer pieces.
Vocabulary byte_vocabulary(int vocab_size);
void write_byte_tokenizer(const std::string& path, int vocab_size);

}  // namespace disagg::gpu
