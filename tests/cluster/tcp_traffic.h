// How many bytes went over which TCP connection of which process: read from
// `ss -tinp` (iproute2), i.e. the kernel's own counters (tcp_info), so a test
// can see which node's connections the KV actually travelled over.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace disagg::test {

struct TcpConnection {
  pid_t pid = 0;  // the process holding this end
  uint16_t local_port = 0;
  uint16_t remote_port = 0;
  uint64_t bytes_sent = 0;      // acknowledged by the peer
  uint64_t bytes_received = 0;
};

// Every established TCP connection of every process this user can see;
// nullopt when `ss` cannot be run.
std::optional<std::vector<TcpConnection>> established_connections();

}  // namespace disagg::test
