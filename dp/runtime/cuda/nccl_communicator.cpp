// nccl_communicator.cpp — the cuda communicator: ncclCommInitAll creates one communicator per
// device of the group; each rank's worker thread issues only on its own communicator and stream.
#include <fmt/format.h>
#include <vector>

#include "backend.h"
#include "dp/runtime/cuda_status.h"

namespace dp::detail {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(const DeviceGroup& group) : group_(group), comms_(static_cast<std::size_t>(group.size())) {
    DP_CUDA_CHECK(ncclCommInitAll(comms_.data(), group.size(), group.device_ids().data()));
  }
  ~NcclCommunicator() override {
    for (ncclComm_t comm : comms_)
      if (comm) ncclCommDestroy(comm);  // never throws from a destructor
  }
  int size() const override { return group_.size(); }

  void all_reduce(int rank, const Stream& stream, float* data, std::size_t count, ReduceOp op) override {
    DP_CUDA_CHECK(ncclAllReduce(data, data, count, ncclFloat32, op == ReduceOp::avg ? ncclAvg : ncclSum, comm(rank),
                                native(rank, stream)));
  }
  void broadcast(int rank, const Stream& stream, void* data, std::size_t bytes, int root) override {
    DP_CUDA_CHECK(ncclBroadcast(data, data, bytes, ncclUint8, root, comm(rank), native(rank, stream)));
  }
  void reduce(int rank, const Stream& stream, float* data, std::size_t count, int root) override {
    // In place on the root; other ranks' buffers are only read.
    DP_CUDA_CHECK(ncclReduce(data, data, count, ncclFloat32, ncclSum, root, comm(rank), native(rank, stream)));
  }
  void all_gather(int rank, const Stream& stream, const float* send, float* recv, std::size_t count) override {
    DP_CUDA_CHECK(ncclAllGather(send, recv, count, ncclFloat32, comm(rank), native(rank, stream)));
  }
  void abort() override {
    for (ncclComm_t& comm : comms_)
      if (comm) {
        ncclCommAbort(comm);
        comm = nullptr;
      }
  }

 private:
  ncclComm_t comm(int rank) const {
    ncclComm_t c = comms_.at(static_cast<std::size_t>(rank));
    if (!c) throw Error(fmt::format("NCCL communicator of rank {} was aborted", rank));
    return c;
  }
  cudaStream_t native(int rank, const Stream& stream) const {
    if (stream.device() != group_.device_ids()[static_cast<std::size_t>(rank)])
      throw DeviceMismatch(fmt::format("collective for rank {} (device {}) issued on a stream of device {}", rank,
                                       group_.device_ids()[static_cast<std::size_t>(rank)], stream.device()));
    return static_cast<cudaStream_t>(Access::stream(stream).native_handle());
  }

  const DeviceGroup& group_;
  std::vector<ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const DeviceGroup& group) {
  return std::make_unique<NcclCommunicator>(group);
}

}  // namespace dp::detail
