// The llama2.c tokenizer (file format and algorithm: ../shared/models/README.md).
#include "text/tokenizer.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <unordered_map>

#include "text/byte_bpe.h"
#include "gpu/error.h"
#include "gpu/file_check.h"
#include "text/merge_queue.h"

namespace disagg::gpu {
namespace {

// SentencePiece's word boundary (U+2581), which llama2.c's pieces spell ' '.
constexpr const char* kSentencePieceSpace = "\xe2\x96\x81";

// `s` with every `from` replaced by `to`, in one pass (replacing in place
// moved the rest of the string at every hit: quadratic in a long piece).
std::string replace_all(const std::string& s, const std::string& from, const std::string& to) {
  std::string out;
  out.reserve(s.size());
  size_t at = 0;
  for (size_t hit = s.find(from); hit != std::string::npos; hit = s.find(from, at)) {
    out.append(s, at, hit - at);
    out += to;
    at = hit + from.size();
  }
  out.append(s, at, std::string::npos);
  return out;
}

}  // namespace

namespace {

constexpr int kMinVocab = kByteTokenOffset + 256;

// Reads little-endian fields from a byte buffer, naming the file on underflow.
class Reader {
 public:
  Reader(const std::string& path, const std::string& bytes) : path_(path), bytes_(bytes) {}
  size_t remaining() const { return bytes_.size() - pos_; }
  template <class T>
  T read(const char* what) {
    T v;
    need(sizeof v, what);
    std::memcpy(&v, bytes_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  std::string read_string(size_t n, const char* what) {
    need(n, what);
    std::string s = bytes_.substr(pos_, n);
    pos_ += n;
    return s;
  }

 private:
  void need(size_t n, const char* what) const {
    if (remaining() < n)
      throw Error(path_ + ": truncated: " + what + " needs " + std::to_string(n) + " bytes at offset " +
                  std::to_string(pos_) + ", only " + std::to_string(remaining()) + " left");
  }
  const std::string& path_;
  const std::string& bytes_;
  size_t pos_ = 0;
};

// "<0xHH>" -> HH, else -1.
int byte_piece_value(const std::string& piece) {
  if (piece.size() != 6 || piece.compare(0, 3, "<0x") != 0 || piece[5] != '>') return -1;
  int value = 0;
  for (int i = 3; i < 5; ++i) {
    const char c = piece[i];
    int digit;
    if (c >= '0' && c <= '9') digit = c - '0';
    else if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    else return -1;
    value = value * 16 + digit;
  }
  return value;
}

bool is_utf8_continuation(unsigned char c) { return (c & 0xC0) == 0x80; }

}  // namespace

Tokenizer Tokenizer::load(const std::string& path, int expected_vocab) {
  const std::string bytes = read_regular_file(path);  // a FIFO or device refused before anything blocks

  Reader r(path, bytes);
  const int32_t max_token_length = r.read<int32_t>("max_token_length");
  if (max_token_length <= 0)
    throw Error(path + ": invalid max_token_length " + std::to_string(max_token_length));

  // The file does not store the piece count: pieces run to the end of the file.
  Vocabulary v;
  while (r.remaining() > 0) {
    if (v.pieces.size() >= size_t(kMaxVocabSize))  // (before each piece: an empty one is 8 bytes of file)
      throw Error(path + ": more than " + std::to_string(kMaxVocabSize) + " pieces, more than a vocabulary may have");
    const std::string index = std::to_string(v.pieces.size());
    const float score = r.read<float>("score of a piece");
    const int32_t length = r.read<int32_t>("length of a piece");
    if (length < 0 || size_t(length) > r.remaining())
      throw Error(path + ": piece " + index + " has length " + std::to_string(length) + " but only " +
                  std::to_string(r.remaining()) + " bytes remain (truncated or corrupt)");
    v.pieces.push_back(r.read_string(size_t(length), "piece bytes"));
    v.scores.push_back(score);
  }

  if (expected_vocab > 0 && int(v.pieces.size()) != expected_vocab)
    throw Error(path + ": tokenizer has " + std::to_string(v.pieces.size()) + " pieces, model has " +
                std::to_string(expected_vocab));
  return from_vocabulary(std::move(v), path);
}

namespace {

// The first of a trie node's children (sorted by byte) whose byte is not
// below `c`: where `c`'s child is, or goes.
template <class Children>
auto first_not_below(Children& kids, unsigned char c) {
  return std::lower_bound(kids.begin(), kids.end(), c, [](const auto& k, unsigned char v) { return k.first < v; });
}

// A byte trie of the tokens recognised whole in text (control and added
// tokens): at each position the longest one that starts there, as Hugging
// Face's added-token split and llama.cpp's special-token parse find them.
class SpecialTokens {
 public:
  void add(const std::string& text, int id) {
    if (text.empty()) return;
    int node = 0;
    for (unsigned char c : text) {
      auto& kids = nodes_[size_t(node)].children;
      auto it = first_not_below(kids, c);
      if (it == kids.end() || it->first != c) {
        node = kids.insert(it, {c, int(nodes_.size())})->second;
        nodes_.emplace_back();  // (may move `kids`: read before)
      } else {
        node = it->second;
      }
    }
    if (nodes_[size_t(node)].id < 0) nodes_[size_t(node)].id = id;  // first id wins
  }
  bool empty() const { return nodes_.size() == 1; }
  // (id, length) of the longest token at text[at...], or id -1.
  std::pair<int, size_t> longest_at(const std::string& text, size_t at) const {
    std::pair<int, size_t> best{-1, 0};
    int node = 0;
    for (size_t i = at; i < text.size(); ++i) {
      const auto& kids = nodes_[size_t(node)].children;
      const auto c = static_cast<unsigned char>(text[i]);
      auto it = first_not_below(kids, c);
      if (it == kids.end() || it->first != c) break;
      node = it->second;
      if (nodes_[size_t(node)].id >= 0) best = {nodes_[size_t(node)].id, i + 1 - at};
    }
    return best;
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int>> children;  // sorted by byte
    int id = -1;
  };
  std::vector<Node> nodes_{1};
};

}  // namespace

struct Tokenizer::Impl {
  Vocabulary v;
  // sentencepiece: piece -> id, of the pieces text is spelled and merged
  // into: not control, unknown, byte or unused ones (where the vocabulary
  // says which), which SentencePiece never makes from text; so text that
  // spells "</s>" or "<0x0A>" stays that text, as the reference tokenizers
  // have it (and a defused control token's spelling cannot merge back into it).
  std::unordered_map<std::string, int> lookup;
  SpecialTokens special;
  std::unique_ptr<ByteBpe> bpe;

  TokenType type(int id) const { return v.types.empty() ? TokenType::normal : v.types[size_t(id)]; }
  void encode_sentencepiece(const std::string& text, bool at_start, std::vector<int>& out) const;
};

Tokenizer Tokenizer::from_vocabulary(Vocabulary vocabulary, const std::string& path) {
  auto impl = std::make_shared<Impl>();
  Vocabulary& v = impl->v;
  v = std::move(vocabulary);
  if (v.pieces.size() > size_t(kMaxVocabSize))
    throw Error(path + ": " + std::to_string(v.pieces.size()) + " tokens, more than a vocabulary may have (" +
                std::to_string(kMaxVocabSize) + ")");
  for (size_t i = 0; i < v.pieces.size(); ++i)
    if (v.pieces[i].size() > kMaxPieceBytes)
      throw Error(path + ": token " + std::to_string(i) + " is " + std::to_string(v.pieces[i].size()) +
                  " bytes long, more than a token may be (" + std::to_string(kMaxPieceBytes) + ")");
  const int n = int(v.pieces.size());
  if (!v.types.empty() && v.types.size() != v.pieces.size())
    throw Error(path + ": " + std::to_string(n) + " pieces but " + std::to_string(v.types.size()) + " token types");
  for (int id : {v.bos, v.eos})
    if (id < -1 || id >= n) throw Error(path + ": special token id " + std::to_string(id) + " is not in the vocabulary");
  if (v.add_bos && v.bos < 0) throw Error(path + ": the vocabulary adds BOS but has none");
  if (v.model == TokenizerModel::sentencepiece) {
    if (v.scores.size() != v.pieces.size())
      throw Error(path + ": " + std::to_string(n) + " pieces but " + std::to_string(v.scores.size()) + " scores");
    if (n < kMinVocab)
      throw Error(path + ": tokenizer has " + std::to_string(n) + " pieces; byte fallback needs at least " +
                  std::to_string(kMinVocab));
    for (int b = 0; b < 256; ++b)
      if (byte_piece_value(v.pieces[size_t(b + kByteTokenOffset)]) != b)
        throw Error(path + ": piece " + std::to_string(b + kByteTokenOffset) + " should be the byte piece for " +
                    std::to_string(b));
    impl->lookup.reserve(v.pieces.size());
    for (int i = 0; i < n; ++i) {
      const TokenType type = impl->type(i);
      if (type == TokenType::normal || type == TokenType::user_defined)
        impl->lookup.emplace(v.pieces[size_t(i)], i);  // first id wins on duplicates
    }
  } else {
    impl->bpe = std::make_unique<ByteBpe>(v.pieces, v.merges, pre_tokenizer(v.pre), path);
  }
  for (int i = 0; i < n; ++i)
    if (impl->type(i) == TokenType::control || impl->type(i) == TokenType::user_defined)
      impl->special.add(v.pieces[size_t(i)], i);
  Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

int Tokenizer::vocab_size() const { return int(impl_->v.pieces.size()); }
const Vocabulary& Tokenizer::vocabulary() const { return impl_->v; }

void Tokenizer::Impl::encode_sentencepiece(const std::string& text, bool at_start, std::vector<int>& tokens) const {
  const size_t first = tokens.size();
  auto emit = [&](const std::string& s) {
    if (auto it = lookup.find(s); it != lookup.end()) {
      tokens.push_back(it->second);
    } else {
      for (unsigned char b : s) tokens.push_back(int(b) + kByteTokenOffset);
    }
  };
  // SentencePiece's "dummy prefix": words at the start look like words after a space.
  if (at_start && !text.empty()) emit(" ");
  // One UTF-8 code point at a time (at most 4 bytes, as llama2.c does).
  for (size_t i = 0; i < text.size();) {
    size_t n = 1;
    while (i + n < text.size() && n < 4 && is_utf8_continuation(static_cast<unsigned char>(text[i + n]))) ++n;
    emit(text.substr(i, n));
    i += n;
  }
  // Merge the adjacent pair with the highest-scoring merged piece, leftmost
  // on ties, until no adjacent pair forms a piece (llama2.c's rule).
  std::vector<int> ids(tokens.begin() + long(first), tokens.end());
  std::string merged;
  merge_greedily(ids, [&](int left, int right) -> std::optional<Merge> {
    merged = v.pieces[size_t(left)];
    merged += v.pieces[size_t(right)];
    auto it = lookup.find(merged);
    if (it == lookup.end()) return std::nullopt;
    return Merge{-double(v.scores[size_t(it->second)]), it->second};
  });
  tokens.resize(first);
  tokens.insert(tokens.end(), ids.begin(), ids.end());
}

namespace {

constexpr char kMark[] = "\xEF\xB7\x90";  // U+FDD0 in UTF-8
constexpr size_t kMarkBytes = 3;

}  // namespace

std::string without_marks(const std::string& text) {
  // A run of marks is either one (inside a defused token: dropped) or an
  // even number (the text's own, doubled: half kept).
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    size_t run = 0;
    while (text.compare(i + run * kMarkBytes, kMarkBytes, kMark) == 0) ++run;
    if (run == 0) {
      out += text[i++];
      continue;
    }
    for (size_t k = 0; k < run / 2; ++k) out += kMark;
    i += run * kMarkBytes;
  }
  return out;
}

std::string Tokenizer::defused_text(const std::string& text) const {
  const Impl& m = *impl_;
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, kMarkBytes, kMark) == 0) {
      out.append(kMark).append(kMark);
      i += kMarkBytes;
      continue;
    }
    // As encode() reads text: the longest special token that starts here.
    const auto [id, length] = m.special.empty() ? std::pair<int, size_t>{-1, 0} : m.special.longest_at(text, i);
    if (id < 0) {
      out += text[i++];
      continue;
    }
    if (m.type(id) != TokenType::control) {
      out.append(text, i, length);
    } else {
      for (size_t k = i; k < i + length; ++k) {  // a mark between characters (never inside one)
        if (k > i && !is_utf8_continuation(static_cast<unsigned char>(text[k]))) out += kMark;
        out += text[k];
      }
    }
    i += length;
  }
  return out;
}

std::vector<int> Tokenizer::encode(const std::string& text, bool add_bos, bool marked) const {
  const Impl& m = *impl_;
  std::vector<int> tokens;
  if (add_bos && m.v.add_bos) tokens.push_back(m.v.bos);
  auto plain = [&](size_t from, size_t to) {
    if (to <= from) return;
    const std::string part = marked ? without_marks(text.substr(from, to - from)) : text.substr(from, to - from);
    if (part.empty()) return;  // (marks only)
    if (m.bpe) m.bpe->encode(part, tokens);
    else m.encode_sentencepiece(part, from == 0, tokens);
  };
  size_t start = 0;  // of the plain text not yet encoded
  if (!m.special.empty()) {
    for (size_t i = 0; i < text.size();) {
      const auto [id, length] = m.special.longest_at(text, i);
      if (id < 0) {
        ++i;
        continue;
      }
      plain(start, i);
      tokens.push_back(id);
      i += length;
      start = i;
    }
  }
  plain(start, text.size());
  return tokens;
}

TokenType Tokenizer::type_of(int token) const {
  if (token < 0 || token >= vocab_size())
    throw Error("token id " + std::to_string(token) + " is out of range [0, " + std::to_string(vocab_size()) + ")");
  return impl_->type(token);
}

std::string Tokenizer::decode(int previous, int token) const {
  if (token < 0 || token >= vocab_size())
    throw Error("token id " + std::to_string(token) + " is out of range [0, " + std::to_string(vocab_size()) + ")");
  const Impl& m = *impl_;
  const std::string& piece = m.v.pieces[size_t(token)];
  const TokenType type = m.type(token);
  // (unused: no text either, as llama.cpp suppresses it; a Hugging Face
  // vocabulary's padding rows past its tokens, "[PADn]", are such)
  if (type == TokenType::control || type == TokenType::unused) return {};
  if (type == TokenType::user_defined) return piece;
  if (m.bpe) return byte_level_bytes(piece);
  if (const int byte = byte_piece_value(piece); byte >= 0) return std::string(1, char(byte));
  if (previous == m.v.bos && !piece.empty() && piece[0] == ' ') return piece.substr(1);
  return piece;
}

std::string Tokenizer::decode_all(int previous, const std::vector<int>& tokens) const {
  std::string text;
  for (int token : tokens) {
    text += decode(previous, token);
    previous = token;
  }
  return text;
}

std::vector<int> end_tokens_of(const Vocabulary& v, const std::vector<int>& named) {
  static const char* const kEndOfTurn[] = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>",
                                           "<|end|>",    "<end_of_turn>"};
  std::vector<int> ends;
  auto add = [&](int id) {
    if (id >= 0 && id < int(v.pieces.size()) && std::find(ends.begin(), ends.end(), id) == ends.end()) ends.push_back(id);
  };
  for (int id : named) add(id);
  for (size_t i = 0; i < v.types.size(); ++i)
    if (v.types[i] == TokenType::control)
      for (const char* name : kEndOfTurn)
        if (v.pieces[i] == name) add(int(i));
  if (v.model == TokenizerModel::sentencepiece) add(v.bos);
  std::sort(ends.begin(), ends.end());
  return ends;
}

// ---------------------------------------------------------------- synthetic tokenizer

namespace {

// Filler pieces in merge-priority order. Single characters come first: merges
// only ever join two existing pieces, so every longer piece below is the
// concatenation of an earlier piece and a single letter, i.e. a reachable merge.
std::vector<std::string> filler_pieces(size_t count) {
  static const std::string kLetters = "etaoinshrdlcumwfgypbvkjxqz";  // English frequency order
  std::vector<std::string> out;
  auto add = [&](std::string s) {
    if (out.size() < count) out.push_back(std::move(s));
  };

  add(" ");
  for (char c : kLetters) add(std::string(1, c));
  for (char c : kLetters) add(std::string(1, char(c - 'a' + 'A')));
  for (char c = '!'; c <= '~'; ++c)
    if (!std::isalpha(static_cast<unsigned char>(c))) add(std::string(1, c));

  // Then stem + letter, level by level: " e", " t", ..., "ee", "et", ..., " ee", ...
  std::vector<std::string> stems{" "};
  for (char c : kLetters) stems.emplace_back(1, c);
  while (out.size() < count) {
    std::vector<std::string> next;
    for (const std::string& stem : stems)
      for (char c : kLetters) {
        next.push_back(stem + c);
        add(next.back());
      }
    stems = std::move(next);
  }
  return out;
}

}  // namespace

std::string sentencepiece_spelling(const std::string& piece) { return replace_all(piece, " ", kSentencePieceSpace); }
std::string llama2c_spelling(const std::string& piece) { return replace_all(piece, kSentencePieceSpace, " "); }

Vocabulary byte_vocabulary(int vocab_size) {
  if (vocab_size < kMinVocab)
    throw Error("a byte tokenizer needs at least " + std::to_string(kMinVocab) + " pieces, asked for " +
                std::to_string(vocab_size));

  // Special pieces spelled as llama2.c's tokenizer export writes them.
  std::vector<std::string> pieces{"<unk>", "\n<s>\n", "\n</s>\n"};
  std::vector<float> scores(pieces.size(), 0.0f);
  char name[8];
  for (int b = 0; b < 256; ++b) {
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    pieces.emplace_back(name);
    scores.push_back(0.0f);
  }
  // SentencePiece convention: score = -rank, so earlier (shorter) merges win.
  int rank = 0;
  for (std::string& piece : filler_pieces(size_t(vocab_size) - pieces.size())) {
    pieces.push_back(std::move(piece));
    scores.push_back(-float(rank++));
  }
  Vocabulary v;
  v.pieces = std::move(pieces);
  v.scores = std::move(scores);
  return v;
}

void write_byte_tokenizer(const std::string& path, int vocab_size) {
  Vocabulary v;
  try {
    v = byte_vocabulary(vocab_size);
  } catch (const Error& e) {
    throw Error(path + ": " + e.what());
  }
  const std::vector<std::string>& pieces = v.pieces;
  const std::vector<float>& scores = v.scores;
  int32_t max_length = 0;
  for (const std::string& p : pieces) max_length = std::max<int32_t>(max_length, int32_t(p.size()));

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(path + ": cannot create tokenizer file");
  out.write(reinterpret_cast<const char*>(&max_length), sizeof max_length);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int32_t length = int32_t(pieces[i].size());
    out.write(reinterpret_cast<const char*>(&scores[i]), sizeof scores[i]);
    out.write(reinterpret_cast<const char*>(&length), sizeof length);
    out.write(pieces[i].data(), length);
  }
  out.close();
  if (!out) throw Error(path + ": write failed");
}

}  // namespace disagg::gpu
