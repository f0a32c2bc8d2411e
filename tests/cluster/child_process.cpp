#include "cluster/child_process.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace disagg::test {

namespace {

using Clock = std::chrono::steady_clock;

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

// Forks and execs argv with stdout/stderr on the given descriptors. The child
// gets SIGKILL when the test binary dies.
pid_t spawn(const std::vector<std::string>& argv, int out_fd, int err_fd, const std::vector<std::string>& env) {
  if (argv.empty()) throw std::runtime_error("spawn: empty argv");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  // The environment is built before fork: the child of a multi-threaded
  // process may only call async-signal-safe functions.
  std::vector<std::string> environment;
  for (char** e = environ; *e; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    bool replaced = false;
    for (const auto& o : env) replaced = replaced || o.compare(0, name.size() + 1, name + "=") == 0;
    if (!replaced) environment.push_back(entry);
  }
  environment.insert(environment.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (const auto& e : environment) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const std::string exec_failed = "exec " + argv[0] + " failed\n";
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the parent died before prctl
    ::setpgid(0, 0);  // a terminal's Ctrl-C reaches the test, which then stops its children
    const int devnull = ::open("/dev/null", O_RDONLY);
    ::dup2(devnull, 0);
    ::dup2(out_fd, 1);
    ::dup2(err_fd, 2);
    ::execve(args[0], args.data(), envp.data());
    [[maybe_unused]] auto n = ::write(2, exec_failed.data(), exec_failed.size());
    ::_exit(127);
  }
  return pid;
}

std::set<unsigned long> socket_inodes(pid_t pid) {
  std::set<unsigned long> inodes;
  const std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = ::opendir(dir.c_str());
  if (!d) return inodes;
  while (dirent* e = ::readdir(d)) {
    char target[256];
    const std::string link = dir + "/" + e->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    unsigned long inode = 0;
    if (std::sscanf(target, "socket:[%lu]", &inode) == 1) inodes.insert(inode);
  }
  ::closedir(d);
  return inodes;
}

}  // namespace

ChildProcess::ChildProcess(std::vector<std::string> argv, std::string log_path, std::vector<std::string> env)
    : log_path_(std::move(log_path)) {
  const int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(log_path_ + ": " + std::strerror(errno));
  try {
    pid_ = spawn(argv, fd, fd, env);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
}

ChildProcess::~ChildProcess() { kill_hard(); }

bool ChildProcess::reap(bool block) {
  if (exit_code_) return true;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, block ? 0 : WNOHANG);
  if (r == pid_) {
    exit_code_ = exit_code_of(status);
    return true;
  }
  return false;
}

bool ChildProcess::running() { return !reap(false); }

std::optional<int> ChildProcess::wait_exit(std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!reap(false)) {
    if (Clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return exit_code_;
}

int ChildProcess::stop(std::chrono::milliseconds grace) {
  if (running()) ::kill(pid_, SIGTERM);
  if (auto code = wait_exit(grace)) return *code;
  kill_hard();
  return *exit_code_;
}

void ChildProcess::kill_hard() {
  if (pid_ <= 0 || exit_code_) return;
  ::kill(pid_, SIGKILL);
  reap(true);
}

std::string ChildProcess::log() const { return read_text_file(log_path_); }

bool ChildProcess::log_says(const std::string& text, std::chrono::milliseconds within) const {
  const auto deadline = Clock::now() + within;
  for (;;) {
    if (log().find(text) != std::string::npos) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // (a poll of the log, bounded by `within`)
  }
}

int run_to_completion(const std::vector<std::string>& argv, std::string& output, std::string& err,
                      std::chrono::milliseconds timeout, std::vector<std::string> env) {
  char out_path[] = "/tmp/disagg-out-XXXXXX";
  char err_path[] = "/tmp/disagg-err-XXXXXX";
  const int out_fd = ::mkstemp(out_path);
  const int err_fd = ::mkstemp(err_path);
  if (out_fd < 0 || err_fd < 0) throw std::runtime_error("run_to_completion: mkstemp failed");
  int code = -1;
  {
    const pid_t pid = spawn(argv, out_fd, err_fd, env);
    const auto deadline = Clock::now() + timeout;
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid, &status, WNOHANG);
      if (r == pid) {
        code = exit_code_of(status);
        break;
      }
      if (Clock::now() >= deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        code = 124;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ::close(out_fd);
  ::close(err_fd);
  output = read_text_file(out_path);
  err = read_text_file(err_path);
  ::unlink(out_path);
  ::unlink(err_path);
  return code;
}

uint16_t free_loopback_port() {
  constexpr int kLowest = 10000;
  int ephemeral_low = 32768;
  std::ifstream("/proc/sys/net/ipv4/ip_local_port_range") >> ephemeral_low;
  if (ephemeral_low <= kLowest + 100) ephemeral_low = 32768;
  static std::mutex mutex;
  static std::set<uint16_t> given;
  static std::mt19937 rng{std::random_device{}()};
  std::lock_guard<std::mutex> lock(mutex);
  std::uniform_int_distribution<int> pick(kLowest, ephemeral_low - 1);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    const auto port = static_cast<uint16_t>(pick(rng));
    if (given.count(port)) continue;
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) throw std::runtime_error("socket failed");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(port);
    const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    ::close(fd);
    if (!bound) continue;
    given.insert(port);
    return port;
  }
  throw std::runtime_error("cannot find a free loopback port below the ephemeral range");
}

bool has_connection_to_port(pid_t pid, uint16_t remote_port) {
  const std::set<unsigned long> inodes = socket_inodes(pid);
  // (the tables of its own network namespace: another host's, in a NetLab)
  for (const char* table : {"/net/tcp", "/net/tcp6"}) {
    std::ifstream in("/proc/" + std::to_string(pid) + table);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
      std::istringstream fields(line);
      std::string sl, local, remote, state, queues, timer, retransmits, uid, timeout;
      unsigned long inode = 0;
      if (!(fields >> sl >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode))
        continue;
      if (state != "01" || !inodes.count(inode)) continue;  // 01: ESTABLISHED
      const auto colon = remote.rfind(':');
      if (colon != std::string::npos && std::stoul(remote.substr(colon + 1), nullptr, 16) == remote_port)
        return true;
    }
  }
  return false;
}

int64_t rss_bytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line))
    if (line.compare(0, 6, "VmRSS:") == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

bool process_alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() && line[close + 2] != 'Z';
}

}  // namespace disagg::test
