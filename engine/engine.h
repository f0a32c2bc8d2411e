// A model on a compute backend: the batched prefill of a prompt and the
// batched decode step over many sequences held in a paged KV pool.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/checkpoint.h"
#include "engine/kv_cache.h"
#include "engine/kv_format.h"

namespace disagg::gpu {

class Backend;

// "auto": CUDA when built with it and a GPU is present, else CPU; "cpu"; "cuda".
struct EngineOptions {
  std::string backend = "auto";
  // Where the packed weight matrices are kept (engine/weight_cache.h): ""
  // or "off": memory of this engine's own; "model": a cache file beside the
  // model; else a cache file in that folder (created if missing). Only a
  // host-memory backend (the CPU's) reads a cache.
  std::string weight_cache;
  // Where the weight cache's lines go (built, rebuilt and why, not usable);
  // unset: stderr.
  std::function<void(const std::string&)> log;
};

struct PrefillOutput {
  KvShape shape;             // n_positions == number of prompt tokens
  std::vector<float> kv;     // KvLayout::layer_kv_position, shape.floats() values
  std::vector<float> logits; // last position, vocab_size values
};

// What a prefill hands out while it runs (the KV transfer's per-layer hook):
// after layer `layer` of a chunk of prompt positions [first, first + count)
// has computed its K and V, on_layer_kv gets them as host memory, each
// count x kv_dim floats in position order (the wire layout's rows). Called in
// order of chunks, and of layers within a chunk; the pointers are valid only
// during the call. A throw aborts the prefill.
struct PrefillHooks {
  std::function<void(int layer, int first, int count, const float* k, const float* v)> on_layer_kv;
  // The same moment, as the request's whole cache (gpu/kv_layout.h: one block
  // of padded(n) positions, all layers) in host memory, of which layer
  // `layer`'s positions [first, first + count) are now final. The pointer
  // stays valid, and those positions unchanged, until this engine's next
  // prefill begins: the streamed KV transfer sends from it in place
  // (engine/kv_stream.h). (A backend with memory of its own copies each such
  // range to a host mirror first.)
  std::function<void(int layer, int first, int count, const float* cache)> on_layer_cache;
  // false: PrefillOutput::kv stays empty (the hooks took the KV).
  bool wire_kv = true;
  // Set: every computed position's logits, not only the last one's (prompt
  // log probabilities): after each piece of positions [first, first + count)
  // their count x vocab_size logits in host memory, valid during the call.
  // The same values as the last position's alone (rows are independent).
  std::function<void(int first, int count, const float* logits)> on_logits;
};

// A prompt's first positions whose KV a pool holds already (a prefill
// worker's prefix cache, engine/prefix_cache.h): prefill() copies them into the
// prompt's cache, hands them to on_layer_cache as if computed (layer by
// layer, positions [0, positions())), and computes only the rest. With the
// fixed arithmetic the result is prefill()'s without a prefix, bit for bit.
struct PrefillPrefix {
  const KvPool* pool = nullptr;  // none: no prefix
  std::vector<int> blocks;       // in position order; each holds pool->block_size() positions
  int positions() const { return pool ? int(blocks.size()) * pool->block_size() : 0; }
};

// One sequence in a decode step: feed `token` at position `pos`; its KV for
// positions [0, pos) already lives in `blocks` of the pool, and the step
// writes position `pos` there too.
struct DecodeSlot {
  int token = 0;
  int pos = 0;
  const std::vector<int>* blocks = nullptr;
};

// Prompt positions per forward pass of a prefill (prefill() and
// prefill_chunk() longer than this run in pieces of it): activations stay
// O(kPrefillRows * hidden) whatever the prompt length. Every row's arithmetic
// is independent of the rows computed with it (gpu/fixed_math.h), so the
// piece size changes no bit of the result.
inline constexpr int kPrefillRows = 512;

class Engine {
 public:
  Engine(std::shared_ptr<const Checkpoint> checkpoint, const EngineOptions& options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ModelConfig& config() const;
  uint64_t fingerprint() const;
  std::string backend_name() const;  // "cpu" or "cuda:<device name>"
  Backend& backend();
  KvShape kv_shape(int n_positions) const;
  // Whether `pool` is on this engine's backend, shaped for this model.
  bool holds(const KvPool& pool);
  KvExpectation kv_expectation() const;

  // All prompt tokens, in chunks of positions: matrix products over the
  // chunk's rows, causal attention over the cache so far. `hooks` (optional)
  // sees each layer's K and V as soon as they exist.
  // `prefix` (optional) holds the KV of positions [0, prefix.positions()),
  // fewer than the prompt's (the last one is computed for its logits);
  // on_layer_kv cannot be used with one.
  PrefillOutput prefill(const std::vector<int>& tokens, const PrefillHooks& hooks = {},
                        const PrefillPrefix& prefix = {});
  // Copies the last prefill's KV of positions [first_block * B, (first_block
  // + blocks.size()) * B) into `blocks` of `pool` (B its block size), which
  // must be whole blocks of that prompt: what a prefix cache keeps of it.
  void keep_prefill_blocks(KvPool& pool, const std::vector<int>& blocks, int first_block);

  // One token for each slot; returns logits, slots.size() x vocab_size.
  std::vector<float> decode_step(KvPool& pool, const std::vector<DecodeSlot>& slots);

  // Chunked prefill straight into a pool: positions [first_pos, first_pos +
  // tokens.size()) of one sequence whose earlier positions are in `blocks`
  // already. Their K and V go into the blocks; returns the last position's
  // logits (vocab_size floats). The same arithmetic as prefill() (rows of a
  // product do not depend on the others, attention sums per position in
  // fixed tiles), so a prompt in chunks of any size gives prefill()'s KV and
  // logits bit for bit: a colocated worker prefills this way between decode
  // steps.
  // `on_logits` as PrefillHooks::on_logits.
  std::vector<float> prefill_chunk(KvPool& pool, const std::vector<int>& tokens, int first_pos,
                                   const std::vector<int>& blocks,
                                   const std::function<void(int, int, const float*)>& on_logits = {});

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A KV pool on the engine's backend, shaped for its model.
KvPool kv_pool_for(Engine& engine, int block_size, int num_blocks);

}  // namespace disagg::gpu
