// A client of a running multi-process cluster in one object: its own actor
// system (io middleman, protocol types) connected to the router at
// "HOST:PORT", and an actors/client.h Client on it. For disagg-client, tests
// and benchmarks.
#pragma once
#include <chrono>
#include <memory>
#include <string>

#include "actors/client.h"
#include "node/tls.h"

namespace disagg {

// Connecting: the first retry after kConnectBackoffFirst, each later one
// after twice the one before, at most kConnectBackoffMax; each try waits
// for the router's handshake what is left of the wait, within
// [kConnectHandshakeMin, kConnectHandshakeMax].
inline constexpr std::chrono::milliseconds kConnectBackoffFirst{25};
inline constexpr std::chrono::milliseconds kConnectBackoffMax{500};
inline constexpr std::chrono::milliseconds kConnectHandshakeMin{500};
inline constexpr std::chrono::milliseconds kConnectHandshakeMax{10000};
// disagg-client's wait for the router by default (--connect-timeout-ms).
inline constexpr std::chrono::milliseconds kDefaultConnectWait{5000};

class RemoteClient {
 public:
  // Connects to the router, retrying with backoff until `wait` has passed
  // (0: one try).
  // Throws gpu::Error("cannot reach the router at HOST:PORT: ...") on failure
  // and for a malformed address.
  // With `tls` enabled (node/tls.h) the connection is mutual TLS: the
  // router must present a certificate of tls.ca_file's CA, and this client
  // presents tls.certificate; a problem with the files throws gpu::Error.
  explicit RemoteClient(const std::string& router_address,
                        std::chrono::milliseconds wait = std::chrono::milliseconds(0),
                        ClientOptions options = {}, TlsOptions tls = {});
  ~RemoteClient();
  RemoteClient(const RemoteClient&) = delete;
  RemoteClient& operator=(const RemoteClient&) = delete;

  Client& client() { return *client_; }
  caf::actor_system& system() { return *system_; }
  const std::string& address() const { return address_; }

 private:
  std::string address_;
  std::unique_ptr<caf::actor_system_config> config_;
  std::unique_ptr<caf::actor_system> system_;
  std::unique_ptr<Client> client_;
};

}  // namespace disagg
