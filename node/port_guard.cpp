#include "node/port_guard.h"

#include <array>
#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include <boost/asio.hpp>

#include "caf/binary_deserializer.hpp"
#include "caf/io/basp/header.hpp"
#include "metrics/disagg_metrics.h"

namespace disagg {

namespace net = boost::asio;
using tcp = net::ip::tcp;

namespace {

constexpr size_t kRelayBuffer = size_t(64) << 10;  // bytes per read, each direction
// A refusal is logged the first time and then every kLogEvery-th time of its kind.
constexpr uint64_t kLogEvery = 1000;

}  // namespace

const char* to_string(GuardRefusal reason) {
  switch (reason) {
    case GuardRefusal::connection_cap: return "connection_cap";
    case GuardRefusal::message_too_large: return "message_too_large";
    case GuardRefusal::bad_header: return "bad_header";
    case GuardRefusal::handshake_timeout: return "handshake_timeout";
  }
  return "unknown";
}

// Members in this order: destroying `io` destroys the sessions its pending
// handlers hold, and they still count themselves out of `active`.
struct PortGuard::Impl {
  PortGuardOptions options;
  Log log;
  std::atomic<int> active{0};
  std::array<std::atomic<uint64_t>, 4> refusals{};
  net::io_context io;
  tcp::acceptor acceptor{io};
  std::thread thread;

  void refuse(GuardRefusal reason, const std::string& who, const std::string& detail) {
    metrics::disagg_metrics().connections_closed.with({to_string(reason)}).inc();
    const uint64_t n = ++refusals[size_t(reason)];
    if (n == 1 || n % kLogEvery == 0)
      log("closed connection from " + who + ": " + detail + " (" + to_string(reason) + ", " + std::to_string(n) +
          " so far)");
  }

  void accept();
};

namespace {

// One relayed connection: peer <-> CAF's port on loopback.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(PortGuard::Impl* guard, tcp::socket peer)
      : guard_(guard), peer_(std::move(peer)), caf_(guard_->io), timer_(guard_->io),
        up_(kRelayBuffer), down_(kRelayBuffer) {
    boost::system::error_code ec;
    const auto remote = peer_.remote_endpoint(ec);
    who_ = ec ? "?" : remote.address().to_string() + ":" + std::to_string(remote.port());
  }

  ~Session() { guard_->active--; }

  void start() {
    auto self = shared_from_this();
    timer_.expires_after(guard_->options.handshake_timeout);
    timer_.async_wait([self](const boost::system::error_code& ec) {
      if (ec || self->handshaken_) return;
      self->guard_->refuse(GuardRefusal::handshake_timeout, self->who_,
                           guard_timeout_text(self->guard_->options));
      self->close();
    });
    // No Nagle on either side (CAF sets TCP_NODELAY on its own sockets): a
    // relayed message is written as header, then payload, and with Nagle the
    // second write waits for the peer's delayed ACK (40 ms per message).
    boost::system::error_code ignored;
    peer_.set_option(tcp::no_delay(true), ignored);
    caf_.async_connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), guard_->options.target_port),
                       [self](const boost::system::error_code& ec) {
                         if (ec) return self->close();
                         boost::system::error_code nodelay_ignored;
                         self->caf_.set_option(tcp::no_delay(true), nodelay_ignored);
                         self->pump_down();
                         if (self->guard_->options.inspect) self->read_header();
                         else self->pump_up();
                       });
  }

 private:
  static std::string guard_timeout_text(const PortGuardOptions& o) {
    return std::string(o.inspect ? "no complete handshake" : "no byte") + " within " +
           std::to_string(o.handshake_timeout.count()) + " ms";
  }

  // Peer -> CAF, inspecting: one BASP header, checked, then its payload.
  void read_header() {
    auto self = shared_from_this();
    net::async_read(peer_, net::buffer(header_), [self](const boost::system::error_code& ec, size_t) {
      if (ec) return self->close();
      caf::io::basp::header hdr;
      caf::binary_deserializer source{nullptr, self->header_.data(), self->header_.size()};
      if (auto err = source(hdr); err || !caf::io::basp::valid(hdr)) {
        self->guard_->refuse(GuardRefusal::bad_header, self->who_, "not a valid BASP header");
        return self->close();
      }
      if (hdr.payload_len > self->guard_->options.max_message_bytes) {
        self->guard_->refuse(GuardRefusal::message_too_large, self->who_,
                             "announced a message of " + std::to_string(hdr.payload_len) + " bytes (max " +
                                 std::to_string(self->guard_->options.max_message_bytes) + ")");
        return self->close();
      }
      net::async_write(self->caf_, net::buffer(self->header_),
                       [self, left = uint64_t(hdr.payload_len)](const boost::system::error_code& wec, size_t) {
                         if (wec) return self->close();
                         self->relay_payload(left);
                       });
    });
  }

  void relay_payload(uint64_t left) {
    auto self = shared_from_this();
    if (left == 0) {
      if (!handshaken_) {
        handshaken_ = true;  // the first message is the peer's BASP handshake
        timer_.cancel();
      }
      return read_header();
    }
    const size_t want = size_t(std::min<uint64_t>(left, up_.size()));
    peer_.async_read_some(net::buffer(up_.data(), want), [self, left](const boost::system::error_code& ec, size_t n) {
      if (ec) return self->close();
      net::async_write(self->caf_, net::buffer(self->up_.data(), n),
                       [self, left, n](const boost::system::error_code& wec, size_t) {
                         if (wec) return self->close();
                         self->relay_payload(left - n);
                       });
    });
  }

  // Peer -> CAF without inspection (TLS): bytes as they come.
  void pump_up() {
    auto self = shared_from_this();
    peer_.async_read_some(net::buffer(up_), [self](const boost::system::error_code& ec, size_t n) {
      if (ec) return self->close();
      if (!self->handshaken_) {
        self->handshaken_ = true;
        self->timer_.cancel();
      }
      net::async_write(self->caf_, net::buffer(self->up_.data(), n), [self](const boost::system::error_code& wec, size_t) {
        if (wec) return self->close();
        self->pump_up();
      });
    });
  }

  // CAF -> peer: bytes as they come.
  void pump_down() {
    auto self = shared_from_this();
    caf_.async_read_some(net::buffer(down_), [self](const boost::system::error_code& ec, size_t n) {
      if (ec) return self->close();
      net::async_write(self->peer_, net::buffer(self->down_.data(), n),
                       [self](const boost::system::error_code& wec, size_t) {
                         if (wec) return self->close();
                         self->pump_down();
                       });
    });
  }

  void close() {
    boost::system::error_code ignored;
    timer_.cancel();
    peer_.shutdown(tcp::socket::shutdown_both, ignored);
    peer_.close(ignored);
    caf_.shutdown(tcp::socket::shutdown_both, ignored);
    caf_.close(ignored);
  }

  PortGuard::Impl* guard_;  // outlives every session (see Impl)
  tcp::socket peer_, caf_;
  net::steady_timer timer_;
  std::array<char, caf::io::basp::header_size> header_{};
  std::vector<char> up_, down_;
  bool handshaken_ = false;
  std::string who_;
};

}  // namespace

void PortGuard::Impl::accept() {
  auto* self = this;
  acceptor.async_accept([self](const boost::system::error_code& ec, tcp::socket peer) {
    if (ec == net::error::operation_aborted) return;
    if (!ec) {
      if (self->active.load() >= self->options.max_connections) {
        boost::system::error_code rec;
        const auto remote = peer.remote_endpoint(rec);
        self->refuse(GuardRefusal::connection_cap,
                     rec ? "?" : remote.address().to_string() + ":" + std::to_string(remote.port()),
                     std::to_string(self->options.max_connections) + " connections open (max-connections)");
        boost::system::error_code ignored;
        peer.close(ignored);
      } else {
        self->active++;
        std::make_shared<Session>(self, std::move(peer))->start();
      }
    }
    self->accept();
  });
}

PortGuard::PortGuard(const PortGuardOptions& options, Log log) : impl_(std::make_unique<Impl>()) {
  impl_->options = options;
  impl_->log = std::move(log);
  boost::system::error_code ec;
  const tcp::endpoint at(net::ip::make_address(options.listen_host, ec), options.listen_port);
  if (ec) throw std::runtime_error("cannot listen on " + options.listen_host + ": " + ec.message());
  impl_->acceptor.open(at.protocol(), ec);
  if (!ec) impl_->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl_->acceptor.bind(at, ec);
  if (!ec) impl_->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec)
    throw std::runtime_error("cannot listen on " + options.listen_host + ":" + std::to_string(options.listen_port) +
                             ": " + ec.message());
  impl_->accept();
  impl_->thread = std::thread([impl = impl_.get()] { impl->io.run(); });
}

PortGuard::~PortGuard() {
  impl_->io.stop();
  impl_->thread.join();
}

uint16_t PortGuard::port() const { return impl_->acceptor.local_endpoint().port(); }

int PortGuard::connections() const { return impl_->active.load(); }

}  // namespace disagg
