// replicas.cpp — the model on each device of a group.
#include "replicas.h"

#include <fmt/format.h>

#include "dp/runtime/error.h"

namespace dp::engines {

Replicas::Replicas(Model& module, const DeviceGroup& group) : module_(module) {
  const int source = group.device_ids()[0];
  if (module.device().index() != source)
    throw InvalidArgument(
        fmt::format("module must have its parameters and buffers on device_ids[0] (device {}) "
                    "but they are on device {}",
                    source, module.device().index()));
  owned_.resize(static_cast<std::size_t>(group.size()));
  for (int rank = 1; rank < group.size(); ++rank)
    owned_[static_cast<std::size_t>(rank)] = module.replicate(group.device(rank));
}

}  // namespace dp::engines
