// A grammar compiled for one vocabulary, and a sequence's place in it.
//
// The parse state is a set of stacks (llama.cpp's grammar, Earley-like for
// grammars without left recursion): a stack is a path of positions in the
// rules, its top the byte set to read next; reading a byte keeps the stacks
// whose top has it, each moved one symbol on and expanded until its top is a
// byte set again (a rule's end pops). Stacks are persistent lists, interned,
// and so are the sets: a state is one number, and (state, byte) -> state is
// memoised, so once seen a byte costs an array read.
//
// The mask of a state: which tokens may come next. The vocabulary's token
// bytes form a prefix tree (TokenVocabulary); a depth-first walk carries the
// state down it, a branch dies where a byte has no next state, and every
// token at a node it reaches is allowed. Tokens that are special (control,
// user-defined, unknown, unused) or have no bytes are never allowed; the end
// tokens only where the grammar may end. Masks are cached per state, so a
// state seen before costs a lookup (XGrammar and Outlines precompute per
// grammar state likewise; this one fills the cache as states appear).
//
// Thread-safe: the memo tables are behind one mutex per compiled grammar.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "grammar/grammar.h"

namespace disagg::grammar {

// The vocabulary as a grammar reads it: each token's bytes, which may appear
// inside a grammar's text, and which end a generation.
class TokenVocabulary {
 public:
  // bytes[i]: token i's text (its decoded bytes); special[i]: never inside
  // a grammar's text; end_tokens: allowed where the grammar may end.
  TokenVocabulary(std::vector<std::string> bytes, const std::vector<bool>& special, std::vector<int> end_tokens);

  size_t size() const { return bytes_.size(); }
  const std::string& bytes(int token) const { return bytes_[size_t(token)]; }
  bool is_end(int token) const;
  const std::vector<int>& end_tokens() const { return end_tokens_; }
  size_t trie_nodes() const { return nodes_.size(); }

 private:
  friend class CompiledGrammar;
  // Nodes are in depth-first preorder (built from the sorted tokens), so a
  // node's subtree is the nodes [id, subtree_end) and its tokens the
  // tokens_ [first_token, subtree_tokens_end).
  struct Node {
    uint32_t first_edge = 0, edges = 0;    // into edges_
    uint32_t first_token = 0, tokens = 0;  // into tokens_: the tokens whose bytes end here
    uint32_t subtree_tokens_end = 0;       // into tokens_: past the last token below this node
  };
  struct Edge {
    uint8_t byte;
    uint32_t child;
  };
  std::vector<std::string> bytes_;
  std::vector<int> end_tokens_;  // sorted
  std::vector<Node> nodes_;      // 0: the root (no bytes)
  std::vector<Edge> edges_;
  std::vector<int32_t> tokens_;
};

// Which tokens a state allows.
struct TokenMask {
  std::vector<uint64_t> bits;  // bit i: token i allowed
  size_t allowed = 0;          // how many
  bool only_end = false;       // nothing but end tokens (the grammar is complete)
  bool allows(int token) const { return (bits[size_t(token) >> 6] >> (token & 63)) & 1; }
  // Every token it does not allow gets -infinity.
  void apply(float* logits, int vocab) const;
};

// The most stack entries one state may nest (deeper paths are cut: a
// grammar's text cannot nest deeper), the most states and stacks one
// compiled grammar may intern (GrammarError past them), and the most masks
// it keeps (past that the cache starts again).
//
// A new state's mask comes from its frame: the state with each stack cut to
// its top kFrameDepth entries over a bottom marker. A walk of the prefix
// tree from the frame decides most tokens for every state that shares it
// (those consumed inside the frame), and lists the few it cannot (those
// that read past the frame's bottom: a string's closing quote and what
// follows it); only those are walked from the state itself (XGrammar's
// context-independent and context-dependent tokens, per frame instead of
// per rule position). A frame that leaves more than 1/kFrameFallback of the
// vocabulary undecided is not used: the state walks the tree itself.
constexpr int kMaxStackDepth = 1024;
constexpr size_t kMaxStates = size_t(1) << 20;
constexpr size_t kMaxStacks = size_t(1) << 22;
constexpr size_t kMaxCachedMasks = 1024;
constexpr int kFrameDepth = 4;
constexpr size_t kFrameFallback = 8;

class CompiledGrammar {
 public:
  // Throws GrammarError (g.check()).
  CompiledGrammar(const Grammar& g, std::shared_ptr<const TokenVocabulary> vocabulary);

  const TokenVocabulary& vocabulary() const { return *vocab_; }
  int start() const { return start_; }  // the state before any byte
  // The state after `byte` from `state`; -1 when the grammar has no such text.
  int next(int state, uint8_t byte);
  // After the bytes of `token` (not an end token); -1 when not allowed.
  int next_token(int state, int token);
  // Whether the text so far is a whole sentence of the grammar.
  bool accepting(int state);
  std::shared_ptr<const TokenMask> mask(int state);
  // The end tokens alone: the mask once the grammar's text has ended.
  const std::shared_ptr<const TokenMask>& end_only_mask() const { return end_only_; }

  size_t states() const;

 private:
  struct Stack {
    int32_t pos;     // index into elems_: the symbol to read next
    int32_t parent;  // the stack below (0: the empty stack)
    int32_t depth;
  };
  struct State {
    std::vector<int32_t> stacks;  // sorted; 0 (the empty stack) when accepting
    std::unique_ptr<std::array<int32_t, 256>> next;  // memo: -2 unknown, -1 dead
  };
  // What a frame decides: the tokens it accepts, those it cannot decide.
  struct Frame {
    std::vector<uint64_t> accepted;
    std::vector<int32_t> undecided;
    bool usable = true;  // false: too many undecided
  };
  static constexpr int32_t kEnd = -1;     // end of an alternative in elems_
  static constexpr int32_t kBottom = 1;   // the stack a frame stands on (a cut stack's rest)

  int32_t push(int32_t parent, int32_t pos);
  const std::vector<int32_t>& closure(int32_t stack);
  int32_t intern(std::vector<int32_t> stacks);
  int32_t next_locked(int32_t state, uint8_t byte);
  std::shared_ptr<const TokenMask> compute_mask(int32_t state);
  // The prefix tree walked from `state`: the tokens reached (all their bytes
  // read) into `reached`; with `below`, every token under a node where a
  // stack ran into the bottom marker.
  void walk_tree(int32_t state, std::vector<uint64_t>& reached, std::vector<uint64_t>* below);
  bool has_bottom(int32_t state) const;
  int32_t frame_of(int32_t state);
  const Frame& frame(int32_t frame_state);
  int32_t next_token_locked(int32_t state, int token);

  std::shared_ptr<const TokenVocabulary> vocab_;
  // The rules flattened: each alternative's symbols then kEnd; a symbol >= 0
  // is a rule, <= -2 the byte set terms_[-symbol - 2].
  std::vector<int32_t> elems_;
  std::vector<ByteSet> terms_;
  std::vector<std::vector<int32_t>> rule_starts_;  // per rule, its alternatives' first index

  mutable std::mutex mutex_;
  std::vector<Stack> stacks_;  // 0: the empty stack
  std::unordered_map<uint64_t, int32_t> stack_index_;
  std::vector<std::vector<int32_t>> closures_;
  std::vector<char> closed_;
  std::vector<State> states_;
  struct VectorHash {
    size_t operator()(const std::vector<int32_t>& v) const;
  };
  std::unordered_map<std::vector<int32_t>, int32_t, VectorHash> state_index_;
  std::unordered_map<int32_t, std::shared_ptr<const TokenMask>> masks_;
  std::unordered_map<int32_t, std::unique_ptr<Frame>> frames_;  // by frame state
  int32_t start_ = -1;
  std::shared_ptr<const TokenMask> end_only_;
};

// One sequence's place in a grammar: the tokens so far taken one at a time.
class Matcher {
 public:
  explicit Matcher(std::shared_ptr<CompiledGrammar> grammar);
  // Takes `token`; false (and no change) when the grammar does not allow it.
  bool accept(int token);
  // The tokens allowed next (after an end token: the end tokens only).
  std::shared_ptr<const TokenMask> mask();
  bool ended() const { return ended_; }
  bool accepting();
  const std::shared_ptr<CompiledGrammar>& grammar() const { return grammar_; }

 private:
  std::shared_ptr<CompiledGrammar> grammar_;
  int state_;
  bool ended_ = false;
};

}  // namespace disagg::grammar
