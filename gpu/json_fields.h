// Typed reads of the JSON files of a Hugging Face model directory
// (config.json, generation_config.json, tokenizer.json,
// tokenizer_config.json): the one place that checks each value's type and
// range before it is converted, and says what was expected, naming the file
// and the key:
//
//   config.json: hidden_size = 1e+300: expected an integer from 1 to 2147483647
//   config.json: num_hidden_layers is missing (expected an integer from 1 to 2147483647)
//   config.json: eos_token_id[1] = 99999: expected a token id from 0 to 299
//
// A value is never converted unchecked: nlohmann's get<int>() of 1e300 or of
// 2^64 - 1 is undefined behaviour or a silent wrap, and its own errors ("type
// must be number, but is string") name neither the file nor the key.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace disagg::gpu {

// The nesting bound of a JSON parse, checked while it parses (nothing deeper
// is built): as a parse callback, throws JsonNestedTooDeep when a container
// opens `limit` levels deep. What reads parsed JSON later (copies, dump)
// recurses. The one guard of a model's files (below) and of a request's
// JSON (http/api.h).
struct JsonNestedTooDeep {};
template <class Event>
bool json_within_depth(int depth, Event event, int limit) {
  if (depth >= limit && (event == Event::object_start || event == Event::array_start)) throw JsonNestedTooDeep{};
  return true;
}

// JSON text of a model's file (or part of one: a safetensors header) parsed
// with its nesting bounded at kMaxFileJsonDepth; json::exception when it is
// not JSON. (A tokenizer.json nests about 6 deep.)
constexpr int kMaxFileJsonDepth = 64;
nlohmann::json parse_file_json(const char* begin, const char* end);

// The integer a JSON number stands for exactly: an integer within int64, or a
// float with no fraction within int64 (4096.0). Nullopt for anything else (not
// a number, a fraction, beyond int64).
std::optional<int64_t> exact_integer(const nlohmann::json& value);

// Throws Error "<file>: <key> = <value>: expected <expected>" (the value cut
// short when long).
[[noreturn]] void wrong_json_value(const std::string& file, const std::string& key, const nlohmann::json& value,
                                   const std::string& expected);

// The fields of one JSON object of `file`; `prefix` names the object inside
// the file ("rope_scaling."). A null value counts as absent, as
// transformers' configs write `"pad_token_id": null`. The object must outlive
// this.
class JsonFields {
 public:
  // Throws Error when `object` is not a JSON object ("<file>: not a JSON
  // object: [...]" for a whole file).
  JsonFields(const nlohmann::json& object, std::string file, std::string prefix = "");

  const std::string& file() const { return file_; }
  const nlohmann::json& value() const { return object_; }
  // The key as an error names it ("rope_scaling.factor").
  std::string name(const std::string& key) const { return prefix_ + key; }
  // The value, or nullptr when absent or null.
  const nlohmann::json* find(const std::string& key) const;
  bool has(const std::string& key) const { return find(key) != nullptr; }

  // Each throws Error naming the file, key and expected type for a value of
  // another type or out of range; the ones without a fallback for an absent
  // key too.
  int64_t integer(const std::string& key, int64_t min, int64_t max) const;
  int64_t integer(const std::string& key, int64_t min, int64_t max, int64_t fallback) const;
  double number(const std::string& key) const;  // finite
  double number(const std::string& key, double fallback) const;
  bool boolean(const std::string& key, bool fallback) const;
  std::string string(const std::string& key) const;
  std::string string(const std::string& key, const std::string& fallback) const;
  JsonFields object(const std::string& key) const;
  const nlohmann::json& array(const std::string& key) const;
  // A token id or a list of them (eos_token_id), each in [0, vocab_size);
  // empty when absent.
  std::vector<int> token_ids(const std::string& key, int vocab_size) const;

  // "<file>: <key> = <value>: expected <expected>" for a present key, "<file>:
  // <key> is missing (expected <expected>)" for an absent one.
  [[noreturn]] void wrong(const std::string& key, const std::string& expected) const;

 private:
  const nlohmann::json& object_;
  std::string file_, prefix_;
};

// "an integer from 1 to 2147483647", as the readers' errors say it.
std::string integer_range_text(int64_t min, int64_t max);

}  // namespace disagg::gpu
