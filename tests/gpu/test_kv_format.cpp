// KV wire format: round trip, one test per error kind, checksum sensitivity.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "engine/kv_format.h"

namespace disagg::gpu {
namespace {

constexpr uint64_t kFingerprint = 0x1234abcd5678ef00ULL;

KvShape shape(uint32_t positions) { return KvShape{3, 2, 8, positions}; }

KvExpectation expectation() { return KvExpectation{kFingerprint, 3, 2, 8, 64}; }

std::vector<float> random_payload(const KvShape& s, uint32_t seed = 1) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(s.floats());
  for (float& f : v) f = dist(gen);
  return v;
}

std::vector<uint8_t> valid_buffer(uint32_t positions = 5) {
  const auto payload = random_payload(shape(positions));
  return serialize_kv(kFingerprint, shape(positions), payload.data());
}

template <class T>
void poke(std::vector<uint8_t>& buf, size_t offset, T value) {
  std::memcpy(buf.data() + offset, &value, sizeof value);
}

// Parses and returns the error kind, failing the test if parsing succeeds.
KvErrorKind parse_error(const std::vector<uint8_t>& buf, const KvExpectation& expect = expectation(),
                        std::string* message = nullptr) {
  try {
    parse_kv(buf.data(), buf.size(), expect);
  } catch (const KvFormatError& e) {
    if (message) *message = e.what();
    return e.kind();
  }
  ADD_FAILURE() << "parse_kv accepted a bad buffer";
  return KvErrorKind::truncated;
}

TEST(KvFormat, RoundTrip) {
  const KvShape s = shape(7);
  const auto payload = random_payload(s);
  const auto buf = serialize_kv(kFingerprint, s, payload.data());
  EXPECT_EQ(buf.size(), kKvHeaderBytes + payload.size() * sizeof(float) + kKvTrailerBytes);
  EXPECT_EQ(buf.size(), kv_buffer_bytes(s));
  EXPECT_EQ(std::memcmp(buf.data(), "DSGKV\0\0\0", 8), 0);

  const KvView view = parse_kv(buf.data(), buf.size(), expectation());
  EXPECT_EQ(view.header.version, kKvFormatVersion);
  EXPECT_EQ(view.header.dtype, KvDtype::f32);
  EXPECT_EQ(view.header.layout, KvLayout::layer_kv_position);
  EXPECT_EQ(view.header.fingerprint, kFingerprint);
  EXPECT_EQ(view.header.shape, s);
  EXPECT_EQ(view.payload, reinterpret_cast<const float*>(buf.data() + kKvHeaderBytes));  // no copy
  EXPECT_EQ(std::memcmp(view.payload, payload.data(), payload.size() * sizeof(float)), 0);
}

TEST(KvFormat, HeaderFieldsAtDocumentedOffsets) {
  const auto buf = valid_buffer(5);
  auto u32 = [&](size_t off) {
    uint32_t v;
    std::memcpy(&v, buf.data() + off, 4);
    return v;
  };
  uint64_t fp, checksum;
  std::memcpy(&fp, buf.data() + 16, 8);
  std::memcpy(&checksum, buf.data() + buf.size() - 8, 8);
  EXPECT_EQ(u32(8), kKvFormatVersion);
  EXPECT_EQ(u32(12), 0u);
  EXPECT_EQ(fp, kFingerprint);
  EXPECT_EQ(u32(24), 3u);
  EXPECT_EQ(u32(28), 2u);
  EXPECT_EQ(u32(32), 8u);
  EXPECT_EQ(u32(36), 5u);
  EXPECT_EQ(u32(40), 0u);
  EXPECT_EQ(u32(44), 0u);
  EXPECT_EQ(checksum, kv_checksum(buf.data(), buf.size() - 8));
}

TEST(KvFormat, AcceptsOnePositionAndMaxPositions) {
  const auto one = valid_buffer(1);
  EXPECT_EQ(parse_kv(one.data(), one.size(), expectation()).header.shape.n_positions, 1u);
  const auto full = valid_buffer(64);
  EXPECT_EQ(parse_kv(full.data(), full.size(), expectation()).header.shape.n_positions, 64u);
}

TEST(KvFormat, TruncatedHeader) {
  auto buf = valid_buffer();
  buf.resize(kKvHeaderBytes - 1);
  EXPECT_EQ(parse_error(buf), KvErrorKind::truncated);
  EXPECT_EQ(parse_error({}), KvErrorKind::truncated);
}

TEST(KvFormat, TruncatedPayload) {
  auto buf = valid_buffer();
  buf.pop_back();
  std::string message;
  EXPECT_EQ(parse_error(buf, expectation(), &message), KvErrorKind::truncated);
  EXPECT_NE(message.find("truncated"), std::string::npos) << message;
}

TEST(KvFormat, TooLong) {
  auto buf = valid_buffer();
  buf.push_back(0);
  std::string message;
  EXPECT_EQ(parse_error(buf, expectation(), &message), KvErrorKind::truncated);
  EXPECT_NE(message.find("too long"), std::string::npos) << message;
}

TEST(KvFormat, BadMagic) {
  auto buf = valid_buffer();
  buf[0] = 'X';
  EXPECT_EQ(parse_error(buf), KvErrorKind::bad_magic);
}

TEST(KvFormat, WrongVersion) {
  auto buf = valid_buffer();
  poke<uint32_t>(buf, 8, kKvFormatVersion + 1);
  EXPECT_EQ(parse_error(buf), KvErrorKind::wrong_version);
}

TEST(KvFormat, UnsupportedDtypeOrLayout) {
  auto buf = valid_buffer();
  poke<uint32_t>(buf, 12, 1);
  EXPECT_EQ(parse_error(buf), KvErrorKind::wrong_version);
  buf = valid_buffer();
  poke<uint32_t>(buf, 40, 1);
  EXPECT_EQ(parse_error(buf), KvErrorKind::wrong_version);
}

TEST(KvFormat, WrongFingerprint) {
  KvExpectation other = expectation();
  other.fingerprint ^= 1;
  std::string message;
  EXPECT_EQ(parse_error(valid_buffer(), other, &message), KvErrorKind::wrong_fingerprint);
  EXPECT_NE(message.find("1234abcd5678ef00"), std::string::npos) << message;
}

TEST(KvFormat, WrongShape) {
  for (auto change : {+[](KvExpectation& e) { e.n_layers = 4; }, +[](KvExpectation& e) { e.n_kv_heads = 1; },
                      +[](KvExpectation& e) { e.head_dim = 16; }, +[](KvExpectation& e) { e.max_positions = 4; }}) {
    KvExpectation e = expectation();
    change(e);
    EXPECT_EQ(parse_error(valid_buffer(5), e), KvErrorKind::wrong_shape);
  }
  // Zero positions is never a valid cache.
  auto empty = serialize_kv(kFingerprint, shape(0), nullptr);
  EXPECT_EQ(parse_error(empty), KvErrorKind::wrong_shape);
}

TEST(KvFormat, BadChecksumOnPayloadCorruption) {
  auto buf = valid_buffer();
  buf[kKvHeaderBytes + 17] ^= 0x04;
  std::string message;
  EXPECT_EQ(parse_error(buf, expectation(), &message), KvErrorKind::bad_checksum);
  EXPECT_NE(message.find("KV checksum mismatch"), std::string::npos) << message;
}

TEST(KvFormat, BadChecksumOnTrailerOrReservedCorruption) {
  auto buf = valid_buffer();
  buf.back() ^= 0x80;
  EXPECT_EQ(parse_error(buf), KvErrorKind::bad_checksum);
  buf = valid_buffer();
  poke<uint32_t>(buf, 44, 7);  // reserved is ignored, but still covered by the checksum
  EXPECT_EQ(parse_error(buf), KvErrorKind::bad_checksum);
}

TEST(KvFormat, ChecksumSeesEveryBitAndLength) {
  std::vector<uint8_t> data(77);
  for (size_t i = 0; i < data.size(); ++i) data[i] = uint8_t(i * 37 + 11);
  const uint64_t base = kv_checksum(data.data(), data.size());
  for (size_t byte = 0; byte < data.size(); ++byte)
    for (int bit = 0; bit < 8; ++bit) {
      data[byte] ^= uint8_t(1u << bit);
      ASSERT_NE(kv_checksum(data.data(), data.size()), base) << "byte " << byte << " bit " << bit;
      data[byte] ^= uint8_t(1u << bit);
    }
  // Zero padding of the tail must not make different lengths collide.
  const std::vector<uint8_t> zeros(40, 0);
  for (size_t n = 0; n < zeros.size(); ++n)
    EXPECT_NE(kv_checksum(zeros.data(), n), kv_checksum(zeros.data(), n + 1)) << n;
  // Swapping two words (even across lanes) changes it too.
  auto swapped = data;
  std::swap_ranges(swapped.begin(), swapped.begin() + 8, swapped.begin() + 8);
  EXPECT_NE(kv_checksum(swapped.data(), swapped.size()), base);
}

TEST(KvFormat, SerializeRejectsNullPayload) { EXPECT_THROW(serialize_kv(kFingerprint, shape(2), nullptr), Error); }

}  // namespace
}  // namespace disagg::gpu
