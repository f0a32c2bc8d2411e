// What the actor tests share: one actor_system per test, a local cluster on
// the shared stories260K model (CPU backend), the colocated reference
// (gpu::generate) and the check that every decode pool ends up empty.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <mutex>
#include <memory>
#include <string>
#include <vector>

#include "actors/client.h"
#include "actors/config.h"
#include "node/local_cluster.h"
#include "caf/actor_system.hpp"
#include "caf/send.hpp"
#include "engine/generate.h"

namespace disagg::test {

// A config for the shared model on the CPU backend with `prefill` + `decode` workers.
DisaggConfig shared_model_config(int prefill, int decode);

// gpu::generate on the shared model (one engine for the whole test binary).
gpu::GenerateResult colocated(const std::vector<int32_t>& prompt, int max_new_tokens,
                              const Sampling& sampling = {});

GenerateRequest make_request(std::vector<int32_t> prompt, int max_new_tokens,
                             const Sampling& sampling = {});

// Prompts of the shared model, as tok512 encodes them.
extern const std::vector<int32_t> kOnceUponATime;   // 5 tokens
extern const std::vector<int32_t> kTomHadARedBall;  // 29 tokens

// Bytes of the serialized KV of `positions` positions of the shared model.
size_t kv_bytes_for(int positions);
// Bytes of the streamed KV of a `prompt_len`-token prompt of the shared model
// (whole key tiles, engine/kv_stream.h).
size_t stream_bytes_for(int prompt_len, int block_size = 16);

// Token events of one request, as the client saw them. The callback holds
// the events, not the TokenLog: a test that ends early (a failed ASSERT)
// destroys its logs while its requests still stream, and the client's
// threads must not lock a destroyed mutex then (they did, and the actor
// system never stopped).
struct TokenLog {
 private:
  struct State {
    std::mutex mutex;
    std::vector<TokenEvent> events;
  };
  std::shared_ptr<State> state_ = std::make_shared<State>();

 public:
  std::mutex& mutex = state_->mutex;
  std::vector<TokenEvent>& events = state_->events;
  TokenLog() = default;
  TokenLog(const TokenLog&) = delete;
  TokenLog& operator=(const TokenLog&) = delete;
  TokenCallback callback() {
    return [state = state_](const TokenEvent& e) {
      std::lock_guard<std::mutex> lock(state->mutex);
      state->events.push_back(e);
    };
  }
};

// Ends the actors a test spawned, whatever its end (the system waits for them).
struct StopAll {
  std::vector<caf::actor> actors;
  template <class... Handles>
  explicit StopAll(const Handles&... handles) : actors{caf::actor_cast<caf::actor>(handles)...} {}
  ~StopAll() {
    for (auto& a : actors) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
  }
};

class ActorTest : public ::testing::Test {
 protected:
  void SetUp() override;
  // Checks that every decode pool is back to full capacity (unless a test
  // killed a worker), then stops the cluster and the actor system.
  void TearDown() override;

  // Starts a cluster with options.config (see shared_model_config) and a client.
  LocalCluster& start(LocalClusterOptions options);
  LocalCluster& start(int prefill, int decode);

  DisaggSystemConfig system_config_;
  std::unique_ptr<caf::actor_system> system_;
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<Client> client_;
  bool expect_pools_free_ = true;
};

}  // namespace disagg::test
