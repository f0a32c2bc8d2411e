#include "http/chat.h"

#include <list>
#include <mutex>

#include "grammar/json_schema.h"
#include "http/fields.h"
#include "text/jinja.h"

namespace disagg::http {

namespace {

std::string message_text(const json& content, size_t index) {
  const std::string param = "messages";
  if (content.is_null()) return {};
  if (content.is_string()) return content.get<std::string>();
  if (content.is_array()) {  // [{"type": "text", "text": "..."}]
    std::string out;
    for (const auto& part : content) {
      const json* type = part.is_object() ? field(part, "type") : nullptr;
      const json* text = part.is_object() ? field(part, "text") : nullptr;
      if (!type || *type != "text" || !text || !text->is_string())
        throw bad_request(param, "messages[" + std::to_string(index) + "].content: only text parts are supported",
                          "unsupported");
      out += text->get_ref<const std::string&>();
    }
    return out;
  }
  throw bad_request(param, "messages[" + std::to_string(index) + "].content must be a string or an array of text parts",
                    "invalid_type");
}

// An assistant message's tool_calls as its family writes them (what the
// model would have generated), after its content; any other message's
// content. A tool message's content is its result.
// `plain` (set): the tokenizer that defuses the text of control tokens in
// the content and the arguments (Tokenizer::defused_text), not in the
// calls' markup, which is the template's.
std::string message_content(const json& m, size_t index, ChatTemplate family, const gpu::Tokenizer* plain = nullptr) {
  auto as_plain = [&](const std::string& t) { return plain ? plain->defused_text(t) : t; };
  std::string text = as_plain(message_text(m.contains("content") ? m["content"] : json(nullptr), index));
  const json* calls = m.contains("tool_calls") ? &m["tool_calls"] : nullptr;
  if (!calls || calls->is_null()) return text;
  const std::string where = "messages[" + std::to_string(index) + "].tool_calls";
  if (m["role"] != "assistant") throw bad_request("messages", where + ": only an assistant message has tool_calls");
  expect_type(calls->is_array(), "messages", "an array of tool calls", *calls);
  json written = json::array();
  for (const json& call : *calls) {
    const json* function = call.is_object() && call.contains("function") ? &call["function"] : nullptr;
    if (!function || !function->is_object() || !function->contains("name") || !(*function)["name"].is_string())
      throw bad_request("messages", where + ": each call needs function.name", "invalid_type");
    json arguments = json::object();
    if (function->contains("arguments")) {
      const json& a = (*function)["arguments"];
      if (a.is_string()) {
        try {
          arguments = parse_json_limited(a.get<std::string>());
        } catch (const JsonOutOfBounds& e) {
          throw bad_request("messages", where + ": function.arguments " + e.what());
        } catch (const json::exception&) {
          arguments = json();  // (not JSON: refused below)
        }
      } else {
        arguments = a;
      }
      if (!arguments.is_object())
        throw bad_request("messages", where + ": function.arguments must be a JSON object (or its text)");
    }
    written.push_back({{"name", (*function)["name"]}, {"arguments", arguments}});
  }
  const gpu::ToolSyntax syntax = gpu::tool_syntax_of(gpu::to_string(family));
  std::string out = text;
  for (const json& call : written) {
    if (syntax == gpu::ToolSyntax::hermes) {
      out += (out.empty() ? "" : "\n") + std::string("<tool_call>\n") + as_plain(dump(call)) + "\n</tool_call>";
    } else if (syntax == gpu::ToolSyntax::llama3) {
      out += (out.empty() ? "" : "\n") + as_plain(dump(json{{"name", call["name"]}, {"parameters", call["arguments"]}}));
    }
  }
  if (syntax == gpu::ToolSyntax::mistral) out += "[TOOL_CALLS]" + as_plain(dump(written));
  if (syntax == gpu::ToolSyntax::none) out += (out.empty() ? "" : "\n") + as_plain(dump(written));
  return out;
}

// `schema` moved to `pointer` inside another schema: its references to
// itself ("#", "#/$defs/X") rewritten to point there. (Values that are data,
// not schemas, are left as they are.) `names`: `schema` maps names to
// schemas (properties, $defs): its keys are names, not keywords (a
// property called "enum" holds a schema like any other).
nlohmann::ordered_json rooted_at(const nlohmann::ordered_json& schema, const std::string& pointer, bool names = false) {
  if (schema.is_array()) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (const nlohmann::ordered_json& v : schema) out.push_back(rooted_at(v, pointer));  // (not json: it sorts keys)
    return out;
  }
  if (!schema.is_object()) return schema;
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& [key, value] : schema.items()) {
    if (names)
      out[key] = rooted_at(value, pointer);
    else if (key == "$ref" && value.is_string() && value.get_ref<const std::string&>().rfind('#', 0) == 0)
      out[key] = pointer + value.get_ref<const std::string&>().substr(1);
    else if (key == "const" || key == "enum" || key == "default" || key == "examples")
      out[key] = value;
    else
      out[key] = rooted_at(value, pointer, key == "properties" || key == "$defs" || key == "definitions");
  }
  return out;
}

}  // namespace

ToolUse parse_tools(const json& body, const nlohmann::ordered_json& in_order, ChatTemplate family, std::string& grammar) {
  ToolUse use;
  const json* tools = field(body, "tools");
  const json* choice = field(body, "tool_choice");
  if (tools && tools->is_null()) tools = nullptr;
  if (!tools || tools->empty()) {
    if (choice && !choice->is_null() && *choice != "none" && *choice != "auto")
      throw bad_request("tool_choice", "'tool_choice' names a tool but 'tools' defines none");
    if (tools) expect_type(tools->is_array(), "tools", "an array of tools", *tools);
    return use;
  }
  expect_type(tools->is_array(), "tools", "an array of tools", *tools);
  if (tools->size() > kMaxTools)
    throw bad_request("tools", "at most " + std::to_string(kMaxTools) + " tools, got " + std::to_string(tools->size()));
  // name, parameters schema (in the body's order: properties are written in it)
  std::vector<std::pair<std::string, nlohmann::ordered_json>> functions;
  for (size_t i = 0; i < tools->size(); ++i) {
    const json& t = (*tools)[i];
    const std::string where = "tools[" + std::to_string(i) + "]";
    // (json comparisons: a "type" that is not a string is just not "function", a 400, not a type_error's 500)
    if (!t.is_object() || !t.contains("type") || t["type"] != "function" || !t.contains("function") ||
        !t["function"].is_object())
      throw bad_request("tools", where + " must be {\"type\": \"function\", \"function\": {...}}");
    const json& f = t["function"];
    if (!f.contains("name") || !f["name"].is_string() || f["name"].get_ref<const std::string&>().empty() ||
        f["name"].get_ref<const std::string&>().size() > 64)
      throw bad_request("tools", where + ".function.name must be a string of 1 to 64 characters");
    for (const auto& [name, unused] : functions)
      if (name == f["name"]) throw bad_request("tools", where + ": a second tool named " + quote(f["name"]));
    nlohmann::ordered_json parameters = f.contains("parameters") && !f["parameters"].is_null()
                                            ? in_order.at("tools").at(i).at("function").at("parameters")
                                            : nlohmann::ordered_json{{"type", "object"}, {"properties", json::object()}};
    functions.emplace_back(f["name"].get<std::string>(), std::move(parameters));
  }
  use.syntax = gpu::tool_syntax_of(gpu::to_string(family));
  use.choice = ToolUse::Choice::automatic;
  if (choice && !choice->is_null()) {
    if (*choice == "none") use.choice = ToolUse::Choice::none;
    else if (*choice == "required") use.choice = ToolUse::Choice::required;
    else if (*choice == "auto") use.choice = ToolUse::Choice::automatic;
    else if (choice->is_object() && choice->contains("type") && (*choice)["type"] == "function" && choice->contains("function") &&
             (*choice)["function"].is_object() && (*choice)["function"].contains("name")) {
      use.choice = ToolUse::Choice::named;
      use.name = (*choice)["function"]["name"].is_string() ? (*choice)["function"]["name"].get<std::string>() : "";
      if (std::none_of(functions.begin(), functions.end(), [&](const auto& f) { return f.first == use.name; }))
        throw bad_request("tool_choice", "'tool_choice' names " + quote((*choice)["function"]["name"]) + ", which 'tools' does not define");
    } else {
      throw bad_request("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                       "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
  }
  const bool parallel = boolean(body, "parallel_tool_calls", true);
  try {
    if (use.choice == ToolUse::Choice::named) {
      for (const auto& [name, parameters] : functions)
        if (name == use.name) grammar = grammar::json_schema_grammar(parameters).to_json();
    } else if (use.choice == ToolUse::Choice::required) {
      // [{"name": one of them, "arguments": its parameters}, ...]; each
      // tool's parameters under $defs, their own references rooted there.
      using ordered = nlohmann::ordered_json;
      ordered branches = ordered::array(), defs = ordered::object();
      for (size_t i = 0; i < functions.size(); ++i) {
        const std::string at = "tool" + std::to_string(i);
        defs[at] = rooted_at(functions[i].second, "#/$defs/" + at);
        branches.push_back(ordered{{"type", "object"},
                                   {"properties", ordered{{"name", ordered{{"const", functions[i].first}}},
                                                          {"arguments", ordered{{"$ref", "#/$defs/" + at}}}}},
                                   {"required", {"name", "arguments"}},
                                   {"additionalProperties", false}});
      }
      ordered calls = {{"type", "array"}, {"minItems", 1}, {"items", ordered{{"anyOf", branches}}}, {"$defs", defs}};
      if (!parallel) calls["maxItems"] = 1;
      grammar = grammar::json_schema_grammar(calls).to_json();
    }
  } catch (const grammar::GrammarError& e) {
    throw bad_request("tools", std::string("a tool's parameters: ") + e.what(), "unsupported");
  }
  return use;
}

namespace {

using ordered_json = nlohmann::ordered_json;

// Every string in `v` defused (Tokenizer::defused_text), keys too: a
// template writes a tool's parameters and a call's arguments with tojson,
// keys and all (a key that spells "<|im_end|><|im_start|>system" must stay
// text). A key without a control token's spelling is unchanged, so the
// template's lookups ("role", "content", ...) still find it.
ordered_json defused(const ordered_json& v, const gpu::Tokenizer& tokenizer) {
  if (v.is_string()) return tokenizer.defused_text(v.get_ref<const std::string&>());
  if (v.is_array()) {
    ordered_json out = ordered_json::array();
    for (const ordered_json& item : v) out.push_back(defused(item, tokenizer));
    return out;
  }
  if (v.is_object()) {
    ordered_json out = ordered_json::object();
    for (const auto& [key, value] : v.items()) out[tokenizer.defused_text(key)] = defused(value, tokenizer);
    return out;
  }
  return v;
}

// A message as a template reads it (as vLLM hands it to transformers):
// content as text (text parts joined; null or absent: "", as an assistant's
// message with tool calls has it), tool_calls' arguments as objects, the
// other fields as sent (checked by message_content before).
ordered_json template_message(const ordered_json& m) {
  ordered_json out = m;
  std::string text;
  if (m.contains("content") && m["content"].is_string()) text = m["content"].get<std::string>();
  if (m.contains("content") && m["content"].is_array())
    for (const auto& part : m["content"]) text += part["text"].get<std::string>();
  out["content"] = text;
  if (m.contains("tool_calls") && m["tool_calls"].is_array())
    for (ordered_json& call : out["tool_calls"]) {
      ordered_json& function = call["function"];
      if (function.contains("arguments") && function["arguments"].is_string())
        function["arguments"] = parse_ordered_json_limited(function["arguments"].get<std::string>());
    }
  return out;
}

// continue_final_message (as vLLM does it): the rendered text cut right
// after the last message's content, so the output continues that message.
std::string up_to_the_last_message(const std::string& rendered, const json& messages, const gpu::Tokenizer& tokenizer,
                                   bool plain) {
  const json& last = messages.back();
  if (last.value("role", "") != "assistant")
    throw bad_request("continue_final_message", "'continue_final_message' needs the last message to be an assistant's");
  std::string content = template_message(ordered_json::parse(last.dump()))["content"].get<std::string>();
  if (plain) content = tokenizer.defused_text(content);
  const size_t at = rendered.rfind(content);
  if (content.empty() || at == std::string::npos)
    throw bad_request("continue_final_message", "the chat template does not write the last message's content as it is");
  return rendered.substr(0, at + content.size());
}

// Whether a request passes tools to the template (transformers' `tools is
// not None`: an empty list too): they go into its context, and a model's
// tool_use template renders it.
bool passes_tools(const ordered_json& body) { return body.contains("tools") && !body["tools"].is_null(); }

// The variables a Jinja chat template renders with, as transformers passes
// them: messages, tools, documents, add_generation_prompt, the vocabulary's
// bos_token and eos_token, then chat_template_kwargs' keys; all in the
// client's key order (a template may write them with tojson).
ordered_json template_context(const ordered_json& body, const gpu::Tokenizer& tokenizer, const ChatOptions& options) {
  const gpu::Vocabulary& v = tokenizer.vocabulary();
  auto piece = [&](int id) { return id >= 0 ? v.pieces[size_t(id)] : std::string(); };
  auto plain = [&](const ordered_json& x) { return options.special_tokens_in_content ? x : defused(x, tokenizer); };
  ordered_json messages = ordered_json::array();
  for (const ordered_json& m : body["messages"]) messages.push_back(template_message(m));
  ordered_json context = {{"messages", plain(messages)}, {"tools", passes_tools(body) ? plain(body["tools"]) : ordered_json()},
                          {"documents", nullptr}, {"add_generation_prompt", options.add_generation_prompt},
                          {"bos_token", piece(v.bos)}, {"eos_token", piece(v.eos)}};
  if (body.contains("chat_template_kwargs") && body["chat_template_kwargs"].is_object())
    for (const auto& [key, value] : body["chat_template_kwargs"].items()) {
      if (key == "messages" || key == "tools" || key == "documents" || key == "add_generation_prompt")
        throw bad_request("chat_template_kwargs", "'chat_template_kwargs' may not set " + quote(json(key)));
      context[key] = plain(value);
    }
  return context;
}

}  // namespace

ChatOptions chat_options(const json& body, const std::string& text) {
  ChatOptions o;
  if (const json* kwargs = field(body, "chat_template_kwargs")) {
    expect_type(kwargs->is_object(), "chat_template_kwargs", "an object", *kwargs);
    o.enable_thinking = boolean(*kwargs, "enable_thinking", true);
  }
  o.special_tokens_in_content = boolean(body, "special_tokens_in_content", false);
  o.add_generation_prompt = boolean(body, "add_generation_prompt", true);
  o.continue_final_message = boolean(body, "continue_final_message", false);
  if (o.add_generation_prompt && o.continue_final_message)
    throw bad_request("continue_final_message",
                      "'continue_final_message' needs 'add_generation_prompt': false (the prompt ends inside the last "
                      "message, not after it)");
  o.body_text = text;
  return o;
}

namespace {

// The compiled template of a request's chat_template: the last
// kCompiledRequestTemplates sources, least recently used out, shared by the
// frontend's threads (compiled outside the lock).
std::shared_ptr<const gpu::JinjaTemplate> request_template(const std::string& source) {
  if (source.size() > kMaxChatTemplateBytes)
    throw bad_request("chat_template", "'chat_template' holds " + std::to_string(source.size()) +
                                           " bytes, more than " + std::to_string(kMaxChatTemplateBytes));
  static std::mutex mutex;
  static std::list<std::pair<std::string, std::shared_ptr<const gpu::JinjaTemplate>>> compiled;
  {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto it = compiled.begin(); it != compiled.end(); ++it)
      if (it->first == source) {
        compiled.splice(compiled.begin(), compiled, it);
        return it->second;
      }
  }
  std::shared_ptr<const gpu::JinjaTemplate> made;
  try {
    made = std::make_shared<const gpu::JinjaTemplate>(source);
  } catch (const gpu::ChatTemplateError& e) {
    throw bad_request("chat_template", "'chat_template' does not compile: " + e.message);
  }
  std::lock_guard<std::mutex> lock(mutex);
  compiled.emplace_front(source, made);
  if (compiled.size() > kCompiledRequestTemplates) compiled.pop_back();
  return made;
}

}  // namespace

std::vector<int32_t> render_chat(const ChatFormat& chat, const json& messages, const gpu::Tokenizer& tokenizer,
                                 const ChatOptions& options, size_t max_characters) {
  using gpu::ChatMessage, gpu::ChatPiece;
  const bool plain = !options.special_tokens_in_content;
  std::vector<ChatPiece> pieces;
  try {
    if (chat.jinja) {
      gpu::JinjaLimits limits;
      limits.characters = max_characters;
      // The body again, its objects' keys in the client's order (json's are sorted).
      ordered_json body = options.body_text.empty() ? ordered_json{{"messages", ordered_json::parse(messages.dump())}}
                                                    : ordered_json::parse(options.body_text.begin(), options.body_text.end());
      const gpu::JinjaTemplate& jinja = passes_tools(body) && chat.tool_use ? *chat.tool_use : *chat.jinja;
      // (replace: a model file's bos or eos piece need not be UTF-8, which JSON text must be)
      std::string text = jinja.render(
          template_context(body, tokenizer, options).dump(-1, ' ', false, ordered_json::error_handler_t::replace),
          limits);
      if (options.continue_final_message) text = up_to_the_last_message(text, messages, tokenizer, plain);
      pieces.push_back({ChatPiece::text, std::move(text)});
    } else {
      if (!options.add_generation_prompt || options.continue_final_message)
        throw bad_request(options.continue_final_message ? "continue_final_message" : "add_generation_prompt",
                          std::string("the built-in ") + gpu::to_string(chat.family) +
                              " chat template always opens the assistant's turn; this needs the model file's template",
                          "unsupported");
      std::vector<ChatMessage> list;
      for (size_t i = 0; i < messages.size(); ++i)
        list.push_back({messages[i]["role"].get<std::string>(),
                        message_content(messages[i], i, chat.family, plain ? &tokenizer : nullptr)});
      pieces = gpu::render_chat_pieces(chat.family, list, "", options.enable_thinking);
    }
  } catch (const gpu::ChatTemplateError& e) {
    throw bad_request(options.request_template ? "chat_template" : "messages",
                      std::string("the ") +
                          (options.request_template ? "request's" : chat.jinja ? "model's" : gpu::to_string(chat.family)) +
                          " chat template: " + e.message);
  }
  const gpu::Vocabulary& v = tokenizer.vocabulary();
  std::vector<int32_t> tokens;
  for (const ChatPiece& p : pieces) {
    if (p.kind == ChatPiece::text) {
      const std::vector<int> ids = tokenizer.encode(p.value, /*add_bos=*/false, /*marked=*/plain);  // the template placed BOS
      tokens.insert(tokens.end(), ids.begin(), ids.end());
    } else if (const int id = p.kind == ChatPiece::bos ? v.bos : v.eos; id >= 0) {
      tokens.push_back(id);
    }
  }
  if (tokens.empty()) throw bad_request("messages", "the messages render to an empty prompt");
  return tokens;
}

// The prompt of a chat request's `messages`: checked (shape, roles, bytes),
// then rendered in the chat format with the body's options.
std::vector<int32_t> chat_prompt(const json& body, const std::string& text, const ServedModel& model,
                                 const gpu::Tokenizer& tokenizer, const ChatFormat& chat) {
  const json* list = field(body, "messages");
  if (!list) throw bad_request("messages", "'messages' is required", "missing");
  const json& messages = *list;
  expect_type(messages.is_array(), "messages", "an array of messages", messages);
  if (messages.empty()) throw bad_request("messages", "'messages' must not be empty");
  size_t bytes = 0;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      throw bad_request("messages", where + " must be an object with a string 'role'", "invalid_type");
    const std::string& role = m["role"].get_ref<const std::string&>();
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      throw bad_request("messages", where + ".role must be system, user, assistant or tool, got " + quote(m["role"]));
    bytes += message_content(m, i, chat.family).size();
  }
  if (int64_t(bytes) > model.max_prompt_bytes)
    throw bad_request("messages", "the messages hold " + std::to_string(bytes) + " bytes, more than " +
                                      std::to_string(model.max_prompt_bytes) + " (disagg.max-prompt-bytes)");
  ChatOptions options = chat_options(body, text);
  ChatFormat format = chat;
  if (const json* own = field(body, "chat_template"); own && !own->is_null()) {
    if (!chat.trusts_request_templates)
      throw bad_request("chat_template",
                        "this server renders no request's own chat template (a template is code run on the server: "
                        "node.trust-request-chat-template turns it on)",
                        "unsupported");
    expect_type(own->is_string(), "chat_template", "a Jinja template (a string)", *own);
    format.jinja = request_template(own->get_ref<const std::string&>());
    format.tool_use = nullptr;  // (the request's own renders all)
    options.request_template = true;
  }
  // A template adds its own text (turn markup, tool definitions): bounded at twice the messages' limit.
  return render_chat(format, messages, tokenizer, options, size_t(2 * model.max_prompt_bytes));
}

}  // namespace disagg::http
