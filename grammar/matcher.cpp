#include "grammar/matcher.h"

#include <algorithm>
#include <limits>
#include <numeric>

namespace disagg::grammar {

// ---------------------------------------------------------------- TokenVocabulary

TokenVocabulary::TokenVocabulary(std::vector<std::string> bytes, const std::vector<bool>& special,
                                 std::vector<int> end_tokens)
    : bytes_(std::move(bytes)), end_tokens_(std::move(end_tokens)) {
  std::sort(end_tokens_.begin(), end_tokens_.end());
  end_tokens_.erase(std::unique(end_tokens_.begin(), end_tokens_.end()), end_tokens_.end());
  end_tokens_.erase(std::remove_if(end_tokens_.begin(), end_tokens_.end(),
                                   [&](int t) { return t < 0 || size_t(t) >= bytes_.size(); }),
                    end_tokens_.end());
  // The prefix tree of the tokens that may appear inside a text, built from
  // them in byte order: a node's children and its tokens are contiguous.
  std::vector<int32_t> order;
  for (size_t i = 0; i < bytes_.size(); ++i)
    if (!bytes_[i].empty() && !(i < special.size() && special[i]) && !is_end(int(i))) order.push_back(int32_t(i));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bytes_[size_t(a)] != bytes_[size_t(b)] ? bytes_[size_t(a)] < bytes_[size_t(b)] : a < b;
  });
  // First the nodes as (parent, byte) in a map, then laid out breadth-first.
  struct Build {
    std::vector<std::pair<uint8_t, uint32_t>> children;
    std::vector<int32_t> tokens;
  };
  std::vector<Build> tree(1);
  for (int32_t t : order) {
    uint32_t at = 0;
    for (char c : bytes_[size_t(t)]) {
      auto& kids = tree[at].children;
      if (!kids.empty() && kids.back().first == uint8_t(c)) {
        at = kids.back().second;  // sorted input: a shared prefix is the last child
      } else {
        tree.push_back({});
        tree[at].children.push_back({uint8_t(c), uint32_t(tree.size() - 1)});
        at = uint32_t(tree.size() - 1);
      }
    }
    tree[at].tokens.push_back(t);
  }
  nodes_.resize(tree.size());
  for (size_t n = 0; n < tree.size(); ++n) {
    nodes_[n].first_edge = uint32_t(edges_.size());
    nodes_[n].edges = uint32_t(tree[n].children.size());
    for (auto& [b, child] : tree[n].children) edges_.push_back(Edge{b, child});
    nodes_[n].first_token = uint32_t(tokens_.size());
    nodes_[n].tokens = uint32_t(tree[n].tokens.size());
    tokens_.insert(tokens_.end(), tree[n].tokens.begin(), tree[n].tokens.end());
  }
  // (preorder: children have larger ids, so one backward pass)
  for (size_t n = nodes_.size(); n-- > 0;) {
    Node& node = nodes_[n];
    node.subtree_tokens_end = node.first_token + node.tokens;
    for (uint32_t e = node.first_edge; e < node.first_edge + node.edges; ++e)
      node.subtree_tokens_end = std::max(node.subtree_tokens_end, nodes_[edges_[e].child].subtree_tokens_end);
  }
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

CompiledGrammar::CompiledGrammar(const Grammar& g, std::shared_ptr<const TokenVocabulary> vocabulary)
    : vocab_(std::move(vocabulary)) {
  g.check();
  auto end_only = std::make_shared<TokenMask>();
  end_only->bits.assign((vocab_->size() + 63) / 64, 0);
  for (int t : vocab_->end_tokens()) end_only->bits[size_t(t) >> 6] |= uint64_t(1) << (t & 63);
  end_only->allowed = vocab_->end_tokens().size();
  end_only->only_end = true;
  end_only_ = std::move(end_only);
  std::vector<std::pair<ByteSet, int32_t>> seen;  // byte sets, deduplicated
  auto term = [&](const ByteSet& s) {
    for (auto& [set, id] : seen)
      if (set == s) return id;
    terms_.push_back(s);
    seen.push_back({s, int32_t(terms_.size() - 1)});
    return int32_t(terms_.size() - 1);
  };
  rule_starts_.resize(g.rule_count());
  for (size_t r = 0; r < g.rule_count(); ++r)
    for (const Alternative& a : g.alternatives(int(r))) {
      rule_starts_[r].push_back(int32_t(elems_.size()));
      for (const Symbol& s : a) elems_.push_back(s.rule >= 0 ? s.rule : -2 - term(s.bytes));
      elems_.push_back(kEnd);
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
  start_ = intern(std::move(first));
  if (start_ < 0) throw GrammarError("grammar: the root matches no text");
}

int32_t CompiledGrammar::push(int32_t parent, int32_t pos) {
  const int32_t depth = stacks_[size_t(parent)].depth + 1;
  if (depth > kMaxStackDepth) return -1;
  const uint64_t key = (uint64_t(uint32_t(pos)) << 32) | uint32_t(parent);
  auto [it, added] = stack_index_.try_emplace(key, int32_t(stacks_.size()));
  if (added) {
    if (stacks_.size() >= kMaxStacks) throw GrammarError("grammar: more than " + std::to_string(kMaxStacks) + " parse stacks");
    stacks_.push_back(Stack{pos, parent, depth});
    closures_.emplace_back();
    closed_.push_back(0);
  }
  return it->second;
}

// The stacks a stack stands for once every rule at its top is expanded: each
// has a byte set on top, or is the empty stack (the text may end there).
const std::vector<int32_t>& CompiledGrammar::closure(int32_t stack) {
  if (closed_[size_t(stack)]) return closures_[size_t(stack)];
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
  closures_[size_t(stack)] = std::move(out);
  closed_[size_t(stack)] = 1;
  return closures_[size_t(stack)];
}

int32_t CompiledGrammar::intern(std::vector<int32_t> stacks) {
  if (stacks.empty()) return -1;
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
  auto it = state_index_.find(stacks);
  if (it != state_index_.end()) return it->second;
  if (states_.size() >= kMaxStates) throw GrammarError("grammar: more than " + std::to_string(kMaxStates) + " parse states");
  const int32_t id = int32_t(states_.size());
  states_.push_back(State{stacks, nullptr});
  state_index_.emplace(std::move(stacks), id);
  return id;
}

int32_t CompiledGrammar::next_locked(int32_t state, uint8_t byte) {
  State& st = states_[size_t(state)];
  if (!st.next) {
    st.next = std::make_unique<std::array<int32_t, 256>>();
    st.next->fill(-2);
  }
  int32_t& memo = (*st.next)[byte];
  if (memo != -2) return memo;
  std::vector<int32_t> out;
  const std::vector<int32_t> stacks = st.stacks;  // (interning below may move states_)
  for (int32_t id : stacks) {
    if (id == 0 || id == kBottom) continue;
    const Stack s = stacks_[size_t(id)];
    if (!terms_[size_t(-2 - elems_[size_t(s.pos)])].has(byte)) continue;
    const int32_t after = elems_[size_t(s.pos) + 1] == kEnd ? s.parent : push(s.parent, s.pos + 1);
    if (after < 0) continue;
    const auto& c = closure(after);
    out.insert(out.end(), c.begin(), c.end());
  }
  const int32_t result = intern(std::move(out));
  (*states_[size_t(state)].next)[byte] = result;
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

std::shared_ptr<const TokenMask> CompiledGrammar::mask(int state) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = masks_.find(state);
  if (it != masks_.end()) return it->second;
  auto m = compute_mask(state);
  if (masks_.size() >= kMaxCachedMasks) masks_.clear();
  masks_.emplace(state, m);
  return m;
}

void CompiledGrammar::walk_tree(int32_t state, std::vector<uint64_t>& reached, std::vector<uint64_t>* below) {
  const TokenVocabulary& v = *vocab_;
  auto mark = [](std::vector<uint64_t>& bits, int32_t t) { bits[size_t(t) >> 6] |= uint64_t(1) << (t & 63); };
  // Depth-first down the prefix tree, the state alongside.
  std::vector<std::pair<uint32_t, int32_t>> todo{{0u, state}};
  while (!todo.empty()) {
    const auto [node, at] = todo.back();
    todo.pop_back();
    const TokenVocabulary::Node& n = v.nodes_[node];
    if (below && has_bottom(at))  // the tokens under here may read past the frame
      for (uint32_t t = n.first_token + n.tokens; t < n.subtree_tokens_end; ++t) mark(*below, v.tokens_[t]);
    for (uint32_t e = n.first_edge; e < n.first_edge + n.edges; ++e) {
      const TokenVocabulary::Edge edge = v.edges_[e];
      const int32_t after = next_locked(at, edge.byte);
      if (after < 0) continue;
      const TokenVocabulary::Node& child = v.nodes_[edge.child];
      for (uint32_t t = child.first_token; t < child.first_token + child.tokens; ++t) mark(reached, v.tokens_[t]);
      if (child.edges) todo.push_back({edge.child, after});
    }
  }
}

bool CompiledGrammar::has_bottom(int32_t state) const {
  const auto& s = states_[size_t(state)].stacks;  // sorted: 0, kBottom first
  return (!s.empty() && s[0] == kBottom) || (s.size() > 1 && s[0] == 0 && s[1] == kBottom);
}

// The state's stacks cut to their top kFrameDepth entries over kBottom (a
// stack no deeper stays whole).
int32_t CompiledGrammar::frame_of(int32_t state) {
  std::vector<int32_t> cut;
  const std::vector<int32_t> stacks = states_[size_t(state)].stacks;
  for (int32_t id : stacks) {
    if (id == 0 || stacks_[size_t(id)].depth <= kFrameDepth) {
      cut.push_back(id);
      continue;
    }
    int32_t top[kFrameDepth];
    int32_t at = id;
    for (int k = 0; k < kFrameDepth; ++k, at = stacks_[size_t(at)].parent) top[k] = stacks_[size_t(at)].pos;
    int32_t rebuilt = kBottom;
    for (int k = kFrameDepth; k-- > 0;) rebuilt = push(rebuilt, top[k]);
    cut.push_back(rebuilt);
  }
  return intern(std::move(cut));
}

const CompiledGrammar::Frame& CompiledGrammar::frame(int32_t frame_state) {
  auto it = frames_.find(frame_state);
  if (it != frames_.end()) return *it->second;
  if (frames_.size() >= kMaxCachedMasks) frames_.clear();
  auto f = std::make_unique<Frame>();
  const size_t words = (vocab_->size() + 63) / 64;
  f->accepted.assign(words, 0);
  std::vector<uint64_t> below(words, 0);
  walk_tree(frame_state, f->accepted, &below);
  for (size_t w = 0; w < words; ++w) {
    uint64_t open = below[w] & ~f->accepted[w];
    while (open) {
      f->undecided.push_back(int32_t(w * 64 + size_t(__builtin_ctzll(open))));
      open &= open - 1;
    }
  }
  f->usable = f->undecided.size() * kFrameFallback <= vocab_->size();
  return *frames_.emplace(frame_state, std::move(f)).first->second;
}

std::shared_ptr<const TokenMask> CompiledGrammar::compute_mask(int32_t state) {
  const TokenVocabulary& v = *vocab_;
  auto m = std::make_shared<TokenMask>();
  const int32_t cut = frame_of(state);
  const Frame* f = cut != state ? &frame(cut) : nullptr;
  if (f && f->usable) {
    m->bits = f->accepted;
    for (int32_t t : f->undecided)
      if (next_token_locked(state, t) >= 0) m->bits[size_t(t) >> 6] |= uint64_t(1) << (t & 63);
  } else {
    m->bits.assign((v.size() + 63) / 64, 0);
    walk_tree(state, m->bits, nullptr);
  }
  size_t text_tokens = 0;
  for (uint64_t w : m->bits) text_tokens += size_t(__builtin_popcountll(w));
  const auto& stacks = states_[size_t(state)].stacks;
  const bool can_end = !stacks.empty() && stacks.front() == 0;
  if (can_end)
    for (int t : v.end_tokens()) m->bits[size_t(t) >> 6] |= uint64_t(1) << (t & 63);
  m->allowed = text_tokens + (can_end ? v.end_tokens().size() : 0);
  m->only_end = can_end && text_tokens == 0;
  return m;
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
