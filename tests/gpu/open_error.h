// What Checkpoint::open says of a bad model file or directory.
#pragma once
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>

#include "model/checkpoint.h"
#include "gpu/error.h"

namespace disagg::test {

// The error's text, or "(opened)" when the model opened.
inline std::string open_error(const std::string& path) {
  try {
    gpu::Checkpoint::open(path);
  } catch (const gpu::Error& e) {
    return e.what();
  }
  return "(opened)";
}

// Makes a FIFO at `path` (replacing what is there).
inline void make_fifo(const std::string& path) {
  ::unlink(path.c_str());
  if (::mkfifo(path.c_str(), 0600) != 0) throw std::runtime_error("mkfifo " + path + " failed");
}

// The error `read` throws (or "(opened)") while `fifo`, a FIFO with no
// writer, lies in its way. A reader that blocks in open() on the FIFO (as
// open(O_RDONLY) does without O_NONBLOCK) fails the test by an assertion
// after 5 s instead of hanging it: the FIFO is then opened for writing and
// closed, which lets the blocked open() return and the read end.
inline std::string error_beside_fifo(const std::string& fifo, std::function<void()> read) {
  auto result = std::make_shared<std::promise<std::string>>();
  std::future<std::string> done = result->get_future();
  std::thread reader([result, read = std::move(read)] {
    try {
      read();
      result->set_value("(opened)");
    } catch (const std::exception& e) {
      result->set_value(e.what());
    }
  });
  const auto start = std::chrono::steady_clock::now();
  if (done.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    ADD_FAILURE() << fifo << ": the read still blocks after 5 s (a FIFO opened without O_NONBLOCK?)";
    while (done.wait_for(std::chrono::milliseconds(10)) != std::future_status::ready &&
           std::chrono::steady_clock::now() - start < std::chrono::seconds(30)) {
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);  // ENXIO until the reader waits in open()
      if (fd >= 0) ::close(fd);
    }
  }
  if (done.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    ADD_FAILURE() << fifo << ": the read never ended";
    reader.detach();  // it owns what it uses
    return "(blocked)";
  }
  reader.join();
  return done.get();
}

}  // namespace disagg::test
