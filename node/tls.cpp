#include "node/tls.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <sys/socket.h>

#include <atomic>
#include <memory>

#include "actors/log.h"
#include "gpu/file_check.h"
#include "node/port_guard.h"

#include "caf/config_option_adder.hpp"
#include "caf/function_view.hpp"

namespace disagg {

namespace {

void add_problem(std::string& problems, const std::string& what) {
  if (!problems.empty()) problems += "; ";
  problems += what;
}

// OpenSSL's error queue as one line (emptied).
std::string openssl_errors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!out.empty()) out += ", ";  // not "; ": that separates problems
    out += buf;
  }
  return out.empty() ? "unknown OpenSSL error" : out;
}

struct CtxFree {
  void operator()(SSL_CTX* c) const { SSL_CTX_free(c); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};

}  // namespace

// ---------------------------------------------------------------- OpenSSL calls of CAF's session
//
// CAF 0.17.6's openssl session (libcaf_openssl/src/openssl/session.cpp)
// calls SSL_accept/SSL_connect/SSL_read/SSL_write and then SSL_get_error
// without clearing the thread's OpenSSL error queue first, and drains the
// queue only inside CAF_LOG_INFO(...), which Debian's build compiles out
// (CAF_LOG_LEVEL_QUIET). So one failed handshake (a peer without a valid
// certificate, a plain-TCP client, a port scanner) leaves its error in the
// queue of the middleman's network thread, and from then on SSL_get_error
// reports SSL_ERROR_SSL for the ordinary "want read" of every healthy
// connection on that thread: CAF closes them all, again and again (seen:
// every worker lost and re-registering in a loop after one refused peer).
// OpenSSL's rule is to clear the queue before each of these calls; these
// definitions do that and call the real functions. They take precedence
// over libssl's because the executable is searched first when
// libcaf_openssl.so's references are bound (ld exports them from the
// executable since a shared library on the link line uses them). A failed
// handshake is logged here too (CAF has no hook for it), with the peer's
// address and OpenSSL's reason, and counted.

namespace {

std::atomic<uint64_t> g_refused_handshakes{0};

template <class Fn>
Fn next_definition(const char* name) {
  void* f = ::dlsym(RTLD_NEXT, name);
  if (!f) {
    node_log(LogLevel::error, std::string("cannot find OpenSSL's ") + name + ": " + ::dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(f);
}

// Per connection: its peer (read while the socket is connected) and whether
// its failure was logged (CAF calls SSL_accept again after a failure).
struct HandshakeNote {
  std::string peer;
  bool logged = false;
};

void free_note(void*, void* ptr, CRYPTO_EX_DATA*, int, long, void*) { delete static_cast<HandshakeNote*>(ptr); }

int note_index() {
  static const int index = SSL_get_ex_new_index(0, nullptr, nullptr, nullptr, free_note);
  return index;
}

std::string peer_of(SSL* ssl);

HandshakeNote& note_of(SSL* ssl) {
  auto* note = static_cast<HandshakeNote*>(SSL_get_ex_data(ssl, note_index()));
  if (!note) {
    note = new HandshakeNote{peer_of(ssl), false};
    SSL_set_ex_data(ssl, note_index(), note);
  }
  return *note;
}

std::string peer_of(SSL* ssl) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  const int fd = SSL_get_fd(ssl);
  if (fd < 0 || ::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return "an unknown peer";
  char host[INET6_ADDRSTRLEN] = "?";
  uint16_t port = 0;
  if (addr.ss_family == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&addr);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (addr.ss_family == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&addr);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  }
  return std::string(host) + ":" + std::to_string(port);
}

// A completed server-side handshake on a loopback connection: maybe a port
// guard's own connection, whose peer is now authenticated (node/port_guard.h).
void report_accepted(SSL* ssl) {
  sockaddr_in local{}, peer{};
  socklen_t local_len = sizeof local, peer_len = sizeof peer;
  const int fd = SSL_get_fd(ssl);
  if (fd < 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_len) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0 || peer.sin_family != AF_INET ||
      peer.sin_addr.s_addr != htonl(INADDR_LOOPBACK))
    return;
  PortGuard::tls_accepted(ntohs(local.sin_port), ntohs(peer.sin_port));
}

// Logs a handshake that failed for good (not "call again"); leaves the error
// queue as it is, for CAF's SSL_get_error.
int after_handshake_step(SSL* ssl, int ret, bool accepting) {
  HandshakeNote& note = note_of(ssl);
  if (ret == 1 && accepting) report_accepted(ssl);
  if (ret == 1 || note.logged) return ret;
  const int err = SSL_get_error(ssl, ret);
  if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) return ret;
  note.logged = true;
  const uint64_t n = ++g_refused_handshakes;
  std::string why = "the connection closed before the handshake completed";
  if (const unsigned long e = ERR_peek_last_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    why = buf;
  }
  if (SSL_get_verify_result(ssl) != X509_V_OK)
    why += " (" + std::string(X509_verify_cert_error_string(SSL_get_verify_result(ssl))) + ")";
  node_log(LogLevel::error, std::string(accepting ? "refused a TLS connection from " : "TLS handshake with ") +
                                note.peer + (accepting ? "" : " failed") + ": " + why + " (" + std::to_string(n) +
                                " failed TLS handshakes so far)");
  return ret;
}

}  // namespace
}  // namespace disagg

extern "C" {

int SSL_accept(SSL* ssl) {
  static const auto real = disagg::next_definition<int (*)(SSL*)>("SSL_accept");
  ERR_clear_error();
  return disagg::after_handshake_step(ssl, real(ssl), true);
}

int SSL_connect(SSL* ssl) {
  static const auto real = disagg::next_definition<int (*)(SSL*)>("SSL_connect");
  ERR_clear_error();
  return disagg::after_handshake_step(ssl, real(ssl), false);
}

int SSL_read(SSL* ssl, void* buf, int num) {
  static const auto real = disagg::next_definition<int (*)(SSL*, void*, int)>("SSL_read");
  ERR_clear_error();
  return real(ssl, buf, num);
}

int SSL_write(SSL* ssl, const void* buf, int num) {
  static const auto real = disagg::next_definition<int (*)(SSL*, const void*, int)>("SSL_write");
  ERR_clear_error();
  return real(ssl, buf, num);
}

}  // extern "C"

namespace disagg {

std::string TlsOptions::validate() const {
  if (!enabled()) return {};
  std::string problems;
  const struct {
    const std::string& path;
    const char* name;
  } files[] = {{certificate, "tls.certificate"}, {key, "tls.key"}, {ca_file, "tls.ca-file"}};
  for (const auto& f : files) {
    if (f.path.empty())
      add_problem(problems, std::string(f.name) +
                                " is required with TLS (set tls.certificate, tls.key and tls.ca-file together)");
    // Opened (without blocking) and fstat()ed here, before OpenSSL and CAF
    // open it by name: a FIFO there would block the node in open() for good.
    else if (const std::string why = gpu::file_problem(f.path); !why.empty())
      add_problem(problems, std::string(f.name) + ": " + f.path + " is not a readable file: " + why);
  }
  if (!problems.empty()) return problems;

  // The same loading CAF's openssl session does for every connection
  // (caf/openssl/session.cpp); CAF raises inside its network loop when it
  // fails there, so fail here first, with OpenSSL's reason.
  ERR_clear_error();
  std::unique_ptr<SSL_CTX, CtxFree> ctx{SSL_CTX_new(TLS_method())};
  if (!ctx) return "cannot create an OpenSSL context: " + openssl_errors();
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), certificate.c_str()) != 1)
    add_problem(problems, "tls.certificate: cannot load " + certificate + ": " + openssl_errors());
  if (SSL_CTX_use_PrivateKey_file(ctx.get(), key.c_str(), SSL_FILETYPE_PEM) != 1)
    add_problem(problems, "tls.key: cannot load " + key + ": " + openssl_errors());
  else if (problems.empty() && SSL_CTX_check_private_key(ctx.get()) != 1)
    add_problem(problems, "tls.key: " + key + " is not the key of " + certificate + ": " + openssl_errors());
  if (SSL_CTX_load_verify_locations(ctx.get(), ca_file.c_str(), nullptr) != 1)
    add_problem(problems, "tls.ca-file: cannot load " + ca_file + ": " + openssl_errors());
  if (!problems.empty()) return problems;

  // This node's own certificate must chain to the CA: peers check it with
  // the same CA file, so a certificate of another CA could never connect.
  X509* cert = SSL_CTX_get0_certificate(ctx.get());
  STACK_OF(X509)* chain = nullptr;
  SSL_CTX_get0_chain_certs(ctx.get(), &chain);
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> verify{X509_STORE_CTX_new()};
  if (!verify || X509_STORE_CTX_init(verify.get(), SSL_CTX_get_cert_store(ctx.get()), cert, chain) != 1)
    return "cannot check tls.certificate: " + openssl_errors();
  if (X509_verify_cert(verify.get()) != 1)
    add_problem(problems, "tls.certificate: " + certificate + " is not signed by the CA of tls.ca-file " + ca_file +
                              " (" + X509_verify_cert_error_string(X509_STORE_CTX_get_error(verify.get())) + ")");
  ERR_clear_error();
  return problems;
}

void add_tls_options(caf::config_option_set& options, TlsOptions& tls) {
  caf::config_option_adder{options, "tls"}
      .add(tls.certificate, "certificate", "PEM certificate of this node (mutual TLS; with key and ca-file)")
      .add(tls.key, "key", "PEM private key of this node's certificate")
      .add(tls.ca_file, "ca-file", "PEM certificate of the cluster's CA (the only issuer peers may have)");
}

caf::expected<caf::strong_actor_ptr> remote_actor_at(caf::actor_system& system, std::set<std::string> interface,
                                                     const std::string& host, uint16_t port,
                                                     std::chrono::milliseconds timeout) {
  // middleman::remote_actor (caf/io/middleman.cpp), with a timeout.
  auto f = caf::make_function_view(connection_manager(system), caf::duration{timeout});
  auto res = f(caf::connect_atom::value, host, port);
  if (!res) {
    if (res.error() == caf::sec::request_timeout)
      return caf::make_error(caf::sec::request_timeout,
                             "no CAF handshake from " + host + ":" + std::to_string(port) + " within " +
                                 std::to_string(timeout.count()) + " ms" +
                                 (uses_tls(system) ? " (with TLS: is it a plain TCP port?)"
                                                   : " (is it a TLS port? then set tls.* here too)"));
    return std::move(res.error());
  }
  caf::strong_actor_ptr ptr = std::move(std::get<1>(*res));
  if (!ptr) return caf::make_error(caf::sec::no_actor_published_at_port, port);
  if (!system.assignable(std::get<2>(*res), interface))
    return caf::make_error(caf::sec::unexpected_actor_messaging_interface, std::move(interface),
                           std::move(std::get<2>(*res)));
  return ptr;
}

uint64_t refused_tls_handshakes() { return g_refused_handshakes.load(); }

void use_tls(caf::actor_system_config& config, const TlsOptions& tls) {
  if (!tls.enabled()) return;
  config.openssl_certificate = tls.certificate;
  config.openssl_key = tls.key;
  config.openssl_cafile = tls.ca_file;
  config.openssl_capath.clear();
  config.openssl_passphrase.clear();
  config.load<caf::openssl::manager>();
}

}  // namespace disagg
