// A cluster's nodes on one host share one copy of the weights: the 2 prefill
// and 2 decode processes of a cluster started at once build one weight cache
// (engine/weight_cache.h), all map it (its pages shared among them, as
// /proc/PID/smaps counts them) and serve from it token for token.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "cluster/cluster_fixture.h"
#include "model/model_writer.h"
#include "support/test_paths.h"

namespace disagg::test {
namespace {

namespace fs = std::filesystem;

// Bytes of a process's mappings of `path` (all its areas), per smaps field.
std::map<std::string, int64_t> mapping_kib(pid_t pid, const std::string& path) {
  std::ifstream smaps("/proc/" + std::to_string(pid) + "/smaps");
  std::map<std::string, int64_t> kib;
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    std::istringstream words(line);
    std::string first;
    words >> first;
    if (first.find(':') == std::string::npos) {  // an area's first line: "begin-end perms offset dev inode path"
      inside = line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0;
    } else if (inside) {
      int64_t value = 0;
      if (words >> value) kib[first.substr(0, first.size() - 1)] += value;
    }
  }
  return kib;
}

int count_of(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

TEST(WeightCacheCluster, NodesOfOneHostBuildOneCacheShareItsPagesAndServeFromIt) {
  TestCluster cluster("cluster-weight-cache");
  const std::string model = cluster.dir() + "/q4.gguf";
  gpu::write_gguf(*gpu::random_weights(gpu::ModelConfig{512, 1024, 4, 8, 4, 512, 256, false}, 41),
                  gpu::byte_vocabulary(512), "cached", model, gpu::FileType::q4_0);
  const std::string folder = cluster.dir() + "/weights";
  cluster.set_model(model);
  cluster.set_tokenizer_file(false);
  cluster.set_disagg_options("weight-cache = \"" + folder + "\"");
  ASSERT_NO_FATAL_FAILURE(cluster.start_all(2, 2));

  // One of the four workers built it; the others waited and mapped it.
  std::vector<std::string> workers = cluster.names("prefill");
  for (const auto& name : cluster.names("decode")) workers.push_back(name);
  ASSERT_EQ(workers.size(), 4u);
  std::string logs;
  for (const auto& name : workers) logs += cluster.node(name).log();
  EXPECT_EQ(count_of(logs, ": built ("), 1) << cluster.logs();
  EXPECT_EQ(count_of(logs, ": mapped ("), 3) << cluster.logs();
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(folder)) files.push_back(e.path().filename().string());
  ASSERT_EQ(files.size(), 2u) << "the cache and its lock file, no temporary file";
  const std::string cache = folder + "/" + (files[0].size() < files[1].size() ? files[0] : files[1]);
  const int64_t cache_kib = int64_t(fs::file_size(cache) / 1024);
  ASSERT_GT(cache_kib, 2000) << "the packed matrices of the model";

  // Each worker maps all of it, and every page it holds is shared with the
  // others: none is a private copy.
  for (const auto& name : workers) {
    SCOPED_TRACE(name);
    const auto kib = mapping_kib(cluster.node(name).pid(), cache);
    EXPECT_GE(kib.count("Rss") ? kib.at("Rss") : 0, cache_kib * 9 / 10);
    const int64_t shared = (kib.count("Shared_Clean") ? kib.at("Shared_Clean") : 0) +
                           (kib.count("Shared_Dirty") ? kib.at("Shared_Dirty") : 0);
    EXPECT_GE(shared, cache_kib * 9 / 10);
    EXPECT_LE(kib.count("Pss") ? kib.at("Pss") : 0, cache_kib / 2) << "a page shared by 4 counts a quarter";
  }

  for (const std::vector<int32_t>& prompt : {std::vector<int32_t>{1, 300, 301, 302}, {1, 5, 6, 7, 8, 9, 10, 11}}) {
    const GenerateRequest request = token_request(prompt, 24);
    const RequestOutcome got = cluster.client().generate(request);
    ASSERT_TRUE(got.ok()) << to_string(got.code) << ": " << got.message;
    EXPECT_EQ(got.tokens, colocated_tokens(model, request));
  }
  EXPECT_TRUE(cluster.stop_all());
}

}  // namespace
}  // namespace disagg::test
