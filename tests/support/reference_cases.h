// The shared greedy reference cases (../shared/reference/stories260K-greedy.jsonl
// and stories260K-greedy-more.jsonl, see their README.md), read with
// nlohmann-json; the same reader parses disagg-generate --json lines. Tests take the
// cases from load_all_reference_cases() and assume nothing about their number
// or sizes (the longest has a 478-token prompt; one prompt is empty, i.e. BOS).
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
  // Where the case comes from: "file.jsonl:line" (set by load_reference_cases).
  std::string origin;
};

// One JSON object; fields that are absent keep their defaults, unknown fields
// are skipped. Throws std::runtime_error on malformed JSON or a field of the
// wrong type.
ReferenceCase parse_reference_case(const std::string& json_line);

// Every non-empty line of a .jsonl file; throws std::runtime_error naming the
// file and line when it cannot be read or parsed.
std::vector<ReferenceCase> load_reference_cases(const std::string& path);

// The cases of every shared reference file (test_paths.h: shared_reference_files()),
// in file order; throws std::runtime_error when a file is missing, malformed or empty.
std::vector<ReferenceCase> load_all_reference_cases();

// "file.jsonl:line, prompt \"...\" (N prompt tokens, M new)", the prompt cut
// to 48 bytes with newlines, tabs and quotes escaped, for test messages.
std::string describe(const ReferenceCase& c);

}  // namespace disagg::test
