// A context-free grammar over bytes: what constrained decoding generates
// under. Rules are numbered; each is a list of alternatives, each
// alternative a sequence of symbols, each symbol a set of bytes (one byte of
// the output) or a reference to a rule. UTF-8 is spelled out as byte
// sequences, so one grammar serves SentencePiece and byte-level vocabularies
// alike.
//
// Built with the combinators below (grammar/json_grammar.h builds JSON's),
// carried between nodes as JSON (to_json / from_json, nlohmann-json), and
// checked before use: references in range, a root that is defined, no left
// recursion (a rule that can reach itself without reading a byte), within
// the size limits below.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace disagg::grammar {

// A grammar that cannot be used: malformed JSON, a reference out of range,
// left recursion, a size past the limits; the message says which.
struct GrammarError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The most rules, and symbols in all alternatives together, one grammar may
// have (a request's or a peer's), and the most bytes of its JSON form (a
// request carries it to every worker, and a decode step copies it per
// sequence).
constexpr size_t kMaxRules = size_t(1) << 16;
constexpr size_t kMaxSymbols = size_t(1) << 20;
// All repetitions of a grammar spelled out together (Grammar::repeat).
constexpr size_t kMaxSpelledSymbols = 4 * kMaxSymbols;
constexpr size_t kMaxGrammarBytes = size_t(1) << 20;
// The deepest nesting of groups a grammar's or a pattern's text may have:
// their parsers recurse per group (a guided_regex of 500,000 '(' in a 1 MB
// body overflowed the stack and ended the server).
constexpr int kMaxNesting = 256;

// One more level of a recursion bounded at `limit`, for the guard's life:
// past the bound the level is given back and an `Error` thrown with
// message() (so an object that outlives the throw, a compiled grammar,
// keeps its count right).
template <class Error>
class NestingGuard {
 public:
  template <class Message>
  NestingGuard(int& depth, int limit, Message&& message) : depth_(depth) {
    if (++depth_ > limit) {
      --depth_;
      throw Error(message());
    }
  }
  ~NestingGuard() { --depth_; }
  NestingGuard(const NestingGuard&) = delete;
  NestingGuard& operator=(const NestingGuard&) = delete;

 private:
  int& depth_;
};

class ByteSet {
 public:
  ByteSet() = default;
  static ByteSet of(uint8_t byte) { return range(byte, byte); }
  static ByteSet range(uint8_t lo, uint8_t hi);
  static ByteSet all() { return range(0, 255); }
  ByteSet& add(uint8_t lo, uint8_t hi);
  ByteSet& add(const ByteSet& other);
  ByteSet complement() const;
  bool has(uint8_t byte) const { return (bits_[byte >> 6] >> (byte & 63)) & 1; }
  bool empty() const { return (bits_[0] | bits_[1] | bits_[2] | bits_[3]) == 0; }
  bool operator==(const ByteSet& o) const;
  bool operator<(const ByteSet& o) const;
  // "lo-hi,lo-hi" in hex (the JSON form), and back (GrammarError).
  std::string ranges() const;
  static ByteSet from_ranges(std::string_view text);

 private:
  uint64_t bits_[4] = {};
};

struct Symbol {
  int32_t rule = -1;  // >= 0: a reference to that rule; -1: one byte of `bytes`
  ByteSet bytes;
};
using Alternative = std::vector<Symbol>;

// What the combinators pass around: alternatives not yet a rule of their own.
struct Expr {
  std::vector<Alternative> alternatives;
};

class Grammar {
 public:
  // A grammar with its root, rule 0, not yet defined (it matches nothing
  // until define(0, ...)).
  Grammar();

  // ---- combinators: each returns an expression; rule() and define() make
  // ---- an expression a rule, which ref() then names.
  static Expr empty();                          // matches ""
  static Expr literal(std::string_view bytes);  // exactly these bytes
  static Expr bytes(const ByteSet& set);        // one byte of the set
  static Expr ref(int rule);
  Expr seq(std::initializer_list<Expr> parts);
  Expr seq(const std::vector<Expr>& parts);
  static Expr alt(std::initializer_list<Expr> parts);
  static Expr alt(const std::vector<Expr>& parts);
  Expr optional(const Expr& e);
  Expr star(const Expr& e);  // zero or more (e must not match "")
  Expr plus(const Expr& e);  // one or more
  // Between min and max copies (max < 0: no bound), `sep` between two.
  Expr repeat(const Expr& e, int min, int max, const Expr* sep = nullptr);

  int rule(const Expr& e);  // a new rule matching e
  int declare();            // a new rule, defined later (recursion)
  void define(int rule, const Expr& e);

  // ---- reading
  size_t rule_count() const { return rules_.size(); }
  const std::vector<Alternative>& alternatives(int rule) const { return rules_[size_t(rule)]; }
  // (kept as the rules change: the parsers check it after every atom)
  size_t symbol_count() const { return symbols_; }
  // Per rule, whether it may match "" (rules referred to must exist: check()).
  std::vector<char> nullable_rules() const;

  // Throws GrammarError: a reference out of range, a rule with no
  // alternative that is reachable, left recursion, past the limits.
  void check() const;

  // {"rules": [[[sym, ...], ...], ...]}: a symbol is a rule number or a
  // string of byte ranges ("30-39,61-61"). from_json checks sizes as it reads
  // (nothing is allocated from a length it announces) and then check().
  std::string to_json() const;
  static Grammar from_json(std::string_view text);

 private:
  // An expression as one symbol: itself when it is one symbol, else a rule.
  Symbol as_symbol(const Expr& e);
  std::vector<std::vector<Alternative>> rules_;
  size_t symbols_ = 0;  // in rules_
  size_t spelled_ = 0;  // symbols repeat() spelled out (kMaxSpelledSymbols)
};

}  // namespace disagg::grammar
