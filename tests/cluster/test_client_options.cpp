// disagg-client refuses options the router would refuse anyway, before it
// connects: a deadline beyond the protocol's maximum (kMaxDeadlineMs).
#include <gtest/gtest.h>

#include <string>

#include "cluster/child_process.h"
#include "cluster/cluster_fixture.h"
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

}  // namespace
}  // namespace disagg::test
