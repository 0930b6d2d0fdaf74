// dp/collectives.h — collectives over the devices of a DeviceGroup, one interface for both
// backends: NCCL on cuda (ncclCommInitAll, one communicator per device), a real ring over counted
// device-to-device copies on sim (so a rank sends and receives 2(N-1)/N of a buffer per all-reduce).
#pragma once

#include <cstddef>
#include <memory>

#include "dp/device.h"
#include "dp/device_group.h"

namespace dp {

enum class ReduceOp { sum, avg };

// NCCL semantics: every rank calls the same collectives in the same order, each from its own
// worker thread, on a stream of its own device; calls are asynchronous for the host and complete
// in stream order. A rank whose peers never arrive waits (on its stream), as on a GPU — abort()
// turns such waits into errors.
class Communicator {
 public:
  static std::unique_ptr<Communicator> create(const DeviceGroup& group);
  virtual ~Communicator() = default;

  virtual int size() const = 0;
  // data (count floats on rank's device) = op over all ranks' data.
  virtual void all_reduce(int rank, const Stream& stream, float* data, std::size_t count, ReduceOp op) = 0;
  // data (bytes on each rank's device) = root's data.
  virtual void broadcast(int rank, const Stream& stream, void* data, std::size_t bytes, int root) = 0;
  // root's data = sum over all ranks' data; other ranks' data unchanged.
  virtual void reduce(int rank, const Stream& stream, float* data, std::size_t count, int root) = 0;
  // recv (size() * count floats) = the ranks' send buffers (count floats each), in rank order.
  virtual void all_gather(int rank, const Stream& stream, const float* send, float* recv, std::size_t count) = 0;
  // Fails every pending and future collective instead of letting ranks wait for absent peers.
  virtual void abort() = 0;
};

}  // namespace dp
