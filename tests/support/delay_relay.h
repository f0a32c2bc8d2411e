// A TCP relay that delays every byte by a fixed time each way: the latency
// of a link between hosts, which this kernel cannot add (it has no netem).
// It listens on one address and port and connects each accepted connection
// to a target; bytes keep their order, each chunk leaves `delay` after it
// arrived (so a round trip through it takes at least twice that). A closed
// side is passed on as a half-close once its bytes are out. Everything stops
// with the relay: its threads join, its sockets close.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace disagg::test {

class DelayRelay {
 public:
  // Throws std::runtime_error when it cannot listen there.
  DelayRelay(const std::string& listen_host, uint16_t listen_port, const std::string& target_host,
             uint16_t target_port, std::chrono::microseconds delay);
  ~DelayRelay();
  DelayRelay(const DelayRelay&) = delete;
  DelayRelay& operator=(const DelayRelay&) = delete;

  uint16_t port() const { return port_; }
  int connections() const { return connections_.load(); }  // accepted so far
  int64_t bytes() const { return bytes_.load(); }         // relayed so far, both ways

 private:
  void accept_loop();
  void pump(int from, int to);  // one direction, until `from` ends or the relay stops

  std::string target_host_;
  uint16_t target_port_;
  std::chrono::microseconds delay_;
  int listener_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int> connections_{0};
  std::atomic<int64_t> bytes_{0};
  std::mutex mutex_;
  std::vector<int> sockets_;          // every connection's two sockets, closed at the end
  std::vector<std::thread> threads_;  // two per connection
  std::thread acceptor_;
};

}  // namespace disagg::test
