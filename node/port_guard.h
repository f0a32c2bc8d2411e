// A guard in front of a node's CAF port: CAF 0.17.6's middleman has no
// message-size limit, no handshake timeout and no connection cap (README,
// security), and trusts the payload length a peer announces, allocating it
// before reading a byte. So the node's CAF port listens on loopback only, and
// this guard owns the public port: it accepts connections up to a cap, and
// relays each to the CAF port, checking on the way in every BASP message
// header (parsed with CAF's own caf::io::basp::header, through CAF's binary
// deserializer) before a byte of its payload moves: an invalid header or an
// announced payload beyond the limit closes the connection, and so does a
// peer that has not completed its first message (the BASP handshake) within
// the handshake timeout. Each refusal is logged once and counted
// (disagg_connections_closed_total{reason}).
//
// With TLS the bytes are encrypted and cannot be inspected: the guard then
// enforces the connection cap and a timeout for the first byte only (an
// unauthenticated peer never reaches CAF's parser anyway: README, TLS).
//
// Bytes from CAF to the peer are relayed unchanged. One I/O thread per guard.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace disagg {

struct PortGuardOptions {
  std::string listen_host = "127.0.0.1";  // the public side
  uint16_t listen_port = 0;               // 0: any free port
  uint16_t target_port = 0;               // CAF's port on 127.0.0.1
  uint32_t max_message_bytes = 16u << 20;  // largest BASP payload a peer may announce
  std::chrono::milliseconds handshake_timeout{5000};
  int max_connections = 1024;
  bool inspect = true;  // false: TLS (encrypted) bytes; cap and first-byte timeout only
};

// Why a connection was refused or closed: the label of the counter.
enum class GuardRefusal { connection_cap, message_too_large, bad_header, handshake_timeout };
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

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace disagg
