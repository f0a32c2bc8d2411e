#include "gpu/json_fields.h"

#include <cmath>
#include <limits>

#include "gpu/error.h"

namespace disagg::gpu {

using json = nlohmann::json;

nlohmann::json parse_file_json(const char* begin, const char* end) {
  return nlohmann::json::parse(begin, end, [](int depth, nlohmann::json::parse_event_t event, nlohmann::json&) {
    return json_within_depth(depth, event, kMaxFileJsonDepth);
  });
}

std::optional<int64_t> exact_integer(const json& value) {
  if (value.is_number_unsigned()) {
    const uint64_t u = value.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
    return int64_t(u);
  }
  if (value.is_number_integer()) return value.get<int64_t>();
  if (value.is_number_float()) {
    const double d = value.get<double>();
    // [-2^63, 2^63): both bounds are exact doubles; a double in between with
    // no fraction converts exactly.
    if (!std::isfinite(d) || d != std::trunc(d) || d < -9223372036854775808.0 || d >= 9223372036854775808.0)
      return std::nullopt;
    return int64_t(d);
  }
  return std::nullopt;
}

namespace {

// A value as an error shows it: its JSON text, cut short when long.
std::string shown(const json& value) {
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

}  // namespace

void wrong_json_value(const std::string& file, const std::string& key, const json& value, const std::string& expected) {
  throw Error(file + ": " + key + " = " + shown(value) + ": expected " + expected);
}

std::string integer_range_text(int64_t min, int64_t max) {
  return "an integer from " + std::to_string(min) + " to " + std::to_string(max);
}

JsonFields::JsonFields(const json& object, std::string file, std::string prefix)
    : object_(object), file_(std::move(file)), prefix_(std::move(prefix)) {
  if (!object_.is_object()) {
    if (prefix_.empty()) throw Error(file_ + ": not a JSON object: " + shown(object_));
    wrong_json_value(file_, prefix_.substr(0, prefix_.size() - 1), object_, "an object");
  }
}

const json* JsonFields::find(const std::string& key) const {
  const auto it = object_.find(key);
  return it == object_.end() || it->is_null() ? nullptr : &*it;
}

void JsonFields::wrong(const std::string& key, const std::string& expected) const {
  if (const json* v = find(key)) wrong_json_value(file_, name(key), *v, expected);
  throw Error(file_ + ": " + name(key) + " is missing (expected " + expected + ")");
}

int64_t JsonFields::integer(const std::string& key, int64_t min, int64_t max) const {
  const json* v = find(key);
  const std::optional<int64_t> i = v ? exact_integer(*v) : std::nullopt;
  if (!i || *i < min || *i > max) wrong(key, integer_range_text(min, max));
  return *i;
}

int64_t JsonFields::integer(const std::string& key, int64_t min, int64_t max, int64_t fallback) const {
  return has(key) ? integer(key, min, max) : fallback;
}

double JsonFields::number(const std::string& key) const {
  const json* v = find(key);
  if (!v || !v->is_number() || !std::isfinite(v->get<double>())) wrong(key, "a number");
  return v->get<double>();
}

double JsonFields::number(const std::string& key, double fallback) const { return has(key) ? number(key) : fallback; }

bool JsonFields::boolean(const std::string& key, bool fallback) const {
  const json* v = find(key);
  if (!v) return fallback;
  if (!v->is_boolean()) wrong(key, "true or false");
  return v->get<bool>();
}

std::string JsonFields::string(const std::string& key) const {
  const json* v = find(key);
  if (!v || !v->is_string()) wrong(key, "a string");
  return v->get<std::string>();
}

std::string JsonFields::string(const std::string& key, const std::string& fallback) const {
  return has(key) ? string(key) : fallback;
}

JsonFields JsonFields::object(const std::string& key) const {
  const json* v = find(key);
  if (!v || !v->is_object()) wrong(key, "an object");
  return JsonFields(*v, file_, name(key) + ".");
}

const json& JsonFields::array(const std::string& key) const {
  const json* v = find(key);
  if (!v || !v->is_array()) wrong(key, "an array");
  return *v;
}

std::vector<int> JsonFields::token_ids(const std::string& key, int vocab_size) const {
  const json* v = find(key);
  if (!v) return {};
  const std::string expected = "a token id from 0 to " + std::to_string(vocab_size - 1) + " (the vocabulary has " +
                               std::to_string(vocab_size) + ")";
  auto id = [&](const json& x, const std::string& where) {
    const std::optional<int64_t> i = exact_integer(x);
    if (!i || *i < 0 || *i >= vocab_size) wrong_json_value(file_, where, x, expected);
    return int(*i);
  };
  std::vector<int> ids;
  if (v->is_array()) {
    for (size_t k = 0; k < v->size(); ++k) ids.push_back(id((*v)[k], name(key) + "[" + std::to_string(k) + "]"));
  } else if (v->is_number()) {
    ids.push_back(id(*v, name(key)));
  } else {
    wrong(key, expected + " or a list of them");
  }
  return ids;
}

}  // namespace disagg::gpu
