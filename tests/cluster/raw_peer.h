// A peer that speaks to a node's port byte by byte, as a stranger would: raw
// loopback TCP connections (from any 127.0.0.0/8 address), BASP headers made
// by hand, and a real client's handshake recorded for replay.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace disagg::test {

// A loopback TCP connection to 127.0.0.1:`port`, bound to `from` (another
// loopback address is another source to the node), or -1.
int connect_to(uint16_t port, const std::string& from = "127.0.0.1");

// A socket listening on a free port of 127.0.0.1 that accepts nothing (the
// kernel completes connections into its backlog), or -1; `port` is set.
int listen_on_loopback(uint16_t& port, int backlog = 16);

// The 32-byte BASP header of CAF 0.17 (caf/io/basp/header.hpp: operation,
// 2 padding bytes, flags, payload_len, operation_data, source and
// destination actor; big-endian) announcing `payload` bytes; operation 0x01
// is a client handshake. A plain CAF port accepts it as valid and sizes its
// read buffer to the announced payload before reading a byte of it.
std::string basp_header(uint32_t payload, uint8_t operation = 0x01);

// Sends `bytes` on `fd`; true when all went out.
bool send_all(int fd, const std::string& bytes);

// Whether the peer closed `fd` (EOF or reset) within `timeout`; what it sent
// before is discarded (a TLS alert, a BASP handshake).
bool closed_by_peer(int fd, std::chrono::milliseconds timeout);

// The bytes of a real client's first BASP message (its handshake) to the
// router at `router_port`: `disagg-client --status` runs through a relay
// that records them. Empty when that failed.
std::string record_client_handshake(uint16_t router_port);

}  // namespace disagg::test
