// What the router decides, without CAF: whether a request is valid, which
// prefill and decode worker take it, and which decode worker a session
// returns to. Kept apart from the message plumbing in router.cpp.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/engine.h"
#include "engine/generate.h"
#include "messages/request.h"
#include "messages/worker.h"

namespace disagg {

using WorkerKey = uint64_t;  // the router's name for a registered worker

// What requests are checked against: the served model's limits.
struct ModelLimits {
  int vocab_size = 0;
  int seq_len = 0;
};

// Empty when `request` with the (already encoded) `prompt` may be served,
// else why not. Without limits only the model-independent checks run.
std::string validate_request(const GenerateRequest& request, const std::vector<int32_t>& prompt,
                             const std::optional<ModelLimits>& limits);


struct PrefillCandidate {
  WorkerKey key = 0;
  int in_flight = 0;
  int64_t outstanding_tokens = 0;  // prompt tokens dispatched and not yet reported
  bool colocated = false;          // of a colocated unit: prefills only for its own decode worker
  // KV-aware routing: the positions of this request it would compute, the
  // prompt less what its prefix cache holds (PrefixIndex); 0: not scored.
  int64_t compute_tokens = 0;
};

// The candidate that would have this prompt done first: the fewest
// outstanding prompt tokens plus compute_tokens, among those below
// max_in_flight; ties go round robin (cursor advances on every pick).
std::optional<WorkerKey> pick_prefill(const std::vector<PrefillCandidate>& candidates,
                                      int max_in_flight, size_t& cursor);

struct DecodeCandidate {
  WorkerKey key = 0;
  int block_size = 1;
  int total_blocks = 0;
  int free_blocks = 0;  // the router's estimate: room for new requests now
  int active_sequences = 0;
  // A colocated unit's decode worker (WorkerInfo::colocated): takes only
  // requests its own unit's prefill worker `partner` prefills (0 while that
  // one is not registered or not responsive: then it takes none).
  bool colocated = false;
  WorkerKey partner = 0;
  // KV-aware routing: prefill-weight x the request's prompt blocks this
  // worker's prefix cache lacks (PrefixIndex), as the router's index says.
  double compute_cost = 0;
};

// The preferred worker (a session's previous one) when it has room; else the
// lowest score, compute_cost - free_blocks (Dynamo's prefill_weight x blocks
// to compute + decode load, with the load as the blocks in use: the most
// free blocks), then the fewest active sequences, ties round robin. Workers
// in `excluded` are skipped; nullopt when none has room.
std::optional<WorkerKey> pick_decode(const std::vector<DecodeCandidate>& candidates, int positions,
                                     std::optional<WorkerKey> preferred,
                                     const std::vector<WorkerKey>& excluded, size_t& cursor);

// The prefill and decode worker of a request, or nullopt when none can take
// it now. A disaggregated decode worker (pick_decode) goes with pick_prefill's
// choice among the disaggregated prefill workers; a colocated one with its
// own unit's prefill worker, and only while that one is below
// max_in_flight. (A cluster may mix both kinds.) The cursors advance as
// pick_prefill's and pick_decode's do, prefill_cursor only when its pick is used.
struct WorkerPair {
  WorkerKey prefill = 0;
  WorkerKey decode = 0;
};
std::optional<WorkerPair> pick_workers(const std::vector<PrefillCandidate>& prefills,
                                       const std::vector<DecodeCandidate>& decodes, int max_in_flight,
                                       int positions, std::optional<WorkerKey> preferred,
                                       const std::vector<WorkerKey>& excluded, size_t& prefill_cursor,
                                       size_t& decode_cursor);

// True when some candidate outside `excluded` could hold `positions` once
// empty (so waiting can help).
bool any_decode_could_fit(const std::vector<DecodeCandidate>& candidates, int positions,
                          const std::vector<WorkerKey>& excluded);

// The most new tokens a request of `prompt_len` prompt tokens may generate
// for the largest pool of `candidates` to hold its KV (positions: the prompt
// and every generated token but the last); 0 when none holds the prompt.
int most_new_tokens(const std::vector<DecodeCandidate>& candidates, int prompt_len);


// A decode worker's room as the router books it: the one answer to "how
// many of its blocks are free" that dispatch (DecodeCandidate::free_blocks)
// and status (WorkerStatus::free_blocks) both read. What the worker last
// reported, lowered by the router's own reservations since (a report may
// predate requests already on their way to it), and never more than its
// pool less the blocks of the unfinished requests the router sent there.
class DecodeRoom {
 public:
  explicit DecodeRoom(int total_blocks = 0) : total_(total_blocks), reported_free_(total_blocks) {}
  // The worker's own report (a load message, a reservation's answer, an ack).
  void reported(const DecodeLoad& load) {
    reported_free_ = load.free_blocks;
    active_ = load.active_sequences;
  }
  // A request of `blocks` sent there; released when it ends there.
  void reserve(int blocks) {
    reserved_ += blocks;
    reported_free_ -= blocks;  // until its next report says otherwise
    requests_ += 1;
  }
  void release(int blocks) {
    reserved_ -= blocks;
    reported_free_ = std::min(total_, reported_free_ + blocks);  // (a report may have counted them free already)
    requests_ -= 1;
  }
  // A request of `blocks` the worker refused (no room): its answer's report
  // describes it without them, so unlike release() nothing comes back free
  // (adding them made a refusing worker look roomy again: the request went
  // straight back to it, refused again, until its deadline).
  void refused(int blocks) {
    reserved_ -= blocks;
    requests_ -= 1;
  }
  int free_blocks() const { return std::max(0, std::min(reported_free_, total_ - reserved_)); }
  int active_sequences() const { return active_; }  // as last reported
  int requests() const { return requests_; }        // sent there, not finished

 private:
  int total_;
  int reported_free_;
  int reserved_ = 0;
  int active_ = 0;
  int requests_ = 0;
};

// Which workers' PrefixIndex holds each block hash: the router's one index
// over all workers (Dynamo's KV router keeps one radix tree for all), so
// scoring a prompt costs its blocks times the workers that hold them, not a
// look-up in every worker's index. Kept by the PrefixIndexes attached to it.
class PrefixHolders {
 public:
  void hold(uint64_t hash, WorkerKey worker);
  void drop(uint64_t hash, WorkerKey worker);
  // Each worker that holds hashes[0], with how many of `hashes`, from the
  // first, it holds (the others hold none); as PrefixIndex::matched says.
  std::unordered_map<WorkerKey, int> matched(const std::vector<uint64_t>& hashes) const;
  size_t size() const { return holders_.size(); }  // distinct hashes held anywhere

 private:
  std::unordered_map<uint64_t, std::vector<WorkerKey>> holders_;
};

// The most blocks one worker's prefix index follows: a cache's size is the
// worker's own claim (2^22: 64 M positions at 16 a block; a claim of 2^31
// let a worker push that many hashes into the router's memory).
constexpr size_t kMaxIndexedBlocks = size_t(1) << 22;

// The router's view of one worker's prefix cache (a decode pool, a prefill
// worker's own cache), from the worker's KV events (messages/worker.h
// KvEvents): bounded by the cache's blocks (it cannot hold more than it has,
// nor more than kMaxIndexedBlocks), numbered batches applied in order.
// Only a hint for routing: the worker itself decides what it shares, so a
// stale or forged event can misroute a request but never give it wrong KV.
class PrefixIndex {
 public:
  explicit PrefixIndex(size_t capacity) : capacity_(std::min(capacity, kMaxIndexedBlocks)) {}
  enum class Applied {
    applied,  // the index follows the worker
    ignored,  // an old batch, or one while waiting for a snapshot
    resync,   // a number was skipped or the batch does not fit the pool: cleared, ask for a snapshot
  };
  Applied apply(const KvEvents& events);
  // The blocks of a prompt just sent to the worker, which it will hold once
  // the prompt's KV is in (SGLang's router inserts a request into its tree
  // at dispatch): counted as held until an event (or a snapshot) stores or
  // removes them, at most `capacity` of them (the oldest go first). They
  // outlive a resync: they are about requests in flight, not past events.
  // Without it, a group's requests sent before the first one's events
  // arrive look uncached everywhere and scatter.
  void predict(const std::vector<uint64_t>& hashes);
  // How many of `hashes`, from the first, the worker holds (or will).
  int matched(const std::vector<uint64_t>& hashes) const;
  // Keeps `holders` told of what this index holds (and predicts), as worker
  // `key`; detach() takes it all back (the worker left).
  void attach(PrefixHolders* holders, WorkerKey key);
  void detach();
  bool synced() const { return synced_; }
  size_t size() const { return hashes_.size() + predicted_.size(); }
  size_t held() const { return hashes_.size(); }  // what the worker's events say it holds

 private:
  void unpredict(uint64_t hash);
  bool holds(uint64_t hash) const { return hashes_.count(hash) || predicted_.count(hash); }
  void insert_held(uint64_t hash);
  void erase_held(uint64_t hash);
  void clear_held();
  void tell(uint64_t hash, bool held) {
    if (holders_) held ? holders_->hold(hash, key_) : holders_->drop(hash, key_);
  }

  size_t capacity_;
  bool synced_ = false;  // a snapshot has been applied since the last resync
  uint64_t seq_ = 0;     // the last batch applied
  std::unordered_set<uint64_t> hashes_;
  std::list<uint64_t> predicted_order_;  // oldest first
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> predicted_;
  PrefixHolders* holders_ = nullptr;
  WorkerKey key_ = 0;
};

// Session key -> decode worker, bounded; the least recently used entry goes
// first when full. Capacity 0 disables affinity.
class SessionAffinity {
 public:
  explicit SessionAffinity(size_t capacity) : capacity_(capacity) {}
  // The session's worker (and marks the session as recently used).
  std::optional<WorkerKey> find(const std::string& session);
  void remember(const std::string& session, WorkerKey worker);
  void forget_worker(WorkerKey worker);
  size_t size() const { return index_.size(); }

 private:
  using Entry = std::pair<std::string, WorkerKey>;
  size_t capacity_;
  std::list<Entry> order_;  // most recently used first
  std::unordered_map<std::string, std::list<Entry>::iterator> index_;
};

}  // namespace disagg
