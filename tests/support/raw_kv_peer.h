// A KV sender on raw UCX: what a sender of another build, or a hostile or
// stalled one, can put on the wire that ours (kv::KvSender) never does.
#pragma once
#include <ucp/api/ucp.h>

#include <memory>
#include <string>

#include "kv/transfer.h"
#include "kv/wire.h"

namespace disagg::test {

class RawKvPeer {
 public:
  // Connects to a receiver's "host:port" (with peer-failure handling).
  RawKvPeer(const std::shared_ptr<kv::KvContext>& context, const std::string& address);
  ~RawKvPeer();  // (force-closes the connection; a send left started is cancelled)
  RawKvPeer(const RawKvPeer&) = delete;
  RawKvPeer& operator=(const RawKvPeer&) = delete;

  // Sends one active message (this thread progresses the worker) and returns
  // the send's status once UCX is done with it, or UCS_INPROGRESS at `until`.
  ucs_status_t send(unsigned id, const kv::PieceHeader& header, const void* data, size_t bytes, uint32_t flags,
                    kv::Deadline until);

  // Starts a piece as a rendezvous and never progresses it: the receiver
  // gets its announcement and starts the receive, whose data never comes
  // (a sender that stalls mid-piece). Call send() first: the connection must
  // be up. At most one at a time; cancelled by the destructor.
  void start_stalled(const kv::PieceHeader& header, const void* data, size_t bytes);

 private:
  ucs_status_t finish(ucs_status_ptr_t request, kv::Deadline until);

  std::shared_ptr<kv::KvContext> context_;  // (first: it outlives the worker)
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  ucs_status_ptr_t stalled_ = nullptr;
};

}  // namespace disagg::test
