#include "actors/router_policy.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>

namespace disagg {

std::string validate_request(const GenerateRequest& request, const std::vector<int32_t>& prompt,
                             const std::optional<ModelLimits>& limits) {
  if (prompt.empty()) return "empty prompt";
  if (request.max_new_tokens <= 0)
    return "max_new_tokens must be positive (got " + std::to_string(request.max_new_tokens) + ")";
  // Token ids against the vocabulary once the model's limits are known (the
  // router checks a queued request again then).
  if (std::string why = gpu::check_sampling(request.sampling, limits ? limits->vocab_size
                                                                     : std::numeric_limits<int32_t>::max());
      !why.empty())
    return why;
  if (request.deadline_ms < 0 || request.deadline_ms > kMaxDeadlineMs)
    return "deadline_ms must be in [0, " + std::to_string(kMaxDeadlineMs) + "] (24 h; got " +
           std::to_string(request.deadline_ms) + ")";
  if (!limits) return {};
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || prompt[i] >= limits->vocab_size)
      return "prompt token " + std::to_string(i) + " has id " + std::to_string(prompt[i]) +
             ", outside the vocabulary [0, " + std::to_string(limits->vocab_size) + ")";
  const int64_t total = int64_t(prompt.size()) + request.max_new_tokens;
  if (total > limits->seq_len)
    return "prompt of " + std::to_string(prompt.size()) + " tokens + max_new_tokens " +
           std::to_string(request.max_new_tokens) + " exceeds the model's seq_len " +
           std::to_string(limits->seq_len);
  return {};
}

std::optional<WorkerKey> pick_prefill(const std::vector<PrefillCandidate>& candidates,
                                      int max_in_flight, size_t& cursor) {
  const size_t n = candidates.size();
  std::optional<size_t> best;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (cursor + k) % n;  // rotated start: the first of equals wins
    const auto& c = candidates[i];
    if (c.in_flight >= max_in_flight) continue;
    auto work = [](const PrefillCandidate& p) { return p.outstanding_tokens + p.compute_tokens; };
    if (!best || work(c) < work(candidates[*best])) best = i;
  }
  if (!best) return std::nullopt;
  ++cursor;
  return candidates[*best].key;
}

namespace {
bool is_excluded(const std::vector<WorkerKey>& excluded, WorkerKey key) {
  return std::find(excluded.begin(), excluded.end(), key) != excluded.end();
}
}  // namespace

std::optional<WorkerKey> pick_decode(const std::vector<DecodeCandidate>& candidates, int positions,
                                     std::optional<WorkerKey> preferred,
                                     const std::vector<WorkerKey>& excluded, size_t& cursor) {
  auto fits = [&](const DecodeCandidate& c) {
    return !is_excluded(excluded, c.key) && c.free_blocks >= gpu::KvPool::blocks_for(positions, c.block_size);
  };
  if (preferred)
    for (const auto& c : candidates)
      if (c.key == *preferred && fits(c)) return c.key;
  const size_t n = candidates.size();
  std::optional<size_t> best;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (cursor + k) % n;
    const auto& c = candidates[i];
    if (!fits(c)) continue;
    if (!best) {
      best = i;
      continue;
    }
    const auto& b = candidates[*best];
    const double score = c.compute_cost - c.free_blocks, best_score = b.compute_cost - b.free_blocks;
    if (score < best_score || (score == best_score && c.active_sequences < b.active_sequences)) best = i;
  }
  if (!best) return std::nullopt;
  ++cursor;
  return candidates[*best].key;
}

std::optional<WorkerPair> pick_workers(const std::vector<PrefillCandidate>& prefills,
                                       const std::vector<DecodeCandidate>& decodes, int max_in_flight,
                                       int positions, std::optional<WorkerKey> preferred,
                                       const std::vector<WorkerKey>& excluded, size_t& prefill_cursor,
                                       size_t& decode_cursor) {
  std::vector<PrefillCandidate> disaggregated;
  for (const auto& p : prefills)
    if (!p.colocated) disaggregated.push_back(p);
  size_t cursor = prefill_cursor;
  const std::optional<WorkerKey> prefill = pick_prefill(disaggregated, max_in_flight, cursor);
  auto partner_has_room = [&](WorkerKey partner) {
    for (const auto& p : prefills)
      if (p.key == partner) return p.in_flight < max_in_flight;
    return false;
  };
  std::vector<DecodeCandidate> usable;
  for (const auto& d : decodes)
    if (d.colocated ? d.partner != 0 && partner_has_room(d.partner) : prefill.has_value()) usable.push_back(d);
  const std::optional<WorkerKey> decode = pick_decode(usable, positions, preferred, excluded, decode_cursor);
  if (!decode) return std::nullopt;
  for (const auto& d : usable)
    if (d.key == *decode && d.colocated) return WorkerPair{d.partner, *decode};
  prefill_cursor = cursor;
  return WorkerPair{*prefill, *decode};
}

bool any_decode_could_fit(const std::vector<DecodeCandidate>& candidates, int positions,
                          const std::vector<WorkerKey>& excluded) {
  for (const auto& c : candidates)
    if (!is_excluded(excluded, c.key) && c.total_blocks >= gpu::KvPool::blocks_for(positions, c.block_size))
      return true;
  return false;
}

int most_new_tokens(const std::vector<DecodeCandidate>& candidates, int prompt_len) {
  int64_t most = 0;
  for (const auto& c : candidates) most = std::max(most, int64_t(c.total_blocks) * c.block_size);
  return int(std::max<int64_t>(0, most - prompt_len + 1));
}

void PrefixHolders::hold(uint64_t hash, WorkerKey worker) { holders_[hash].push_back(worker); }

void PrefixHolders::drop(uint64_t hash, WorkerKey worker) {
  auto it = holders_.find(hash);
  if (it == holders_.end()) return;
  auto& workers = it->second;
  if (auto w = std::find(workers.begin(), workers.end(), worker); w != workers.end()) {
    *w = workers.back();
    workers.pop_back();
  }
  if (workers.empty()) holders_.erase(it);
}

std::unordered_map<WorkerKey, int> PrefixHolders::matched(const std::vector<uint64_t>& hashes) const {
  std::unordered_map<WorkerKey, int> depth;
  for (size_t i = 0; i < hashes.size(); ++i) {
    auto it = holders_.find(hashes[i]);
    if (it == holders_.end()) break;
    bool deeper = false;
    for (WorkerKey w : it->second) {
      if (i == 0) depth[w] = 1, deeper = true;
      else if (auto d = depth.find(w); d != depth.end() && d->second == int(i)) d->second += 1, deeper = true;
    }
    if (!deeper) break;
  }
  return depth;
}

void PrefixIndex::attach(PrefixHolders* holders, WorkerKey key) {
  detach();
  holders_ = holders;
  key_ = key;
  for (uint64_t h : hashes_) tell(h, true);
  for (uint64_t h : predicted_order_) tell(h, true);
}

void PrefixIndex::detach() {
  for (uint64_t h : hashes_) tell(h, false);
  for (uint64_t h : predicted_order_) tell(h, false);
  holders_ = nullptr;
}

void PrefixIndex::insert_held(uint64_t hash) {
  const bool was = holds(hash);
  hashes_.insert(hash);
  if (!was) tell(hash, true);
}

void PrefixIndex::erase_held(uint64_t hash) {
  if (hashes_.erase(hash) && !holds(hash)) tell(hash, false);
}

void PrefixIndex::clear_held() {
  for (uint64_t h : hashes_)
    if (!predicted_.count(h)) tell(h, false);
  hashes_.clear();
}

void PrefixIndex::unpredict(uint64_t hash) {
  auto it = predicted_.find(hash);
  if (it == predicted_.end()) return;
  predicted_order_.erase(it->second);
  predicted_.erase(it);
  if (!hashes_.count(hash)) tell(hash, false);
}

void PrefixIndex::predict(const std::vector<uint64_t>& hashes) {
  for (uint64_t h : hashes) {
    if (hashes_.count(h)) continue;
    unpredict(h);  // (to the back: the newest)
    predicted_order_.push_back(h);
    predicted_[h] = std::prev(predicted_order_.end());
    tell(h, true);
    if (predicted_.size() > capacity_) unpredict(predicted_order_.front());
  }
}

PrefixIndex::Applied PrefixIndex::apply(const KvEvents& events) {
  if (events.snapshot) {
    clear_held();
    if (events.stored.size() <= capacity_)
      for (uint64_t h : events.stored) insert_held(h);
    for (uint64_t h : hashes_) unpredict(h);
    seq_ = events.seq;
    synced_ = true;
    return Applied::applied;
  }
  if (!synced_ || events.seq <= seq_) return Applied::ignored;
  if (events.seq != seq_ + 1) {
    clear_held();
    synced_ = false;
    return Applied::resync;
  }
  for (uint64_t h : events.removed) {
    erase_held(h);
    unpredict(h);
  }
  for (uint64_t h : events.stored) {
    insert_held(h);
    unpredict(h);
    if (hashes_.size() > capacity_) {  // more blocks than the pool has: not what the worker holds
      clear_held();
      synced_ = false;
      return Applied::resync;
    }
  }
  seq_ = events.seq;
  return Applied::applied;
}

int PrefixIndex::matched(const std::vector<uint64_t>& hashes) const {
  int n = 0;
  while (size_t(n) < hashes.size() && holds(hashes[size_t(n)])) ++n;
  return n;
}

std::optional<WorkerKey> SessionAffinity::find(const std::string& session) {
  auto it = index_.find(session);
  if (it == index_.end()) return std::nullopt;
  order_.splice(order_.begin(), order_, it->second);
  return it->second->second;
}

void SessionAffinity::remember(const std::string& session, WorkerKey worker) {
  if (capacity_ == 0 || session.empty()) return;
  auto it = index_.find(session);
  if (it != index_.end()) {
    it->second->second = worker;
    order_.splice(order_.begin(), order_, it->second);
    return;
  }
  if (index_.size() >= capacity_) {
    index_.erase(order_.back().first);
    order_.pop_back();
  }
  order_.emplace_front(session, worker);
  index_[session] = order_.begin();
}

void SessionAffinity::forget_worker(WorkerKey worker) {
  for (auto it = order_.begin(); it != order_.end();) {
    if (it->second == worker) {
      index_.erase(it->first);
      it = order_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace disagg
