// The typed readers of a request body (http/api.cpp, http/chat.cpp): each
// reads one field with its type, range and error (400, naming the field)
// in one place. A field that is absent or null reads as its default.
#pragma once
#include <cstdint>
#include <string>

#include "http/api.h"

namespace disagg::http {

// The field `name` of `body`, or nullptr when it is absent or null.
const json* field(const json& body, const char* name);
// JSON's name of v's type ("string", "object", ...).
std::string type_words(const json& v);
// A value as an error message quotes it: scalars as JSON, at most
// kMaxQuotedBytes of a string; a container by its type and size, never
// dumped (dump() recurses, and the value may be most of the body).
std::string quote(const json& v);
// Throws the 400 "'name' must be <wanted>, got <type>" unless `ok`.
void expect_type(bool ok, const char* name, const char* wanted, const json& v);
// A number in [lo, hi] ((lo, hi] with lo_open), an integer in [lo, hi]
// (beyond int64 is beyond every range), a boolean, a string.
double number_in(const json& body, const char* name, double def, double lo, double hi, bool lo_open);
int64_t integer_in(const json& body, const char* name, int64_t def, int64_t lo, int64_t hi);
bool boolean(const json& body, const char* name, bool def);
std::string string_of(const json& body, const char* name, std::string def = {});

}  // namespace disagg::http
