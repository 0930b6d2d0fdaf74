// nccl_communicator.cpp — the cuda communicator: one NCCL communicator per device of the group;
// each rank's worker thread issues only on its own communicator and stream. In one process,
// ncclCommInitAll; across processes, process 0 makes the unique id, the process group (MPI)
// broadcasts it, and each process initialises its local ranks inside one NCCL group call.
#include <atomic>
#include <chrono>
#include <exception>
#include <fmt/format.h>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "backend.h"
#include "device_scope.h"
#include "dp/runtime/detail/cuda_status.h"

namespace dp::detail {
namespace {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const DeviceGroup& group, ProcessGroup& processes)
      : group_(group),
        comms_(static_cast<std::size_t>(group.size())),
        world_(group.size() * processes.size()),
        first_(group.size() * processes.rank()) {
    std::vector<ncclComm_t> comms(static_cast<std::size_t>(group.size()), nullptr);
    init(comms, processes);
    for (std::size_t r = 0; r < comms.size(); ++r) comms_[r].store(comms[r]);
  }
  ~NcclCommunicator() override {
    for (auto& slot : comms_)
      if (ncclComm_t comm = slot.exchange(nullptr)) ncclCommDestroy(comm);  // never throws from a destructor
  }

  int size() const override { return world_; }
  int local_size() const override { return group_.size(); }
  int first_rank() const override { return first_; }

  void all_reduce(int rank, const Stream& stream, float* data, std::size_t count, ReduceOp op) override {
    const StreamSpan span(Access::stream(stream), "all_reduce", SpanKind::collective);
    const std::shared_lock issuing(issuing_);
    DP_CUDA_CHECK(ncclAllReduce(data, data, count, ncclFloat32, op == ReduceOp::avg ? ncclAvg : ncclSum, comm(rank),
                                native(rank, stream)));
  }
  void all_reduce_bf16(int rank, const Stream& stream, std::uint16_t* data, std::size_t count) override {
    const StreamSpan span(Access::stream(stream), "all_reduce", SpanKind::collective);
    const std::shared_lock issuing(issuing_);
    DP_CUDA_CHECK(ncclAllReduce(data, data, count, ncclBfloat16, ncclSum, comm(rank), native(rank, stream)));
  }
  void broadcast(int rank, const Stream& stream, void* data, std::size_t bytes, int root) override {
    const StreamSpan span(Access::stream(stream), "broadcast", SpanKind::collective);
    const std::shared_lock issuing(issuing_);
    DP_CUDA_CHECK(ncclBroadcast(data, data, bytes, ncclUint8, root, comm(rank), native(rank, stream)));
  }
  void reduce(int rank, const Stream& stream, float* data, std::size_t count, int root) override {
    // In place on the root; other ranks' buffers are only read.
    const StreamSpan span(Access::stream(stream), "reduce", SpanKind::collective);
    const std::shared_lock issuing(issuing_);
    DP_CUDA_CHECK(ncclReduce(data, data, count, ncclFloat32, ncclSum, root, comm(rank), native(rank, stream)));
  }
  void all_gather(int rank, const Stream& stream, const float* send, float* recv, std::size_t count) override {
    const StreamSpan span(Access::stream(stream), "all_gather", SpanKind::collective);
    const std::shared_lock issuing(issuing_);
    DP_CUDA_CHECK(ncclAllGather(send, recv, count, ncclFloat32, comm(rank), native(rank, stream)));
  }
  // A reduce to each block's owner (or a broadcast from it) per block, aggregated into one NCCL
  // launch by a group (NCCL's "aggregated operations"): one launch per bucket, as its all-reduce.
  void reduce_scatter(int rank, const Stream& stream, float* data, std::size_t count) override {
    const StreamSpan span(Access::stream(stream), "reduce_scatter", SpanKind::collective);
    const std::shared_lock issuing(issuing_);
    const ncclComm_t c = comm(rank);
    const cudaStream_t s = native(rank, stream);
    const Group group;
    for_each_owned_block(count, world_, [&](int owner, BlockRange block) {
      DP_CUDA_CHECK(
          ncclReduce(data + block.begin, data + block.begin, block.size(), ncclFloat32, ncclSum, owner, c, s));
    });
  }
  void all_gather_blocks(int rank, const Stream& stream, float* data, std::size_t count) override {
    const StreamSpan span(Access::stream(stream), "all_gather_blocks", SpanKind::collective);
    const std::shared_lock issuing(issuing_);
    const ncclComm_t c = comm(rank);
    const cudaStream_t s = native(rank, stream);
    const Group group;
    for_each_owned_block(count, world_, [&](int owner, BlockRange block) {
      DP_CUDA_CHECK(ncclBroadcast(data + block.begin, data + block.begin, block.size(), ncclFloat32, owner, c, s));
    });
  }
  // Any thread may abort while the ranks' workers issue collectives (a failing rank aborts at once):
  // each communicator is taken out of its slot atomically, so it is aborted exactly once and a
  // worker sees either it or null (then its collective fails with "aborted"). A worker holds the
  // communicator only while its call enqueues (`issuing_`, shared): ncclCommAbort frees it, so it
  // waits for calls in progress to return first. Enqueueing normally returns at once (the kernels
  // that wait for peers are what the abort stops); a call stuck on the host (a connection set up
  // lazily with a peer that died) is given a few seconds, then aborted under it.
  void abort() override {
    std::unique_lock no_call_in_progress(issuing_, std::defer_lock);
    (void)no_call_in_progress.try_lock_for(std::chrono::seconds(5));
    for (auto& slot : comms_)
      if (ncclComm_t comm = slot.exchange(nullptr)) ncclCommAbort(comm);
  }

 private:
  // ncclGroupStart, and its ncclGroupEnd also when a call inside fails (the group is then ended
  // before the failure propagates; its own error, if any, is the first one's consequence).
  struct Group {
    Group() { DP_CUDA_CHECK(ncclGroupStart()); }
    ~Group() noexcept(false) {
      const ncclResult_t ended = ncclGroupEnd();
      if (std::uncaught_exceptions() == 0) DP_CUDA_CHECK(ended);
    }
    Group(const Group&) = delete;
    Group& operator=(const Group&) = delete;
  };

  void init(std::vector<ncclComm_t>& comms, ProcessGroup& processes) {
    const auto& group = group_;
    const DeviceRestore restore;  // initialisation switches devices; the caller's is kept
    // NCCL names GPUs, not dp devices (several dp devices may share a GPU: RuntimeOptions::
    // devices_per_gpu; a group whose devices share one takes the device ring instead).
    std::vector<int> gpus;
    for (int r = 0; r < group.size(); ++r) gpus.push_back(group.device(r).gpu());
    if (processes.size() == 1) {
      DP_CUDA_CHECK(ncclCommInitAll(comms.data(), group.size(), gpus.data()));
      return;
    }
    // Communicator::create has checked the processes: the same number of GPUs each, no GPU in two.
    ncclUniqueId id{};
    if (processes.rank() == 0) DP_CUDA_CHECK(ncclGetUniqueId(&id));
    processes.broadcast_bytes(&id, sizeof(id), 0);
    DP_CUDA_CHECK(ncclGroupStart());
    for (int r = 0; r < group.size(); ++r) {
      DP_CUDA_CHECK(cudaSetDevice(gpus[static_cast<std::size_t>(r)]));
      DP_CUDA_CHECK(ncclCommInitRank(&comms[static_cast<std::size_t>(r)], world_, id, first_ + r));
    }
    DP_CUDA_CHECK(ncclGroupEnd());
  }

  ncclComm_t comm(int rank) const {
    ncclComm_t c = comms_.at(static_cast<std::size_t>(rank)).load();
    if (!c) throw CollectiveAborted(fmt::format("NCCL communicator of rank {} was aborted", rank));
    return c;
  }
  cudaStream_t native(int rank, const Stream& stream) const {
    if (stream.device() != group_.device_ids()[static_cast<std::size_t>(rank)])
      throw DeviceMismatch(fmt::format("collective for rank {} (device {}) issued on a stream of device {}", rank,
                                       group_.device_ids()[static_cast<std::size_t>(rank)], stream.device()));
    StreamImpl& impl = Access::stream(stream);
    impl.count(Counter::launches);  // every caller issues one collective on it
    return static_cast<cudaStream_t>(impl.native_handle());
  }

  const DeviceGroup& group_;
  std::shared_timed_mutex issuing_;  // shared by each call while it uses a communicator; abort takes it
  std::vector<std::atomic<ncclComm_t>> comms_;
  int world_, first_;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const DeviceGroup& group,
                                                     std::shared_ptr<ProcessGroup> processes) {
  return std::make_unique<NcclCommunicator>(group, *processes);
}

}  // namespace dp::detail
