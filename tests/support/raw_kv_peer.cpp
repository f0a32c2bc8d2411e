#include "support/raw_kv_peer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <stdexcept>

namespace disagg::test {

RawKvPeer::RawKvPeer(const std::shared_ptr<kv::KvContext>& context, const std::string& address) : context_(context) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (ucp_worker_create(context->native(), &wp, &worker_) != UCS_OK) throw std::runtime_error("ucp_worker_create");
  const size_t colon = address.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep_params.sockaddr.addr = reinterpret_cast<const sockaddr*>(&a);
  ep_params.sockaddr.addrlen = sizeof a;
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  if (ucp_ep_create(worker_, &ep_params, &ep_) != UCS_OK) throw std::runtime_error("ucp_ep_create");
}

RawKvPeer::~RawKvPeer() {
  const kv::Deadline soon = kv::Clock::now() + std::chrono::seconds(5);
  if (stalled_ != nullptr) {
    ucp_request_cancel(worker_, stalled_);
    ucp_request_free(stalled_);
  }
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  finish(ucp_ep_close_nbx(ep_, &param), soon);
  ucp_worker_destroy(worker_);
}

ucs_status_t RawKvPeer::send(unsigned id, const kv::PieceHeader& header, const void* data, size_t bytes,
                             uint32_t flags, kv::Deadline until) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = flags;
  return finish(ucp_am_send_nbx(ep_, id, &header, sizeof header, data, bytes, &param), until);
}

void RawKvPeer::start_stalled(const kv::PieceHeader& header, const void* data, size_t bytes) {
  if (stalled_ != nullptr) throw std::logic_error("a stalled piece is out already");
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t request = ucp_am_send_nbx(ep_, kv::wire::kPiece, &header, sizeof header, data, bytes, &param);
  if (!UCS_PTR_IS_PTR(request)) throw std::runtime_error("a rendezvous send that did not stay in progress");
  stalled_ = request;
}

ucs_status_t RawKvPeer::finish(ucs_status_ptr_t request, kv::Deadline until) {
  if (request == nullptr) return UCS_OK;
  if (UCS_PTR_IS_ERR(request)) return UCS_PTR_STATUS(request);
  ucs_status_t status = UCS_INPROGRESS;
  while ((status = ucp_request_check_status(request)) == UCS_INPROGRESS && kv::Clock::now() < until) {
    ucp_worker_progress(worker_);
  }
  if (status == UCS_INPROGRESS) ucp_request_cancel(worker_, request);
  ucp_request_free(request);
  return status;
}

}  // namespace disagg::test
