#include "http/fields.h"

namespace disagg::http {

std::string type_words(const json& v) { return std::string(v.type_name()); }

void expect_type(bool ok, const char* name, const char* wanted, const json& v) {
  if (!ok) throw bad_request(name, std::string("'") + name + "' must be " + wanted + ", got " + type_words(v), "invalid_type");
}

double number_in(const json& body, const char* name, double def, double lo, double hi, bool lo_open) {
  const json* v = field(body, name);
  if (!v) return def;
  expect_type(v->is_number(), name, "a number", *v);
  const double x = v->get<double>();
  if ((lo_open ? x <= lo : x < lo) || x > hi)
    throw bad_request(name, std::string("'") + name + "' must be in " + (lo_open ? "(" : "[") + json(lo).dump() +
                                ", " + json(hi).dump() + "], got " + quote(*v));
  return x;
}

int64_t integer_in(const json& body, const char* name, int64_t def, int64_t lo, int64_t hi) {
  const json* v = field(body, name);
  if (!v) return def;
  expect_type(v->is_number_integer(), name, "an integer", *v);
  // Beyond int64 (unsigned) is beyond every range here.
  const bool huge = v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(hi);
  const int64_t x = huge ? hi : v->get<int64_t>();
  if (huge || x < lo || x > hi)
    throw bad_request(name, std::string("'") + name + "' must be in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "], got " + quote(*v));
  return x;
}

bool boolean(const json& body, const char* name, bool def) {
  const json* v = field(body, name);
  if (!v) return def;
  expect_type(v->is_boolean(), name, "a boolean", *v);
  return v->get<bool>();
}

std::string string_of(const json& body, const char* name, std::string def) {
  const json* v = field(body, name);
  if (!v) return def;
  expect_type(v->is_string(), name, "a string", *v);
  return v->get<std::string>();
}

}  // namespace disagg::http
