#include "http/api.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <tuple>

#include "engine/speculation.h"
#include "grammar/json_grammar.h"
#include "grammar/gbnf.h"
#include "grammar/json_schema.h"
#include "grammar/regex.h"
#include "http/chat.h"
#include "http/fields.h"

namespace disagg::http {

namespace {

// A parse error's own words are cut after this many bytes (the quoted token can be as long as the body).
constexpr size_t kMaxParseMessageBytes = 160 + kMaxQuotedBytes;
// The longest UTF-8 encoding of one character.
constexpr size_t kMaxUtf8Bytes = 4;
// OpenAI's shapes name the chunks' objects so.
constexpr const char* kCompletionObject = "text_completion";
constexpr const char* kChatObject = "chat.completion";
constexpr const char* kChatChunkObject = "chat.completion.chunk";

json nullable(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }

// `text` cut after `limit` bytes, "..." marking the cut.
std::string clip(const std::string& text, size_t limit) {
  return text.size() <= limit ? text : text.substr(0, limit) + "...";
}

// A token id of the vocabulary: an integer, or (a logit_bias key) its
// decimal digits. The one vocabulary check of every field that names tokens.
int32_t token_id(const json& v, const std::string& text, const ServedModel& model, const char* param) {
  int64_t id = -1;
  if (v.is_number_integer()) {
    // (beyond int64: outside any vocabulary)
    id = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(model.vocab_size) ? model.vocab_size : v.get<int64_t>();
  } else if (!text.empty() && text.size() <= 10 && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    id = std::stoll(text);
  } else {
    throw bad_request(param, std::string("'") + param + "' names tokens by their ids, got " + quote(json(text)),
                      "invalid_type");
  }
  if (id < 0 || id >= model.vocab_size)
    throw bad_request(param, std::string("'") + param + "': token id " + (v.is_null() ? text : quote(v)) +
                                 " is outside the vocabulary [0, " + std::to_string(model.vocab_size) + ")");
  return int32_t(id);
}

// Our extra field "speculation" (engine/speculation.h; it changes no token):
// "off", "ngram", "draft", or {"method": "off" | "ngram" | "draft", "num_speculative_tokens",
// "prompt_lookup_min", "prompt_lookup_max"} (vLLM's names); what it leaves
// out, the decode worker's configuration says.
void parse_speculation(const json& body, gpu::SpeculationParams& p) {
  const json* v = field(body, "speculation");
  if (!v || v->is_null()) return;
  auto method = [&](const json& m) {
    if (!m.is_string() || !gpu::parse_speculation_method(m.get<std::string>(), p.method))
      throw bad_request("speculation", "'speculation' method must be \"off\", \"ngram\" or \"draft\", got " + quote(m));
  };
  if (v->is_string()) return method(*v);
  expect_type(v->is_object(), "speculation", "\"off\", \"ngram\", \"draft\" or an object", *v);
  for (auto it = v->begin(); it != v->end(); ++it)
    if (it.key() != "method" && it.key() != "num_speculative_tokens" && it.key() != "prompt_lookup_min" &&
        it.key() != "prompt_lookup_max")
      throw bad_request("speculation", "'speculation' has no field " + quote(json(it.key())));
  if (const json* m = field(*v, "method")) method(*m);
  p.num_tokens = int32_t(integer_in(*v, "num_speculative_tokens", 0, 1, gpu::kMaxSpeculativeTokens));
  p.lookup_min = int32_t(integer_in(*v, "prompt_lookup_min", 0, 1, gpu::kMaxLookupTokens));
  p.lookup_max = int32_t(integer_in(*v, "prompt_lookup_max", 0, 1, gpu::kMaxLookupTokens));
}

// The sampling controls (engine/sampling.h's order; vLLM's names and ranges).
void parse_sampling(const json& body, Endpoint endpoint, const ServedModel& model, int32_t max_tokens, Sampling& s) {
  s.top_k = int32_t(integer_in(body, "top_k", 0, -1, model.vocab_size));
  if (s.top_k < 0) s.top_k = 0;  // vLLM's -1: every token
  s.min_p = float(number_in(body, "min_p", 0.0, 0.0, 1.0, false));
  s.presence_penalty = float(number_in(body, "presence_penalty", 0.0, -gpu::kMaxPresencePenalty, gpu::kMaxPresencePenalty, false));
  s.frequency_penalty = float(number_in(body, "frequency_penalty", 0.0, -gpu::kMaxFrequencyPenalty, gpu::kMaxFrequencyPenalty, false));
  s.repetition_penalty = float(number_in(body, "repetition_penalty", 1.0, 0.0, gpu::kMaxRepetitionPenalty, true));
  if (const json* bias = field(body, "logit_bias")) {
    expect_type(bias->is_object(), "logit_bias", "an object of token ids to numbers", *bias);
    if (bias->size() > gpu::kMaxLogitBiasEntries)
      throw bad_request("logit_bias", "at most " + std::to_string(gpu::kMaxLogitBiasEntries) + " logit_bias entries, got " +
                                          std::to_string(bias->size()));
    for (auto it = bias->begin(); it != bias->end(); ++it) {
      const int32_t token = token_id(json(nullptr), it.key(), model, "logit_bias");
      expect_type(it.value().is_number(), "logit_bias", "an object of token ids to numbers", it.value());
      const double b = it.value().get<double>();
      if (!(b >= -gpu::kMaxLogitBias && b <= gpu::kMaxLogitBias))
        throw bad_request("logit_bias", "a logit_bias must be in [-100, 100], got " + quote(it.value()) + " for token " +
                                            std::to_string(token));
      s.logit_bias.push_back({token, float(b)});
    }
    // "7" and "07" are one token: named twice.
    std::vector<int32_t> ids;
    for (const auto& b : s.logit_bias) ids.push_back(b.token);
    std::sort(ids.begin(), ids.end());
    if (std::adjacent_find(ids.begin(), ids.end()) != ids.end())
      throw bad_request("logit_bias", "'logit_bias' names a token twice");
  }
  s.stop.min_tokens = int32_t(integer_in(body, "min_tokens", 0, 0, max_tokens));
  s.stop.ignore_eos = boolean(body, "ignore_eos", false);
  if (const json* ids = field(body, "stop_token_ids")) {
    expect_type(ids->is_array(), "stop_token_ids", "an array of token ids", *ids);
    if (ids->size() > gpu::kMaxStopTokenIds)
      throw bad_request("stop_token_ids", "at most " + std::to_string(gpu::kMaxStopTokenIds) + " stop_token_ids, got " +
                                              std::to_string(ids->size()));
    for (const json& id : *ids) {
      expect_type(id.is_number_integer(), "stop_token_ids", "an array of token ids", id);
      s.stop.stop_token_ids.push_back(token_id(id, {}, model, "stop_token_ids"));
    }
  }
  // Log probabilities: completions' logprobs N; chat's logprobs true with top_logprobs N.
  if (endpoint == Endpoint::completions) {
    s.logprobs = int32_t(integer_in(body, "logprobs", -1, 0, gpu::kMaxLogprobs));
  } else if (boolean(body, "logprobs", false)) {
    s.logprobs = int32_t(integer_in(body, "top_logprobs", 0, 0, gpu::kMaxLogprobs));
  } else if (field(body, "top_logprobs")) {
    throw bad_request("top_logprobs", "'top_logprobs' needs \"logprobs\": true");
  }
  parse_speculation(body, s.speculation);
  // The router checks the same (one rule); a request that passes here passes there.
  if (const std::string why = gpu::check_sampling(s, model.vocab_size); !why.empty()) throw bad_request("", why);
}

// An option we do not support: absent, null or its neutral value passes.
void refuse_unless(const json& body, const char* name, const std::function<bool(const json&)>& neutral) {
  const json* v = field(body, name);
  if (v && !neutral(*v))
    throw bad_request(name, std::string("'") + name + "' is not supported (got " + quote(*v) + ")", "unsupported");
}

// The grammar of response_format: none for {"type": "text"} (or no
// response_format), any JSON object for {"type": "json_object"}, the
// schema's for {"type": "json_schema", "json_schema": {"name", "schema",
// "strict"}} (a schema it cannot compile: 400 naming the keyword).
std::string response_format_grammar(const json& body, const nlohmann::ordered_json& in_order) {
  const json* v = field(body, "response_format");
  if (!v || v->is_null()) return {};
  expect_type(v->is_object(), "response_format", "an object", *v);
  const json* type = field(*v, "type");
  if (!type || !type->is_string())
    throw bad_request("response_format", "'response_format' needs a \"type\": \"text\", \"json_object\" or \"json_schema\"");
  if (*type == "text") return {};
  if (*type == "json_object") {
    static const std::string object = grammar::json_object_grammar().to_json();
    return object;
  }
  if (*type != "json_schema")
    throw bad_request("response_format", "'response_format' of type " + quote(*type) + " is not supported", "unsupported");
  const json* spec = field(*v, "json_schema");
  if (!spec || !spec->is_object())
    throw bad_request("response_format", "'response_format' of type json_schema needs a \"json_schema\" object");
  const json* schema = field(*spec, "schema");
  const json* strict = field(*spec, "strict");
  if (strict && !strict->is_boolean() && !strict->is_null())
    throw bad_request("response_format", "'response_format.json_schema.strict' must be a boolean");
  try {
    // No schema: any JSON value (OpenAI requires one; vLLM does not).
    // (the schema itself from the body in its keys' order)
    const grammar::Grammar g =
        grammar::json_schema_grammar(schema ? in_order.at("response_format").at("json_schema").at("schema")
                                            : nlohmann::ordered_json(true),
                                     strict && strict->is_boolean() && strict->get<bool>());
    return g.to_json();
  } catch (const grammar::GrammarError& e) {
    throw bad_request("response_format", std::string("response_format.json_schema: ") + e.what(), "unsupported");
  }
}

// vLLM's guided decoding fields: guided_json (a schema), guided_choice
// (one of these texts, written as they are), guided_grammar (GBNF,
// grammar/gbnf.h), guided_regex (the whole output matches it,
// grammar/regex.h). One source of a grammar per request.
std::string guided_grammar(const json& body, const nlohmann::ordered_json& in_order) {
  const json* schema = field(body, "guided_json");
  const json* choice = field(body, "guided_choice");
  const json* gbnf = field(body, "guided_grammar");
  const json* regex = field(body, "guided_regex");
  for (const json** f : {&schema, &choice, &gbnf, &regex})
    if (*f && (*f)->is_null()) *f = nullptr;
  if (int(schema != nullptr) + int(choice != nullptr) + int(gbnf != nullptr) + int(regex != nullptr) > 1)
    throw bad_request(gbnf ? "guided_grammar" : regex ? "guided_regex" : "guided_choice",
                      "'guided_json', 'guided_choice', 'guided_grammar' and 'guided_regex' exclude each other");
  for (const auto& [value, name, what] : {std::tuple{gbnf, "guided_grammar", "a string (GBNF)"},
                                          std::tuple{regex, "guided_regex", "a string (a regular expression)"}}) {
    if (!value) continue;
    expect_type(value->is_string(), name, what, *value);
    try {
      const std::string& text = value->get_ref<const std::string&>();
      return (value == gbnf ? grammar::gbnf_grammar(text) : grammar::regex_grammar(text)).to_json();
    } catch (const grammar::GrammarError& e) {
      throw bad_request(name, std::string(name) + ": " + e.what());
    }
  }
  if (schema) {
    try {
      // (vLLM takes the schema as an object or as its JSON text)
      const nlohmann::ordered_json parsed = schema->is_string() ? parse_ordered_json_limited(schema->get<std::string>())
                                                                : in_order.at("guided_json");
      return grammar::json_schema_grammar(parsed).to_json();
    } catch (const JsonOutOfBounds& e) {
      throw bad_request("guided_json", std::string("'guided_json' ") + e.what());
    } catch (const grammar::GrammarError& e) {
      throw bad_request("guided_json", std::string("guided_json: ") + e.what(), "unsupported");
    } catch (const json::exception&) {
      throw bad_request("guided_json", "'guided_json' is a string that is not JSON");
    }
  }
  if (choice) {
    expect_type(choice->is_array() && !choice->empty(), "guided_choice", "a non-empty array of strings", *choice);
    std::vector<grammar::Expr> options;
    for (const json& c : *choice) {
      expect_type(c.is_string() && !c.get_ref<const std::string&>().empty(), "guided_choice",
                  "a non-empty array of non-empty strings", c);
      options.push_back(grammar::Grammar::literal(c.get_ref<const std::string&>()));
    }
    grammar::Grammar g;
    g.define(0, grammar::Grammar::alt(options));
    return g.to_json();
  }
  return {};
}

std::vector<int32_t> as_tokens(const std::vector<int>& v) { return std::vector<int32_t>(v.begin(), v.end()); }

std::vector<int32_t> encode_checked(const std::string& text, const ServedModel& model, const gpu::Tokenizer& tokenizer,
                                    const char* param, bool add_bos = true) {
  if (int64_t(text.size()) > model.max_prompt_bytes)
    throw bad_request(param, std::string(param) + " of " + std::to_string(text.size()) + " bytes is longer than " +
                                 std::to_string(model.max_prompt_bytes) + " bytes (disagg.max-prompt-bytes)");
  return as_tokens(tokenizer.encode(text, add_bos));
}

// `prompt`: a string, an array of token ids, or a batch of one of them
// ([["text"]], [[ids]]; `batched` says p is that one); larger batches are n > 1.
std::vector<int32_t> parse_prompt(const json& p, const ServedModel& model, const gpu::Tokenizer& tokenizer,
                                  bool batched = false) {
  if (p.is_string()) {
    std::vector<int32_t> tokens = encode_checked(p.get_ref<const std::string&>(), model, tokenizer, "prompt");
    // (an empty text, with a tokenizer that puts no BOS first)
    if (tokens.empty()) throw bad_request("prompt", "'prompt' encodes to no tokens");
    return tokens;
  }
  expect_type(p.is_array(), "prompt", "a string or an array of token ids", p);
  if (p.empty()) throw bad_request("prompt", "'prompt' must not be an empty array");
  if (!batched && p.size() == 1 && (p[0].is_string() || p[0].is_array())) return parse_prompt(p[0], model, tokenizer, true);
  std::vector<int32_t> tokens;
  tokens.reserve(p.size());
  for (const auto& t : p) {
    if (!t.is_number_integer())
      throw bad_request("prompt", "'prompt' must be one string or one array of token ids (batched prompts are not supported)",
                        t.is_string() || t.is_array() ? "unsupported" : "invalid_type");
    tokens.push_back(token_id(t, {}, model, "prompt"));
  }
  return tokens;
}

}  // namespace

namespace {

// The parse callback of a request's JSON text: it sees each container open
// at the depth of its parent (the body's object: 0) before anything in it
// is parsed, and each key before its value, so neither bound is passed by
// anything built; nlohmann's parser and destructor are iterative, so nothing
// here recurses on the input.
class JsonGuard {
 public:
  bool operator()(int depth, json::parse_event_t event) {
    using Event = json::parse_event_t;
    try {
      gpu::json_within_depth(depth, event, kMaxJsonDepth);
    } catch (const gpu::JsonNestedTooDeep&) {
      throw JsonOutOfBounds("nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    }
    if (event == Event::object_start || event == Event::array_start) members_.push_back(0);
    if ((event == Event::object_end || event == Event::array_end) && !members_.empty()) members_.pop_back();
    if (event == Event::key && !members_.empty() && ++members_.back() > kMaxJsonMembers)
      throw JsonOutOfBounds("holds an object of more than " + std::to_string(kMaxJsonMembers) + " members");
    return true;
  }

 private:
  std::vector<size_t> members_;  // of each container open (an array's stay 0)
};

template <class Json>
Json parse_guarded(const std::string& text) {
  JsonGuard guard;
  return Json::parse(text, [&guard](int depth, json::parse_event_t event, Json&) { return guard(depth, event); });
}

}  // namespace

json parse_json_limited(const std::string& text) { return parse_guarded<json>(text); }

nlohmann::ordered_json parse_ordered_json_limited(const std::string& text) {
  return parse_guarded<nlohmann::ordered_json>(text);
}

namespace {

// A request body: a JSON object (nesting bounded while it is parsed) whose
// "model", if any, is the one served (else 404).
json parse_body(const std::string& text, const ServedModel& model) {
  json body;
  try {
    body = parse_json_limited(text);
  } catch (const JsonOutOfBounds& e) {
    throw bad_request("", std::string("the request's JSON ") + e.what(), "invalid_json");
  } catch (const json::exception& e) {  // parse_error, and out_of_range 406: a number beyond a double
    throw bad_request("", "malformed JSON: " + clip(e.what(), kMaxParseMessageBytes), "invalid_json");
  }
  if (!body.is_object()) throw bad_request("", "the request body must be a JSON object", "invalid_json");

  if (const json* m = field(body, "model")) {
    expect_type(m->is_string(), "model", "a string", *m);
    if (m->get_ref<const std::string&>() != model.name) throw model_not_found(m->get_ref<const std::string&>(), model);
  }
  return body;
}


// A token's text after `previous` ("" for an id the tokenizer lacks).
std::string piece_after(const gpu::Tokenizer& tokenizer, int32_t previous, int32_t token) {
  try {
    return tokenizer.decode(previous, token);
  } catch (const std::exception&) {
    return {};  // an id the tokenizer lacks (the router checked the vocabulary)
  }
}
// completions' top_logprobs entry: the alternatives' texts (after `previous`)
// and the sampled token's (`text`) to their log probabilities.
json alternatives_by_text(const gpu::Tokenizer& tokenizer, int32_t previous, const TokenLogprobs& lp,
                          const std::string& text) {
  json alternatives = json::object();
  for (size_t k = 0; k < lp.top_tokens.size() && k < lp.top_logprobs.size(); ++k)
    alternatives[piece_after(tokenizer, previous, lp.top_tokens[k])] = lp.top_logprobs[k];
  alternatives[text] = lp.logprob;
  return alternatives;
}

json bytes_of(const std::string& text) {
  json out = json::array();
  for (unsigned char c : text) out.push_back(int(c));
  return out;
}

}  // namespace

json error_body(const ApiError& e) {
  return {{"error", {{"message", e.message}, {"type", e.type}, {"param", nullable(e.param)}, {"code", nullable(e.code)}}}};
}

ApiError bad_request(const std::string& param, const std::string& message, const std::string& code) {
  ApiError e;
  e.status = 400;
  e.message = message;
  e.param = param;
  e.code = code;
  return e;
}

ApiError error_for_outcome(ErrorCode code, const std::string& message) {
  ApiError e;
  e.message = message;
  e.code = to_string(code);
  switch (code) {
    case ErrorCode::invalid_request:
    case ErrorCode::kv_too_large:
      e.status = 400;
      e.type = "invalid_request_error";
      break;
    case ErrorCode::overloaded:
      e.status = 503;
      e.type = "overloaded_error";
      e.retry_after_s = kOverloadedRetryAfterS;
      break;
    case ErrorCode::timeout:
      e.status = 504;
      e.type = "timeout_error";
      break;
    default:  // worker_lost, incompatible_kv, internal, cancelled (by someone else)
      e.status = 500;
      e.type = "server_error";
      break;
  }
  return e;
}

std::string prompt_text(const gpu::Tokenizer& tokenizer, const std::vector<int32_t>& tokens) {
  // BOS and EOS have no text (a llama2.c vocabulary spells them, untyped);
  // as after BOS, SentencePiece's first word loses the space it was encoded with.
  const gpu::Vocabulary& v = tokenizer.vocabulary();
  std::vector<int> ids;
  for (int32_t t : tokens)
    if (t != v.bos && t != v.eos) ids.push_back(t);
  return tokenizer.decode_all(v.bos, ids);
}

json prompt_logprobs_json(const gpu::Tokenizer& tokenizer, const std::vector<int32_t>& prompt,
                          const std::vector<TokenLogprobs>& logprobs, int64_t& text_offset) {
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array();
  const gpu::Vocabulary& v = tokenizer.vocabulary();
  for (size_t i = 0; i < prompt.size(); ++i) {
    const bool special = prompt[i] == v.bos || prompt[i] == v.eos;
    const std::string text = special ? std::string() : piece_after(tokenizer, i ? prompt[i - 1] : v.bos, prompt[i]);
    tokens.push_back(text);
    offsets.push_back(text_offset);
    text_offset += int64_t(text.size());
    if (i == 0 || i - 1 >= logprobs.size()) {  // the first token follows nothing
      token_logprobs.push_back(nullptr);
      top.push_back(nullptr);
      continue;
    }
    token_logprobs.push_back(logprobs[i - 1].logprob);
    top.push_back(alternatives_by_text(tokenizer, prompt[i - 1], logprobs[i - 1], text));
  }
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

namespace {

std::vector<int32_t> control_markers(const gpu::Tokenizer& tokenizer, gpu::ToolSyntax syntax);

// The prompt's tokens: completions' `prompt`, or chat's `messages` rendered;
// shorter than the context.
std::vector<int32_t> request_prompt(const json& body, const std::string& text, Endpoint endpoint, const ServedModel& model,
                                    const gpu::Tokenizer& tokenizer, const ChatFormat& chat) {
  std::vector<int32_t> tokens;
  if (endpoint == Endpoint::completions) {
    const json* prompt = field(body, "prompt");
    if (!prompt) throw bad_request("prompt", "'prompt' is required", "missing");
    tokens = parse_prompt(*prompt, model, tokenizer);
  } else {
    tokens = chat_prompt(body, text, model, tokenizer, chat);
  }
  if (int64_t(tokens.size()) >= model.seq_len)
    throw bad_request(endpoint == Endpoint::chat ? "messages" : "prompt",
                      "the prompt is " + std::to_string(tokens.size()) + " tokens; this model's context is " +
                          std::to_string(model.seq_len) + " tokens", "context_length_exceeded");
  return tokens;
}

// max_tokens (chat: or max_completion_tokens) within what the context leaves
// after the prompt; without one, completions' default or (chat) as many as
// the context holds (`defaulted`).
int32_t request_max_tokens(const json& body, Endpoint endpoint, const ServedModel& model, int64_t prompt_len,
                           bool& defaulted) {
  const char* max_name = "max_tokens";
  const json* max_tokens = field(body, "max_tokens");
  if (!max_tokens && endpoint == Endpoint::chat && field(body, "max_completion_tokens")) {
    max_name = "max_completion_tokens";
    max_tokens = field(body, max_name);
  }
  defaulted = false;
  if (!max_tokens) {
    defaulted = endpoint == Endpoint::chat;
    return endpoint == Endpoint::chat ? int32_t(model.seq_len - prompt_len)
                                      : int32_t(std::min<int64_t>(kDefaultCompletionMaxTokens, model.seq_len - prompt_len));
  }
  expect_type(max_tokens->is_number_integer(), max_name, "an integer", *max_tokens);
  // Beyond int64 (unsigned) is beyond any context; compared without overflowing.
  const bool huge = max_tokens->is_number_unsigned() && max_tokens->get<uint64_t>() > uint64_t(model.seq_len);
  const int64_t m = huge ? int64_t(model.seq_len) + 1 : max_tokens->get<int64_t>();
  if (m < 1) throw bad_request(max_name, std::string("'") + max_name + "' must be at least 1, got " + std::to_string(m));
  if (m > model.seq_len - prompt_len)
    throw bad_request(max_name, "This model's maximum context length is " + std::to_string(model.seq_len) +
                                    " tokens. However, you requested " + std::to_string(prompt_len) +
                                    " tokens in the prompt and " + quote(*max_tokens) + " for the completion.",
                      "context_length_exceeded");
  return int32_t(m);
}

// `stop`: one string or at most kMaxStopStrings, each at most kMaxStopBytes
// (empty ones dropped).
std::vector<std::string> request_stop(const json& body) {
  std::vector<std::string> out;
  const json* stop = field(body, "stop");
  if (!stop) return out;
  if (stop->is_string()) {
    out.push_back(stop->get<std::string>());
  } else {
    expect_type(stop->is_array(), "stop", "a string or an array of strings", *stop);
    if (stop->size() > kMaxStopStrings)
      throw bad_request("stop", "at most " + std::to_string(kMaxStopStrings) + " stop strings, got " + quote(*stop));
    for (const auto& s : *stop) {
      expect_type(s.is_string(), "stop", "a string or an array of strings", s);
      out.push_back(s.get<std::string>());
    }
  }
  out.erase(std::remove(out.begin(), out.end(), std::string()), out.end());
  for (const auto& s : out)
    if (s.size() > kMaxStopBytes)
      throw bad_request("stop", "a stop string may be at most " + std::to_string(kMaxStopBytes) + " bytes, got " +
                                    std::to_string(s.size()) + " (" + quote(json(s)) + ")");
  return out;
}

}  // namespace

ApiRequest parse_request(Endpoint endpoint, const std::string& text, const ServedModel& model,
                         const gpu::Tokenizer& tokenizer, const ChatFormat& chat,
                         const std::function<uint64_t()>& random_seed) {
  const json body = parse_body(text, model);
  // Unsupported options: only their neutral values pass.
  if (endpoint == Endpoint::chat)  // (a completions option)
    refuse_unless(body, "echo", [](const json& v) { return v.is_boolean() && !v.get<bool>(); });

  ApiRequest r;
  r.endpoint = endpoint;
  r.prompt_tokens = request_prompt(body, text, endpoint, model, tokenizer, chat);
  r.max_tokens = request_max_tokens(body, endpoint, model, int64_t(r.prompt_tokens.size()), r.max_tokens_defaulted);

  r.sampling.temperature = float(number_in(body, "temperature", 1.0, 0.0, kMaxTemperature, false));
  r.sampling.top_p = float(number_in(body, "top_p", 1.0, 0.0, 1.0, true));
  if (const json* seed = field(body, "seed")) {
    expect_type(seed->is_number_integer(), "seed", "an integer", *seed);
    r.sampling.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : uint64_t(seed->get<int64_t>());
  } else {
    r.sampling.seed = random_seed();
  }
  // The fields that hold JSON schemas read them from the body parsed again
  // keeping its keys' order (properties are written in their schema's order).
  const nlohmann::ordered_json in_order =
      field(body, "response_format") || field(body, "guided_json") || field(body, "tools")
          ? parse_ordered_json_limited(text)
          : nlohmann::ordered_json::object();
  r.sampling.grammar = response_format_grammar(body, in_order);
  if (std::string guided = guided_grammar(body, in_order); !guided.empty()) {
    if (!r.sampling.grammar.empty())
      throw bad_request("response_format", "'response_format' and vLLM's guided_* options exclude each other");
    r.sampling.grammar = std::move(guided);
  }
  if (endpoint == Endpoint::chat) {
    r.reasoning = gpu::reasoning_syntax_of(gpu::to_string(chat.family));
    if (r.reasoning != gpu::ReasoningSyntax::none) {
      const size_t tail = std::min<size_t>(r.prompt_tokens.size(), 8);  // <think> and a few newlines
      const std::vector<int> last(r.prompt_tokens.end() - std::ptrdiff_t(tail), r.prompt_tokens.end());
      r.thought_opened = gpu::prompt_opens_thought(r.reasoning, tokenizer.decode_all(-1, last));
    }
    std::string calls;
    r.tools = parse_tools(body, in_order, chat.family, calls);
    if (r.tools.choice == ToolUse::Choice::automatic) r.tools.marker_tokens = control_markers(tokenizer, r.tools.syntax);
    // A required or named call is this turn's output: its grammar rules, and
    // a response_format waits for a turn that answers in text (as OpenAI
    // and vLLM take both, and the Agents SDK sends both).
    if (!calls.empty()) r.sampling.grammar = std::move(calls);
    // (auto with a response_format: the format rules, the output is content)
    if (r.tools.choice == ToolUse::Choice::automatic && !r.sampling.grammar.empty()) r.tools.choice = ToolUse::Choice::none;
    // (under a grammar the output is what it rules, content: no </think> can close a thought the prompt opened)
    if (!r.sampling.grammar.empty()) r.thought_opened = false;
  }
  parse_sampling(body, endpoint, model, r.max_tokens, r.sampling);
  r.logprobs = r.sampling.logprobs;
  r.n = int32_t(integer_in(body, "n", 1, 1, kMaxChoices));
  r.best_of = int32_t(integer_in(body, "best_of", r.n, r.n, kMaxChoices));
  r.stop = request_stop(body);
  // A stop would cut the output a grammar rules before it is complete, and
  // a reply that ends with "stop" must parse (a stop token id is not one of
  // the grammar's ends: it may come anywhere).
  if (!r.sampling.grammar.empty())
    for (const char* key : {"stop", "stop_token_ids"})
      if (key == std::string("stop") ? !r.stop.empty() : !r.sampling.stop.stop_token_ids.empty())
        throw bad_request(key, std::string("'") + key +
                                   "' beside a structured output (response_format, guided_*, a required or named "
                                   "tool call) would cut it before it is complete",
                          "unsupported");
  r.stream = boolean(body, "stream", false);
  if (endpoint == Endpoint::completions && boolean(body, "echo", false)) {
    r.echo = true;
    const json* prompt = field(body, "prompt");
    r.echo_text = prompt->is_string() ? prompt->get<std::string>() : prompt_text(tokenizer, r.prompt_tokens);
    if (r.logprobs >= 0) {
      if (r.stream)
        throw bad_request("echo", "'echo' with 'logprobs' cannot be streamed (the prompt's come with the end)");
      r.sampling.prompt_logprobs = r.logprobs;
    }
  }
  if (r.stream && r.best_of > r.n)
    throw bad_request("best_of", "'best_of' greater than 'n' cannot be streamed (the best are known at the end)");
  // (streamed, each chunk carries its tokens' log probabilities and they are
  // let go; under tools they wait for the calls, read when the choice ends)
  if (!r.stream || r.tools.active()) fit_reply_logprobs(r);
  // best_of ranks its samples by their log probabilities: computed, shown only when asked.
  if (r.best_of > r.n) r.sampling.logprobs = std::max(r.sampling.logprobs, 0);
  if (const json* options = field(body, "stream_options")) {
    expect_type(options->is_object(), "stream_options", "an object", *options);
    if (!r.stream) throw bad_request("stream_options", "'stream_options' is only allowed with \"stream\": true");
    if (const json* usage = field(*options, "include_usage")) {
      expect_type(usage->is_boolean(), "stream_options", "an object with a boolean include_usage", *usage);
      r.include_usage = usage->get<bool>();
    }
  }
  r.user = string_of(body, "user");
  r.return_token_ids = boolean(body, "return_token_ids", false);
  r.cache_salt = string_of(body, "cache_salt");
  return r;
}

void fit_reply_logprobs(ApiRequest& r) {
  if (r.logprobs < 0) return;
  const int64_t echoed = r.echo ? int64_t(r.prompt_tokens.size()) : 0;
  // (chat without max_tokens: as many as fit, the bound included)
  // (best_of: every sample's are held until the best are known)
  const int64_t samples = std::max(r.n, r.best_of);
  const int64_t fit = kMaxReplyLogprobs / (samples * (r.logprobs + 1)) - echoed;
  if (r.max_tokens_defaulted && r.max_tokens > fit && fit >= std::max<int64_t>(1, r.sampling.stop.min_tokens))
    r.max_tokens = int32_t(fit);
  const int64_t tokens = int64_t(r.max_tokens) + echoed;
  const int64_t most = samples * tokens * (r.logprobs + 1);
  if (most > kMaxReplyLogprobs)
    throw bad_request(r.endpoint == Endpoint::chat ? "top_logprobs" : "logprobs",
                      "a reply of " + std::to_string(samples) + " sample(s) of up to " + std::to_string(tokens) +
                          " tokens with " + std::to_string(r.logprobs) + " alternatives each carries up to " +
                          std::to_string(most) + " log probabilities, more than the " +
                          std::to_string(kMaxReplyLogprobs) +
                          " a reply kept whole may; ask for fewer tokens, choices or alternatives" +
                          (r.stream || r.best_of > r.n || r.tools.active() ? "" : ", or stream it"));
}

// ---------------------------------------------------------------- TextAssembler

TextAssembler::TextAssembler(const gpu::Tokenizer& tokenizer, std::vector<std::string> stop, int32_t last_prompt_token,
                             std::vector<int32_t> shown)
    : tokenizer_(tokenizer), stop_(std::move(stop)), shown_(std::move(shown)), previous_(last_prompt_token) {}

std::string TextAssembler::release(size_t upto) {
  std::string out = pending_.substr(0, upto);
  pending_.erase(0, upto);
  text_ += out;
  return out;
}

std::string TextAssembler::add(int32_t token) {
  ++tokens_;
  if (stopped_) return {};
  try {
    if (std::find(shown_.begin(), shown_.end(), token) != shown_.end())
      pending_ += tokenizer_.vocabulary().pieces.at(size_t(token));
    else
      pending_ += tokenizer_.decode(previous_, token);
  } catch (const std::exception&) {
    // an id the tokenizer lacks: no text (the router checked the vocabulary)
  }
  previous_ = token;
  // A stop string can only begin in pending_: what was released ended in
  // no prefix of one.
  size_t first = std::string::npos;
  for (const auto& s : stop_) first = std::min(first, pending_.find(s));
  if (first != std::string::npos) {
    stopped_ = true;
    std::string out = release(first);
    pending_.clear();
    return out;
  }
  size_t hold = 0;
  for (const auto& s : stop_)
    for (size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k)
      if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  // An incomplete UTF-8 character at the end waits for its next bytes.
  for (size_t back = 1; back <= std::min(kMaxUtf8Bytes, pending_.size()); ++back) {
    const auto c = static_cast<unsigned char>(pending_[pending_.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t length = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (length > back) hold = std::max(hold, back);
    break;
  }
  return release(pending_.size() - hold);
}

std::string TextAssembler::flush() {
  if (stopped_) return {};
  return release(pending_.size());
}

// ---------------------------------------------------------------- responses

json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens, int64_t reasoning_tokens) {
  json usage = {{"prompt_tokens", prompt_tokens},
                {"completion_tokens", completion_tokens},
                {"total_tokens", prompt_tokens + completion_tokens},
                {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
  if (reasoning_tokens >= 0) usage["completion_tokens_details"] = {{"reasoning_tokens", reasoning_tokens}};
  return usage;
}

json choice_json(Endpoint endpoint, int index, const std::string& text, const std::string& finish_reason) {
  json choice = {{"index", index}};
  if (endpoint == Endpoint::completions) choice["text"] = text;
  else choice["message"] = {{"role", "assistant"}, {"content", text}};
  choice["logprobs"] = nullptr;
  choice["finish_reason"] = nullable(finish_reason);
  return choice;
}

// ---------------------------------------------------------------- tools

namespace {

// The markup that may begin a call in the family's syntax (text/tool_calls.h).
const std::vector<std::string>& call_markers(gpu::ToolSyntax syntax) {
  static const std::vector<std::string> none, llama3 = {"<|python_tag|>"}, hermes = {"<tool_call>"},
                                        mistral = {"[TOOL_CALLS]"};
  switch (syntax) {
    case gpu::ToolSyntax::llama3: return llama3;
    case gpu::ToolSyntax::hermes: return hermes;
    case gpu::ToolSyntax::mistral: return mistral;
    case gpu::ToolSyntax::none: break;
  }
  return none;
}

// The syntax's markers that this vocabulary makes one control token each.
std::vector<int32_t> control_markers(const gpu::Tokenizer& tokenizer, gpu::ToolSyntax syntax) {
  std::vector<int32_t> ids;
  for (const std::string& marker : call_markers(syntax)) {
    const std::vector<int> t = tokenizer.encode(marker, false);
    if (t.size() == 1 && tokenizer.type_of(t[0]) == gpu::TokenType::control) ids.push_back(t[0]);
  }
  return ids;
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

// {"name": a string, "arguments": anything} as a call (required's elements).
bool required_call(const json& j, gpu::ToolCall& call) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string() || !j.contains("arguments")) return false;
  call = {j["name"].get<std::string>(), dump(j["arguments"])};
  return true;
}

}  // namespace

ToolStream::ToolStream(const ToolUse& tools) : tools_(tools) {}

void ToolStream::add_call(gpu::ToolCall call, std::vector<Delta>& out) {
  const size_t index = calls_.size();
  out.push_back({Delta::Kind::call, call.name, index});
  out.push_back({Delta::Kind::arguments, call.arguments, index});
  calls_.push_back(std::move(call));
}

std::vector<ToolStream::Delta> ToolStream::add(const std::string& piece) {
  std::vector<Delta> out;
  text_ += piece;
  switch (tools_.choice) {
    case ToolUse::Choice::none: break;
    case ToolUse::Choice::named:
      if (!head_sent_) out.push_back({Delta::Kind::call, tools_.name, 0});
      head_sent_ = true;
      if (!piece.empty()) out.push_back({Delta::Kind::arguments, piece, 0});
      break;
    case ToolUse::Choice::required: scan_array(out); break;
    case ToolUse::Choice::automatic: {
      if (held_) break;
      size_t safe = text_.size();
      const size_t first = text_.find_first_not_of(" \t\r\n");
      if (tools_.syntax == gpu::ToolSyntax::llama3 && (first == std::string::npos || text_[first] == '{')) {
        // (a leading object is a call: nothing is sure before the first character)
        held_ = first != std::string::npos;
        break;
      }
      for (const std::string& marker : call_markers(tools_.syntax)) {
        const size_t at = text_.find(marker, streamed_);
        if (at != std::string::npos) {
          safe = std::min(safe, at);
          held_ = true;
          continue;
        }
        // A tail that may be the marker's start waits.
        for (size_t k = std::min(marker.size() - 1, text_.size()); k > 0; --k)
          if (text_.compare(text_.size() - k, k, marker, 0, k) == 0) {
            safe = std::min(safe, text_.size() - k);
            break;
          }
      }
      if (safe > streamed_) out.push_back({Delta::Kind::content, text_.substr(streamed_, safe - streamed_), 0});
      streamed_ = std::max(streamed_, safe);
      break;
    }
  }
  return out;
}

// [ {call} , {call} ... ]: each element whole as its closing brace comes.
void ToolStream::scan_array(std::vector<Delta>& out) {
  for (; scanned_ < text_.size() && !broken_ && !closed_; ++scanned_) {
    const char c = text_[scanned_];
    if (in_string_) {
      if (escaped_) escaped_ = false;
      else if (c == '\\') escaped_ = true;
      else if (c == '"') in_string_ = false;
      continue;
    }
    if (is_space(c)) continue;
    if (depth_ == 0) {
      if (c == '[') depth_ = 1;
      else broken_ = true;
    } else if (depth_ == 1) {
      if (c == '{') {
        element_ = scanned_;
        depth_ = 2;
      } else if (c == ']') {
        closed_ = true;
      } else if (c != ',') {
        broken_ = true;  // (an element that is not an object)
      }
    } else if (c == '"') {
      in_string_ = true;
    } else if (c == '{' || c == '[') {
      ++depth_;
    } else if (c == '}' || c == ']') {
      if (--depth_ > 1) continue;
      gpu::ToolCall call;
      const json j = json::parse(text_.substr(element_, scanned_ + 1 - element_), nullptr, false);
      if (j.is_discarded() || !required_call(j, call)) broken_ = true;
      else add_call(std::move(call), out);
    }
  }
}

ToolReply ToolStream::finish(const std::string& finish_reason, std::vector<Delta>& deltas) {
  ToolReply reply{text_, {}, finish_reason, {}};
  switch (tools_.choice) {
    case ToolUse::Choice::none: break;
    case ToolUse::Choice::named: {
      if (!head_sent_) deltas.push_back({Delta::Kind::call, tools_.name, 0});
      head_sent_ = true;
      reply.content.clear();
      reply.calls.push_back({tools_.name, text_});
      const json j = json::parse(text_, nullptr, false);
      if (finish_reason == "stop" && j.is_object()) reply.finish_reason = "tool_calls";
      break;
    }
    case ToolUse::Choice::required:
      if (calls_.empty()) {
        deltas.push_back({Delta::Kind::content, text_, 0});  // (held back while it might have been calls)
        break;
      }
      reply.content.clear();
      reply.calls = calls_;
      if (finish_reason == "stop" && closed_ && !broken_) reply.finish_reason = "tool_calls";
      break;
    case ToolUse::Choice::automatic: {
      gpu::ParsedOutput parsed;
      if (finish_reason == "stop") parsed = gpu::parse_tool_calls(tools_.syntax, text_);
      if (parsed.calls.empty()) {
        if (text_.size() > streamed_) deltas.push_back({Delta::Kind::content, text_.substr(streamed_), 0});
        streamed_ = text_.size();
        break;
      }
      reply.content = std::move(parsed.content);
      for (gpu::ToolCall& call : parsed.calls) add_call(std::move(call), deltas);
      reply.calls = calls_;
      reply.finish_reason = "tool_calls";
      break;
    }
  }
  return reply;
}

ToolReply read_tool_calls(const ToolUse& tools, const std::string& text, const std::string& finish_reason) {
  ToolStream stream(tools);
  std::vector<ToolStream::Delta> deltas = stream.add(text);
  return stream.finish(finish_reason, deltas);
}

json tool_choice_json(int index, const ToolReply& reply, const std::string& id_prefix) {
  json message = {{"role", "assistant"}, {"content", nullable(reply.content)}};
  if (!reply.reasoning.empty()) message["reasoning_content"] = reply.reasoning;
  if (!reply.calls.empty()) {
    json calls = json::array();
    for (size_t k = 0; k < reply.calls.size(); ++k)
      calls.push_back({{"id", id_prefix + std::to_string(k)},
                       {"type", "function"},
                       {"function", {{"name", reply.calls[k].name}, {"arguments", reply.calls[k].arguments}}}});
    message["tool_calls"] = std::move(calls);
  }
  return {{"index", index}, {"message", message}, {"logprobs", nullptr}, {"finish_reason", nullable(reply.finish_reason)}};
}

json tool_delta_chunk(const std::string& id, int64_t created, const std::string& model, int index,
                      const ToolStream::Delta& delta, const std::string& id_prefix, bool include_usage) {
  json chunk = stream_chunk(Endpoint::chat, id, created, model, index, "", "", false, include_usage);
  json& out = chunk["choices"][0]["delta"];
  switch (delta.kind) {
    case ToolStream::Delta::Kind::content: out = {{"content", delta.text}}; break;
    case ToolStream::Delta::Kind::call:
      out = {{"tool_calls", json::array({{{"index", delta.index},
                                           {"id", id_prefix + std::to_string(delta.index)},
                                           {"type", "function"},
                                           {"function", {{"name", delta.text}, {"arguments", ""}}}}})}};
      break;
    case ToolStream::Delta::Kind::arguments:
      out = {{"tool_calls", json::array({{{"index", delta.index}, {"function", {{"arguments", delta.text}}}}})}};
      break;
  }
  return chunk;
}

json reasoned_choice_json(int index, const gpu::Reasoned& text, const std::string& finish_reason) {
  json choice = choice_json(Endpoint::chat, index, text.content, finish_reason);
  choice["message"]["reasoning_content"] = nullable(text.reasoning);
  return choice;
}

json reasoned_chunk(const std::string& id, int64_t created, const std::string& model, int index,
                    const gpu::Reasoned& piece, bool include_usage) {
  json chunk = stream_chunk(Endpoint::chat, id, created, model, index, piece.content, "", false, include_usage);
  if (!piece.reasoning.empty()) chunk["choices"][0]["delta"]["reasoning_content"] = piece.reasoning;
  return chunk;
}

json response_json(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model, json choices,
                   int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens, int64_t reasoning_tokens) {
  return {{"id", id},
          {"object", endpoint == Endpoint::completions ? kCompletionObject : kChatObject},
          {"created", created},
          {"model", model},
          {"choices", std::move(choices)},
          {"usage", usage_json(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}};
}

json stream_chunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model, int index,
                  const std::string& text, const std::string& finish_reason, bool first, bool include_usage) {
  json choice = {{"index", index}, {"logprobs", nullptr}, {"finish_reason", nullable(finish_reason)}};
  if (endpoint == Endpoint::completions) {
    choice["text"] = text;
  } else {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || (first && finish_reason.empty())) delta["content"] = text;
    choice["delta"] = delta;
  }
  json chunk = {{"id", id},
                {"object", endpoint == Endpoint::completions ? kCompletionObject : kChatChunkObject},
                {"created", created},
                {"model", model},
                {"choices", json::array({choice})}};
  if (include_usage) chunk["usage"] = nullptr;
  return chunk;
}

json usage_chunk(Endpoint endpoint, const std::string& id, int64_t created, const std::string& model,
                 int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens, int64_t reasoning_tokens) {
  return {{"id", id},
          {"object", endpoint == Endpoint::completions ? kCompletionObject : kChatChunkObject},
          {"created", created},
          {"model", model},
          {"choices", json::array()},
          {"usage", usage_json(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens)}};
}

ApiError model_not_found(const std::string& asked, const ServedModel& model) {
  ApiError e;
  e.status = 404;
  e.message = "The model " + quote(json(asked)) + " does not exist (this server serves `" + model.name + "`).";
  e.param = "model";
  e.code = "model_not_found";
  return e;
}

json model_json(const ServedModel& model) {
  return {{"id", model.name},
          {"object", "model"},
          {"created", model.created},
          {"owned_by", "disagg"},
          {"root", model.name},
          {"max_model_len", model.seq_len}};
}

json models_response(const ServedModel& model) { return {{"object", "list"}, {"data", json::array({model_json(model)})}}; }

json model_response(const ServedModel& model, const std::string& id) {
  if (id != model.name) throw model_not_found(id, model);
  return model_json(model);
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

int64_t tokens_within(const gpu::Tokenizer& tokenizer, int32_t previous, const std::vector<int32_t>& ids, size_t bytes) {
  size_t at = 0;
  int64_t n = 0;
  for (const int32_t id : ids) {
    if (at >= bytes) break;
    at += piece_after(tokenizer, previous, id).size();
    previous = id;
    ++n;
  }
  return n;
}

json logprobs_json(Endpoint endpoint, const gpu::Tokenizer& tokenizer, int32_t previous, const std::vector<int32_t>& ids,
                   const std::vector<TokenLogprobs>& logprobs, size_t from, int64_t& text_offset) {
  if (from > 0 && from <= ids.size()) previous = ids[from - 1];
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(), offsets = json::array(),
       content = json::array();
  for (size_t i = from; i < ids.size() && i - from < logprobs.size(); ++i) {
    const TokenLogprobs& lp = logprobs[i - from];
    const std::string text = piece_after(tokenizer, previous, ids[i]);
    if (endpoint == Endpoint::completions) {
      tokens.push_back(text);
      token_logprobs.push_back(lp.logprob);
      top.push_back(alternatives_by_text(tokenizer, previous, lp, text));
      offsets.push_back(text_offset);
    } else {
      json alternatives = json::array();
      for (size_t k = 0; k < lp.top_tokens.size() && k < lp.top_logprobs.size(); ++k) {
        const std::string alt = piece_after(tokenizer, previous, lp.top_tokens[k]);
        alternatives.push_back({{"token", alt}, {"logprob", lp.top_logprobs[k]}, {"bytes", bytes_of(alt)}});
      }
      content.push_back({{"token", text}, {"logprob", lp.logprob}, {"bytes", bytes_of(text)}, {"top_logprobs", alternatives}});
    }
    text_offset += int64_t(text.size());
    previous = ids[i];
  }
  if (endpoint == Endpoint::chat) return {{"content", content}};
  return {{"tokens", tokens}, {"token_logprobs", token_logprobs}, {"top_logprobs", top}, {"text_offset", offsets}};
}

json tokenize_response(const std::string& text, const ServedModel& model, const gpu::Tokenizer& tokenizer,
                       const ChatFormat& chat) {
  const json body = parse_body(text, model);
  std::vector<int32_t> tokens;
  const json* prompt = field(body, "prompt");
  const json* messages = field(body, "messages");
  if ((prompt != nullptr) == (messages != nullptr))
    throw bad_request(prompt ? "messages" : "prompt", "give exactly one of 'prompt' and 'messages'", "missing");
  if (prompt) {
    expect_type(prompt->is_string(), "prompt", "a string", *prompt);
    tokens = encode_checked(prompt->get_ref<const std::string&>(), model, tokenizer, "prompt",
                            boolean(body, "add_special_tokens", true));
  } else {
    tokens = chat_prompt(body, text, model, tokenizer, chat);
  }
  json out = {{"count", tokens.size()}, {"max_model_len", model.seq_len}, {"tokens", tokens}, {"token_strs", nullptr}};
  if (boolean(body, "return_token_strs", false)) {
    json strs = json::array();
    for (int32_t t : tokens) strs.push_back(tokenizer.vocabulary().pieces[size_t(t)]);
    out["token_strs"] = std::move(strs);
  }
  return out;
}

json detokenize_response(const std::string& text, const ServedModel& model, const gpu::Tokenizer& tokenizer) {
  const json body = parse_body(text, model);
  const json* tokens = field(body, "tokens");
  if (!tokens) throw bad_request("tokens", "'tokens' is required", "missing");
  expect_type(tokens->is_array(), "tokens", "an array of token ids", *tokens);
  std::vector<int> ids;
  for (const json& t : *tokens) {
    if (!t.is_number_integer()) throw bad_request("tokens", "'tokens' must be an array of token ids", "invalid_type");
    ids.push_back(token_id(t, {}, model, "tokens"));
  }
  return {{"prompt", prompt_text(tokenizer, std::vector<int32_t>(ids.begin(), ids.end()))}};
}

std::string sse_event(const json& payload) { return "data: " + dump(payload) + "\n\n"; }

}  // namespace disagg::http
