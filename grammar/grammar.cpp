#include "grammar/grammar.h"

#include <algorithm>
#include <cstdio>
#include <functional>

#include <nlohmann/json.hpp>

namespace disagg::grammar {

// ---------------------------------------------------------------- ByteSet

ByteSet ByteSet::range(uint8_t lo, uint8_t hi) { return ByteSet().add(lo, hi); }

ByteSet& ByteSet::add(uint8_t lo, uint8_t hi) {
  for (int b = lo; b <= hi; ++b) bits_[b >> 6] |= uint64_t(1) << (b & 63);
  return *this;
}

ByteSet& ByteSet::add(const ByteSet& other) {
  for (int i = 0; i < 4; ++i) bits_[i] |= other.bits_[i];
  return *this;
}

ByteSet ByteSet::complement() const {
  ByteSet out;
  for (int i = 0; i < 4; ++i) out.bits_[i] = ~bits_[i];
  return out;
}

bool ByteSet::operator==(const ByteSet& o) const { return std::equal(bits_, bits_ + 4, o.bits_); }
bool ByteSet::operator<(const ByteSet& o) const { return std::lexicographical_compare(bits_, bits_ + 4, o.bits_, o.bits_ + 4); }

std::string ByteSet::ranges() const {
  std::string out;
  for (int b = 0; b < 256;) {
    if (!has(uint8_t(b))) {
      ++b;
      continue;
    }
    int e = b;
    while (e + 1 < 256 && has(uint8_t(e + 1))) ++e;
    char buf[8];
    std::snprintf(buf, sizeof buf, "%02x-%02x", b, e);
    if (!out.empty()) out += ',';
    out += buf;
    b = e + 1;
  }
  return out;
}

namespace {

int hex_byte(std::string_view text, size_t at) {
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (at + 2 > text.size()) return -1;
  const int hi = digit(text[at]), lo = digit(text[at + 1]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

}  // namespace

ByteSet ByteSet::from_ranges(std::string_view text) {
  // "lo-hi" pieces of exactly five characters, comma-separated.
  ByteSet out;
  if (!text.empty() && text.back() == ',')
    throw GrammarError("grammar: byte ranges \"" + std::string(text.substr(0, 40)) + "\" end in a comma");
  for (size_t at = 0; at < text.size(); at += 6) {
    const int lo = hex_byte(text, at), hi = hex_byte(text, at + 3);
    if (lo < 0 || hi < lo || text[at + 2] != '-' || (at + 5 < text.size() && text[at + 5] != ','))
      throw GrammarError("grammar: byte ranges \"" + std::string(text.substr(0, 40)) + "\" are not lo-hi,lo-hi in hex");
    out.add(uint8_t(lo), uint8_t(hi));
  }
  if (out.empty()) throw GrammarError("grammar: a byte set is empty");
  return out;
}

// ---------------------------------------------------------------- combinators

Grammar::Grammar() : rules_(1) {}

Expr Grammar::empty() { return Expr{{Alternative{}}}; }

Expr Grammar::literal(std::string_view bytes) {
  Alternative a;
  for (char c : bytes) a.push_back(Symbol{-1, ByteSet::of(uint8_t(c))});
  return Expr{{std::move(a)}};
}

Expr Grammar::bytes(const ByteSet& set) { return Expr{{Alternative{Symbol{-1, set}}}}; }

Expr Grammar::ref(int rule) { return Expr{{Alternative{Symbol{rule, {}}}}}; }

Symbol Grammar::as_symbol(const Expr& e) {
  if (e.alternatives.size() == 1 && e.alternatives[0].size() == 1) return e.alternatives[0][0];
  return Symbol{rule(e), {}};
}

Expr Grammar::seq(std::initializer_list<Expr> parts) { return seq(std::vector<Expr>(parts)); }

Expr Grammar::seq(const std::vector<Expr>& parts) {
  Alternative out;
  for (const Expr& p : parts) {
    if (p.alternatives.size() == 1) {
      out.insert(out.end(), p.alternatives[0].begin(), p.alternatives[0].end());
    } else {
      out.push_back(as_symbol(p));
    }
  }
  return Expr{{std::move(out)}};
}

Expr Grammar::alt(std::initializer_list<Expr> parts) { return alt(std::vector<Expr>(parts)); }

Expr Grammar::alt(const std::vector<Expr>& parts) {
  Expr out;
  for (const Expr& p : parts) out.alternatives.insert(out.alternatives.end(), p.alternatives.begin(), p.alternatives.end());
  return out;
}

Expr Grammar::optional(const Expr& e) { return alt({e, empty()}); }

Expr Grammar::star(const Expr& e) {
  // R := e R | "": the reference to R is last, so a stack does not grow.
  const int r = declare();
  define(r, alt({seq({e, ref(r)}), empty()}));
  return ref(r);
}

Expr Grammar::plus(const Expr& e) { return seq({e, star(e)}); }

Expr Grammar::repeat(const Expr& e, int min, int max, const Expr* sep) {
  if (min < 0 || (max >= 0 && max < min)) throw GrammarError("grammar: repeat bounds " + std::to_string(min) + ".." + std::to_string(max));
  if (max == 0) return empty();
  // Each copy is spelled out: refused before it is built when the copies
  // alone would pass the size limit (nested repetitions multiply).
  size_t symbols = 0;
  for (const Alternative& a : e.alternatives) symbols += a.size();
  const size_t copies = std::max<size_t>(symbols, 1) * size_t(std::max(min, max));
  if (copies > kMaxSymbols)
    throw GrammarError("grammar: a repetition that would spell out more than " + std::to_string(kMaxSymbols) + " symbols");
  // Repetitions spelled out before any rule holds them (a{1000}{1000} many
  // times over in one alternative) count against the grammar's budget too.
  spelled_ += copies;
  if (spelled_ > kMaxSpelledSymbols)
    throw GrammarError("grammar: its repetitions spell out more than " + std::to_string(kMaxSpelledSymbols) + " symbols");
  // The first copy, then (sep e) for the rest: min - 1 required, the others
  // optional and nested, so the grammar grows linearly with max.
  // The repeated part as one sequence of symbols (a multi-alternative one a
  // rule of its own, made once), so every link of the chain below has the
  // same body: CompiledGrammar tells a bounded repetition's links apart from
  // other rules by that.
  const Expr once = e.alternatives.size() > 1 ? Expr{{Alternative{as_symbol(e)}}} : e;
  const Expr next = sep ? seq({*sep, once}) : once;
  Expr rest;
  if (max < 0) {
    rest = star(next);
  } else {
    rest = empty();
    for (int i = max - std::max(min, 1); i > 0; --i) rest = optional(seq({next, rest}));
  }
  std::vector<Expr> parts{once};
  for (int i = 1; i < min; ++i) parts.push_back(next);
  parts.push_back(rest);
  const Expr some = seq(parts);
  return min == 0 ? optional(some) : some;
}

int Grammar::rule(const Expr& e) {
  const int r = declare();
  define(r, e);
  return r;
}

int Grammar::declare() {
  if (rules_.size() >= kMaxRules) throw GrammarError("grammar: more than " + std::to_string(kMaxRules) + " rules");
  rules_.emplace_back();
  return int(rules_.size() - 1);
}

void Grammar::define(int rule, const Expr& e) {
  if (rule < 0 || size_t(rule) >= rules_.size()) throw GrammarError("grammar: no rule " + std::to_string(rule));
  size_t symbols = symbols_;
  for (const Alternative& a : rules_[size_t(rule)]) symbols -= a.size();
  for (const Alternative& a : e.alternatives) symbols += a.size();
  // (checked as it grows: a compiler that copies a part per use, a schema's
  // long const under many types, must stop at the bound, not at the end)
  if (symbols > kMaxSymbols) throw GrammarError("grammar: more than " + std::to_string(kMaxSymbols) + " symbols");
  rules_[size_t(rule)] = e.alternatives;
  symbols_ = symbols;
}

// ---------------------------------------------------------------- checks

std::vector<char> Grammar::nullable_rules() const {
  // To a fixed point.
  const size_t n = rules_.size();
  std::vector<char> nullable(n, 0);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const auto& a : rules_[r])
        if (std::all_of(a.begin(), a.end(), [&](const Symbol& s) { return s.rule >= 0 && nullable[size_t(s.rule)]; })) {
          nullable[r] = changed = true;
          break;
        }
    }
  }
  return nullable;
}

void Grammar::check() const {
  if (rules_.size() > kMaxRules) throw GrammarError("grammar: more than " + std::to_string(kMaxRules) + " rules");
  if (symbol_count() > kMaxSymbols) throw GrammarError("grammar: more than " + std::to_string(kMaxSymbols) + " symbols");
  const size_t n = rules_.size();
  for (size_t r = 0; r < n; ++r)
    for (const auto& a : rules_[r])
      for (const Symbol& s : a) {
        if (s.rule >= int64_t(n) || (s.rule < 0 && s.bytes.empty()))
          throw GrammarError("grammar: rule " + std::to_string(r) + " refers to rule " + std::to_string(s.rule) +
                             (s.rule < 0 ? " (an empty byte set)" : ", which does not exist"));
      }
  if (rules_[0].empty()) throw GrammarError("grammar: the root rule has no alternative");
  const std::vector<char> nullable = nullable_rules();
  // Left recursion: a cycle among "r may start with s" edges.
  std::vector<std::vector<int>> starts(n);
  for (size_t r = 0; r < n; ++r)
    for (const auto& a : rules_[r])
      for (const Symbol& s : a) {
        if (s.rule < 0) break;
        starts[r].push_back(s.rule);
        if (!nullable[size_t(s.rule)]) break;
      }
  std::vector<char> mark(n, 0);  // 0 new, 1 on the path, 2 done
  std::vector<std::pair<int, size_t>> path;
  for (size_t root = 0; root < n; ++root) {
    if (mark[root]) continue;
    path.push_back({int(root), 0});
    mark[root] = 1;
    while (!path.empty()) {
      auto& [r, next] = path.back();
      if (next == starts[size_t(r)].size()) {
        mark[size_t(r)] = 2;
        path.pop_back();
        continue;
      }
      const int s = starts[size_t(r)][next++];
      if (mark[size_t(s)] == 1)
        throw GrammarError("grammar: rule " + std::to_string(s) + " is left-recursive (it can reach itself before a byte)");
      if (mark[size_t(s)] == 0) {
        mark[size_t(s)] = 1;
        path.push_back({s, 0});
      }
    }
  }
}

// ---------------------------------------------------------------- JSON form

std::string Grammar::to_json() const {
  nlohmann::json rules = nlohmann::json::array();
  for (const auto& r : rules_) {
    nlohmann::json alts = nlohmann::json::array();
    for (const auto& a : r) {
      nlohmann::json syms = nlohmann::json::array();
      for (const Symbol& s : a) {
        if (s.rule >= 0) syms.push_back(s.rule);
        else syms.push_back(s.bytes.ranges());
      }
      alts.push_back(std::move(syms));
    }
    rules.push_back(std::move(alts));
  }
  return nlohmann::json{{"rules", std::move(rules)}}.dump();
}

Grammar Grammar::from_json(std::string_view text) {
  if (text.size() > kMaxGrammarBytes)
    throw GrammarError("grammar: " + std::to_string(text.size()) + " bytes, more than " + std::to_string(kMaxGrammarBytes));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("rules") || !j["rules"].is_array() || j["rules"].empty())
    throw GrammarError("grammar: not {\"rules\": [...]} with at least one rule");
  const auto& rules = j["rules"];
  if (rules.size() > kMaxRules) throw GrammarError("grammar: more than " + std::to_string(kMaxRules) + " rules");
  Grammar g;
  g.rules_.assign(rules.size(), {});
  size_t symbols = 0;
  for (size_t r = 0; r < rules.size(); ++r) {
    if (!rules[r].is_array()) throw GrammarError("grammar: rule " + std::to_string(r) + " is not a list of alternatives");
    for (const auto& alt : rules[r]) {
      if (!alt.is_array()) throw GrammarError("grammar: rule " + std::to_string(r) + " has an alternative that is not a list");
      symbols += alt.size();
      if (symbols > kMaxSymbols) throw GrammarError("grammar: more than " + std::to_string(kMaxSymbols) + " symbols");
      Alternative a;
      for (const auto& s : alt) {
        if (s.is_number_unsigned() && s.get<uint64_t>() < rules.size()) a.push_back(Symbol{int32_t(s.get<uint64_t>()), {}});
        else if (s.is_string()) a.push_back(Symbol{-1, ByteSet::from_ranges(s.get_ref<const std::string&>())});
        else throw GrammarError("grammar: rule " + std::to_string(r) + " has a symbol that is neither a rule number nor byte ranges");
      }
      g.rules_[r].push_back(std::move(a));
    }
  }
  g.symbols_ = symbols;
  g.check();
  return g;
}

}  // namespace disagg::grammar
