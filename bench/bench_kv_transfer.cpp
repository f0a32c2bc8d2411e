// bench_kv_transfer (scripts/bench kv): the KV transfer path (kv/) against raw
// loopback TCP and memcpy, in one run of two processes on 127.0.0.1; or, with
// --peer-pid and --peer-host (bench/kv_link.sh), with the receiver on
// another host: the network (and mount: its /sys) namespaces of process
// PID, at the far end of a (shaped) link.
//
// The parent is the sender, a forked child the receiver; they coordinate over
// a socketpair, outside the timed regions. For each payload size:
//   tcp     raw loopback TCP: one connection, write() of the whole payload,
//           the receiver read()s it into its buffer and answers one byte;
//   ours    kv::KvSender -> kv::KvReceiver with UCX_TLS=tcp: the receiver
//           expects the transfer (its memory registered first), the sender
//           sends the payload in pieces and waits for the receiver's verdict,
//           so both checksums are inside the time;
//   shm     the same with shared-memory transports (both processes on one host);
//   memcpy  one copy in the sender process.
// Connections are set up before timing (between nodes they persist). Each
// figure is the median of --reps timed runs after --warmup untimed ones
// (the first touches fresh pages); raw TCP and ours over TCP alternate run by
// run, so that both see the same machine (on a small VM the loopback's speed
// drifts by 2x within seconds).
// rss_ratio: the receiver's peak RSS growth over the whole "ours" phase of a
// size, from a fresh receiver (listening, nothing connected, destination not
// yet allocated) to the end, over the payload: 1.0 is the destination buffer
// alone, what a transfer path without staging copies costs.
//
// Output: one line per size for each of
//   kv-transfer SIZE: ours=X GB/s tcp=Y GB/s ratio=Z rss_ratio=W
//   kv-transfer-shm SIZE: ours=X GB/s memcpy=Y GB/s
// (GB = 1e9 bytes), and comment lines (#) with the settings.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kv/transfer.h"

namespace {

using disagg::kv::Clock;
using namespace std::chrono_literals;

constexpr size_t kMiB = size_t(1) << 20;
constexpr double kGB = 1e9;
// Generous: a transfer of 256 MiB at 0.1 GB/s still fits.
constexpr auto kTransferDeadline = 60s;
// Bytes per write()/read() call of the raw TCP baseline: large, the kernel
// takes what fits in the socket buffer.
constexpr size_t kRawChunk = 64 * kMiB;

struct Options {
  std::vector<size_t> sizes_mib = {16, 64, 256};
  int reps = 7;
  int warmup = 1;
  size_t piece_bytes = 4 * kMiB;
  size_t inflight_bytes = 32 * kMiB;
  std::string tcp_tls = "tcp";
  std::string shm_tls = "posix,cma,tcp";  // tcp: UCX's client-server handshake needs it (the data takes shm)
  std::vector<std::pair<std::string, std::string>> ucx;
  bool run_tcp = true;  // --modes
  bool run_shm = true;
  bool verbose = false;
  std::string peer_pid;              // the receiver enters this process's network and mount namespaces
  std::string peer_host = "127.0.0.1";  // where it listens, and the sender connects
};

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "bench_kv_transfer: %s\n", what.c_str());
  std::exit(1);
}

void usage() {
  std::printf(
      "usage: bench_kv_transfer [--sizes=16,64,256] [--reps=7] [--warmup=1] [--piece-mib=4]\n"
      "                         [--inflight-mib=32] [--tcp-tls=tcp] [--shm-tls=posix,cma,tcp]\n"
      "                         [--modes=tcp,shm] [--ucx=NAME=VALUE ...] [--verbose]\n"
      "                         [--peer-pid=PID --peer-host=IP]\n"
      "  --ucx sets a UCX option (without the UCX_ prefix) on both sides' contexts, e.g. --ucx=RNDV_THRESH=64K\n");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq), value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (key == "--sizes") {
      o.sizes_mib.clear();
      size_t pos = 0;
      while (pos < value.size()) {
        const size_t comma = value.find(',', pos);
        o.sizes_mib.push_back(std::stoul(value.substr(pos, comma - pos)));
        pos = comma == std::string::npos ? value.size() : comma + 1;
      }
    } else if (key == "--reps") {
      o.reps = std::max(1, std::stoi(value));
    } else if (key == "--warmup") {
      o.warmup = std::max(0, std::stoi(value));
    } else if (key == "--piece-mib") {
      o.piece_bytes = size_t(std::stod(value) * double(kMiB));
    } else if (key == "--inflight-mib") {
      o.inflight_bytes = size_t(std::stod(value) * double(kMiB));
    } else if (key == "--tcp-tls") {
      o.tcp_tls = value;
    } else if (key == "--shm-tls") {
      o.shm_tls = value;
    } else if (key == "--ucx") {
      const size_t e = value.find('=');
      if (e == std::string::npos) die("--ucx wants NAME=VALUE");
      o.ucx.push_back({value.substr(0, e), value.substr(e + 1)});
    } else if (key == "--modes") {
      o.run_tcp = value.find("tcp") != std::string::npos;
      o.run_shm = value.find("shm") != std::string::npos;
      if (!o.run_tcp && !o.run_shm) die("--modes wants tcp, shm or tcp,shm");
    } else if (key == "--verbose") {
      o.verbose = true;
    } else if (key == "--peer-pid") {
      o.peer_pid = value;
    } else if (key == "--peer-host") {
      o.peer_host = value;
    } else if (key == "--help" || key == "-h") {
      usage();
      std::exit(0);
    } else {
      usage();
      die("unknown argument " + a);
    }
  }
  if (o.piece_bytes == 0 || o.inflight_bytes == 0) die("piece and in-flight sizes must be positive");
  return o;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Fresh anonymous pages: untouched until written, and returned to the
// system (RSS drops) when unmapped.
struct Pages {
  explicit Pages(size_t n) : bytes(n) {
    void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) die("mmap of " + std::to_string(n) + " bytes failed");
    data = static_cast<uint8_t*>(p);
  }
  ~Pages() { munmap(data, bytes); }
  Pages(const Pages&) = delete;
  Pages& operator=(const Pages&) = delete;
  uint8_t* data;
  size_t bytes;
};

// ---------------------------------------------------------------- peak RSS (receiver)

long status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line)) {
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') return std::stol(line.substr(n + 1));
  }
  return -1;
}

// Resets VmHWM to the current RSS (Linux >= 4.0); returns false if it cannot.
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return bool(out);
}

// User + system CPU seconds of this process (all threads) so far.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  const auto s = [](const timeval& t) { return double(t.tv_sec) + double(t.tv_usec) * 1e-6; };
  return s(u.ru_utime) + s(u.ru_stime);
}

// ---------------------------------------------------------------- control channel

enum class Op : uint32_t { setup, expect, result, teardown, raw_receive, quit };

struct Msg {
  Op op = Op::quit;
  uint32_t flag = 0;     // setup: 1 = shm transports
  uint64_t a = 0;        // setup: payload bytes; expect/result: transfer id
  uint64_t b = 0;        // replies: raw TCP port, RSS growth in bytes, status
  double cpu = 0;        // result replies: the receiver's CPU seconds for that transfer
  char text[112] = {};   // replies: the receiver's address or an error
};

void send_msg(int fd, const Msg& m) {
  if (write(fd, &m, sizeof m) != ssize_t(sizeof m)) die("control channel write failed");
}
Msg recv_msg(int fd) {
  Msg m;
  size_t got = 0;
  while (got < sizeof m) {
    const ssize_t k = read(fd, reinterpret_cast<char*>(&m) + got, sizeof m - got);
    if (k <= 0) die("control channel closed");
    got += size_t(k);
  }
  return m;
}
Msg call(int fd, const Msg& m) {
  send_msg(fd, m);
  Msg reply = recv_msg(fd);
  if (reply.text[0] == '!') die(std::string("receiver: ") + (reply.text + 1));
  return reply;
}

disagg::kv::ContextOptions context_options(const Options& o, bool shm) {
  disagg::kv::ContextOptions c;
  c.transports = shm ? o.shm_tls : o.tcp_tls;
  c.ucx_settings = o.ucx;
  // UCX 1.13 uses shared memory only without peer-failure handling.
  c.peer_failure_detection = !shm;
  return c;
}

// ---------------------------------------------------------------- receiver (child)

void read_fully(int fd, uint8_t* p, size_t n) {
  while (n > 0) {
    const ssize_t k = read(fd, p, std::min(n, kRawChunk));
    if (k <= 0) die("raw TCP read failed");
    p += k;
    n -= size_t(k);
  }
}

// A listening socket on `host` (any port) for the raw TCP baseline.
int raw_listen(const std::string& host, uint16_t* port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) die("--peer-host wants an IPv4 address");
  socklen_t len = sizeof addr;
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 1) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    die("raw TCP listen failed");
  }
  *port = ntohs(addr.sin_port);
  return fd;
}

int receiver_main(int ctl, const Options& o) {
  std::shared_ptr<disagg::kv::KvContext> context;
  std::unique_ptr<disagg::kv::KvReceiver> rx;
  std::unique_ptr<Pages> dest;
  long base_kib = 0;
  double cpu_at_expect = 0;
  int raw_listener = -1, raw = -1;
  for (;;) {
    Msg m = recv_msg(ctl);
    Msg reply;
    try {
      switch (m.op) {
        case Op::setup: {
          // A fresh receiver (listening, nothing connected), then the peak
          // RSS is reset and the destination mapped, untouched: the growth
          // from here is the destination plus whatever the transfers cost.
          context = disagg::kv::KvContext::create(context_options(o, m.flag != 0));
          disagg::kv::ReceiverOptions ro;
          ro.host = o.peer_host;
          rx = std::make_unique<disagg::kv::KvReceiver>(context, ro);
          uint16_t port = 0;
          raw_listener = raw_listen(o.peer_host, &port);
          if (!reset_peak_rss()) die("cannot reset the peak RSS (/proc/self/clear_refs)");
          base_kib = status_kib("VmHWM");
          dest = std::make_unique<Pages>(m.a);
          std::snprintf(reply.text, sizeof reply.text, "%s", rx->address().c_str());
          reply.b = port;
          break;
        }
        case Op::expect:
          cpu_at_expect = cpu_seconds();
          rx->expect(m.a, dest->data, dest->bytes, Clock::now() + kTransferDeadline);
          break;
        case Op::result: {
          const auto r = rx->wait(m.a, Clock::now() + kTransferDeadline);
          reply.b = uint64_t(r.status);
          reply.cpu = cpu_seconds() - cpu_at_expect;
          if (!r.ok()) std::snprintf(reply.text, sizeof reply.text, "!transfer %s: %s", to_string(r.status), r.detail.c_str());
          break;
        }
        case Op::raw_receive: {
          send_msg(ctl, reply);  // ready: the sender streams the payload now
          if (raw < 0) raw = accept(raw_listener, nullptr, nullptr);
          if (raw < 0) die("raw TCP accept failed");
          read_fully(raw, dest->data, dest->bytes);
          const char ack = 1;
          if (write(raw, &ack, 1) != 1) die("raw TCP ack failed");
          continue;  // already answered
        }
        case Op::teardown:
          reply.b = uint64_t(std::max(0L, status_kib("VmHWM") - base_kib)) * 1024;
          if (raw >= 0) close(raw);
          close(raw_listener);
          raw = raw_listener = -1;
          rx.reset();
          context.reset();
          dest.reset();
          break;
        case Op::quit:
          return 0;
      }
    } catch (const std::exception& e) {
      std::snprintf(reply.text, sizeof reply.text, "!%s", e.what());
    }
    send_msg(ctl, reply);
  }
}

// ---------------------------------------------------------------- sender (parent)

struct PhaseResult {
  double ours_gbps = 0;
  double raw_gbps = 0;  // only with the raw TCP baseline
  double rss_ratio = 0;
};

struct Timing {
  double seconds = 0;
  double sender_cpu = 0, receiver_cpu = 0;  // CPU seconds of each process (all threads)
};

// One transfer over our path: the receiver expects it, the sender sends it
// all and waits for the verdict.
Timing transfer_once(int ctl, disagg::kv::KvSender& tx, const Options& o, const Pages& src) {
  Msg expect;
  expect.op = Op::expect;
  expect.a = disagg::kv::new_transfer_id();
  call(ctl, expect);
  const double cpu0 = cpu_seconds();
  const auto t0 = Clock::now();
  if (!tx.send_all(expect.a, src.data, src.bytes, o.piece_bytes)) die("the receiver refused a transfer");
  const auto r = tx.wait(expect.a, Clock::now() + kTransferDeadline);
  const double s = seconds_since(t0);
  if (!r.ok()) die(std::string("transfer failed: ") + to_string(r.status) + " " + r.detail);
  const double sender_cpu = cpu_seconds() - cpu0;
  Msg result;
  result.op = Op::result;
  result.a = expect.a;
  const Msg done = call(ctl, result);
  return Timing{s, sender_cpu, done.cpu};
}

// The payload once over the raw TCP connection. Returns seconds.
double raw_once(int ctl, int fd, const Pages& src) {
  Msg receive;
  receive.op = Op::raw_receive;
  call(ctl, receive);
  const auto t0 = Clock::now();
  size_t sent = 0;
  while (sent < src.bytes) {
    const ssize_t k = write(fd, src.data + sent, std::min(src.bytes - sent, kRawChunk));
    if (k <= 0) die("raw TCP write failed");
    sent += size_t(k);
  }
  char ack = 0;
  if (read(fd, &ack, 1) != 1) die("raw TCP ack missing");
  return seconds_since(t0);
}

// One size in one mode: a fresh receiver, our transfers (alternating with
// raw TCP ones when with_raw), the receiver's peak RSS growth.
PhaseResult run_phase(int ctl, const Options& o, const Pages& src, bool shm, bool with_raw) {
  Msg setup;
  setup.op = Op::setup;
  setup.flag = shm ? 1 : 0;
  setup.a = src.bytes;
  const Msg ready = call(ctl, setup);
  auto context = disagg::kv::KvContext::create(context_options(o, shm));
  disagg::kv::SenderOptions so;
  so.max_inflight_bytes = o.inflight_bytes;
  std::vector<double> ours, raw, sender_cpu, receiver_cpu;
  {
    disagg::kv::KvSender tx(context, ready.text, so);
    int fd = -1;
    if (with_raw) {
      fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      inet_pton(AF_INET, o.peer_host.c_str(), &addr.sin_addr);
      addr.sin_port = htons(uint16_t(ready.b));
      if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) die("raw TCP connect failed");
    }
    for (int rep = 0; rep < o.warmup + o.reps; ++rep) {
      const bool timed = rep >= o.warmup;
      if (with_raw) {
        const double s = raw_once(ctl, fd, src);
        if (timed) raw.push_back(s);
      }
      const Timing t = transfer_once(ctl, tx, o, src);
      if (timed) {
        ours.push_back(t.seconds);
        sender_cpu.push_back(t.sender_cpu);
        receiver_cpu.push_back(t.receiver_cpu);
      }
    }
    if (fd >= 0) close(fd);
  }
  Msg teardown;
  teardown.op = Op::teardown;
  const Msg done = call(ctl, teardown);
  PhaseResult out;
  out.ours_gbps = double(src.bytes) / median(ours) / kGB;
  if (with_raw) out.raw_gbps = double(src.bytes) / median(raw) / kGB;
  out.rss_ratio = double(done.b) / double(src.bytes);
  if (o.verbose) {
    const auto gbps = [&](double s) { return double(src.bytes) / s / kGB; };
    std::printf("#   %zu MiB %s: ours min/median/max %.2f/%.2f/%.2f GB/s", src.bytes / kMiB, shm ? "shm" : "tcp",
                gbps(*std::max_element(ours.begin(), ours.end())), gbps(median(ours)),
                gbps(*std::min_element(ours.begin(), ours.end())));
    if (with_raw) {
      std::printf(", raw tcp %.2f/%.2f/%.2f GB/s", gbps(*std::max_element(raw.begin(), raw.end())),
                  gbps(median(raw)), gbps(*std::min_element(raw.begin(), raw.end())));
    }
    // CPU per transfer against its wall time: above 1 in total, the two
    // processes could not both run at once.
    std::printf(", CPU/wall sender %.2f receiver %.2f, receiver peak RSS growth %.1f MiB\n",
                median(sender_cpu) / median(ours), median(receiver_cpu) / median(ours), double(done.b) / double(kMiB));
  }
  return out;
}

double run_memcpy(const Options& o, const Pages& src) {
  Pages dst(src.bytes);
  std::vector<double> times;
  for (int rep = 0; rep < o.warmup + o.reps; ++rep) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data, src.data, src.bytes);
    const double s = seconds_since(t0);
    if (rep >= o.warmup) times.push_back(s);
  }
  return double(src.bytes) / median(times) / kGB;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, fds) != 0) die("socketpair failed");
  std::fflush(stdout);
  // Fork before either side touches UCX: each process makes its own contexts.
  const pid_t child = fork();
  if (child < 0) die("fork failed");
  if (child == 0) {
    close(fds[0]);
    // The receiver on the other host: its network, and the mount namespace
    // whose /sys lists that network's interfaces (UCX looks there).
    for (const char* kind : {"net", "mnt"}) {
      if (o.peer_pid.empty()) break;
      const std::string path = "/proc/" + o.peer_pid + "/ns/" + kind;
      const int ns = open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (ns < 0 || setns(ns, 0) != 0) die("cannot enter " + path + ": " + std::strerror(errno));
      close(ns);
    }
    _exit(receiver_main(fds[1], o));
  }
  close(fds[1]);
  const int ctl = fds[0];

  std::printf("# bench_kv_transfer: sender pid %d, receiver pid %d at %s%s; %d timed runs (median) after %d warm-up\n",
              int(getpid()), int(child), o.peer_host.c_str(), o.peer_pid.empty() ? "" : " (another network namespace)",
              o.reps, o.warmup);
  std::printf("# pieces %.2f MiB, in flight <= %.2f MiB; UCX_TLS tcp mode \"%s\", shm mode \"%s\"", double(o.piece_bytes) / kMiB,
              double(o.inflight_bytes) / kMiB, o.tcp_tls.c_str(), o.shm_tls.c_str());
  for (const auto& [k, v] : o.ucx) std::printf(", UCX_%s=%s", k.c_str(), v.c_str());
  std::printf("\n");
  std::fflush(stdout);

  for (size_t mib : o.sizes_mib) {
    Pages src(mib * kMiB);
    for (size_t i = 0; i < src.bytes; ++i) src.data[i] = uint8_t(i * 2654435761u >> 24);  // touched, not all zero
    if (o.run_tcp) {
      const PhaseResult tcp = run_phase(ctl, o, src, /*shm=*/false, /*with_raw=*/true);
      std::printf("kv-transfer %zuMiB: ours=%.2f GB/s tcp=%.2f GB/s ratio=%.2f rss_ratio=%.2f\n", mib, tcp.ours_gbps,
                  tcp.raw_gbps, tcp.ours_gbps / tcp.raw_gbps, tcp.rss_ratio);
    }
    if (o.run_shm) {
      const PhaseResult shm = run_phase(ctl, o, src, /*shm=*/true, /*with_raw=*/false);
      const double copy = run_memcpy(o, src);
      std::printf("kv-transfer-shm %zuMiB: ours=%.2f GB/s memcpy=%.2f GB/s\n", mib, shm.ours_gbps, copy);
    }
    std::fflush(stdout);
  }
  Msg quit;
  quit.op = Op::quit;
  send_msg(ctl, quit);
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
