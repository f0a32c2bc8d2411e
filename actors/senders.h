// Who sent the message an actor handles. CAF delivers a message to any actor
// whose id it has made known to a peer node (a decode worker's handle goes
// to the router and to every prefill worker; a prefill worker's to each
// decode worker it ships KV to), and a typed interface says what may be
// sent, not by whom. So each role checks the sender of what commands it:
//
//   its own timers      from_itself        (leases, deadlines, heartbeats)
//   one named actor     from(addr)         (a relay's worker, a gate's relay)
//   its node            from_this_node     (the node's own settings)
//   a worker's orders   from_node_or(addr) (its node, or the router it serves:
//                                           reserve, prefill, cancel)
#pragma once
#include "caf/actor_addr.hpp"
#include "caf/actor_control_block.hpp"

namespace disagg {

// One of its own timers (delayed_send to itself).
template <class Self>
bool from_itself(Self self) {
  return self->current_sender() == self->ctrl();
}

// From `who` (false when `who` is invalid).
template <class Self>
bool from(Self self, const caf::actor_addr& who) {
  return who && self->current_sender() && self->current_sender()->address() == who;
}

// From an actor of this process.
template <class Self>
bool from_this_node(Self self) {
  return self->current_sender() && self->current_sender()->node() == self->node();
}

// From this process or from `router`: a worker's orders. Behind a node's
// relay a worker's router is on another node (the relay tells the worker
// which, router_atom); in one process it is on this one.
template <class Self>
bool from_node_or(Self self, const caf::actor_addr& router) {
  return from_this_node(self) || from(self, router);
}

// A worker's answer to orders from another: the one text for all of them.
inline constexpr const char* kNotItsRouter = "orders come from the router this worker serves, or from its own node";

}  // namespace disagg
