#include "grammar/matcher.h"

#include "grammar/code_points.h"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>

namespace disagg::grammar {

// ---------------------------------------------------------------- TokenVocabulary

namespace {

// Token t's bit in a mask's words.
void set_bit(std::vector<uint64_t>& bits, int32_t t) { bits[size_t(t) >> 6] |= uint64_t(1) << (t & 63); }
void clear_bit(std::vector<uint64_t>& bits, int32_t t) { bits[size_t(t) >> 6] &= ~(uint64_t(1) << (t & 63)); }

// The set bits of a word (the library is built for any x86-64, where
// __builtin_popcountll is a call into libgcc).
size_t bits_in(uint64_t x) {
  x = x - ((x >> 1) & 0x5555555555555555ull);
  x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
  x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
  return size_t((x * 0x0101010101010101ull) >> 56);
}

// The characters of `text` when it is plain characters alone, else -1.
int32_t plain_chars_of(const std::string& text) {
  const auto& forms = plain_char_forms();
  int32_t chars = 0;
  for (size_t at = 0; at < text.size(); ++chars) {
    const ByteForm* form = nullptr;
    for (const ByteForm& f : forms)
      if (f[0].has(uint8_t(text[at]))) form = &f;
    if (!form || at + form->size() > text.size()) return -1;
    for (const ByteSet& set : *form)
      if (!set.has(uint8_t(text[at++]))) return -1;
  }
  return chars;
}

}  // namespace

TokenVocabulary::TokenVocabulary(std::vector<std::string> bytes, const std::vector<bool>& special,
                                 std::vector<int> end_tokens)
    : bytes_(std::move(bytes)), end_tokens_(std::move(end_tokens)) {
  std::sort(end_tokens_.begin(), end_tokens_.end());
  end_tokens_.erase(std::unique(end_tokens_.begin(), end_tokens_.end()), end_tokens_.end());
  end_tokens_.erase(std::remove_if(end_tokens_.begin(), end_tokens_.end(),
                                   [&](int t) { return t < 0 || size_t(t) >= bytes_.size(); }),
                    end_tokens_.end());
  // The tokens that may appear inside a text. Tokens longer than a node's
  // depth can say are left out (never allowed).
  std::vector<int32_t> text, rest;
  plain_chars_.assign(bytes_.size(), -1);
  for (size_t i = 0; i < bytes_.size(); ++i) {
    if (bytes_[i].empty() || bytes_[i].size() > 0xFFFF || (i < special.size() && special[i]) || is_end(int(i))) continue;
    text.push_back(int32_t(i));
    plain_chars_[i] = plain_chars_of(bytes_[i]);
    if (plain_chars_[i] < 0) rest.push_back(int32_t(i));
  }
  const size_t words = (bytes_.size() + 63) / 64;
  plain_up_to_.assign(kPlainMasks + 1, std::vector<uint64_t>(words, 0));
  plain_all_.assign(words, 0);
  std::vector<int32_t> rest_long = rest;
  for (int32_t t : text) {
    const int32_t chars = plain_chars_[size_t(t)];
    if (chars < 0) continue;
    max_plain_chars_ = std::max(max_plain_chars_, int(chars));
    set_bit(plain_all_, t);
    if (chars > kPlainMasks) rest_long.push_back(t);
    for (int k = chars; k <= kPlainMasks; ++k) set_bit(plain_up_to_[size_t(k)], t);
  }
  all_ = trie_of(std::move(text));
  for (uint32_t n = 1; n < all_.nodes.size(); n = all_.nodes[n].subtree_end) branch_[all_.nodes[n].byte] = n;
  rest_ = trie_of(std::move(rest));
  rest_long_ = trie_of(std::move(rest_long));
  by_length_ = all_.tokens;
  std::stable_sort(by_length_.begin(), by_length_.end(),
                   [&](int32_t a, int32_t b) { return bytes_[size_t(a)].size() > bytes_[size_t(b)].size(); });
}

// The prefix tree of `order`, built from them in byte order: each new node
// comes after its parent's earlier subtree, which is preorder.
TokenVocabulary::Trie TokenVocabulary::trie_of(std::vector<int32_t> order) const {
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bytes_[size_t(a)] != bytes_[size_t(b)] ? bytes_[size_t(a)] < bytes_[size_t(b)] : a < b;
  });
  Trie trie;
  std::vector<Node>& nodes = trie.nodes;
  nodes.assign(1, Node{});
  std::vector<std::vector<int32_t>> ending(1);  // per node, the tokens whose bytes end there
  std::vector<uint32_t> path{0};                // the nodes of the previous token's bytes
  std::string previous;
  for (int32_t t : order) {
    const std::string& b = bytes_[size_t(t)];
    size_t common = 0;
    while (common < previous.size() && common < b.size() && previous[common] == b[common]) ++common;
    path.resize(common + 1);
    for (size_t i = common; i < b.size(); ++i) {
      Node node;
      node.depth = uint16_t(i + 1);
      node.byte = uint8_t(b[i]);
      nodes.push_back(node);
      ending.emplace_back();
      path.push_back(uint32_t(nodes.size() - 1));
    }
    ending[path.back()].push_back(t);
    previous = b;
  }
  for (size_t n = 0; n < nodes.size(); ++n) {
    nodes[n].first_token = uint32_t(trie.tokens.size());
    nodes[n].tokens = uint32_t(ending[n].size());
    trie.tokens.insert(trie.tokens.end(), ending[n].begin(), ending[n].end());
  }
  // Subtrees from the end (a subtree's nodes follow its root): the nodes
  // still open on the right spine are closed by a node no deeper.
  trie.subtree_bytes.assign(nodes.size(), Bytes{});
  std::vector<uint32_t> open;
  auto close = [&](uint32_t n, uint32_t end) {
    nodes[n].subtree_end = end;
    nodes[n].subtree_tokens_end = end < nodes.size() ? nodes[end].first_token : uint32_t(trie.tokens.size());
  };
  for (uint32_t n = 0; n < nodes.size(); ++n) {
    while (!open.empty() && nodes[open.back()].depth >= nodes[n].depth) {
      close(open.back(), n);
      open.pop_back();
    }
    // Its byte and its depth are below each open ancestor.
    nodes[n].max_depth = nodes[n].depth;
    for (uint32_t a : open) {
      trie.subtree_bytes[a][nodes[n].byte >> 6] |= uint64_t(1) << (nodes[n].byte & 63);
      nodes[a].max_depth = std::max(nodes[a].max_depth, nodes[n].depth);
    }
    open.push_back(n);
  }
  for (uint32_t a : open) close(a, uint32_t(nodes.size()));
  return trie;
}

void TokenVocabulary::allow_plain_up_to(int chars, std::vector<uint64_t>& bits) const {
  const std::vector<uint64_t>& up_to = plain_up_to_[size_t(std::clamp(chars, 0, kPlainMasks))];
  for (size_t w = 0; w < bits.size(); ++w) bits[w] |= up_to[w];
}

void TokenVocabulary::allow_plain(std::vector<uint64_t>& bits) const {
  for (size_t w = 0; w < bits.size(); ++w) bits[w] |= plain_all_[w];
}

size_t TokenVocabulary::longer_than(size_t n) const {
  return size_t(std::partition_point(by_length_.begin(), by_length_.end(),
                                     [&](int32_t t) { return bytes_[size_t(t)].size() > n; }) -
                by_length_.begin());
}

std::shared_ptr<const TokenVocabulary::ByteRun> TokenVocabulary::byte_run(const Bytes& set, bool build) const {
  std::lock_guard<std::mutex> lock(runs_mutex_);
  for (const auto& run : runs_)
    if (run->set == set) return run;
  if (!build) return nullptr;
  if (runs_.size() >= kMaxByteRuns) runs_.erase(runs_.begin());
  runs_.push_back(make_byte_run(set));
  return runs_.back();
}

// One pass down the tree in preorder through the nodes of the set's bytes
// (a node reached has a parent of them: the subtrees of the others are
// skipped), then the branches placed by group.
std::shared_ptr<const TokenVocabulary::ByteRun> TokenVocabulary::make_byte_run(const Bytes& set) const {
  auto run = std::make_shared<ByteRun>();
  run->set = set;
  auto in = [&](uint8_t b) { return (set[b >> 6] >> (b & 63)) & 1; };
  const size_t words = (bytes_.size() + 63) / 64;
  run->alone_bits.assign(kRunDepth + 1, std::vector<uint64_t>(words, 0));
  constexpr size_t kKeys = size_t(kRunGroups) * 256;
  std::vector<uint32_t> key_of;  // per branch found, its group (at * 256 + byte)
  std::vector<uint32_t> found;
  std::vector<uint32_t> group_size(kKeys, 0);
  const std::vector<Node>& nodes = all_.nodes;
  for (uint32_t n = 1; n < nodes.size();) {
    const Node& node = nodes[n];
    if (in(node.byte)) {
      for (uint32_t t = node.first_token; t < node.first_token + node.tokens; ++t) {
        if (node.depth <= kRunDepth) set_bit(run->alone_bits[node.depth], all_.tokens[t]);
        else run->alone_longer.push_back(all_.tokens[t]);
      }
      ++n;
      continue;
    }
    const size_t at = size_t(node.depth) - 1;
    if (at < size_t(kRunGroups)) {
      key_of.push_back(uint32_t(at * 256 + node.byte));
      found.push_back(n);
      ++group_size[key_of.back()];
    } else {
      run->far.push_back(n);
    }
    n = node.subtree_end;
  }
  for (int n = 1; n <= kRunDepth; ++n)
    for (size_t w = 0; w < words; ++w) run->alone_bits[size_t(n)][w] |= run->alone_bits[size_t(n) - 1][w];
  std::vector<uint32_t> place(kKeys + 1, 0);
  for (size_t k = 0; k < kKeys; ++k) {
    place[k + 1] = place[k] + group_size[k];
    if (group_size[k]) run->groups.push_back({uint16_t(k / 256), uint8_t(k % 256), place[k], place[k + 1]});
  }
  run->branches.resize(found.size());
  for (size_t i = 0; i < found.size(); ++i) run->branches[place[key_of[i]]++] = found[i];
  return run;
}

bool TokenVocabulary::is_end(int token) const {
  return std::binary_search(end_tokens_.begin(), end_tokens_.end(), token);
}

// ---------------------------------------------------------------- TokenMask

void TokenMask::apply(float* logits, int vocab) const {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int w = 0; w * 64 < vocab; ++w) {
    const uint64_t word = bits[size_t(w)];
    if (word == ~uint64_t(0)) continue;
    const int end = std::min(vocab, (w + 1) * 64);
    for (int i = w * 64; i < end; ++i)
      if (!((word >> (i & 63)) & 1)) logits[i] = minus_inf;
  }
}

// ---------------------------------------------------------------- CompiledGrammar

size_t CompiledGrammar::VectorHash::operator()(const std::vector<int32_t>& v) const {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ v.size();
  for (int32_t x : v) h = (h ^ uint64_t(uint32_t(x))) * 0x100000001b3ull, h ^= h >> 29;
  return size_t(h);
}

CompiledGrammar::CompiledGrammar(const Grammar& g, std::shared_ptr<const TokenVocabulary> vocabulary,
                                 size_t direct_walk_share)
    : vocab_(std::move(vocabulary)), direct_walk_share_(direct_walk_share) {
  g.check();
  auto end_only = std::make_shared<TokenMask>();
  end_only->bits.assign((vocab_->size() + 63) / 64, 0);
  for (int t : vocab_->end_tokens()) set_bit(end_only->bits, t);
  end_only->allowed = vocab_->end_tokens().size();
  end_only->only_end = true;
  end_only_ = std::move(end_only);
  // Byte sets, deduplicated (by an ordered map: a scan of those seen was
  // quadratic in a grammar's distinct sets, up to a million symbols' worth).
  std::map<ByteSet, int32_t> seen;
  auto term = [&](const ByteSet& s) {
    const auto [at, fresh] = seen.try_emplace(s, int32_t(terms_.size()));
    if (fresh) terms_.push_back(s);
    return at->second;
  };
  rule_starts_.resize(g.rule_count());
  for (size_t r = 0; r < g.rule_count(); ++r)
    for (const Alternative& a : g.alternatives(int(r))) {
      rule_starts_[r].push_back(int32_t(elems_.size()));
      for (const Symbol& s : a) elems_.push_back(s.rule >= 0 ? s.rule : -2 - term(s.bytes));
      elems_.push_back(kEnd);
    }
  std::unordered_map<std::string, uint8_t> classes;  // which terms hold a class's bytes -> the class
  for (int b = 0; b < 256; ++b) {
    std::string in(terms_.size(), '0');
    for (size_t t = 0; t < terms_.size(); ++t) in[t] = terms_[t].has(uint8_t(b)) ? '1' : '0';
    byte_class_[size_t(b)] = classes.try_emplace(std::move(in), uint8_t(classes.size())).first->second;
  }
  classes_ = classes.size();
  find_repetitions(g);
  class_byte_.assign(classes_, 0);
  class_bytes_.assign(classes_, TokenVocabulary::Bytes{});
  for (int b = 255; b >= 0; --b) {
    class_byte_[byte_class_[size_t(b)]] = uint8_t(b);
    class_bytes_[byte_class_[size_t(b)]][size_t(b) >> 6] |= uint64_t(1) << (b & 63);
  }
  // The runs its larger ASCII byte sets may read (byte_run_mask), made now:
  // a new grammar's first mask waits for them, not a later one.
  for (const ByteSet& term : terms_) {
    TokenVocabulary::Bytes set{};
    int count = 0;
    for (int b = 0; b < 256; ++b)
      if (term.has(uint8_t(b))) set[size_t(b) >> 6] |= uint64_t(1) << (b & 63), ++count;
    term_bytes_.push_back(count);
    if (count >= kRunMinBytes && !set[2] && !set[3]) vocab_->byte_run(set, true);
  }
  for (const ByteForm& f : plain_char_forms()) {
    PlainForm& form = plain_forms_.emplace_back();
    for (const ByteSet& set : f) {
      std::vector<uint8_t>& reps = form.emplace_back();
      std::vector<char> seen(classes_, 0);
      for (int b = 0; b < 256; ++b)
        if (set.has(uint8_t(b)) && !seen[byte_class_[size_t(b)]]) {
          seen[byte_class_[size_t(b)]] = 1;
          reps.push_back(uint8_t(b));
        }
    }
  }
  stacks_.push_back(Stack{kEnd, 0, 0});  // the empty stack
  closures_.push_back({0});
  closed_.push_back(1);
  stacks_.push_back(Stack{kEnd, 0, 0});  // kBottom: a frame's floor
  closures_.push_back({kBottom});
  closed_.push_back(1);
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<int32_t> first;
  for (int32_t a : rule_starts_[0]) {
    if (elems_[size_t(a)] == kEnd) {
      first.push_back(0);
      continue;
    }
    const int32_t s = push(0, a);
    if (s < 0) continue;
    const auto& c = closure(s);
    first.insert(first.end(), c.begin(), c.end());
  }
  start_ = intern(first);
  if (start_ < 0) throw GrammarError("grammar: the root matches no text");
}

int32_t CompiledGrammar::push(int32_t parent, int32_t pos) {
  const int32_t depth = stacks_[size_t(parent)].depth + 1;
  if (depth > kMaxStackDepth) return -1;
  const uint64_t key = (uint64_t(uint32_t(pos)) << 32) | uint32_t(parent);
  if (auto it = stack_index_.find(key); it != stack_index_.end()) return it->second;
  // (checked before the index names the new stack: a refused one must not
  // stay in it, pointing past the end, for the next request to find)
  if (stacks_.size() >= kMaxStacks) throw GrammarError("grammar: more than " + std::to_string(kMaxStacks) + " parse stacks");
  const int32_t id = int32_t(stacks_.size());
  stacks_.push_back(Stack{pos, parent, depth});
  closures_.emplace_back();
  closed_.push_back(0);
  stack_index_.emplace(key, id);
  return id;
}

// The stacks a stack stands for once every rule at its top is expanded: each
// has a byte set on top, or is the empty stack (the text may end there).
const std::vector<int32_t>& CompiledGrammar::closure(int32_t stack) {
  if (closed_[size_t(stack)]) return closures_[size_t(stack)];
  // A closure follows the symbols that may match "" one call deeper each
  // (root ::= x x x ... with x nullable): bounded, as the closures' sizes
  // are (n such symbols hold n^2 / 2 entries).
  const NestingGuard<GrammarError> nested(closure_depth_, kMaxClosureDepth, [] {
    return "grammar: more than " + std::to_string(kMaxClosureDepth) + " symbols that may match nothing in a row";
  });
  std::vector<int32_t> out;
  const Stack s = stacks_[size_t(stack)];
  const int32_t sym = elems_[size_t(s.pos)];
  if (sym <= -2) {
    out.push_back(stack);
  } else {
    // The rule's alternatives, on top of what follows it here.
    int32_t rest = s.parent;
    if (elems_[size_t(s.pos) + 1] != kEnd) rest = push(s.parent, s.pos + 1);
    if (rest >= 0) {
      for (int32_t a : rule_starts_[size_t(sym)]) {
        const int32_t top = elems_[size_t(a)] == kEnd ? rest : push(rest, a);
        if (top < 0) continue;
        const std::vector<int32_t> more = closure(top);  // (a copy: closure may grow closures_)
        out.insert(out.end(), more.begin(), more.end());
      }
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  closure_entries_ += out.size();
  if (closure_entries_ > kMaxClosureEntries)
    throw GrammarError("grammar: its parse stacks' closures pass " + std::to_string(kMaxClosureEntries) + " entries");
  closures_[size_t(stack)] = std::move(out);
  closed_[size_t(stack)] = 1;
  return closures_[size_t(stack)];
}

int32_t CompiledGrammar::intern(std::vector<int32_t>& stacks) {
  if (stacks.empty()) return -1;
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
  auto it = state_index_.find(stacks);
  if (it != state_index_.end()) return it->second;
  if (states_.size() >= kMaxStates) throw GrammarError("grammar: more than " + std::to_string(kMaxStates) + " parse states");
  const int32_t id = int32_t(states_.size());
  const bool bottom = (stacks[0] == kBottom) || (stacks.size() > 1 && stacks[0] == 0 && stacks[1] == kBottom);
  states_.push_back(State{stacks, nullptr, nullptr, bottom});
  state_index_.emplace(stacks, id);
  return id;
}

int32_t CompiledGrammar::next_locked(int32_t state, uint8_t byte) {
  int32_t* memo = transitions(state);
  const uint8_t cls = byte_class_[byte];
  if (memo[cls] != -2) return memo[cls];
  std::vector<int32_t>& out = next_stacks_;
  out.clear();
  for (int32_t id : states_[size_t(state)].stacks) {  // (push and closure leave states_ be)
    if (id == 0 || id == kBottom) continue;
    const Stack s = stacks_[size_t(id)];
    if (!terms_[size_t(-2 - elems_[size_t(s.pos)])].has(byte)) continue;
    const int32_t after = elems_[size_t(s.pos) + 1] == kEnd ? s.parent : push(s.parent, s.pos + 1);
    if (after < 0) continue;
    const auto& c = closure(after);
    out.insert(out.end(), c.begin(), c.end());
  }
  const int32_t result = intern(out);
  memo[cls] = result;
  // Every class the same stacks read leads there too (a string's letters
  // split into classes by the grammar's literals: one transition for all).
  const std::vector<int32_t>& stacks = states_[size_t(state)].stacks;
  if (stacks.size() <= 64) {
    auto readers = [&](uint8_t b) {
      uint64_t read = 0;
      for (size_t i = 0; i < stacks.size(); ++i) {
        const int32_t id = stacks[i];
        if (id != 0 && id != kBottom && terms_[size_t(-2 - elems_[size_t(stacks_[size_t(id)].pos)])].has(b))
          read |= uint64_t(1) << i;
      }
      return read;
    };
    const uint64_t these = readers(byte);
    for (size_t c = 0; c < classes_; ++c)
      if (memo[c] == -2 && readers(class_byte_[c]) == these) memo[c] = result;
  }
  return result;
}

int CompiledGrammar::next(int state, uint8_t byte) {
  if (state < 0) return -1;
  std::lock_guard<std::mutex> lock(mutex_);
  return next_locked(state, byte);
}

int CompiledGrammar::next_token(int state, int token) {
  if (state < 0 || token < 0 || size_t(token) >= vocab_->size()) return -1;
  const std::string& bytes = vocab_->bytes(token);
  if (bytes.empty() || vocab_->is_end(token)) return -1;
  std::lock_guard<std::mutex> lock(mutex_);
  return next_token_locked(state, token);
}

int32_t CompiledGrammar::next_token_locked(int32_t state, int token) {
  for (char c : vocab_->bytes(token)) {
    state = next_locked(state, uint8_t(c));
    if (state < 0) return -1;
  }
  return state;
}

bool CompiledGrammar::accepting(int state) {
  if (state < 0) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  const auto& s = states_[size_t(state)].stacks;
  return !s.empty() && s.front() == 0;
}

size_t CompiledGrammar::states() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return states_.size();
}

size_t CompiledGrammar::stacks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stacks_.size();
}

size_t CompiledGrammar::closure_entries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return closure_entries_;
}

std::shared_ptr<const TokenMask> CompiledGrammar::mask(int state) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = masks_.find(state);
  if (it != masks_.end()) return it->second;
  auto m = compute_mask(state);
  if (masks_.size() >= kMaxCachedMasks) masks_.clear();
  masks_.emplace(state, m);
  return m;
}

bool CompiledGrammar::walk_tree(int32_t state, std::vector<uint64_t>& reached, std::vector<uint64_t>* below,
                                size_t undecided_limit, int skip_depth, uint32_t root, size_t max_visits,
                                const TokenVocabulary::Trie* trie) {
  const TokenVocabulary& v = *vocab_;
  // A run of plain characters: its plain tokens at once, the others walked.
  if (!trie && !has_bottom(state) && root == 0) {
    const int32_t plain = plain_reach(state);
    if (plain == kFar) v.allow_plain(reached);
    else if (plain != kNotPlain) v.allow_plain_up_to(plain, reached);
    if (plain != kNotPlain) trie = plain == kPlainLong ? &v.rest_long_ : &v.rest_;
  }
  if (!trie) trie = &v.all_;
  const TokenVocabulary::Node* nodes = trie->nodes.data();
  const int32_t* tokens = trie->tokens.data();
  // The tree in preorder, the state after each depth's byte alongside (and
  // its memo row, stable while states_ grows): a node whose byte has no
  // next state is skipped with its subtree. marked_to: the nodes below the
  // last one that marked its tokens `below`; undecided: the tokens so far
  // marked below and not reached (a frame past `undecided_limit` of them is
  // not worth finishing).
  struct At {
    int32_t state;
    const int32_t* row;
  };
  std::vector<At> at_depth(size_t(nodes[0].max_depth) + 1);
  at_depth[nodes[root].depth] = {state, transitions(state)};
  uint32_t marked_to = 0;
  size_t undecided = 0;
  const uint32_t count = nodes[root].subtree_end;
  uint32_t n = root + 1;
  if (below && has_bottom(state)) {
    for (uint32_t t = 0; t < nodes[0].subtree_tokens_end; ++t) set_bit(*below, tokens[t]);
    marked_to = count;
  }
  size_t visits = 0;
  while (n < count) {
    if (++visits > max_visits) return false;
    const TokenVocabulary::Node& node = nodes[n];
    if (node.max_depth <= skip_depth) {
      n = node.subtree_end;
      continue;
    }
    const At& from = at_depth[node.depth - 1u];
    int32_t at = from.row[byte_class_[node.byte]];
    if (at == -2) at = next_locked(from.state, node.byte);
    if (at < 0) {
      if (n < marked_to && (undecided += node.subtree_tokens_end - node.first_token) > undecided_limit) return false;
      n = node.subtree_end;
      continue;
    }
    for (uint32_t t = node.first_token; t < node.first_token + node.tokens; ++t) set_bit(reached, tokens[t]);
    const uint32_t first_below = node.first_token + node.tokens;
    if (node.subtree_end == n + 1) {  // a leaf
      ++n;
      continue;
    }
    if (below && n >= marked_to && has_bottom(at)) {  // the tokens under here may read past the frame
      for (uint32_t t = first_below; t < node.subtree_tokens_end; ++t) set_bit(*below, tokens[t]);
      marked_to = node.subtree_end;
    }
    // Every byte below leads one way at each depth (a string's characters):
    // the tokens below as deep as that way goes are read, without a step
    // down the tree.
    if (node.subtree_tokens_end - first_below >= kUniformMinTokens) {
      const UniformRun run = uniform_run(at, *trie, n);
      const int deepest = node.max_depth - node.depth;
      const bool mark_below = below && n >= marked_to && run.bottom < deepest;
      if (run.depth >= deepest && !mark_below) {
        for (uint32_t t = first_below; t < node.subtree_tokens_end; ++t) set_bit(reached, tokens[t]);
        n = node.subtree_end;
        continue;
      }
      if (run.depth >= 0) {
        const bool inside = n < marked_to;  // below already
        for (uint32_t d = n + 1; d < node.subtree_end; ++d) {
          if (nodes[d].max_depth <= skip_depth) {
            d = nodes[d].subtree_end - 1;
            continue;
          }
          const int depth = nodes[d].depth - node.depth;
          const bool past = mark_below && depth > run.bottom;
          if (depth <= run.depth) {  // read
            for (uint32_t t = nodes[d].first_token; t < nodes[d].first_token + nodes[d].tokens; ++t) {
              set_bit(reached, tokens[t]);
              if (past) set_bit(*below, tokens[t]);
            }
            continue;
          }
          // Deeper than the run: nothing below here is read either. (With
          // a skip_depth there is no `below`: nothing to count.)
          const uint32_t first = nodes[d].first_token, last = nodes[d].subtree_tokens_end;
          if (past)
            for (uint32_t t = first; t < last; ++t) set_bit(*below, tokens[t]);
          if (inside || past) undecided += last - first;
          d = nodes[d].subtree_end - 1;
        }
        if (undecided > undecided_limit) return false;
        n = node.subtree_end;
        continue;
      }
    }
    at_depth[node.depth] = {at, transitions(at)};
    ++n;
  }
  return true;
}

int32_t* CompiledGrammar::transitions(int32_t state) {
  State& st = states_[size_t(state)];
  if (!st.next) {
    constexpr size_t kChunk = size_t(1) << 16;
    if (row_chunks_.empty() || row_chunk_used_ + classes_ > kChunk) {
      row_chunks_.push_back(std::unique_ptr<int32_t[]>(new int32_t[kChunk]));  // (each row is filled as it is carved)
      row_chunk_used_ = 0;
    }
    st.next = row_chunks_.back().get() + row_chunk_used_;
    row_chunk_used_ += classes_;
    std::fill(st.next, st.next + classes_, -2);
  }
  return st.next;
}

namespace {
using Bytes = TokenVocabulary::Bytes;
bool subset(const Bytes& a, const Bytes& b) { return !(a[0] & ~b[0]) && !(a[1] & ~b[1]) && !(a[2] & ~b[2]) && !(a[3] & ~b[3]); }
bool meet(const Bytes& a, const Bytes& b) { return (a[0] & b[0]) || (a[1] & b[1]) || (a[2] & b[2]) || (a[3] & b[3]); }
}  // namespace

// Each byte is asked once per state (a memo read after the first of its
// class); the state's bytes kept grouped by where they lead.
int32_t CompiledGrammar::uniform_next(int32_t state, const Bytes& bytes) {
  Uniform* u = states_[size_t(state)].uniform.get();
  if (!u) u = (states_[size_t(state)].uniform = std::make_unique<Uniform>()).get();  // (stable while states_ grows)
  for (size_t w = 0; w < 4; ++w)
    for (uint64_t open = bytes[w] & ~u->known[w]; open; open &= open - 1) {
      const uint64_t bit = open & -open;
      const int32_t next = next_locked(state, uint8_t(w * 64 + size_t(__builtin_ctzll(open))));
      u->known[w] |= bit;
      if (next < 0) {
        u->dead[w] |= bit;
        continue;
      }
      auto way = std::find_if(u->ways.begin(), u->ways.end(), [&](const auto& x) { return x.first == next; });
      if (way == u->ways.end()) way = u->ways.insert(u->ways.end(), {next, Bytes{}});
      way->second[w] |= bit;
    }
  if (subset(bytes, u->dead)) return -1;
  for (const auto& [next, to] : u->ways)
    if (meet(bytes, to)) return subset(bytes, to) ? next : -3;
  return -3;
}

CompiledGrammar::UniformRun CompiledGrammar::uniform_run(int32_t state, const TokenVocabulary::Trie& trie,
                                                         uint32_t node) {
  const TokenVocabulary::Node& n = trie.nodes[node];
  const Bytes& bytes = trie.subtree_bytes[node];
  const int deepest = n.max_depth - n.depth;
  UniformRun run;
  run.depth = 0;
  for (int32_t at = state; run.depth < deepest;) {
    const int32_t next = uniform_next(at, bytes);
    if (next == -3) return UniformRun{};
    if (next == -1) break;
    ++run.depth;  // the nodes this deep below are reached in `next`
    if (run.bottom == kNoBottom && has_bottom(next)) run.bottom = run.depth;
    if (next == at) {  // a loop: as deep as the tree goes
      run.depth = deepest;
      break;
    }
    at = next;
  }
  return run;
}

// One plain character from `state`: asked first as one byte sequence per
// form (most states part or die there), then every class of every form's
// bytes (one byte stands for its class: plain_forms_).
int32_t CompiledGrammar::plain_step(int32_t state) {
  if (states_[size_t(state)].plain_next != kPlainUnknown) return states_[size_t(state)].plain_next;
  // A state of a bounded repetition reads a character as every state of its
  // shape does while both stand a character or more from their bounds
  // (kShapeLongTokens: they read the same texts that short, into states of
  // one shape again): the first such state is checked form by form, the
  // others read one form's bytes.
  std::vector<int32_t> key;
  const int32_t reach = state_shape(state, key);
  const bool by_shape = reach != kFar && reach >= kCharBytes;
  if (by_shape) {
    auto it = plain_shapes_.find(key);
    if (it != plain_shapes_.end()) {
      if (it->second != kPlainOne) return states_[size_t(state)].plain_next = it->second;
      int32_t next = state;
      for (const std::vector<uint8_t>& classes : plain_forms_.front())
        if ((next = next_locked(next, classes.front())) < 0) break;
      if (next >= 0 && !has_bottom(next)) return states_[size_t(state)].plain_next = next;
      // (else a state unlike its shape's: checked below)
    }
  }
  const int32_t next = plain_step_checked(state);
  if (by_shape) {
    if (plain_shapes_.size() >= kMaxCachedMasks) plain_shapes_.clear();
    plain_shapes_.emplace(std::move(key), next >= 0 ? kPlainOne : next);
  }
  return states_[size_t(state)].plain_next = next;
}

int32_t CompiledGrammar::plain_step_checked(int32_t state) {
  int32_t one = -2;  // the live state the forms' first sequences reach (-2: none yet)
  bool died = false;
  for (const PlainForm& f : plain_forms_) {
    int32_t s = state;
    for (const std::vector<uint8_t>& classes : f)
      if ((s = next_locked(s, classes.front())) < 0) break;
    if ((s < 0 && one != -2) || (s >= 0 && (died || (one != -2 && s != one)))) return kPlainParted;
    if (s < 0) died = true;
    else one = s;
  }
  if (died) {  // every one: unless some other byte reads on, no character at all
    for (const PlainForm& f : plain_forms_) {
      Bytes first{};  // (one byte of each class of the form's first position)
      for (uint8_t b : f[0]) first[b >> 6] |= uint64_t(1) << (b & 63);
      if (uniform_next(state, first) != -1) return kPlainParted;
    }
    return kPlainNone;
  }
  // Every byte of every form into that state, through states with no bottom.
  for (const PlainForm& f : plain_forms_)
    if (!form_leads(f, 0, state, one)) return kPlainParted;
  return one;
}

// Each class of each byte on its own way: a grammar may spell a character's
// first bytes apart (GBNF's and regular expressions' classes do).
bool CompiledGrammar::form_leads(const PlainForm& f, size_t i, int32_t from, int32_t to) {
  if (i == f.size()) return from == to;
  for (uint8_t b : f[i]) {
    const int32_t next = next_locked(from, b);
    if (next < 0 || has_bottom(next) || !form_leads(f, i + 1, next, to)) return false;
  }
  return true;
}

int32_t CompiledGrammar::plain_reach(int32_t state) {
  if (states_[size_t(state)].plain != kPlainUnknown) return states_[size_t(state)].plain;
  int32_t reach = kNotPlain;
  for (int32_t at = state, chars = 0;; ++chars) {
    if (chars >= vocab_->max_plain_chars()) {  // as far as any token goes
      reach = kFar;
      break;
    }
    if (chars >= TokenVocabulary::kPlainMasks) {  // far enough: longer tokens are walked
      reach = kPlainLong;
      break;
    }
    const int32_t next = plain_step(at);
    if (next == kPlainNone) reach = chars == 0 ? kNotPlain : chars;
    if (next < 0) break;
    if (next == at) {  // a loop: any number
      reach = kFar;
      break;
    }
    at = next;
  }
  return states_[size_t(state)].plain = reach;
}

// The ASCII form's classes by where they lead: the one taking the most
// bytes, and the few others as `except`; every other form must lead there
// too, through states with no bottom.
int32_t CompiledGrammar::plain_but(int32_t state, TokenVocabulary::Bytes& except) {
  except = {};
  const std::vector<uint8_t>& ascii = plain_forms_.front().front();
  std::vector<std::pair<int32_t, size_t>> ways;  // next state, bytes
  for (uint8_t b : ascii) {
    const int32_t next = next_locked(state, b);
    auto way = std::find_if(ways.begin(), ways.end(), [&](const auto& w) { return w.first == next; });
    if (way == ways.end()) way = ways.insert(ways.end(), {next, 0});
    way->second += bits_in(class_bytes_[byte_class_[b]][0]) + bits_in(class_bytes_[byte_class_[b]][1]);
  }
  const auto most = std::max_element(ways.begin(), ways.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  const int32_t to = most->first;
  if (to < 0 || has_bottom(to)) return -1;
  const ByteSet& form = plain_char_forms().front().front();
  size_t excepted = 0;
  for (uint8_t b : ascii) {
    if (next_locked(state, b) == to) continue;
    for (int x = 0; x < 128; ++x)
      if (byte_class_[size_t(x)] == byte_class_[b] && form.has(uint8_t(x))) {
        except[size_t(x) >> 6] |= uint64_t(1) << (x & 63);
        ++excepted;
      }
  }
  if (excepted > kPlainButMost) return -1;
  for (size_t f = 1; f < plain_forms_.size(); ++f)
    if (!form_leads(plain_forms_[f], 0, state, to)) return -1;
  return to;
}

bool CompiledGrammar::plain_but_mask(int32_t state, std::vector<uint64_t>& bits) {
  if (!reads_many(state)) return false;
  TokenVocabulary::Bytes except;
  const int32_t to = plain_but(state, except);
  if (to < 0 || plain_reach(to) != kFar) return false;
  const TokenVocabulary& v = *vocab_;
  v.allow_plain(bits);
  // The branches of the excepted bytes: every token of theirs walked from
  // where the byte leads.
  for (size_t w = 0; w < 2; ++w)
    for (uint64_t open = except[w]; open; open &= open - 1) {
      const uint8_t b = uint8_t(w * 64 + size_t(__builtin_ctzll(open)));
      const uint32_t node = v.branch(b);
      if (!node) continue;
      const TokenVocabulary::Node& branch = v.all_.nodes[node];
      for (uint32_t t = branch.first_token; t < branch.subtree_tokens_end; ++t) clear_bit(bits, v.all_.tokens[t]);
      const int32_t next = next_locked(state, b);
      if (next < 0) continue;
      for (uint32_t t = branch.first_token; t < branch.first_token + branch.tokens; ++t) set_bit(bits, v.all_.tokens[t]);
      walk_tree(next, bits, nullptr, 0, 0, node);
    }
  // The tokens that are not plain, walked from the state.
  walk_tree(state, bits, nullptr, 0, 0, 0, SIZE_MAX, &v.rest_);
  return true;
}

bool CompiledGrammar::has_bottom(int32_t state) const { return states_[size_t(state)].bottom; }

// The stack cut to its top `depth` entries over kBottom (itself when it is
// no deeper).
int32_t CompiledGrammar::cut(int32_t stack, int depth) {
  if (stacks_[size_t(stack)].depth <= depth) return stack;
  int32_t top[kFrameDepths.back()];
  int32_t at = stack;
  for (int k = 0; k < depth; ++k, at = stacks_[size_t(at)].parent) top[k] = stacks_[size_t(at)].pos;
  int32_t rebuilt = kBottom;
  for (int k = depth; k-- > 0;) rebuilt = push(rebuilt, top[k]);
  return rebuilt;
}

void CompiledGrammar::Frame::allow(std::vector<uint64_t>& bits) const {
  if (!accepted_bits.empty())
    for (size_t w = 0; w < bits.size(); ++w) bits[w] |= accepted_bits[w];
  for (int32_t t : accepted_tokens) set_bit(bits, t);
}

const CompiledGrammar::Frame& CompiledGrammar::frame(int32_t frame_state, size_t undecided_limit) {
  auto it = frames_.find(frame_state);
  if (it != frames_.end()) return *it->second;
  if (frames_.size() >= kMaxCachedMasks) frames_.clear();
  auto f = std::make_unique<Frame>();
  const size_t words = (vocab_->size() + 63) / 64;
  std::vector<uint64_t>& accepted = walk_accepted_;
  std::vector<uint64_t>& below = walk_below_;
  accepted.resize(words, 0);
  below.resize(words, 0);
  if (!walk_tree(frame_state, accepted, &below, undecided_limit)) {
    std::fill(accepted.begin(), accepted.end(), 0);
    std::fill(below.begin(), below.end(), 0);
    f->complete = false;
    return *frames_.emplace(frame_state, std::move(f)).first->second;
  }
  size_t count = 0;
  for (size_t w = 0; w < words; ++w) {
    if (accepted[w]) count += bits_in(accepted[w]);
    for (uint64_t open = below[w] & ~accepted[w]; open; open &= open - 1)
      f->undecided.push_back(int32_t(w * 64 + size_t(__builtin_ctzll(open))));
    below[w] = 0;
  }
  if (count > words) {
    f->accepted_bits = accepted;
    std::fill(accepted.begin(), accepted.end(), 0);
  } else {
    f->accepted_tokens.reserve(count);
    for (size_t w = 0; w < words; ++w) {
      for (uint64_t open = accepted[w]; open; open &= open - 1)
        f->accepted_tokens.push_back(int32_t(w * 64 + size_t(__builtin_ctzll(open))));
      accepted[w] = 0;
    }
  }
  return *frames_.emplace(frame_state, std::move(f)).first->second;
}

// The shallowest usable frame of some stacks cut together: a string's
// characters are decided by the few entries of its loop, whatever the
// string is nested in. -1: none (the stacks are deep and no cut of them
// decides enough).
int32_t CompiledGrammar::choose_frame(const std::vector<int32_t>& stacks) {
  int32_t chosen = -1;
  size_t fewest = vocab_->size() / kFrameFallback + 1;  // undecided tokens of `chosen`
  std::vector<int32_t> cuts;
  for (int depth : kFrameDepths) {
    cuts.clear();
    bool whole = true;
    for (int32_t stack : stacks) {
      cuts.push_back(cut(stack, depth));
      whole = whole && cuts.back() == stack;
    }
    const int32_t frame_state = intern(cuts);
    const Frame& f = frame(frame_state, fewest);
    const size_t undecided = f.undecided.size();
    if (f.complete && undecided < fewest) {
      chosen = frame_state;
      fewest = undecided;
    }
    // (stacks kept whole leave nothing undecided: nothing reads past them)
    if (whole || fewest * kFrameFew <= vocab_->size()) break;
  }
  return chosen;
}

int32_t CompiledGrammar::stack_frame(int32_t stack) {
  auto it = stack_frames_.find(stack);
  if (it != stack_frames_.end()) return it->second;
  const int32_t chosen = choose_frame({stack});
  if (stack_frames_.size() >= kMaxCachedMasks * 64) stack_frames_.clear();
  stack_frames_.emplace(stack, chosen);
  return chosen;
}

// A state's tokens are the union of its stacks' (a token is read from a set
// of stacks when it is read from one of them). Its stacks cut together
// decide most in one walk (a string's body: a stack per kind of character,
// which together read a run of plain characters; an object's keys: a stack
// per key); failing that each stack's own frame does. The tokens a frame
// leaves undecided are read from the state itself.
void CompiledGrammar::frame_mask(int32_t state, std::vector<uint64_t>& bits) {
  std::vector<int32_t> stacks = states_[size_t(state)].stacks;  // (interning may move states_)
  if (!stacks.empty() && stacks[0] == 0) stacks.erase(stacks.begin());  // the text may end here: the end tokens, below
  const int32_t together = stacks.size() > 1 ? choose_frame(stacks) : -1;
  if (together >= 0) {
    const Frame& f = frame(together, vocab_->size());
    f.allow(bits);
    read_undecided(state, f.undecided, bits);
    return;
  }
  std::vector<int32_t> undecided;
  for (int32_t stack : stacks) {
    const int32_t frame_state = stack_frame(stack);
    if (frame_state < 0) {
      std::fill(bits.begin(), bits.end(), 0);
      walk_tree(state, bits, nullptr, 0);
      return;
    }
    const Frame& f = frame(frame_state, vocab_->size());  // (valid until the next frame())
    f.allow(bits);
    undecided.insert(undecided.end(), f.undecided.begin(), f.undecided.end());
  }
  read_undecided(state, undecided, bits);
}

void CompiledGrammar::read_undecided(int32_t state, const std::vector<int32_t>& undecided, std::vector<uint64_t>& bits) {
  for (int32_t t : undecided)
    if (!has_token(bits, t) && next_token_locked(state, t) >= 0) set_bit(bits, t);
}

bool CompiledGrammar::reads_many(int32_t state) const {
  const std::vector<int32_t>& stacks = states_[size_t(state)].stacks;
  return std::any_of(stacks.begin(), stacks.end(), [&](int32_t id) {
    return id != 0 && id != kBottom && term_bytes_[size_t(-2 - elems_[size_t(stacks_[size_t(id)].pos)])] >= kRunMinBytes;
  });
}

bool CompiledGrammar::byte_run_mask(int32_t state, std::vector<uint64_t>& bits) {
  using Bytes = TokenVocabulary::Bytes;
  if (!reads_many(state)) return false;
  // The set: the most bytes that lead `state` one way (every byte asked,
  // so the state's Uniform holds them all by where they lead).
  const Bytes every = {~uint64_t(0), ~uint64_t(0), ~uint64_t(0), ~uint64_t(0)};
  uniform_next(state, every);
  auto count = [](const Bytes& b) { return bits_in(b[0]) + bits_in(b[1]) + bits_in(b[2]) + bits_in(b[3]); };
  const auto& ways = states_[size_t(state)].uniform->ways;
  const auto most = std::max_element(ways.begin(), ways.end(), [&](const auto& a, const auto& b) { return count(a.second) < count(b.second); });
  if (most == ways.end() || count(most->second) < size_t(kRunMinBytes)) return false;
  const auto [first, set] = *most;
  if (set[2] || set[3]) return false;  // (ASCII: a UTF-8 byte leads on to a byte of another set)
  // at[j]: the state after j bytes of the set. The run ends in a loop
  // (every later byte of the set too), where the set dies, or at kRunDepth
  // (open: the tokens past it are read one by one); where the set's bytes
  // part sooner, no run.
  std::vector<int32_t> at = {state};
  enum { kOpen, kLoops, kDies } end = kOpen;
  for (int32_t next = first; int(at.size()) <= TokenVocabulary::kRunDepth;) {
    if (next == at.back()) {
      end = kLoops;
      break;
    }
    if (next == -1) {
      end = kDies;
      break;
    }
    if (next == -3) return false;
    at.push_back(next);
    next = uniform_next(next, set);
  }
  const auto run = vocab_->byte_run(set, true);
  const TokenVocabulary::Trie& trie = vocab_->all_;
  const size_t known = at.size() - 1;
  auto later = std::partition_point(run->groups.begin(), run->groups.end(),
                                    [&](const TokenVocabulary::ByteRun::Group& g) { return g.at <= known; });
  // The tokens under the branches past an open end, and the far ones, are
  // read one by one: at most kRunReadLimit.
  std::vector<uint32_t> one_by_one = run->far;
  if (end == kOpen)
    for (auto g = later; g != run->groups.end(); ++g) one_by_one.insert(one_by_one.end(), run->branches.begin() + g->begin, run->branches.begin() + g->end);
  size_t reads = end == kOpen ? run->alone_longer.size() : 0;
  for (uint32_t b : one_by_one) reads += trie.nodes[b].subtree_tokens_end - trie.nodes[b].first_token;
  if (reads > kRunReadLimit) return false;
  auto read = [&](int32_t t) {
    if (next_token_locked(state, t) >= 0) set_bit(bits, t);
  };
  // Tokens of the set alone: as deep as the run reads.
  const std::vector<uint64_t>& alone = run->alone_bits[end == kLoops ? size_t(TokenVocabulary::kRunDepth) : known];
  for (size_t w = 0; w < bits.size(); ++w) bits[w] |= alone[w];
  for (int32_t t : run->alone_longer) {
    if (end == kLoops) set_bit(bits, t);
    else if (end == kOpen) read(t);
  }
  // The others: each live group's branches walked from the state its byte
  // leads to, after the bytes of the set before it.
  for (auto g = run->groups.begin(); g != run->groups.end(); ++g) {
    if (g >= later && end != kLoops) break;
    const int32_t next = next_locked(at[std::min(size_t(g->at), known)], g->byte);
    if (next < 0) continue;
    for (uint32_t i = g->begin; i < g->end; ++i) {
      const TokenVocabulary::Node& branch = trie.nodes[run->branches[i]];
      for (uint32_t t = branch.first_token; t < branch.first_token + branch.tokens; ++t) set_bit(bits, trie.tokens[t]);
      walk_tree(next, bits, nullptr, 0, 0, run->branches[i]);
    }
  }
  for (uint32_t b : one_by_one)
    for (uint32_t t = trie.nodes[b].first_token; t < trie.nodes[b].subtree_tokens_end; ++t) read(trie.tokens[t]);
  return true;
}

// The first way that applies: a state of a bounded repetition takes the
// tokens of one of its shape further from the bound (kShapeLongTokens) and
// walks the longer ones; a state that reads a bounded run of plain
// characters (a string with a maxLength) walks the tree itself, its plain
// tokens taken at once (a frame would be no help: a cut through a chain's
// links is a frame of its own at every count); one that reads plain
// characters but a few into an endless run takes them at once too
// (plain_but_mask); one that reads a run of one byte class takes its
// ByteRun's groups (byte_run_mask); any other walks the tree itself if that
// is short (kDirectWalkShare), else takes its frames'.
std::shared_ptr<const TokenMask> CompiledGrammar::compute_mask(int32_t state) {
  const TokenVocabulary& v = *vocab_;
  auto m = std::make_shared<TokenMask>();
  const size_t words = (v.size() + 63) / 64;
  const std::vector<int32_t> stacks = states_[size_t(state)].stacks;  // (interning may move states_)
  std::vector<int32_t> key;
  const int32_t reach = state_shape(state, key);
  ShapeMask* same = nullptr;
  if (reach != kFar) {
    auto it = shape_masks_.find(key);
    if (it != shape_masks_.end()) same = &it->second;
  }
  const int32_t common = same ? std::min(reach, same->reach) : 0;
  const size_t longer = same ? v.longer_than(size_t(common)) : 0;
  const int32_t plain = plain_reach(state);
  m->bits.assign(words, 0);
  if (same && longer * kShapeLongTokens <= v.size()) {
    m->bits = same->mask->bits;
    for (int t : v.end_tokens()) clear_bit(m->bits, t);
    for (size_t i = 0; i < longer; ++i) {
      const int32_t t = v.by_length_[i];
      clear_bit(m->bits, t);
    }
    walk_tree(state, m->bits, nullptr, 0, common);
  } else if (plain != kNotPlain && plain != kFar) {
    walk_tree(state, m->bits, nullptr, 0);
  } else if (plain == kNotPlain && plain_but_mask(state, m->bits)) {
  } else if (plain == kNotPlain && byte_run_mask(state, m->bits)) {
  } else if (!direct_walk_share_ || !walk_tree(state, m->bits, nullptr, 0, 0, 0, v.trie_nodes() / direct_walk_share_)) {
    std::fill(m->bits.begin(), m->bits.end(), 0);
    frame_mask(state, m->bits);
  }
  size_t text_tokens = 0;
  for (uint64_t w : m->bits)
    if (w) text_tokens += bits_in(w);
  const bool can_end = !stacks.empty() && stacks.front() == 0;
  if (can_end)
    for (int t : v.end_tokens()) set_bit(m->bits, t);
  m->allowed = text_tokens + (can_end ? v.end_tokens().size() : 0);
  m->only_end = can_end && text_tokens == 0;
  if (reach != kFar && (!same || reach > same->reach)) {
    if (!same && shape_masks_.size() >= kMaxCachedMasks) shape_masks_.clear();
    shape_masks_[key] = ShapeMask{reach, m};
  }
  return m;
}

// The links of bounded repetitions: a rule of two alternatives, A and "",
// is a chain's first link (L1) with body A; one of A' L and "", where L is a
// link with body A', the next. A body that may read nothing is no chain (a
// link would decide nothing sooner).
void CompiledGrammar::find_repetitions(const Grammar& g) {
  const size_t n = g.rule_count();
  const std::vector<char> nullable = g.nullable_rules();
  auto same = [](const Symbol& a, const Symbol& b) { return a.rule == b.rule && (a.rule >= 0 || a.bytes == b.bytes); };
  // Per rule: its link number (0: none, -1: being found) and which
  // alternative is A..., and the body's length.
  std::vector<int> level(n, -2), which(n, -1);
  std::vector<size_t> body(n, 0);
  auto find = [&](auto&& self, size_t r) -> int {
    if (level[r] != -2) return std::max(level[r], 0);
    level[r] = -1;
    int found = 0;
    const auto& alts = g.alternatives(int(r));
    if (alts.size() == 2 && (alts[0].empty() != alts[1].empty())) {
      const int w = alts[0].empty() ? 1 : 0;
      const Alternative& a = alts[size_t(w)];
      which[r] = w;
      found = 1;
      body[r] = a.size();
      const Symbol& last = a.back();
      if (a.size() >= 2 && last.rule >= 0 && size_t(last.rule) != r) {
        const size_t p = size_t(last.rule);
        const int below = self(self, p);
        if (below > 0 && body[p] == a.size() - 1) {
          const Alternative& pa = g.alternatives(int(p))[size_t(which[p])];
          if (std::equal(a.begin(), a.end() - 1, pa.begin(), [&](const Symbol& x, const Symbol& y) { return same(x, y); })) {
            found = below + 1;
            body[r] = body[p];
          }
        }
      }
      // A body that may read nothing.
      if (std::all_of(a.begin(), a.begin() + long(body[r]),
                      [&](const Symbol& s) { return s.rule >= 0 && nullable[size_t(s.rule)]; }))
        found = 0;
    }
    level[r] = found;
    return found;
  };
  shape_pos_.resize(elems_.size());
  std::iota(shape_pos_.begin(), shape_pos_.end(), 0);
  pos_reach_.assign(elems_.size(), kFar);
  std::vector<std::pair<Alternative, int32_t>> firsts;  // per body: the first link's alternative's start
  for (size_t r = 0; r < n; ++r) {
    const int k = find(find, r);
    if (k < 2) continue;
    const Alternative& a = g.alternatives(int(r))[size_t(which[r])];
    const int32_t start = rule_starts_[r][size_t(which[r])];
    int32_t first = start;
    bool known = false;
    for (const auto& [b, at] : firsts)
      if (b.size() == a.size() - 1 &&
          std::equal(b.begin(), b.end(), a.begin(), [&](const Symbol& x, const Symbol& y) { return same(x, y); })) {
        first = at;
        known = true;
        break;
      }
    if (!known) firsts.push_back({Alternative(a.begin(), a.end() - 1), start});
    for (size_t j = 0; j < a.size(); ++j) {
      shape_pos_[size_t(start) + j] = first + int32_t(j);
      pos_reach_[size_t(start) + j] = k - 1;
    }
  }
}

int32_t CompiledGrammar::state_shape(int32_t state, std::vector<int32_t>& key) {
  key.clear();
  int32_t reach = kFar;
  for (int32_t stack : states_[size_t(state)].stacks) {
    const Shape sh = shape(stack);
    key.push_back(sh.id);
    reach = std::min(reach, sh.reach);
  }
  std::sort(key.begin(), key.end());
  key.erase(std::unique(key.begin(), key.end()), key.end());
  return reach;
}

CompiledGrammar::Shape CompiledGrammar::shape(int32_t stack) {
  if (stack_shapes_.size() < stacks_.size()) stack_shapes_.resize(stacks_.size(), Shape{-1, kFar});
  if (stack_shapes_[0].id < 0) stack_shapes_[0] = Shape{0, kFar}, stack_shapes_[kBottom] = Shape{1, kFar};
  std::vector<int32_t> path;
  for (int32_t at = stack; stack_shapes_[size_t(at)].id < 0; at = stacks_[size_t(at)].parent) path.push_back(at);
  for (size_t i = path.size(); i-- > 0;) {
    const Stack& s = stacks_[size_t(path[i])];
    const Shape parent = stack_shapes_[size_t(s.parent)];
    const uint64_t key = (uint64_t(uint32_t(shape_pos_[size_t(s.pos)])) << 32) | uint32_t(parent.id);
    const int32_t id = shape_index_.try_emplace(key, int32_t(shape_index_.size() + 2)).first->second;
    stack_shapes_[size_t(path[i])] = Shape{id, std::min(parent.reach, pos_reach_[size_t(s.pos)])};
  }
  return stack_shapes_[size_t(stack)];
}

// ---------------------------------------------------------------- Matcher

Matcher::Matcher(std::shared_ptr<CompiledGrammar> grammar) : grammar_(std::move(grammar)), state_(grammar_->start()) {}

bool Matcher::accept(int token) {
  if (grammar_->vocabulary().is_end(token)) {
    if (!ended_ && !grammar_->accepting(state_)) return false;
    ended_ = true;
    return true;
  }
  if (ended_) return false;
  const int next = grammar_->next_token(state_, token);
  if (next < 0) return false;
  state_ = next;
  return true;
}

bool Matcher::accepting() { return ended_ || grammar_->accepting(state_); }

std::shared_ptr<const TokenMask> Matcher::mask() {
  return ended_ ? grammar_->end_only_mask() : grammar_->mask(state_);
}

}  // namespace disagg::grammar
