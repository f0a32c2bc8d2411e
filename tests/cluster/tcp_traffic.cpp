#include "cluster/tcp_traffic.h"

#include <regex>
#include <sstream>
#include <string>

#include "cluster/child_process.h"

namespace disagg::test {

namespace {

uint16_t port_of(const std::string& address) {
  const auto colon = address.rfind(':');
  return colon == std::string::npos ? 0 : uint16_t(std::stoul(address.substr(colon + 1)));
}

uint64_t counter(const std::string& info, const std::string& name) {
  std::smatch m;
  if (std::regex_search(info, m, std::regex(name + ":(\\d+)"))) return std::stoull(m[1]);
  return 0;
}

}  // namespace

std::optional<std::vector<TcpConnection>> established_connections() {
  std::string out, err;
  if (run_to_completion({"/bin/sh", "-c", "exec ss -tinpH state established"}, out, err,
                        std::chrono::seconds(10)) != 0)
    return std::nullopt;
  // Each connection is a line "Recv-Q Send-Q local peer users:((...,pid=N,...))"
  // followed by an indented line of tcp_info counters.
  std::vector<TcpConnection> connections;
  std::istringstream lines(out);
  std::string line;
  std::optional<TcpConnection> current;
  const std::regex pid_pattern("pid=(\\d+)");
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    if (line[0] != ' ' && line[0] != '\t') {
      if (current) connections.push_back(*current);
      current.reset();
      std::istringstream fields(line);
      std::string recv_q, send_q, local, peer;
      std::smatch m;
      if (!(fields >> recv_q >> send_q >> local >> peer) || !std::regex_search(line, m, pid_pattern)) continue;
      current = TcpConnection{pid_t(std::stol(m[1])), port_of(local), port_of(peer), 0, 0};
    } else if (current) {
      current->bytes_sent = counter(line, "bytes_acked");
      current->bytes_received = counter(line, "bytes_received");
    }
  }
  if (current) connections.push_back(*current);
  return connections;
}

}  // namespace disagg::test
