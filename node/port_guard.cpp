#include "node/port_guard.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>
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
using Clock = std::chrono::steady_clock;

std::string address_of(const tcp::socket& s) {
  boost::system::error_code ec;
  const auto remote = s.remote_endpoint(ec);
  return ec ? "?" : remote.address().to_string();
}

}  // namespace

const char* to_string(GuardRefusal reason) {
  switch (reason) {
    case GuardRefusal::connection_cap: return "connection_cap";
    case GuardRefusal::pending_cap: return "pending_cap";
    case GuardRefusal::source_cap: return "source_cap";
    case GuardRefusal::bad_header: return "bad_header";
    case GuardRefusal::message_too_large: return "message_too_large";
    case GuardRefusal::handshake_timeout: return "handshake_timeout";
    case GuardRefusal::message_timeout: return "message_timeout";
    case GuardRefusal::buffer_budget: return "buffer_budget";
  }
  return "unknown";
}

namespace {
class Session;
}

// Members in this order: destroying `io` destroys the sessions its pending
// handlers hold, and they still count themselves out of `active`. Everything
// but `active` is touched on the guard's thread only.
struct PortGuard::Impl {
  PortGuardOptions options;
  Log log;
  std::atomic<int> active{0};
  std::array<std::atomic<uint64_t>, kGuardRefusals> refusals{};
  uint64_t accept_failures = 0;  // (the guard's thread only)
  int pending = 0;                            // sessions in their handshake
  std::map<std::string, std::vector<Session*>> pending_by_source;  // of them per address
  std::set<Session*> collecting;              // sessions holding a buffered message
  int64_t buffered = 0;                       // bytes announced by the messages being collected
  std::map<uint16_t, std::weak_ptr<Session>> by_caf_port;  // local port of each connection to CAF
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
  void tls_accepted(uint16_t caf_port);
  // Room for one more pending connection from `source`, whose share is full:
  // its pending connection that has been silent longest is closed.
  void evict_pending(const std::string& source, const std::string& who);
  // Room for a buffered message of `bytes`: collecting connections silent
  // for at least kStalledCollector are closed, the longest silent first,
  // until it fits (false: it does not, even so).
  bool make_buffer_room(int64_t bytes);
};

namespace {

// Every live guard, for PortGuard::tls_accepted (posted under the lock, so a
// guard is not destroyed meanwhile: its destructor leaves the set first).
std::mutex g_guards_mutex;
std::set<PortGuard::Impl*> g_guards;

// One relayed connection: peer <-> CAF's port on loopback.
class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(PortGuard::Impl* guard, tcp::socket peer, std::string source)
      : guard_(guard), peer_(std::move(peer)), caf_(guard_->io), timer_(guard_->io), source_(std::move(source)),
        up_(kRelayBuffer), down_(kRelayBuffer), heard_(Clock::now()) {
    boost::system::error_code ec;
    const auto remote = peer_.remote_endpoint(ec);
    who_ = ec ? "?" : source_ + ":" + std::to_string(remote.port());
    guard_->pending++;
    guard_->pending_by_source[source_].push_back(this);
  }

  ~Session() {
    leave_pending();
    drop_buffer();
    // (A newer session may hold the same loopback port already: only this one's entry goes.)
    if (auto it = guard_->by_caf_port.find(caf_port_); caf_port_ && it != guard_->by_caf_port.end() && it->second.expired())
      guard_->by_caf_port.erase(it);
    guard_->active--;
  }

  void start() {
    auto self = shared_from_this();
    arm(guard_->options.handshake_timeout, [self] {
      if (self->handshaken_) return;
      self->guard_->refuse(GuardRefusal::handshake_timeout, self->who_,
                           std::string(self->guard_->options.inspect ? "no complete BASP handshake"
                                                                     : "no complete TLS handshake") +
                               " within " + std::to_string(self->guard_->options.handshake_timeout.count()) + " ms");
      self->close();
    });
    // No Nagle on either side (CAF sets TCP_NODELAY on its own sockets): a
    // relayed message is written as header, then payload, and with Nagle the
    // second write waits for the peer's delayed ACK (40 ms per message).
    boost::system::error_code ignored;
    peer_.set_option(tcp::no_delay(true), ignored);
    caf_.async_connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), guard_->options.target_port),
                       [self](const boost::system::error_code& ec) {
                         if (ec || self->closed_) return self->close();
                         boost::system::error_code local_ec;
                         self->caf_.set_option(tcp::no_delay(true), local_ec);
                         const auto local = self->caf_.local_endpoint(local_ec);
                         if (!local_ec) {
                           self->caf_port_ = local.port();
                           self->guard_->by_caf_port[self->caf_port_] = self;
                         }
                         self->pump_down();
                         if (self->guard_->options.inspect) self->read_header();
                         else self->pump_up();
                       });
  }

  // TLS: CAF completed the handshake of this connection.
  void tls_accepted() { end_handshake(); }

  // When the peer last sent bytes (or connected), and how many it sent.
  Clock::time_point heard() const { return heard_; }
  uint64_t received() const { return received_; }
  const std::string& who() const { return who_; }

  // Closes the connection now and gives back its pending slot and buffered
  // bytes at once (not when its handlers have run out), so that the
  // connection this makes room for can take them.
  void close() {
    closed_ = true;
    leave_pending();
    drop_buffer();
    boost::system::error_code ignored;
    timer_.cancel();
    peer_.shutdown(tcp::socket::shutdown_both, ignored);
    peer_.close(ignored);
    caf_.shutdown(tcp::socket::shutdown_both, ignored);
    caf_.close(ignored);
  }

 private:
  void heard_from_peer(size_t n) {
    heard_ = Clock::now();
    received_ += n;
  }

  // Leaves the pending connections (once: at the end of the handshake or at close).
  void leave_pending() {
    if (!pending_) return;
    pending_ = false;
    guard_->pending--;
    auto it = guard_->pending_by_source.find(source_);
    if (it == guard_->pending_by_source.end()) return;
    auto& list = it->second;
    list.erase(std::remove(list.begin(), list.end(), this), list.end());
    if (list.empty()) guard_->pending_by_source.erase(it);
  }

  // Gives back the buffered message's bytes (its announced length) to the guard's budget.
  void drop_buffer() {
    guard_->buffered -= collecting_;
    collecting_ = 0;
    guard_->collecting.erase(this);
  }

  void end_handshake() {
    if (handshaken_) return;
    handshaken_ = true;
    leave_pending();
    timer_.cancel();
  }

  // The one deadline a session has at a time (the handshake's, then a
  // buffered message's): `expired` runs unless it was re-armed or cancelled.
  template <class Fn>
  void arm(std::chrono::milliseconds after, Fn expired) {
    timer_.expires_after(after);
    timer_.async_wait([expired](const boost::system::error_code& ec) {
      if (!ec) expired();
    });
  }

  // Peer -> CAF, inspecting: one BASP header, checked, then its payload.
  void read_header() {
    auto self = shared_from_this();
    net::async_read(peer_, net::buffer(header_), [self](const boost::system::error_code& ec, size_t n) {
      if (ec) return self->close();
      self->heard_from_peer(n);
      caf::io::basp::header hdr;
      caf::binary_deserializer source{nullptr, self->header_.data(), self->header_.size()};
      if (auto err = source(hdr); err || !caf::io::basp::valid(hdr)) {
        self->guard_->refuse(GuardRefusal::bad_header, self->who_, "not a valid BASP header");
        return self->close();
      }
      if (!self->handshaken_ && hdr.operation != caf::io::basp::message_type::client_handshake) {
        self->guard_->refuse(GuardRefusal::bad_header, self->who_, "a first message that is no BASP client handshake");
        return self->close();
      }
      const uint32_t limit = self->handshaken_ ? self->guard_->options.max_message_bytes : kMaxHandshakeBytes;
      if (hdr.payload_len > limit) {
        self->guard_->refuse(GuardRefusal::message_too_large, self->who_,
                             std::string(self->handshaken_ ? "announced a message of " : "announced a handshake of ") +
                                 std::to_string(hdr.payload_len) + " bytes (max " + std::to_string(limit) + ")");
        return self->close();
      }
      if (hdr.payload_len > kStreamedMessageBytes) return self->collect(hdr.payload_len);
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
      end_handshake();  // the first message is the peer's BASP handshake
      return read_header();
    }
    const size_t want = size_t(std::min<uint64_t>(left, up_.size()));
    peer_.async_read_some(net::buffer(up_.data(), want), [self, left](const boost::system::error_code& ec, size_t n) {
      if (ec) return self->close();
      self->heard_from_peer(n);
      net::async_write(self->caf_, net::buffer(self->up_.data(), n),
                       [self, left, n](const boost::system::error_code& wec, size_t) {
                         if (wec) return self->close();
                         self->relay_payload(left - n);
                       });
    });
  }

  // A payload beyond kStreamedMessageBytes (only after the handshake):
  // collected here as it arrives, then header and payload to CAF at once.
  void collect(uint32_t payload_len) {
    if (!guard_->make_buffer_room(payload_len)) {
      const int64_t left = guard_->options.max_buffered_bytes - guard_->buffered;
      guard_->refuse(GuardRefusal::buffer_budget, who_,
                     "announced a message of " + std::to_string(payload_len) + " bytes; " + std::to_string(left) +
                         " of the " + std::to_string(guard_->options.max_buffered_bytes) +
                         " bytes for buffered messages are free");
      return close();
    }
    collecting_ = payload_len;
    guard_->buffered += collecting_;
    guard_->collecting.insert(this);
    message_.clear();
    auto self = shared_from_this();
    arm(guard_->options.message_timeout, [self] {
      self->guard_->refuse(GuardRefusal::message_timeout, self->who_,
                           std::to_string(self->message_.size()) + " of a message's " +
                               std::to_string(self->collecting_) + " bytes within " +
                               std::to_string(self->guard_->options.message_timeout.count()) + " ms");
      self->close();
    });
    collect_more();
  }

  void collect_more() {
    auto self = shared_from_this();
    if (message_.size() == collecting_) {
      timer_.cancel();
      const std::array<net::const_buffer, 2> both{net::buffer(header_), net::buffer(message_)};
      return net::async_write(caf_, both, [self](const boost::system::error_code& wec, size_t) {
        if (wec) return self->close();
        self->drop_buffer();
        std::vector<char>().swap(self->message_);
        self->read_header();
      });
    }
    const size_t want = std::min(up_.size(), size_t(collecting_) - message_.size());
    peer_.async_read_some(net::buffer(up_.data(), want), [self](const boost::system::error_code& ec, size_t n) {
      if (ec) return self->close();
      self->heard_from_peer(n);
      self->message_.insert(self->message_.end(), self->up_.data(), self->up_.data() + n);
      self->collect_more();
    });
  }

  // Peer -> CAF without inspection (TLS): bytes as they come.
  void pump_up() {
    auto self = shared_from_this();
    peer_.async_read_some(net::buffer(up_), [self](const boost::system::error_code& ec, size_t n) {
      if (ec) return self->close();
      self->heard_from_peer(n);
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

  PortGuard::Impl* guard_;  // outlives every session (see Impl)
  tcp::socket peer_, caf_;
  net::steady_timer timer_;
  std::string source_;  // the peer's address
  std::array<char, caf::io::basp::header_size> header_{};
  std::vector<char> up_, down_;
  std::vector<char> message_;  // a buffered message's payload so far
  uint32_t collecting_ = 0;    // its announced length (counted in guard_->buffered)
  uint16_t caf_port_ = 0;      // local port of the connection to CAF
  Clock::time_point heard_;    // the peer's last bytes (or its connect)
  uint64_t received_ = 0;      // bytes from the peer
  bool pending_ = true;        // counted in the guard's pending connections
  bool handshaken_ = false;
  bool closed_ = false;
  std::string who_;
};

}  // namespace

void PortGuard::Impl::accept() {
  auto* self = this;
  acceptor.async_accept([self](const boost::system::error_code& ec, tcp::socket peer) {
    if (ec == net::error::operation_aborted) return;
    if (!ec) {
      const std::string source = address_of(peer);
      boost::system::error_code rec;
      const auto remote = peer.remote_endpoint(rec);
      const std::string who = rec ? "?" : source + ":" + std::to_string(remote.port());
      const auto& o = self->options;
      const auto from_source = self->pending_by_source.find(source);
      std::optional<GuardRefusal> refusal;
      std::string detail;
      if (self->active.load() >= o.max_connections) {
        refusal = GuardRefusal::connection_cap;
        detail = std::to_string(o.max_connections) + " connections open (max-connections)";
      } else if (self->pending >= o.max_pending) {
        refusal = GuardRefusal::pending_cap;
        detail = std::to_string(o.max_pending) + " connections in their handshake (the share of the slots peers that have not completed one may hold)";
      } else if (from_source != self->pending_by_source.end() &&
                 int(from_source->second.size()) >= o.max_pending_per_source) {
        // Every client behind one NAT or on one host shares an address:
        // refusing the newcomer would let stalled connections lock real
        // peers out. A real handshake takes milliseconds and a staller
        // sends nothing, so the one silent longest makes room.
        self->evict_pending(source, who);
      }
      if (refusal) {
        self->refuse(*refusal, who, detail);
        boost::system::error_code ignored;
        peer.close(ignored);
      } else {
        self->active++;
        std::make_shared<Session>(self, std::move(peer), source)->start();
      }
      self->accept();
      return;
    }
    // (EMFILE: tried again at once, the same error comes back at once) The
    // connections already open keep being served meanwhile.
    const uint64_t n = ++self->accept_failures;
    if (n == 1 || n % kLogEvery == 0)
      self->log("accept failed: " + ec.message() + " (" + std::to_string(n) + " so far); trying again in " +
                std::to_string(metrics::kAcceptRetry.count()) + " ms");
    metrics::accept_later(self->io.get_executor(), [self] { self->accept(); });
  });
}

void PortGuard::Impl::evict_pending(const std::string& source, const std::string& who) {
  // The one that has made the least progress (bytes sent: a real TLS or
  // BASP handshake sends hundreds at once, a staller next to nothing), of
  // those the one silent longest.
  auto& list = pending_by_source.at(source);
  Session* quietest = *std::min_element(list.begin(), list.end(), [](const Session* a, const Session* b) {
    return a->received() != b->received() ? a->received() < b->received() : a->heard() < b->heard();
  });
  refuse(GuardRefusal::source_cap, quietest->who(),
         std::to_string(options.max_pending_per_source) + " connections from " + source +
             " in their handshake (max-pending-per-source): the one with the least progress, silent longest, is "
             "closed for " + who);
  quietest->close();
}

bool PortGuard::Impl::make_buffer_room(int64_t bytes) {
  while (bytes > options.max_buffered_bytes - buffered) {
    const auto now = Clock::now();
    Session* quietest = nullptr;
    for (Session* s : collecting)
      if (now - s->heard() >= kStalledCollector && (!quietest || s->heard() < quietest->heard())) quietest = s;
    if (!quietest) return false;
    refuse(GuardRefusal::buffer_budget, quietest->who(),
           "a buffered message silent for " +
               std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(now - quietest->heard()).count()) +
               " ms is closed to make room for another one");
    quietest->close();
  }
  return true;
}

void PortGuard::Impl::tls_accepted(uint16_t caf_port) {
  auto it = by_caf_port.find(caf_port);
  if (it == by_caf_port.end()) return;
  if (auto session = it->second.lock()) session->tls_accepted();
}

void PortGuard::tls_accepted(uint16_t caf_port, uint16_t loopback_port) {
  std::lock_guard<std::mutex> lock(g_guards_mutex);
  for (Impl* guard : g_guards)
    if (guard->options.target_port == caf_port)
      net::post(guard->io, [guard, loopback_port] { guard->tls_accepted(loopback_port); });
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
  {
    std::lock_guard<std::mutex> lock(g_guards_mutex);
    g_guards.insert(impl_.get());
  }
  impl_->accept();
  impl_->thread = std::thread([impl = impl_.get()] { impl->io.run(); });
}

PortGuard::~PortGuard() {
  {
    std::lock_guard<std::mutex> lock(g_guards_mutex);
    g_guards.erase(impl_.get());
  }
  impl_->io.stop();
  impl_->thread.join();
}

uint16_t PortGuard::port() const { return impl_->acceptor.local_endpoint().port(); }

int PortGuard::connections() const { return impl_->active.load(); }

}  // namespace disagg
