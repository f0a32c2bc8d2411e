#include "node/client.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "caf/all.hpp"
#include "actors/config.h"
#include "caf/io/all.hpp"
#include "gpu/error.h"
#include "messages/registration.h"

namespace disagg {

RemoteClient::RemoteClient(const std::string& router_address, std::chrono::milliseconds wait,
                           ClientOptions options, TlsOptions tls)
    : address_(router_address) {
  const auto colon = router_address.rfind(':');
  char* end = nullptr;
  const unsigned long port =
      colon == std::string::npos ? 0 : std::strtoul(router_address.c_str() + colon + 1, &end, 10);
  if (colon == std::string::npos || colon == 0 || *end != '\0' || port == 0 || port > 65535)
    throw gpu::Error("router address must be HOST:PORT, got \"" + router_address + "\"");
  const std::string host = router_address.substr(0, colon);

  config_ = std::make_unique<caf::actor_system_config>();
  register_messages(*config_);
  prefer_sharing_scheduler(*config_);
  watch_connections(*config_);
  config_->load<caf::io::middleman>();
  if (const std::string problems = tls.validate(); !problems.empty()) throw gpu::Error(problems);
  use_tls(*config_, tls);
  system_ = std::make_unique<caf::actor_system>(*config_);
  // A refused or reset connection is tried again with backoff until `wait`
  // has passed: a guard closes a pending connection to make room for
  // newer ones from the same address (node/port_guard.h), and a router
  // restarting refuses for a moment. Errors that another try cannot change
  // (another actor, or none, at the port) end at once.
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + wait;
  auto backoff = kConnectBackoffFirst;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const auto handshake = std::clamp(left, kConnectHandshakeMin, kConnectHandshakeMax);
    auto router = remote_actor_at<router_actor>(*system_, host, uint16_t(port), handshake);
    if (router) {
      client_ = std::make_unique<Client>(*system_, *router, options);
      return;
    }
    const bool final = router.error() == caf::sec::unexpected_actor_messaging_interface ||
                       router.error() == caf::sec::no_actor_published_at_port;
    if (final || Clock::now() + backoff >= deadline)
      throw gpu::Error("cannot reach the router at " + router_address + ": " + system_->render(router.error()));
    std::this_thread::sleep_for(backoff);
    backoff = std::min(2 * backoff, kConnectBackoffMax);
  }
}

RemoteClient::~RemoteClient() {
  client_.reset();
  system_.reset();  // before the config it was made from
}

}  // namespace disagg
