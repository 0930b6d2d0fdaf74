// replicas.h — the model on each device of a group: rank 0 is the module itself, the others are
// replicas whose values the engine broadcasts.
#pragma once

#include <memory>
#include <vector>

#include "dp/nn/model.h"
#include "dp/runtime/device_group.h"

namespace dp::engines {

// The model on each device of `group`: rank 0 is `module` itself (it must live on device_ids[0],
// else InvalidArgument), the others are replicas whose values the engine broadcasts.
class Replicas {
 public:
  Replicas(Model& module, const DeviceGroup& group);
  Model& operator[](int rank) const { return rank == 0 ? module_ : *owned_[static_cast<std::size_t>(rank)]; }

 private:
  Model& module_;
  std::vector<std::unique_ptr<Model>> owned_;  // [0] stays empty
};

}  // namespace dp::engines
