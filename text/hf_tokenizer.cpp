#include "text/hf_tokenizer.h"

#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "text/byte_bpe.h"
#include "gpu/error.h"
#include "gpu/file_check.h"
#include "gpu/json_fields.h"

namespace disagg::gpu {
namespace {

using json = nlohmann::json;

// The first step of `type` of a pre_tokenizer (alone or in a Sequence), or nullptr.
const json* step_of(const json& pre, const std::string& type) {
  if (!pre.is_object()) return nullptr;
  if (const auto t = pre.find("type"); t != pre.end() && *t == type) return &pre;
  if (const auto steps = pre.find("pretokenizers"); steps != pre.end() && steps->is_array())
    for (const json& p : *steps)
      if (const json* found = step_of(p, type)) return found;
  return nullptr;
}

const json* byte_level(const json& pre) { return step_of(pre, "ByteLevel"); }

// The regex of a pre_tokenizer's Split step, or "".
std::string split_pattern(const json& pre) {
  const json* split = step_of(pre, "Split");
  if (!split || !split->contains("pattern") || !(*split)["pattern"].contains("Regex")) return {};
  return (*split)["pattern"]["Regex"].get<std::string>();
}
bool has_byte_level(const json& pre) { return byte_level(pre) != nullptr; }

// Whether `key` of `object` is absent, null or `plain` (its default).
bool unset_or(const json& object, const char* key, const json& plain) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() || *it == plain;
}

// The settings this reader takes from the split regex's family (its
// PreTokenizer: ignore_merges, NFC) or does not implement, read from the
// file and checked: a file that says otherwise is refused, never encoded
// differently from the reference tokenizer.
void check_settings(const std::string& path, const json& top, const json& model, const json& pre_tokenizer,
                    const PreTokenizer& pre) {
  auto refuse = [&](const std::string& what) {
    throw Error(path + ": " + what + " (this reader encodes byte-level BPE with the " + pre.name +
                " family's settings only)");
  };
  const auto ignore = model.find("ignore_merges");
  const bool ignore_merges = ignore != model.end() && ignore->is_boolean() && ignore->get<bool>();
  if (!unset_or(model, "ignore_merges", ignore_merges) || ignore_merges != pre.ignore_merges)
    refuse("model.ignore_merges is " + (ignore == model.end() ? std::string("unset") : ignore->dump()) +
           ", the split regex's family has " + (pre.ignore_merges ? "true" : "false"));
  const auto normalizer = top.find("normalizer");
  const bool none = normalizer == top.end() || normalizer->is_null();
  const bool nfc = !none && *normalizer == json{{"type", "NFC"}};
  if ((!none && !nfc) || nfc != pre.nfc)
    refuse("normalizer " + (none ? std::string("null") : normalizer->dump()) + ", the split regex's family has " +
           (pre.nfc ? "{\"type\": \"NFC\"}" : "none"));
  if (!unset_or(model, "dropout", 0.0)) refuse("model.dropout is " + model["dropout"].dump());
  if (!unset_or(model, "byte_fallback", false)) refuse("model.byte_fallback is set");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (!unset_or(model, key, "")) refuse(std::string("model.") + key + " is " + model[key].dump());
  // (ByteLevel's add_prefix_space and use_regex default to true: a prefix
  // space, and GPT-2's split again after the family's)
  if (const json* step = byte_level(pre_tokenizer)) {
    for (const char* key : {"add_prefix_space", "use_regex"}) {
      const auto value = step->find(key);
      if (value == step->end() || !value->is_boolean() || value->get<bool>())
        refuse(std::string("the ByteLevel pre-tokenizer's ") + key + " is not false");
    }
  }
  if (const json* split = step_of(pre_tokenizer, "Split")) {
    if (!unset_or(*split, "invert", false) || split->value("behavior", json()) != "Isolated")
      refuse("the Split pre-tokenizer is not an isolating one (behavior \"Isolated\", not inverted)");
  }
  if (const auto added = top.find("added_tokens"); added != top.end() && added->is_array())
    for (size_t k = 0; k < added->size(); ++k)
      for (const char* key : {"lstrip", "rstrip", "single_word"})
        if (!unset_or((*added)[k], key, false))
          refuse("added_tokens[" + std::to_string(k) + "]." + key + " is set");
}

// tokenizer_config.json's chat_template into `v`: one template, or
// transformers' list of named ones ({"name", "template"}), of which
// apply_chat_template renders the one named "tool_use" for a request with
// tools, where there is one, else the one named "default" (others only by
// name: not read here). A list without a default is refused (transformers
// refuses a request without tools then).
void read_chat_templates(const JsonFields& config, Vocabulary& v) {
  const json* value = config.find("chat_template");
  if (!value || value->is_null()) return;
  if (value->is_string()) {
    v.chat_template = value->get<std::string>();
    return;
  }
  const char* expected = "a string or a list of {\"name\", \"template\"} objects";
  if (!value->is_array()) config.wrong("chat_template", expected);
  for (size_t k = 0; k < value->size(); ++k) {
    const json& named = (*value)[k];
    if (!named.is_object()) config.wrong("chat_template", expected);
    const JsonFields entry(named, config.file(), "chat_template[" + std::to_string(k) + "].");
    const std::string name = entry.string("name");
    if (name == "default") v.chat_template = entry.string("template");
    else if (name == "tool_use") v.tool_use_template = entry.string("template");
  }
  if (v.chat_template.empty())
    throw Error(config.file() + ": chat_template: a list of named templates without one named \"default\"");
}

}  // namespace

json read_json_file(const std::string& path) {
  const std::string text = read_regular_file(path);  // a FIFO or device refused before anything blocks
  try {
    return parse_file_json(text.data(), text.data() + text.size());
  } catch (const JsonNestedTooDeep&) {
    throw Error(path + ": nested deeper than " + std::to_string(kMaxFileJsonDepth) + " levels");
  } catch (const json::exception& e) {
    throw Error(path + ": not JSON: " + e.what());
  }
}

Vocabulary read_hf_tokenizer(const std::string& path, const std::string& config_path, int vocab_size,
                             const std::string& template_path) {
  const json t = read_json_file(path);
  try {
    // Every value type- and range-checked before it is converted (gpu/json_fields.h).
    const JsonFields top(t, path);
    const JsonFields model = top.object("model");
    const json pre_tokenizer = top.has("pre_tokenizer") ? *top.find("pre_tokenizer") : json();
    if (model.string("type", "") != "BPE" || !has_byte_level(pre_tokenizer))
      throw Error(path + ": model.type " + model.string("type", "?") +
                  ": only byte-level BPE tokenizers (a ByteLevel pre-tokenizer) are read");
    const std::string pattern = split_pattern(pre_tokenizer);
    const PreTokenizer* pre = pre_tokenizer_with_pattern(pattern);
    if (!pre) throw Error(path + ": pre_tokenizer: the split regex " + json(pattern).dump() + " is not one this reader knows");
    check_settings(path, t, model.value(), pre_tokenizer, *pre);

    const int64_t max_id = std::numeric_limits<int32_t>::max() - 1;
    std::map<int, std::pair<std::string, TokenType>> by_id;
    const JsonFields vocab = model.object("vocab");
    for (const auto& [piece, id] : vocab.value().items()) by_id[int(vocab.integer(piece, 0, max_id))] = {piece, TokenType::normal};
    if (top.has("added_tokens")) {
      const json& added_tokens = top.array("added_tokens");
      for (size_t k = 0; k < added_tokens.size(); ++k) {
        const JsonFields added(added_tokens[k], path, "added_tokens[" + std::to_string(k) + "].");
        by_id[int(added.integer("id", 0, max_id))] = {
            added.string("content"), added.boolean("special", false) ? TokenType::control : TokenType::user_defined};
      }
    }
    if (by_id.empty()) throw Error(path + ": model.vocab holds nothing");
    const int rows = vocab_size > 0 ? vocab_size : by_id.rbegin()->first + 1;
    if (rows > kMaxVocabSize)  // (checked before the padding is made)
      throw Error(path + ": a vocabulary of " + std::to_string(rows) + " tokens, more than a vocabulary may have (" +
                  std::to_string(kMaxVocabSize) + ")");
    if (by_id.rbegin()->first >= rows)
      throw Error(path + ": token id " + std::to_string(by_id.rbegin()->first) + " does not fit a vocabulary of " +
                  std::to_string(rows));

    Vocabulary v;
    v.model = TokenizerModel::byte_bpe;
    v.pre = pre->name;
    v.pieces.resize(size_t(rows));
    v.types.assign(size_t(rows), TokenType::unused);
    for (int i = 0; i < rows; ++i) v.pieces[size_t(i)] = "[PAD" + std::to_string(i) + "]";
    for (const auto& [id, piece] : by_id) {
      v.pieces[size_t(id)] = piece.first;
      v.types[size_t(id)] = piece.second;
    }
    const json& merges = model.array("merges");
    for (size_t k = 0; k < merges.size(); ++k) {
      const json& m = merges[k];
      if (m.is_string()) v.merges.push_back(m.get<std::string>());
      else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string())
        v.merges.push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
      else wrong_json_value(path, "model.merges[" + std::to_string(k) + "]", m, "a string \"a b\" or a pair of strings");
    }

    const json config_json = config_path.empty() ? json::object() : read_json_file(config_path);
    const JsonFields config(config_json, config_path);
    auto id_of = [&](const char* key) {
      const json* value = config.find(key);
      std::string text;
      if (value && value->is_string()) text = value->get<std::string>();
      else if (value && value->is_object()) text = JsonFields(*value, config_path, std::string(key) + ".").string("content", "");
      else if (value) config.wrong(key, "a string or an object with a content string");
      if (text.empty()) return -1;
      for (const auto& [id, piece] : by_id)
        if (piece.first == text) return id;
      throw Error(config_path + ": " + key + " \"" + text + "\" is not in the vocabulary");
    };
    v.bos = id_of("bos_token");
    v.eos = id_of("eos_token");
    v.add_bos = config.boolean("add_bos_token", v.bos >= 0) && v.bos >= 0;
    read_chat_templates(config, v);
    // transformers writes the template beside the config (chat_template.jinja)
    // and, loading, prefers it to the config's.
    if (!template_path.empty()) v.chat_template = read_regular_file(template_path);
    return v;
  } catch (const json::exception& e) {
    // A shape the readers above do not check (inside pre_tokenizer, say).
    throw Error(path + ": unexpected JSON: " + e.what());
  }
}

}  // namespace disagg::gpu
