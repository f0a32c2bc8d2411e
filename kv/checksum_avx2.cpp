// XXH3 inlined from the system's xxhash.h into this file, which CMake compiles
// with -mavx2 so that xxHash selects its AVX2 code path. Called only when the
// CPU has AVX2 (checksum.cpp).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstddef>
#include <cstdint>

#ifndef __AVX2__
#error "checksum_avx2.cpp must be compiled with -mavx2"
#endif

namespace disagg::kv::detail {

uint64_t xxh3_avx2(const void* data, size_t bytes, uint64_t seed) { return XXH3_64bits_withSeed(data, bytes, seed); }

}  // namespace disagg::kv::detail
