// The KV "transport" of a colocated worker (node role `worker`): its prefill
// and decode actors share one compute actor, whose engine computes the prompt
// and whose pool holds the decode blocks, so the prompt's KV is copied from
// the prefill cache straight into the reserved blocks, layer by layer, on the
// compute actor's own thread. Nothing crosses a process or a socket.
//
// It keeps the shape of the streamed transfer (kv/plane.h): the decode actor
// registers the reserved blocks under a fresh transfer id before answering
// the router (the receiver allocates first), the compute takes them when the
// prefill starts, and the prefill worker's commit names the id. An id nobody
// registered (or one already taken or cancelled) writes nothing.
//
// Why the blocks may be written after the decode actor gave them up (a cancel
// while the prefill runs): every later user of them (another request's
// prefill, a decode step) is work of the same compute actor, which runs its
// messages one after another, so it starts only after this write is done.
#pragma once
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace disagg::kv {

// Thread-safe: the decode actor registers and cancels, the compute actor takes.
class LocalKvTargets {
 public:
  // The prompt's blocks of a reservation, in order (gpu::KvPool::stream_spans).
  void expect(uint64_t transfer_id, std::vector<int32_t> blocks) {
    std::lock_guard<std::mutex> lock(mutex_);
    targets_[transfer_id] = std::move(blocks);
  }
  // The blocks registered under `transfer_id`, once: nullopt when none are
  // (never registered, taken, or cancelled).
  std::optional<std::vector<int32_t>> take(uint64_t transfer_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = targets_.find(transfer_id);
    if (it == targets_.end()) return std::nullopt;
    std::vector<int32_t> blocks = std::move(it->second);
    targets_.erase(it);
    return blocks;
  }
  // Forgets a registration not taken yet (the reservation ended first).
  void cancel(uint64_t transfer_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    targets_.erase(transfer_id);
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return targets_.size();
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<uint64_t, std::vector<int32_t>> targets_;
};

}  // namespace disagg::kv
