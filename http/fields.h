// The typed readers of a request body (http/api.cpp, http/chat.cpp): each
// reads one field with its type, range and error (400, naming the field)
// in one place. A field that is absent or null reads as its default.
#pragma once
#include <cstdint>
#include <string>

#include "http/api.h"

namespace disagg::http {

// The field `name` of `body`, or nullptr when it is absent or null (`json`,
// or the `nlohmann::ordered_json` /v1/responses reads, keeping schemas' key order).
template <class Json>
const Json* field(const Json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}
// JSON's name of v's type ("string", "object", ...).
std::string type_words(const json& v);
// A value as an error message quotes it: scalars as JSON, at most
// kMaxQuotedBytes of a string; a container by its type and size, never
// dumped (dump() recurses, and the value may be most of the body).
template <class Json>
std::string quote(const Json& v) {
  if (v.is_array()) return "an array of " + std::to_string(v.size()) + " elements";
  if (v.is_object()) return "an object of " + std::to_string(v.size()) + " members";
  if (v.is_string() && v.template get_ref<const std::string&>().size() > kMaxQuotedBytes)
    return dump(Json(v.template get_ref<const std::string&>().substr(0, kMaxQuotedBytes))) + "...";
  return dump(v);
}
// Throws the 400 "'name' must be <wanted>, got <type>" unless `ok`.
void expect_type(bool ok, const char* name, const char* wanted, const json& v);
// A number in [lo, hi] ((lo, hi] with lo_open), an integer in [lo, hi]
// (beyond int64 is beyond every range), a boolean, a string.
double number_in(const json& body, const char* name, double def, double lo, double hi, bool lo_open);
int64_t integer_in(const json& body, const char* name, int64_t def, int64_t lo, int64_t hi);
bool boolean(const json& body, const char* name, bool def);
std::string string_of(const json& body, const char* name, std::string def = {});

}  // namespace disagg::http
