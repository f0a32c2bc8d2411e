// Serialization and validation of the KV-cache wire format (layout: kv_format.h,
// rationale: docs/kv-format.md).
#include "engine/kv_format.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the KV wire format is little-endian and is written from host memory as-is");

namespace disagg::gpu {
namespace {

constexpr char kMagic[8] = {'D', 'S', 'G', 'K', 'V', '\0', '\0', '\0'};

// Field offsets, as documented in kv_format.h.
constexpr size_t kOffVersion = 8, kOffDtype = 12, kOffFingerprint = 16, kOffLayers = 24, kOffKvHeads = 28,
                 kOffHeadDim = 32, kOffPositions = 36, kOffLayout = 40, kOffReserved = 44;

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

std::string hex(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// ---- checksum
// Four independent lanes, each absorbing one 8-byte word per 32-byte block as
//   lane = xorshift(multiply(lane ^ word)).
// Each step is a bijection of the lane for a fixed word, so a corrupted word can
// never be cancelled by later identical data: any error confined to one word is
// always detected. Four lanes hide the multiply latency: about 11 GB/s on one
// core of the development machine, above network speed. Not cryptographic; it guards against corruption and bugs.
constexpr uint64_t kMul = 0x9fb21c651e98df25ULL;  // odd, high-entropy multiplier

inline uint64_t absorb(uint64_t lane, uint64_t word) {
  lane = (lane ^ word) * kMul;
  return lane ^ (lane >> 29);
}

inline uint64_t finalize(uint64_t x) {  // splitmix64 finalizer: full avalanche
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

uint64_t kv_checksum(const uint8_t* data, size_t size) {
  uint64_t lane[4] = {0x243f6a8885a308d3ULL, 0x13198a2e03707344ULL, 0xa4093822299f31d0ULL,
                      0x082efa98ec4e6c89ULL};
  size_t i = 0;
  for (; i + 32 <= size; i += 32) {
    lane[0] = absorb(lane[0], load<uint64_t>(data + i));
    lane[1] = absorb(lane[1], load<uint64_t>(data + i + 8));
    lane[2] = absorb(lane[2], load<uint64_t>(data + i + 16));
    lane[3] = absorb(lane[3], load<uint64_t>(data + i + 24));
  }
  // Tail: whole words round-robin, then the last 0..7 bytes zero-padded into one
  // word (the total size, mixed in below, distinguishes padding from real zeros).
  int next_lane = 0;
  for (; i + 8 <= size; i += 8) {
    lane[next_lane] = absorb(lane[next_lane], load<uint64_t>(data + i));
    ++next_lane;
  }
  if (i < size) {
    uint64_t last = 0;
    std::memcpy(&last, data + i, size - i);
    lane[next_lane] = absorb(lane[next_lane], last);
  }
  // Each combining step is a bijection in the lane it adds.
  uint64_t h = finalize(lane[0]) ^ lane[1];
  h = finalize(h) ^ lane[2];
  h = finalize(h) ^ lane[3];
  return finalize(h ^ (uint64_t(size) * kMul));
}

size_t kv_buffer_bytes(const KvShape& shape) {
  // Checked: the shape may come from an untrusted header.
  size_t bytes = kKvHeaderBytes + kKvTrailerBytes, payload = 2 * sizeof(float);
  const bool overflow = __builtin_mul_overflow(payload, size_t(shape.n_layers), &payload) ||
                        __builtin_mul_overflow(payload, size_t(shape.n_positions), &payload) ||
                        __builtin_mul_overflow(payload, size_t(shape.n_kv_heads), &payload) ||
                        __builtin_mul_overflow(payload, size_t(shape.head_dim), &payload) ||
                        __builtin_add_overflow(bytes, payload, &bytes);
  if (overflow)
    throw Error("KV shape too large: " + std::to_string(shape.n_layers) + " layers x " +
                std::to_string(shape.n_positions) + " positions x " + std::to_string(shape.n_kv_heads) +
                " kv heads x " + std::to_string(shape.head_dim) + " head dim");
  return bytes;
}

std::vector<uint8_t> serialize_kv(uint64_t fingerprint, const KvShape& shape, const float* payload) {
  const size_t total = kv_buffer_bytes(shape);
  const size_t payload_bytes = total - kKvHeaderBytes - kKvTrailerBytes;
  if (payload_bytes > 0 && payload == nullptr) throw Error("serialize_kv: null payload for a non-empty shape");

  std::vector<uint8_t> buf(total);
  uint8_t* p = buf.data();
  std::memcpy(p, kMagic, sizeof kMagic);
  store<uint32_t>(p + kOffVersion, kKvFormatVersion);
  store<uint32_t>(p + kOffDtype, uint32_t(KvDtype::f32));
  store<uint64_t>(p + kOffFingerprint, fingerprint);
  store<uint32_t>(p + kOffLayers, shape.n_layers);
  store<uint32_t>(p + kOffKvHeads, shape.n_kv_heads);
  store<uint32_t>(p + kOffHeadDim, shape.head_dim);
  store<uint32_t>(p + kOffPositions, shape.n_positions);
  store<uint32_t>(p + kOffLayout, uint32_t(KvLayout::layer_kv_position));
  store<uint32_t>(p + kOffReserved, 0);
  if (payload_bytes > 0) std::memcpy(p + kKvHeaderBytes, payload, payload_bytes);
  store<uint64_t>(p + kKvHeaderBytes + payload_bytes, kv_checksum(p, kKvHeaderBytes + payload_bytes));
  return buf;
}

KvView parse_kv(const uint8_t* data, size_t size, const KvExpectation& expect) {
  using K = KvErrorKind;
  if (size < kKvHeaderBytes + kKvTrailerBytes)
    throw KvFormatError(K::truncated, "KV buffer truncated: " + std::to_string(size) +
                                          " bytes, smaller than header and checksum (" +
                                          std::to_string(kKvHeaderBytes + kKvTrailerBytes) + ")");
  if (std::memcmp(data, kMagic, sizeof kMagic) != 0)
    throw KvFormatError(K::bad_magic, "KV buffer has bad magic (not a DSGKV cache)");

  KvView view;
  KvHeader& h = view.header;
  h.version = load<uint32_t>(data + kOffVersion);
  if (h.version != kKvFormatVersion)
    throw KvFormatError(K::wrong_version, "KV format version " + std::to_string(h.version) +
                                              ", this build reads version " + std::to_string(kKvFormatVersion));
  // An unknown dtype or layout is an encoding this build cannot read: reported
  // with the version mismatches (the reserved field is ignored, for forward compatibility).
  const uint32_t dtype = load<uint32_t>(data + kOffDtype);
  if (dtype != uint32_t(KvDtype::f32))
    throw KvFormatError(K::wrong_version, "KV dtype " + std::to_string(dtype) + " unsupported (only 0 = float32)");
  const uint32_t layout = load<uint32_t>(data + kOffLayout);
  if (layout != uint32_t(KvLayout::layer_kv_position))
    throw KvFormatError(K::wrong_version,
                        "KV layout " + std::to_string(layout) + " unsupported (only 0 = layer, K/V, position)");
  h.dtype = KvDtype(dtype);
  h.layout = KvLayout(layout);

  h.fingerprint = load<uint64_t>(data + kOffFingerprint);
  if (h.fingerprint != expect.fingerprint)
    throw KvFormatError(K::wrong_fingerprint, "KV cache is from model " + hex(h.fingerprint) +
                                                  ", this model is " + hex(expect.fingerprint));

  KvShape& s = h.shape;
  s.n_layers = load<uint32_t>(data + kOffLayers);
  s.n_kv_heads = load<uint32_t>(data + kOffKvHeads);
  s.head_dim = load<uint32_t>(data + kOffHeadDim);
  s.n_positions = load<uint32_t>(data + kOffPositions);
  if (s.n_layers != expect.n_layers || s.n_kv_heads != expect.n_kv_heads || s.head_dim != expect.head_dim)
    throw KvFormatError(K::wrong_shape, "KV shape " + std::to_string(s.n_layers) + " layers x " +
                                            std::to_string(s.n_kv_heads) + " kv heads x " +
                                            std::to_string(s.head_dim) + " head dim, expected " +
                                            std::to_string(expect.n_layers) + " x " +
                                            std::to_string(expect.n_kv_heads) + " x " +
                                            std::to_string(expect.head_dim));
  if (s.n_positions < 1 || s.n_positions > expect.max_positions)
    throw KvFormatError(K::wrong_shape, "KV cache has " + std::to_string(s.n_positions) +
                                            " positions, expected 1 to " + std::to_string(expect.max_positions));

  const size_t expected_size = kv_buffer_bytes(s);
  if (size != expected_size)
    throw KvFormatError(K::truncated, std::string(size < expected_size ? "KV buffer truncated" : "KV buffer too long") +
                                          ": " + std::to_string(size) + " bytes, expected " +
                                          std::to_string(expected_size) + " for " + std::to_string(s.n_positions) +
                                          " positions");

  const size_t body = size - kKvTrailerBytes;
  const uint64_t stored = load<uint64_t>(data + body);
  const uint64_t computed = kv_checksum(data, body);
  if (stored != computed)
    throw KvFormatError(K::bad_checksum, "KV checksum mismatch: stored " + hex(stored) + ", computed " + hex(computed) +
                                             " (payload corrupted in transit?)");

  // The payload is read in place as floats.
  if (reinterpret_cast<uintptr_t>(data) % alignof(float) != 0)
    throw Error("parse_kv: buffer must be " + std::to_string(alignof(float)) + "-byte aligned");
  view.payload = reinterpret_cast<const float*>(data + kKvHeaderBytes);
  return view;
}

}  // namespace disagg::gpu
