// Atoms that name the operations of the protocol (CAF 0.17 atoms: <= 10 chars).
#pragma once
#include "caf/atom.hpp"

namespace disagg {

using generate_atom = caf::atom_constant<caf::atom("generate")>;  // client -> router
using cancel_atom = caf::atom_constant<caf::atom("cancel")>;      // client -> router -> workers
using register_atom = caf::atom_constant<caf::atom("register")>;  // worker -> router
using token_atom = caf::atom_constant<caf::atom("token")>;        // decode -> router -> client
using done_atom = caf::atom_constant<caf::atom("done")>;          // decode -> router
using load_atom = caf::atom_constant<caf::atom("load")>;          // decode -> router
using status_atom = caf::atom_constant<caf::atom("status")>;      // anyone -> router/worker
using heartbeat_atom = caf::atom_constant<caf::atom("heartbeat")>;  // router -> itself
using deadline_atom = caf::atom_constant<caf::atom("deadline")>;  // router -> itself
using prefill_atom = caf::atom_constant<caf::atom("prefill")>;    // router -> prefill -> compute
using reserve_atom = caf::atom_constant<caf::atom("reserve")>;    // router -> decode
using lease_atom = caf::atom_constant<caf::atom("lease")>;        // decode -> itself
using kv_atom = caf::atom_constant<caf::atom("kv")>;              // prefill -> decode
using landed_atom = caf::atom_constant<caf::atom("landed")>;    // KV receiver callback -> decode
using admit_atom = caf::atom_constant<caf::atom("admit")>;        // decode -> compute
using step_atom = caf::atom_constant<caf::atom("step")>;          // decode -> compute
using chunk_atom = caf::atom_constant<caf::atom("chunk")>;        // compute -> itself
using info_atom = caf::atom_constant<caf::atom("info")>;          // worker -> compute
using router_atom = caf::atom_constant<caf::atom("router")>;      // relay -> worker: the router it serves
using kv_events_atom = caf::atom_constant<caf::atom("kvevents")>;  // worker -> router (and snapshots on request)

}  // namespace disagg
