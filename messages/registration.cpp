#include "messages/registration.h"

#include "caf/actor_system_config.hpp"
#include "messages/protocol.h"

namespace disagg {

std::string to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::none: return "none";
    case ErrorCode::invalid_request: return "invalid_request";
    case ErrorCode::overloaded: return "overloaded";
    case ErrorCode::kv_too_large: return "kv_too_large";
    case ErrorCode::incompatible_kv: return "incompatible_kv";
    case ErrorCode::timeout: return "timeout";
    case ErrorCode::cancelled: return "cancelled";
    case ErrorCode::worker_lost: return "worker_lost";
    case ErrorCode::internal: return "internal";
  }
  return "unknown(" + std::to_string(static_cast<int>(code)) + ")";
}

std::string to_string(WorkerRole role) {
  switch (role) {
    case WorkerRole::prefill: return "prefill";
    case WorkerRole::decode: return "decode";
  }
  return "unknown(" + std::to_string(static_cast<int>(role)) + ")";
}

RequestOutcome make_failure(RequestId id, ErrorCode code, std::string message) {
  RequestOutcome out;
  out.id = id;
  out.code = code;
  out.message = std::move(message);
  return out;
}

void register_messages(caf::actor_system_config& config) {
  // Client-facing.
  config.add_message_type<Sampling>("disagg::Sampling");
  config.add_message_type<GenerateRequest>("disagg::GenerateRequest");
  config.add_message_type<TokenEvent>("disagg::TokenEvent");
  config.add_message_type<TokenBatch>("disagg::TokenBatch");
  config.add_message_type<Timings>("disagg::Timings");
  config.add_message_type<RequestOutcome>("disagg::RequestOutcome");
  // Membership and load.
  config.add_message_type<ModelInfo>("disagg::ModelInfo");
  config.add_message_type<WorkerInfo>("disagg::WorkerInfo");
  config.add_message_type<DecodeLoad>("disagg::DecodeLoad");
  config.add_message_type<KvEvents>("disagg::KvEvents");
  config.add_message_type<PrefillLoad>("disagg::PrefillLoad");
  config.add_message_type<WorkerStatus>("disagg::WorkerStatus");
  config.add_message_type<RouterStatus>("disagg::RouterStatus");
  // Between workers.
  config.add_message_type<KvReservation>("disagg::KvReservation");
  config.add_message_type<KvTarget>("disagg::KvTarget");
  config.add_message_type<KvLanded>("disagg::KvLanded");
  config.add_message_type<ReserveReply>("disagg::ReserveReply");
  config.add_message_type<PrefillJob>("disagg::PrefillJob");
  config.add_message_type<PrefillReport>("disagg::PrefillReport");
  config.add_message_type<KvTransfer>("disagg::KvTransfer");
  config.add_message_type<KvAck>("disagg::KvAck");
  config.add_message_type<DecodeDone>("disagg::DecodeDone");
  // Worker <-> its compute actor.
  config.add_message_type<PrefillWork>("disagg::PrefillWork");
  config.add_message_type<PrefillResult>("disagg::PrefillResult");
  config.add_message_type<KvAdmit>("disagg::KvAdmit");
  config.add_message_type<AdmitResult>("disagg::AdmitResult");
  config.add_message_type<StepSlot>("disagg::StepSlot");
  config.add_message_type<DecodeStep>("disagg::DecodeStep");
  config.add_message_type<StepResult>("disagg::StepResult");
  // Handles that travel inside messages.
  config.add_message_type<client_actor>("disagg::client_actor");
  config.add_message_type<compute_actor>("disagg::compute_actor");
  config.add_message_type<decode_actor>("disagg::decode_actor");
  config.add_message_type<prefill_actor>("disagg::prefill_actor");
  config.add_message_type<router_actor>("disagg::router_actor");
}

}  // namespace disagg
