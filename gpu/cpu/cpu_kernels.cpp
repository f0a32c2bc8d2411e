// Weight packing, scratch sizes and the choice of the kernels' instruction set.
#include "gpu/cpu/cpu_kernels.h"

#include <cstdlib>
#include <cstring>
#include <string>

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

namespace {

// A tile's layout of `type` (cpu_kernels.h): the file block's byte ranges
// that become the body's words, in order, and the offsets of its halves
// that become the tail.
struct TileSpec {
  int ranges[3][2];  // [begin, end) in the block; {0, 0}: none
  int halves[2];     // -1: none
  bool flip;         // bytes XOR 0x80 (Q8_0)
};

TileSpec tile_spec(WeightType type) {
  switch (type) {
    case WeightType::q8_0: return {{{2, 34}, {0, 0}, {0, 0}}, {0, -1}, true};
    case WeightType::q4_0: return {{{2, 18}, {0, 0}, {0, 0}}, {0, -1}, false};
    case WeightType::q4_k: return {{{16, 144}, {4, 16}, {0, 0}}, {0, 2}, false};
    case WeightType::q5_k: return {{{48, 176}, {16, 48}, {4, 16}}, {0, 2}, false};
    case WeightType::q6_k: return {{{0, 128}, {128, 192}, {192, 208}}, {208, -1}, false};
    default: throw Error(std::string("tile_quantized: ") + to_string(type) + " is not quantized");
  }
}

}  // namespace

size_t tile_body_bytes(WeightType type) {
  const TileSpec spec = tile_spec(type);
  size_t words = 0;
  for (const auto& range : spec.ranges) words += size_t(range[1] - range[0]) / 4;
  return words * 4 * kTileCols;
}

size_t tile_tail_bytes(WeightType type) { return kTileCols * block_bytes(type) - tile_body_bytes(type); }

size_t tiled_bytes(WeightType type, int n, int k) {
  return size_t((n + kTileCols - 1) / kTileCols) * size_t(k / block_values(type)) * kTileCols * block_bytes(type);
}

void tile_quantized(WeightType type, const uint8_t* rows, uint8_t* tiled, int n, int k, int tile_begin,
                    int tile_end) {
  const TileSpec spec = tile_spec(type);
  const int blocks = k / block_values(type);
  const size_t bytes = block_bytes(type), row = row_bytes(type, k), body = tile_body_bytes(type),
               tail = tile_tail_bytes(type), tile_bytes = size_t(blocks) * (body + tail);
  const uint8_t pad = spec.flip ? 0x80 : 0x00;  // q = 0 (Q8_0); under zero scales elsewhere
  for (int t = tile_begin; t < tile_end; ++t)
    for (int b = 0; b < blocks; ++b) {
      uint8_t* out = tiled + size_t(t) * tile_bytes + size_t(b) * body;
      uint8_t* tails = tiled + size_t(t) * tile_bytes + size_t(blocks) * body + size_t(b) * tail;
      for (int c = 0; c < kTileCols; ++c) {
        const int col = t * kTileCols + c;
        const uint8_t* block = col < n ? rows + size_t(col) * row + size_t(b) * bytes : nullptr;
        int word = 0;
        for (const auto& range : spec.ranges)
          for (int at = range[0]; at < range[1]; at += 4, ++word)
            for (int i = 0; i < 4; ++i)
              out[64 * word + 4 * c + i] = block ? uint8_t(block[at + i] ^ (spec.flip ? 0x80 : 0x00)) : pad;
        for (int h = 0; h < 2 && spec.halves[h] >= 0; ++h) {
          const uint8_t zero[2] = {0, 0};
          std::memcpy(tails + 32 * h + 2 * c, block ? block + spec.halves[h] : zero, 2);
        }
      }
    }
}

void untile_block(WeightType type, const uint8_t* tile, int blocks, int b, int c, uint8_t* block) {
  const TileSpec spec = tile_spec(type);
  const size_t body = tile_body_bytes(type), tail = tile_tail_bytes(type);
  const uint8_t* in = tile + size_t(b) * body;
  const uint8_t* tails = tile + size_t(blocks) * body + size_t(b) * tail;
  int word = 0;
  for (const auto& range : spec.ranges)
    for (int at = range[0]; at < range[1]; at += 4, ++word)
      for (int i = 0; i < 4; ++i) block[at + i] = uint8_t(in[64 * word + 4 * c + i] ^ (spec.flip ? 0x80 : 0x00));
  for (int h = 0; h < 2 && spec.halves[h] >= 0; ++h) std::memcpy(block + spec.halves[h], tails + 32 * h + 2 * c, 2);
}

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
