#include "gpu/small_model.h"

#include <filesystem>

#include "model/model_writer.h"

namespace disagg::test {

std::shared_ptr<const gpu::Checkpoint> small_random_model(int seq_len, uint64_t seed, const std::string& file_name) {
  gpu::ModelConfig c;
  c.dim = 64;
  c.hidden_dim = 160;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.vocab_size = 300;
  c.seq_len = seq_len;
  c.shared_classifier = false;
  const auto path = std::filesystem::temp_directory_path() / file_name;
  gpu::write_random_checkpoint(path.string(), c, seed);
  return gpu::Checkpoint::open(path.string());
}

}  // namespace disagg::test
