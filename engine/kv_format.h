// Wire format of a request's KV cache, shipped from prefill to decode.
//
//   offset  size  field
//   0       8     magic "DSGKV\0\0\0"
//   8       4     format version (kKvFormatVersion)
//   12      4     dtype   (0 = float32)
//   16      8     model fingerprint (Checkpoint::fingerprint)
//   24      4     layers
//   28      4     kv heads
//   32      4     head dim
//   36      4     positions
//   40      4     layout  (0 = [layer][K then V][position][kv_head*head_dim])
//   44      4     reserved (0)
//   48      N     payload: layers*2*positions*kv_heads*head_dim values of dtype
//   48+N    8     checksum (kv_checksum) over bytes [0, 48+N)
//
// Everything is little-endian. The layout is layer-major so the payload can
// later be streamed one layer at a time.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu/error.h"

namespace disagg::gpu {

constexpr uint32_t kKvFormatVersion = 1;
constexpr size_t kKvHeaderBytes = 48;
constexpr size_t kKvTrailerBytes = 8;

enum class KvDtype : uint32_t { f32 = 0 };
enum class KvLayout : uint32_t { layer_kv_position = 0 };

struct KvShape {
  uint32_t n_layers = 0;
  uint32_t n_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t n_positions = 0;

  size_t kv_dim() const { return size_t(n_kv_heads) * head_dim; }
  size_t layer_floats() const { return 2 * size_t(n_positions) * kv_dim(); }  // K and V
  size_t floats() const { return size_t(n_layers) * layer_floats(); }
  bool operator==(const KvShape& o) const {
    return n_layers == o.n_layers && n_kv_heads == o.n_kv_heads && head_dim == o.head_dim &&
           n_positions == o.n_positions;
  }
};

struct KvHeader {
  uint32_t version = kKvFormatVersion;
  KvDtype dtype = KvDtype::f32;
  uint64_t fingerprint = 0;
  KvShape shape;
  KvLayout layout = KvLayout::layer_kv_position;
};

enum class KvErrorKind { truncated, bad_magic, wrong_version, wrong_fingerprint, wrong_shape, bad_checksum };

class KvFormatError : public Error {
 public:
  KvFormatError(KvErrorKind kind, const std::string& what) : Error(what), kind_(kind) {}
  KvErrorKind kind() const { return kind_; }

 private:
  KvErrorKind kind_;
};

// What the receiver accepts: its model's fingerprint and shape, and at most
// max_positions positions.
struct KvExpectation {
  uint64_t fingerprint = 0;
  uint32_t n_layers = 0;
  uint32_t n_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t max_positions = 0;
};

// A validated buffer: header plus a pointer to its payload (inside the buffer).
struct KvView {
  KvHeader header;
  const float* payload = nullptr;
};

uint64_t kv_checksum(const uint8_t* data, size_t size);
size_t kv_buffer_bytes(const KvShape& shape);

std::vector<uint8_t> serialize_kv(uint64_t fingerprint, const KvShape& shape, const float* payload);

// Throws KvFormatError naming the problem: truncated buffer, bad magic, wrong
// version, wrong fingerprint, wrong shape (or too many positions), bad checksum.
KvView parse_kv(const uint8_t* data, size_t size, const KvExpectation& expect);

}  // namespace disagg::gpu
