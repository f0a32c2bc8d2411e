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
// bytes form a prefix tree (TokenVocabulary), laid out in preorder; a walk
// reads it in order, carries the state down it, skips a branch where a byte
// has no next state, and allows every token at a node it reaches. Where
// every byte below a node leads one way at each depth (a string's
// characters: back to the same state, or on through a bounded repetition),
// the walk marks the tokens below without stepping down. A state whose
// walk would be long takes most of its tokens from sets made ahead: a run
// of plain characters (TokenVocabulary's plain tokens), a run of one byte
// class (its ByteRun), a frame's walk shared by every state with the same
// top, or a state of the same shape (bounded repetitions); compute_mask
// says which. Tokens that are special (control, user-defined, unknown,
// unused) or have no bytes are never allowed; the end tokens only where the
// grammar may end. Masks are cached per state, so a state seen before costs
// a lookup. (Byte classes that the same stacks read share one transition.)
//
// Thread-safe: the memo tables are behind one mutex per compiled grammar.
#pragma once
#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "grammar/grammar.h"

namespace disagg::grammar {

// The vocabulary as a grammar reads it: each token's bytes, which may appear
// inside a grammar's text, and which end a generation.
//
// Its *plain* tokens are those of characters JSON writes unescaped in a
// string alone (code_points.h plain_char_forms): most of a vocabulary. A
// state that reads any plain character into one next state, and so on for
// k characters (a string's body: k unbounded; a string with a maxLength),
// then none, allows exactly the plain tokens of at most k characters, so
// its walk takes them as one set and walks the prefix tree of the other
// tokens alone (llguidance's token slices). A run is followed only
// kPlainMasks characters far: one that goes on past them takes the plain
// tokens that short and walks the longer ones with the rest (a tree of
// their own: a few hundred tokens). 16: measured (bench_grammar) against 8,
// 12, 24 and 32 (8 and 12: many more long tokens walked; 32: a longer run
// followed).
class TokenVocabulary {
 public:
  using Bytes = std::array<uint64_t, 4>;  // a set of bytes, bit b of word b / 64
  // bytes[i]: token i's text (its decoded bytes); special[i]: never inside
  // a grammar's text; end_tokens: allowed where the grammar may end.
  TokenVocabulary(std::vector<std::string> bytes, const std::vector<bool>& special, std::vector<int> end_tokens);

  size_t size() const { return bytes_.size(); }
  const std::string& bytes(int token) const { return bytes_[size_t(token)]; }
  bool is_end(int token) const;
  const std::vector<int>& end_tokens() const { return end_tokens_; }
  size_t trie_nodes() const { return all_.nodes.size(); }
  // How many of the tokens that may appear inside a text are longer than
  // `n` bytes.
  size_t longer_than(size_t n) const;
  // A token's characters when it is plain, else -1.
  int plain_chars(int token) const { return plain_chars_[size_t(token)]; }
  // Sets the bits of the plain tokens of at most `chars` characters
  // (<= kPlainMasks), or of all of them.
  static constexpr int kPlainMasks = 16;
  void allow_plain_up_to(int chars, std::vector<uint64_t>& bits) const;
  void allow_plain(std::vector<uint64_t>& bits) const;
  int max_plain_chars() const { return max_plain_chars_; }

  // The tokens as a run over one set of bytes reads them (a loop or a
  // bounded repetition of one byte class: an email's letters, a uuid's hex
  // digits): those of the set's bytes alone, by length, and the branches of
  // the prefix tree (all_) where a token's first byte outside the set
  // stands, grouped by its position and value. A state that reads every
  // byte of the set into one next state, and so on for a few bytes, decides
  // a group by one transition (most die there: a space, a quote) and walks
  // the branches of the live ones from their next state instead of walking
  // the tree: XGrammar's context-independent tokens, for a byte class.
  static constexpr int kRunDepth = 16;   // the longest run followed; tokens alone as bits up to it
  static constexpr int kRunGroups = 64;  // branches grouped by position up to here; deeper ones: `far`
  struct ByteRun {
    Bytes set{};
    std::vector<std::vector<uint64_t>> alone_bits;  // [n <= kRunDepth]: tokens of the set's bytes alone, at most n of them
    std::vector<int32_t> alone_longer;              // and those longer
    struct Group {
      uint16_t at;   // the first byte outside the set: its position ...
      uint8_t byte;  // ... and value
      uint32_t begin, end;  // into `branches`
    };
    std::vector<Group> groups;  // by (at, byte)
    std::vector<uint32_t> branches;
    std::vector<uint32_t> far;  // branches at kRunGroups or deeper
  };
  // The run of `set`: made when not kept and `build` (a compiled grammar
  // asks for its larger ASCII terms' sets as it is made: a millisecond each,
  // once per vocabulary), else null. Thread-safe.
  std::shared_ptr<const ByteRun> byte_run(const Bytes& set, bool build) const;
  static constexpr size_t kMaxByteRuns = 16;  // kept per vocabulary (the oldest let go)

 private:
  std::shared_ptr<const ByteRun> make_byte_run(const Bytes& set) const;
  // all_'s node of the tokens that begin with `byte` (0: none do).
  uint32_t branch(uint8_t byte) const { return branch_[byte]; }
  std::array<uint32_t, 256> branch_{};
  mutable std::mutex runs_mutex_;
  mutable std::vector<std::shared_ptr<const ByteRun>> runs_;
  friend class CompiledGrammar;
  // A prefix tree in depth-first preorder (built from the sorted tokens):
  // a node's subtree is the nodes [id, subtree_end), its tokens the tokens
  // [first_token, subtree_tokens_end), so a walk reads the array in order
  // and skips a dead branch by one jump (llguidance's token trie).
  struct Node {
    uint32_t subtree_end = 0;
    uint32_t first_token = 0, tokens = 0;  // into tokens: the tokens whose bytes end here
    uint32_t subtree_tokens_end = 0;       // into tokens: past the last token below this node
    uint16_t depth = 0;                    // its bytes (the root: 0)
    uint16_t max_depth = 0;                // the deepest node of its subtree
    uint8_t byte = 0;                      // its last byte
  };
  struct Trie {
    std::vector<Node> nodes;  // 0: the root (no bytes)
    std::vector<int32_t> tokens;
    std::vector<Bytes> subtree_bytes;  // per node: the bytes of its subtree's nodes below it
  };
  Trie trie_of(std::vector<int32_t> tokens) const;
  std::vector<std::string> bytes_;
  std::vector<int> end_tokens_;  // sorted
  Trie all_;                     // every token that may appear inside a text
  Trie rest_;                    // those that are not plain
  Trie rest_long_;               // and the plain ones of more than kPlainMasks characters
  std::vector<int32_t> by_length_;  // all_'s tokens, longest first
  std::vector<int32_t> plain_chars_;
  std::vector<std::vector<uint64_t>> plain_up_to_;  // [k]: the plain tokens of at most k <= kPlainMasks characters
  std::vector<uint64_t> plain_all_;
  int max_plain_chars_ = 0;
};

// Whether bit `token` of a set of tokens as bits is set.
inline bool has_token(const std::vector<uint64_t>& bits, int token) { return (bits[size_t(token) >> 6] >> (token & 63)) & 1; }

// Which tokens a state allows.
struct TokenMask {
  std::vector<uint64_t> bits;  // bit i: token i allowed
  size_t allowed = 0;          // how many
  bool only_end = false;       // nothing but end tokens (the grammar is complete)
  bool allows(int token) const { return has_token(bits, token); }
  // Every token it does not allow gets -infinity.
  void apply(float* logits, int vocab) const;
};

// The most stack entries one state may nest (deeper paths are cut: a
// grammar's text cannot nest deeper), the most states and stacks one
// compiled grammar may intern (GrammarError past them), and the most masks
// it keeps (past that the cache starts again).
//
// A new state's mask comes from its frame: its stacks cut together to
// their top entries over a bottom marker, the first of kFrameDepths that
// leaves at most 1/kFrameFew of the vocabulary undecided (else the one that
// leaves fewest, up to 1/kFrameFallback). Failing that, the union of each
// stack's own frame, chosen alike (a token is read from a set of stacks
// when one of them reads it); failing that, the state walks the tree
// itself. A frame's walk decides the tokens read inside it for every state
// with that top, wherever it is nested, and lists the few it cannot (those
// that read past the bottom: a string's closing quote and what follows
// it); only those are read from the state itself (XGrammar's
// context-independent and context-dependent tokens, per stack top instead
// of per rule position). A frame's walk stops as soon as it has left more
// undecided than a shallower one did. Depths 3, 5, 8: measured
// (bench_grammar) against 1..8 over JSON and real tool schemas; 3 holds a
// JSON string's character loop and its closing quote; kFrameFew: 64
// against 512 (20-50% slower).
constexpr int kMaxStackDepth = 1024;
constexpr size_t kMaxStates = size_t(1) << 20;
constexpr size_t kMaxStacks = size_t(1) << 22;
// A stack's closure calls itself once per symbol that may match "" in a row
// (each call a small frame), and all closures together hold at most this
// many stacks.
constexpr int kMaxClosureDepth = 8192;
constexpr size_t kMaxClosureEntries = size_t(1) << 24;
constexpr size_t kMaxCachedMasks = 1024;
constexpr std::array<int, 3> kFrameDepths = {3, 5, 8};
constexpr size_t kFrameFallback = 8;
constexpr size_t kFrameFew = 64;
constexpr uint32_t kUniformMinTokens = 16;
// A state walks the tree itself first, as far as 1/kDirectWalkShare of its
// nodes: a literal's, a number's, a date's few tokens are found that way
// without a frame's bookkeeping; past it (a string's body) it takes its
// frames'. 32 (8,500 nodes of Llama 3's tree): measured (bench_grammar)
// against 128 and 8 (more frames for small masks; longer walks before
// giving up).
constexpr size_t kDirectWalkShare = 32;

// A bounded repetition (Grammar::repeat: L1 := A | "", Lk := A L(k-1) | "")
// has a state for each count left, and each would walk the tree for its
// mask (a string bounded by maxLength: one per character). Two states that
// differ only in which link of such chains their stacks stand in (their
// *shapes* are equal) read the same tokens up to `reach` bytes long: a link
// Lk decides nothing until k-1 more copies of A (each at least a byte) are
// read. So a state's mask is its shape's mask so far (kept from the state of
// that shape with the longest reach) for the short tokens, and a walk of the
// tree's long branches alone for the others, when at most
// 1/kShapeLongTokens of the vocabulary is longer than the reach.
constexpr size_t kShapeLongTokens = 4;

class CompiledGrammar {
 public:
  // Throws GrammarError (g.check()).
  // `direct_walk_share`: kDirectWalkShare, or 0 for frames wherever none
  // of the other ways applies (the tests of frames).
  CompiledGrammar(const Grammar& g, std::shared_ptr<const TokenVocabulary> vocabulary,
                  size_t direct_walk_share = kDirectWalkShare);

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
  size_t stacks() const;
  size_t closure_entries() const;

 private:
  using PlainForm = std::vector<std::vector<uint8_t>>;  // plain_forms_'s
  struct Stack {
    int32_t pos;     // index into elems_: the symbol to read next
    int32_t parent;  // the stack below (0: the empty stack)
    int32_t depth;
  };
  // Where a state's bytes lead, as far as asked: the bytes asked, those
  // that die, and the others by their next state.
  struct Uniform {
    TokenVocabulary::Bytes known{}, dead{};
    std::vector<std::pair<int32_t, TokenVocabulary::Bytes>> ways;
  };
  struct State {
    std::vector<int32_t> stacks;  // sorted; 0 (the empty stack) when accepting
    int32_t* next = nullptr;  // memo per byte class (-2 unknown, -1 dead), in row_chunks_
    std::unique_ptr<Uniform> uniform;
    bool bottom = false;  // a frame's: it holds kBottom (the text may read past the frame)
    int32_t plain = kPlainUnknown;       // plain_reach's answer
    int32_t plain_next = kPlainUnknown;  // plain_step's
  };
  // What a frame decides: the tokens it accepts, those it cannot decide.
  struct Frame {
    // As bits, or listed when they are few (most frames: a key's or a
    // number's first bytes), so a frame costs what it holds.
    std::vector<uint64_t> accepted_bits;
    std::vector<int32_t> accepted_tokens;
    std::vector<int32_t> undecided;
    bool complete = true;  // false: the walk stopped at its limit of undecided tokens (then empty)
    void allow(std::vector<uint64_t>& bits) const;
  };
  static constexpr int32_t kEnd = -1;     // end of an alternative in elems_
  static constexpr int32_t kBottom = 1;   // the stack a frame stands on (a cut stack's rest)

  int32_t push(int32_t parent, int32_t pos);
  const std::vector<int32_t>& closure(int32_t stack);
  // The state of a set of stacks (sorted and deduplicated in place).
  int32_t intern(std::vector<int32_t>& stacks);
  int32_t next_locked(int32_t state, uint8_t byte);
  std::shared_ptr<const TokenMask> compute_mask(int32_t state);
  // The state's text tokens from its stacks' frames (or one walk).
  void frame_mask(int32_t state, std::vector<uint64_t>& bits);
  // The prefix tree walked from `state`: the tokens reached (all their bytes
  // read) into `reached`; with `below`,
  // every token under a node where a stack ran into the bottom marker; it
  // stops (false) once more than `undecided_limit` of those are not reached.
  // Branches no deeper than `skip_depth` are not walked. With a `root`
  // (of vocab_->all_, and no `below`), only the tokens under it, `state`
  // being the state after its bytes (and no plain run taken at once).
  // It gives up (false) past `max_visits` nodes. A `trie` given is walked
  // as it is (no plain run taken at once).
  bool walk_tree(int32_t state, std::vector<uint64_t>& reached, std::vector<uint64_t>* below, size_t undecided_limit,
                 int skip_depth = 0, uint32_t root = 0, size_t max_visits = SIZE_MAX,
                 const TokenVocabulary::Trie* trie = nullptr);
  // Bounded repetitions (kShapeLongTokens): each link's elems_ positions
  // mapped to the first link's with the same body, and how far a stack
  // standing there reads like any other link (k - 1 bytes).
  void find_repetitions(const Grammar& g);
  static constexpr int32_t kFar = std::numeric_limits<int32_t>::max();
  struct Shape {
    int32_t id;     // equal for stacks equal but for their links
    int32_t reach;  // kFar when it stands in no link
  };
  Shape shape(int32_t stack);
  // A state's shape (its stacks' shape ids, sorted, without repeats) into
  // `key`; returns its reach (the least of its stacks').
  int32_t state_shape(int32_t state, std::vector<int32_t>& key);
  bool has_bottom(int32_t state) const;
  int32_t cut(int32_t stack, int depth);
  int32_t choose_frame(const std::vector<int32_t>& stacks);
  int32_t stack_frame(int32_t stack);
  int32_t* transitions(int32_t state);  // its memo row (index: byte_class_)
  // The one state every byte of `bytes` leads to from `state`; -1 when
  // every one is dead, -3 when they go to different places or some die.
  int32_t uniform_next(int32_t state, const TokenVocabulary::Bytes& bytes);
  // A state whose most bytes lead one way reads a run of them (ByteRun):
  // its tokens into `bits` from the run's groups; false (bits untouched)
  // when those bytes are fewer than kRunMinBytes or not all ASCII, when
  // they part within kRunDepth bytes, or when more than kRunReadLimit
  // tokens would be read one by one. (A set no term
  // of the grammar is, a union of some, has its ByteRun made here.)
  bool byte_run_mask(int32_t state, std::vector<uint64_t>& bits);
  // Whether a stack of the state reads a byte set of kRunMinBytes or more
  // (else neither a run of one class nor of plain characters but a few).
  bool reads_many(int32_t state) const;
  static constexpr int kRunMinBytes = 16;
  static constexpr size_t kRunReadLimit = 2048;
  std::vector<int> term_bytes_;                       // per term: how many bytes it has
  std::vector<uint8_t> class_byte_;                   // per byte class: its first byte
  std::vector<TokenVocabulary::Bytes> class_bytes_;  // per byte class: its bytes
  // When every byte below `node` leads one way at each depth (a string's
  // characters: the same state again, or the next of a bounded repetition):
  // how deep below it tokens are read from `state`, and the first depth
  // whose state holds a frame's bottom (deeper tokens may read past it).
  static constexpr int kNoBottom = 1 << 30;
  // How many plain characters `state` reads, each into one next state (the
  // same for every character), with no frame's bottom on the way, before a
  // state that reads none: then it allows exactly the plain tokens of at
  // most that many characters (kFar: any). kPlainLong: at least
  // kPlainMasks (the longer plain tokens undecided). kNotPlain when it is no
  // such run (some character dies or goes elsewhere partway).
  static constexpr int32_t kPlainUnknown = -2, kNotPlain = -1, kPlainLong = kFar - 1;
  int32_t plain_reach(int32_t state);
  // The one state every plain character leads `state` to, through states
  // with no bottom; kPlainNone when every one dies, kPlainParted else.
  // plain_step_checked asks every form's bytes; plain_step asks one form
  // where a state of the same shape was checked (plain_shapes_).
  static constexpr int32_t kPlainParted = -3, kPlainNone = -4, kPlainOne = -5;
  int32_t plain_step(int32_t state);
  int32_t plain_step_checked(int32_t state);
  // Whether every byte sequence of a form, from its position `i` on, leads
  // `from` to `to` through states with no bottom.
  bool form_leads(const PlainForm& f, size_t i, int32_t from, int32_t to);
  // A state where every plain character but a few ASCII ones (at most
  // kPlainButMost: a key that must not be a declared property's name)
  // leads to one state (however the character's bytes are spelled in the
  // grammar) that reads plain characters on without end: its
  // plain tokens at once but those beginning with an excepted byte, whose
  // branches are walked, and its other tokens walked; false (bits
  // untouched) when it is no such state.
  int32_t plain_but(int32_t state, TokenVocabulary::Bytes& except);
  bool plain_but_mask(int32_t state, std::vector<uint64_t>& bits);
  static constexpr size_t kPlainButMost = 8;
  static constexpr int32_t kCharBytes = 4;  // the most bytes of one character
  struct UniformRun {
    int depth = -1;  // -1: not one way
    int bottom = kNoBottom;
  };
  UniformRun uniform_run(int32_t state, const TokenVocabulary::Trie& trie, uint32_t node);
  // A frame's walk, cached; one that leaves more than `undecided_limit`
  // tokens undecided is not finished (not complete).
  const Frame& frame(int32_t frame_state, size_t undecided_limit);
  int32_t next_token_locked(int32_t state, int token);
  // Allows those of frames' undecided tokens that `state` reads.
  void read_undecided(int32_t state, const std::vector<int32_t>& undecided, std::vector<uint64_t>& bits);

  std::shared_ptr<const TokenVocabulary> vocab_;
  size_t direct_walk_share_;
  // The rules flattened: each alternative's symbols then kEnd; a symbol >= 0
  // is a rule, <= -2 the byte set terms_[-symbol - 2].
  std::vector<int32_t> elems_;
  std::vector<ByteSet> terms_;
  // Per byte, its class: bytes no term tells apart lead every state to the
  // same next one, so a state's memo row has an entry per class.
  std::array<uint8_t, 256> byte_class_{};
  size_t classes_ = 0;
  // The memo rows, carved from chunks that never move.
  std::vector<std::unique_ptr<int32_t[]>> row_chunks_;
  size_t row_chunk_used_ = 0;
  std::vector<std::vector<int32_t>> rule_starts_;  // per rule, its alternatives' first index
  // code_points.h's plain character forms as this grammar reads them: per
  // form, per byte position, one byte of each class its set holds (the
  // first of each, in byte order).
  std::vector<PlainForm> plain_forms_;

  mutable std::mutex mutex_;
  std::vector<Stack> stacks_;  // 0: the empty stack
  std::unordered_map<uint64_t, int32_t> stack_index_;
  std::vector<std::vector<int32_t>> closures_;
  std::vector<char> closed_;
  int closure_depth_ = 0;       // closure()'s calls in progress
  size_t closure_entries_ = 0;  // in closures_
  std::vector<State> states_;
  std::vector<int32_t> next_stacks_;  // next_locked's scratch
  struct VectorHash {
    size_t operator()(const std::vector<int32_t>& v) const;
  };
  std::unordered_map<std::vector<int32_t>, int32_t, VectorHash> state_index_;
  std::unordered_map<int32_t, std::shared_ptr<const TokenMask>> masks_;
  std::unordered_map<int32_t, std::unique_ptr<Frame>> frames_;  // by frame state
  std::vector<uint64_t> walk_accepted_, walk_below_;             // frame()'s scratch, zero between walks
  std::unordered_map<int32_t, int32_t> stack_frames_;          // stack -> its frame state, -1: none
  // Bounded repetitions: per elems_ position, its link's first-of-its-body
  // position and reach (kFar: no link); per stack, its shape (id -1: not yet);
  // shapes interned by (shape position, parent's shape); per state shape,
  // the mask of the longest-reaching state seen with it.
  std::vector<int32_t> shape_pos_, pos_reach_;
  std::vector<Shape> stack_shapes_;
  std::unordered_map<uint64_t, int32_t> shape_index_;
  struct ShapeMask {
    int32_t reach;
    std::shared_ptr<const TokenMask> mask;
  };
  std::unordered_map<std::vector<int32_t>, ShapeMask, VectorHash> shape_masks_;
  // Per state shape, plain_step's answer for the first of its states
  // checked (kPlainOne for a state: the others' own next state).
  std::unordered_map<std::vector<int32_t>, int32_t, VectorHash> plain_shapes_;
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
