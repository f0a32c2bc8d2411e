// Weight packing, scratch sizes and the choice of the kernels' instruction set.
#include "gpu/cpu/cpu_kernels.h"

#include <cstdlib>

#include "gpu/error.h"

namespace disagg::gpu::cpu {

size_t packed_floats(int n, int k) { return size_t((n + kPanel - 1) / kPanel) * kPanel * size_t(k); }

namespace {

// W[n][k] in panels of kPanel columns (cpu_kernels.h), padded with zeros.
template <class T>
void pack_panels(const T* w, T* packed, int n, int k) {
  const int panels = (n + kPanel - 1) / kPanel;
  for (int p = 0; p < panels; ++p) {
    T* dst = packed + size_t(p) * kPanel * k;
    for (int kk = 0; kk < k; ++kk)
      for (int c = 0; c < kPanel; ++c) {
        const int row = p * kPanel + c;
        dst[size_t(kk) * kPanel + c] = row < n ? w[size_t(row) * k + kk] : T(0);
      }
  }
}

}  // namespace

void pack_matrix(const float* w, float* packed, int n, int k) { pack_panels(w, packed, n, k); }
void pack_matrix16(const uint16_t* w, uint16_t* packed, int n, int k) { pack_panels(w, packed, n, k); }

size_t attention_scratch_floats(int rows, int n_heads, int n_kv_heads, int head_size) {
  const size_t group = size_t(n_heads / n_kv_heads);
  const size_t head_floats = size_t((head_size + 15) / 16) * 16;
  return size_t(rows) * group * (head_floats + 2);
}

namespace {

bool cpu_runs(const std::string& isa) {
  if (isa == "generic") return true;
  __builtin_cpu_init();
  if (isa == "avx2")
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == "avx512")
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return false;
}

}  // namespace

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (const char* isa : {"generic", "avx2", "avx512"})
    if (cpu_runs(isa)) out.emplace_back(isa);
  return out;
}

const KernelTable& kernels_for(const std::string& requested) {
  std::string isa = requested;
  if (isa.empty() || isa == "auto") {
    const char* env = std::getenv("DISAGG_CPU_ISA");
    isa = env && *env ? env : supported_isas().back();
  }
  if (isa != "generic" && isa != "avx2" && isa != "avx512")
    throw Error("unknown CPU kernel set \"" + isa + "\" (expected generic, avx2 or avx512)");
  if (!cpu_runs(isa)) throw Error("this CPU cannot run the " + isa + " kernels");
  if (isa == "avx512") return avx512_kernels();
  if (isa == "avx2") return avx2_kernels();
  return generic_kernels();
}

}  // namespace disagg::gpu::cpu
