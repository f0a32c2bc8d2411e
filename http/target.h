// A request target's path, percent-decoded (Boost.URL, header-only: its
// implementation is compiled in target.cpp alone).
#pragma once
#include <optional>
#include <string>

namespace disagg::http {

// The path of an origin-form target ("/v1/models/org%2Fname?x=1" ->
// "/v1/models/org/name"), or nullopt when it is no such target.
std::optional<std::string> decoded_path(const std::string& target);

}  // namespace disagg::http
