#include "actors/tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <sys/stat.h>

#include <memory>

#include "caf/config_option_adder.hpp"
#include "caf/function_view.hpp"

namespace disagg {

namespace {

void add_problem(std::string& problems, const std::string& what) {
  if (!problems.empty()) problems += "; ";
  problems += what;
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
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
    else if (!is_regular_file(f.path))
      add_problem(problems, std::string(f.name) + ": " + f.path + " is not a readable file");
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
