// disagg-client refuses options the router would refuse anyway, before it
// connects: a deadline beyond the protocol's maximum (kMaxDeadlineMs).
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>

#include <string>

#include "cluster/child_process.h"
#include "cluster/cluster_fixture.h"
#include "cluster/raw_peer.h"
#include "messages/request.h"

namespace disagg::test {
namespace {

int run_client_with_deadline(const std::string& deadline, std::string& err) {
  std::string out;
  // Nothing listens on port 1: only a usage error can end it before connecting.
  return run_to_completion({client_binary(), "--router", "127.0.0.1:1", "--prompt-tokens", "1 403",
                            "--max-new-tokens", "1", "--deadline-ms", deadline},
                           out, err, std::chrono::seconds(20));
}

TEST(ClientOptions, DeadlineBeyondTheMaximumIsAUsageError) {
  std::string err;
  EXPECT_EQ(run_client_with_deadline(std::to_string(kMaxDeadlineMs + 1), err), 2) << err;
  EXPECT_NE(err.find("--deadline-ms expects an integer in [1, " + std::to_string(kMaxDeadlineMs) + "]"),
            std::string::npos)
      << err;
  // The maximum itself passes parsing (and fails later: no router there).
  err.clear();
  EXPECT_NE(run_client_with_deadline(std::to_string(kMaxDeadlineMs), err), 2) << err;
  EXPECT_NE(err.find("cannot reach the router"), std::string::npos) << err;
}

// A port that accepts connections (the kernel's backlog) and never speaks:
// the client waits for the router's handshake no longer than its connect
// timeout, then exits 3 naming the wait, rather than hanging on the
// middleman.
TEST(ClientOptions, APortThatNeverHandshakesEndsAtTheConnectTimeout) {
  uint16_t port = 0;
  const int listener = listen_on_loopback(port);
  ASSERT_GE(listener, 0);
  const std::string where = "127.0.0.1:" + std::to_string(port);
  std::string out, err;
  const auto start = std::chrono::steady_clock::now();
  const int code = run_to_completion({client_binary(), "--router", where, "--status", "--connect-timeout-ms", "1000"},
                                     out, err, std::chrono::seconds(20));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::close(listener);
  EXPECT_EQ(code, 3) << err;
  EXPECT_NE(err.find("no CAF handshake from " + where + " within"), std::string::npos) << err;
  EXPECT_GE(seconds, 1.0);
  EXPECT_LT(seconds, 5.0) << "the handshake wait outlived the connect timeout";
}

}  // namespace
}  // namespace disagg::test
