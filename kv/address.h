// Internal: "host:port" strings <-> socket addresses, for the UCX listener
// (receiver) and the client-server endpoint (sender).
#pragma once
#include <sys/socket.h>

#include <cstdint>
#include <string>

namespace disagg::kv::detail {

struct HostPort {
  std::string host;
  uint16_t port = 0;
};

// "host:port", "[v6-address]:port"; throws KvError (invalid_argument).
HostPort parse_address(const std::string& address);
// "host:port", with brackets around an IPv6 host.
std::string format_address(const std::string& host, uint16_t port);

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
};

// Resolves a host name or numeric address (first result, IPv4 or IPv6);
// throws KvError (invalid_argument when it does not parse, unreachable when the
// name does not resolve).
SocketAddress resolve(const std::string& host, uint16_t port);

// The port of a bound socket address.
uint16_t port_of(const sockaddr_storage& address);

}  // namespace disagg::kv::detail
