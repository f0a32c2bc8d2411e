// The small random model the engine-level tests share: 2 layers, 4 query
// heads on 2 KV heads (grouped-query attention), dim 64, a vocabulary of
// 300 and a classifier of its own; any context length.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "model/checkpoint.h"

namespace disagg::test {

// Written once per call to the system's temp folder as `file_name`, with
// weights drawn from `seed`.
std::shared_ptr<const gpu::Checkpoint> small_random_model(int seq_len, uint64_t seed, const std::string& file_name);

}  // namespace disagg::test
