// The weight cache: a model's matrices in a backend's layout (the CPU's
// tiles, gpu/cpu/cpu_kernels.h), written once to a file and mapped read-only
// by every process that serves the model, so N processes on one host hold one
// copy (the page cache's) and a restart does not re-lay the model file.
//
// The file, `<model file name>.<fingerprint, 16 hex>.<layout>.wcache`:
//
//   offset  bytes  field
//   0       8      magic "DGWCACHE"
//   8       4      header format (kHeaderFormat)
//   12      4      header bytes (kHeaderBytes; the data starts there, page aligned)
//   16      8      the model file's fingerprint (Checkpoint::fingerprint)
//   24      8      the plan's digest: XXH3-64 of every matrix's (type, n, k, offset, bytes)
//   32      8      data bytes (the file is exactly header + data bytes)
//   40      8      data checksum: XXH3-64 of the XXH3-64s of its kChunkBytes chunks
//   48      64     the layout's name and version (Backend::weight_layout), NUL padded
//   112     8      XXH3-64 of bytes [0, 112)
//
// Never trusted blindly: every field is checked at load and the data's
// checksum recomputed (its pages are read once, as the model file's are for
// the fingerprint). A stale (another fingerprint, layout or plan), truncated
// or tampered file is rebuilt, with a log line saying why. Builders serialize
// on `<name>.lock` (flock; released by the kernel if the holder dies) and
// write `<name>.tmp.<pid>`, renamed over the name once complete, so readers
// only ever see a whole file, and processes that start together build once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace disagg::gpu {

struct WeightCacheKey {
  std::string model_path;  // names the file, and (folder "model") where it goes
  uint64_t fingerprint = 0;
  std::string layout;      // Backend::weight_layout(): at most 63 characters
  uint64_t plan_digest = 0;
  size_t data_bytes = 0;
};

class WeightCache {
 public:
  static constexpr uint32_t kHeaderFormat = 1;
  static constexpr size_t kHeaderBytes = 4096;
  static constexpr size_t kChunkBytes = size_t(16) << 20;

  using Log = std::function<void(const std::string&)>;
  using Fill = std::function<void(uint8_t* data)>;

  // The file for `key` in `folder` ("model": the model file's folder, or a
  // Hugging Face model's directory itself), mapped read-only. Built first by
  // fill(data) (data_bytes, zeroed) when missing or not valid. nullptr, with a
  // log line, where no cache can be had (the folder cannot be written, the
  // disk is full, another builder held the lock past kBuildWait): the caller
  // then lays the weights out in memory of its own.
  static std::unique_ptr<WeightCache> open(const std::string& folder, const WeightCacheKey& key, const Fill& fill,
                                           const Log& log);

  // Why the file at `path` is not a valid cache for `key` ("" when it is).
  // Reads the whole file (the checksum).
  static std::string problem(const std::string& path, const WeightCacheKey& key);

  // `<folder>/<model file name>.<fingerprint>.<layout>.wcache`.
  static std::string path_for(const std::string& folder, const WeightCacheKey& key);

  ~WeightCache();
  WeightCache(const WeightCache&) = delete;
  WeightCache& operator=(const WeightCache&) = delete;

  const uint8_t* data() const { return static_cast<const uint8_t*>(mapping_) + kHeaderBytes; }
  const std::string& path() const { return path_; }
  // Whether this open() wrote the file (false: it mapped one already there).
  bool built() const { return built_; }

 private:
  WeightCache() = default;
  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  bool built_ = false;
};

}  // namespace disagg::gpu
