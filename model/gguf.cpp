#include "model/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "gpu/error.h"
#include "gpu/file_check.h"

namespace disagg::gpu::gguf {

namespace {

constexpr uint32_t kMaxDims = 4;         // GGML_MAX_DIMS
constexpr int kMaxArrayNesting = 4;      // arrays of arrays of ...: deeper is refused
// Array values in all the metadata: each becomes a Value of ~100 bytes, so
// a count checked only against the bytes left (one a u8) could still ask for
// 100x the file's size in memory. Real files hold under 1 M (a vocabulary's
// tokens, scores, types and merges).
constexpr uint64_t kMaxArrayValues = uint64_t(1) << 22;
// Top-level metadata entries and tensors: each also costs ~10x its fewest
// bytes in memory (a map node and its key, a TensorInfo), so their counts
// are bounded as the array values are. Real files hold under 100 entries
// (a vocabulary is one) and under 10,000 tensors.
constexpr uint64_t kMaxMetadataEntries = uint64_t(1) << 16;
constexpr uint64_t kMaxTensors = uint64_t(1) << 16;
// The fewest bytes one metadata entry / tensor info can take (an empty
// key or name, the smallest value, one dimension): what a count is checked
// against before anything is reserved for it.
constexpr uint64_t kMinMetadataBytes = 8 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 4 + 8 + 4 + 8;

size_t scalar_bytes(ValueType t) {
  switch (t) {
    case ValueType::u8: case ValueType::i8: case ValueType::boolean: return 1;
    case ValueType::u16: case ValueType::i16: return 2;
    case ValueType::u32: case ValueType::i32: case ValueType::f32: return 4;
    case ValueType::u64: case ValueType::i64: case ValueType::f64: return 8;
    case ValueType::string: return 8;  // at least its length
    case ValueType::array: return 4 + 8;
  }
  return 0;
}

bool known(uint32_t t) { return t <= uint32_t(ValueType::f64); }

// A bounds-checked little-endian cursor over the file's bytes.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size, const std::string& path) : data_(data), size_(size), path_(path) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(path_ + ": " + what + " (at byte " + std::to_string(at_) + " of " + std::to_string(size_) + ")");
  }
  size_t at() const { return at_; }
  uint64_t left() const { return size_ - at_; }

  template <class T>
  T scalar(const char* what) {
    if (left() < sizeof(T)) fail(std::string("truncated: ") + what);
    T v;
    std::memcpy(&v, data_ + at_, sizeof(T));  // x86-64 and the file are little-endian
    at_ += sizeof(T);
    return v;
  }

  std::string string(const char* what) {
    const uint64_t n = scalar<uint64_t>(what);
    if (n > left()) fail(std::string(what) + " of " + std::to_string(n) + " bytes runs past the end of the file");
    std::string s(reinterpret_cast<const char*>(data_ + at_), size_t(n));
    at_ += size_t(n);
    return s;
  }

  Value value(ValueType type, const std::string& key, int depth) {
    Value v;
    v.type = type;
    switch (type) {
      case ValueType::u8: v.u = scalar<uint8_t>(key.c_str()); break;
      case ValueType::i8: v.i = scalar<int8_t>(key.c_str()); break;
      case ValueType::u16: v.u = scalar<uint16_t>(key.c_str()); break;
      case ValueType::i16: v.i = scalar<int16_t>(key.c_str()); break;
      case ValueType::u32: v.u = scalar<uint32_t>(key.c_str()); break;
      case ValueType::i32: v.i = scalar<int32_t>(key.c_str()); break;
      case ValueType::u64: v.u = scalar<uint64_t>(key.c_str()); break;
      case ValueType::i64: v.i = scalar<int64_t>(key.c_str()); break;
      case ValueType::f32: v.f = scalar<float>(key.c_str()); break;
      case ValueType::f64: v.f = scalar<double>(key.c_str()); break;
      case ValueType::boolean: {
        const uint8_t b = scalar<uint8_t>(key.c_str());
        if (b > 1) fail("metadata " + key + ": a boolean of " + std::to_string(b));
        v.u = b;
        break;
      }
      case ValueType::string: v.s = string(key.c_str()); break;
      case ValueType::array: {
        if (depth >= kMaxArrayNesting) fail("metadata " + key + ": arrays nested deeper than " + std::to_string(kMaxArrayNesting));
        const uint32_t element = scalar<uint32_t>(key.c_str());
        if (!known(element)) fail("metadata " + key + ": unknown array element type " + std::to_string(element));
        v.element = ValueType(element);
        const uint64_t count = scalar<uint64_t>(key.c_str());
        if (count > left() / scalar_bytes(v.element))
          fail("metadata " + key + ": an array of " + std::to_string(count) + " " + to_string(v.element) +
               " values cannot fit in the " + std::to_string(left()) + " bytes left");
        if (count > kMaxArrayValues - array_values_)
          fail("metadata " + key + ": an array of " + std::to_string(count) + " values makes more than " +
               std::to_string(kMaxArrayValues) + " array values in all");
        array_values_ += count;
        v.array.reserve(size_t(count));
        for (uint64_t k = 0; k < count; ++k) v.array.push_back(value(v.element, key, depth + 1));
        break;
      }
    }
    return v;
  }

  void seek(size_t to) { at_ = to; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
  uint64_t array_values_ = 0;  // in the arrays read so far (kMaxArrayValues)
  const std::string& path_;
};

// a * b, or nullopt when it overflows int64.
std::optional<int64_t> product(int64_t a, int64_t b) {
  if (a != 0 && b > std::numeric_limits<int64_t>::max() / a) return std::nullopt;
  return a * b;
}

}  // namespace

const char* to_string(ValueType type) {
  switch (type) {
    case ValueType::u8: return "u8";
    case ValueType::i8: return "i8";
    case ValueType::u16: return "u16";
    case ValueType::i16: return "i16";
    case ValueType::u32: return "u32";
    case ValueType::i32: return "i32";
    case ValueType::f32: return "f32";
    case ValueType::boolean: return "bool";
    case ValueType::string: return "string";
    case ValueType::array: return "array";
    case ValueType::u64: return "u64";
    case ValueType::i64: return "i64";
    case ValueType::f64: return "f64";
  }
  return "unknown";
}

std::optional<WeightType> weight_type_of(TensorType type) {
  switch (type) {
    case TensorType::f32: return WeightType::f32;
    case TensorType::f16: return WeightType::f16;
    case TensorType::bf16: return WeightType::bf16;
    case TensorType::q8_0: return WeightType::q8_0;
    case TensorType::q4_0: return WeightType::q4_0;
    case TensorType::q4_k: return WeightType::q4_k;
    case TensorType::q5_k: return WeightType::q5_k;
    case TensorType::q6_k: return WeightType::q6_k;
    default: return std::nullopt;
  }
}

TensorType tensor_type_of(WeightType type) {
  switch (type) {
    case WeightType::f32: return TensorType::f32;
    case WeightType::f16: return TensorType::f16;
    case WeightType::bf16: return TensorType::bf16;
    case WeightType::q8_0: return TensorType::q8_0;
    case WeightType::q4_0: return TensorType::q4_0;
    case WeightType::q4_k: return TensorType::q4_k;
    case WeightType::q5_k: return TensorType::q5_k;
    case WeightType::q6_k: return TensorType::q6_k;
  }
  return TensorType::f32;
}

std::optional<TypeTraits> traits_of(uint32_t ggml_type) {
  switch (TensorType(ggml_type)) {
    case TensorType::f32: return TypeTraits{"f32", 1, 4};
    case TensorType::f16: return TypeTraits{"f16", 1, 2};
    case TensorType::bf16: return TypeTraits{"bf16", 1, 2};
    case TensorType::q4_0: return TypeTraits{"q4_0", 32, 2 + 16};        // f16 scale, 32 x 4 bits
    case TensorType::q8_0: return TypeTraits{"q8_0", 32, 2 + 32};        // f16 scale, 32 x i8
    case TensorType::q4_k: return TypeTraits{"q4_k", 256, 2 + 2 + 12 + 128};  // d, dmin, 8 x 6-bit scales/mins, 256 x 4 bits
    case TensorType::q5_k: return TypeTraits{"q5_k", 256, 2 + 2 + 12 + 32 + 128};  // ... + 256 high bits
    case TensorType::q6_k: return TypeTraits{"q6_k", 256, 128 + 64 + 16 + 2};  // 4 low bits, 2 high bits, 16 x i8 scales, d
  }
  return std::nullopt;
}

std::string ggml_type_name(uint32_t ggml_type) {
  if (auto t = traits_of(ggml_type)) return t->name;
  // Its number alone where ggml has no name (4 and 5 were removed types):
  // errors say "type 99", not "type type 99".
  static const char* const names[] = {"f32",  "f16",  "q4_0", "q4_1", "4",      "5",      "q5_0", "q5_1",
                                      "q8_0", "q8_1", "q2_k", "q3_k", "q4_k",   "q5_k",   "q6_k", "q8_k",
                                      "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq4_nl", "iq3_s", "iq2_s", "iq4_xs",
                                      "i8", "i16", "i32", "i64", "f64", "iq1_m", "bf16"};
  if (ggml_type < sizeof names / sizeof names[0]) return names[ggml_type];
  return std::to_string(ggml_type);
}

bool Value::is_integer() const {
  switch (type) {
    case ValueType::u8: case ValueType::i8: case ValueType::u16: case ValueType::i16: case ValueType::u32:
    case ValueType::i32: case ValueType::u64: case ValueType::i64: return true;
    default: return false;
  }
}

int64_t TensorInfo::elements() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;  // checked by File::parse
  return n;
}

namespace {

// One tensor's entry of the header: its name, dimensions (1 to 4, their
// product within int64), a supported type whose blocks tile its rows, its
// size and its offset (a multiple of `alignment`), every figure checked.
TensorInfo read_tensor_info(Reader& r, uint64_t alignment) {
  TensorInfo t;
  t.name = r.string("tensor name");
  const std::string where = "tensor " + t.name + ": ";
  const uint32_t n_dims = r.scalar<uint32_t>("tensor dimensions");
  if (n_dims == 0 || n_dims > kMaxDims) r.fail(where + std::to_string(n_dims) + " dimensions (1 to 4 are allowed)");
  int64_t elements = 1;
  for (uint32_t d = 0; d < n_dims; ++d) {
    const uint64_t dim = r.scalar<uint64_t>("tensor dimension");
    const auto next = dim == 0 || dim > uint64_t(std::numeric_limits<int64_t>::max()) ? std::nullopt
                                                                                        : product(elements, int64_t(dim));
    if (!next) r.fail(where + "dimension " + std::to_string(dim) + " is zero or makes the tensor too large");
    elements = *next;
    t.dims.push_back(int64_t(dim));
  }
  t.type = r.scalar<uint32_t>("tensor type");
  const auto traits = traits_of(t.type);
  if (!traits) r.fail(where + "type " + ggml_type_name(t.type) + " is not supported (f32, f16, bf16, q4_0, q8_0, q4_k, q5_k, q6_k are)");
  if (t.dims[0] % traits->block_elems != 0)
    r.fail(where + "rows of " + std::to_string(t.dims[0]) + " values are not whole " + traits->name + " blocks of " +
           std::to_string(traits->block_elems));
  const auto bytes = product(elements / traits->block_elems, traits->block_bytes);
  if (!bytes) r.fail(where + "too large");
  t.bytes = uint64_t(*bytes);
  t.offset = r.scalar<uint64_t>("tensor offset");
  if (t.offset % alignment != 0)
    r.fail(where + "offset " + std::to_string(t.offset) + " is not a multiple of the alignment " + std::to_string(alignment));
  return t;
}

void check_no_overlap(const std::vector<TensorInfo>& tensors, uint64_t data_offset, const std::string& path) {
  // No two tensors share bytes: a tensor whose type or shape was changed to
  // run into the next one would be read as both (each of its bytes is then
  // one tensor's weight and another's). Sorted by offset, each tensor must
  // end where or before the next begins; zero-byte tensors cannot exist here.
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(tensors.size());
  for (const auto& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
  for (size_t k = 1; k < by_offset.size(); ++k) {
    const TensorInfo& a = *by_offset[k - 1];
    const TensorInfo& b = *by_offset[k];
    if (b.offset - a.offset < a.bytes)
      throw Error(path + ": tensors " + a.name + " and " + b.name + " overlap: " + a.name + "'s " +
                  std::to_string(a.bytes) + " bytes at offset " + std::to_string(a.offset - data_offset) +
                  " run into " + b.name + " at offset " + std::to_string(b.offset - data_offset));
  }
}

}  // namespace

File File::parse(const uint8_t* data, size_t size, const std::string& path) {
  File f;
  f.path_ = path;
  Reader r(data, size, f.path_);
  if (r.scalar<uint32_t>("magic") != kMagic) {
    r.seek(0);
    r.fail("not a GGUF file (no \"GGUF\" magic)");
  }
  f.version_ = r.scalar<uint32_t>("version");
  if (f.version_ != 2 && f.version_ != 3)
    r.fail("GGUF version " + std::to_string(f.version_) + " (versions 2 and 3 are read)");
  const uint64_t tensor_count = r.scalar<uint64_t>("tensor count");
  const uint64_t metadata_count = r.scalar<uint64_t>("metadata count");
  if (metadata_count > kMaxMetadataEntries)
    r.fail(std::to_string(metadata_count) + " metadata entries are more than the " +
           std::to_string(kMaxMetadataEntries) + " read");
  if (tensor_count > kMaxTensors)
    r.fail(std::to_string(tensor_count) + " tensors are more than the " + std::to_string(kMaxTensors) + " read");
  if (metadata_count > r.left() / kMinMetadataBytes)
    r.fail(std::to_string(metadata_count) + " metadata entries cannot fit in the file");
  if (tensor_count > r.left() / kMinTensorInfoBytes)
    r.fail(std::to_string(tensor_count) + " tensors cannot fit in the file");

  for (uint64_t k = 0; k < metadata_count; ++k) {
    std::string key = r.string("metadata key");
    const uint32_t type = r.scalar<uint32_t>("metadata type");
    if (!known(type)) r.fail("metadata " + key + ": unknown value type " + std::to_string(type));
    Value v = r.value(ValueType(type), key, 0);
    if (!f.metadata_.emplace(key, std::move(v)).second) r.fail("metadata " + key + " appears twice");
  }
  if (f.find("general.alignment")) {
    uint64_t alignment = 0;  // (any integer type, as every other integer of the file)
    try {
      alignment = f.uint("general.alignment");
    } catch (const Error&) {  // (not a non-negative integer: refused below)
    }
    if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment > (1u << 20))
      r.fail("general.alignment must be a power of two of at most 1 MiB");
    f.alignment_ = alignment;
  } else {
    f.alignment_ = kDefaultAlignment;
  }

  f.tensors_.reserve(size_t(tensor_count));
  for (uint64_t k = 0; k < tensor_count; ++k) {
    TensorInfo t = read_tensor_info(r, f.alignment_);
    const std::string where = "tensor " + t.name + ": ";
    if (!f.by_name_.emplace(t.name, f.tensors_.size()).second) r.fail(where + "appears twice");
    f.tensors_.push_back(std::move(t));
  }
  f.data_offset_ = (uint64_t(r.at()) + f.alignment_ - 1) / f.alignment_ * f.alignment_;
  for (auto& t : f.tensors_) {
    // data_offset + offset + bytes <= size, without overflowing.
    if (f.data_offset_ > size || t.offset > size - f.data_offset_ || t.bytes > size - f.data_offset_ - t.offset)
      throw Error(path + ": tensor " + t.name + ": its " + std::to_string(t.bytes) + " bytes at offset " +
                  std::to_string(t.offset) + " end past the file's " + std::to_string(size) + " bytes (truncated?)");
    t.offset += f.data_offset_;
  }
  check_no_overlap(f.tensors_, f.data_offset_, path);
  return f;
}

const Value* File::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

const TensorInfo* File::tensor(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& File::require_tensor(const std::string& name) const {
  if (const TensorInfo* t = tensor(name)) return *t;
  throw Error(path_ + ": tensor " + name + " is missing");
}

namespace {

const Value& required(const File& f, const std::string& path, const std::string& key) {
  if (const Value* v = f.find(key)) return *v;
  throw Error(path + ": metadata " + key + " is missing");
}

uint64_t as_uint(const Value& v, const std::string& path, const std::string& key) {
  if (v.is_integer() && (v.type == ValueType::u8 || v.type == ValueType::u16 || v.type == ValueType::u32 ||
                         v.type == ValueType::u64 || v.i >= 0))
    return v.type == ValueType::i8 || v.type == ValueType::i16 || v.type == ValueType::i32 || v.type == ValueType::i64
               ? uint64_t(v.i)
               : v.u;
  throw Error(path + ": metadata " + key + " must be a non-negative integer, not " + to_string(v.type));
}

double as_number(const Value& v, const std::string& path, const std::string& key) {
  if (v.type == ValueType::f32 || v.type == ValueType::f64) return v.f;
  if (v.is_integer()) return v.u != 0 ? double(v.u) : double(v.i);
  throw Error(path + ": metadata " + key + " must be a number, not " + to_string(v.type));
}

}  // namespace

uint64_t File::uint(const std::string& key) const { return as_uint(required(*this, path_, key), path_, key); }

uint64_t File::uint(const std::string& key, uint64_t fallback) const {
  const Value* v = find(key);
  return v ? as_uint(*v, path_, key) : fallback;
}

double File::number(const std::string& key) const { return as_number(required(*this, path_, key), path_, key); }

double File::number(const std::string& key, double fallback) const {
  const Value* v = find(key);
  return v ? as_number(*v, path_, key) : fallback;
}

const std::string& File::string(const std::string& key) const {
  const Value& v = required(*this, path_, key);
  if (v.type != ValueType::string) throw Error(path_ + ": metadata " + key + " must be a string, not " + to_string(v.type));
  return v.s;
}

const Value& File::array(const std::string& key, ValueType element) const {
  const Value& v = required(*this, path_, key);
  if (v.type != ValueType::array || v.element != element)
    throw Error(path_ + ": metadata " + key + " must be an array of " + to_string(element));
  return v;
}

// ---------------------------------------------------------------- Writer

Value Writer::u32(uint32_t v) {
  Value x;
  x.type = ValueType::u32;
  x.u = v;
  return x;
}

Value Writer::f32(float v) {
  Value x;
  x.type = ValueType::f32;
  x.f = v;
  return x;
}

Value Writer::str(std::string v) {
  Value x;
  x.type = ValueType::string;
  x.s = std::move(v);
  return x;
}

Value Writer::boolean(bool v) {
  Value x;
  x.type = ValueType::boolean;
  x.u = v ? 1 : 0;
  return x;
}

Value Writer::strings(std::vector<std::string> v) {
  Value x;
  x.type = ValueType::array;
  x.element = ValueType::string;
  for (auto& s : v) x.array.push_back(str(std::move(s)));
  return x;
}

Value Writer::f32s(const std::vector<float>& v) {
  Value x;
  x.type = ValueType::array;
  x.element = ValueType::f32;
  for (float f : v) x.array.push_back(f32(f));
  return x;
}

Value Writer::i32s(const std::vector<int32_t>& v) {
  Value x;
  x.type = ValueType::array;
  x.element = ValueType::i32;
  for (int32_t i : v) {
    Value e;
    e.type = ValueType::i32;
    e.i = i;
    x.array.push_back(e);
  }
  return x;
}

void Writer::add(const std::string& key, Value value) { metadata_.emplace_back(key, std::move(value)); }

void Writer::add_tensor(const std::string& name, std::vector<int64_t> dims, uint32_t ggml_type, Fill fill) {
  const auto traits = traits_of(ggml_type);
  if (!traits) throw Error("GGUF writer: tensor " + name + ": type " + ggml_type_name(ggml_type) + " is not supported");
  int64_t elements = 1;
  for (int64_t d : dims) elements *= d;
  if (dims.empty() || dims[0] % traits->block_elems != 0)
    throw Error("GGUF writer: tensor " + name + ": rows are not whole " + traits->name + " blocks");
  tensors_.push_back({name, std::move(dims), ggml_type, uint64_t(elements / traits->block_elems * traits->block_bytes),
                      std::move(fill)});
}

namespace {

struct Out {
  std::FILE* f;
  const std::string& path;
  void bytes(const void* p, size_t n) {
    if (std::fwrite(p, 1, n, f) != n) throw Error(path + ": write failed");
  }
  template <class T>
  void scalar(T v) {
    bytes(&v, sizeof v);
  }
  void string(const std::string& s) {
    scalar<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  void value(const Value& v) {
    switch (v.type) {
      case ValueType::u8: scalar<uint8_t>(uint8_t(v.u)); break;
      case ValueType::i8: scalar<int8_t>(int8_t(v.i)); break;
      case ValueType::u16: scalar<uint16_t>(uint16_t(v.u)); break;
      case ValueType::i16: scalar<int16_t>(int16_t(v.i)); break;
      case ValueType::u32: scalar<uint32_t>(uint32_t(v.u)); break;
      case ValueType::i32: scalar<int32_t>(int32_t(v.i)); break;
      case ValueType::u64: scalar<uint64_t>(v.u); break;
      case ValueType::i64: scalar<int64_t>(v.i); break;
      case ValueType::f32: scalar<float>(float(v.f)); break;
      case ValueType::f64: scalar<double>(v.f); break;
      case ValueType::boolean: scalar<uint8_t>(uint8_t(v.u)); break;
      case ValueType::string: string(v.s); break;
      case ValueType::array:
        scalar<uint32_t>(uint32_t(v.element));
        scalar<uint64_t>(v.array.size());
        for (const auto& e : v.array) value(e);
        break;
    }
  }
  void pad(uint64_t alignment) {
    const long at = std::ftell(f);
    if (at < 0) throw Error(path + ": ftell failed");
    static const char zeros[64] = {};
    for (uint64_t n = (alignment - uint64_t(at) % alignment) % alignment; n > 0;) {
      const size_t k = size_t(std::min<uint64_t>(n, sizeof zeros));
      bytes(zeros, k);
      n -= k;
    }
  }
};

}  // namespace

void Writer::write(const std::string& path) const {
  // (written whole or not at all: a half-written model must never be left
  // behind looking like one, nor the file it replaces cut while it is read)
  OutputFile file = OutputFile::create(path);
  std::FILE* f = file.stream();
  {
    Out out{f, path};
    out.scalar<uint32_t>(kMagic);
    out.scalar<uint32_t>(3);
    out.scalar<uint64_t>(tensors_.size());
    bool has_alignment = false;
    for (const auto& [key, value] : metadata_) has_alignment |= key == "general.alignment";
    out.scalar<uint64_t>(metadata_.size() + (has_alignment || alignment_ == kDefaultAlignment ? 0 : 1));
    for (const auto& [key, value] : metadata_) {
      out.string(key);
      out.scalar<uint32_t>(uint32_t(value.type));
      out.value(value);
    }
    if (!has_alignment && alignment_ != kDefaultAlignment) {
      out.string("general.alignment");
      out.scalar<uint32_t>(uint32_t(ValueType::u32));
      out.scalar<uint32_t>(uint32_t(alignment_));
    }
    uint64_t offset = 0;
    for (const auto& t : tensors_) {
      out.string(t.name);
      out.scalar<uint32_t>(uint32_t(t.dims.size()));
      for (int64_t d : t.dims) out.scalar<uint64_t>(uint64_t(d));
      out.scalar<uint32_t>(t.type);
      out.scalar<uint64_t>(offset);
      offset += (t.bytes + alignment_ - 1) / alignment_ * alignment_;
    }
    for (const auto& t : tensors_) {
      out.pad(alignment_);
      const long before = std::ftell(f);
      t.fill(f);
      if (std::ferror(f) || std::ftell(f) - before != long(t.bytes))
        throw Error(path + ": tensor " + t.name + ": wrote " + std::to_string(std::ftell(f) - before) + " bytes, not " +
                    std::to_string(t.bytes));
    }
  }
  file.commit();
}

}  // namespace disagg::gpu::gguf
