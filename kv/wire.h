// What a KvSender and a KvReceiver say to each other: UCX active messages
// (AM) whose user header is one of the fixed-size structs below and, for a
// piece, whose data is the piece's bytes.
//
//   sender                          receiver
//   hello        ------------------>            (on connect: magic + version)
//                <------------------ hello_ack  (same; the connection is usable)
//   piece [hdr + bytes] ----------->            (any number, any order)
//                <------------------ verdict    (once per transfer and source:
//                                                complete or why it failed; also
//                                                for a piece of a transfer the
//                                                receiver does not expect)
//   bye          ------------------>            (before the sender closes: the
//                                                receiver closes its side too,
//                                                while the sender still answers)
//
// Both ends run the same build on little-endian hosts (checked below), so the
// structs travel as they are in memory; the magic and version catch a peer
// from another build or something that is not a KV sender at all.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace disagg::kv {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the KV wire structs assume a little-endian host");

namespace wire {

constexpr uint32_t kMagic = 0x564b4744;  // "DGKV" read as little-endian bytes
constexpr uint16_t kVersion = 1;

// UCP active-message ids, one handler each on the receiving worker.
enum AmId : unsigned { kHello = 1, kHelloAck = 2, kPiece = 3, kVerdict = 4, kBye = 5 };

struct HelloHeader {  // also the bye
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t reserved = 0;
};

}  // namespace wire

// The header in front of every piece. The receiver checks every field before
// a byte lands: the transfer must be expected, [offset, offset + length) must
// lie in its memory and overlap nothing received before, and the bytes must
// hash to `checksum` (see piece_checksum).
struct PieceHeader {
  uint32_t magic = wire::kMagic;
  uint16_t version = wire::kVersion;
  uint16_t reserved = 0;
  uint64_t transfer_id = 0;
  uint32_t piece_index = 0;  // the sender's numbering, echoed in errors
  uint32_t reserved2 = 0;
  uint64_t offset = 0;       // where the piece goes in the transfer's byte space
  uint64_t length = 0;       // equals the AM's data length
  uint64_t checksum = 0;     // piece_checksum(bytes, length, offset)
};
static_assert(sizeof(PieceHeader) == 48, "PieceHeader is a wire format");

namespace wire {

struct VerdictHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint8_t status = 0;        // a TransferStatus
  uint8_t reserved = 0;
  uint64_t transfer_id = 0;
  uint64_t bytes_received = 0;
  uint32_t piece_index = 0;  // the piece that failed it, when one did
  uint32_t has_piece = 0;    // 1: piece_index is meaningful
};
static_assert(sizeof(VerdictHeader) == 32, "VerdictHeader is a wire format");

// A hello or verdict header from an active message's header bytes: true when
// it has H's size, this magic and this version (anything else is another
// build, or not a KV peer, and is ignored).
template <class H>
bool read_header(const void* data, size_t length, H* out) {
  if (length != sizeof(H)) return false;
  std::memcpy(out, data, sizeof(H));
  return out->magic == kMagic && out->version == kVersion;
}

}  // namespace wire

// The checksum of a piece: xxHash's 64-bit XXH3 of its bytes, seeded with the
// piece's offset so that a correct piece written at the wrong place fails too.
// It guards against corruption and framing bugs, not against an attacker.
// (XXH3 rather than XXH64: the same value on every CPU, and with AVX2 about
// twice XXH64's speed; both ends hash every byte, kv/checksum.cpp.)
uint64_t piece_checksum(const void* data, size_t bytes, uint64_t offset);

}  // namespace disagg::kv
