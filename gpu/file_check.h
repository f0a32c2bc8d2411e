// Every file the project reads by a user's path (model files, tokenizer
// files, config.json and the other JSON files of a model directory, TLS
// certificates and keys, a node's config file) is opened here: only a
// regular file (or a directory, where the caller accepts one), and without
// ever blocking in open().
//
// Why: open(O_RDONLY) of a FIFO blocks until a writer comes, so a FIFO named
// as a model hung every node that loaded it, silently and past SIGTERM
// (issue 44); a character device can block in read() or never end. So the
// path is stat()ed first (a device or socket is refused without being opened
// at all: opening some devices has effects), then opened with O_NONBLOCK (a
// FIFO's open returns at once) and fstat()ed: the check and the read see the
// same file, with no window in which the path could be swapped for a FIFO.
// O_NONBLOCK is cleared again once the file is known to be regular. A
// Hugging Face directory's files are each opened here too.
//
// Free of CAF: the compute library and the node code both use it.
#pragma once
#include <sys/stat.h>

#include <cstddef>
#include <cstdio>
#include <string>
#include <utility>

namespace disagg::gpu {

enum class Accept { regular_file, regular_file_or_directory };

// A read-only file descriptor of a regular file (or a directory), closed when
// destroyed.
class InputFile {
 public:
  // Throws Error "<path>: cannot open: <reason>" or "<path>: not a regular
  // file (a FIFO)" (a socket, a character device, a block device, a
  // directory where none is accepted).
  static InputFile open(const std::string& path, Accept accept = Accept::regular_file);

  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&&) = delete;
  InputFile(const InputFile&) = delete;
  ~InputFile();

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool is_directory() const { return S_ISDIR(status_.st_mode); }
  size_t size() const { return size_t(status_.st_size); }
  // Every byte of a regular file, read through the descriptor. Throws Error
  // "<path>: cannot read: <reason>".
  std::string read_all() const;

 private:
  InputFile(std::string path, int fd, const struct stat& status) : path_(std::move(path)), fd_(fd), status_(status) {}
  std::string path_;
  int fd_ = -1;
  struct stat status_ {};
};

// The bytes of the regular file at `path` (InputFile::open(path).read_all()).
std::string read_regular_file(const std::string& path);

// Why InputFile::open(path, accept) would throw, without the path: "" when it
// would not; else "cannot open: No such file or directory", "not a regular
// file (a FIFO)", .... For a file a library then opens by its name (OpenSSL's
// certificate loading, CAF's config reader), checked just before.
std::string file_problem(const std::string& path, Accept accept = Accept::regular_file);

// A file written whole or not at all (a model file, a fingerprint memo):
// written as `<path>.tmp.<pid>.<n>` (n: the process's nth writer) and
// renamed over `path` (a link's target, where `path` is a link) by commit(), so no
// reader ever finds a half-written one under `path`, and a file being
// replaced stays whole for whoever has it open or mapped (a node serving it,
// or a writer whose input it is: `disagg-convert --model m.gguf --out m.gguf`).
// Destroyed uncommitted (an error, an exception), the temporary file is removed.
class OutputFile {
 public:
  // Throws Error "<path>: cannot create: <reason>".
  static OutputFile create(const std::string& path);

  OutputFile(OutputFile&& other) noexcept;
  OutputFile& operator=(OutputFile&&) = delete;
  OutputFile(const OutputFile&) = delete;
  ~OutputFile();

  std::FILE* stream() const { return file_; }
  // Closes the stream and renames the file into place. Throws Error
  // "<path>: write failed: <reason>" (the temporary file removed) if a write
  // failed, the close did or the rename.
  void commit();

 private:
  OutputFile(std::string path, std::string temporary, std::FILE* file)
      : path_(std::move(path)), temporary_(std::move(temporary)), file_(file) {}
  std::string path_, temporary_;
  std::FILE* file_ = nullptr;
};

// `text` as the file at `path`, whole or not at all (OutputFile). Throws
// Error "<path>: cannot create: ..." or "<path>: write failed: ...".
void write_regular_file(const std::string& path, const std::string& text);

// errno in words (read it before anything else can change it).
std::string errno_text();

// A file type in words: "a FIFO", "a socket", "a character device", "a block
// device", "a directory", "a regular file", "a file of unknown type".
std::string file_type_name(mode_t mode);

}  // namespace disagg::gpu
