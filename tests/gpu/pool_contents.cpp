#include "gpu/pool_contents.h"

#include "gpu/backend.h"

namespace disagg::test {

std::vector<float> gather_kv(gpu::KvPool& pool, const std::vector<int>& blocks, int n_positions) {
  const int n_layers = int(pool.model().n_layers);
  const size_t kv_dim = pool.model().kv_dim();
  std::vector<float> all(pool.floats());
  pool.backend().download(all.data(), pool.data(), all.size() * sizeof(float));
  std::vector<float> out(size_t(n_layers) * 2 * n_positions * kv_dim);
  const size_t bs = size_t(pool.block_size());
  for (int l = 0; l < n_layers; ++l)
    for (int kv = 0; kv < 2; ++kv)
      for (int p = 0; p < n_positions; ++p) {
        const size_t pb = size_t(p) % bs;
        const size_t block = size_t(blocks[size_t(p) / bs]);
        const size_t region = ((size_t(l) * 2 + kv) * size_t(pool.num_blocks()) + block) * bs * kv_dim;
        const size_t dst = ((size_t(l) * 2 + kv) * n_positions + p) * kv_dim;
        for (size_t e = 0; e < kv_dim; ++e)
          out[dst + e] = kv == 0 ? all[region + ((pb / 16) * kv_dim + e) * 16 + pb % 16] : all[region + pb * kv_dim + e];
      }
  return out;
}

}  // namespace disagg::test
