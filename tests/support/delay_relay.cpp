#include "support/delay_relay.h"

#include <signal.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <time.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <stdexcept>

namespace disagg::test {

namespace {

using Clock = std::chrono::steady_clock;

// How often a waiting thread looks at the stop flag.
constexpr int kStopPollMs = 50;
constexpr size_t kChunkBytes = 64 * 1024;

sockaddr_in address_of(const std::string& host, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) throw std::runtime_error("not an IPv4 address: " + host);
  return a;
}

bool write_all(int fd, const char* data, size_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    data += w;
    n -= size_t(w);
  }
  return true;
}

}  // namespace

DelayRelay::DelayRelay(const std::string& listen_host, uint16_t listen_port, const std::string& target_host,
                       uint16_t target_port, std::chrono::microseconds delay)
    : target_host_(target_host), target_port_(target_port), delay_(delay) {
  listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener_ < 0) throw std::runtime_error(std::string("relay socket: ") + std::strerror(errno));
  const int one = 1;
  ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a = address_of(listen_host, listen_port);
  if (::bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listener_, 64) != 0) {
    const std::string why = std::strerror(errno);
    ::close(listener_);
    throw std::runtime_error("relay cannot listen on " + listen_host + ":" + std::to_string(listen_port) + ": " + why);
  }
  socklen_t len = sizeof a;
  ::getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len);
  port_ = ntohs(a.sin_port);
  acceptor_ = std::thread([this] { accept_loop(); });
}

DelayRelay::~DelayRelay() {
  stopping_ = true;
  acceptor_.join();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (int fd : sockets_) ::shutdown(fd, SHUT_RDWR);
  }
  for (std::thread& t : threads_) t.join();
  for (int fd : sockets_) ::close(fd);
  ::close(listener_);
}

void DelayRelay::accept_loop() {
  while (!stopping_) {
    pollfd p{listener_, POLLIN, 0};
    if (::poll(&p, 1, kStopPollMs) <= 0) continue;
    const int client = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    const int upstream = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in target = address_of(target_host_, target_port_);
    if (upstream < 0 || ::connect(upstream, reinterpret_cast<sockaddr*>(&target), sizeof target) != 0) {
      ::close(client);
      if (upstream >= 0) ::close(upstream);
      continue;
    }
    const int one = 1;
    ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ::setsockopt(upstream, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    ++connections_;
    std::lock_guard<std::mutex> lock(mutex_);
    sockets_.push_back(client);
    sockets_.push_back(upstream);
    threads_.emplace_back([this, client, upstream] { pump(client, upstream); });
    threads_.emplace_back([this, client, upstream] { pump(upstream, client); });
  }
}

// Reads what `from` sends, stamps it, and writes each chunk to `to` once it
// is `delay_` old; `from`'s end goes on as a half-close after its bytes.
void DelayRelay::pump(int from, int to) {
  struct Chunk {
    Clock::time_point due;
    std::string bytes;
  };
  std::deque<Chunk> queue;
  bool ended = false;
  std::vector<char> buffer(kChunkBytes);
  while (!stopping_) {
    const auto now = Clock::now();
    while (!queue.empty() && queue.front().due <= now) {
      if (!write_all(to, queue.front().bytes.data(), queue.front().bytes.size())) {
        ::shutdown(from, SHUT_RDWR);  // the other side is gone: so is this direction
        return;
      }
      bytes_ += int64_t(queue.front().bytes.size());
      queue.pop_front();
    }
    if (ended && queue.empty()) {
      ::shutdown(to, SHUT_WR);
      return;
    }
    auto wait = std::chrono::microseconds(kStopPollMs * 1000);
    if (!queue.empty())
      wait = std::min(wait, std::chrono::ceil<std::chrono::microseconds>(queue.front().due - now));
    wait = std::max(wait, std::chrono::microseconds(0));
    const timespec ts{time_t(wait.count() / 1000000), long(wait.count() % 1000000) * 1000};
    // (ended: nothing to read, only to wait for the queue's next chunk)
    pollfd p{from, POLLIN, 0};
    if (::ppoll(&p, ended ? 0 : 1, &ts, nullptr) <= 0 || ended) continue;
    const ssize_t n = ::recv(from, buffer.data(), buffer.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ended = true;
      continue;
    }
    queue.push_back({Clock::now() + delay_, std::string(buffer.data(), size_t(n))});
  }
}

}  // namespace disagg::test
