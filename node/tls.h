// Mutual TLS between the nodes of a cluster, through CAF's openssl module
// (libcaf_openssl 0.17.6). Options of group "tls" (disagg-node's INI, or
// --tls.certificate=... on its command line; disagg-client --tls-cert/-key/-ca):
//
//   certificate  PEM certificate (chain) of this node, signed by the cluster's CA
//   key          its unencrypted PEM private key
//   ca-file      PEM certificate(s) of the cluster's CA: the only issuer trusted
//
// All three set: the node loads caf::openssl::manager and every connection it
// makes or accepts (the router's port, a decode node's KV port, a prefill
// node's dials to the decode nodes, a client's connection to the router) is
// TLS with certificate verification in both directions: CAF 0.17.6's session
// (libcaf_openssl/src/openssl/session.cpp, create_ssl_context) sets
// SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT with the CA as the only
// trust anchor, so a peer without a certificate of that CA fails the
// handshake, on either side. Until the handshake has completed, the session's
// read_some runs SSL_accept/SSL_connect and hands CAF's BASP parser zero
// bytes, so nothing an unauthenticated peer sends is ever parsed as a BASP
// header (in particular no announced payload size is allocated). None set:
// plain TCP (the loopback demo). Some set: a configuration error.
//
// What CAF's session does not check: the peer's name (any certificate of the
// cluster's CA is accepted for any role and host: the CA is the cluster), and
// revocation. Failed handshakes are not visible to the application (CAF logs
// them only through its own logger, compiled out in Debian's build).
#pragma once
#include <chrono>
#include <cstdint>
#include <set>
#include <string>

#include "caf/actor_system.hpp"
#include "caf/actor_system_config.hpp"
#include "caf/io/middleman.hpp"
#include "caf/openssl/manager.hpp"
#include "caf/openssl/publish.hpp"
#include "caf/openssl/remote_actor.hpp"

namespace disagg {

struct TlsOptions {
  std::string certificate;  // PEM: this node's certificate (chain)
  std::string key;          // PEM: its private key (unencrypted)
  std::string ca_file;      // PEM: the cluster's CA certificate(s)

  bool enabled() const { return !certificate.empty() || !key.empty() || !ca_file.empty(); }
  // Empty when TLS is off or usable, else every problem found, separated by
  // "; ": not all three set, a file that is missing or not PEM, a key that
  // does not belong to the certificate, a certificate the CA did not sign.
  std::string validate() const;
};

// Registers the fields of `tls` as options of group "tls".
void add_tls_options(caf::config_option_set& options, TlsOptions& tls);

// When `tls` is enabled: copies the files into CAF's openssl settings and
// loads caf::openssl::manager (the io middleman must be loaded already). Call
// before the actor system is made from `config`.
void use_tls(caf::actor_system_config& config, const TlsOptions& tls);

// TLS handshakes of this process that failed for good (each is logged at
// level error with the peer's address and OpenSSL's reason).
uint64_t refused_tls_handshakes();

// Whether `system` talks TLS (it was made from a config given to use_tls).
inline bool uses_tls(caf::actor_system& system) { return system.has_openssl_manager(); }

// The middleman actor that opens connections: the openssl one with TLS (for
// connect_atom requests, e.g. a prefill node dialling a decode node).
inline caf::io::middleman_actor connection_manager(caf::actor_system& system) {
  return uses_tls(system) ? system.openssl_manager().actor_handle() : system.middleman().actor_handle();
}

// publish / remote_actor over TLS or plain TCP, as the system is configured.
template <class Handle>
caf::expected<uint16_t> publish_actor(caf::actor_system& system, const Handle& who, uint16_t port,
                                      const std::string& host, bool reuse = true) {
  if (uses_tls(system)) return caf::openssl::publish(who, port, host.c_str(), reuse);
  return system.middleman().publish(who, port, host.c_str(), reuse);
}

// The actor published at host:port, over TLS or plain TCP as the system is
// configured, like middleman::remote_actor but bounded: an error after
// `timeout` when the peer accepts the connection and never completes its
// handshake (a TLS port dialled without TLS, a plain port dialled with it,
// a process that does not speak). A later call for the same endpoint joins
// the attempt still pending in CAF's middleman actor rather than opening
// another connection.
caf::expected<caf::strong_actor_ptr> remote_actor_at(caf::actor_system& system, std::set<std::string> interface,
                                                     const std::string& host, uint16_t port,
                                                     std::chrono::milliseconds timeout);

template <class Handle>
caf::expected<Handle> remote_actor_at(caf::actor_system& system, const std::string& host, uint16_t port,
                                      std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
  auto res = remote_actor_at(system, system.message_types(caf::detail::type_list<Handle>{}), host, port, timeout);
  if (!res) return std::move(res.error());
  return caf::actor_cast<Handle>(std::move(*res));
}

}  // namespace disagg
