// The process's heap, set once at start: what a serving process needs from
// glibc's allocator that its defaults do not give.
//
// By default glibc moves its threshold for serving a block from mmap
// instead of the heap up to the size of the largest mmapped block freed so
// far, and returns the heap's free top to the kernel past twice that: so
// how often memory is handed back and faulted in again depends on what
// the process freed before (a tokenizer's load, a grammar compiled and
// dropped). Measured (bench_grammar, Llama 3 vocabulary): the same masks
// took 1.6-2x as long after an unrelated change to what a vocabulary frees
// at its construction, five times the page faults. Fixed thresholds make it
// one behaviour: blocks under kMmapThreshold from the heap, and up to
// kKeptFreeHeap of its free top kept for the next requests.
#pragma once
#include <cstddef>

namespace disagg::gpu {

constexpr size_t kMmapThreshold = size_t(4) << 20;
constexpr size_t kKeptFreeHeap = size_t(256) << 20;
constexpr size_t kHeapGrowth = size_t(16) << 20;  // the heap grows by at least this much at a time

// Sets the thresholds above (mallopt). Call first thing in main, before
// threads; false when the allocator refused one of them.
bool fix_heap_thresholds();

}  // namespace disagg::gpu
