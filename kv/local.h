// The KV "transport" of a colocated worker (node role `worker`): its prefill
// and decode actors share one compute actor, whose engine computes the prompt
// straight into the reserved blocks of its own pool (gpu::Engine::
// prefill_chunk), a chunk at a time between decode steps. Nothing crosses a
// process or a socket, and nothing is copied.
//
// It keeps the shape of the streamed transfer (kv/plane.h): the decode actor
// registers the reserved blocks under a fresh transfer id before answering
// the router (the receiver allocates first), the compute claims them when the
// prefill starts, and the prefill worker's commit names the id. An id nobody
// registered (or one already claimed or cancelled) is refused, and nothing is
// computed.
//
// Why a cancel cannot let a chunk write blocks that another request holds:
// the decode actor cancels the registration before it frees the blocks, and
// the compute looks whether the registration is alive before each chunk. A
// chunk already running when the cancel comes finishes first: every later
// user of those blocks (another request's prefill, a decode step) is work of
// the same compute actor, which runs its messages one after another.
#pragma once
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace disagg::kv {

// Thread-safe: the decode actor registers and cancels, the compute actor
// claims, looks and releases.
class LocalKvTargets {
 public:
  // The prompt's blocks of a reservation, in order.
  void expect(uint64_t transfer_id, std::vector<int32_t> blocks) {
    std::lock_guard<std::mutex> lock(mutex_);
    targets_[transfer_id] = Target{std::move(blocks), false};
  }
  // The blocks registered under `transfer_id`, once: nullopt when none are
  // (never registered, claimed already, or cancelled). The registration
  // stays alive until released or cancelled.
  std::optional<std::vector<int32_t>> claim(uint64_t transfer_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = targets_.find(transfer_id);
    if (it == targets_.end() || it->second.claimed) return std::nullopt;
    it->second.claimed = true;
    return it->second.blocks;
  }
  // Whether the blocks of a claimed registration may still be written (the
  // decode actor has not cancelled it).
  bool alive(uint64_t transfer_id) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return targets_.count(transfer_id) != 0;
  }
  // The compute is done with it (written, or stopped).
  void release(uint64_t transfer_id) { cancel(transfer_id); }
  // Forgets a registration (the reservation ended): not claimed, it never
  // will be; claimed, the compute writes no further chunk into its blocks.
  void cancel(uint64_t transfer_id) {
    std::lock_guard<std::mutex> lock(mutex_);
    targets_.erase(transfer_id);
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return targets_.size();
  }

 private:
  struct Target {
    std::vector<int32_t> blocks;
    bool claimed = false;
  };
  mutable std::mutex mutex_;
  std::unordered_map<uint64_t, Target> targets_;
};

}  // namespace disagg::kv
