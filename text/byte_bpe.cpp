// Byte-level BPE: the pre-tokenizer regexes run on PCRE2 (JIT, Unicode
// properties), normalization and UTF-8 repair on ICU.
#include "text/byte_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <array>
#include <climits>

#include "gpu/error.h"
#include "text/merge_queue.h"

namespace disagg::gpu {
namespace {

// The split regexes of each family, as their tokenizer.json (and llama.cpp's
// llama-vocab.cpp for the same `tokenizer.ggml.pre`) define them.
const std::string kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
const std::string kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const std::string kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

const std::array<PreTokenizer, 6> kPreTokenizers{{
    {"default", kGpt2Pattern, false, false},
    {"gpt-2", kGpt2Pattern, false, false},
    {"llama-bpe", kLlama3Pattern, true, false},
    {"llama3", kLlama3Pattern, true, false},
    {"llama-v3", kLlama3Pattern, true, false},
    {"qwen2", kQwen2Pattern, false, true},
}};

// GPT-2's alphabet: bytes '!'..'~', 0xA1..0xAC and 0xAE..0xFF are their own
// code points; the other 68 take U+0100 onwards in byte order.
struct ByteAlphabet {
  std::array<char32_t, 256> code_point{};
  std::array<int, 324> byte_of{};  // code point (< 0x144) -> byte, or -1
  ByteAlphabet() {
    byte_of.fill(-1);
    char32_t extra = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      code_point[size_t(b)] = printable ? char32_t(b) : extra++;
      byte_of[size_t(code_point[size_t(b)])] = b;
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

void append_utf8(std::string& out, char32_t cp) {  // cp < 0x800 here
  if (cp < 0x80) {
    out += char(cp);
  } else {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  }
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof buffer);
  return reinterpret_cast<const char*>(buffer);
}

void check_icu(UErrorCode status, const char* what) {
  if (U_FAILURE(status)) throw Error(std::string("text: ") + what + ": " + u_errorName(status));
}

}  // namespace

const PreTokenizer& pre_tokenizer(const std::string& name) {
  for (const PreTokenizer& p : kPreTokenizers)
    if (p.name == name) return p;
  std::string known;
  for (const PreTokenizer& p : kPreTokenizers) known += (known.empty() ? "" : ", ") + p.name;
  throw Error("tokenizer.ggml.pre \"" + name + "\" is not supported (supported: " + known + ")");
}

const PreTokenizer* pre_tokenizer_with_pattern(const std::string& pattern) {
  for (const PreTokenizer& p : kPreTokenizers)
    if (p.pattern == pattern) return &p;
  return nullptr;
}

std::string byte_level_spelling(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) append_utf8(out, alphabet().code_point[b]);
  return out;
}

std::string byte_level_bytes(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c0 = static_cast<unsigned char>(s[i]);
    // Only 1- and 2-byte sequences can be in the alphabet (code points < 0x144).
    if (c0 < 0x80 || ((c0 & 0xE0) == 0xC0 && i + 1 < s.size())) {
      const char32_t cp = c0 < 0x80 ? c0 : char32_t(((c0 & 0x1F) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3F));
      const size_t n = c0 < 0x80 ? 1 : 2;
      if (cp < alphabet().byte_of.size() && alphabet().byte_of[cp] >= 0) {
        out += char(alphabet().byte_of[cp]);
      } else {
        out.append(s.substr(i, n));
      }
      i += n;
    } else {
      out += s[i++];  // the rest of a longer sequence passes through byte by byte
    }
  }
  return out;
}

std::string sanitize_utf8(std::string_view text, bool nfc) {
  if (text.size() > size_t(INT32_MAX / 2)) throw Error("text: " + std::to_string(text.size()) + " bytes is too long");
  // To UTF-16 with U+FFFD for what is ill-formed: at most one unit per byte.
  std::u16string units(text.size(), u'\0');
  int32_t length = 0, substitutions = 0;
  UErrorCode status = U_ZERO_ERROR;
  u_strFromUTF8WithSub(units.data(), int32_t(units.size()), &length, text.data(), int32_t(text.size()), 0xFFFD,
                       &substitutions, &status);
  check_icu(status, "UTF-8 conversion");
  units.resize(size_t(length));
  bool changed = substitutions > 0;
  if (nfc) {
    const UNormalizer2* normalizer = unorm2_getNFCInstance(&status);
    check_icu(status, "NFC");
    const int32_t done = unorm2_spanQuickCheckYes(normalizer, units.data(), length, &status);
    check_icu(status, "NFC check");
    if (done < length) {
      // Normalizing can lengthen text (at most 3x for NFC); preflight, then fill.
      std::u16string normal;
      int32_t need = unorm2_normalize(normalizer, units.data(), length, nullptr, 0, &status);
      if (status != U_BUFFER_OVERFLOW_ERROR) check_icu(status, "NFC");
      status = U_ZERO_ERROR;
      normal.resize(size_t(need));
      unorm2_normalize(normalizer, units.data(), length, normal.data(), need, &status);
      check_icu(status, "NFC");
      units = std::move(normal);
      changed = true;
    }
  }
  if (!changed) return std::string(text);
  std::string out(units.size() * 3, '\0');
  int32_t bytes = 0;
  u_strToUTF8(out.data(), int32_t(out.size()), &bytes, units.data(), int32_t(units.size()), &status);
  check_icu(status, "UTF-8 conversion");
  out.resize(size_t(bytes));
  return out;
}

struct ByteBpe::Regex {
  pcre2_code* code = nullptr;
  ~Regex() { pcre2_code_free(code); }
};

ByteBpe::ByteBpe(const std::vector<std::string>& pieces, const std::vector<std::string>& merges,
                 const PreTokenizer& pre, const std::string& source)
    : pre_(pre), regex_(std::make_unique<Regex>()) {
  int code = 0;
  PCRE2_SIZE offset = 0;
  regex_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pre.pattern.c_str()), PCRE2_ZERO_TERMINATED,
                               PCRE2_UTF | PCRE2_UCP, &code, &offset, nullptr);
  if (!regex_->code)
    throw Error(source + ": the " + pre.name + " pre-tokenizer's regex does not compile at " + std::to_string(offset) +
                ": " + pcre2_message(code));
  pcre2_jit_compile(regex_->code, PCRE2_JIT_COMPLETE);  // without JIT (unsupported CPU) it still matches

  lookup_.reserve(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) lookup_.emplace(pieces[i], int(i));  // first id wins
  for (int b = 0; b < 256; ++b) {
    const std::string spelling = byte_level_spelling(std::string(1, char(b)));
    auto it = lookup_.find(spelling);
    if (it == lookup_.end())
      throw Error(source + ": the byte-level vocabulary has no piece for byte " + std::to_string(b) + " (\"" +
                  spelling + "\")");
    byte_token_[b] = it->second;
  }
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string& m = merges[rank];
    const size_t space = m.find(' ', 1);  // a piece never holds a space (byte-level spelling)
    auto left = space == std::string::npos ? lookup_.end() : lookup_.find(m.substr(0, space));
    auto right = space == std::string::npos ? lookup_.end() : lookup_.find(m.substr(space + 1));
    auto merged = space == std::string::npos ? lookup_.end() : lookup_.find(m.substr(0, space) + m.substr(space + 1));
    if (left == lookup_.end() || right == lookup_.end() || merged == lookup_.end())
      throw Error(source + ": merge " + std::to_string(rank) + " \"" + m + "\" names a piece the vocabulary lacks");
    merges_.emplace(uint64_t(uint32_t(left->second)) << 32 | uint32_t(right->second),
                    std::pair<int, int>{int(rank), merged->second});  // a repeated pair keeps its first rank
  }
}

ByteBpe::~ByteBpe() = default;

void ByteBpe::encode(std::string_view raw, std::vector<int>& out) const {
  const std::string text = sanitize_utf8(raw, pre_.nfc);
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(regex_->code, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  // Long runs (a 64 KiB word) need more than the default 32 KiB JIT stack.
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
  if (!match || !context || !stack) {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(match);
    throw Error("pre-tokenizer: out of memory");
  }
  pcre2_jit_stack_assign(context, nullptr, stack);
  struct Free {
    pcre2_match_data* m;
    pcre2_match_context* c;
    pcre2_jit_stack* s;
    ~Free() {
      pcre2_jit_stack_free(s);
      pcre2_match_context_free(c);
      pcre2_match_data_free(m);
    }
  } free_all{match, context, stack};

  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t at = 0;
  while (at < text.size()) {
    const int rc = pcre2_match(regex_->code, subject, text.size(), at, PCRE2_NO_UTF_CHECK, match, context);
    if (rc == PCRE2_ERROR_NOMATCH) {
      encode_piece(std::string_view(text).substr(at), out);  // an unmatched tail is a piece of its own
      break;
    }
    if (rc < 0) throw Error("pre-tokenizer " + pre_.name + ": " + pcre2_message(rc));
    const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match);
    if (span[0] > at) encode_piece(std::string_view(text).substr(at, span[0] - at), out);  // Split "Isolated": gaps too
    if (span[1] == span[0]) {  // never for these patterns; step one code point on
      size_t n = 1;
      while (span[0] + n < text.size() && (static_cast<unsigned char>(text[span[0] + n]) & 0xC0) == 0x80) ++n;
      encode_piece(std::string_view(text).substr(span[0], n), out);
      at = span[0] + n;
      continue;
    }
    encode_piece(std::string_view(text).substr(span[0], span[1] - span[0]), out);
    at = span[1];
  }
}

void ByteBpe::encode_piece(std::string_view bytes, std::vector<int>& out) const {
  if (pre_.ignore_merges) {
    if (auto it = lookup_.find(byte_level_spelling(bytes)); it != lookup_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  std::vector<int> ids;
  ids.reserve(bytes.size());
  for (unsigned char b : bytes) ids.push_back(byte_token_[b]);
  merge_greedily(ids, [this](int left, int right) -> std::optional<Merge> {
    auto it = merges_.find(uint64_t(uint32_t(left)) << 32 | uint32_t(right));
    if (it == merges_.end()) return std::nullopt;
    return Merge{double(it->second.first), it->second.second};
  });
  out.insert(out.end(), ids.begin(), ids.end());
}

}  // namespace disagg::gpu
