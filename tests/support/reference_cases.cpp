#include "support/reference_cases.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "support/test_paths.h"

namespace disagg::test {

ReferenceCase parse_reference_case(const std::string& json_line) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_line);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(std::string("JSON: ") + e.what());
  }
  if (!j.is_object()) throw std::runtime_error("JSON: expected an object");
  ReferenceCase c;
  try {
    if (j.contains("prompt")) c.prompt = j["prompt"].get<std::string>();
    if (j.contains("text")) c.text = j["text"].get<std::string>();
    if (j.contains("prompt_tokens")) c.prompt_tokens = j["prompt_tokens"].get<std::vector<int>>();
    if (j.contains("output_tokens")) c.output_tokens = j["output_tokens"].get<std::vector<int>>();
    if (j.contains("max_new_tokens")) c.max_new_tokens = j["max_new_tokens"].get<int>();
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(std::string("JSON: ") + e.what());
  }
  return c;
}

std::vector<ReferenceCase> load_reference_cases(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot open");
  std::vector<ReferenceCase> cases;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      cases.push_back(parse_reference_case(line));
      cases.back().origin = path.substr(path.find_last_of('/') + 1) + ":" + std::to_string(number);
    } catch (const std::exception& e) {
      throw std::runtime_error(path + ":" + std::to_string(number) + ": " + e.what());
    }
  }
  return cases;
}

std::vector<ReferenceCase> load_all_reference_cases() {
  std::vector<ReferenceCase> all;
  for (const std::string& path : shared_reference_files()) {
    std::vector<ReferenceCase> cases = load_reference_cases(path);
    if (cases.empty()) throw std::runtime_error(path + ": no cases");
    all.insert(all.end(), std::make_move_iterator(cases.begin()), std::make_move_iterator(cases.end()));
  }
  return all;
}

std::string describe(const ReferenceCase& c) {
  // At most 48 bytes of the prompt, cut before a UTF-8 continuation byte.
  size_t shown = std::min<size_t>(c.prompt.size(), 48);
  while (shown < c.prompt.size() && shown > 0 && (uint8_t(c.prompt[shown]) & 0xC0) == 0x80) --shown;
  std::string prompt;
  for (const char ch : c.prompt.substr(0, shown)) {
    if (ch == '\n') prompt += "\\n";
    else if (ch == '\t') prompt += "\\t";
    else if (ch == '"' || ch == '\\') prompt += std::string("\\") + ch;
    else prompt += ch;
  }
  if (shown < c.prompt.size()) prompt += "...";
  return (c.origin.empty() ? std::string("case") : c.origin) + ", prompt \"" + prompt + "\" (" +
         std::to_string(c.prompt_tokens.size()) + " prompt tokens, " + std::to_string(c.max_new_tokens) + " new)";
}

}  // namespace disagg::test
