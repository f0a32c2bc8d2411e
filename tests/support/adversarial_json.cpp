#include "support/adversarial_json.h"

#include <algorithm>
#include <random>
#include <utility>

namespace disagg::test {

namespace {

// The last member of every JSON body: an invalid "user" (checked last).
constexpr const char* kClosingMember = ",\"user\":5}";

using Members = std::vector<std::pair<std::string, std::string>>;  // name, JSON text

Members completion_base() {
  return {{"model", "\"stories260K\""}, {"prompt", "\"Once upon a time\""}, {"max_tokens", "8"},
          {"temperature", "0"},         {"stop", "[\"\\n\"]"},              {"stream", "false"}};
}

Members chat_base() {
  return {{"model", "\"stories260K\""},
          {"messages", "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi\"}]"},
          {"max_tokens", "8"},
          {"stream", "true"},
          {"stream_options", "{\"include_usage\":true}"}};
}

// Every field the API knows that a request may set, and one it does not.
const std::vector<std::string>& field_names() {
  static const std::vector<std::string> names = {
      "model",  "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
      "seed",   "stop",   "stream",   "stream_options", "n", "best_of", "logprobs", "top_logprobs",
      "echo",   "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "unknown_field"};
  return names;
}

std::string repeated(const std::string& unit, size_t times, const std::string& separator = "") {
  std::string out;
  out.reserve((unit.size() + separator.size()) * times);
  for (size_t i = 0; i < times; ++i) {
    if (i) out += separator;
    out += unit;
  }
  return out;
}

// Values of every type and shape, and the extremes of each.
std::vector<std::string> value_catalogue(size_t max_bytes) {
  const size_t big = max_bytes / 2;
  std::vector<std::string> v = {
      // numbers beyond a double, at its edges, beyond 64-bit integers
      "1e400", "-1e400", "1e-400", "-0", "0", "-1", "1.5", "1e308", "-1e308", "4.9e-324", "2.2250738585072014e-308",
      "9223372036854775807", "9223372036854775808", "-9223372036854775808", "-9223372036854775809",
      "18446744073709551615", "18446744073709551616", "123456789012345678901234567890", "1" + std::string(400, '0'),
      "0." + std::string(400, '0') + "1",
      // numbers JSON does not have
      "01", "1.", "-", ".5", "1e", "+1", "NaN", "Infinity", "-Infinity", "0x10",
      // every type
      "null", "true", "false", "\"\"", "\"x\"", "[]", "{}", "[1]", "[\"a\"]", "{\"a\":1}", "[null]", "[[]]", "[{}]",
      "[[1,2]]", "[[[1]]]", "[\"a\",\"b\"]", "[1,\"a\"]", "{\"type\":\"json_object\"}", "{\"type\":\"text\"}",
      "{\"type\":\"text\",\"x\":1}", "{\"1\":100}", "{\"include_usage\":\"yes\"}",
      // strings: long, invalid UTF-8 (raw), bad escapes, control characters, unterminated
      "\"" + std::string(big, 'a') + "\"", "\"\xff\xfe\"", "\"\xc3\"", "\"\xed\xa0\x80\"", "\"\xf4\x90\x80\x80\"",
      "\"\xc0\xaf\"", "\"\\ud800\"", "\"\\udc00\\ud800\"", "\"\\u0000\"", "\"\\x\"", "\"\\u12\"", "\"\x01\"",
      "\"abc", "\"\\\"",
      // many elements, many members
      "[" + repeated("1", big / 2, ",") + "]", "[" + repeated("\"a\"", big / 4, ",") + "]",
      "[" + repeated("\"" + std::string(300, 's') + "\"", 17, ",") + "]",
      "{" + repeated("\"k\":1", big / 6, ",") + "}",
      // messages of every wrong shape
      "[{\"role\":\"user\",\"content\":[{\"type\":5}]}]", "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":5}]}]",
      "[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":\"x\"}}]}]",
      "[{\"role\":\"user\",\"content\":[5]}]", "[{\"role\":5}]", "[{\"role\":\"tool\",\"content\":\"x\"}]",
      "[{\"role\":\"user\",\"content\":{\"a\":1}}]", "[{\"role\":\"assistant\",\"content\":\"x\"}]",
      "[{\"content\":\"x\"}]", "[5]", "[[{\"role\":\"user\",\"content\":\"x\"}]]",
      "[{\"role\":\"user\",\"content\":\"" + std::string(big, 'm') + "\"}]",
  };
  // nesting around the depth limit and far beyond it, as the probes sent
  for (size_t depth : {size_t(62), size_t(63), size_t(64), size_t(65), size_t(66), size_t(1000), size_t(20000),
                       size_t(100000), size_t(400000)}) {
    if (2 * depth + 1 <= max_bytes) v.push_back(nested_arrays(depth));
    if (6 * depth + 1 <= max_bytes) v.push_back(nested_objects(depth));
    if (8 * depth <= max_bytes) v.push_back(nested_arrays(depth, "1e400"));
    if (2 * depth + 32 <= max_bytes) v.push_back(nested_arrays(depth, "{\"role\":\"user\",\"content\":\"x\"}"));
  }
  return v;
}

std::string object_text(const Members& members) {
  std::string out = "{";
  for (size_t i = 0; i < members.size(); ++i) {
    if (i) out += ",";
    out += "\"" + members[i].first + "\":" + members[i].second;
  }
  return out;
}

}  // namespace

std::string nested_arrays(size_t depth, const std::string& inner) {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

std::string nested_objects(size_t depth, const std::string& inner) {
  return repeated("{\"a\":", depth) + inner + std::string(depth, '}');
}

std::vector<AdversarialBody> adversarial_bodies(uint64_t seed, size_t count, size_t max_bytes) {
  std::mt19937_64 rng(seed);
  auto below = [&](size_t n) { return n == 0 ? size_t(0) : size_t(rng() % n); };
  const auto values = value_catalogue(max_bytes);
  std::vector<AdversarialBody> out;
  out.reserve(count);
  // Bodies that are no object at all.
  for (const char* whole : {"", " ", "null", "[]", "5", "\"x\"", "{", "}", "{\"prompt\":\"x\"", "\xef\xbb\xbf{}",
                            "{\"prompt\":\"x\"}}", "{\"prompt\":\"x\"} {}", "{\"prompt\" \"x\"}", "{'prompt':'x'}"})
    if (out.size() < count) out.push_back({"whole body " + std::string(whole), false, whole});
  // Every field with every value of the catalogue (the endpoints taking
  // turns), then damaged text.
  const size_t combinations = field_names().size() * values.size();
  for (size_t k = 0; out.size() < count; ++k) {
    const bool chat = k < combinations ? k % 2 == 1 : rng() % 2 == 1;
    Members members = chat ? chat_base() : completion_base();
    AdversarialBody b;
    b.chat = chat;
    if (k < combinations) {
      // One field replaced by (or, where the base has none, given) a value of the catalogue.
      const std::string& name = field_names()[k / values.size()];
      const std::string& value = values[k % values.size()];
      auto it = std::find_if(members.begin(), members.end(), [&](const auto& m) { return m.first == name; });
      if (it != members.end()) it->second = value;
      else members.insert(members.begin() + long(below(members.size() + 1)), {name, value});
      b.what = name + " = " + value.substr(0, 80) + (value.size() > 80 ? "... (" + std::to_string(value.size()) + " bytes)" : "");
      b.body = object_text(members) + kClosingMember;
    } else {
      // The text damaged before the closing member.
      std::string text = object_text(members);
      const int edits = 1 + int(below(3));
      b.what = "damaged:";
      for (int e = 0; e < edits && !text.empty(); ++e) {
        const size_t at = below(text.size());
        switch (below(5)) {
          case 0:
            text.resize(std::max<size_t>(1, at));
            b.what += " cut at " + std::to_string(at);
            break;
          case 1:
            text[at] = char(below(256));
            b.what += " byte " + std::to_string(at) + " = " + std::to_string(int(static_cast<unsigned char>(text[at])));
            break;
          case 2: {
            static const std::string specials = std::string("\"{}[],:\\") + '\0' + "\xff\xc3 e-.0123456789tfn";
            const char c = below(2) ? specials[below(specials.size())] : char(below(256));
            text.insert(text.begin() + long(at), c);
            b.what += " inserted " + std::to_string(int(static_cast<unsigned char>(c))) + " at " + std::to_string(at);
            break;
          }
          case 3: {
            const size_t n = 1 + below(std::min<size_t>(16, text.size() - at));
            text.erase(at, n);
            b.what += " erased " + std::to_string(n) + " at " + std::to_string(at);
            break;
          }
          default: {
            const size_t n = 1 + below(std::min<size_t>(32, text.size() - at));
            text.insert(at, text.substr(at, n));
            b.what += " repeated " + std::to_string(n) + " at " + std::to_string(at);
            break;
          }
        }
      }
      b.body = text + kClosingMember;
    }
    if (b.body.size() <= max_bytes) out.push_back(std::move(b));
  }
  return out;
}

}  // namespace disagg::test
