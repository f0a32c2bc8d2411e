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
  // (from the heap: below its top, where an mmapped block lies far above it;
  // the heap grew for them unless tests before this one left it room)
  for (void* b : blocks) EXPECT_LT(reinterpret_cast<uintptr_t>(b), grown) << "a block came from the heap";
  EXPECT_GE(grown, before);
  for (void* b : blocks) std::free(b);
  EXPECT_EQ(top(), grown) << "the heap's freed top was kept";
}

}  // namespace
}  // namespace disagg::gpu
