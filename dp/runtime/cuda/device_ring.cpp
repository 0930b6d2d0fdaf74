// device_ring.cpp — the communicator of dp devices that share one GPU (RuntimeOptions::
// devices_per_gpu): NCCL refuses two ranks on one GPU, so each call is one kernel per rank
// (device_ring.cu) running the sim ring's algorithm, and the results equal the sim ring's bit for
// bit. Each rank's worker issues only on its own stream; the kernels meet through flags in device
// memory, so a rank's part of a step can be captured into its own graph, as NCCL's can.
#include "device_ring.h"

#include <atomic>
#include <fmt/format.h>
#include <vector>

#include "backend.h"
#include "device_scope.h"
#include "dp/runtime/detail/cuda_status.h"
#include "launch_group.h"

namespace dp::detail {
namespace {

// Note [rings and lazy loading]
// A ring kernel spins until its peers' kernels arrive, launched by other workers. With lazy module
// loading (the default since CUDA 12.2) a kernel's first launch may need a context synchronization
// to load it, and that would wait for the spinning kernel: a deadlock if a peer's part of the call
// were still to be launched behind it (CUDA Programming Guide, "Lazy Loading", Potential Hazards).
// The ranks' parts of a call are launched together (Note [implicit synchronization],
// launch_group.h), so every kernel a ring kernel waits for was launched before it and a context
// synchronization only waits for work that ends; and the ring kernel itself is preloaded here
// (ring::preload). Lazy loading stays on, as the driver's default and PyTorch's (eager loading
// would load every cuDNN and cuBLAS kernel at start-up).

class DeviceRingCommunicator final : public Communicator {
 public:
  explicit DeviceRingCommunicator(const DeviceGroup& group)
      : group_(group),
        gpu_(group.device(0).gpu()),
        ranks_(static_cast<std::size_t>(group.size())),
        calls_(std::make_shared<LaunchGroup>(group.size())),
        replays_(std::make_shared<LaunchGroup>(group.size())) {
    if (group.size() > ring::kMaxRanks)
      throw InvalidArgument(
          fmt::format("the device ring takes at most {} ranks, got {}", ring::kMaxRanks, group.size()));
    for (int r = 0; r < group.size(); ++r)
      if (group.device(r).gpu() != gpu_)
        throw InvalidArgument(fmt::format(
            "devices {} and {} run on GPUs {} and {}: a group whose devices share GPUs must lie on one GPU (use "
            "devices_per_gpu = 1 across GPUs, where NCCL connects them)",
            group.device_ids()[0], group.device_ids()[static_cast<std::size_t>(r)], gpu_, group.device(r).gpu()));
    // Never a device-wide synchronization here or in the destructor: another thread may be
    // capturing on this GPU (cudaDeviceSynchronize would invalidate it), and other rings' kernels
    // may be spinning for peers whose workers are about to launch. The flags are zeroed on a
    // stream of the ring's own, which is waited for alone.
    const DeviceScope scope(gpu_);
    DP_CUDA_CHECK(ring::preload());
    DP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    {
      const std::lock_guard serial(implicit_sync_mutex());  // Note [implicit synchronization]
      DP_CUDA_CHECK(cudaMalloc(&shared_, sizeof(ring::Shared)));
      DP_CUDA_CHECK(cudaMemsetAsync(shared_, 0, sizeof(ring::Shared), stream_));
      DP_CUDA_CHECK(cudaHostAlloc(&aborted_host_, sizeof(int), cudaHostAllocMapped));
    }
    *aborted_host_ = 0;
    void* device_view = nullptr;
    DP_CUDA_CHECK(cudaHostGetDevicePointer(&device_view, aborted_host_, 0));
    aborted_device_ = static_cast<const volatile int*>(device_view);
    DP_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the zeroed flags before any rank's first call
  }
  ~DeviceRingCommunicator() override {
    abort();  // kernels still waiting for peers that will not come end now
    try {
      const DeviceScope scope(gpu_);
      // None of this communicator's kernels still reads its memory once each rank's last stream is
      // done (a capturing one holds no launched kernel: its calls run only when replayed).
      for (Rank& rank : ranks_)
        if (rank.last.valid() && !rank.last.capturing()) rank.last.synchronize();
      cudaFree(shared_);  // waits for the GPU: not under the lock (Note [implicit synchronization])
      cudaFreeHost(aborted_host_);
      if (stream_) cudaStreamDestroy(stream_);
      (void)cudaGetLastError();  // reported nowhere: read out (See Note [last error], backend.h)
    } catch (...) {              // never throws from a destructor
    }
  }

  int size() const override { return group_.size(); }
  int local_size() const override { return group_.size(); }
  int first_rank() const override { return 0; }

  void all_reduce(int rank, const Stream& stream, float* data, std::size_t count, ReduceOp op) override {
    launch(stream, "all_reduce",
           {op == ReduceOp::avg ? ring::Op::all_reduce_avg : ring::Op::all_reduce_sum, rank, size(), 0, data, nullptr,
            count});
  }
  void all_reduce_bf16(int rank, const Stream& stream, std::uint16_t* data, std::size_t count) override {
    launch(stream, "all_reduce", {ring::Op::all_reduce_bf16, rank, size(), 0, data, nullptr, count});
  }
  void broadcast(int rank, const Stream& stream, void* data, std::size_t bytes, int root) override {
    check_root(root);
    launch(stream, "broadcast", {ring::Op::broadcast, rank, size(), root, data, nullptr, bytes});
  }
  void reduce(int rank, const Stream& stream, float* data, std::size_t count, int root) override {
    check_root(root);
    launch(stream, "reduce", {ring::Op::reduce, rank, size(), root, data, nullptr, count});
  }
  void all_gather(int rank, const Stream& stream, const float* send, float* recv, std::size_t count) override {
    launch(stream, "all_gather", {ring::Op::all_gather, rank, size(), 0, recv, send, count});
  }
  void abort() override {
    if (aborted_host_) *static_cast<volatile int*>(aborted_host_) = 1;
    aborted_.store(true);
    calls_->abort();
    replays_->abort();
  }

 private:
  void check_root(int root) const {
    if (root < 0 || root >= size()) throw InvalidArgument(fmt::format("collective root {} of {} ranks", root, size()));
  }
  void launch(const Stream& stream, const char* name, const ring::Call& call) {
    if (aborted_.load()) throw CollectiveAborted(fmt::format("{}: communicator was aborted", name));
    if (call.rank < 0 || call.rank >= size())
      throw InvalidArgument(fmt::format("{}: local rank {} of {}", name, call.rank, size()));
    if (stream.device() != group_.device_ids()[static_cast<std::size_t>(call.rank)])
      throw DeviceMismatch(fmt::format("{}: rank {} is device {} but the stream is on device {}", name, call.rank,
                                       group_.device_ids()[static_cast<std::size_t>(call.rank)], stream.device()));
    StreamImpl& impl = Access::stream(stream);
    order_after_last_call(call.rank, stream);
    impl.count(Counter::launches);
    const StreamSpan span(impl, name, SpanKind::collective);
    const DeviceScope scope(gpu_);
    const auto native = static_cast<cudaStream_t>(impl.native_handle());
    if (stream.capturing()) {
      // Nothing runs until the graph is replayed, and then with the other ranks' replays.
      DP_CUDA_CHECK(ring::launch(call, shared_, aborted_device_, native));
      note_captured_ring_call({replays_, call.rank});
    } else {
      // With the other ranks' parts (Note [implicit synchronization]); the launcher may be another
      // rank's worker, and every rank's stream is on this GPU.
      DP_CUDA_CHECK(calls_->arrive(
          call.rank, [this, call, native] { return ring::launch(call, shared_, aborted_device_, native); }, name));
    }
    Rank& rank = ranks_[static_cast<std::size_t>(call.rank)];
    rank.last = stream;
    if (!stream.capturing()) stream.record(rank.done);
  }
  // A rank's calls run one at a time, in the order it made them (each reads the barrier count the
  // last one left): a call on another stream than the rank's last waits for that one. Inside a
  // capture the engine orders them itself (DDP's streams wait on each other's events).
  void order_after_last_call(int r, const Stream& stream) {
    Rank& rank = ranks_[static_cast<std::size_t>(r)];
    if (!rank.done.valid()) rank.done = group_.device(r).create_event();
    if (rank.last.valid() && !stream.capturing() && !rank.last.capturing() &&
        Access::stream(rank.last).native_handle() != Access::stream(stream).native_handle())
      stream.wait(rank.done);
  }

  struct Rank {
    Stream last;  // the stream of the rank's last call
    Event done;   // recorded behind it (outside captures)
  };
  const DeviceGroup& group_;
  int gpu_;
  std::vector<Rank> ranks_;
  std::shared_ptr<LaunchGroup> calls_;    // eager calls
  std::shared_ptr<LaunchGroup> replays_;  // replays of graphs holding calls (kept alive by the graphs)
  cudaStream_t stream_ = nullptr;         // zeroes the flags
  ring::Shared* shared_ = nullptr;
  int* aborted_host_ = nullptr;  // mapped pinned memory: the host ends the kernels' waits
  const volatile int* aborted_device_ = nullptr;
  std::atomic<bool> aborted_{false};
};

}  // namespace

std::unique_ptr<Communicator> make_device_ring_communicator(const DeviceGroup& group,
                                                            std::shared_ptr<ProcessGroup> processes) {
  if (processes && processes->size() > 1)
    throw InvalidArgument(
        fmt::format("devices that share a GPU (devices_per_gpu > 1) run in one process; this job has {} processes",
                    processes->size()));
  return std::make_unique<DeviceRingCommunicator>(group);
}

}  // namespace dp::detail
