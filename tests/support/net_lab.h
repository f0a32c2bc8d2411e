// Hosts on a network of the test's own, for tests of a cluster whose nodes
// are not on one loopback (issue 41).
//
// Safety first: enter_private_namespace() moves the test process into a
// fresh network namespace (unshare(CLONE_NEWNET)) and checks that it is not
// the one it was in; only then does a NetLab run `ip`, `tc` or `iptables`,
// always in that namespace or in hosts made inside it, so nothing reaches or
// changes the machine's own network. A machine that refuses (no
// CAP_NET_ADMIN) gets the reason, and the tests skip with it.
//
//   the lab (the test process's namespace: the router between the hosts,
//   where the test's own client runs, and where links are cut and shaped)
//     h1 10.77.1.1 ── veth ── net0 10.77.1.2  host 1 (a namespace of its own)
//     h2 10.77.2.1 ── veth ── net0 10.77.2.2  host 2
//     ...
//
// A host's namespaces (its network, and a mount namespace whose /sys shows
// that network's interfaces, where UCX looks for them) are held by a child
// process that does nothing (killed with the test, PR_SET_PDEATHSIG): when
// the test ends, however it ends, the hosts, their links and every rule go
// with the namespaces; nothing is left.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace disagg::test {

class PacketDelay;

class NetLab {
 public:
  // "" once this process is in a network namespace of its own, else why
  // not (unshare refused, or the namespace did not change).
  static std::string enter_private_namespace();

  // One host per name, host i (from 1) at 10.77.i.2 behind the lab's
  // 10.77.i.1; the lab forwards between them. Requires
  // enter_private_namespace() to have succeeded (throws otherwise).
  explicit NetLab(const std::vector<std::string>& hosts);
  ~NetLab();
  NetLab(const NetLab&) = delete;
  NetLab& operator=(const NetLab&) = delete;

  std::string address(const std::string& host) const;
  // The lab's own address on the link to `host` (10.77.i.1): what the test
  // process listens on to be reachable from every host.
  std::string gateway(const std::string& host) const;
  // argv to put before a command to run it on `host` (nsenter into its namespaces).
  std::vector<std::string> run_on(const std::string& host) const;
  // The same into its network alone: /sys stays the lab's (the machine's),
  // as `nsenter --net` leaves a process.
  std::vector<std::string> run_on_network_only(const std::string& host) const;
  // The process holding the namespaces of `host` (what `bench_kv_transfer
  // --peer-pid` enters).
  pid_t holder(const std::string& host) const;
  // The namespace of process `pid` ("net:[inode]").
  static std::string namespace_of(pid_t pid);

  // Drops every packet between hosts a and b, both ways (no RST, no FIN:
  // a pulled cable), until heal(a, b).
  void cut(const std::string& a, const std::string& b);
  void heal(const std::string& a, const std::string& b);
  // Every TCP connection between a and b's `port` goes silent (both ways,
  // no RST, no FIN) once it has carried `bytes` bytes: a link cut in the
  // middle of a handshake. Connections made before this count from their
  // start, so call it before the ones it is for. Until heal_connections.
  void cut_connections_after(const std::string& a, const std::string& b, uint16_t port, int64_t bytes);
  void heal_connections(const std::string& a, const std::string& b, uint16_t port, int64_t bytes);
  // What b's `port` sends to a is dropped, but for bare acknowledgements
  // (no data, no FIN, no RST): a's bytes arrive and are acknowledged, and
  // nothing else ever reaches a. Until heal_replies.
  void cut_replies(const std::string& a, const std::string& b, uint16_t port);
  void heal_replies(const std::string& a, const std::string& b, uint16_t port);
  // The other ends ("address:port") of the TCP sockets in the network of
  // `host` whose peer is the address `peer`, in any state (ss's list).
  std::vector<std::string> tcp_peers(const std::string& host, const std::string& peer) const;
  // Sets the kernel setting `name` (sysctl's, e.g. net.ipv4.tcp_orphan_retries)
  // to `value` in the network of `host` alone.
  void sysctl(const std::string& host, const std::string& name, const std::string& value);
  // cut(a, b), but for TCP to and from b's `port`.
  void cut_but_port(const std::string& a, const std::string& b, uint16_t port);
  // Drops every packet to and from `host`: the other hosts' and the lab's
  // (where the test's own client runs), until rejoin(host).
  void isolate(const std::string& host);
  void rejoin(const std::string& host);
  // Drops each packet the lab forwards between hosts with probability p
  // (iptables' statistic match), from now on; lost() counts them: the
  // packets that met the rule, and those it dropped.
  void lose(double p);
  std::pair<long, long> lost() const;
  // Limits the link of `host` to `rate` (tc's units: "1gbit") both ways.
  void shape(const std::string& host, const std::string& rate);
  // Puts `delay` each way on the link of `host` (this kernel has no netem),
  // for every packet, whatever connection it belongs to: the host's address
  // moves to an inner interface whose frames cross a PacketDelay to net0.
  // Call it before the host's processes start (it moves their address), at
  // most once per host.
  void delay(const std::string& host, std::chrono::microseconds delay);

 private:
  struct Host {
    std::string name;
    int index;     // from 1
    pid_t holder;  // its namespace's holder
  };
  const Host& host(const std::string& name) const;
  std::vector<Host> hosts_;
  std::vector<std::unique_ptr<PacketDelay>> delays_;  // (before hosts_ goes: their threads read its interfaces)
};

}  // namespace disagg::test
