#include "support/test_paths.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <vector>
#include <iterator>
#include <random>
#include <stdexcept>

namespace disagg::test {

std::string shared_dir() {
  if (const char* env = std::getenv("DISAGG_SHARED"); env && *env) return env;
  return DISAGG_SHARED_DIR;
}
std::string shared_model() { return shared_dir() + "/models/stories260K.bin"; }
std::string shared_tokenizer() { return shared_dir() + "/models/tok512.bin"; }
std::string shared_reference() { return shared_dir() + "/reference/stories260K-greedy.jsonl"; }
std::string shared_reference_more() { return shared_dir() + "/reference/stories260K-greedy-more.jsonl"; }
std::vector<std::string> shared_reference_files() { return {shared_reference(), shared_reference_more()}; }
std::string bin_dir() { return DISAGG_BIN_DIR; }

namespace {

// Every temp dir this process made, removed when it exits normally (a
// suite's models, written once and used by all its tests, and any a test
// left behind): a process killed midway leaves its dirs. Only the process
// that made them removes them (a forked child _exits).
struct TempDirs {
  std::mutex mutex;
  std::vector<std::string> dirs;
  pid_t owner = ::getpid();
  ~TempDirs() {
    if (::getpid() != owner) return;
    std::error_code ignored;
    for (const auto& d : dirs) std::filesystem::remove_all(d, ignored);
  }
};
TempDirs& temp_dirs() {
  static TempDirs dirs;
  return dirs;
}

}  // namespace

std::string make_temp_dir(const std::string& tag) {
  namespace fs = std::filesystem;
  std::random_device rd;
  TempDirs& made = temp_dirs();
  for (int attempt = 0; attempt < 100; ++attempt) {
    auto dir = fs::temp_directory_path() / ("disagg-" + tag + "-" + std::to_string(rd()));
    if (fs::create_directory(dir)) {
      std::lock_guard<std::mutex> lock(made.mutex);
      made.dirs.push_back(dir.string());
      return dir.string();
    }
  }
  throw std::runtime_error("cannot create a temp dir for " + tag);
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error(path + ": cannot write");
}

}  // namespace disagg::test
