#include "engine/memory.h"

#include <malloc.h>

namespace disagg::gpu {

bool fix_heap_thresholds() {
  return mallopt(M_MMAP_THRESHOLD, int(kMmapThreshold)) == 1 && mallopt(M_TRIM_THRESHOLD, int(kKeptFreeHeap)) == 1 &&
         mallopt(M_TOP_PAD, int(kHeapGrowth)) == 1;
}

}  // namespace disagg::gpu
