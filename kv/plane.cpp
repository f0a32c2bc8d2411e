#include "kv/plane.h"

#include <ifaddrs.h>
#include <sys/stat.h>
#include <unistd.h>

#include <iterator>
#include <set>

#include <climits>
#include <fstream>

namespace disagg::kv {

namespace {

// UCX_TLS of the same-host context: the data takes posix shared memory and
// CMA; tcp is there for UCX's client-server handshake only (without it the
// connection never completes; docs/kv-transfer.md, transports).
constexpr const char* kSharedMemoryTransports = "posix,cma,tcp";
constexpr const char* kNetworkTransports = "tcp";

}  // namespace

const char* to_string(Transport transport) { return transport == Transport::shm ? "shm" : "tcp"; }

std::string interfaces_problem(const std::string& sys_class_net) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};  // (nothing to compare: UCX will say what it finds)
  std::set<std::string> named;
  for (ifaddrs* a = list; a; a = a->ifa_next)
    if (a->ifa_addr && (a->ifa_addr->sa_family == AF_INET || a->ifa_addr->sa_family == AF_INET6)) named.insert(a->ifa_name);
  ::freeifaddrs(list);
  for (const std::string& name : named) {
    struct stat st {};
    if (::stat((sys_class_net + "/" + name).c_str(), &st) != 0)
      return "this process's network interface " + name + " is not in " + sys_class_net +
             ", where UCX looks for interfaces: that /sys belongs to another network namespace (a process entered "
             "this one without its own sysfs, as `nsenter --net` leaves it; `ip netns exec` mounts one), so the KV "
             "data plane could not use " + name;
  }
  return {};
}

KvPlane::KvPlane(const PlaneOptions& options) : options_(options) {
  if (const std::string problem = interfaces_problem(); !problem.empty()) throw KvError(KvErrc::ucx_error, problem);
  ContextOptions tcp;
  tcp.transports = kNetworkTransports;
  tcp.peer_failure_detection = true;
  tcp_context_ = KvContext::create(tcp);
  if (options_.shared_memory) {
    ContextOptions shm;
    shm.transports = kSharedMemoryTransports;
    shm.peer_failure_detection = false;
    shm_context_ = KvContext::create(shm);
  }
  if (!options_.listen_host.empty()) {
    ReceiverOptions listen;
    listen.host = options_.listen_host;
    listen.idle_connection = 2 * options_.idle_sender;  // (closed after our senders open a new one)
    tcp_receiver_ = std::make_unique<KvReceiver>(tcp_context_, listen);
    if (shm_context_) shm_receiver_ = std::make_unique<KvReceiver>(shm_context_, listen);
  }
}

KvPlane::~KvPlane() {
  // Senders first (they flush and say bye), then the receivers.
  senders_.clear();
  shm_receiver_.reset();
  tcp_receiver_.reset();
}

Transport KvPlane::transport_for(const std::string& peer_host_id) const {
  return shm_receiver_ && !peer_host_id.empty() && peer_host_id == host_identity() ? Transport::shm
                                                                                    : Transport::tcp;
}

KvReceiver& KvPlane::receiver(Transport transport) {
  KvReceiver* r = transport == Transport::shm ? shm_receiver_.get() : tcp_receiver_.get();
  if (!r) throw KvError(KvErrc::invalid_argument, std::string("this node has no ") + to_string(transport) + " KV receiver");
  return *r;
}

std::string KvPlane::address(Transport transport) const {
  const KvReceiver* r = transport == Transport::shm ? shm_receiver_.get() : tcp_receiver_.get();
  return r ? r->address() : std::string();
}

std::shared_ptr<KvSender> KvPlane::sender(Transport transport, const std::string& address) {
  const auto context = transport == Transport::shm ? shm_context_ : tcp_context_;
  if (!context)
    throw KvError(KvErrc::invalid_argument, "shared-memory KV transfers are off on this node (kv-shared-memory)");
  std::lock_guard<std::mutex> lock(senders_mu_);
  const std::pair<Transport, std::string> key{transport, address};
  const auto now = std::chrono::steady_clock::now();
  Kept& slot = senders_[key];
  // One that sent no piece within idle_sender is opened anew: a receiver
  // closes connections silent for twice that (ReceiverOptions::idle_connection,
  // counted from the last piece it got), and over shared memory we would not
  // learn that it did.
  const bool stale = slot.sender && now - slot.sender->last_sent() >= options_.idle_sender;
  const bool opening = !slot.sender || !slot.sender->connected() || stale;
  if (opening) slot.sender.reset();  // (a broken connection is closed before its replacement opens)
  // Connections to other addresses go when idle, at every call, and when
  // broken, at an opening: a decode node started again listens on a new
  // port, and its old address is never asked for again (the soak found 6-9
  // file descriptors left per restart; over shared memory a connection to it
  // never breaks).
  for (auto it = senders_.begin(); it != senders_.end();) {
    const Kept& other = it->second;
    const bool idle = other.sender && now - other.asked >= options_.idle_sender;
    const bool broken = opening && other.sender && !other.sender->connected();
    it = it->first != key && (idle || broken) ? senders_.erase(it) : std::next(it);
  }
  if (opening) {
    try {
      slot.sender = std::make_shared<KvSender>(context, address, options_.sender);
    } catch (...) {
      senders_.erase(key);  // (an unreachable address leaves no empty entry behind)
      throw;
    }
  }
  slot.asked = now;
  return slot.sender;
}

size_t KvPlane::senders() const {
  std::lock_guard<std::mutex> lock(senders_mu_);
  return senders_.size();
}

std::string host_identity() {
  static const std::string id = [] {
    char name[HOST_NAME_MAX + 1] = {};
    ::gethostname(name, sizeof name - 1);
    std::string boot;
    std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
    return std::string(name) + "/" + boot;
  }();
  return id;
}

}  // namespace disagg::kv
