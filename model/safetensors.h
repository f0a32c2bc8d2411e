// The safetensors format (Hugging Face): an 8-byte little-endian header
// length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin,
// end]}, "__metadata__": {...}}, then the tensors' bytes, offsets relative to
// the end of the header. Parsed from a mapping; nothing is copied.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace disagg::gpu::safetensors {

struct Tensor {
  std::string dtype;           // "F32", "F16", "BF16", ... as the file says
  std::vector<int64_t> shape;  // outermost first: a matrix is {rows, cols}
  size_t offset = 0;           // of the first byte, from the start of the file
  size_t bytes = 0;
};

// The largest JSON header read (the format's own limit is 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

// Every tensor of the file `data` (`size` bytes) maps. Throws Error("<path>:
// ...") for a header length beyond the file or kMaxHeaderBytes, a header that
// is not a JSON object of tensors, a negative or overflowing shape, offsets
// out of order or outside the data, two tensors whose bytes overlap, or a
// byte count that disagrees with the dtype and shape (for F32, F16, BF16;
// other dtypes are listed with their bytes for the caller to refuse by name).
std::map<std::string, Tensor> parse(const uint8_t* data, size_t size, const std::string& path);

// Bytes per value of a dtype, or 0 for one this library does not compute with.
size_t dtype_bytes(const std::string& dtype);

// A safetensors file of `tensors` (name -> dtype, shape, bytes), in name
// order, for tests and converters. Throws Error on a write failure.
struct Input {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};
void write(const std::string& path, const std::map<std::string, Input>& tensors);

}  // namespace disagg::gpu::safetensors
