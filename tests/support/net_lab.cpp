#include "support/net_lab.h"

#include "support/packet_delay.h"

#include <fcntl.h>
#include <sstream>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "support/run_command.h"

namespace disagg::test {

namespace {

// Set once this process's thread has entered a namespace of its own: the
// one condition for running a network command.
bool entered = false;

std::string link_of(const std::string& path) {
  char buffer[64] = {};
  const ssize_t n = ::readlink(path.c_str(), buffer, sizeof buffer - 1);
  return n > 0 ? std::string(buffer, size_t(n)) : std::string();
}

// Runs `command` (sh) in the lab; throws with its output when it fails.
void lab_command(const std::string& command) {
  if (!entered) throw std::logic_error("NetLab: a network command outside a namespace of the test's own");
  const auto [out, status] = run_command("(" + command + ") 2>&1");
  if (status != 0) throw std::runtime_error("NetLab: `" + command + "` failed (" + std::to_string(status) + "): " + out);
}

// Waits (up to 3 s, polling the kernel's link state) until every link
// that `shows` (`ip link show` commands) lists says it is up: the kernel
// reports a new link's carrier up to a second later, and UCX leaves out an
// interface that is not running when its context starts.
void wait_until_up(const std::vector<std::string>& shows) {
  std::string all;
  for (const std::string& show : shows) all += (all.empty() ? "" : " && ") + show + " | grep -q 'state UP'";
  lab_command("for _ in $(seq 300); do " + all + " && exit 0; sleep 0.01; done; exit 1");
}

}  // namespace

std::string NetLab::namespace_of(pid_t pid) { return link_of("/proc/" + std::to_string(pid) + "/ns/net"); }

std::string NetLab::enter_private_namespace() {
  const std::string before = link_of("/proc/thread-self/ns/net");
  if (before.empty()) return "cannot read /proc/thread-self/ns/net";
  if (::unshare(CLONE_NEWNET) != 0)
    return std::string("unshare(CLONE_NEWNET) refused: ") + std::strerror(errno) + " (it needs CAP_NET_ADMIN)";
  const std::string after = link_of("/proc/thread-self/ns/net");
  if (after.empty() || after == before) return "the network namespace did not change (" + before + ")";
  // (pid 1's is the machine's, where it can be read)
  const std::string init = namespace_of(1);
  if (!init.empty() && init == after) return "the new namespace is pid 1's";
  entered = true;
  lab_command("ip link set lo up && echo 1 > /proc/sys/net/ipv4/ip_forward");
  return "";
}

NetLab::NetLab(const std::vector<std::string>& names) {
  if (!entered) throw std::logic_error("NetLab: call enter_private_namespace() first (and skip when it refuses)");
  const pid_t parent = ::getpid();
  for (const std::string& name : names) {
    const int index = int(hosts_.size()) + 1;
    int ready[2];
    if (::pipe2(ready, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
    if (pid == 0) {  // the holder: namespaces of its own, then nothing
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      // Its own mount namespace too, with a sysfs of its network's: UCX
      // finds the interfaces in /sys/class/net, which otherwise lists the
      // machine's (a host whose veth happened to be named like the
      // machine's NIC worked, any other did not).
      char ok = ::getppid() == parent && ::unshare(CLONE_NEWNET | CLONE_NEWNS) == 0 &&
                        ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0 &&
                        ::mount("sysfs", "/sys", "sysfs", 0, nullptr) == 0
                    ? 1
                    : 0;
      [[maybe_unused]] auto n = ::write(ready[1], &ok, 1);
      if (!ok) ::_exit(1);
      for (;;) ::pause();
    }
    ::close(ready[1]);
    char ok = 0;
    const bool read_ok = ::read(ready[0], &ok, 1) == 1;
    ::close(ready[0]);
    hosts_.push_back({name, index, pid});
    if (!read_ok || !ok) throw std::runtime_error("NetLab: host " + name + " could not make its namespace");
    const std::string i = std::to_string(index), ns = "/proc/" + std::to_string(pid) + "/ns/net";
    lab_command("ip link add h" + i + " type veth peer name net0 netns " + std::to_string(pid) + " && ip addr add 10.77." +
                i + ".1/24 dev h" + i + " && ip link set h" + i + " up");
    lab_command("nsenter --net=" + ns + " sh -c 'ip link set lo up && ip addr add 10.77." + i +
                ".2/24 dev net0 && ip link set net0 up && ip route add default via 10.77." + i + ".1'");
    wait_until_up(  // (both ends running before a node looks for them)
        {"ip link show h" + i, "nsenter --net=" + ns + " ip link show net0"});
  }
}

NetLab::~NetLab() {
  delays_.clear();
  for (const Host& h : hosts_) {
    ::kill(h.holder, SIGKILL);
    ::waitpid(h.holder, nullptr, 0);
  }
}

const NetLab::Host& NetLab::host(const std::string& name) const {
  for (const Host& h : hosts_)
    if (h.name == name) return h;
  throw std::logic_error("NetLab: no host " + name);
}

std::string NetLab::address(const std::string& name) const {
  return "10.77." + std::to_string(host(name).index) + ".2";
}

std::string NetLab::gateway(const std::string& name) const {
  return "10.77." + std::to_string(host(name).index) + ".1";
}

pid_t NetLab::holder(const std::string& name) const { return host(name).holder; }

std::vector<std::string> NetLab::run_on(const std::string& name) const {
  const std::string proc = "/proc/" + std::to_string(host(name).holder);
  return {"/usr/bin/nsenter", "--net=" + proc + "/ns/net", "--mount=" + proc + "/ns/mnt", "--"};
}

std::vector<std::string> NetLab::run_on_network_only(const std::string& name) const {
  return {"/usr/bin/nsenter", "--net=/proc/" + std::to_string(host(name).holder) + "/ns/net", "--"};
}

void NetLab::cut(const std::string& a, const std::string& b) {
  const std::string x = address(a), y = address(b);
  lab_command("iptables -I FORWARD -s " + x + " -d " + y + " -j DROP && iptables -I FORWARD -s " + y + " -d " + x +
              " -j DROP");
}

void NetLab::cut_but_port(const std::string& a, const std::string& b, uint16_t port) {
  cut(a, b);
  const std::string x = address(a), y = address(b), p = std::to_string(port);
  lab_command("iptables -I FORWARD -p tcp -s " + x + " -d " + y + " --dport " + p +
              " -j ACCEPT && iptables -I FORWARD -p tcp -s " + y + " -d " + x + " --sport " + p + " -j ACCEPT");
}

namespace {

// conntrack's byte count of a connection, both directions together.
std::string connbytes_rules(const char* action, const std::string& x, const std::string& y, uint16_t port,
                            int64_t bytes) {
  const std::string match = " -m connbytes --connbytes " + std::to_string(bytes) +
                            ": --connbytes-dir both --connbytes-mode bytes -j DROP";
  return std::string("iptables ") + action + " FORWARD -p tcp -s " + x + " -d " + y + " --dport " +
         std::to_string(port) + match + " && iptables " + action + " FORWARD -p tcp -s " + y + " -d " + x +
         " --sport " + std::to_string(port) + match;
}

}  // namespace

void NetLab::cut_connections_after(const std::string& a, const std::string& b, uint16_t port, int64_t bytes) {
  lab_command(connbytes_rules("-I", address(a), address(b), port, bytes));
}

void NetLab::heal_connections(const std::string& a, const std::string& b, uint16_t port, int64_t bytes) {
  lab_command(connbytes_rules("-D", address(a), address(b), port, bytes));
}

void NetLab::heal(const std::string& a, const std::string& b) {
  const std::string x = address(a), y = address(b);
  lab_command("iptables -D FORWARD -s " + x + " -d " + y + " -j DROP && iptables -D FORWARD -s " + y + " -d " + x +
              " -j DROP");
}

namespace {

std::string isolation_rules(const char* action, const std::string& x) {
  return "iptables " + std::string(action) + " FORWARD -s " + x + " -j DROP && iptables " + action + " FORWARD -d " + x +
         " -j DROP && iptables " + action + " INPUT -s " + x + " -j DROP && iptables " + action + " OUTPUT -d " + x +
         " -j DROP";
}

}  // namespace

void NetLab::lose(double p) {
  // (a rule with no target first: it counts every packet that reaches the loss)
  lab_command("iptables -A FORWARD -m comment --comment loss-seen && iptables -A FORWARD -m statistic --mode random "
              "--probability " + std::to_string(p) + " -m comment --comment loss-dropped -j DROP");
}

std::pair<long, long> NetLab::lost() const {
  if (!entered) throw std::logic_error("NetLab: a network command outside a namespace of the test's own");
  const auto [out, status] = run_command("iptables -L FORWARD -v -x -n 2>&1");
  if (status != 0) throw std::runtime_error("NetLab: iptables -L failed: " + out);
  auto packets = [&out = out](const std::string& tag) {
    const size_t at = out.find("/* " + tag + " */");
    if (at == std::string::npos) return -1L;
    const size_t line = out.rfind('\n', at) + 1;  // (npos + 1 = 0 on the first line)
    return std::stol(out.substr(out.find_first_not_of(' ', line)));
  };
  return {packets("loss-seen"), packets("loss-dropped")};
}

void NetLab::isolate(const std::string& name) { lab_command(isolation_rules("-I", address(name))); }

void NetLab::rejoin(const std::string& name) { lab_command(isolation_rules("-D", address(name))); }

namespace {

std::string reply_rules(const char* action, const std::string& x, const std::string& y, uint16_t port) {
  const std::string from = "iptables " + std::string(action) + " FORWARD -p tcp -s " + y + " -d " + x + " --sport " +
                           std::to_string(port);
  // (an IPv4 TCP segment with timestamps and no data is 52 bytes)
  return from + " -m length --length 65:65535 -j DROP && " + from + " --tcp-flags FIN FIN -j DROP && " + from +
         " --tcp-flags RST RST -j DROP";
}

}  // namespace

void NetLab::cut_replies(const std::string& a, const std::string& b, uint16_t port) {
  lab_command(reply_rules("-I", address(a), address(b), port));
}

void NetLab::heal_replies(const std::string& a, const std::string& b, uint16_t port) {
  lab_command(reply_rules("-D", address(a), address(b), port));
}

std::vector<std::string> NetLab::tcp_peers(const std::string& name, const std::string& peer) const {
  if (!entered) throw std::logic_error("NetLab: a network command outside a namespace of the test's own");
  const auto [out, status] = run_command("nsenter --net=/proc/" + std::to_string(host(name).holder) +
                                         "/ns/net ss -tanH dst " + peer + " 2>&1");
  if (status != 0) throw std::runtime_error("NetLab: ss failed: " + out);
  // Each line: state, queues, local address:port, peer address:port.
  std::vector<std::string> peers;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    std::istringstream fields(line);
    std::string state, recv_q, send_q, local, remote;
    if (fields >> state >> recv_q >> send_q >> local >> remote) peers.push_back(remote);
  }
  return peers;
}

void NetLab::sysctl(const std::string& name, const std::string& setting, const std::string& value) {
  lab_command("nsenter --net=/proc/" + std::to_string(host(name).holder) + "/ns/net sysctl -q -w " + setting + "=" +
              value);
}

void NetLab::delay(const std::string& name, std::chrono::microseconds delay) {
  const Host& h = host(name);
  const std::string i = std::to_string(h.index), ns = "/proc/" + std::to_string(h.holder) + "/ns/net";
  //   h<i> ── veth ── net0 ═ PacketDelay ═ wire0 ── veth ── in0 10.77.i.2  (the host's stack)
  lab_command("nsenter --net=" + ns + " sh -c 'ip link add in0 type veth peer name wire0 && ip addr del 10.77." + i +
              ".2/24 dev net0 && ip addr add 10.77." + i + ".2/24 dev in0 && ip link set wire0 up && ip link set in0 up" +
              " && ip link set net0 promisc on && ip link set wire0 promisc on && ip route replace default via 10.77." +
              i + ".1 dev in0'");
  wait_until_up({"nsenter --net=" + ns + " ip link show in0", "nsenter --net=" + ns + " ip link show wire0"});
  delays_.push_back(std::make_unique<PacketDelay>(ns, "net0", "wire0", delay));
}

void NetLab::shape(const std::string& name, const std::string& rate) {
  const std::string qdisc = " root tbf rate " + rate + " burst 256kb latency 50ms";
  lab_command("tc qdisc replace dev h" + std::to_string(host(name).index) + qdisc);
  lab_command("nsenter --net=/proc/" + std::to_string(host(name).holder) + "/ns/net tc qdisc replace dev net0" + qdisc);
}

}  // namespace disagg::test
