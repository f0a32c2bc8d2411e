// One call makes every protocol type known to an actor system, so messages can
// cross process boundaries (CAF io middleman) and print in logs.
#pragma once

namespace caf {
class actor_system_config;
}

namespace disagg {

// Adds all message structs of messages/ and the typed actor handles of
// messages/interfaces.h. Call it once on each node's config before creating
// the actor_system.
void register_messages(caf::actor_system_config& config);

}  // namespace disagg
