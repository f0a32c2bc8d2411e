// Byte-level BPE (llama.cpp's `gpt2` tokenizer model; Hugging Face's BPE with
// a ByteLevel pre-tokenizer): the vocabulary of Llama 3, Mistral Nemo, Qwen2
// and Qwen3. Text -> (normalized) -> split by the family's pre-tokenizer
// regex -> each piece's bytes spelled in GPT-2's byte-to-unicode alphabet ->
// merges applied lowest rank first -> ids. Special and added tokens are
// split off before this (text/tokenizer.cpp); this file sees plain text only.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace disagg::gpu {

// A pre-tokenizer by its GGUF name (`tokenizer.ggml.pre`).
struct PreTokenizer {
  std::string name;     // as the file spells it
  std::string pattern;  // the split regex (PCRE2 syntax, matched with Unicode properties)
  bool ignore_merges;   // a piece that is a whole vocabulary entry is taken as is (Llama 3)
  bool nfc;             // text is NFC-normalized first (Qwen2's tokenizer.json normalizer)
};
// Throws Error naming `name` and the known ones when it is not supported.
const PreTokenizer& pre_tokenizer(const std::string& name);
// The pre-tokenizer whose regex is `pattern` (a tokenizer.json's Split), or nullptr.
const PreTokenizer* pre_tokenizer_with_pattern(const std::string& pattern);

// GPT-2's byte-to-unicode map: byte b is spelled as one code point (printable
// Latin-1 bytes as themselves, the rest as U+0100 + n), so every byte string
// has a spelling without spaces or control characters.
std::string byte_level_spelling(std::string_view bytes);
// The bytes a spelling stands for; code points outside the alphabet stay as
// their UTF-8 (a vocabulary's added tokens are not spelled).
std::string byte_level_bytes(std::string_view spelling);

// `text` as valid UTF-8: each ill-formed sequence becomes U+FFFD, one per
// maximal subpart (as a WHATWG decoder, e.g. Node's, reads it); NFC-normalized
// when `nfc`. Throws Error when the library refuses.
std::string sanitize_utf8(std::string_view text, bool nfc);

class ByteBpe {
 public:
  // `pieces` spelled byte-level (added tokens raw), `merges` as "left right"
  // lines, lowest rank first; `source` names the file in errors. Throws Error
  // when a byte has no piece of its own or a merge names an unknown piece.
  ByteBpe(const std::vector<std::string>& pieces, const std::vector<std::string>& merges,
          const PreTokenizer& pre, const std::string& source);
  ~ByteBpe();
  ByteBpe(const ByteBpe&) = delete;
  ByteBpe& operator=(const ByteBpe&) = delete;

  // Appends the ids of plain text (no special tokens) to `out`.
  void encode(std::string_view text, std::vector<int>& out) const;

 private:
  void encode_piece(std::string_view bytes, std::vector<int>& out) const;
  const PreTokenizer& pre_;
  struct Regex;
  std::unique_ptr<Regex> regex_;
  std::unordered_map<std::string, int> lookup_;  // spelling -> id
  int byte_token_[256];                          // the id of each byte's one-code-point piece
  // (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int, int>> merges_;
};

}  // namespace disagg::gpu
