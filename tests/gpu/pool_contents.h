// What a KV pool holds, read back for tests.
#pragma once
#include <vector>

#include "engine/engine.h"

namespace disagg::test {

// Positions [0, n_positions) of a sequence's blocks, gathered into the wire
// order [layer][K then V][position][kv_dim] of a prefill's KV. The pool's
// layout is written out here on its own (a plane per layer and K or V, blocks
// in order; K tiled by 16 positions, V rows), so the tests check
// gpu/kv_layout.h rather than repeat it.
std::vector<float> gather_kv(gpu::KvPool& pool, const std::vector<int>& blocks, int n_positions);

}  // namespace disagg::test
