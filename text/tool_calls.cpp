#include "text/tool_calls.h"

#include <nlohmann/json.hpp>

#include <optional>
#include <sstream>
#include <vector>

namespace disagg::gpu {

namespace {

using json = nlohmann::json;

std::string trimmed(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string::npos) return {};
  const size_t b = s.find_last_not_of(" \t\r\n");
  return s.substr(a, b - a + 1);
}

// Whether `j` nests at most kMaxCallDepth deep (walked with a stack of our
// own: what handles a call later, dump() and copies, recurses, and a model
// can write 100,000 brackets).
bool shallow(const json& j) {
  std::vector<std::pair<const json*, int>> todo{{&j, 1}};
  while (!todo.empty()) {
    const auto [v, depth] = todo.back();
    todo.pop_back();
    if (!v->is_structured()) continue;
    if (depth > kMaxCallDepth) return false;
    for (const json& child : *v) todo.emplace_back(&child, depth + 1);
  }
  return true;
}

// `text` as one JSON value, or nullopt (not JSON, or nested too deep).
// (nlohmann's parser is iterative.)
std::optional<json> parse_call(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  if (j.is_discarded() || !shallow(j)) return std::nullopt;
  return j;
}

// {"name": string, "arguments"|"parameters": object} as a call; {"name":
// string} alone as one without arguments. Another object with a "name"
// ({"name": "Bob", "age": 3}: data the model wrote) is no call, as vLLM's
// parsers, which need the arguments, take it.
bool call_of(const json& j, ToolCall& out) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const json* args = nullptr;
  if (j.contains("arguments")) args = &j["arguments"];
  else if (j.contains("parameters")) args = &j["parameters"];
  else if (j.size() != 1) return false;
  std::optional<json> parsed;
  if (args && args->is_string()) {  // (some models write the arguments as a JSON string)
    parsed = parse_call(args->get<std::string>());
    if (!parsed) return false;
    args = &*parsed;
  }
  if (args && !args->is_object()) return false;
  out.name = j["name"].get<std::string>();
  out.arguments = args ? args->dump() : "{}";
  return true;
}

ParsedOutput hermes(const std::string& text) {
  static const std::string open = "<tool_call>", close = "</tool_call>";
  ParsedOutput out;
  size_t first = text.find(open);
  if (first == std::string::npos) return {text, {}};
  for (size_t at = first; at != std::string::npos; at = text.find(open, at)) {
    const size_t body = at + open.size();
    const size_t end = text.find(close, body);
    const auto j = parse_call(text.substr(body, end == std::string::npos ? std::string::npos : end - body));
    ToolCall call;
    if (!j || !call_of(*j, call)) return {text, {}};
    out.calls.push_back(std::move(call));
    if (end == std::string::npos) break;
    at = end + close.size();
  }
  out.content = trimmed(text.substr(0, first));
  return out;
}

ParsedOutput llama3(const std::string& text) {
  static const std::string tag = "<|python_tag|>";
  std::string body = text;
  std::string before;
  if (const size_t at = body.find(tag); at != std::string::npos) {
    before = trimmed(body.substr(0, at));
    body = body.substr(at + tag.size());
  }
  body = trimmed(body);
  if (body.empty() || body[0] != '{') return {text, {}};
  // One object, or several separated by ";" or newlines.
  ParsedOutput out;
  size_t at = 0;
  // (one copy of the body, each object read from where the last ended: a
  // copy of the rest per object was quadratic in a long run of calls)
  std::istringstream in(body);
  while (at < body.size()) {
    // The object from `at` (one parse that stops where it ends; a parse of
    // each prefix ending in '}' was quadratic in the output).
    in.clear();
    in.seekg(std::streamoff(at));
    json j;
    try {
      in >> j;
    } catch (const json::exception&) {
      return {text, {}};
    }
    const std::streamoff used = in.tellg();
    const size_t end = used < 0 ? body.size() : size_t(used);
    ToolCall call;
    if (!shallow(j) || !call_of(j, call)) return {text, {}};
    out.calls.push_back(std::move(call));
    at = body.find_first_not_of(" \t\r\n;", end);
    if (at == std::string::npos) break;
    if (body[at] != '{') return {text, {}};
  }
  out.content = before;
  return out;
}

ParsedOutput mistral(const std::string& text) {
  static const std::string tag = "[TOOL_CALLS]";
  const size_t at = text.find(tag);
  if (at == std::string::npos) return {text, {}};
  const auto j = parse_call(trimmed(text.substr(at + tag.size())));
  if (!j) return {text, {}};
  ParsedOutput out;
  for (const json& item : j->is_array() ? *j : json::array({*j})) {
    ToolCall call;
    if (!call_of(item, call)) return {text, {}};
    out.calls.push_back(std::move(call));
  }
  out.content = trimmed(text.substr(0, at));
  return out;
}

}  // namespace

ParsedOutput parse_tool_calls(ToolSyntax syntax, const std::string& text) {
  switch (syntax) {
    case ToolSyntax::llama3: return llama3(text);
    case ToolSyntax::hermes: return hermes(text);
    case ToolSyntax::mistral: return mistral(text);
    case ToolSyntax::none: break;
  }
  return {text, {}};
}

ToolSyntax tool_syntax_of(const std::string& name) {
  if (name.rfind("llama3", 0) == 0) return ToolSyntax::llama3;
  if (name.rfind("qwen", 0) == 0 || name == "chatml") return ToolSyntax::hermes;
  if (name == "mistral") return ToolSyntax::mistral;
  return ToolSyntax::none;
}

}  // namespace disagg::gpu
