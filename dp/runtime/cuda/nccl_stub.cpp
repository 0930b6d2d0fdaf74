// nccl_stub.cpp — builds without the cuda backend have no NCCL communicator.
#include "backend.h"

namespace dp::detail {

std::unique_ptr<Communicator> make_nccl_communicator(const DeviceGroup&, std::shared_ptr<ProcessGroup>) {
  throw Error("NCCL communicator requested, but dp was built without the cuda backend");
}

std::unique_ptr<Communicator> make_device_ring_communicator(const DeviceGroup&, std::shared_ptr<ProcessGroup>) {
  throw Error("device ring communicator requested, but dp was built without the cuda backend");
}

}  // namespace dp::detail
