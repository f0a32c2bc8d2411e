#include "kv/address.h"

#include <netdb.h>
#include <netinet/in.h>

#include <cstring>
#include <limits>

#include "kv/transfer.h"

namespace disagg::kv::detail {

HostPort parse_address(const std::string& address) {
  const auto bad = [&](const char* why) {
    return KvError(KvErrc::invalid_argument, "KV address \"" + address + "\": " + why);
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size()) {
    throw bad("expected host:port");
  }
  HostPort out;
  out.host = address.substr(0, colon);
  if (out.host.front() == '[') {  // [v6]:port
    if (out.host.size() < 3 || out.host.back() != ']') throw bad("unbalanced brackets");
    out.host = out.host.substr(1, out.host.size() - 2);
  } else if (out.host.find(':') != std::string::npos) {
    throw bad("an IPv6 address needs brackets: [host]:port");  // (fe80::1:4700 names no port for sure)
  }
  const std::string port = address.substr(colon + 1);
  unsigned long value = 0;
  for (char c : port) {
    if (c < '0' || c > '9') throw bad("the port is not a number");
    value = value * 10 + unsigned(c - '0');
    if (value > std::numeric_limits<uint16_t>::max()) throw bad("the port is out of range");
  }
  if (value == 0) throw bad("port 0 cannot be dialled");
  out.port = uint16_t(value);
  return out;
}

std::string format_address(const std::string& host, uint16_t port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

SocketAddress resolve(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw KvError(KvErrc::unreachable, "KV address " + format_address(host, port) +
                                            ": cannot resolve the host: " + gai_strerror(rc));
  }
  SocketAddress out;
  std::memcpy(&out.storage, found->ai_addr, found->ai_addrlen);
  out.length = found->ai_addrlen;
  freeaddrinfo(found);
  return out;
}

uint16_t port_of(const sockaddr_storage& address) {
  if (address.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(address).sin_port);
  if (address.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(address).sin6_port);
  return 0;
}

}  // namespace disagg::kv::detail
