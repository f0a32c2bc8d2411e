// Where tests find the shared model, reference outputs and built binaries.
#pragma once
#include <string>
#include <vector>

namespace disagg::test {

// ../shared (or $DISAGG_SHARED when set).
std::string shared_dir();
std::string shared_model();      // shared_dir()/models/stories260K.bin
std::string shared_tokenizer();  // shared_dir()/models/tok512.bin
std::string shared_reference();       // shared_dir()/reference/stories260K-greedy.jsonl (3 cases)
std::string shared_reference_more();  // shared_dir()/reference/stories260K-greedy-more.jsonl (20 cases)
// Every greedy reference file: shared_reference(), then shared_reference_more().
std::vector<std::string> shared_reference_files();
std::string bin_dir();           // build/bin
// A fresh empty directory under the system temp dir, unique per call;
// removed with all it holds when the process exits.
std::string make_temp_dir(const std::string& tag);
// A whole file's bytes ("" when it cannot be read), and writing one (throws).
std::string read_text_file(const std::string& path);
void write_text_file(const std::string& path, const std::string& text);

}  // namespace disagg::test
