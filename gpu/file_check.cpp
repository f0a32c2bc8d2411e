#include "gpu/file_check.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "gpu/error.h"

namespace disagg::gpu {

namespace {

bool acceptable(mode_t mode, Accept accept) {
  return S_ISREG(mode) || (accept == Accept::regular_file_or_directory && S_ISDIR(mode));
}

Error refused(const std::string& path, mode_t mode, Accept accept) {
  return Error(path + (accept == Accept::regular_file ? ": not a regular file (" : ": not a regular file or a directory (") +
               file_type_name(mode) + ")");
}

}  // namespace

std::string errno_text() { return std::strerror(errno); }

std::string file_type_name(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "a file of unknown type";
}

InputFile InputFile::open(const std::string& path, Accept accept) {
  // First by name: a device or socket is refused without being opened (an
  // open can have effects on a device; a socket's fails with a vague ENXIO).
  // A FIFO is left to the one check below, which refuses it whether it was
  // there at this stat() or put there after.
  struct stat named {};
  if (::stat(path.c_str(), &named) == 0 && !acceptable(named.st_mode, accept) && !S_ISFIFO(named.st_mode))
    throw refused(path, named.st_mode, accept);
  // Then what was opened: O_NONBLOCK so that a FIFO's open returns at once
  // (without it, open() waits for a writer, for good), fstat() so that the
  // check is of this very file.
  int fd;
  do fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const std::string why = errno_text();
    throw Error(path + ": cannot open: " + why);
  }
  InputFile file(path, fd, named);  // closes fd if anything below throws
  if (::fstat(fd, &file.status_) != 0) {
    const std::string why = errno_text();
    throw Error(path + ": cannot stat: " + why);
  }
  if (!acceptable(file.status_.st_mode, accept)) throw refused(path, file.status_.st_mode, accept);
  // A regular file's reads never block anyway; cleared so that the
  // descriptor is an ordinary one for whoever reads or maps it.
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const std::string why = errno_text();
    throw Error(path + ": cannot clear O_NONBLOCK: " + why);
  }
  return file;
}

InputFile::InputFile(InputFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(other.fd_), status_(other.status_) {
  other.fd_ = -1;
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string InputFile::read_all() const {
  std::string bytes;
  bytes.reserve(size());
  char buffer[1 << 16];
  for (off_t at = 0;;) {
    const ssize_t n = ::pread(fd_, buffer, sizeof buffer, at);
    if (n > 0) {
      bytes.append(buffer, size_t(n));
      at += n;
    } else if (n == 0) {
      return bytes;
    } else if (errno != EINTR) {
      const std::string why = errno_text();
      throw Error(path_ + ": cannot read: " + why);
    }
  }
}

std::string read_regular_file(const std::string& path) { return InputFile::open(path).read_all(); }

std::string file_problem(const std::string& path, Accept accept) {
  try {
    InputFile::open(path, accept);
    return {};
  } catch (const Error& e) {
    const std::string what = e.what();
    const std::string prefix = path + ": ";
    return what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what;
  }
}

OutputFile OutputFile::create(const std::string& path) {
  // A link is written through (its target replaced, as writing to it did),
  // and each writer of the process has a name of its own (two threads
  // writing one file's memo at once must not share a temporary file).
  std::error_code ec;
  const std::filesystem::path resolved = std::filesystem::canonical(path, ec);
  const std::string target = ec ? path : resolved.string();
  static std::atomic<uint64_t> writers{0};
  std::string temporary = target + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(writers++);
  ::unlink(temporary.c_str());  // (one an earlier process of this pid left: it died writing)
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0666);
  if (fd < 0) {
    const std::string why = errno_text();
    throw Error(path + ": cannot create: " + why);
  }
  std::FILE* file = ::fdopen(fd, "wb");
  if (!file) {
    const std::string why = errno_text();
    ::close(fd);
    ::unlink(temporary.c_str());
    throw Error(path + ": cannot create: " + why);
  }
  return OutputFile(target, std::move(temporary), file);
}

OutputFile::OutputFile(OutputFile&& other) noexcept
    : path_(std::move(other.path_)), temporary_(std::move(other.temporary_)), file_(other.file_) {
  other.file_ = nullptr;
  other.temporary_.clear();
}

OutputFile::~OutputFile() {
  if (file_) std::fclose(file_);
  if (!temporary_.empty()) ::unlink(temporary_.c_str());
}

void OutputFile::commit() {
  const bool written = !std::ferror(file_);
  const int closed = std::fclose(file_);
  file_ = nullptr;
  const std::string why = errno_text();
  if (!written || closed != 0) throw Error(path_ + ": write failed: " + (written ? why : "a write failed"));
  if (::rename(temporary_.c_str(), path_.c_str()) != 0) {
    const std::string why_rename = errno_text();
    throw Error(path_ + ": write failed: cannot rename " + temporary_ + ": " + why_rename);
  }
  temporary_.clear();
}

void write_regular_file(const std::string& path, const std::string& text) {
  OutputFile file = OutputFile::create(path);
  if (std::fwrite(text.data(), 1, text.size(), file.stream()) != text.size()) {
    const std::string why = errno_text();
    throw Error(path + ": write failed: " + why);
  }
  file.commit();
}

}  // namespace disagg::gpu
