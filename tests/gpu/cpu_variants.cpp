// CTest runs parts of test_gpu again under each CPU variant (tests/CMakeLists.txt):
// DISAGG_CPU_ISA forces one of our kernel sets, OPENBLAS_CORETYPE one of
// OpenBLAS's kernel families. A variant this CPU cannot run skips every test
// with a message instead of failing.
//
// The engine calls no BLAS, so OPENBLAS_CORETYPE cannot change its results;
// the variants keep it that way: OpenBLAS's AVX-512 builds (SkylakeX,
// Cooperlake) sum small products in another order than its AVX2 ones, which
// made batched and single decode differ on AVX-512 machines when the engine
// used sgemm.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "gpu/cpu/cpu_kernels.h"

namespace {

// The features OpenBLAS needs for a core type it is told to use.
bool cpu_runs_coretype(const std::string& coretype) {
  __builtin_cpu_init();
  if (coretype == "Sandybridge") return __builtin_cpu_supports("avx");
  if (coretype == "Haswell" || coretype == "Zen") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool skylakex = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512cd");
  if (coretype == "SkylakeX") return skylakex;
  if (coretype == "Cooperlake") return skylakex && __builtin_cpu_supports("avx512bf16");
  return true;  // a type this list does not know: let OpenBLAS decide
}

class CpuVariant : public ::testing::Environment {
 public:
  void SetUp() override {
    if (const char* isa = std::getenv("DISAGG_CPU_ISA"); isa && *isa) {
      bool runs = false;
      for (const auto& s : disagg::gpu::cpu::supported_isas()) runs = runs || s == isa;
      if (!runs) GTEST_SKIP() << "DISAGG_CPU_ISA=" << isa << ": this CPU cannot run these kernels; skipped";
    }
    if (const char* core = std::getenv("OPENBLAS_CORETYPE"); core && *core && !cpu_runs_coretype(core))
      GTEST_SKIP() << "OPENBLAS_CORETYPE=" << core << ": this CPU cannot run it; skipped";
  }
};

const auto* const registered = ::testing::AddGlobalTestEnvironment(new CpuVariant);

}  // namespace
