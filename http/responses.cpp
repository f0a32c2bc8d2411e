#include "http/responses.h"

#include <utility>

#include "http/fields.h"

namespace disagg::http {

using ojson = nlohmann::ordered_json;

namespace {

// A message's content as text: a string, or an array of text parts
// (input_text, output_text, text).
std::string content_text(const ojson& content, const std::string& param) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    throw bad_request(param, "'" + param + "' must be a string or an array of text parts, got " + quote(content),
                      "invalid_type");
  std::string text;
  for (const ojson& part : content) {
    const ojson* type = part.is_object() ? field(part, "type") : nullptr;
    const ojson* t = part.is_object() ? field(part, "text") : nullptr;
    const bool textual = type && (*type == "input_text" || *type == "output_text" || *type == "text");
    if (!textual || !t || !t->is_string())
      throw bad_request(param, "'" + param + "' may hold text parts only (input_text, output_text), got " +
                                   (type ? quote(*type) : std::string("a part without a type")),
                        "unsupported");
    text += t->get<std::string>();
  }
  return text;
}

// `input` as chat messages (after the instructions' system message).
void add_input(const ojson& input, ojson& messages) {
  if (input.is_string()) {
    messages.push_back({{"role", "user"}, {"content", input}});
    return;
  }
  if (!input.is_array())
    throw bad_request("input", "'input' must be a string or an array of input items, got " + quote(input),
                      "invalid_type");
  for (size_t i = 0; i < input.size(); ++i) {
    const ojson& item = input[i];
    const std::string param = "input[" + std::to_string(i) + "]";
    if (!item.is_object()) throw bad_request(param, "'" + param + "' must be an object", "invalid_type");
    const ojson* type = field(item, "type");
    const std::string kind = type && type->is_string() ? type->get<std::string>() : "message";
    if (kind == "message") {
      const ojson* role = field(item, "role");
      const ojson* content = field(item, "content");
      if (!role || !role->is_string() || !content)
        throw bad_request(param, "'" + param + "' must have a role and a content", "missing");
      std::string r = role->get<std::string>();
      if (r == "developer") r = "system";
      messages.push_back({{"role", r}, {"content", content_text(*content, param + ".content")}});
    } else if (kind == "function_call") {
      const ojson* call_id = field(item, "call_id");
      const ojson* name = field(item, "name");
      const ojson* arguments = field(item, "arguments");
      if (!call_id || !call_id->is_string() || !name || !name->is_string() || !arguments || !arguments->is_string())
        throw bad_request(param, "'" + param + "' (a function_call) must have string call_id, name and arguments",
                          "invalid_type");
      ojson call = {{"id", *call_id}, {"type", "function"}, {"function", {{"name", *name}, {"arguments", *arguments}}}};
      // Calls after an assistant message (its text, or calls) are that turn's.
      if (!messages.empty() && messages.back()["role"] == "assistant") {
        ojson& turn = messages.back();
        if (!turn.contains("tool_calls")) turn["tool_calls"] = ojson::array();
        turn["tool_calls"].push_back(std::move(call));
      } else {
        messages.push_back({{"role", "assistant"}, {"content", nullptr}, {"tool_calls", ojson::array({std::move(call)})}});
      }
    } else if (kind == "function_call_output") {
      const ojson* call_id = field(item, "call_id");
      const ojson* output = field(item, "output");
      if (!call_id || !call_id->is_string() || !output)
        throw bad_request(param, "'" + param + "' (a function_call_output) must have a string call_id and an output",
                          "invalid_type");
      messages.push_back(
          {{"role", "tool"}, {"tool_call_id", *call_id}, {"content", content_text(*output, param + ".output")}});
    } else if (kind == "reasoning") {
      // (a thinking model's earlier reasoning: chat templates write none back)
    } else {
      throw bad_request(param, "input items of type \"" + kind.substr(0, kMaxQuotedBytes) +
                                   "\" are not supported (message, function_call, function_call_output, reasoning)",
                        "unsupported");
    }
  }
}

// Responses' flat function tools as chat's.
ojson chat_tools(const ojson& tools) {
  if (!tools.is_array()) throw bad_request("tools", "'tools' must be an array, got " + quote(tools), "invalid_type");
  ojson out = ojson::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& t = tools[i];
    const std::string param = "tools[" + std::to_string(i) + "]";
    const ojson* type = t.is_object() ? field(t, "type") : nullptr;
    if (!type || *type != "function")
      throw bad_request(param, "only function tools are supported, got " + (type ? quote(*type) : std::string("none")),
                        "unsupported");
    ojson function = ojson::object();
    for (const char* key : {"name", "description", "parameters", "strict"})
      if (const ojson* v = field(t, key)) function[key] = *v;
    out.push_back({{"type", "function"}, {"function", std::move(function)}});
  }
  return out;
}

ojson chat_tool_choice(const ojson& choice) {
  if (choice.is_object()) {
    const ojson* type = field(choice, "type");
    const ojson* name = field(choice, "name");
    if (!type || *type != "function" || !name)
      throw bad_request("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or a function "
                                       "{\"type\": \"function\", \"name\"}", "unsupported");
    return {{"type", "function"}, {"function", {{"name", *name}}}};
  }
  return choice;  // (a string: chat's own words, checked there)
}

// text.format as chat's response_format (none for plain text).
ojson chat_response_format(const ojson& text) {
  const ojson* format = text.is_object() ? field(text, "format") : nullptr;
  if (!format) return nullptr;
  const ojson* type = format->is_object() ? field(*format, "type") : nullptr;
  if (!type || !type->is_string())
    throw bad_request("text.format", "'text.format' must be an object with a type", "invalid_type");
  if (*type == "text") return nullptr;
  if (*type == "json_object") return {{"type", "json_object"}};
  if (*type != "json_schema")
    throw bad_request("text.format", "'text.format' of type " + quote(*type) + " is not supported", "unsupported");
  ojson schema = ojson::object();
  for (const char* key : {"name", "description", "schema", "strict"})
    if (const ojson* v = field(*format, key)) schema[key] = *v;
  return {{"type", "json_schema"}, {"json_schema", std::move(schema)}};
}

}  // namespace

std::string chat_body_of_responses(const std::string& text) {
  ojson body;
  try {
    body = parse_ordered_json_limited(text);
  } catch (...) {
    return text;  // (not JSON, or too deep: parse_request says so as for any endpoint)
  }
  if (!body.is_object()) return text;
  for (const char* stored : {"previous_response_id", "conversation", "prompt"})
    if (field(body, stored))
      throw bad_request(stored, std::string("'") + stored + "' needs stored responses; this server stores none",
                        "unsupported");
  if (const ojson* background = field(body, "background"); background && *background == true)
    throw bad_request("background", "background responses are not supported", "unsupported");
  ojson chat = ojson::object();
  ojson messages = ojson::array();
  if (const ojson* instructions = field(body, "instructions")) {
    if (!instructions->is_string())
      throw bad_request("instructions", "'instructions' must be a string, got " + quote(*instructions), "invalid_type");
    messages.push_back({{"role", "system"}, {"content", *instructions}});
  }
  const ojson* input = field(body, "input");
  if (!input) throw bad_request("input", "'input' is required", "missing");
  add_input(*input, messages);
  chat["messages"] = std::move(messages);
  for (const char* same : {"model", "temperature", "top_p", "seed", "user", "parallel_tool_calls", "stream", "top_k",
                           "min_p", "repetition_penalty", "cache_salt"})
    if (const ojson* v = field(body, same)) chat[same] = *v;
  // (the router's session affinity key: user, or its Responses successors)
  if (!chat.contains("user"))
    for (const char* key : {"prompt_cache_key", "safety_identifier"})
      if (const ojson* v = field(body, key); v && v->is_string()) {
        chat["user"] = *v;
        break;
      }
  if (const ojson* max = field(body, "max_output_tokens")) chat["max_tokens"] = *max;
  // Log probabilities: asked for by include's "message.output_text.logprobs", top_logprobs alternatives each.
  if (const ojson* include = field(body, "include"); include && include->is_array())
    for (const ojson& what : *include)
      if (what == "message.output_text.logprobs") {
        chat["logprobs"] = true;
        if (const ojson* top = field(body, "top_logprobs")) chat["top_logprobs"] = *top;
      }
  if (const ojson* tools = field(body, "tools")) chat["tools"] = chat_tools(*tools);
  if (const ojson* choice = field(body, "tool_choice")) chat["tool_choice"] = chat_tool_choice(*choice);
  if (const ojson* t = field(body, "text"))
    if (ojson format = chat_response_format(*t); !format.is_null()) chat["response_format"] = std::move(format);
  if (chat.contains("stream") && chat["stream"] == true) chat["stream_options"] = {{"include_usage", true}};
  return chat.dump();
}

ApiError as_responses_error(ApiError e) {
  auto starts = [&](const char* prefix) { return e.param.rfind(prefix, 0) == 0; };
  if (starts("messages")) e.param = "input";
  else if (e.param == "max_tokens") e.param = "max_output_tokens";
  else if (starts("response_format")) e.param = "text.format";
  return e;
}

// ---------------------------------------------------------------- the reply

ResponsesSink::ResponsesSink(ReplySink& out, std::string id, int64_t created_at, std::string model,
                             const std::string& request)
    : out_(out), id_(std::move(id)), created_at_(created_at), model_(std::move(model)) {
  json body;
  try {
    body = parse_json_limited(request);
  } catch (...) {
  }
  if (!body.is_object()) body = json::object();
  auto echo = [&](const char* name, json fallback) {
    request_[name] = body.contains(name) && !body[name].is_null() ? body[name] : std::move(fallback);
  };
  echo("instructions", nullptr);
  echo("max_output_tokens", nullptr);
  echo("metadata", json::object());
  echo("parallel_tool_calls", true);
  echo("reasoning", nullptr);
  echo("store", false);
  echo("temperature", 1.0);
  echo("text", {{"format", {{"type", "text"}}}});
  echo("tool_choice", "auto");
  echo("tools", json::array());
  echo("top_p", 1.0);
  echo("truncation", "disabled");
  echo("user", nullptr);
}

json ResponsesSink::response(const std::string& status) const {
  json r = {{"id", id_},
            {"object", "response"},
            {"created_at", created_at_},
            {"status", status},
            {"error", error_.is_null() ? json(nullptr) : error_},
            {"incomplete_details", nullptr},
            {"model", model_},
            {"output", output_},
            {"previous_response_id", nullptr},
            {"usage", nullptr}};
  r.update(request_);
  if (status == "incomplete") r["incomplete_details"] = {{"reason", "max_output_tokens"}};
  if (usage_.is_object()) {
    const int64_t in = usage_.value("prompt_tokens", int64_t(0)), out = usage_.value("completion_tokens", int64_t(0));
    // (the chat usage's details: usage_json's)
    auto detail = [&](const char* details, const char* key) {
      const json* d = field(usage_, details);
      return d && d->is_object() ? d->value(key, int64_t(0)) : int64_t(0);
    };
    r["usage"] = {{"input_tokens", in},
                  {"input_tokens_details", {{"cached_tokens", detail("prompt_tokens_details", "cached_tokens")}}},
                  {"output_tokens", out},
                  {"output_tokens_details", {{"reasoning_tokens", detail("completion_tokens_details", "reasoning_tokens")}}},
                  {"total_tokens", in + out}};
  }
  return r;
}

namespace {

json reasoning_item(const std::string& id, const std::string& text, const char* status) {
  return {{"type", "reasoning"}, {"id", id}, {"summary", json::array()},
          {"content", json::array({{{"type", "reasoning_text"}, {"text", text}}})}, {"status", status}};
}

json output_text(const std::string& text, json logprobs = json::array()) {
  return {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}, {"logprobs", std::move(logprobs)}};
}

// A chat choice's log probabilities (choice.logprobs.content: the same
// shape as output_text's), or none.
json logprobs_of(const json& choice) {
  if (!choice.contains("logprobs") || !choice["logprobs"].is_object()) return json::array();
  const json& content = choice["logprobs"].value("content", json());
  return content.is_array() ? content : json::array();
}

json message_item(const std::string& id, const std::string& text, const char* status, json logprobs = json::array()) {
  json content = json::array();
  if (status == std::string("completed")) content.push_back(output_text(text, std::move(logprobs)));
  return {{"type", "message"}, {"id", id}, {"status", status}, {"role", "assistant"}, {"content", std::move(content)}};
}

json call_item(const std::string& id, const std::string& call_id, const std::string& name, const std::string& arguments,
               const char* status) {
  return {{"type", "function_call"}, {"id", id}, {"call_id", call_id}, {"name", name},
          {"arguments", arguments}, {"status", status}};
}

std::string string_at(const json& o, const char* key) {
  return o.is_object() && o.contains(key) && o[key].is_string() ? o[key].get<std::string>() : std::string();
}

// The id of output item `index` of response `id` ("resp_X": "msg_X_0", ...).
std::string item_id(const char* prefix, const std::string& response_id, size_t index) {
  const size_t cut = response_id.find('_');
  return prefix + (cut == std::string::npos ? response_id : response_id.substr(cut + 1)) + "_" + std::to_string(index);
}

}  // namespace

void ResponsesSink::reply_json(int status, const json& chat) {
  const json& choice = chat["choices"][0];
  const json& message = choice["message"];
  if (const std::string reasoning = string_at(message, "reasoning_content"); !reasoning.empty())
    output_.push_back(reasoning_item(item_id("rs_", id_, output_.size()), reasoning, "completed"));
  // (the log probabilities are of every token: those of the text alone only without reasoning and calls)
  const bool text_alone = string_at(message, "reasoning_content").empty() && !message.contains("tool_calls");
  if (const std::string content = string_at(message, "content"); !content.empty())
    output_.push_back(message_item(item_id("msg_", id_, output_.size()), content, "completed",
                                   text_alone ? logprobs_of(choice) : json::array()));
  if (message.contains("tool_calls"))
    for (const json& call : message["tool_calls"])
      output_.push_back(call_item(item_id("fc_", id_, output_.size()), string_at(call, "id"),
                                  string_at(call["function"], "name"), string_at(call["function"], "arguments"),
                                  "completed"));
  usage_ = chat.value("usage", json());
  finish_ = string_at(choice, "finish_reason");
  out_.reply_json(status, response(finish_ == "length" ? "incomplete" : "completed"));
}

void ResponsesSink::emit(const std::string& type, json fields) {
  fields["type"] = type;
  fields["sequence_number"] = sequence_++;
  out_.event("event: " + type + "\ndata: " + dump(fields) + "\n\n");
}

void ResponsesSink::open_events() {
  out_.open_events();
  emit("response.created", {{"response", response("in_progress")}});
  emit("response.in_progress", {{"response", response("in_progress")}});
}

void ResponsesSink::add_item(json item, Open open) {
  close_item("completed");
  const size_t index = output_.size();
  emit("response.output_item.added", {{"output_index", index}, {"item", item}});
  if (open == Open::message)
    emit("response.content_part.added", {{"item_id", item["id"]}, {"output_index", index}, {"content_index", 0},
                                         {"part", output_text("")}});
  output_.push_back(std::move(item));
  open_ = open;
}

void ResponsesSink::close_item(const char* status) {
  if (open_ == Open::none) return;
  const size_t index = output_.size() - 1;
  json& item = output_[index];
  const json item_id = item["id"];
  if (open_ == Open::reasoning) {
    const std::string text = item["content"][0]["text"];
    emit("response.reasoning_text.done",
         {{"item_id", item_id}, {"output_index", index}, {"content_index", 0}, {"text", text}});
  } else if (open_ == Open::message) {
    const std::string text = std::move(text_);
    text_.clear();
    json logprobs = std::move(logprobs_);
    logprobs_ = json::array();
    item["content"] = json::array({output_text(text, logprobs)});
    emit("response.output_text.done", {{"item_id", item_id}, {"output_index", index}, {"content_index", 0},
                                       {"text", text}, {"logprobs", logprobs}});
    emit("response.content_part.done", {{"item_id", item_id}, {"output_index", index}, {"content_index", 0},
                                        {"part", output_text(text, logprobs)}});
  } else {
    emit("response.function_call_arguments.done", {{"item_id", item_id}, {"output_index", index},
                                                   {"name", item["name"]}, {"arguments", item["arguments"]}});
  }
  item["status"] = status;
  emit("response.output_item.done", {{"output_index", index}, {"item", item}});
  open_ = Open::none;
}

void ResponsesSink::on_chunk(const json& chunk) {
  if (chunk.contains("error")) {
    error_ = {{"code", chunk["error"].value("code", json(nullptr))},
              {"message", chunk["error"].value("message", json(""))}};
    emit("error", {{"code", error_["code"]}, {"message", error_["message"]},
                   {"param", chunk["error"].value("param", json(nullptr))}});
    return;
  }
  if (chunk.contains("usage") && chunk["usage"].is_object()) usage_ = chunk["usage"];
  if (!chunk.contains("choices") || chunk["choices"].empty()) return;
  const json& choice = chunk["choices"][0];
  if (const std::string finish = string_at(choice, "finish_reason"); !finish.empty()) finish_ = finish;
  const json& delta = choice.value("delta", json::object());
  // (log probabilities come for tokens, the text's among reasoning and calls: after either, none are shown)
  if (!string_at(delta, "reasoning_content").empty() || delta.contains("tool_calls")) {
    text_alone_ = false;
    logprobs_ = json::array();
  }
  const json logprobs = text_alone_ ? logprobs_of(choice) : json::array();
  if (const std::string piece = string_at(delta, "reasoning_content"); !piece.empty()) {
    if (open_ != Open::reasoning)
      add_item(reasoning_item(item_id("rs_", id_, output_.size()), "", "in_progress"), Open::reasoning);
    const size_t index = output_.size() - 1;
    output_[index]["content"][0]["text"].get_ref<std::string&>() += piece;  // (in place: a long thought is not copied a token at a time)
    emit("response.reasoning_text.delta", {{"item_id", output_[index]["id"]}, {"output_index", index},
                                           {"content_index", 0}, {"delta", piece}});
  }
  if (const std::string piece = string_at(delta, "content"); piece.empty() && open_ == Open::message) {
    logprobs_.insert(logprobs_.end(), logprobs.begin(), logprobs.end());  // (tokens whose text came earlier)
  } else if (!piece.empty()) {
    if (open_ != Open::message)
      add_item(message_item(item_id("msg_", id_, output_.size()), "", "in_progress"), Open::message);
    const size_t index = output_.size() - 1;
    text_ += piece;
    logprobs_.insert(logprobs_.end(), logprobs.begin(), logprobs.end());
    emit("response.output_text.delta", {{"item_id", output_[index]["id"]}, {"output_index", index},
                                        {"content_index", 0}, {"delta", piece}, {"logprobs", logprobs}});
  }
  if (delta.contains("tool_calls") && delta["tool_calls"].is_array())
    for (const json& call : delta["tool_calls"]) {
      const int at = call.value("index", 0);
      const json function = call.value("function", json::object());
      auto known = calls_.find(at);
      if (known == calls_.end()) {  // its head: id and name
        add_item(call_item(item_id("fc_", id_, output_.size()), string_at(call, "id"), string_at(function, "name"), "",
                           "in_progress"),
                 Open::call);
        known = calls_.emplace(at, output_.size() - 1).first;
      }
      const std::string piece = string_at(function, "arguments");
      // (a call's arguments follow its head, before any other item opens)
      if (piece.empty() || open_ != Open::call || known->second + 1 != output_.size()) continue;
      json& item = output_[known->second];
      item["arguments"].get_ref<std::string&>() += piece;
      emit("response.function_call_arguments.delta", {{"item_id", item["id"]}, {"output_index", known->second},
                                                      {"delta", piece}});
    }
}

void ResponsesSink::event(std::string data) {
  if (data.rfind("data: {", 0) != 0) return;  // ("data: [DONE]": the Responses stream has none)
  json chunk;
  try {
    chunk = json::parse(data.substr(6));
  } catch (const json::exception&) {
    return;  // (ours: always JSON)
  }
  on_chunk(chunk);
}

void ResponsesSink::end_events() {
  // (an item the end cut short, by an error or max_output_tokens: incomplete)
  close_item(error_.is_null() && finish_ != "length" ? "completed" : "incomplete");
  if (!error_.is_null()) emit("response.failed", {{"response", response("failed")}});
  else if (finish_ == "length") emit("response.incomplete", {{"response", response("incomplete")}});
  else emit("response.completed", {{"response", response("completed")}});
  out_.end_events();
}

}  // namespace disagg::http
