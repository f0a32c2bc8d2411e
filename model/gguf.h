// GGUF (ggml's model file format, versions 2 and 3), read from bytes the
// caller has mapped, and written. Layout (little-endian):
//
//   "GGUF" u32 version, u64 tensor_count, u64 metadata_count
//   metadata_count x { string key, u32 value_type, value }
//   tensor_count   x { string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset }
//   padding to general.alignment (default 32), then the tensor data; each
//   tensor at data_start + offset, offset a multiple of the alignment.
//
// string = u64 length + bytes; array = u32 element type, u64 count, values.
// dims[0] is a tensor's innermost dimension (a matrix's row length).
//
// Every length and count the file announces is checked against the bytes
// that are left before anything is allocated for it; every tensor against
// its type's block size, the file's end and the other tensors (no overlap). Errors name the file and the key
// or tensor: "model.gguf: tensor blk.0.attn_q.weight: ...".
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gpu/quant.h"

namespace disagg::gpu::gguf {

constexpr uint32_t kMagic = 0x46554747;    // "GGUF" read as a little-endian u32
constexpr uint64_t kDefaultAlignment = 32;  // general.alignment when a file names none

enum class ValueType : uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7, string = 8, array = 9,
  u64 = 10, i64 = 11, f64 = 12,
};
const char* to_string(ValueType type);

// ggml's tensor types that this project reads (ggml.h numbers them).
enum class TensorType : uint32_t {
  f32 = 0, f16 = 1, q4_0 = 2, q8_0 = 8, q4_k = 12, q5_k = 13, q6_k = 14, bf16 = 30,
};

// The engine's weight type of a ggml tensor type (nullopt: one it does not
// compute with), and back.
std::optional<WeightType> weight_type_of(TensorType type);
TensorType tensor_type_of(WeightType type);

// A tensor type's storage: blocks of `block_elems` values in `block_bytes`.
struct TypeTraits {
  const char* name;
  int64_t block_elems;
  int64_t block_bytes;
};
// Nullopt for a type number this project does not read.
std::optional<TypeTraits> traits_of(uint32_t ggml_type);
// The name ggml gives a type number ("q5_1", ...), or the number ("99") for
// one it does not name; errors put "type " before either.
std::string ggml_type_name(uint32_t ggml_type);

struct Value {
  ValueType type = ValueType::u8;
  uint64_t u = 0;      // u8..u64, boolean
  int64_t i = 0;       // i8..i64
  double f = 0;        // f32, f64
  std::string s;       // string
  ValueType element = ValueType::u8;  // array: its elements' type
  std::vector<Value> array;

  bool is_integer() const;
  bool is_number() const { return is_integer() || type == ValueType::f32 || type == ValueType::f64; }
};

struct TensorInfo {
  std::string name;
  std::vector<int64_t> dims;  // dims[0] innermost
  uint32_t type = 0;          // ggml type number (traits_of(type) is set)
  uint64_t offset = 0;        // from the start of the file
  uint64_t bytes = 0;
  int64_t elements() const;
};

class File {
 public:
  // Parses `size` bytes at `data` (the whole file). Throws gpu::Error
  // "<path>: <problem>" for anything that is not a valid GGUF v2/v3 file
  // whose tensors all lie inside its data section, overlap no other tensor
  // and have a type traits_of knows.
  static File parse(const uint8_t* data, size_t size, const std::string& path);

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  const std::map<std::string, Value>& metadata() const { return metadata_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

  const Value* find(const std::string& key) const;
  const TensorInfo* tensor(const std::string& name) const;
  // Typed reads; a missing key or one of another type throws, naming it.
  uint64_t uint(const std::string& key) const;  // any non-negative integer type
  double number(const std::string& key) const;  // any number type
  const std::string& string(const std::string& key) const;
  const Value& array(const std::string& key, ValueType element) const;
  // The same with a default for an absent key (a present key of another type throws).
  uint64_t uint(const std::string& key, uint64_t fallback) const;
  double number(const std::string& key, double fallback) const;
  // The tensor or an error naming it.
  const TensorInfo& require_tensor(const std::string& name) const;

 private:
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = kDefaultAlignment;
  uint64_t data_offset_ = 0;
  std::map<std::string, Value> metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> by_name_;
};

// Writes a GGUF v3 file: metadata in the order added, then tensors, each
// padded to the alignment. Tensor bytes are written as given (already in
// the tensor's type); add_tensor's `write` is called once, in order, to
// stream each tensor's bytes, so a large model never needs to be in memory.
class Writer {
 public:
  explicit Writer(uint64_t alignment = kDefaultAlignment) : alignment_(alignment) {}
  void add(const std::string& key, Value value);
  // Convenience values.
  static Value u32(uint32_t v);
  static Value f32(float v);
  static Value str(std::string v);
  static Value boolean(bool v);
  static Value strings(std::vector<std::string> v);
  static Value f32s(const std::vector<float>& v);
  static Value i32s(const std::vector<int32_t>& v);

  using Fill = std::function<void(std::FILE*)>;
  void add_tensor(const std::string& name, std::vector<int64_t> dims, uint32_t ggml_type, Fill fill);
  // Writes everything to `path`; throws gpu::Error.
  void write(const std::string& path) const;

 private:
  struct Pending {
    std::string name;
    std::vector<int64_t> dims;
    uint32_t type;
    uint64_t bytes;
    Fill fill;
  };
  uint64_t alignment_;
  std::vector<std::pair<std::string, Value>> metadata_;
  std::vector<Pending> tensors_;
};

}  // namespace disagg::gpu::gguf
