// The process's heap thresholds (engine/memory.h): blocks under the mmap
// threshold come from the heap, and its freed top stays with the process
// for the next requests instead of going back to the kernel.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "engine/memory.h"

namespace disagg::gpu {
namespace {

TEST(Heap, FreedMemoryStaysWithTheProcess) {
  ASSERT_TRUE(fix_heap_thresholds());
  // 32 blocks of 1 MiB: over glibc's default threshold (128 KiB, so each
  // would be mmapped alone), under kMmapThreshold.
  constexpr size_t kBlock = size_t(1) << 20, kBlocks = 32;
  const auto top = [] { return reinterpret_cast<uintptr_t>(sbrk(0)); };
  const uintptr_t before = top();
  std::vector<void*> blocks;
  for (size_t i = 0; i < kBlocks; ++i) {
    blocks.push_back(std::malloc(kBlock));
    ASSERT_NE(blocks.back(), nullptr);
    std::memset(blocks.back(), 1, kBlock);
  }
  const uintptr_t grown = top();
  EXPECT_GE(grown, before + kBlocks * kBlock * 3 / 4) << "the blocks came from the heap";
  for (void* b : blocks) std::free(b);
  EXPECT_EQ(top(), grown) << "the heap's freed top was kept";
}

}  // namespace
}  // namespace disagg::gpu
