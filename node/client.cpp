#include "node/client.h"

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
  config_->load<caf::io::middleman>();
  if (const std::string problems = tls.validate(); !problems.empty()) throw gpu::Error(problems);
  use_tls(*config_, tls);
  system_ = std::make_unique<caf::actor_system>(*config_);
  const auto deadline = std::chrono::steady_clock::now() + wait;
  for (;;) {
    auto router = remote_actor_at<router_actor>(*system_, host, uint16_t(port), std::chrono::seconds(10));
    if (router) {
      client_ = std::make_unique<Client>(*system_, *router, options);
      return;
    }
    if (std::chrono::steady_clock::now() >= deadline)
      throw gpu::Error("cannot reach the router at " + router_address + ": " + system_->render(router.error()));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

RemoteClient::~RemoteClient() {
  client_.reset();
  system_.reset();  // before the config it was made from
}

}  // namespace disagg
