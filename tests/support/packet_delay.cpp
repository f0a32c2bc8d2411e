#include "support/packet_delay.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <stdexcept>
#include <vector>

namespace disagg::test {

namespace {

using Clock = std::chrono::steady_clock;

// struct virtio_net_hdr (linux/virtio_net.h, which C++ cannot include: a
// member there is named `class`): what PACKET_VNET_HDR puts before a frame.
constexpr size_t kVnetHeaderBytes = 10;
// How often a waiting thread looks at the stop flag.
constexpr int kStopPollMs = 50;
// The largest frame: a TCP segment the kernel has not cut yet (64 KiB and
// its headers) behind its offload header.
constexpr size_t kFrameBytes = 128 * 1024;
// Room in each socket for the frames of a fast link's delay (10 Gbit/s
// with 1 ms: 1.25 MB) while the thread is busy.
constexpr int kSocketBuffer = 32 << 20;

// A packet socket on `name` that reads what arrives there (not what it
// sends) and sends there, frames behind their virtio_net_hdr.
int open_interface(const std::string& name) {
  const unsigned index = ::if_nametoindex(name.c_str());
  if (index == 0) throw std::runtime_error("PacketDelay: no interface " + name + ": " + std::strerror(errno));
  const int fd = ::socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC, htons(ETH_P_ALL));
  if (fd < 0) throw std::runtime_error(std::string("PacketDelay: packet socket: ") + std::strerror(errno));
  const int one = 1;
  const bool ok = ::setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one) == 0 &&
                  ::setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one) == 0 &&
                  ::setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &kSocketBuffer, sizeof kSocketBuffer) == 0 &&
                  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &kSocketBuffer, sizeof kSocketBuffer) == 0;
  sockaddr_ll at{};
  at.sll_family = AF_PACKET;
  at.sll_protocol = htons(ETH_P_ALL);
  at.sll_ifindex = int(index);
  if (!ok || ::bind(fd, reinterpret_cast<sockaddr*>(&at), sizeof at) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("PacketDelay: cannot open " + name + ": " + why);
  }
  return fd;
}

}  // namespace

PacketDelay::PacketDelay(const std::string& netns, const std::string& a, const std::string& b,
                         std::chrono::microseconds delay)
    : delay_(delay) {
  // The sockets are made on a thread that enters the namespace (setns moves
  // the calling thread only); they stay in it wherever they are used.
  std::string error;
  std::thread opener([&] {
    const int ns = ::open(netns.c_str(), O_RDONLY | O_CLOEXEC);
    if (ns < 0 || ::setns(ns, CLONE_NEWNET) != 0) {
      error = "PacketDelay: cannot enter " + netns + ": " + std::strerror(errno);
      if (ns >= 0) ::close(ns);
      return;
    }
    ::close(ns);
    try {
      a_ = open_interface(a);
      b_ = open_interface(b);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  opener.join();
  if (!error.empty()) {
    if (a_ >= 0) ::close(a_);
    if (b_ >= 0) ::close(b_);
    throw std::runtime_error(error);
  }
  forth_ = std::thread([this] { pump(a_, b_); });
  back_ = std::thread([this] { pump(b_, a_); });
}

PacketDelay::~PacketDelay() {
  stopping_ = true;
  forth_.join();
  back_.join();
  ::close(a_);
  ::close(b_);
}

// Reads each frame that arrives on `from`, stamps it, and sends it on `to`
// once it is `delay_` old.
void PacketDelay::pump(int from, int to) {
  struct Frame {
    Clock::time_point due;
    std::vector<char> bytes;
  };
  std::deque<Frame> queue;
  std::vector<char> buffer(kFrameBytes);
  while (!stopping_) {
    const auto now = Clock::now();
    while (!queue.empty() && queue.front().due <= now) {
      const std::vector<char>& f = queue.front().bytes;
      // (a refusal, e.g. the far queue full, drops the frame: a link's loss)
      if (::send(to, f.data(), f.size(), MSG_DONTWAIT) == ssize_t(f.size())) ++frames_;
      queue.pop_front();
    }
    auto wait = std::chrono::microseconds(kStopPollMs * 1000);
    if (!queue.empty()) wait = std::min(wait, std::chrono::ceil<std::chrono::microseconds>(queue.front().due - now));
    wait = std::max(wait, std::chrono::microseconds(0));
    const timespec ts{time_t(wait.count() / 1000000), long(wait.count() % 1000000) * 1000};
    pollfd p{from, POLLIN, 0};
    if (::ppoll(&p, 1, &ts, nullptr) <= 0) continue;
    // Everything that has arrived, each stamped as it is read.
    for (;;) {
      const ssize_t n = ::recv(from, buffer.data(), buffer.size(), MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      if (size_t(n) <= kVnetHeaderBytes) continue;
      queue.push_back({Clock::now() + delay_, std::vector<char>(buffer.data(), buffer.data() + n)});
    }
  }
}

}  // namespace disagg::test
