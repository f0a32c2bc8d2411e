#include "engine/weight_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>  // Debian's libxxhash picks AVX2/AVX-512 at run time
#endif

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include "gpu/error.h"
#include "gpu/file_check.h"
#include "gpu/host_memory.h"
#include "model/checkpoint.h"

namespace disagg::gpu {

namespace {

constexpr char kMagic[8] = {'D', 'G', 'W', 'C', 'A', 'C', 'H', 'E'};
constexpr size_t kLayoutField = 64;
constexpr size_t kCheckedHeader = 112;  // the bytes the header's own checksum covers

// How long a process waits for another one's build of the same cache before
// it lays its weights out on its own: a build writes the file once at memory
// speed (an 8B-shaped Q4_0 model: seconds); a holder this late is stuck.
constexpr auto kBuildWait = std::chrono::minutes(10);
// How often a waiting process tries the lock again.
constexpr auto kLockPoll = std::chrono::milliseconds(20);

struct Header {
  char magic[8];
  uint32_t format;
  uint32_t header_bytes;
  uint64_t fingerprint;
  uint64_t plan_digest;
  uint64_t data_bytes;
  uint64_t checksum;
  char layout[kLayoutField];
  uint64_t header_checksum;
};
static_assert(offsetof(Header, layout) == 48 && offsetof(Header, header_checksum) == kCheckedHeader,
              "the header's layout is the one weight_cache.h draws");


// The data's checksum: each kChunkBytes chunk hashed on its own (in parallel:
// a load reads the file at memory speed), then the chunks' hashes in order.
uint64_t data_checksum(const uint8_t* data, size_t bytes) {
  const size_t chunks = (bytes + WeightCache::kChunkBytes - 1) / WeightCache::kChunkBytes;
  std::vector<uint64_t> digests(chunks);
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t c = 0; c < chunks; ++c) {
    const size_t begin = c * WeightCache::kChunkBytes;
    digests[c] = XXH3_64bits(data + begin, std::min(WeightCache::kChunkBytes, bytes - begin));
  }
  return XXH3_64bits(digests.data(), digests.size() * sizeof(uint64_t));
}

Header header_for(const WeightCacheKey& key, uint64_t checksum) {
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.format = WeightCache::kHeaderFormat;
  h.header_bytes = uint32_t(WeightCache::kHeaderBytes);
  h.fingerprint = key.fingerprint;
  h.plan_digest = key.plan_digest;
  h.data_bytes = key.data_bytes;
  h.checksum = checksum;
  std::memcpy(h.layout, key.layout.data(), std::min(key.layout.size(), kLayoutField - 1));
  h.header_checksum = XXH3_64bits(&h, kCheckedHeader);
  return h;
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Why the open file `fd` is not a valid cache for `key` ("" when it is); on
// success its read-only mapping (header included) in *mapping.
std::string validate(int fd, const WeightCacheKey& key, void** mapping) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "cannot stat: " + errno_text();
  if (!S_ISREG(st.st_mode)) return "not a regular file (" + file_type_name(st.st_mode) + ")";
  const size_t expected = WeightCache::kHeaderBytes + key.data_bytes;
  if (size_t(st.st_size) < sizeof(Header)) return "truncated: " + std::to_string(st.st_size) + " bytes, no header";
  Header h{};
  if (::pread(fd, &h, sizeof h, 0) != ssize_t(sizeof h)) return "cannot read the header: " + errno_text();
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) return "not a weight cache (bad magic)";
  if (XXH3_64bits(&h, kCheckedHeader) != h.header_checksum) return "the header's checksum does not match";
  if (h.format != WeightCache::kHeaderFormat || h.header_bytes != WeightCache::kHeaderBytes)
    return "header format " + std::to_string(h.format) + ", this build reads " +
           std::to_string(WeightCache::kHeaderFormat);
  if (h.fingerprint != key.fingerprint)
    return "stale: made from a model with fingerprint " + hex(h.fingerprint) + ", this one's is " +
           hex(key.fingerprint);
  if (std::string(h.layout, strnlen(h.layout, kLayoutField)) != key.layout)
    return "stale: layout " + std::string(h.layout, strnlen(h.layout, kLayoutField)) + ", this backend's is " +
           key.layout;
  if (h.plan_digest != key.plan_digest || h.data_bytes != key.data_bytes)
    return "stale: its matrices are placed otherwise than this build places them";
  if (size_t(st.st_size) != expected)
    return (size_t(st.st_size) < expected ? "truncated: " : "overlong: ") + std::to_string(st.st_size) +
           " bytes, expected " + std::to_string(expected);
  void* m = ::mmap(nullptr, expected, PROT_READ, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return "cannot map: " + errno_text();
  advise_huge_pages(m, expected);
  if (data_checksum(static_cast<const uint8_t*>(m) + WeightCache::kHeaderBytes, key.data_bytes) != h.checksum) {
    ::munmap(m, expected);
    return "tampered: the data's checksum does not match the header's";
  }
  *mapping = m;
  return "";
}

// An exclusive flock on `path` (created if need be), waited for at most
// kBuildWait; -1 (with *why) when it cannot be had.
int lock_file(const std::string& path, std::string* why) {
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    *why = "cannot create " + path + ": " + errno_text();
    return -1;
  }
  const auto deadline = std::chrono::steady_clock::now() + kBuildWait;
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) {
      *why = "cannot lock " + path + ": " + errno_text();
      ::close(fd);
      return -1;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      *why = "another process has been building it for over " +
             std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kBuildWait).count()) + " s";
      ::close(fd);
      return -1;
    }
    std::this_thread::sleep_for(kLockPoll);  // a poll with a deadline: flock itself has none
  }
  return fd;
}

// Temporary files (`<name>.tmp.<pid>`, each the size of a whole cache) a
// builder that died left behind: this cache's (called under its lock, when
// no builder can be writing one), and those of the same model file's other
// caches (an earlier version's fingerprint, an earlier layout: nobody would
// build those again) that nobody has written for longer than a build may take
// (kBuildWait: then a builder is given up on; one of them may be building
// under its own lock). Another model's whose name begins with this one's
// (`m.gguf.old` beside `m.gguf`) are not this model's: after the model's
// name come the fingerprint's 16 hex digits (path_for).
bool of_model(const std::string& file, const std::string& model_name) {
  const size_t at = model_name.size() + 1;  // (after "<model>.")
  if (file.size() <= at + 16 || file.compare(0, at - 1, model_name) != 0 || file[at - 1] != '.' || file[at + 16] != '.')
    return false;
  return std::all_of(file.begin() + ptrdiff_t(at), file.begin() + ptrdiff_t(at + 16),
                     [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; });
}

void remove_leftovers(const std::string& folder, const std::string& name, const std::string& model_name) {
  DIR* dir = ::opendir(folder.c_str());
  if (!dir) return;
  const std::string ours = name + ".tmp.", temporary = ".wcache.tmp.";
  const auto now = std::chrono::system_clock::now();
  while (const dirent* e = ::readdir(dir)) {
    const std::string file = e->d_name, at = folder + "/" + file;
    if (file.compare(0, ours.size(), ours) == 0) {
      ::unlink(at.c_str());
      continue;
    }
    struct stat st {};
    if (!of_model(file, model_name) || file.find(temporary, model_name.size()) == std::string::npos ||
        ::lstat(at.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
      continue;
    const auto written = std::chrono::system_clock::time_point(std::chrono::seconds(st.st_mtim.tv_sec));
    if (now - written > kBuildWait) ::unlink(at.c_str());
  }
  ::closedir(dir);
}

}  // namespace

std::string WeightCache::path_for(const std::string& folder, const WeightCacheKey& key) {
  return model_side_file(key.model_path, folder, "." + hex(key.fingerprint) + "." + key.layout + ".wcache");
}

std::string WeightCache::problem(const std::string& path, const WeightCacheKey& key) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return "cannot open: " + errno_text();
  void* mapping = nullptr;
  std::string why = validate(fd, key, &mapping);
  ::close(fd);
  if (mapping) ::munmap(mapping, kHeaderBytes + key.data_bytes);
  return why;
}

std::unique_ptr<WeightCache> WeightCache::open(const std::string& folder, const WeightCacheKey& key,
                                               const Fill& fill, const Log& log) {
  if (key.layout.empty() || key.layout.size() >= kLayoutField ||
      key.layout.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789-") != std::string::npos)
    throw Error("weight cache: layout name '" + key.layout + "' is not 1-63 of [a-z0-9-]");
  const std::string path = path_for(folder, key);
  if (path.empty()) throw Error("weight cache: no folder (\"" + folder + "\" means none)");
  std::unique_ptr<WeightCache> cache(new WeightCache);
  cache->path_ = path;
  cache->mapping_bytes_ = kHeaderBytes + key.data_bytes;

  // A valid cache is mapped as it is; anything else is rebuilt under the lock.
  auto try_existing = [&](bool say_why) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0) {
      if (errno != ENOENT && say_why) log("weight cache " + path + ": cannot open: " + errno_text() + "; rebuilding");
      return false;
    }
    const std::string why = validate(fd, key, &cache->mapping_);
    ::close(fd);
    if (!why.empty() && say_why) log("weight cache " + path + ": " + why + "; rebuilding");
    return why.empty();
  };
  auto mapped = [&] {
    log("weight cache " + path + ": mapped (" + std::to_string(key.data_bytes) + " bytes)");
    return std::move(cache);
  };
  if (try_existing(false)) return mapped();

  const std::string dir = std::filesystem::path(path).parent_path().string();
  if (folder != "model") {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    if (error) {
      log("weight cache: cannot create the folder " + dir + ": " + error.message() + "; weights kept in memory");
      return nullptr;
    }
  }
  std::string why;
  const int lock = lock_file(path + ".lock", &why);
  if (lock < 0) {
    log("weight cache " + path + ": " + why + "; weights kept in memory");
    return nullptr;
  }
  struct Unlock {
    int fd;
    ~Unlock() { ::close(fd); }  // closing the descriptor drops the flock
  } unlock{lock};
  // Built by a process we waited for, or there all along but not valid.
  if (try_existing(true)) return mapped();

  const std::string name = std::filesystem::path(path).filename().string();
  remove_leftovers(dir, name, std::filesystem::path(model_side_file(key.model_path, folder, "")).filename().string());
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    log("weight cache: cannot create " + tmp + ": " + errno_text() + "; weights kept in memory");
    return nullptr;
  }
  // The mapping, once made, is the cache's alone to release (its destructor,
  // when `cache` goes on a failed path): unmapped here too, it was unmapped
  // twice, the second time perhaps over another thread's new mapping.
  auto fail = [&](const std::string& what) {
    log("weight cache: " + what + " " + tmp + ": " + errno_text() + "; weights kept in memory");
    ::close(fd);
    ::unlink(tmp.c_str());
    return nullptr;
  };
  // Blocks reserved up front: a full disk is an error here, not a SIGBUS
  // when a page of the mapping is first written.
  if (const int err = ::posix_fallocate(fd, 0, off_t(cache->mapping_bytes_)); err != 0) {
    errno = err;
    return fail("cannot reserve " + std::to_string(cache->mapping_bytes_) + " bytes for");
  }
  void* m = ::mmap(nullptr, cache->mapping_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) return fail("cannot map");
  advise_huge_pages(m, cache->mapping_bytes_);
  cache->mapping_ = m;
  auto* data = static_cast<uint8_t*>(m) + kHeaderBytes;
  try {
    fill(data);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  const Header h = header_for(key, data_checksum(data, key.data_bytes));
  std::memcpy(m, &h, sizeof h);
  // No fsync: a file cut short by a crash fails its checksum and is rebuilt.
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail("cannot rename");
  ::mprotect(m, cache->mapping_bytes_, PROT_READ);
  ::close(fd);
  cache->built_ = true;
  log("weight cache " + path + ": built (" + std::to_string(key.data_bytes) + " bytes)");
  return cache;
}

WeightCache::~WeightCache() {
  if (mapping_) ::munmap(mapping_, mapping_bytes_);
}

}  // namespace disagg::gpu
