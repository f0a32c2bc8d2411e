#include "gpu/hf_tokenizer.h"

#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "gpu/byte_bpe.h"
#include "gpu/error.h"

namespace disagg::gpu {
namespace {

using json = nlohmann::json;

// The Split regex of a pre_tokenizer (alone or in a Sequence), or "".
std::string split_pattern(const json& pre) {
  if (!pre.is_object()) return {};
  if (pre.value("type", "") == "Split" && pre.contains("pattern") && pre["pattern"].contains("Regex"))
    return pre["pattern"]["Regex"].get<std::string>();
  if (pre.value("type", "") == "Sequence")
    for (const json& p : pre.value("pretokenizers", json::array()))
      if (std::string s = split_pattern(p); !s.empty()) return s;
  return {};
}

bool has_byte_level(const json& pre) {
  if (!pre.is_object()) return false;
  if (pre.value("type", "") == "ByteLevel") return true;
  for (const json& p : pre.value("pretokenizers", json::array()))
    if (has_byte_level(p)) return true;
  return false;
}

}  // namespace

json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error(path + ": not JSON: " + e.what());
  }
}

Vocabulary read_hf_tokenizer(const std::string& path, const std::string& config_path, int vocab_size) {
  const json t = read_json_file(path);
  try {
    const json& model = t.at("model");
    if (model.value("type", "") != "BPE" || !has_byte_level(t.value("pre_tokenizer", json())))
      throw Error(path + ": model.type " + model.value("type", "?") +
                  ": only byte-level BPE tokenizers (a ByteLevel pre-tokenizer) are read");
    const std::string pattern = split_pattern(t.at("pre_tokenizer"));
    const PreTokenizer* pre = pre_tokenizer_with_pattern(pattern);
    if (!pre) throw Error(path + ": pre_tokenizer: the split regex " + json(pattern).dump() + " is not one this reader knows");

    std::map<int, std::pair<std::string, TokenType>> by_id;
    for (const auto& [piece, id] : model.at("vocab").items()) by_id[id.get<int>()] = {piece, TokenType::normal};
    for (const json& added : t.value("added_tokens", json::array()))
      by_id[added.at("id").get<int>()] = {added.at("content").get<std::string>(),
                                          added.value("special", false) ? TokenType::control : TokenType::user_defined};
    if (by_id.empty() || by_id.begin()->first < 0) throw Error(path + ": model.vocab holds a negative id or nothing");
    const int rows = vocab_size > 0 ? vocab_size : by_id.rbegin()->first + 1;
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
    for (const json& m : model.at("merges"))
      v.merges.push_back(m.is_string() ? m.get<std::string>() : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>());

    const json config = config_path.empty() ? json::object() : read_json_file(config_path);
    auto id_of = [&](const char* key) {
      const json& value = config.contains(key) ? config[key] : json();
      const std::string text = value.is_string() ? value.get<std::string>()
                               : value.is_object() ? value.value("content", "") : "";
      if (text.empty()) return -1;
      for (const auto& [id, piece] : by_id)
        if (piece.first == text) return id;
      throw Error(config_path + ": " + key + " \"" + text + "\" is not in the vocabulary");
    };
    v.bos = id_of("bos_token");
    v.eos = id_of("eos_token");
    v.add_bos = config.value("add_bos_token", v.bos >= 0) && v.bos >= 0;
    if (config.contains("chat_template") && config["chat_template"].is_string())
      v.chat_template = config["chat_template"].get<std::string>();
    return v;
  } catch (const json::exception& e) {
    throw Error(path + ": " + e.what());
  }
}

}  // namespace disagg::gpu
