// The weight cache (engine/weight_cache.h): an engine reading its matrices
// from the cache computes the very bits of one that packed them itself; a
// stale, truncated or tampered file is rebuilt and never read; builders that
// start together write one file. (Processes sharing its pages, and a cluster
// serving from it: tests/cluster/test_weight_cache.cpp.)
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "engine/engine.h"
#include "engine/weight_cache.h"
#include "model/model_writer.h"
#include "support/run_command.h"
#include "support/test_paths.h"

namespace disagg::gpu {
namespace {

namespace fs = std::filesystem;

// Every line a cache or engine logs.
struct Lines {
  std::vector<std::string> lines;
  WeightCache::Log log() {
    return [this](const std::string& line) { lines.push_back(line); };
  }
  int count(const std::string& part) const {
    int n = 0;
    for (const auto& l : lines) n += l.find(part) != std::string::npos;
    return n;
  }
  std::string all() const {
    std::string s;
    for (const auto& l : lines) s += l + "\n";
    return s;
  }
};

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// ---------------------------------------------------------------- the file

class WeightCacheFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::make_temp_dir("weight-cache");
    key_ = WeightCacheKey{dir_ + "/model.gguf", 0x1234abcd5678ef00ull, "test-layout-1", 77, 3 * WeightCache::kChunkBytes / 2};
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The cache for `key`, filled with bytes drawn from the key's fingerprint.
  std::unique_ptr<WeightCache> open(const WeightCacheKey& key) {
    return WeightCache::open(dir_, key, [&](uint8_t* d) { ++fills_, fill(d, key); }, lines_.log());
  }
  static void fill(uint8_t* d, const WeightCacheKey& key) {
    for (size_t i = 0; i < key.data_bytes; ++i) d[i] = uint8_t((i * 131 + key.fingerprint) >> 3);
  }
  ::testing::AssertionResult holds_its_bytes(const WeightCache& cache, const WeightCacheKey& key) {
    std::vector<uint8_t> want(key.data_bytes);
    fill(want.data(), key);
    if (std::memcmp(cache.data(), want.data(), want.size()) != 0) return ::testing::AssertionFailure() << "other bytes";
    return ::testing::AssertionSuccess();
  }
  std::string path() const { return WeightCache::path_for(dir_, key_); }
  // Overwrites `bytes` at `offset` of the cache file.
  void overwrite(size_t offset, const std::string& bytes) {
    std::fstream f(path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(offset));
    f.write(bytes.data(), std::streamsize(bytes.size()));
  }
  // Flips every bit of the byte at `offset` of the cache file.
  void flip(size_t offset) {
    std::fstream f(path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(std::streamoff(offset));
    char c = 0;
    f.read(&c, 1);
    f.seekp(std::streamoff(offset));
    c = char(~c);
    f.write(&c, 1);
  }
  // A broken file must be refused, rebuilt with a log line that says why,
  // and the rebuilt one read.
  void expect_rebuilt_because(const std::string& why) {
    EXPECT_NE(WeightCache::problem(path(), key_).find(why), std::string::npos) << WeightCache::problem(path(), key_);
    fills_ = 0;
    lines_.lines.clear();
    auto cache = open(key_);
    ASSERT_TRUE(cache);
    EXPECT_TRUE(cache->built());
    EXPECT_EQ(fills_, 1);
    EXPECT_EQ(lines_.count(why), 1) << lines_.all();
    EXPECT_EQ(lines_.count("rebuilding"), 1) << lines_.all();
    EXPECT_TRUE(holds_its_bytes(*cache, key_));
    EXPECT_EQ(WeightCache::problem(path(), key_), "");
  }

  std::string dir_;
  WeightCacheKey key_;
  Lines lines_;
  int fills_ = 0;
};

TEST_F(WeightCacheFile, IsBuiltOnceThenMappedAsItIs) {
  auto first = open(key_);
  ASSERT_TRUE(first);
  EXPECT_TRUE(first->built());
  EXPECT_TRUE(holds_its_bytes(*first, key_));
  EXPECT_EQ(first->path(), dir_ + "/model.gguf.1234abcd5678ef00.test-layout-1.wcache");
  EXPECT_EQ(fs::file_size(first->path()), WeightCache::kHeaderBytes + key_.data_bytes);
  auto second = open(key_);
  ASSERT_TRUE(second);
  EXPECT_FALSE(second->built());
  EXPECT_EQ(fills_, 1);
  EXPECT_TRUE(holds_its_bytes(*second, key_));
  EXPECT_EQ(lines_.count("built"), 1) << lines_.all();
  EXPECT_EQ(lines_.count("mapped"), 1) << lines_.all();
  // Only the cache and its lock file remain: no temporary file.
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{fs::path(path()).filename().string(),
                                                      fs::path(path()).filename().string() + ".lock"}));
}

TEST_F(WeightCacheFile, TamperedDataIsRebuilt) {
  open(key_);
  flip(WeightCache::kHeaderBytes + key_.data_bytes - 5);  // in the last chunk
  expect_rebuilt_because("tampered");
  flip(WeightCache::kHeaderBytes + 7);  // in the first
  expect_rebuilt_because("tampered");
}

TEST_F(WeightCacheFile, TruncatedOrOverlongFilesAreRebuilt) {
  open(key_);
  fs::resize_file(path(), fs::file_size(path()) - 4096);
  expect_rebuilt_because("truncated");
  fs::resize_file(path(), 100);  // not even a header
  expect_rebuilt_because("truncated");
  fs::resize_file(path(), fs::file_size(path()) + 1);
  expect_rebuilt_because("overlong");
}

TEST_F(WeightCacheFile, ATamperedHeaderIsRebuilt) {
  open(key_);
  flip(40);  // the data checksum's first byte: the header's own checksum catches it
  expect_rebuilt_because("the header's checksum");
  overwrite(0, "XXXX");
  expect_rebuilt_because("bad magic");
}

TEST_F(WeightCacheFile, StaleFilesAreRebuilt) {
  // Another model's cache under this one's name.
  WeightCacheKey other = key_;
  other.fingerprint = 99;
  open(other);
  fs::rename(WeightCache::path_for(dir_, other), path());
  expect_rebuilt_because("stale: made from a model with fingerprint 0000000000000063");
  // Another layout's, and another placement's.
  other = key_;
  other.layout = "test-layout-0";
  open(other);
  fs::rename(WeightCache::path_for(dir_, other), path());
  expect_rebuilt_because("stale: layout test-layout-0");
  other = key_;
  other.plan_digest = 78;
  fs::remove(path());
  open(other);
  key_.plan_digest = 78;  // (same name: the plan is not in it)
  ASSERT_EQ(WeightCache::problem(path(), key_), "");
  key_.plan_digest = 77;
  expect_rebuilt_because("placed otherwise");
}

TEST_F(WeightCacheFile, LeftoversOfADeadBuilderAreRemoved) {
  const std::string leftover = path() + ".tmp.999999";
  std::ofstream(leftover) << "half a cache";
  auto cache = open(key_);
  ASSERT_TRUE(cache);
  EXPECT_FALSE(fs::exists(leftover));
}

// A dead builder's temporary file of another cache of this model (an earlier
// version's fingerprint, an earlier layout: never built again, so never
// cleaned under its own lock) goes once nobody has written it for a build's
// longest wait; a fresh one (a builder at work) and other models' stay,
// a model's whose name begins with this one's too.
TEST_F(WeightCacheFile, AnotherVersionsAbandonedTemporaryFileIsRemoved) {
  const std::string old_version = dir_ + "/model.gguf.00000000000000aa.test-layout-1.wcache.tmp.999999";
  const std::string old_layout = dir_ + "/model.gguf.1234abcd5678ef00.test-layout-0.wcache.tmp.999998";
  const std::string building = dir_ + "/model.gguf.00000000000000bb.test-layout-1.wcache.tmp.999997";
  const std::string other_model = dir_ + "/other.gguf.00000000000000aa.test-layout-1.wcache.tmp.999996";
  const std::string longer_name = dir_ + "/model.gguf.old.00000000000000aa.test-layout-1.wcache.tmp.999995";
  for (const std::string& f : {old_version, old_layout, building, other_model, longer_name})
    std::ofstream(f) << "half a cache";
  const auto hour_ago = fs::file_time_type::clock::now() - std::chrono::hours(1);
  for (const std::string& f : {old_version, old_layout, other_model, longer_name}) fs::last_write_time(f, hour_ago);
  ASSERT_TRUE(open(key_));
  EXPECT_FALSE(fs::exists(old_version));
  EXPECT_FALSE(fs::exists(old_layout));
  EXPECT_TRUE(fs::exists(building)) << "written within the wait: a builder may be at work";
  EXPECT_TRUE(fs::exists(other_model));
  EXPECT_TRUE(fs::exists(longer_name)) << "model.gguf.old's";
}

TEST_F(WeightCacheFile, AFolderIsMadeWithItsParents) {
  auto cache = WeightCache::open(dir_ + "/a/b/c", key_, [&](uint8_t* d) { ++fills_, fill(d, key_); }, lines_.log());
  ASSERT_TRUE(cache) << lines_.all();
  EXPECT_TRUE(holds_its_bytes(*cache, key_));
  EXPECT_EQ(cache->path().rfind(dir_ + "/a/b/c/", 0), 0u) << cache->path();
}

TEST_F(WeightCacheFile, AFolderThatCannotBeMadeKeepsTheWeightsInMemory) {
  std::ofstream(dir_ + "/file") << "x";
  auto cache = WeightCache::open(dir_ + "/file/cache", key_, [&](uint8_t*) { ++fills_; }, lines_.log());
  EXPECT_FALSE(cache);
  EXPECT_EQ(fills_, 0);
  EXPECT_EQ(lines_.count("weights kept in memory"), 1) << lines_.all();
}

TEST_F(WeightCacheFile, AFillThatThrowsLeavesNoFile) {
  EXPECT_THROW(WeightCache::open(dir_, key_, [](uint8_t*) { throw Error("no"); }, lines_.log()), Error);
  EXPECT_EQ(files_in(dir_), (std::vector<std::string>{fs::path(path()).filename().string() + ".lock"}));
}

// Builders that start at once (each its own descriptor of the lock file, as
// processes have) build once; the others wait and map that file.
TEST_F(WeightCacheFile, BuildersThatStartTogetherBuildOnce) {
  std::atomic<int> fills{0};
  std::atomic<int> go{0};
  std::vector<std::unique_ptr<WeightCache>> caches(4);
  std::vector<std::thread> threads;
  std::vector<Lines> lines(caches.size());
  for (size_t i = 0; i < caches.size(); ++i)
    threads.emplace_back([&, i] {
      ++go;
      while (go.load() < int(caches.size())) std::this_thread::yield();
      caches[i] = WeightCache::open(dir_, key_, [&](uint8_t* d) { ++fills, fill(d, key_); }, lines[i].log());
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(fills.load(), 1);
  int built = 0;
  for (size_t i = 0; i < caches.size(); ++i) {
    ASSERT_TRUE(caches[i]) << lines[i].all();
    built += caches[i]->built();
    EXPECT_TRUE(holds_its_bytes(*caches[i], key_));
  }
  EXPECT_EQ(built, 1);
  EXPECT_EQ(files_in(dir_).size(), 2u);
}

// ---------------------------------------------------------------- engines

// A model whose rows are whole superblocks, in each file type with its own
// packing: f32 and f16 panels, Q8_0 and Q4_0 tiles, Q4_K and Q6_K tiles
// (q4_k_m mixes them).
class WeightCacheEngine : public ::testing::TestWithParam<FileType> {
 protected:
  static void SetUpTestSuite() { dir_ = test::make_temp_dir("weight-cache-engine"); }
  static void TearDownTestSuite() { fs::remove_all(dir_); }
  static std::string model(FileType type) {
    const std::string path = dir_ + "/" + to_string(type) + ".gguf";
    if (!fs::exists(path))
      write_gguf(*random_weights(ModelConfig{256, 512, 3, 4, 2, 512, 64, true}, 23), byte_vocabulary(512), "c", path,
                 type);
    return path;
  }
  static std::string dir_;
};
std::string WeightCacheEngine::dir_;

TEST_P(WeightCacheEngine, ReadsTheBitsItsOwnPackingComputes) {
  const auto checkpoint = Checkpoint::open(model(GetParam()));
  const std::vector<int> prompt = {1, 300, 301, 40, 41, 42, 7, 9, 11};
  Engine plain(checkpoint);
  const std::vector<float> want = plain.prefill(prompt).logits;
  Lines lines;
  EngineOptions options;
  options.weight_cache = dir_ + "/cache";
  options.log = lines.log();
  for (const char* step : {"built", "mapped"}) {
    SCOPED_TRACE(step);
    lines.lines.clear();
    Engine cached(checkpoint, options);
    EXPECT_EQ(lines.count(step), 1) << lines.all();
    const std::vector<float> got = cached.prefill(prompt).logits;
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
    EXPECT_EQ(cached.fingerprint(), plain.fingerprint());  // the model file's, whatever holds the weights
  }
}

// The engine computes with the file's pages themselves (no copy of its own):
// bytes written to the file change what it computes.
TEST(WeightCacheEngineMapping, ComputesFromTheFilesPages) {
  const std::string dir = test::make_temp_dir("weight-cache-pages");
  const std::string path = dir + "/q8.gguf";
  write_gguf(*random_weights(ModelConfig{256, 512, 2, 4, 2, 512, 64, true}, 3), byte_vocabulary(512), "p", path,
             FileType::q8_0);
  const auto checkpoint = Checkpoint::open(path);
  EngineOptions options;
  options.weight_cache = "model";
  options.log = [](const std::string&) {};
  Engine cached(checkpoint, options);
  const std::vector<int> prompt = {1, 2, 3, 4};
  const std::vector<float> before = cached.prefill(prompt).logits;
  std::string cache;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".wcache") cache = e.path().string();
  ASSERT_FALSE(cache.empty());
  {
    std::fstream f(cache, std::ios::in | std::ios::out | std::ios::binary);
    const std::string junk(fs::file_size(cache) - WeightCache::kHeaderBytes, '\x11');
    f.seekp(std::streamoff(WeightCache::kHeaderBytes));
    f.write(junk.data(), std::streamsize(junk.size()));
  }
  const std::vector<float> after = cached.prefill(prompt).logits;
  EXPECT_NE(std::memcmp(before.data(), after.data(), before.size() * sizeof(float)), 0);
  fs::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Types, WeightCacheEngine,
                         ::testing::Values(FileType::f32, FileType::f16, FileType::q8_0, FileType::q4_0,
                                           FileType::q4_k_m),
                         [](const auto& info) { return std::string(to_string(info.param)); });

// "model": beside the model file; a second process maps what the first built.
TEST(WeightCacheProcesses, DisaggGenerateBuildsBesideTheModelThenMaps) {
  const std::string dir = test::make_temp_dir("weight-cache-generate");
  const std::string path = dir + "/q4.gguf";
  write_gguf(*random_weights(ModelConfig{256, 512, 2, 4, 2, 512, 64, true}, 5), byte_vocabulary(512), "g", path,
             FileType::q4_0);
  const std::string command = std::string(DISAGG_BIN_DIR) + "/disagg-generate --model " + test::shell_quoted(path) +
                              " --prompt-tokens '1 300 301' --max-new-tokens 12 --json";
  const auto [plain, plain_status] = test::run_command(command + " 2>/dev/null");
  ASSERT_EQ(plain_status, 0);
  for (const char* step : {"built", "mapped"}) {
    const auto [out, status] = test::run_command(command + " --weight-cache model 2>&1");
    ASSERT_EQ(status, 0) << out;
    EXPECT_NE(out.find(std::string(": ") + step + " ("), std::string::npos) << out;
    EXPECT_NE(out.find(plain), std::string::npos) << out;  // the same tokens
  }
  EXPECT_EQ(files_in(dir).size(), 3u);  // the model, its cache, the lock
  fs::remove_all(dir);
}

}  // namespace
}  // namespace disagg::gpu
