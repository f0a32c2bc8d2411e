// A guard in front of a node's CAF port: CAF 0.17.6's middleman has no
// message-size limit, no handshake timeout and no connection cap (README,
// security), and trusts the payload length a peer announces, allocating it
// before reading a byte. So the node's CAF port listens on loopback only, and
// this guard owns the public port and relays each connection to it.
//
// A connection's life (one Session):
//
//   accept ──▶ pending ──(handshake done)──▶ established ──▶ closed
//     │           │                             │
//     │ caps      │ handshake deadline          │ plain: every header checked;
//     ▼           ▼                             ▼ large messages buffered, with a deadline
//   refused     closed                        closed
//
// - accept: refused beyond max_connections in all or beyond max_pending (the
//   connections still in their handshake, so that strangers can hold at
//   most that share of the slots). Beyond max_pending_per_source from one
//   address, that address's pending connection that has sent the fewest
//   bytes (of those, the one silent longest) is closed to make room:
//   clients behind one NAT or on one host share an address, and a real
//   handshake (hundreds of bytes at once, milliseconds) must win over any
//   number of stallers.
// - pending: plain: the peer's first message must be a BASP client handshake
//   of at most kMaxHandshakeBytes, complete by handshake_timeout. TLS: the
//   TLS handshake (with a certificate of the cluster's CA) must be complete
//   by handshake_timeout; node/tls.cpp reports it (tls_accepted), as CAF's
//   SSL_accept succeeds, for the guard's own loopback connection.
// - established, plain: every BASP header is parsed with CAF's own
//   caf::io::basp::header before a byte of its payload moves; more than
//   max_message_bytes closes the connection. A payload up to
//   kStreamedMessageBytes streams through; a larger one is collected here as
//   its bytes arrive (memory follows the bytes received, not the length
//   announced), one message per connection at a time (so at most
//   max_message_bytes each), within max_buffered_bytes for all connections
//   together, and passed to CAF only once complete; it must be complete by
//   message_timeout. When the port's budget is full, collectors silent for
//   kStalledCollector are closed to make room for a new message. So CAF never allocates more than kStreamedMessageBytes
//   for bytes that have not arrived. TLS: the bytes are opaque; the peer has
//   proven a certificate of the cluster's CA.
// Each refusal is logged (the first and every 1000th of its kind) and
// counted (disagg_connections_closed_total{reason}).
//
// Bytes from CAF to the peer are relayed unchanged. One I/O thread per guard.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "metrics/exposer.h"  // (metrics::kAcceptRetry)

namespace disagg {

// The payload a peer's first message (its BASP handshake: node id, app
// identifier, a published actor's interface; CAF 0.17 writes a few hundred
// bytes) may announce.
constexpr uint32_t kMaxHandshakeBytes = 64u << 10;
// Payloads up to this stream through to CAF as they arrive; larger ones are
// collected by the guard first.
constexpr uint32_t kStreamedMessageBytes = 64u << 10;

// A connection collecting a buffered message that has sent nothing for this
// long is closed when another message needs its share of max_buffered_bytes
// (a real peer writes a message as fast as its link allows; a few stalled
// announcements must not hold the whole budget until message_timeout).
constexpr std::chrono::milliseconds kStalledCollector{1000};

// The defaults are NodeOptions' (node/config.h), which sets every field.
struct PortGuardOptions {
  std::string listen_host = "127.0.0.1";  // the public side
  uint16_t listen_port = 0;               // 0: any free port
  uint16_t target_port = 0;               // CAF's port on 127.0.0.1
  uint32_t max_message_bytes = 16u << 20;  // largest BASP payload a peer may announce
  std::chrono::milliseconds handshake_timeout{5000};  // accept to the end of the handshake (plain: BASP; TLS: TLS)
  std::chrono::milliseconds message_timeout{10000};   // header to the last byte of a buffered message
  int64_t max_buffered_bytes = int64_t(64) << 20;     // buffered messages of all connections together
  int max_connections = 1024;
  int max_pending = 256;             // connections in their handshake at once
  int max_pending_per_source = 16;   // of them from one address
  bool inspect = true;  // false: TLS (encrypted) bytes: caps and the TLS handshake deadline only
};

// Why a connection was refused or closed: the label of the counter.
enum class GuardRefusal {
  connection_cap,     // max_connections open
  pending_cap,        // max_pending in their handshake
  source_cap,         // closed to make room: max_pending_per_source from its address in their handshake
  bad_header,         // not a valid BASP header (or a first message that is no client handshake)
  message_too_large,  // beyond max_message_bytes (or kMaxHandshakeBytes before the handshake)
  handshake_timeout,  // no complete handshake within handshake_timeout
  message_timeout,    // a buffered message incomplete after message_timeout
  buffer_budget,      // a buffered message beyond what max_buffered_bytes has left, or a stalled one closed for room
};
inline constexpr int kGuardRefusals = 8;
const char* to_string(GuardRefusal reason);

class PortGuard {
 public:
  using Log = std::function<void(const std::string&)>;
  // Listens at once; throws std::runtime_error naming the address when it cannot.
  PortGuard(const PortGuardOptions& options, Log log);
  ~PortGuard();  // closes everything, joins the thread
  PortGuard(const PortGuard&) = delete;
  PortGuard& operator=(const PortGuard&) = delete;

  uint16_t port() const;      // the public port
  int connections() const;    // relayed now

  // node/tls.cpp: CAF's SSL_accept completed on its port `caf_port` for a
  // connection from 127.0.0.1:loopback_port, i.e. (if that is a guard's own
  // connection to its CAF port) the guard's peer completed the TLS handshake
  // with a certificate of the cluster's CA. Any thread.
  static void tls_accepted(uint16_t caf_port, uint16_t loopback_port);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace disagg
