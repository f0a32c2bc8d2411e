// KvContext (a UCP context with its own settings) and the small shared helpers.
#include <sys/random.h>
#include <ucp/api/ucp.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "kv/event_loop.h"
#include "kv/transfer.h"

namespace disagg::kv {

void apply_process_settings() {
  static std::once_flag once;
  std::call_once(once, [] { ::setenv("UCX_TCP_CONN_NB", "y", /*overwrite=*/0); });
}

std::shared_ptr<KvContext> KvContext::create(const ContextOptions& options) {
  apply_process_settings();
  // The environment (UCX_*) first, then this context's own settings on top,
  // so two contexts in one process can use different transports.
  ucp_config_t* config = nullptr;
  ucs_status_t status = ucp_config_read(nullptr, nullptr, &config);
  if (status != UCS_OK) throw KvError(KvErrc::ucx_error, detail::ucx_message("ucp_config_read", status));
  auto modify = [&](const std::string& name, const std::string& value) {
    const ucs_status_t s = ucp_config_modify(config, name.c_str(), value.c_str());
    if (s != UCS_OK) {
      ucp_config_release(config);
      throw KvError(KvErrc::ucx_error, detail::ucx_message("UCX setting " + name + "=" + value, s));
    }
  };
  if (!options.transports.empty()) modify("TLS", options.transports);
  for (const auto& [name, value] : options.ucx_settings) modify(name, value);

  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  // AM: pieces, handshakes and verdicts are active messages (large ones go by
  // rendezvous straight into the receiver's memory). WAKEUP: the progress
  // threads sleep on the worker's event descriptor instead of spinning.
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "disagg-kv";
  ucp_context_h context = nullptr;
  status = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (status != UCS_OK) {
    throw KvError(KvErrc::ucx_error,
                  detail::ucx_message("ucp_init (transports \"" + options.transports + "\")", status));
  }
  return std::shared_ptr<KvContext>(new KvContext(context, options));
}

KvContext::~KvContext() { ucp_cleanup(context_); }

const char* to_string(TransferStatus status) {
  switch (status) {
    case TransferStatus::pending: return "pending";
    case TransferStatus::complete: return "complete";
    case TransferStatus::cancelled: return "cancelled";
    case TransferStatus::expired: return "expired";
    case TransferStatus::bad_checksum: return "bad_checksum";
    case TransferStatus::out_of_range: return "out_of_range";
    case TransferStatus::overlap: return "overlap";
    case TransferStatus::unknown_transfer: return "unknown_transfer";
    case TransferStatus::protocol_error: return "protocol_error";
    case TransferStatus::peer_failed: return "peer_failed";
    case TransferStatus::timed_out: return "timed_out";
  }
  return "invalid";
}

uint64_t new_transfer_id() {
  uint64_t id = 0;
  while (id == 0) {
    const ssize_t got = getrandom(&id, sizeof id, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got != ssize_t(sizeof id)) {
      throw KvError(KvErrc::ucx_error, std::string("getrandom: ") + std::strerror(errno));
    }
  }
  return id;
}

}  // namespace disagg::kv
