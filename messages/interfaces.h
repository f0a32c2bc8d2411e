// The typed actor interfaces of the cluster. Every message a role accepts is
// listed here; CAF checks sends against these at compile time.
#pragma once
#include <cstdint>
#include <vector>

#include "caf/actor_addr.hpp"
#include "caf/replies_to.hpp"
#include "caf/typed_actor.hpp"
#include "messages/atoms.h"
#include "messages/compute.h"
#include "messages/request.h"
#include "messages/transfer.h"
#include "messages/worker.h"

namespace disagg {

// client_actor, whoever submitted a request: messages/request.h.

// Owns one gpu::Engine (and a decode worker's KV pool storage); detached, so
// heavy compute never blocks the scheduler threads of the other actors.
using compute_actor = caf::typed_actor<
    caf::replies_to<info_atom>::with<ModelInfo>,
    caf::replies_to<prefill_atom, PrefillWork>::with<PrefillResult>,
    caf::replies_to<admit_atom, KvAdmit>::with<AdmitResult>,
    caf::replies_to<step_atom, DecodeStep>::with<StepResult>,
    // a decode worker's sequence has ended: what the compute holds for it
    // (a draft model's KV, engine/draft.h) goes
    caf::reacts_to<cancel_atom, RequestId>,
    // all a prefill worker's prefix cache holds (KvEvents::stored; none without one)
    caf::replies_to<kv_events_atom>::with<KvEvents>,
    // its own turn for the next chunk of a colocated worker's prompt, sent
    // after each chunk so that queued decode steps run between two chunks.
    caf::reacts_to<chunk_atom>>;

// Holds admitted sequences in a paged KV pool and decodes them with continuous
// batching; streams tokens and its final report to the router.
using decode_actor = caf::typed_actor<
    caf::replies_to<reserve_atom, KvReservation>::with<ReserveReply>,
    caf::replies_to<kv_atom, KvTransfer>::with<KvAck>,
    // conditional disaggregation: the decode worker prefills the uncached rest
    // of a prompt itself, into the blocks it reserved with a local target
    // (ReserveReply::target transport kLocalKvTransport on a worker that is
    // not colocated).
    caf::replies_to<prefill_atom, PrefillJob>::with<PrefillReport>,
    caf::reacts_to<cancel_atom, RequestId>,
    // the router it serves, told by its node (the node's relay): besides its
    // own node, the one sender of reserve, prefill and cancel it takes
    // (actors/senders.h from_node_or)
    caf::reacts_to<router_atom, caf::actor_addr>,
    // its reservations' lease wake-up (actors/deadlines.h), armed for this
    // time (steady clock ticks): ends the leases past their end only.
    caf::reacts_to<lease_atom, int64_t>,
    // its KV receiver's verdict on a streamed transfer: (request id, reservation serial, verdict).
    caf::reacts_to<landed_atom, RequestId, uint64_t, KvLanded>,
    caf::replies_to<status_atom>::with<DecodeLoad>,
    // a snapshot of its prefix cache for the router's index (KvEvents)
    caf::replies_to<kv_events_atom>::with<KvEvents>>;

// Runs prompts and ships their KV to the decode worker the router chose.
using prefill_actor = caf::typed_actor<
    caf::replies_to<prefill_atom, PrefillJob, decode_actor>::with<PrefillReport>,
    caf::reacts_to<cancel_atom, RequestId>,
    // the router it serves, told by its node (its gate, or the decode worker
    // whose own prefill it is): as a decode worker's
    caf::reacts_to<router_atom, caf::actor_addr>,
    caf::replies_to<status_atom>::with<PrefillLoad>,
    // a snapshot of its prefix cache for the router's index (KvEvents), as a
    // decode worker's; its stores and evictions go to the router as they happen
    caf::replies_to<kv_events_atom>::with<KvEvents>>;

// Admits, schedules and finishes requests; the only actor clients talk to.
using router_actor = caf::typed_actor<
    // client: the reply is the request's one terminal outcome; token events go
    // to the client handle (may be invalid: no streaming).
    caf::replies_to<generate_atom, GenerateRequest, client_actor>::with<RequestOutcome>,
    caf::reacts_to<cancel_atom, RequestId>,
    // workers: membership (the router monitors them) and decode progress.
    caf::replies_to<register_atom, WorkerInfo, prefill_actor>::with<caf::ok_atom>,
    caf::replies_to<register_atom, WorkerInfo, decode_actor>::with<caf::ok_atom>,
    caf::reacts_to<token_atom, TokenBatch>,
    caf::reacts_to<done_atom, DecodeDone>,
    caf::reacts_to<load_atom, DecodeLoad>,
    caf::reacts_to<kv_events_atom, KvEvents>,
    // the router's own deadline wake-up: its time (Clock, since its epoch).
    caf::reacts_to<deadline_atom, int64_t>,
    // the router's own heartbeat timer: ask every worker whether it is alive.
    caf::reacts_to<heartbeat_atom>,
    caf::replies_to<status_atom>::with<RouterStatus>>;

}  // namespace disagg
