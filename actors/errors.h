// How CAF's own failures of a request (no reply in time, the receiver gone)
// and the KV receiver's verdicts on a stream map onto the protocol's error
// codes.
#pragma once
#include <string>

#include "caf/error.hpp"
#include "caf/sec.hpp"
#include "kv/transfer.h"
#include "messages/request.h"

namespace disagg {

inline ErrorCode code_of(const caf::error& error) {
  if (error == caf::sec::request_timeout) return ErrorCode::timeout;
  if (error == caf::sec::request_receiver_down) return ErrorCode::worker_lost;
  return ErrorCode::internal;
}

inline ErrorCode code_of(kv::TransferStatus status) {
  switch (status) {
    case kv::TransferStatus::complete: return ErrorCode::none;
    case kv::TransferStatus::cancelled: return ErrorCode::cancelled;
    case kv::TransferStatus::pending:
    case kv::TransferStatus::expired:
    case kv::TransferStatus::timed_out:
    case kv::TransferStatus::unknown_transfer: return ErrorCode::timeout;  // its reservation ended (lease)
    case kv::TransferStatus::peer_failed: return ErrorCode::worker_lost;
    case kv::TransferStatus::bad_checksum:
    case kv::TransferStatus::out_of_range:
    case kv::TransferStatus::overlap:
    case kv::TransferStatus::protocol_error: return ErrorCode::incompatible_kv;  // a piece failed a check
  }
  return ErrorCode::internal;
}

// "<who>: <CAF's description>", e.g. "decode ack: request_timeout".
inline std::string describe(const std::string& who, const caf::error& error) {
  return who + ": " + caf::to_string(error);
}

}  // namespace disagg
