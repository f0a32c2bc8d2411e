// One process's end of the KV data plane: the UCX contexts, the receivers a
// decode node listens with, and the senders a prefill node keeps to each
// decode node it has shipped KV to. Built once per process (node runtime,
// in-process cluster) and shared by its workers' actors; CAF-free.
//
// Two transports, chosen per transfer by the receiving side:
//   tcp: UCX over TCP with peer-failure handling; works between hosts.
//   shm: UCX over posix shared memory + CMA (one copy, process_vm_readv),
//        between processes of one host only; without peer-failure handling
//        (UCX 1.13 has none for these transports: the deadlines and the
//        control plane's cancel end a transfer whose peer died).
// A decode node picks shm when the prefill node has the same host identity
// (host_identity()) and both allow it, else tcp.
#pragma once
#include <cstdint>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "kv/transfer.h"

namespace disagg::kv {

enum class Transport : uint8_t { tcp = 0, shm = 1 };
const char* to_string(Transport transport);

struct PlaneOptions {
  // Receivers: listen on this address (a decode node; empty: no receivers).
  // It must be reachable by the prefill nodes, and only by them (UCX
  // authenticates nothing: docs/kv-transfer.md, security).
  std::string listen_host;
  // Offer and use the same-host path. Off: always TCP.
  bool shared_memory = true;
  SenderOptions sender;  // for every connection this process opens
  // A connection not asked for this long is closed at the next sender()
  // call, and one that sent no piece for this long is opened anew when it is
  // the one asked for: shared memory has no
  // peer-failure detection, so one to a decode node that is gone never
  // breaks (a node started again listens on a new port, and its old address
  // is never asked for again), and our receivers close connections silent
  // for twice this (ReceiverOptions::idle_connection: a sender killed
  // without its bye), which a sender over shared memory would not learn.
  std::chrono::milliseconds idle_sender{std::chrono::minutes(10)};
};

class KvPlane {
 public:
  // Throws KvError when a context or receiver cannot be made (a bad host, a
  // UCX installation without the transports, interfaces_problem()).
  explicit KvPlane(const PlaneOptions& options);
  ~KvPlane();
  KvPlane(const KvPlane&) = delete;
  KvPlane& operator=(const KvPlane&) = delete;

  const PlaneOptions& options() const { return options_; }
  bool receiving() const { return tcp_receiver_ != nullptr; }

  // The transport a receiver here uses for a sender on `peer_host_id`.
  Transport transport_for(const std::string& peer_host_id) const;
  // The receiver of that transport (receiving() only) and its address.
  KvReceiver& receiver(Transport transport);
  std::string address(Transport transport) const;

  // The connection to the receiver at `address` over `transport`, opened on
  // first use and opened again after it broke or sat idle (idle_sender). Throws KvError when the
  // receiver cannot be reached (unreachable, timed_out). Thread-safe.
  // Each call closes the connections to other addresses idle longer than
  // options().idle_sender (a transfer using one keeps it), and opening one
  // closes the broken ones.
  std::shared_ptr<KvSender> sender(Transport transport, const std::string& address);
  size_t senders() const;  // connections kept

 private:
  PlaneOptions options_;
  std::shared_ptr<KvContext> tcp_context_, shm_context_;
  std::unique_ptr<KvReceiver> tcp_receiver_, shm_receiver_;
  mutable std::mutex senders_mu_;
  struct Kept {
    std::shared_ptr<KvSender> sender;
    std::chrono::steady_clock::time_point asked;  // when sender() last returned it
  };
  std::map<std::pair<Transport, std::string>, Kept> senders_;
};

// Why UCX could not use this process's network interfaces, or "": UCX finds
// them in /sys/class/net, and a process that entered a network namespace
// without a sysfs of that namespace sees another's there (its interfaces
// missing, or others of the same name), so a KV stream ends "Destination is
// unreachable". Checks that every interface with an address here is listed.
std::string interfaces_problem(const std::string& sys_class_net = "/sys/class/net");

// This machine's identity for choosing the same-host path: the hostname and
// the kernel's boot id. Processes in one network and PID namespace share it.
std::string host_identity();

}  // namespace disagg::kv
