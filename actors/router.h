// The router: the one actor clients talk to. It validates and admits requests
// (bounded queue), picks a prefill worker (least queued prompt tokens) and a
// decode worker (room, then load; a session's previous one first), owns every
// request's deadline, forwards streamed tokens to the client, and gives every
// accepted request exactly one terminal reply. Workers join by registering.
#pragma once
#include <memory>
#include <optional>

#include "actors/config.h"
#include "caf/actor_system.hpp"
#include "text/tokenizer.h"
#include "messages/interfaces.h"

namespace disagg {

// `tokenizer` may be null: then text prompts are rejected as invalid_request
// and token events carry no text. `model`, the cluster's model (the router's
// own disagg.model), makes the router the authority on vocabulary and
// context from the start; without it (a router node with no disagg.model),
// the first worker to register sets the cluster's model, and every later
// worker must have the same (fingerprint, vocabulary, context).
//
// `thread`: scheduled (nodes, the in-process cluster) or detached on a
// thread of its own, whose CPU time bench/bench_router.cpp reads (there its
// token latency through the router was also lower: p50 712 / 853 us against
// 1,234 / 1,582 us at 16 / 256 simulated workers). Nodes keep it scheduled:
// with a detached router, the router node of ClusterChaos (workers killed
// under load) once did not exit on SIGTERM within the test's bound and was
// killed (137), in one of four full test runs, 2026-12-03; not understood yet.
enum class RouterThread { scheduled, own };
router_actor spawn_router(caf::actor_system& system, const DisaggConfig& config,
                          std::shared_ptr<const gpu::Tokenizer> tokenizer,
                          std::optional<ModelInfo> model = std::nullopt,
                          RouterThread thread = RouterThread::scheduled);

}  // namespace disagg
