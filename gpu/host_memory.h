// Host memory advice shared by the CPU backend's allocations and the
// engine's output buffers.
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>

namespace disagg::gpu {

constexpr size_t kHugePage = size_t(2) << 20;  // x86-64 transparent huge page

// Asks for transparent huge pages for the whole 2 MiB pages inside
// [p, p + bytes): a large buffer then faults in 512x fewer times when first
// touched (each fault costs microseconds in a VM) and takes fewer TLB misses.
// Advice only: where the kernel declines, nothing changes.
inline void advise_huge_pages(void* p, size_t bytes) {
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

}  // namespace disagg::gpu
