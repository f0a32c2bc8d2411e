// A link's latency at the packet level, which this kernel cannot add (it
// has no netem) and a TCP relay cannot give every connection (UCX's KV
// connections go to the peer's own addresses and ports): frames that
// arrive on interface `a` leave on interface `b` `delay` later, and the
// other way round, as from a wire of that length. Both interfaces belong
// to the network namespace of the file `netns` names (/proc/PID/ns/net);
// NetLab::delay puts a host's address behind such a wire. Frames keep
// their offload metadata (PACKET_VNET_HDR: a TCP segment the kernel has not
// cut or checksummed yet crosses as it is), their order, and their bytes;
// one that the far interface refuses (its queue full) is dropped, as a
// link drops it. Everything stops with the object: its threads join and
// its sockets close.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

namespace disagg::test {

class PacketDelay {
 public:
  // Throws std::runtime_error when it cannot open either interface.
  PacketDelay(const std::string& netns, const std::string& a, const std::string& b, std::chrono::microseconds delay);
  ~PacketDelay();
  PacketDelay(const PacketDelay&) = delete;
  PacketDelay& operator=(const PacketDelay&) = delete;

  int64_t frames() const { return frames_.load(); }  // passed on so far, both ways

 private:
  void pump(int from, int to);  // one direction, until the object stops

  std::chrono::microseconds delay_;
  int a_ = -1, b_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> frames_{0};
  std::thread forth_, back_;
};

}  // namespace disagg::test
