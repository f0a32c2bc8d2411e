// The shared greedy reference cases (../shared/reference/stories260K-greedy.jsonl),
// read with a small JSON reader that also parses disagg-generate --json lines.
#pragma once
#include <string>
#include <vector>

namespace disagg::test {

struct ReferenceCase {
  std::string prompt;
  std::vector<int> prompt_tokens;
  int max_new_tokens = 0;
  std::vector<int> output_tokens;
  std::string text;
};

// One JSON object; fields that are absent keep their defaults, unknown fields
// are skipped. Throws std::runtime_error on malformed JSON.
ReferenceCase parse_reference_case(const std::string& json_line);

// Every non-empty line of a .jsonl file; throws std::runtime_error naming the
// file and line when it cannot be read or parsed.
std::vector<ReferenceCase> load_reference_cases(const std::string& path);

}  // namespace disagg::test
