// Processes a cluster test starts (disagg-node, disagg-client, scripts), and
// what it inspects about them. A child never outlives the test binary: it is
// killed when its handle goes away and, should the test binary itself die,
// by the kernel (PR_SET_PDEATHSIG).
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "support/test_paths.h"

namespace disagg::test {

class ChildProcess {
 public:
  // Runs argv[0] (a path) with stdout and stderr appended to `log_path`, and
  // `env` ("NAME=value") added to the environment.
  ChildProcess(std::vector<std::string> argv, std::string log_path, std::vector<std::string> env = {});
  ~ChildProcess();  // SIGKILL unless it has exited; always reaped
  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;

  pid_t pid() const { return pid_; }
  bool running();
  // The exit code (128 + signal when killed), or nullopt if still running after `timeout`.
  std::optional<int> wait_exit(std::chrono::milliseconds timeout);
  // SIGTERM, then SIGKILL after `grace`; the exit code.
  int stop(std::chrono::milliseconds grace = std::chrono::seconds(5));
  void kill_hard();  // SIGKILL and reap
  std::string log() const;
  const std::string& log_path() const { return log_path_; }
  // Whether its log holds `text` within `within` (polled).
  bool log_says(const std::string& text, std::chrono::milliseconds within) const;

 private:
  bool reap(bool block);
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
  std::string log_path_;
};

// Runs a command to completion (bounded by `timeout`, then killed); returns
// its exit code and fills `output` with its stdout (stderr goes to `err`).
int run_to_completion(const std::vector<std::string>& argv, std::string& output, std::string& err,
                      std::chrono::milliseconds timeout, std::vector<std::string> env = {});

// A loopback TCP port nothing listens on right now, picked at random below the
// kernel's ephemeral range (ip_local_port_range) so that no node's `port = 0`
// listener or outgoing connection can take it before the node it is meant for
// binds it; never the same port twice in one process. tests/support/ports.py
// follows the same rule for the Python tests.
uint16_t free_loopback_port();

// Whether process `pid` has an established TCP connection to `remote_port`
// (read from /proc: the process's socket inodes matched against /proc/net/tcp).
bool has_connection_to_port(pid_t pid, uint16_t remote_port);

// Whether a process with this pid exists (and is not a zombie).
bool process_alive(pid_t pid);

// Resident memory of a process in bytes (VmRSS), 0 when it cannot be read.
int64_t rss_bytes(pid_t pid);

// write_text_file, read_text_file: support/test_paths.h

}  // namespace disagg::test
