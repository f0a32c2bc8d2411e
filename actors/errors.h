// How CAF's own failures of a request (no reply in time, the receiver gone)
// map onto the protocol's error codes.
#pragma once
#include <string>

#include "caf/error.hpp"
#include "caf/sec.hpp"
#include "messages/request.h"

namespace disagg {

inline ErrorCode code_of(const caf::error& error) {
  if (error == caf::sec::request_timeout) return ErrorCode::timeout;
  if (error == caf::sec::request_receiver_down) return ErrorCode::worker_lost;
  return ErrorCode::internal;
}

// "<who>: <CAF's description>", e.g. "decode ack: request_timeout".
inline std::string describe(const std::string& who, const caf::error& error) {
  return who + ": " + caf::to_string(error);
}

}  // namespace disagg
