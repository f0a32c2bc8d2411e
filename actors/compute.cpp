#include "actors/compute.h"

#include <atomic>
#include <chrono>
#include <type_traits>

#include "actors/timing.h"
#include "caf/all.hpp"
#include "gpu/kv_format.h"
#include "gpu/sampling.h"

namespace disagg {

// Token ids and block lists travel as std::vector<int32_t> and are handed to
// gpu/ (std::vector<int>) without copies.
static_assert(std::is_same<int32_t, int>::value, "int32_t must be int");

namespace {

gpu::SamplingParams to_gpu(const Sampling& s) { return {s.temperature, s.top_p, s.seed}; }

// prefill_counts(): process-wide, so every compute actor adds to the same counts.
std::atomic<int64_t> prefills_computed{0};
std::atomic<int64_t> prefills_skipped_cancelled{0};
std::atomic<int64_t> prefills_skipped_expired{0};

// Declared pool after engine: the pool (which refers to the engine) goes first.
struct ComputeState {
  std::unique_ptr<gpu::Engine> engine;
  std::unique_ptr<gpu::KvPool> pool;
};

PrefillResult run_prefill(ComputeState& st, PrefillWork& work) {
  PrefillResult r;
  r.id = work.id;
  const auto start = Clock::now();
  // Skipped, not computed, when the request has ended while this waited.
  if (work.cancelled && work.cancelled->load()) {
    ++prefills_skipped_cancelled;
    r.code = ErrorCode::cancelled;
    r.message = "cancelled before its prefill ran";
    return r;
  }
  if (work.deadline_ns > 0 && start.time_since_epoch() >= std::chrono::nanoseconds(work.deadline_ns)) {
    ++prefills_skipped_expired;
    r.code = ErrorCode::timeout;
    r.message = "deadline passed before its prefill ran";
    return r;
  }
  ++prefills_computed;
  try {
    gpu::PrefillOutput out = st.engine->prefill(work.tokens);
    r.first_token = gpu::sample_token(out.logits.data(), st.engine->config().vocab_size,
                                      to_gpu(work.sampling), 0);
    r.kv = gpu::serialize_kv(st.engine->fingerprint(), out.shape, out.kv.data());
  } catch (const std::exception& e) {
    r.code = ErrorCode::internal;
    r.message = std::string("prefill: ") + e.what();
  }
  r.compute_us = micros_since(start);
  return r;
}

AdmitResult run_admit(ComputeState& st, KvAdmit& admit) {
  AdmitResult r;
  r.id = admit.transfer.id;
  const auto& bytes = admit.transfer.bytes;
  try {
    if (!st.pool) throw gpu::Error("admit: this compute actor has no KV pool");
    gpu::KvView view = gpu::parse_kv(bytes.data(), bytes.size(), st.engine->kv_expectation());
    const auto positions = int64_t(view.header.shape.n_positions);
    if (positions != admit.transfer.prompt_len) {
      r.code = ErrorCode::incompatible_kv;
      r.message = "KV holds " + std::to_string(positions) + " positions, the prompt has " +
                  std::to_string(admit.transfer.prompt_len);
      return r;
    }
    if (int64_t(admit.blocks.size()) * st.pool->block_size() < positions)
      throw gpu::Error("admit: " + std::to_string(admit.blocks.size()) + " blocks cannot hold " +
                       std::to_string(positions) + " positions");
    st.pool->write(admit.blocks, view);
  } catch (const gpu::KvFormatError& e) {
    r.code = ErrorCode::incompatible_kv;
    r.message = e.what();
  } catch (const std::exception& e) {
    r.code = ErrorCode::internal;
    r.message = std::string("admit: ") + e.what();
  }
  return r;
}

StepResult run_step(ComputeState& st, DecodeStep& step) {
  StepResult r;
  const auto start = Clock::now();
  try {
    if (!st.pool) throw gpu::Error("step: this compute actor has no KV pool");
    std::vector<gpu::DecodeSlot> slots;
    slots.reserve(step.slots.size());
    for (const auto& s : step.slots) slots.push_back(gpu::DecodeSlot{s.token, s.pos, &s.blocks});
    const std::vector<float> logits = st.engine->decode_step(*st.pool, slots);
    const int vocab = st.engine->config().vocab_size;
    r.next_tokens.reserve(slots.size());
    for (size_t i = 0; i < step.slots.size(); ++i)
      r.next_tokens.push_back(gpu::sample_token(logits.data() + i * size_t(vocab), vocab,
                                                to_gpu(step.slots[i].sampling),
                                                uint64_t(step.slots[i].step)));
  } catch (const std::exception& e) {
    r.code = ErrorCode::internal;
    r.message = std::string("decode step: ") + e.what();
    r.next_tokens.clear();
  }
  r.compute_us = micros_since(start);
  return r;
}

compute_actor::behavior_type compute_behavior(compute_actor::pointer, std::shared_ptr<ComputeState> st) {
  return {
      [st](info_atom) { return model_info(*st->engine); },
      [st](prefill_atom, PrefillWork& work) { return run_prefill(*st, work); },
      [st](admit_atom, KvAdmit& admit) { return run_admit(*st, admit); },
      [st](step_atom, DecodeStep& step) { return run_step(*st, step); },
  };
}

}  // namespace

PrefillCounts prefill_counts() {
  PrefillCounts c;
  c.computed = prefills_computed.load();
  c.skipped_cancelled = prefills_skipped_cancelled.load();
  c.skipped_expired = prefills_skipped_expired.load();
  return c;
}

namespace {

ModelInfo model_info_of(uint64_t fingerprint, const gpu::ModelConfig& c) {
  ModelInfo info;
  info.fingerprint = fingerprint;
  info.vocab_size = c.vocab_size;
  info.seq_len = c.seq_len;
  info.n_layers = c.n_layers;
  info.n_kv_heads = c.n_kv_heads;
  info.head_dim = c.head_size();
  return info;
}

}  // namespace

ModelInfo model_info(const gpu::Checkpoint& checkpoint) {
  return model_info_of(checkpoint.fingerprint(), checkpoint.config());
}

ModelInfo model_info(const gpu::Engine& engine) {
  ModelInfo info = model_info_of(engine.fingerprint(), engine.config());
  info.backend = engine.backend_name();
  return info;
}

compute_actor spawn_compute(caf::actor_system& system, const ComputeSpec& spec) {
  if (!spec.checkpoint) throw gpu::Error("spawn_compute: no checkpoint");
  auto st = std::make_shared<ComputeState>();
  st->engine = std::make_unique<gpu::Engine>(spec.checkpoint, spec.engine);
  if (spec.pool_blocks > 0)
    st->pool = std::make_unique<gpu::KvPool>(*st->engine, spec.pool_block_size, spec.pool_blocks);
  return system.spawn<caf::detached>(compute_behavior, std::move(st));
}

}  // namespace disagg
