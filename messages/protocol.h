// The disagg protocol: every message, every actor interface, and the path of
// a request. Reading this directory alone explains the whole flow.
//
// Roles (messages/interfaces.h)
//   router   one per cluster; admits requests, picks workers, owns deadlines,
//            sends exactly one terminal reply per request.
//   prefill  runs prompts (through its compute actor) and ships their KV.
//   decode   holds sequences in a paged KV pool, decodes them in batches.
//   compute  one per worker, owns the gpu::Engine; detached (own thread).
//   client   whoever submits; receives the streamed token events.
//
// Membership (messages/worker.h)
//   worker -> router   (register_atom, WorkerInfo, its typed handle) -> ok
//   The router monitors each worker; a worker going down fails the requests it
//   holds with worker_lost. Local and remote workers register the same way.
//   decode -> router   (load_atom, DecodeLoad) whenever free blocks or active
//                      sequences change.
//
// A request (ids everywhere: every per-request message carries RequestId)
//   1. client  -> router  request(generate_atom, GenerateRequest, client_actor)
//      The router validates it (invalid_request; deadline_ms at most
//      kMaxDeadlineMs, a text prompt at most max-prompt-bytes, checked before
//      it is encoded), encodes text prompts, and queues it (bounded:
//      overloaded when full). A deadline timer starts.
//   2. router  -> decode  request(reserve_atom, KvReservation) -> ReserveReply
//      When a prefill worker has a slot (least queued prompt tokens) and a
//      decode worker has room (most free blocks, then fewest active sequences,
//      round robin on ties; a session's previous decode worker first), the
//      receiver allocates first: the decode worker reserves the blocks of
//      prompt + new tokens, with a lease (the request's time left + the ack
//      timeout) after which it frees them by itself. No room (overloaded):
//      the request goes back to the front of the queue, with that worker's
//      real load in the router's books, and waits for room on any decode
//      worker; no prompt has been computed. A worker that does not answer is
//      left for another one (max-decode-retries). Phases at the router: queued -> reserving ->
//      prefilling (the KV streams meanwhile) -> decoding -> finished; at the
//      decode worker: reserved (stream open) -> [commit waiting for the
//      stream's verdict] -> active -> gone (one-message path: reserved ->
//      admitting -> active -> gone).
//      Streams (kv-transport tcp or shm): the decode worker registers the
//      prompt's blocks with its KV receiver (kv/plane.h) under a new 64-bit
//      transfer id and answers with a KvTarget (receiver address, id, block
//      size, the blocks' runs). The receiver's final verdict comes back to the
//      decode worker as (landed_atom, id, serial, KvLanded); a failed stream
//      frees the blocks at once.
//   2b. router -> prefill request(prefill_atom, PrefillJob, decode_actor)
//      once the blocks are reserved.
//      The job holds one of the worker's max-prefill-inflight slots (taken
//      when the reservation was asked for) until its report (step 5)
//      arrives, even if the request ends before.
//   3. prefill -> compute request(prefill_atom, PrefillWork) -> PrefillResult
//      The first token (sampled, step 0) and, streamed, the verdict on the
//      KV it sent during the prefill: after each layer of each chunk, that
//      layer's new positions as pieces over UCX from the engine's cache into
//      the reserved blocks (engine/kv_stream.h); else the KV bytes
//      (gpu::serialize_kv). Work whose deadline passed or whose request was
//      cancelled before the compute actor reached it is skipped (timeout /
//      cancelled); a cancel during a streamed prefill stops it at the next
//      layer. KV larger than max_kv_transfer_bytes: PrefillReport{kv_too_large}
//      (streamed: before any compute). A colocated worker (kv/local.h): the
//      compute writes the KV straight into the reserved blocks of its own
//      pool, prefill-chunk positions per turn, each next turn a
//      (chunk_atom) to itself behind the decode steps queued meanwhile; the
//      reply comes after the last chunk.
//   4. prefill -> decode  request(kv_atom, KvTransfer) -> KvAck, with a deadline
//      Streamed: a commit (transfer id, model fingerprint, first token,
//      sampling; no bytes); the sequence starts once the receiver's verdict
//      is complete. One message: the decode worker refuses a first token
//      outside the vocabulary (invalid_request), takes the request's reserved
//      blocks (none left: timeout, the lease ended), has its compute validate
//      and store the KV (request(admit_atom, KvAdmit) -> AdmitResult;
//      mismatch: incompatible_kv), then acks.
//   5. prefill -> router  PrefillReport (the reply to step 2b): done, KV
//      bytes, timings; or the error.
//   6. decode  -> compute request(step_atom, DecodeStep) -> StepResult, looping:
//      one step in flight, all active sequences (up to max_batch) per step;
//      sequences admitted meanwhile join the next step.
//   7. decode  -> client  (token_atom, TokenEvent) per token, the first token
//      included, when the reservation named the client (KvReservation::client:
//      the router's direct-token-streams, for a request whose text the
//      router does not add; the HTTP frontend decodes by itself); and
//      decode  -> router  (token_atom, TokenBatch) per decode step: a
//      TokenEvent per sequence (the first token alone, at admission). The
//      router records them (what a migration continues from, metrics) and,
//      when the decode worker does not stream to the client, adds each
//      text piece and forwards each event to the client. The client library
//      passes each index on once, in order, and takes from a completed
//      outcome any token no event brought (disagg_tokens_from_outcome_total).
//      Token and done messages count only from the request's decode worker
//      and only when they name the router's current attempt
//      (KvReservation::attempt, echoed in TokenEvent::attempt and
//      DecodeDone::attempt): a decode node's relay may deliver an earlier
//      attempt's after the worker's answer to a new reservation.
//   8. decode  -> router  (done_atom, DecodeDone) after the last token; the
//      decode worker frees the request's blocks (also on cancel or error).
//   9. router  -> client  RequestOutcome (the reply to step 1) once it has both
//      the PrefillReport and the DecodeDone: tokens, finish reason, timings.
//
// Cancellation and failure
//   The router monitors each request's client actor: a client that goes
//   away (its process killed, Ctrl-C) cancels its requests, as below.
//   client -> router (cancel_atom, id), from the request's client actor or
//   its submitter only (others are ignored): the router replies cancelled and sends
//   (cancel_atom, id) to the request's prefill and decode workers, which drop
//   it and free its blocks (a decode worker reports its load even when it held
//   nothing of it; the prefill worker reports the job once its compute has
//   finished or skipped it). The same happens when the deadline passes
//   (timeout) or any step fails. Whatever the cause, the router finishes a
//   request in one place, exactly once.
//   A worker that goes down, or leaves the router's heartbeat
//   ((status_atom) every heartbeat-interval-ms, self-timed by heartbeat_atom)
//   unanswered for heartbeat-timeout-ms, does not end its requests: each
//   starts over on other workers (cancel to the old ones, the prefill worker
//   too while it has not reported, so a new job of the id is not refused
//   there; their late answers name an old attempt and are ignored). One whose decode worker was lost
//   after tokens were streamed migrates: PrefillJob.prompt_tokens = prompt +
//   those tokens, first_step = their count, so the continuation is exactly
//   the original (sampling is stateless per step) and its token events go on
//   at index first_step (the router forwards each index once). After
//   max-worker-retries restarts: worker_lost. Only the requests a worker
//   still holds are affected: once the decode worker has a request's KV
//   (the prefill report, or its first token or done) the prefill worker
//   holds it no more, and a request whose tokens are final (done, or
//   max_new_tokens streamed) completes whatever fails afterwards.
//   The client's request actor monitors the router: the router's process
//   gone ends the request with worker_lost at once.
//
// Sampling is stateless per step (messages/request.h Sampling), so the tokens
// equal gpu::generate's for the same prompt and sampling settings.
#pragma once

#include "messages/atoms.h"
#include "messages/compute.h"
#include "messages/interfaces.h"
#include "messages/registration.h"
#include "messages/request.h"
#include "messages/transfer.h"
#include "messages/worker.h"
