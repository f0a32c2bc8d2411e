#include "cluster/raw_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>

#include "cluster/child_process.h"
#include "cluster/cluster_fixture.h"

namespace disagg::test {

using Clock = std::chrono::steady_clock;

int listen_on_loopback(uint16_t& port, int backlog) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof at;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0 || ::listen(fd, backlog) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
    ::close(fd);
    return -1;
  }
  port = ntohs(at.sin_port);
  return fd;
}

int connect_to(uint16_t port, const std::string& from) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in local{};
  local.sin_family = AF_INET;
  ::inet_pton(AF_INET, from.c_str(), &local.sin_addr);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&local), sizeof local) != 0 ||
      ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::string basp_header(uint32_t payload, uint8_t operation) {
  std::string h(32, '\0');
  h[0] = char(operation);
  for (int i = 0; i < 4; ++i) h[4 + i] = char((payload >> (8 * (3 - i))) & 0xff);
  return h;
}

bool send_all(int fd, const std::string& bytes) {
  return ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size());
}

bool closed_by_peer(int fd, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  char buf[512];
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return true;
  }
  return false;
}

std::string record_client_handshake(uint16_t router_port) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (::bind(listener, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 || ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(listener);
    return {};
  }
  const uint16_t relay_port = ntohs(addr.sin_port);
  std::string recorded;
  std::thread relay([&] {
    pollfd lp{listener, POLLIN, 0};
    if (::poll(&lp, 1, 10000) <= 0) return;
    const int client = ::accept(listener, nullptr, nullptr);
    const int router = connect_to(router_port);
    if (client < 0 || router < 0) {
      if (client >= 0) ::close(client);
      if (router >= 0) ::close(router);
      return;
    }
    // Relays both ways until either side closes (bounded: 10 s).
    std::string up;
    char buf[4096];
    for (const auto deadline = Clock::now() + std::chrono::seconds(10); Clock::now() < deadline;) {
      pollfd p[2] = {{client, POLLIN, 0}, {router, POLLIN, 0}};
      if (::poll(p, 2, 100) <= 0) continue;
      bool done = false;
      for (int i = 0; i < 2 && !done; ++i) {
        if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const ssize_t n = ::recv(p[i].fd, buf, sizeof buf, 0);
        if (n <= 0) {
          done = true;
          break;
        }
        if (i == 0) up.append(buf, size_t(n));
        send_all(i == 0 ? router : client, std::string(buf, size_t(n)));
      }
      if (done) break;
    }
    ::close(client);
    ::close(router);
    if (up.size() < 32) return;
    uint32_t payload = 0;
    for (int i = 0; i < 4; ++i) payload = (payload << 8) | static_cast<unsigned char>(up[4 + i]);
    if (up.size() >= 32 + size_t(payload)) recorded = up.substr(0, 32 + payload);
  });
  std::string out, err;
  run_to_completion({client_binary(), "--router", "127.0.0.1:" + std::to_string(relay_port), "--status"}, out, err,
                    std::chrono::seconds(15));
  relay.join();
  ::close(listener);
  return recorded;
}

}  // namespace disagg::test
