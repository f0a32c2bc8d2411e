// Malformed and adversarial request bodies for the HTTP API's fuzz tests
// (tests/http: parse_request itself; tests/cluster: a running frontend).
// Deterministic for a seed. Every body is one the API must refuse with a 4xx:
// each is either not JSON the API accepts (broken syntax, invalid UTF-8, a
// number beyond a double, nesting beyond the depth limit) or a JSON object
// whose last member is "user": 5 (a string is required, and it is the last
// field checked, so every other field is validated first), with one field
// replaced by a wrong or extreme value, or the text damaged byte by byte
// before that last member.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace disagg::test {

struct AdversarialBody {
  std::string what;  // how it was made, for failure messages
  bool chat = false;  // for /v1/chat/completions (else /v1/completions)
  std::string body;
};

// `count` bodies from `seed`: a few that are no object, then every field
// the API knows (and an unknown one) with every value of a catalogue of
// types, extremes and shapes (about 2,100), then damaged text. `max_bytes`
// bounds each body (a few larger than the frontend's body limit are the
// caller's to add).
std::vector<AdversarialBody> adversarial_bodies(uint64_t seed, size_t count, size_t max_bytes);

// Values nested `depth` deep: [[[...]]] around `inner`, or {"a":{"a":...}}.
std::string nested_arrays(size_t depth, const std::string& inner = "1");
std::string nested_objects(size_t depth, const std::string& inner = "1");

}  // namespace disagg::test
