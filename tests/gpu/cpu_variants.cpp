// CTest runs parts of test_gpu again under each of our CPU kernel sets
// (tests/CMakeLists.txt): DISAGG_CPU_ISA forces one. A set this CPU cannot run
// skips every test with a message (CTest reports the run as Skipped) instead
// of failing.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "gpu/cpu/cpu_kernels.h"

namespace {

class CpuVariant : public ::testing::Environment {
 public:
  void SetUp() override {
    if (const char* isa = std::getenv("DISAGG_CPU_ISA"); isa && *isa) {
      bool runs = false;
      for (const auto& s : disagg::gpu::cpu::supported_isas()) runs = runs || s == isa;
      if (!runs) GTEST_SKIP() << "DISAGG_CPU_ISA=" << isa << ": this CPU cannot run these kernels; skipped";
    }
  }
};

const auto* const registered = ::testing::AddGlobalTestEnvironment(new CpuVariant);

}  // namespace
